"""TRL's side of a study against TRL (studies/vs_trl.py, studies/dpo_vs_trl.py): the Trainer settings both studies
align with the recipe's, and the LoRA adapter, from a study's settings ``s``."""

from __future__ import annotations


def trainer_arguments(s: dict, output_dir, *, bf16: bool, gradient_checkpointing: bool) -> dict:
    """The TrainingArguments fields that SFTConfig and DPOConfig share, set as the recipe trains: its batch,
    schedule and AdamW (fused, as the recipe's torch.optim.AdamW(fused=True)), no gradient checkpointing unless asked
    (TRL's default is on), fp32 unless bf16, no saving, evaluation or trackers during the measured run."""
    import torch

    return {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": s["per_device_train_batch_size"],
        "gradient_accumulation_steps": s["gradient_accumulation_steps"],
        "max_steps": s["max_train_steps"],
        "learning_rate": s["learning_rate"],
        "lr_scheduler_type": s["lr_scheduler_type"],
        "warmup_steps": s["num_warmup_steps"],
        "weight_decay": s["weight_decay"],
        "adam_epsilon": s["adam_epsilon"],
        "max_grad_norm": s["max_grad_norm"],
        "optim": "adamw_torch_fused",
        "gradient_checkpointing": gradient_checkpointing,
        "bf16": bf16,
        "fp16": False,
        # Without CUDA: the CPU, and with 2 processes DDP over gloo (Trainer needs telling; the recipe's
        # build_accelerator does the same with Accelerator(cpu=True)).
        "use_cpu": not torch.cuda.is_available(),
        "seed": s["seed"],
        "logging_steps": s["logging_steps"],
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
    }


def lora_config(s: dict):
    """The recipe's LoRA adapter (``--lora_r``, ``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=s["lora_r"],
        lora_alpha=s["lora_alpha"],
        lora_dropout=s["lora_dropout"],
        target_modules=s["lora_target_modules"],
        task_type="CAUSAL_LM",
    )
