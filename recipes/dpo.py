"""Preference tuning (DPO) of a causal language model with LoRA (default), QLoRA (``--load_in_4bit``) or full
fine-tuning, on one GPU or two with DDP or FSDP2: ``recipes/llm_finetune.py``'s loop, its loss replaced by TRL's
DPO loss (with RPO's NLL term on the chosen answers, optionally), with no second model in memory.

What it teaches: the reference model costs nothing. With LoRA it is the same base with the adapter switched off
(PEFT's ``disable_adapter()``); continuing an SFT adapter (``--adapter_name_or_path``, e.g. what llm_finetune.py
saved), the adapter is loaded twice, as the trained ``default`` and a frozen ``reference`` (a few MB), and the
reference forward switches to it: the reference is the SFT policy, not the bare base (TRL's ``ref`` adapter does the
same). With a full fine-tune the reference log-probs are computed in one pass before training and kept per pair
(``--precompute_reference``, always on there), so training holds one model. Each pair's chosen and rejected answers
go through one forward (concatenated along the batch), with logits only at the completion positions; the loss of an
optimizer step is the mean over *all* pairs of the global batch (every process, every accumulation micro-batch), so
1 process x 8 pairs, 2 processes x 4 and 1 x 4 x 2 accumulation give the same steps. Data in TRL's preference formats
(``prompt``/``chosen``/``rejected`` strings or conversations, or conversations with the prompt in their shared first
turns), from JSONL/JSON/CSV/Parquet files or a Hub dataset, tokenized and cut as TRL 1.16's DPOTrainer does by default;
dropout off, as its ``disable_dropout`` (docs/dpo.md lists what differs from TRL, and why).

With no arguments it runs offline: the adapter llm_finetune.py saved in ``outputs/llm_finetune`` (else a fresh one on
its base model, ``outputs/train_lm``, pretrained first when missing), on pairs of the SFT recipe's questions about
standard-library names, the right answer chosen and a wrong one rejected; reward accuracy and exact match on held-out
pairs are in the log (docs/dpo.md has the numbers).

Which config fits what: single_gpu.yaml: one GPU (or the CPU); ddp_2gpu.yaml: two GPUs, one replica each (LoRA and
QLoRA up to ~13B on 24 GB cards); fsdp_2gpu.yaml: a model that does not fit one GPU, sharded (full fine-tunes, LoRA
on larger models); fsdp_offload_2gpu.yaml: the shards and optimizer state in host RAM (the largest models).

Launch (from the repository root):
    # CPU smoke run, or one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/dpo.py --max_train_steps 20
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command), continuing an SFT adapter
    # (its base is the model) on your pairs:
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/dpo.py \\
        --adapter_name_or_path outputs/llm_finetune --train_file chats.jsonl
    # a full fine-tune sharded over two GPUs (the reference log-probs computed before training), or offloaded:
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/dpo.py \\
        --model_name_or_path ... --full_finetune --mixed_precision bf16 --gradient_checkpointing
    accelerate launch --config_file accelerate_configs/fsdp_offload_2gpu.yaml recipes/dpo.py \\
        --model_name_or_path ... --load_in_4bit --mixed_precision bf16 --gradient_checkpointing

To use it in your project, copy recipes/dpo.py, recipes/dpo_kit/, recipes/llm_kit/ and shared/ (and
accelerate_configs/, which the launch lines name): the kits beside the recipe, shared/ beside it or one folder up.
Without --model_name_or_path, an SFT adapter or a model in outputs/train_lm, it pretrains one with recipes/train_lm.py,
which it looks for beside itself.

Writes to --output_dir: the adapter (LoRA/QLoRA) or the whole model, the tokenizer, ``results.json`` (TRL's metric
names: ``train/rewards/accuracies`` ..., ``eval/rewards/accuracies`` ...) and ``checkpoints/step_N``.
"""

import argparse
import contextlib
import itertools
import json
import logging
import math
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from accelerate.utils import disable_fsdp_ram_efficient_loading
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

# PEFT, which transformers imports, imports bitsandbytes, which on a CPU with AVX-512 bf16 warns on every process that
# an optional kernel is not installed (bitsandbytes 0.50; the CPU path works without it): quieted before that import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import get_scheduler

# shared/ (beside this file in a copy, or one folder up here) and the kits (the LLM recipes', this recipe's) go first
# on sys.path, so that no installed package of those names shadows them (this folder too, for an import that is not a
# run).
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
sys.path.insert(0, str(HERE))
from shared.checkpoints import find_checkpoint, keep_global_batch, load_checkpoint, save_checkpoint, save_final
from shared.signals import install_stop_on_signals
from shared.fsdp import check_offload_fits_host_ram, gathered_state_dict, set_keep_gathered_in_one_process
from shared.fsdp import set_wrap_at_blocks
from shared.lora import lora_model
from llm_kit.loading import causal_lm_config, load_base_model
from llm_kit.loading import parameter_counts
from llm_kit.adapters import SFT_DEFAULT, continued_adapter, load_adapter_state, save_adapter_state, starting_point
from shared.model_split import find_block_list
from dpo_kit.preference_data import as_sft_rows, collate_pairs, disable_dropout, precompute_reference
from dpo_kit.preference_data import preference_format, reference_logps, sequence_logps
from dpo_kit.preference_data import stdlib_name_pairs, tokenize_pairs
from shared.results import RunRecord
from llm_kit.sharded_4bit import load_4bit_sharded
from shared.flags import add_reliability_flags, positive_float, positive_int, prepare_output_dir
from shared.accelerator import build_accelerator, fused_adamw, set_gpu_index, set_quiet_library_logs
from shared.parallelism import choose_parallelism
from shared.errors import report_recipe_errors, install_peer_exit_hooks, set_stop_with_launcher
from shared.fsdp import set_fsdp_on_cpu
from llm_kit.sft_data import add_chat_template, chat_tokenizer, check_batches, load_raw_datasets
from llm_kit.sft_eval import exact_match_before, exact_match_results

# What the offline default (no --model_name_or_path) trains with unless a flag says otherwise: from the base, large
# steps; continuing the SFT recipe's adapter, smaller ones with RPO's NLL term (measured there, docs/dpo.md: DPO alone
# lowers both answers, and the exact match falls from 72 % to 71 % at 3e-5, 32 % at 1e-3; with --rpo_alpha 5 at 1e-4
# the reward accuracy reaches 78.5 % and the exact match rises to 74 %).
OFFLINE_DEFAULT_SETTINGS = {"max_train_steps": 200, "learning_rate": 1e-3}
OFFLINE_SFT_SETTINGS = {"max_train_steps": 200, "learning_rate": 1e-4, "rpo_alpha": 5.0}
# Said when no data flag is given: a user's model would otherwise train on the offline pairs without a word.
BUNDLED_DATA = (
    "data: no --train_file or --dataset_name, so this run trains on the bundled preference pairs (is a standard-"
    "library name a class, a function or a method? the right answer chosen, a wrong one rejected); pass yours with "
    "--train_file (JSON Lines, CSV or Parquet: prompt, chosen and rejected)"
)
# TRL's metric names (results.json: train/<name>, eval/<name>), as ``metric_means`` orders them; nll_loss: the
# policy's loss on the chosen completion tokens (what --rpo_alpha weighs; TRL before 1.0 logs it with rpo_alpha).
METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--train_file",
        help="Preference pairs (.jsonl/.json, .csv, .parquet): prompt + chosen + "
        "rejected (strings or messages), or chosen + rejected conversations sharing their prompt turns.",
    )
    data.add_argument(
        "--validation_file",
        help="Validation pairs, same format (default: held out from the training "
        "data, --validation_split_percentage).",
    )
    data.add_argument(
        "--dataset_name", help="A Hugging Face Hub dataset (needs internet), e.g. 'trl-lib/ultrafeedback_binarized'."
    )
    data.add_argument("--dataset_config_name", help="The Hub dataset's configuration, if it has several.")
    data.add_argument(
        "--validation_split_percentage",
        type=positive_float,
        default=5,
        help="Share of the training data held out for validation when there is no validation split.",
    )
    data.add_argument(
        "--max_length",
        type=positive_int,
        default=1024,
        help="Prompt + completion tokens at most (TRL's default and its keep_start cut): completions are cut to what "
        "the prompt leaves, and a pair whose prompt alone fills it is dropped. Counted and reported.",
    )
    data.add_argument(
        "--max_prompt_length",
        type=positive_int,
        help="Cut longer prompts from the left, keeping their end next to the answer (TRL before 1.0), so that long "
        "prompts keep their pair and leave room for the completion (default: none, as TRL 1.x). Counted and reported.",
    )
    data.add_argument("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training pairs.")
    data.add_argument("--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation pairs.")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name_or_path",
        help="Local folder or Hub name of a causal LM. Default: the base of "
        "--adapter_name_or_path; offline: outputs/train_lm, pretrained first if missing.",
    )
    model.add_argument(
        "--adapter_name_or_path",
        help="A LoRA adapter to continue (e.g. outputs/llm_finetune, what "
        "llm_finetune.py saved): trained on, and its frozen copy is the reference. Its own rank and "
        "targets are kept (--lora_* apply to a new adapter only).",
    )
    model.add_argument(
        "--tokenizer_name", help="Folder or Hub name of the tokenizer, when the model's folder holds none."
    )
    model.add_argument("--trust_remote_code", action="store_true", help="Allow a Hub model to run its own code.")
    model.add_argument(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp", "device_map"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; else single).",
    )
    model.add_argument(
        "--full_finetune",
        action="store_true",
        help="Train every weight instead of a LoRA adapter "
        "(the reference log-probs are then computed before training).",
    )
    model.add_argument(
        "--load_in_4bit",
        action="store_true",
        help="QLoRA: the base model in 4-bit NF4 with double quantization (bitsandbytes), a LoRA adapter on top.",
    )
    model.add_argument(
        "--precompute_reference",
        action=argparse.BooleanOptionalAction,
        help="Compute the reference "
        "log-probs of every pair in one pass before training and keep them (always on with "
        "--full_finetune; pointless with LoRA, whose reference costs no memory).",
    )
    model.add_argument("--lora_r", type=positive_int, default=8, help="LoRA rank.")
    model.add_argument(
        "--lora_alpha", type=positive_float, default=16, help="LoRA scaling: updates are scaled by alpha / r."
    )
    model.add_argument(
        "--lora_dropout", type=float, default=0.0, help="Dropout on the LoRA path (needs --no-disable_dropout)."
    )
    model.add_argument(
        "--disable_dropout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TRL's default: every dropout of the model and of LoRA set to 0, so that the policy starts as the "
        "reference and each step's loss is exact. --no-disable_dropout trains with the model's dropout (the reference "
        "is always scored without).",
    )
    model.add_argument(
        "--lora_target_modules",
        nargs="+",
        default=["all-linear"],
        help="Module names (or suffixes) to adapt; 'all-linear': every linear layer but the output head.",
    )
    model.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each decoder block's activations in backward: less memory, ~1/3 more compute.",
    )
    dpo = parser.add_argument_group("DPO")
    dpo.add_argument(
        "--loss_type",
        choices=["sigmoid", "ipo"],
        default="sigmoid",
        help="sigmoid: DPO's "
        "-log sigmoid(beta * margin); ipo: (margin per token - 1 / (2 beta))^2, TRL's IPO (log-probs "
        "averaged over each completion's tokens).",
    )
    dpo.add_argument(
        "--beta",
        type=positive_float,
        default=0.1,
        help="How far the policy may move from the reference: higher stays closer (IPO: its tau).",
    )
    dpo.add_argument(
        "--label_smoothing",
        type=float,
        default=0.0,
        help="sigmoid only: the share of pairs taken to "
        "be mislabelled (conservative DPO: -(1-e) log sigmoid(beta m) - e log sigmoid(-beta m)).",
    )
    dpo.add_argument(
        "--rpo_alpha",
        type=float,
        help="RPO (arXiv:2404.19733): add rpo_alpha x the NLL of the chosen "
        "completions, the mean over every chosen completion token of the step's global batch (TRL's "
        "rpo_alpha before 1.0, per batch on each process; 1.16: loss_type ['sigmoid', 'sft'] with "
        "loss_weights [1, alpha]). Keeps the right answer likely while DPO pushes both down. Default: "
        "off (0 too); offline, continuing the SFT adapter: 5.",
    )
    training = parser.add_argument_group("training")
    training.add_argument(
        "--per_device_train_batch_size",
        type=positive_int,
        default=4,
        help="Pairs per process per forward pass (each forward holds 2x as many sequences).",
    )
    training.add_argument(
        "--per_device_eval_batch_size", type=positive_int, help="Pairs per evaluation batch (default: training's)."
    )
    training.add_argument(
        "--gradient_accumulation_steps",
        type=positive_int,
        help="Forward/backward passes per optimizer step (default: 1; on a resume, what keeps the checkpoint's global "
        "batch in this process count).",
    )
    training.add_argument(
        "--num_train_epochs",
        type=positive_int,
        default=1,
        help="Passes over the training set (ignored with --max_train_steps).",
    )
    training.add_argument(
        "--max_train_steps",
        type=positive_int,
        help="Stop after this many optimizer steps (default: --num_train_epochs; offline default: 200).",
    )
    training.add_argument(
        "--learning_rate",
        type=positive_float,
        help="Peak AdamW learning rate (default: 5e-5 "
        "with LoRA, TRL's 1e-6 for a full fine-tune; offline default: 1e-3, continuing the SFT "
        "adapter 1e-4).",
    )
    training.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay.")
    training.add_argument("--adam_epsilon", type=positive_float, default=1e-8, help="AdamW's epsilon.")
    training.add_argument(
        "--lr_scheduler_type", default="cosine", help="transformers.get_scheduler name: linear, cosine, constant, ..."
    )
    training.add_argument(
        "--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps."
    )
    training.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm to this (0 disables)."
    )
    training.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], help="Override the config's mixed precision."
    )
    training.add_argument("--seed", type=int, default=42, help="Seed for the LoRA initialisation and shuffling.")
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output_dir", default="outputs/dpo", help="Adapter (or model), tokenizer, results.json, checkpoints."
    )
    output.add_argument(
        "--exact_match_samples",
        type=int,
        help="Score greedy answers to N (shuffled) validation "
        "prompts against the chosen answers, before and after training (default: 100 when the "
        "answers are short, else none; 0 skips; not under FSDP).",
    )
    output.add_argument("--report_to", help="Trackers to log to: tensorboard, wandb, all, ... (default: none).")
    output.add_argument(
        "--logging_steps",
        type=positive_int,
        default=10,
        help="Log the loss and TRL's reward metrics every N optimizer steps.",
    )
    output.add_argument("--skip_eval", action="store_true", help="Skip the final evaluation (eval/* are NaN).")
    output.add_argument(
        "--perf_warmup_steps", type=int, default=1, help="Optimizer steps left out of the throughput numbers."
    )
    add_reliability_flags(parser)  # checkpoints, resume, --save_on_each_node, --dist_timeout (shared by the recipes)
    args = parser.parse_args(argv)
    if args.full_finetune and (args.load_in_4bit or args.adapter_name_or_path):
        parser.error(
            "--full_finetune trains every weight of the model; --load_in_4bit and --adapter_name_or_path "
            "train a LoRA adapter: choose one"
        )
    if args.precompute_reference and not args.full_finetune:
        parser.error(
            "--precompute_reference is for full fine-tunes: with LoRA the reference is the same model with "
            "the adapter switched off (or the frozen copy of --adapter_name_or_path), which costs no memory "
            "and no pass before training. Leave the flag out."
        )
    if args.precompute_reference is False and args.full_finetune:
        parser.error(
            "--no-precompute_reference would need a second, frozen copy of the model as the reference; this "
            "recipe keeps one model and computes the reference log-probs before training (the same loss, "
            "tested). Leave the flag out."
        )
    if args.label_smoothing and (args.loss_type != "sigmoid" or not 0 <= args.label_smoothing < 0.5):
        parser.error("--label_smoothing is a share of mislabelled pairs in [0, 0.5), for --loss_type sigmoid only")
    if args.rpo_alpha is not None and not args.rpo_alpha >= 0:
        parser.error(f"--rpo_alpha weighs the chosen answers' NLL: 0 or more, not {args.rpo_alpha}")
    if args.lora_dropout and args.disable_dropout:
        parser.error(
            f"--lora_dropout {args.lora_dropout} would be switched off: --disable_dropout (on by default, as in TRL) "
            "sets every dropout of the policy and the reference to 0, LoRA's included. Add --no-disable_dropout."
        )
    if args.validation_file and not args.train_file:
        parser.error("--validation_file needs --train_file")
    args.precompute_reference = args.full_finetune  # the one way a full fine-tune keeps a single model
    # The offline default model is small and barely pretrained: it learns visibly only with larger steps than an LLM.
    sft = not args.full_finetune and Path(SFT_DEFAULT, "adapter_config.json").is_file()  # continued (starting_point)
    settings = (
        {}
        if args.model_name_or_path or args.adapter_name_or_path
        else (OFFLINE_SFT_SETTINGS if sft else OFFLINE_DEFAULT_SETTINGS)
    )
    chosen = {name: value for name, value in settings.items() if getattr(args, name) is None}
    for name, value in chosen.items():
        setattr(args, name, value)
    settings = " ".join(f"--{name} {value:g}" for name, value in chosen.items())
    args.offline_default_settings = settings and f"the offline default trains with {settings} (flags change it)"
    args.learning_rate = args.learning_rate or (1e-6 if args.full_finetune else 5e-5)
    return args


def dpo_losses(
    policy: torch.Tensor, reference: torch.Tensor, batch: dict, beta: float, loss_type: str, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss, and ``METRICS`` per pair (pairs x 7, detached), as TRL 1.16's DPOTrainer computes them
    (trl/trainer/dpo_trainer.py, ``_compute_loss``): margin = (policy - reference) of chosen minus that of rejected;
    sigmoid: -log sigmoid(beta * margin), with label smoothing -(1-e) log sigmoid(beta m) - e log sigmoid(-beta m)
    (conservative DPO, TRL's sigmoid before 1.0; 1.16 keeps it for its robust/aot losses); ipo: each log-ratio over its
    completion's token count, then (margin - 1 / (2 beta))^2. Rewards: beta * log-ratio."""
    chosen_logratios, rejected_logratios = (policy - reference).chunk(2)
    chosen_tokens, rejected_tokens = completion_tokens(batch).to(policy.device).chunk(2)
    if loss_type == "ipo":
        margin = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        margin = chosen_logratios - rejected_logratios
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    chosen_logps, rejected_logps = policy.detach().chunk(2)
    per_pair = [
        losses.detach(),
        chosen_rewards,
        rejected_rewards,
        (chosen_rewards > rejected_rewards).float(),
        chosen_rewards - rejected_rewards,
        chosen_logps,
        rejected_logps,
        chosen_tokens,
    ]
    return losses, torch.stack(per_pair, dim=1).float()


def completion_tokens(batch: dict) -> torch.Tensor:
    """The completion tokens of each row (chosen rows, then rejected): the scored positions."""
    return (batch["sequences"]["loss_targets"] != -100).sum(dim=1)


def step_counts(batch: dict) -> torch.Tensor:
    """The batch's pairs and their chosen completion tokens: summed over a step, what its losses are averaged over."""
    return torch.stack([(batch["index"] >= 0).sum(), completion_tokens(batch).chunk(2)[0].sum()])


def step_loss(
    model, batch: dict, reference: torch.Tensor, step_pairs, step_tokens, rpo_alpha: float | None, **loss_kw
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's forward on a micro-batch, its share of its optimizer step's loss, and its per-pair columns
    (``dpo_losses``): its DPO losses over the step's pairs plus, with ``rpo_alpha`` (RPO), that times its chosen
    completion tokens' loss over the step's chosen tokens. Summed over the step's micro-batches and processes: the
    mean DPO loss per pair plus rpo_alpha x the mean NLL per chosen completion token, whatever the processes and
    accumulation (TRL: per batch on each process)."""
    policy = sequence_logps(model, batch)
    losses, per_pair = dpo_losses(policy, reference, batch, **loss_kw)
    nll = -policy.chunk(2)[0].sum() / step_tokens  # the chosen rows (the first half): their completion tokens
    return losses.sum() / step_pairs + (rpo_alpha * nll if rpo_alpha else 0), per_pair


def metric_means(sums: torch.Tensor, pairs, rpo_alpha: float | None) -> torch.Tensor:
    """``METRICS`` from the sums over ``pairs`` pairs of ``dpo_losses``' per-pair columns: means per pair, but
    ``nll_loss`` per chosen completion token (minus the summed chosen log-probs over the chosen tokens), and
    ``loss`` the DPO loss plus ``rpo_alpha`` x ``nll_loss`` (the objective trained)."""
    means, nll_loss = sums[:-1] / pairs, -sums[5:6] / sums[-1]
    return torch.cat([means[:1] + (rpo_alpha or 0) * nll_loss, means[1:], nll_loss])


def evaluate(accelerator, model, eval_dataloader, precomputed, rpo_alpha, **loss_kw) -> dict:
    """TRL's metrics over every validation pair, each counted once (``eval/loss``, ``eval/rewards/accuracies`` ...)."""
    model.eval()
    sums, pairs = torch.zeros(len(METRICS), device=accelerator.device), 0  # the per-pair columns: METRICS' count
    for batch in eval_dataloader:
        with torch.no_grad():
            reference = reference_logps(accelerator, model, batch, precomputed)
            per_pair = dpo_losses(sequence_logps(model, batch), reference, batch, **loss_kw)[1]
        # gather_for_metrics drops the pairs Accelerate repeated to give every process a full last batch.
        per_pair = accelerator.gather_for_metrics(per_pair)
        sums, pairs = sums + per_pair.sum(dim=0), pairs + len(per_pair)
    results = {f"eval/{name}": value for name, value in zip(METRICS, metric_means(sums, pairs, rpo_alpha).tolist())}
    if pairs:
        accelerator.print(
            f"eval: loss {results['eval/loss']:.4f}, reward accuracy "
            f"{results['eval/rewards/accuracies']:.1%}, margin {results['eval/rewards/margins']:.4f} on "
            f"{pairs} validation pairs"
        )
    return {**results, "eval/num_pairs": pairs}


def dataloaders(
    train_dataset,
    eval_dataset,
    tokenizer,
    data_parallel_size: int,
    *,
    per_device_train_batch_size,
    seed,
    per_device_eval_batch_size,
) -> tuple[DataLoader, ...]:
    """Shuffled training pairs (refused if they cannot give every data-parallel process a batch), the validation
    pairs in order, and the training pairs in order for the reference pass of a full fine-tune."""
    collate_fn, pinned = partial(collate_pairs, pad_token_id=tokenizer.pad_token_id), torch.cuda.is_available()
    # The loader gets its own generator: one without draws a seed from the global RNG whenever it starts iterating.
    train_dataloader = DataLoader(
        train_dataset,
        per_device_train_batch_size,
        shuffle=True,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=pinned,
    )
    check_batches(train_dataloader, data_parallel_size)
    eval_size = per_device_eval_batch_size or per_device_train_batch_size
    eval_dataloader = DataLoader(eval_dataset, eval_size, collate_fn=collate_fn, pin_memory=pinned)
    reference_dataloader = DataLoader(train_dataset, eval_size, collate_fn=collate_fn, pin_memory=pinned)
    return train_dataloader, eval_dataloader, reference_dataloader


def save(accelerator, model, tokenizer, output_dir: Path, trained_only: bool) -> None:
    """The model, or the trained ``default`` adapter alone, and the tokenizer, for ``from_pretrained``, written whole
    or not at all (a collective). The same as llm_finetune.py's ``save`` but for ``selected_adapters`` (the frozen
    reference copy is not saved): kept in each recipe so that each copies alone."""
    accelerator.wait_for_everyone()
    state_dict = gathered_state_dict(accelerator, model, trained_only=trained_only)
    kwargs = {"selected_adapters": ["default"]} if trained_only else {}

    def write(folder: Path) -> None:
        accelerator.unwrap_model(model).save_pretrained(folder, state_dict=state_dict, **kwargs)
        tokenizer.save_pretrained(folder)

    save_final(accelerator, output_dir, write, output_dir / "checkpoints", state_dict)
    accelerator.print(f"saved the {'adapter' if trained_only else 'model'} and the tokenizer to {output_dir}")


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()
    lora, method = not args.full_finetune, "qlora" if args.load_in_4bit else "full" if args.full_finetune else "lora"

    # ------------------------------------------------------------------ Accelerator and seed
    set_stop_with_launcher()  # Linux: dies with its launcher (a SIGKILLed launcher cannot stop its workers)
    stop = install_stop_on_signals(Path(args.output_dir) / "checkpoints")  # SIGTERM, Ctrl-C: checkpoint, then exit
    install_peer_exit_hooks()  # 2+ processes: a rank another one stopped says so in one line
    set_gpu_index()  # one process on a GPU: env ACCELERATE_TORCH_DEVICE=cuda:N, so results say cuda:0, not cuda
    accelerator = build_accelerator(  # no gradient_accumulation_steps: the loop counts a step's pairs, then syncs
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        log_with=args.report_to,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_fsdp_on_cpu(accelerator)  # CPU + FSDP config: Accelerate's state set back to FSDP2 (cpu=True drops it)
    set_keep_gathered_in_one_process(
        accelerator
    )  # FSDP in 1 process: no resharding after forward (nothing to shard over)
    set_seed(args.seed)
    set_quiet_library_logs(accelerator)  # library warnings once, from the main process; no colour codes in log files
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/dpo.py")  # or a clear refusal
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason}); method: {method}")
    data_parallel_size = accelerator.num_processes if parallelism.name in ("ddp", "fsdp") else 1
    layout, checkpoints_dir = "fsdp" if parallelism.name == "fsdp" else "replica", output_dir / "checkpoints"
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)
    args.gradient_accumulation_steps, batch_shape = keep_global_batch(
        accelerator.num_processes,  # a resume: its global batch
        checkpoint,
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        data_parallel_size,
        args.seed,
    )
    args.adapter_name_or_path, args.model_name_or_path = starting_point(  # the adapter to continue (offline: the SFT
        accelerator,
        args.adapter_name_or_path,
        args.model_name_or_path,
        lora,
        output_dir,
        HERE,  # recipe's) and
        args.offline_default_settings,
    )  # its base, or the offline base; prints the offline default's settings
    config, args.max_length = causal_lm_config(
        accelerator, args.model_name_or_path, args.max_length, args.load_in_4bit, args.trust_remote_code
    )
    tokenizer = chat_tokenizer(accelerator, args.model_name_or_path, args.trust_remote_code, args.tokenizer_name)
    add_chat_template(accelerator, tokenizer)  # before the data: conversational rows are checked with it

    # ------------------------------------------------------------------------------- data
    with accelerator.main_process_first():  # the main process reads and tokenizes first, the others read its cache
        raw_datasets, fmt = load_raw_datasets(  # every row checked by preference_format, which names the format
            args.train_file,
            args.validation_file,
            args.dataset_name,
            args.dataset_config_name,
            args.validation_split_percentage,
            args.seed,
            args.max_train_samples,
            args.max_eval_samples,
            preference_format,
            default_data=stdlib_name_pairs,
        )
        if not (args.train_file or args.dataset_name):
            accelerator.print(BUNDLED_DATA)
        train_dataset, eval_dataset, counts = tokenize_pairs(
            accelerator, raw_datasets, fmt, tokenizer, args.max_length, args.max_prompt_length
        )
    train_dataloader, eval_dataloader, reference_dataloader = dataloaders(
        train_dataset,
        eval_dataset,
        tokenizer,
        data_parallel_size,
        per_device_train_batch_size=args.per_device_train_batch_size,
        seed=args.seed,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
    )

    # ------------------------------------------------------------------------------ model
    model = load_base_model(
        accelerator,
        args.model_name_or_path,
        config,
        lora,
        args.load_in_4bit,
        [],
        args.max_length,
        args.trust_remote_code,
    )
    if args.gradient_checkpointing:  # non-reentrant: the reentrant one breaks DDP and gets no grad from a frozen base
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.adapter_name_or_path:  # trained "default" + frozen "reference" copy: the reference is the SFT policy
        model = continued_adapter(model, args.adapter_name_or_path)  # PeftModel.from_pretrained x 2
    elif lora:  # a new adapter (get_peft_model): the reference is the base, the adapter switched off
        model = lora_model(
            model,
            args.model_name_or_path,
            r=args.lora_r,
            alpha=args.lora_alpha,
            dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type="CAUSAL_LM",
        )
    if args.disable_dropout and (switched := disable_dropout(model)):  # TRL's default: at step 0, policy = reference
        accelerator.print(
            f"dropout: off in the policy and the reference, as in TRL ({switched} dropout probabilities set to 0; "
            "--no-disable_dropout keeps them)"
        )
    trainable, total = parameter_counts(accelerator, model, args.model_name_or_path)
    if args.load_in_4bit and parallelism.name == "fsdp":  # built empty: the weights come now, a layer at a time
        load_4bit_sharded(accelerator, model, args.model_name_or_path)  # the main process reads, the others receive
        disable_fsdp_ram_efficient_loading()  # env: transformers must not load to meta on rank 1+ again

    # ------------------------------------------------------------------ optimizer and scheduler
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        fused=fused_adamw(accelerator),
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        eps=args.adam_epsilon,
    )
    steps_per_epoch = math.ceil(len(train_dataloader) / (data_parallel_size * args.gradient_accumulation_steps))
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    # Warm-up and training steps times the processes: the prepared scheduler steps once per process per step.
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        args.num_warmup_steps * accelerator.num_processes,
        max_train_steps * accelerator.num_processes,
    )

    # ------------------------------------------------------------------------------ prepare
    if parallelism.name == "fsdp":  # one FSDP unit per decoder block; an offload that cannot fit is refused now
        set_wrap_at_blocks(accelerator, model, find_block_list(model, set(model._no_split_modules)))
        check_offload_fits_host_ram(accelerator, model)
    model, optimizer, train_dataloader, eval_dataloader, reference_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, reference_dataloader, lr_scheduler
    )
    # A full fine-tune's reference: the model as loaded, before any step (and before a resume loads trained weights).
    precomputed = {
        split: precompute_reference(accelerator, model, loader) if args.precompute_reference else None
        for split, loader in (("train", reference_dataloader), ("eval", eval_dataloader))
    }
    sft_rows, sft_fmt = as_sft_rows(raw_datasets["validation"], fmt)
    exact_rows, exact_before = exact_match_before(  # greedy answers to held-out prompts, scored again at the end
        accelerator,
        model,
        tokenizer,
        sft_rows,
        sft_fmt,
        0 if args.skip_eval else args.exact_match_samples,
        layout == "fsdp",
        args.seed,
    )
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel_size
    run_config = {
        **vars(args),
        "method": method,
        "parallelism": parallelism.name,
        "data_format": fmt,
        "global_batch_size": global_batch_size,
        "max_train_steps": max_train_steps,
    }
    accelerator.init_trackers("dpo", {k: v for k, v in run_config.items() if not isinstance(v, list | None)})
    loss_kw = {name: getattr(args, name) for name in ("beta", "loss_type", "label_smoothing", "rpo_alpha")}

    # ---------------------------------------------------------------------- training loop
    resume = load_checkpoint(
        accelerator,
        checkpoint,
        steps_per_epoch,
        args.gradient_accumulation_steps,  # all states; the scheduler's count brought to this run's processes
        lr_scheduler,
        load_state=(lambda folder: load_adapter_state(accelerator, folder)) if lora else None,  # LoRA: the adapter
    )
    completed_steps, log, window, logs = resume.completed_steps, resume.history.get("train/log", []), [], {}
    every = steps_per_epoch if args.checkpointing_steps == "epoch" else args.checkpointing_steps  # checkpoints
    last_checkpoint = max_train_steps - (args.checkpointing_steps == "epoch")  # no epoch checkpoint at the end
    save_checkpoint_at = lambda step: save_checkpoint(  # the whole history so far: a resume goes on with it
        accelerator,
        checkpoints_dir,
        step,
        args.checkpoints_total_limit,
        write_state=(lambda folder: save_adapter_state(accelerator, folder)) if lora else None,  # LoRA: the adapter
        layout=layout,
        history={"train/loss_curve": record.losses(), "train/log": log},
        batch=batch_shape,
    )
    record = RunRecord(accelerator, max_train_steps, resume.history.get("train/loss_curve"), args.perf_warmup_steps)
    accelerator.print(f"config: {json.dumps(run_config, sort_keys=True, default=str)}")
    progress_bar = tqdm(total=max_train_steps, initial=completed_steps, disable=not accelerator.is_local_main_process)
    for epoch in range(resume.epoch, math.ceil(max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)  # reseeds the shuffling: same order on every process and after a resume
        skip = resume.batches_to_skip if epoch == resume.epoch else 0  # a resumed epoch: the batches already seen
        active_dataloader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        batches = iter(record.timed(active_dataloader))
        while completed_steps < max_train_steps and (
            micro_batches := list(itertools.islice(batches, args.gradient_accumulation_steps))
        ):
            # The step's loss: the mean over *all* its pairs (RPO's NLL: over all their chosen tokens), counted before
            # the first backward (sync point: an all-reduce). DDP/FSDP average N processes' gradients: hence the N.
            step_pairs, step_tokens = accelerator.reduce(sum(step_counts(b) for b in micro_batches), "sum")
            sums = torch.zeros(len(METRICS) + 1, device=accelerator.device)  # + the step's real tokens
            for index, batch in enumerate(micro_batches):  # all but the last skip DDP's all-reduce / FSDP2's scatter
                reference = reference_logps(accelerator, model, batch, precomputed["train"])
                with accelerator.no_sync(model) if index < len(micro_batches) - 1 else contextlib.nullcontext():
                    loss, per_pair = step_loss(model, batch, reference, step_pairs, step_tokens, **loss_kw)
                    accelerator.backward(loss * data_parallel_size)
                sums += torch.cat([per_pair.sum(dim=0), batch["sequences"]["num_tokens"].sum()[None].float()])
            if args.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            completed_steps += 1
            progress_bar.update(1)
            sums = accelerator.reduce(sums, "sum")  # the global sums stay on the device: only the log reads them
            window.append(metric_means(sums[:-1], step_pairs, args.rpo_alpha))  # on the device until a log reads it
            record.step(completed_steps, window[-1][0], samples=step_pairs, tokens=sums[-1])
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                means = torch.stack(window).mean(dim=0).tolist()  # sync point: reads the window's metrics
                logs = {f"train/{name}": value for name, value in zip(METRICS, means)}
                logs["train/learning_rate"], window = lr_scheduler.get_last_lr()[0], []
                log.append({"step": completed_steps, **logs})
                accelerator.log(logs, step=completed_steps)
            if stop.requested(completed_steps):  # SIGTERM or Ctrl-C to any process: all stop after this step
                stop.exit(save_checkpoint_at(completed_steps))
            if every and completed_steps % every == 0 and completed_steps <= last_checkpoint:
                save_checkpoint_at(completed_steps)
    progress_bar.close()

    # ------------------------------------------------------------------------------- save
    # Before the evaluation: nothing that can fail after the last optimizer step may lose the trained weights.
    save(accelerator, model, tokenizer, output_dir, trained_only=lora)

    # ------------------------------------------------------------------------- evaluation
    results = {
        "recipe": "dpo",
        "config": run_config,
        "train/log": log,
        "method": method,
        "data/counts": counts,
        **{key: value for key, value in logs.items() if key != "train/loss"},  # the last logged window's TRL metrics
        **evaluate(accelerator, model, [] if args.skip_eval else eval_dataloader, precomputed["eval"], **loss_kw),
        **exact_match_results(accelerator, model, tokenizer, exact_rows, sft_fmt, exact_before),
        "parallelism": parallelism.name,
        "data/format": fmt,
        "global_batch_size": global_batch_size,
        "model/trainable_parameters": trainable,
        "model/total_parameters": total,
    }
    record.write(output_dir, results, model)  # a collective
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)  # DDP gone before gloo
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
