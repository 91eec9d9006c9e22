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
names: ``train/rewards/accuracies`` ..., ``eval/rewards/accuracies`` ...) and ``checkpoints/step_N`` every
--checkpointing_steps (N steps or epoch) and after the last step.
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
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from accelerate.utils import disable_fsdp_ram_efficient_loading
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

# bitsandbytes (PEFT imports it) warns on each CPU process of an optional kernel it lacks: docs/troubleshooting.md
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# shared/ (beside this file in a copy, or one folder up here) and this recipe's kits go first on sys.path, so that no
# installed package of those names shadows them; this folder too, for an import that is not a run.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
sys.path.insert(0, str(HERE))
from shared.checkpoints import keep_global_batch, load_checkpoint, save_final, set_start_checkpoint
from shared.signals import install_stop_on_signals
from shared.fsdp import gathered_state_dict, set_keep_gathered_in_one_process
from llm_kit.loading import causal_lm_config, max_length_within_positions, parameter_counts, set_fsdp_units
from llm_kit.adapters import POLICY_FLAGS, SFT_DEFAULT, START_FLAGS, adapter_checkpoints, load_model, starting_point
from llm_kit.adapters import set_offline_defaults
from llm_kit.checkpoints import ADAPTER_FLAGS, BATCH_FLAGS, CHECKPOINT_FLAGS, checkpoint_saver, unchanged_by_a_resume
from llm_kit.optimizer import OPTIMIZER_FLAGS, adamw_and_scheduler
from dpo_kit.preference_data import as_sft_rows, collate_pairs, preference_format, stdlib_name_pairs, tokenize_pairs
from dpo_kit.loss import LOSS_FLAGS, METRICS, dpo_losses, metric_means, sequence_logps, step_counts, step_loss
from dpo_kit.metrics import TrainLog
from dpo_kit.reference import disable_dropout, precompute_reference, reference_logps
from shared.results import RunRecord
from llm_kit.sharded_4bit import load_4bit_sharded
from shared.flags import add_reliability_flags, flags, positive_float, positive_int, prepare_output_dir
from shared.accelerator import build_accelerator, set_gpu_index, set_quiet_library_logs
from shared.parallelism import choose_parallelism
from shared.errors import report_recipe_errors, install_peer_exit_hooks, set_stop_with_launcher
from shared.fsdp import set_fsdp_on_cpu
from llm_kit.sft_data import DATA_FLAGS, add_chat_template, chat_tokenizer, check_batches, load_raw_datasets
from llm_kit.sft_eval import exact_match_before, exact_match_results

# What the offline default (no --model_name_or_path) trains with unless a flag says otherwise: large steps from the
# base; continuing the SFT recipe's adapter, smaller ones with RPO's NLL term (docs/dpo.md has the measurements).
OFFLINE_DEFAULT_SETTINGS = {"max_train_steps": 200, "learning_rate": 1e-3, "lr_scheduler_type": "cosine"}
OFFLINE_SFT_SETTINGS = {"max_train_steps": 200, "learning_rate": 1e-4, "rpo_alpha": 5.0, "lr_scheduler_type": "cosine"}
# Said when --disable_dropout (on by default) switched dropout off.
DROPOUT_OFF = (
    "dropout: off in the policy and the reference, as in TRL ({} dropout probabilities set to 0; --no-disable_dropout "
    "keeps them)"
)
# Said when no data flag is given: a user's model would otherwise train on the offline pairs without a word.
BUNDLED_DATA = (
    "data: no --train_file or --dataset_name, so this run trains on the bundled preference pairs (is a standard-"
    "library name a class, a function or a method? the right answer chosen, a wrong one rejected); pass yours with "
    "--train_file (JSON Lines, CSV or Parquet: prompt, chosen and rejected)"
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument_group("data").add_argument
    add(
        "--train_file",
        help="Preference pairs (.jsonl/.json, .csv, .parquet): prompt + chosen + rejected (strings or messages), "
        "or chosen + rejected conversations sharing their prompt turns.",
    )
    add("--validation_file", help="Validation pairs, same format (default: held out from the training data).")
    add("--dataset_name", help="A Hugging Face Hub dataset (needs internet), e.g. 'trl-lib/ultrafeedback_binarized'.")
    add("--dataset_config_name", help="The Hub dataset's configuration, if it has several.")
    add("--validation_split_percentage", type=positive_float, default=5, help="Held out without a validation split.")
    add(
        "--max_length",
        type=positive_int,
        help="Prompt + completion tokens at most, TRL's cut (default 1024, TRL's, or the model's positions if "
        "fewer): a pair whose prompt fills it is dropped (reported).",
    )
    add("--max_prompt_length", type=positive_int, help="Cut longer prompts from the left (TRL < 1.0); default: none.")
    add("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training pairs.")
    add("--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation pairs.")
    add = parser.add_argument_group("model").add_argument
    add("--model_name_or_path", help="A causal LM (default: the adapter's base; offline: outputs/train_lm).")
    add(
        "--adapter_name_or_path", help="LoRA adapter to continue (rank, targets kept); its frozen copy: the reference."
    )
    add("--tokenizer_name", help="Folder or Hub name of the tokenizer, when the model's folder holds none.")
    add("--trust_remote_code", action="store_true", help="Allow a Hub model to run its own code.")
    add(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp", "device_map"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; else single).",
    )
    add("--full_finetune", action="store_true", help="Train every weight (the reference precomputed), not LoRA.")
    add("--load_in_4bit", action="store_true", help="QLoRA: the base model in 4-bit NF4 (bitsandbytes), LoRA on top.")
    add(
        "--precompute_reference",
        action=argparse.BooleanOptionalAction,
        help="The reference log-probs of every pair computed before training (on with --full_finetune; not LoRA).",
    )
    add("--lora_r", type=positive_int, default=8, help="LoRA rank.")
    add("--lora_alpha", type=positive_float, default=16, help="LoRA scaling: updates are scaled by alpha / r.")
    add("--lora_dropout", type=float, default=0.0, help="Dropout on the LoRA path (needs --no-disable_dropout).")
    add(
        "--disable_dropout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TRL's default: every dropout (LoRA's too) set to 0, so that the policy starts as the reference. "
        "--no-disable_dropout trains with the model's dropout (the reference is scored without).",
    )
    add("--lora_target_modules", nargs="+", default=["all-linear"], help="Modules to adapt; all-linear: but the head.")
    add("--gradient_checkpointing", action="store_true", help="Recompute activations in backward: less memory.")
    add = parser.add_argument_group("DPO").add_argument
    add(
        "--loss_type",
        choices=["sigmoid", "ipo"],
        default="sigmoid",
        help="sigmoid: DPO's -log sigmoid(beta * margin); ipo: TRL's IPO, (margin per token - 1 / (2 beta))^2.",
    )
    add("--beta", type=positive_float, default=0.1, help="Higher keeps the policy closer to the reference (IPO: tau).")
    add("--label_smoothing", type=float, default=0.0, help="sigmoid: share of pairs taken as mislabelled (cDPO).")
    add(
        "--rpo_alpha",
        type=float,
        help="RPO (arXiv:2404.19733): add rpo_alpha x the NLL of the chosen completion tokens of the step's global "
        "batch, which keeps the right answer likely while DPO pushes both down (default: off; offline, "
        "continuing the SFT adapter: 5; docs/dpo.md).",
    )
    add = parser.add_argument_group("training").add_argument
    add("--per_device_train_batch_size", type=positive_int, default=4, help="Pairs (2 sequences each) per forward.")
    add("--per_device_eval_batch_size", type=positive_int, help="Pairs per evaluation batch (default: training's).")
    add(
        "--gradient_accumulation_steps",
        type=positive_int,
        help="Forward/backward passes per optimizer step (default: 1; on a resume, what keeps the checkpoint's "
        "global batch in this process count).",
    )
    add("--num_train_epochs", type=positive_int, default=1, help="Passes over the data (unless --max_train_steps).")
    add("--max_train_steps", type=positive_int, help="Stop after this many optimizer steps (offline default: 200).")
    add(
        "--learning_rate",
        type=positive_float,
        help="Peak AdamW learning rate (default: 5e-5 with LoRA, TRL's 1e-6 for a full fine-tune; offline default: "
        "1e-3, continuing the SFT adapter 1e-4).",
    )
    add("--weight_decay", type=float, default=0.0, help="AdamW weight decay.")
    add("--adam_epsilon", type=positive_float, default=1e-8, help="AdamW's epsilon.")
    add("--lr_scheduler_type", help="transformers.get_scheduler name: linear (TRL's; the default), cosine, ...")
    add("--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps.")
    add("--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm to this (0 disables).")
    add("--mixed_precision", choices=["no", "fp16", "bf16"], help="Override the config's mixed precision.")
    add("--seed", type=int, default=42, help="Seed for the LoRA initialisation and shuffling.")
    add = parser.add_argument_group("output").add_argument
    add("--output_dir", default="outputs/dpo", help="Adapter (or model), tokenizer, results.json, checkpoints.")
    add(
        "--exact_match_samples",
        type=int,
        help="Score greedy answers to N (shuffled) validation prompts against the chosen answers, before and after "
        "training (default: 100 when the answers are short, else none; 0 skips; not under FSDP).",
    )
    add("--report_to", help="Trackers to log to: tensorboard, wandb, all, ... (default: none).")
    add("--logging_steps", type=positive_int, default=10, help="Log the loss and reward metrics every N steps.")
    add("--skip_eval", action="store_true", help="Skip the final evaluation (eval/* are NaN).")
    add("--perf_warmup_steps", type=int, default=1, help="Optimizer steps left out of the throughput numbers.")
    add_reliability_flags(parser)  # checkpoints, resume, --save_on_each_node, --dist_timeout (shared by the recipes)
    args = parser.parse_args(argv)
    refuse_conflicting_flags(parser, args)
    args.precompute_reference = args.full_finetune  # the one way a full fine-tune keeps a single model
    # The offline default model is small and barely pretrained: it learns visibly only with larger steps than an LLM.
    sft = not args.full_finetune and Path(SFT_DEFAULT, "adapter_config.json").is_file()  # continued (starting_point)
    settings = OFFLINE_SFT_SETTINGS if sft else OFFLINE_DEFAULT_SETTINGS
    offline = not (args.model_name_or_path or args.adapter_name_or_path)
    args.offline_default_settings = set_offline_defaults(args, settings if offline else {})
    args.learning_rate = args.learning_rate or (1e-6 if args.full_finetune else 5e-5)
    args.lr_scheduler_type = args.lr_scheduler_type or "linear"
    return args


def refuse_conflicting_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that cannot go together, refused with the usage line and exit code 2 (``parser.error``)."""
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


def run_results(run_config: dict, train_log, *, counts: dict, parameters: tuple[int, int]) -> dict:
    """What ``results.json`` holds besides the evaluation: the resolved configuration, the logged windows and TRL's
    metrics of the last one (``train_log``), the method, the data's format and counts, the parallelism and the
    model's trainable and total parameters."""
    return {
        "recipe": "dpo",
        "config": run_config,
        "train/log": train_log.log,
        "method": run_config["method"],
        "data/counts": counts,
        **{key: value for key, value in train_log.last.items() if key != "train/loss"},  # the last window's
        "parallelism": run_config["parallelism"],
        "data/format": run_config["data_format"],
        "global_batch_size": run_config["global_batch_size"],
        "model/trainable_parameters": parameters[0],
        "model/total_parameters": parameters[1],
    }


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


# The flags ``dataloaders`` takes, by their names.
LOADER_FLAGS = ("per_device_train_batch_size", "per_device_eval_batch_size", "seed")


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
    set_keep_gathered_in_one_process(accelerator)  # FSDP in 1 process: no resharding after forward
    set_seed(args.seed)
    set_quiet_library_logs(accelerator)  # library warnings once, from the main process; no colour codes in log files
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/dpo.py")  # or a clear refusal
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason}); method: {method}")
    data_parallel_size = accelerator.num_processes if parallelism.name in ("ddp", "fsdp") else 1
    layout, checkpoints_dir = "fsdp" if parallelism.name == "fsdp" else "replica", output_dir / "checkpoints"
    checkpoint = set_start_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)
    args.gradient_accumulation_steps, batch_shape = keep_global_batch(  # a resume keeps its global batch
        accelerator.num_processes, checkpoint, data_parallel_size=data_parallel_size, **flags(args, BATCH_FLAGS)
    )

    # ------------------------------------------------------------------------------- data
    with accelerator.main_process_first():  # every row checked before any model is built (or pretrained)
        raw_datasets, fmt = load_raw_datasets(  # preference_format checks the rows and names the format
            **flags(args, DATA_FLAGS), row_format=preference_format, default_data=stdlib_name_pairs
        )
    if not (args.train_file or args.dataset_name):
        accelerator.print(BUNDLED_DATA)
    # The adapter to continue (offline: the SFT recipe's) and its base, else the offline base (its settings printed).
    args.adapter_name_or_path, args.model_name_or_path = starting_point(
        accelerator, lora, output_dir, HERE, **flags(args, START_FLAGS)
    )
    config = causal_lm_config(accelerator, args.model_name_or_path, args.load_in_4bit, args.trust_remote_code)
    args.max_length = max_length_within_positions(accelerator, config, args.model_name_or_path, args.max_length)
    tokenizer = chat_tokenizer(accelerator, args.model_name_or_path, args.trust_remote_code, args.tokenizer_name)
    add_chat_template(accelerator, tokenizer)  # conversational pairs are tokenized with it
    with accelerator.main_process_first():  # the main process tokenizes first, the others read its cache
        train_dataset, eval_dataset, counts = tokenize_pairs(
            accelerator, raw_datasets, fmt, tokenizer, args.max_length, args.max_prompt_length
        )
    train_dataloader, eval_dataloader, reference_dataloader = dataloaders(
        train_dataset, eval_dataset, tokenizer, data_parallel_size, **flags(args, LOADER_FLAGS)
    )

    # ------------------------------------------------------------------------------ model
    model = load_model(  # a continued adapter (its frozen copy: the reference), a new one (the base), or none
        accelerator, args.model_name_or_path, config, lora=lora, **flags(args, POLICY_FLAGS)
    )
    if args.disable_dropout and (switched := disable_dropout(model)):  # TRL's default: at step 0, policy = reference
        accelerator.print(DROPOUT_OFF.format(switched))
    trainable, total = parameter_counts(accelerator, model, args.model_name_or_path)
    if args.load_in_4bit and parallelism.name == "fsdp":  # built empty: the weights come now, a layer at a time
        load_4bit_sharded(accelerator, model, args.model_name_or_path)  # the main process reads, the others receive
        disable_fsdp_ram_efficient_loading()  # env: transformers must not load to meta on rank 1+ again

    # ------------------------------------------------------------------ optimizer and scheduler
    # Each process sees 1/data_parallel_size of the batches, grouped by the accumulation (the last group may be short).
    steps_per_epoch = math.ceil(len(train_dataloader) / (data_parallel_size * args.gradient_accumulation_steps))
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    optimizer, lr_scheduler = adamw_and_scheduler(accelerator, model, max_train_steps, **flags(args, OPTIMIZER_FLAGS))

    # ------------------------------------------------------------------------------ prepare
    if parallelism.name == "fsdp":  # one FSDP unit per decoder block; an offload that cannot fit is refused now
        set_fsdp_units(accelerator, model)
    model, optimizer, train_dataloader, eval_dataloader, reference_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, reference_dataloader, lr_scheduler
    )
    # A full fine-tune's reference: the model as loaded, before any step (and before a resume loads trained weights).
    precomputed = {
        split: precompute_reference(accelerator, model, loader) if args.precompute_reference else None
        for split, loader in (("train", reference_dataloader), ("eval", eval_dataloader))
    }
    sft_rows, sft_fmt = as_sft_rows(raw_datasets["validation"], fmt)
    exact_samples = 0 if args.skip_eval else args.exact_match_samples  # greedy answers, scored again at the end
    exact_rows, exact_before = exact_match_before(
        accelerator, model, tokenizer, sft_rows, sft_fmt, exact_samples, layout == "fsdp", args.seed
    )
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel_size
    run_config = {**vars(args), "method": method, "parallelism": parallelism.name, "data_format": fmt}
    run_config |= {"global_batch_size": global_batch_size, "max_train_steps": max_train_steps}
    accelerator.init_trackers("dpo", {k: v for k, v in run_config.items() if not isinstance(v, list | None)})
    loss_kw = flags(args, LOSS_FLAGS)  # every step's loss and the evaluation's

    # ---------------------------------------------------------------------- training loop
    load_state, write_state = adapter_checkpoints(accelerator) if lora else (None, None)  # LoRA: the adapter alone
    unchanged = unchanged_by_a_resume(len(train_dataloader.dataset), lora, **flags(args, ADAPTER_FLAGS))
    resume = load_checkpoint(
        accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps, lr_scheduler, load_state, unchanged
    )
    completed_steps, train_log = resume.completed_steps, TrainLog(resume.history, args.logging_steps, max_train_steps)
    record = RunRecord(accelerator, max_train_steps, resume.history.get("train/loss_curve"), args.perf_warmup_steps)
    save_at_step_end = checkpoint_saver(  # a checkpoint when due, or on SIGTERM or Ctrl-C (then exit)
        accelerator,
        stop=stop,
        checkpoints_dir=checkpoints_dir,
        steps_per_epoch=steps_per_epoch,
        max_train_steps=max_train_steps,
        write_state=write_state,
        layout=layout,
        history=lambda: {"train/loss_curve": record.losses(), "train/log": train_log.log},  # a resume goes on
        batch=batch_shape,
        unchanged=unchanged,
        **flags(args, CHECKPOINT_FLAGS),
    )
    accelerator.print(f"config: {json.dumps(run_config, sort_keys=True, default=str)}")
    progress_bar = tqdm(total=max_train_steps, initial=completed_steps, disable=not accelerator.is_local_main_process)
    for epoch in range(resume.epoch, math.ceil(max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)  # reseeds the shuffling: same order on every process and after a resume
        skip = resume.batches_to_skip if epoch == resume.epoch else 0  # a resumed epoch: the batches already seen
        active_dataloader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        batches = iter(record.timed(active_dataloader))  # the loader's batches as they are, each wait timed
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
            optimizer.zero_grad()
            completed_steps += 1
            progress_bar.update(1)
            sums = accelerator.reduce(sums, "sum")  # the global sums stay on the device: only the log reads them
            step_means = metric_means(sums[:-1], step_pairs, args.rpo_alpha)  # on the device until a log reads it
            record.step(completed_steps, step_means[0], samples=step_pairs, tokens=sums[-1])
            train_log.add(accelerator, completed_steps, step_means, lr_scheduler.get_last_lr()[0])  # every N: logged
            lr_scheduler.step()  # after the log, which reports the rate this step used (as the Trainer)
            save_at_step_end(completed_steps)  # a checkpoint when due; SIGTERM or Ctrl-C: one, then all exit
    progress_bar.close()

    # ------------------------------------------------------------------------------- save
    save(accelerator, model, tokenizer, output_dir, trained_only=lora)  # before the evaluation: it cannot lose them

    # ------------------------------------------------------------------------- evaluation
    results = run_results(run_config, train_log, counts=counts, parameters=(trainable, total))
    results |= evaluate(accelerator, model, [] if args.skip_eval else eval_dataloader, precomputed["eval"], **loss_kw)
    results |= exact_match_results(accelerator, model, tokenizer, exact_rows, sft_fmt, exact_before)
    record.write(output_dir, results, model)  # a collective
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)  # DDP gone before gloo
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
