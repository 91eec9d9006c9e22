"""Supervised fine-tuning of a causal language model (Llama, Qwen, Mistral, Gemma, GPT-2 ...) with LoRA (default),
QLoRA (``--load_in_4bit``) or full fine-tuning, on one GPU, two GPUs with DDP or FSDP2, or one model split over two
devices: one training loop through ``accelerator.prepare()``, the launch config picks.

What it teaches: the loss only on the answers (every prompt, system and user token has label -100), normalised
exactly: the loss of an optimizer step is the sum of the token losses over *all* answer tokens of the global batch
(every process, every accumulation micro-batch) divided by their count, so 1 process x batch 8, 2 processes x 4 and
1 process x 4 x 2 accumulation give the same losses and weights (the 2024 gradient-accumulation bug of transformers was
a per-micro-batch mean). Data in the formats TRL users have (``messages``, ``prompt``/``completion``, ``text``), from
JSONL/JSON/CSV/Parquet files or a Hub dataset. The LoRA adapter is saved for ``PeftModel.from_pretrained``, and with
``--merge_and_save`` the merged model for ``AutoModelForCausalLM.from_pretrained``.

With no arguments it runs offline on something real: the model ``recipes/train_lm.py`` saved in ``outputs/train_lm``
(or, when there is none, a small one it pretrains first with that recipe, printed), learning whether standard-
library names are classes, functions or methods: the exact match of its answers on held-out names, before and after
training, is in the log (README: 0 % -> 74 %; it trains with --max_train_steps 600 --learning_rate 1e-3 unless told
otherwise).

Launch (from the repository root):
    # CPU smoke run, or one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/llm_finetune.py --max_train_steps 20
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/llm_finetune.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --train_file chats.jsonl
    # 7B QLoRA on two 24 GB GPUs, one replica each:
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/llm_finetune.py \\
        --model_name_or_path meta-llama/Llama-2-7b-hf --load_in_4bit --mixed_precision bf16 --gradient_checkpointing
    # 13B LoRA sharded over two GPUs (FSDP2), or a model split over both with a device_map:
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/llm_finetune.py \\
        --model_name_or_path ... --mixed_precision bf16 --gradient_checkpointing
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml recipes/llm_finetune.py \\
        --model_name_or_path ...

To use it in your project, copy recipes/llm_finetune.py, recipes/llm_kit/ and shared/ (and accelerate_configs/, which
the launch lines name): the kit beside the recipe, shared/ beside it or one folder up. Without --model_name_or_path and
a model in outputs/train_lm, it pretrains one with recipes/train_lm.py, which it looks for beside itself.

Writes to --output_dir: ``adapter_model.safetensors`` + ``adapter_config.json`` (LoRA/QLoRA) or the whole model (full
fine-tune), the tokenizer, ``merged/`` with ``--merge_and_save``, ``results.json``, and ``checkpoints/step_N``
every --checkpointing_steps (N steps or epoch) and after the last step (adapter, optimizer, scheduler, sampler and RNG
states; the base model is not copied into them).
"""

import argparse
import contextlib
import itertools
import json
import logging
import math
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from accelerate import PartialState
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
from llm_kit.loading import causal_lm_config, default_base_model, parameter_counts, save_merged
from llm_kit.loading import max_length_within_positions, set_fsdp_units
from shared.model_split import split_devices
from shared.results import RunRecord
from shared.lora import LORA_FLAGS
from shared.flags import add_reliability_flags, flags, positive_float, positive_int, prepare_output_dir
from shared.accelerator import build_accelerator, set_gpu_index, set_quiet_library_logs
from shared.parallelism import choose_parallelism
from shared.errors import report_recipe_errors, install_peer_exit_hooks, set_stop_with_launcher
from shared.fsdp import set_fsdp_on_cpu
from shared.sampling import LengthGroupedShuffledSampler
from llm_kit.adapters import MODEL_FLAGS, adapter_checkpoints, load_model, set_offline_defaults
from llm_kit.checkpoints import BATCH_FLAGS, CHECKPOINT_FLAGS, checkpoint_saver, unchanged_by_a_resume
from llm_kit.optimizer import OPTIMIZER_FLAGS, adamw_and_scheduler
from llm_kit.sharded_4bit import load_4bit_sharded
from llm_kit.sft_data import (
    DATA_FLAGS,
    add_chat_template,
    best_fit_decreasing,
    chat_tokenizer,
    check_batches,
    check_packing,
    collate,
    load_raw_datasets,
    tokenize_datasets,
)
from llm_kit.loss import token_losses
from llm_kit.sft_eval import exact_match_before, exact_match_results, generate_samples


# What the offline default model (no --model_name_or_path) trains with unless a flag says otherwise.
OFFLINE_DEFAULT_SETTINGS = {"max_train_steps": 600, "learning_rate": 1e-3, "lr_scheduler_type": "cosine"}
# The flags ``load_model`` takes here: the shared ones, the length a device_map plans for, and whether to merge.
SFT_MODEL_FLAGS = (*MODEL_FLAGS, "max_length", "merge_and_save")
# The flags ``unchanged_by_a_resume`` takes here: the adapter's, and which tokens are trained.
SFT_RESUME_FLAGS = (*LORA_FLAGS, "assistant_only_loss")
# Said when no data flag is given: a user's model would otherwise train on the offline questions without a word.
BUNDLED_DATA = (
    "data: no --train_file or --dataset_name, so this run trains on the bundled questions (is a standard-library name "
    "a class, a function or a method?); pass yours with --train_file (JSON Lines, CSV or Parquet: messages, prompt + "
    "completion, or text)"
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument_group("data").add_argument
    add("--train_file", help="Training data (.jsonl/.json, .csv, .parquet): messages, prompt + completion or text.")
    add("--validation_file", help="Validation data, same format (default: held out from the training data).")
    add("--dataset_name", help="A Hugging Face Hub dataset (needs internet), e.g. 'trl-lib/Capybara'.")
    add("--dataset_config_name", help="The Hub dataset's configuration, if it has several.")
    add("--validation_split_percentage", type=positive_float, default=5, help="Held out without a validation split.")
    add(
        "--max_length",
        type=positive_int,
        help="Cut samples to this many tokens (reported; default 1024, TRL's, or the model's positions if fewer).",
    )
    add("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training samples.")
    add("--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation samples.")
    add(
        "--packing",
        action="store_true",
        help="Pack the samples into rows of --max_length tokens (best fit decreasing, TRL's packing=True), each "
        "batch flattened into one row without padding: the same losses (docs/llm_finetune.md).",
    )
    add("--group_by_length", action="store_true", help="Batch samples of similar length together (less padding).")
    add(
        "--assistant_only_loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Train a conversation's answers only; --no-assistant_only_loss: every token (TRL's default).",
    )
    add = parser.add_argument_group("model").add_argument
    add("--model_name_or_path", help="Folder or Hub name of a causal LM (default: outputs/train_lm, pretrained).")
    add("--tokenizer_name", help="Folder or Hub name of the tokenizer, when the model's folder holds none.")
    add("--trust_remote_code", action="store_true", help="Allow a Hub model to run its own code.")
    add(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp", "device_map"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; 1 process seeing >= 2 GPUs: "
        "device_map; else single).",
    )
    add("--full_finetune", action="store_true", help="Train every weight instead of a LoRA adapter.")
    add("--load_in_4bit", action="store_true", help="QLoRA: the base model in 4-bit NF4 (bitsandbytes), LoRA on top.")
    add("--lora_r", type=positive_int, default=8, help="LoRA rank.")
    add("--lora_alpha", type=positive_float, default=16, help="LoRA scaling: updates are scaled by alpha / r.")
    add(
        "--lora_dropout",
        type=float,
        default=0.0,
        help="Dropout on the LoRA path (PEFT's default: 0; > 0 keeps a dropped copy of every adapted layer's "
        "input, and its mask, for backward).",
    )
    add("--lora_target_modules", nargs="+", default=["all-linear"], help="Modules to adapt; all-linear: but the head.")
    add("--gradient_checkpointing", action="store_true", help="Recompute activations in backward: less memory.")
    add = parser.add_argument_group("training").add_argument
    add("--per_device_train_batch_size", type=positive_int, default=4, help="Samples (packed: rows) per forward.")
    add("--per_device_eval_batch_size", type=positive_int, help="Samples per evaluation batch (default: training's).")
    add(
        "--gradient_accumulation_steps",
        type=positive_int,
        help="Forward/backward passes per optimizer step (default: 1; on a resume, what keeps the checkpoint's "
        "global batch in this process count).",
    )
    add("--num_train_epochs", type=positive_int, default=1, help="Passes over the data (unless --max_train_steps).")
    add("--max_train_steps", type=positive_int, help="Stop after this many optimizer steps (offline default: 600).")
    add(
        "--learning_rate",
        type=positive_float,
        help="Peak AdamW learning rate (default 2e-4: LoRA 1e-4..3e-4, full ~1e-5; with the offline default model: "
        "1e-3).",
    )
    add("--weight_decay", type=float, default=0.0, help="AdamW weight decay.")
    add("--adam_epsilon", type=positive_float, default=1e-8, help="AdamW's epsilon in m / (sqrt(v) + epsilon).")
    add("--lr_scheduler_type", help="transformers.get_scheduler name: linear (TRL's; the default), cosine, ...")
    add("--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps.")
    add("--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm to this (0 disables).")
    add("--mixed_precision", choices=["no", "fp16", "bf16"], help="Override the config's mixed precision.")
    add("--seed", type=int, default=42, help="Seed for the LoRA initialisation, shuffling and dropout.")
    add = parser.add_argument_group("output").add_argument
    add("--output_dir", default="outputs/llm_finetune", help="Adapter or model, tokenizer, results.json, checkpoints.")
    add("--merge_and_save", action="store_true", help="Also save the base model with the adapter merged in (merged/).")
    add("--generate_samples", type=int, default=0, help="After training, answer the first N validation prompts.")
    add("--sample_tokens", type=int, default=48, help="Tokens to generate per answer with --generate_samples.")
    add(
        "--exact_match_samples",
        type=int,
        help="Score greedy answers to N (shuffled) validation prompts by exact match, before and after training "
        "(default: 100 when the answers are short, as in the offline data, else none; 0 skips; not under FSDP).",
    )
    add("--report_to", help="Trackers to log to: tensorboard, wandb, all, ... (default: none).")
    add("--logging_steps", type=positive_int, default=10, help="Log train/loss every N optimizer steps.")
    add("--skip_eval", action="store_true", help="Skip the final evaluation (eval/* are NaN): speed benchmarks.")
    add("--perf_warmup_steps", type=int, default=1, help="Optimizer steps left out of the throughput numbers.")
    add_reliability_flags(parser)  # checkpoints, resume, --save_on_each_node, --dist_timeout (shared by the recipes)
    args = parser.parse_args(argv)
    if args.full_finetune and args.load_in_4bit:
        parser.error(
            "--load_in_4bit trains a LoRA adapter on a frozen 4-bit model; it cannot be combined with --full_finetune"
        )
    if args.packing and args.group_by_length:
        parser.error(
            "--group_by_length batches samples of similar length; --packing fills rows of --max_length "
            "tokens, all of about one length: choose one"
        )
    if args.validation_file and not args.train_file:
        parser.error("--validation_file needs --train_file")
    # The offline default model is small and barely pretrained: it learns visibly only with more and larger steps
    # than a pretrained LLM wants, on the schedule docs/llm_finetune.md measured (0 % -> 74 % exact match). Each stays
    # the user's to set; a user's model gets TRL's defaults.
    offline = args.model_name_or_path is None
    args.offline_default_settings = set_offline_defaults(args, OFFLINE_DEFAULT_SETTINGS if offline else {})
    args.learning_rate = args.learning_rate or 2e-4
    args.lr_scheduler_type = args.lr_scheduler_type or "linear"
    return args


# The flags ``dataloaders`` takes, by their names.
LOADER_FLAGS = (
    "packing",
    "max_length",
    "group_by_length",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "seed",
)


def dataloaders(
    train_dataset,
    eval_dataset,
    tokenizer,
    data_parallel_size: int,
    *,
    packing,
    max_length,
    group_by_length,
    per_device_train_batch_size,
    seed,
    per_device_eval_batch_size,
) -> tuple[DataLoader, ...]:
    """The training loader (shuffled samples, or batches of similar length; with --packing shuffled rows of
    --max_length tokens, each batch flattened into one row without padding), refused if it cannot give every
    data-parallel process a batch, and the evaluation loader (padded batches of samples, in order)."""
    sampler, collate_fn = None, partial(collate, pad_token_id=tokenizer.pad_token_id)
    if packing:  # the loader's items are rows (lists of sample indices): it shuffles rows, a batch is rows
        samples, lengths = train_dataset, [len(ids) for ids in train_dataset["input_ids"]]
        train_dataset, pad_token_id = best_fit_decreasing(lengths, max_length), tokenizer.pad_token_id
        collate_fn = lambda rows: collate([samples[i] for row in rows for i in row], pad_token_id, packing=True)
        fill = sum(lengths) / (len(train_dataset) * max_length)  # a step computes the rows' empty ends too
        PartialState().print(
            f"packing: {len(samples)} training samples in {len(train_dataset)} rows of up to "
            f"{max_length} tokens, {fill:.1%} full"
        )
    if group_by_length:  # ours, not transformers' LengthGroupedSampler: that has no set_epoch (resumes differ)
        lengths = [len(ids) for ids in train_dataset["input_ids"]]
        sampler = LengthGroupedShuffledSampler(lengths, per_device_train_batch_size, seed)
    # The loader gets its own generator: one without draws a seed from the global RNG whenever it starts iterating.
    # Pinned on a GPU: the prepared loader's non_blocking copy (build_accelerator) does not wait for it.
    pinned = torch.cuda.is_available()
    train_dataloader = DataLoader(
        train_dataset,
        per_device_train_batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=collate_fn,
        pin_memory=pinned,
    )
    check_batches(train_dataloader, data_parallel_size)
    eval_dataloader = DataLoader(
        eval_dataset,
        per_device_eval_batch_size or per_device_train_batch_size,
        collate_fn=partial(collate, pad_token_id=tokenizer.pad_token_id),
        pin_memory=pinned,
    )
    return train_dataloader, eval_dataloader


def save(accelerator, model, tokenizer, output_dir: Path, trained_only: bool) -> None:
    """The model (or, ``trained_only``, a PeftModel's adapter: adapter_model.safetensors + adapter_config.json) and
    the tokenizer, for ``from_pretrained``, written whole or not at all (``save_final``). A collective: the full
    weights are gathered onto the main process (every shard of FSDP2, every device of a split), for LoRA only the
    adapter's."""
    accelerator.wait_for_everyone()
    state_dict = gathered_state_dict(accelerator, model, trained_only=trained_only)

    def write(folder: Path) -> None:
        accelerator.unwrap_model(model).save_pretrained(folder, state_dict=state_dict)
        tokenizer.save_pretrained(folder)

    save_final(accelerator, output_dir, write, output_dir / "checkpoints", state_dict)
    accelerator.print(f"saved the {'adapter' if trained_only else 'model'} and the tokenizer to {output_dir}")


def run_results(run_config: dict, parallelism_requested: str, *, counts: dict, parameters: tuple[int, int]) -> dict:
    """What ``results.json`` holds besides the evaluation: the resolved configuration, the model, method and
    parallelism, the data's format and counts, and the model's trainable and total parameters."""
    return {
        "recipe": "llm_finetune",
        "config": run_config,
        "model": run_config["model_name_or_path"],
        "method": run_config["method"],
        "parallelism": run_config["parallelism"],
        "parallelism_requested": parallelism_requested,
        "data/format": run_config["data_format"],
        "data/counts": counts,
        "global_batch_size": run_config["global_batch_size"],
        "model/trainable_parameters": parameters[0],
        "model/total_parameters": parameters[1],
    }


def log_train_loss(accelerator, progress_bar, record, lr_scheduler, completed_steps: int, logging_steps: int) -> None:
    """The mean loss of the steps since the last log (a sync point: it reads them) on the progress bar, and with the
    learning rate to the trackers (``train/loss``, ``train/learning_rate``)."""
    since_last_log = completed_steps % logging_steps or logging_steps
    loss, lr = statistics.fmean(record.losses()[-since_last_log:]), lr_scheduler.get_last_lr()[0]
    progress_bar.set_postfix({"train/loss": f"{loss:.4f}"})
    accelerator.log({"train/loss": loss, "train/learning_rate": lr}, step=completed_steps)


def evaluate(accelerator, model, eval_dataloader) -> dict:
    """Loss and perplexity on the answer tokens of every validation sample, each counted once (``eval/*``)."""
    model.eval()
    loss_sum, num_tokens, num_samples = 0.0, 0, 0
    for batch in eval_dataloader:
        with torch.no_grad():
            _, per_sample = token_losses(model, batch)
        tokens = (batch["labels"][:, 1:] != -100).sum(dim=1).to(per_sample.device)
        # gather_for_metrics drops the samples Accelerate repeated to give every process a full last batch.
        per_sample, tokens = accelerator.gather_for_metrics((per_sample, tokens))
        loss_sum += per_sample.sum().item()
        num_tokens += int(tokens.sum())
        num_samples += len(tokens)
    loss = loss_sum / num_tokens if num_tokens else math.nan
    perplexity = math.exp(loss) if num_tokens else math.nan
    accelerator.print(
        f"eval: loss {loss:.4f}, perplexity {perplexity:.2f} on the answer tokens of {num_samples} "
        f"validation samples ({num_tokens} tokens)"
    )
    return {
        "eval/loss": loss,
        "eval/perplexity": perplexity,
        "eval/num_samples": num_samples,
        "eval/num_tokens": num_tokens,
    }


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()
    lora, method = not args.full_finetune, "qlora" if args.load_in_4bit else "full" if args.full_finetune else "lora"

    # ------------------------------------------------------------------ Accelerator and seed
    set_stop_with_launcher()  # Linux: dies with its launcher (a SIGKILLed launcher cannot stop its workers)
    stop = install_stop_on_signals(Path(args.output_dir) / "checkpoints")  # SIGTERM, Ctrl-C: checkpoint, then exit
    install_peer_exit_hooks()  # 2+ processes: a rank another one stopped says so in one line
    set_gpu_index()  # one process on a GPU: env ACCELERATE_TORCH_DEVICE=cuda:N, so results say cuda:0, not cuda
    accelerator = build_accelerator(  # no gradient_accumulation_steps: the loop counts a step's tokens, then syncs
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
    if args.offline_default_settings:  # e.g. "the offline default model trains with --learning_rate 0.001 (...)"
        accelerator.print(args.offline_default_settings)
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/llm_finetune.py")  # or a clear refusal
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason}); method: {method}")
    data_parallel_size = accelerator.num_processes if parallelism.name in ("ddp", "fsdp") else 1
    layout, checkpoints_dir = "fsdp" if parallelism.name == "fsdp" else "replica", output_dir / "checkpoints"
    checkpoint = set_start_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)
    args.gradient_accumulation_steps, batch_shape = keep_global_batch(  # a resume keeps its global batch
        accelerator.num_processes, checkpoint, data_parallel_size=data_parallel_size, **flags(args, BATCH_FLAGS)
    )

    # ------------------------------------------------------------------------------- data
    with accelerator.main_process_first():  # every row checked before any model is built (or pretrained)
        raw_datasets, fmt = load_raw_datasets(**flags(args, DATA_FLAGS))
    if not (args.train_file or args.dataset_name):
        accelerator.print(BUNDLED_DATA)
    args.model_name_or_path = args.model_name_or_path or default_base_model(accelerator, output_dir, HERE)
    config = causal_lm_config(accelerator, args.model_name_or_path, args.load_in_4bit, args.trust_remote_code)
    args.max_length = max_length_within_positions(accelerator, config, args.model_name_or_path, args.max_length)
    tokenizer = chat_tokenizer(accelerator, args.model_name_or_path, args.trust_remote_code, args.tokenizer_name)
    with accelerator.main_process_first():  # the main process tokenizes first (datasets caches it), the others read
        if fmt == "messages":  # the recipe's template where the model has none: saved only when trained with
            add_chat_template(accelerator, tokenizer)
        train_dataset, eval_dataset, counts, data_format = tokenize_datasets(  # data_format: as the user gave it
            accelerator, raw_datasets, fmt, tokenizer, args.max_length, args.assistant_only_loss
        )
    train_dataloader, eval_dataloader = dataloaders(
        train_dataset, eval_dataset, tokenizer, data_parallel_size, **flags(args, LOADER_FLAGS)
    )

    # ------------------------------------------------------------------------------ model
    split_over = split_devices(accelerator.device) if parallelism.name == "device_map" else []
    model = load_model(  # frozen + an adapter (LoRA), or every weight trained; split over devices with a device_map
        accelerator, args.model_name_or_path, config, lora=lora, devices=split_over, **flags(args, SFT_MODEL_FLAGS)
    )
    trainable, total = parameter_counts(accelerator, model, args.model_name_or_path)
    if args.load_in_4bit and parallelism.name == "fsdp":  # built empty: the weights come now, a layer at a time
        load_4bit_sharded(accelerator, model, args.model_name_or_path)  # the main process reads, the others receive
        disable_fsdp_ram_efficient_loading()  # env: done above; transformers must not load to meta on rank 1+ again

    # ------------------------------------------------------------------ optimizer and scheduler
    # Each process sees 1/data_parallel_size of the batches, grouped by the accumulation (the last group may be short).
    steps_per_epoch = math.ceil(len(train_dataloader) / (data_parallel_size * args.gradient_accumulation_steps))
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    optimizer, lr_scheduler = adamw_and_scheduler(accelerator, model, max_train_steps, **flags(args, OPTIMIZER_FLAGS))

    # ------------------------------------------------------------------------------ prepare
    if parallelism.name == "fsdp":  # one FSDP unit per decoder block; an offload that cannot fit is refused now
        set_fsdp_units(accelerator, model)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    check_packing(accelerator.unwrap_model(model), accelerator.device, args.packing)  # refused if packed samples mix
    exact_samples = 0 if args.skip_eval else args.exact_match_samples  # greedy answers, scored again at the end
    exact_rows, exact_before = exact_match_before(
        accelerator, model, tokenizer, raw_datasets["validation"], fmt, exact_samples, layout == "fsdp", args.seed
    )
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel_size
    run_config = {**vars(args), "method": method, "parallelism": parallelism.name, "data_format": data_format}
    run_config |= {"num_processes": accelerator.num_processes, "global_batch_size": global_batch_size}
    run_config |= {"max_train_steps": max_train_steps, "mixed_precision": accelerator.mixed_precision}
    accelerator.init_trackers("llm_finetune", {k: v for k, v in run_config.items() if not isinstance(v, list | None)})

    # ---------------------------------------------------------------------- training loop
    load_state, write_state = adapter_checkpoints(accelerator) if lora else (None, None)  # LoRA: the adapter alone
    unchanged = unchanged_by_a_resume(len(train_dataloader.dataset), lora, **flags(args, SFT_RESUME_FLAGS))
    resume = load_checkpoint(
        accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps, lr_scheduler, load_state, unchanged
    )
    completed_steps, curve = resume.completed_steps, resume.history.get("train/loss_curve")  # a resume goes on
    devices = sorted(set(split_over), key=str) or None  # a split model: results name every device it uses
    record = RunRecord(accelerator, max_train_steps, curve, args.perf_warmup_steps, devices)
    save_at_step_end = checkpoint_saver(  # a checkpoint when due, or on SIGTERM or Ctrl-C (then exit)
        accelerator,
        stop=stop,
        checkpoints_dir=checkpoints_dir,
        steps_per_epoch=steps_per_epoch,
        max_train_steps=max_train_steps,
        write_state=write_state,
        layout=layout,
        history=lambda: {"train/loss_curve": record.losses()},  # the whole history so far: a resume goes on with it
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
            # Exact normalisation: the step's loss is the sum over *all* its answer tokens (every micro-batch,
            # every process) over their count, known before the first backward (sync point: one all-reduce). DDP
            # and FSDP average the gradients of N processes, each holding 1/N of the batch: hence the N.
            step_tokens = accelerator.reduce(sum((b["labels"][:, 1:] != -100).sum() for b in micro_batches), "sum")
            step_loss = torch.zeros((), device=accelerator.device)
            for index, batch in enumerate(micro_batches):  # all but the last skip DDP's all-reduce / FSDP2's scatter
                with accelerator.no_sync(model) if index < len(micro_batches) - 1 else contextlib.nullcontext():
                    loss_sum, _ = token_losses(model, batch)
                    accelerator.backward(loss_sum * data_parallel_size / step_tokens)
                step_loss += loss_sum.detach()
            if args.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            completed_steps += 1
            progress_bar.update(1)
            # The global loss, tokens (padding aside) and samples stay on the device: only the log below reads.
            sizes = sum(torch.stack([b["num_tokens"].sum(), (b["num_tokens"] > 0).sum()]) for b in micro_batches)
            real_tokens, samples = accelerator.reduce(sizes, "sum")  # (packed rows: each process's samples differ)
            global_loss = accelerator.reduce(step_loss, "sum") / step_tokens
            record.step(completed_steps, global_loss, samples=samples, tokens=real_tokens, answer_tokens=step_tokens)
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                log_train_loss(accelerator, progress_bar, record, lr_scheduler, completed_steps, args.logging_steps)
            lr_scheduler.step()  # after the log, which reports the rate this step used (as the Trainer)
            save_at_step_end(completed_steps)  # a checkpoint when due; SIGTERM or Ctrl-C: one, then all exit
    progress_bar.close()

    # ------------------------------------------------------------------------------- save
    save(accelerator, model, tokenizer, output_dir, trained_only=lora)  # before the evaluation: it cannot lose them
    if args.merge_and_save and lora:
        save_merged(accelerator, args.model_name_or_path, output_dir, tokenizer, args.trust_remote_code)

    # ------------------------------------------------------------------------- evaluation
    results = run_results(run_config, args.parallelism, counts=counts, parameters=(trainable, total))
    results |= evaluate(accelerator, model, [] if args.skip_eval else eval_dataloader)
    results["samples"] = generate_samples(  # (the others wait just below)
        accelerator, model, tokenizer, raw_datasets["validation"], fmt, args.generate_samples, args.sample_tokens
    )
    results |= exact_match_results(accelerator, model, tokenizer, exact_rows, fmt, exact_before)
    record.write(output_dir, results, model)  # a collective
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)  # DDP gone before gloo
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
