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
training, is in the log (README: 0 % -> 74 % with --max_train_steps 600 --learning_rate 1e-3).

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

Writes to --output_dir: ``adapter_model.safetensors`` + ``adapter_config.json`` (LoRA/QLoRA) or the whole model (full
fine-tune), the tokenizer, ``merged/`` with ``--merge_and_save``, ``results.json``, and ``checkpoints/step_N``
(adapter, optimizer, scheduler, sampler and RNG states; the base model is not copied into them).
"""

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import torch
from accelerate import init_empty_weights
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

# PEFT, which transformers imports, imports bitsandbytes, which on a CPU with AVX-512 bf16 warns on every process that
# an optional kernel is not installed (bitsandbytes 0.50; the CPU path works without it): quieted before that import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler  # noqa: E402

# The helper module: shared/ next to this file (a copied recipe) or one folder up (this repository), first on sys.path
# so that no installed package named "shared" shadows it.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
from shared.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from shared.data import stdlib_names  # noqa: E402
from shared.flops import lm_flops_per_token  # noqa: E402
from shared.fsdp import (  # noqa: E402
    check_offload_fits_host_ram,
    gathered_state_dict,
    sharding_facts,
    trained_weights_only_in_checkpoints,
    wrap_at_blocks,
)
from shared.hang_dump import HangDump  # noqa: E402
from shared.sharded_4bit import empty_4bit_model, load_4bit_sharded  # noqa: E402
from shared.model_split import (  # noqa: E402
    dispatch_on_devices,
    execution_devices,
    find_block_list,
    lm_head_cost_in_blocks,
    plan_device_map,
    split_devices,
)
from shared.results import ThroughputMeter, model_state_bytes, per_rank, write_results  # noqa: E402
from shared.runtime import (  # noqa: E402
    RecipeError,
    build_accelerator,
    choose_parallelism,
    positive_float,
    positive_int,
    main_process_alone,
    prepare_output_dir,
    run_facts,
    steps_or_epoch,
)
from shared.sampling import LengthGroupedShuffledSampler  # noqa: E402

DATA_FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
ROLES = {"system", "user", "assistant"}
# For tokenizers without a chat template: every message is "<|role|>\n" + content + the end-of-sequence token, and the
# generation prompt is "<|assistant|>\n" (the tags are plain text, not new tokens, so the vocabulary stays as it is).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}{% "
    "endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Encoder-only architectures that AutoModelForCausalLM would load anyway (BertLMHeadModel ...), but are not causal LMs.
ENCODER_ONLY = {
    "bert",
    "roberta",
    "xlm-roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta",
    "deberta-v2",
    "mpnet",
    "camembert",
    "modernbert",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--train_file", help="Training data: .jsonl/.json, .csv or .parquet with messages, prompt+completion or text."
    )
    data.add_argument(
        "--validation_file",
        help="Validation data, same format (default: --validation_split_percentage of the training data).",
    )
    data.add_argument("--dataset_name", help="A Hugging Face Hub dataset (needs internet), e.g. 'trl-lib/Capybara'.")
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
        default=512,
        help="Truncate samples to this many tokens (counted and reported).",
    )
    data.add_argument("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training samples.")
    data.add_argument(
        "--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation samples."
    )
    data.add_argument(
        "--packing",
        action="store_true",
        help="Pack samples into rows of --max_length tokens; each keeps its own positions and attends only to itself.",
    )
    data.add_argument(
        "--group_by_length", action="store_true", help="Batch samples of similar length together (less padding)."
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name_or_path",
        default=None,
        help="Local folder or Hub name of a causal LM. Default: outputs/train_lm, pretrained first if missing.",
    )
    model.add_argument("--trust_remote_code", action="store_true", help="Allow a Hub model to run its own code.")
    model.add_argument(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp", "device_map"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; 1 process seeing >= 2 GPUs: "
        "device_map; else single).",
    )
    model.add_argument("--full_finetune", action="store_true", help="Train every weight instead of a LoRA adapter.")
    model.add_argument(
        "--load_in_4bit",
        action="store_true",
        help="QLoRA: the base model in 4-bit NF4 with double quantization (bitsandbytes), a LoRA adapter on top.",
    )
    model.add_argument("--lora_r", type=positive_int, default=8, help="LoRA rank.")
    model.add_argument(
        "--lora_alpha", type=positive_float, default=16, help="LoRA scaling: updates are scaled by alpha / r."
    )
    model.add_argument(
        "--lora_dropout", type=float, default=0.05, help="Dropout on the LoRA path (0 for exact comparisons)."
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
    training = parser.add_argument_group("training")
    training.add_argument(
        "--per_device_train_batch_size", type=positive_int, default=4, help="Samples per process per forward pass."
    )
    training.add_argument(
        "--per_device_eval_batch_size",
        type=positive_int,
        default=None,
        help="Samples per evaluation batch (default: training's).",
    )
    training.add_argument(
        "--gradient_accumulation_steps",
        type=positive_int,
        default=1,
        help="Forward/backward passes per optimizer step.",
    )
    training.add_argument(
        "--num_train_epochs",
        type=positive_int,
        default=1,
        help="Passes over the training set (ignored with --max_train_steps).",
    )
    training.add_argument("--max_train_steps", type=positive_int, help="Stop after this many optimizer steps.")
    training.add_argument(
        "--learning_rate",
        type=positive_float,
        default=2e-4,
        help="Peak AdamW learning rate (LoRA: 1e-4..3e-4; full: ~1e-5).",
    )
    training.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay.")
    training.add_argument(
        "--adam_epsilon",
        type=positive_float,
        default=1e-8,
        help="AdamW's epsilon: the update is m / (sqrt(v) + epsilon), so it also sets how much a near-zero "
        "gradient moves a weight.",
    )
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
    training.add_argument(
        "--seed", type=int, default=42, help="Seed for the LoRA initialisation, shuffling and dropout."
    )
    training.add_argument(
        "--dist_timeout",
        type=float,
        default=600,
        help="Seconds any collective may wait for the other processes before the run fails with an error naming it.",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output_dir",
        default="outputs/llm_finetune",
        help="Adapter (or model), tokenizer, results.json, checkpoints.",
    )
    output.add_argument(
        "--merge_and_save",
        action="store_true",
        help="Also write the base model with the adapter merged in to output_dir/merged (QLoRA: into a 16/32-bit "
        "copy).",
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
        "--sample_tokens", type=int, default=48, help="Tokens to generate per answer with --generate_samples."
    )
    output.add_argument(
        "--generate_samples",
        type=int,
        default=0,
        help="After training, print answers to the first N validation prompts.",
    )
    output.add_argument(
        "--exact_match_samples",
        type=int,
        default=100,
        help="Score greedy answers to N (shuffled) validation questions by exact match, before and after training "
        "(0 skips; not under FSDP).",
    )
    output.add_argument(
        "--report_to", default=None, help="Trackers to log to: tensorboard, wandb, all, ... (default: none)."
    )
    output.add_argument(
        "--logging_steps", type=positive_int, default=10, help="Log train/loss every N optimizer steps."
    )
    output.add_argument(
        "--skip_eval", action="store_true", help="Skip the final evaluation (eval/* are NaN): speed benchmarks."
    )
    output.add_argument(
        "--perf_warmup_steps", type=int, default=1, help="Optimizer steps left out of the throughput numbers."
    )
    args = parser.parse_args(argv)
    if args.full_finetune and args.load_in_4bit:
        parser.error(
            "--load_in_4bit trains a LoRA adapter on a frozen 4-bit model; it cannot be combined with --full_finetune"
        )
    if args.validation_file and not args.train_file:
        parser.error("--validation_file needs --train_file")
    return args


# ----------------------------------------------------------------------------- the default model and data
def default_base_model(accelerator, output_dir: Path) -> str:
    """``outputs/train_lm`` (what ``recipes/train_lm.py`` saves by default) if it holds a model; otherwise a small one
    pretrained here first with that recipe, on one process (the others wait), in ``output_dir/base_model``."""
    for candidate in (Path("outputs/train_lm"), output_dir / "base_model"):
        if (candidate / "config.json").is_file() and (candidate / "tokenizer.json").is_file():
            return str(candidate)
    recipe = HERE / "train_lm.py"
    if not recipe.is_file():
        raise RecipeError(
            "No --model_name_or_path given and no pretrained model in outputs/train_lm. Pass a local folder or "
            "Hub name of a causal LM (the pretraining fallback needs recipes/train_lm.py beside "
            f"{Path(__file__).name})."
        )
    target = output_dir / "base_model"
    # Minutes of pretraining on the main process: the others wait untimed (a barrier bounded by --dist_timeout would
    # kill the run while it is only slow).
    with main_process_alone(accelerator):
        if accelerator.is_main_process:
            pretrain_base_model(accelerator, recipe, target)
    return str(target)


def pretrain_base_model(accelerator, recipe: Path, target: Path) -> None:
    """``recipes/train_lm.py`` as a plain 1-process run into ``target``."""
    command = [
        sys.executable,
        str(recipe),
        "--model_size",
        "small",
        "--max_train_steps",
        "150",
        "--corpus_max_mb",
        "3",
        "--per_device_train_batch_size",
        "8",
        "--block_size",
        "256",
        "--sample_tokens",
        "0",
        "--output_dir",
        str(target),
    ]
    accelerator.print(
        "no base model yet: pretraining one first (a 1-process run, a few minutes on a CPU): " + " ".join(command)
    )
    # A plain 1-process run: none of this launch's distributed settings may reach it.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(
            ("RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "ACCELERATE_")
        )
    }
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RecipeError(f"Pretraining the default base model failed: {done.stdout.strip().splitlines()[-1][:300]}")


def load_raw_datasets(args) -> datasets.DatasetDict:
    """train/validation splits from the user's files, a Hub dataset, or the offline default."""
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        for split, file in files.items():
            if not Path(file).is_file():
                raise RecipeError(f"--{split}_file {file!r} does not exist (looked in {Path.cwd()}).")
            if Path(file).stat().st_size == 0:
                raise RecipeError(f"--{split}_file {file!r} is empty: it needs at least one sample.")
        suffixes = {Path(file).suffix.lower() for file in files.values()}
        if len(suffixes) != 1 or next(iter(suffixes)) not in DATA_FILE_BUILDERS:
            raise RecipeError(
                f"Data files must all be one of {sorted(DATA_FILE_BUILDERS)}; got {sorted(files.values())}."
            )
        builder = DATA_FILE_BUILDERS[suffixes.pop()]
        raw = {}
        for split, file in files.items():  # one at a time, so that an error can name the file
            try:
                raw[split] = datasets.load_dataset(builder, data_files={split: file}, split=split)
            except Exception as error:  # datasets raises many types for unreadable files; report them all plainly
                raise RecipeError(f"Could not read --{split}_file {file!r}: {unreadable(file, error)}") from None
        if "validation" in raw and set(raw["validation"].column_names) != set(raw["train"].column_names):
            raise RecipeError(
                f"--train_file {files['train']!r} has the columns {raw['train'].column_names} but --validation_file "
                f"{files['validation']!r} has {raw['validation'].column_names}: both must be in one format (messages, "
                "prompt + completion, or text)."
            )
    elif args.dataset_name:
        try:
            raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        except Exception as error:  # offline, unknown name, or a bad configuration: all end here
            raise RecipeError(
                f"Could not load the Hub dataset {args.dataset_name!r} ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:300]}). Without internet, pass --train_file."
            ) from None
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw["test"]
    else:
        return stdlib_names()
    # Every row checked before anything is shuffled or split off, so that a bad row is named by its place in the file.
    for split in ("train", "validation"):
        if split in raw and len(raw[split]):
            given = args.train_file if split == "train" else args.validation_file
            source = f"--{split}_file {given!r}" if given else f"the {split} split of {args.dataset_name}"
            check_rows(raw[split], data_format(raw["train"].column_names), source)
    if "validation" not in raw:
        raw = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)
        raw["validation"] = raw.pop("test")
    return datasets.DatasetDict({"train": raw["train"], "validation": raw["validation"]})


def unreadable(file: str, error: Exception) -> str:
    """Why a data file could not be read: for JSON Lines, the first line that is not a JSON object (datasets names
    only its own error; the line is in a log message above it)."""
    if Path(file).suffix.lower() == ".jsonl":
        with open(file, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as bad:
                    return f"line {number} is not valid JSON ({bad.msg} at column {bad.colno}): {line.strip()[:120]!r}"
                if not isinstance(row, dict):
                    return f"line {number} is a JSON {type(row).__name__}, not an object of columns: {line[:120]!r}"
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


def check_rows(dataset: datasets.Dataset, fmt: str, source: str) -> None:
    """Refuse, naming the row, a conversation that tokenize_sample could not learn from (rows count from 1, as lines
    of a JSON Lines file do)."""
    if fmt != "messages":
        return
    for number, messages in enumerate(dataset["messages"], start=1):
        check_conversation(messages, f"Row {number} of {source}")


def check_conversation(messages, where: str) -> None:
    """Refuse a ``messages`` value this recipe cannot learn from, in one paragraph that starts with ``where``."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages
    ):
        raise RecipeError(
            f"{where}: 'messages' must be a list of {{role, content}} objects; got {str(messages)[:200]}."
        )
    unknown = sorted({m["role"] for m in messages} - ROLES)
    if unknown:
        raise RecipeError(f"{where} has the role(s) {unknown}; the roles are {sorted(ROLES)}: {str(messages)[:200]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecipeError(
            f"{where} has no assistant turn, so nothing to learn from: {str(messages)[:200]}. Add the answer as "
            "{'role': 'assistant', 'content': ...}, or drop the row."
        )


def data_format(columns: list[str]) -> str:
    """``messages``, ``prompt_completion`` or ``text``: the TRL formats, in that order of preference."""
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise RecipeError(
        f"The data has none of the formats this recipe reads: a 'messages' column (a list of {{role, content}}), "
        f"'prompt' and 'completion' columns, or a 'text' column. Columns found: {columns}."
    )


# ----------------------------------------------------------------------------- tokens and labels
def tokenize_sample(sample: dict, fmt: str, tokenizer, max_length: int) -> dict:
    """``input_ids`` and ``labels`` (-100 everywhere but on answer tokens) of one sample, truncated to ``max_length``.

    Conversations are rendered with the chat template one turn at a time: the text up to an assistant turn (with the
    generation prompt) is prompt, the rest of that turn is answer, and each piece is tokenized on its own, so which
    tokens are answers is exact (a template that does not render a conversation as a prefix of its continuation is
    refused). The first token of a sample never has a label: nothing inside the sample predicts it (this also keeps
    packed samples from predicting each other).
    """
    pieces: list[tuple[str, bool]] = []  # (text, is_answer)
    if fmt == "messages":
        messages, done = sample["messages"], ""
        check_conversation(messages, "A conversation")  # (rows of files were checked with their row numbers)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise RecipeError(
                    "The chat template does not render a conversation as a prefix of its continuation, so the "
                    "answer tokens cannot be found exactly; use a template that does (most do)."
                )
            pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            done = full
        ids, labels = [], []
        for text, is_answer in pieces:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if is_answer else [-100] * len(piece)
    else:
        prompt = sample["prompt"] if fmt == "prompt_completion" else ""
        answer = (sample["completion"] if fmt == "prompt_completion" else sample["text"]) or ""
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        answer_ids = tokenizer(answer, add_special_tokens=not prompt)["input_ids"] + [tokenizer.eos_token_id]
        ids, labels = prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids
    labels[0:1] = [-100]
    truncated = len(ids) > max_length
    prompt_tokens = next((index for index, label in enumerate(labels) if label != -100), len(labels))
    ids, labels = ids[:max_length], labels[:max_length]
    return {
        "input_ids": ids,
        "labels": labels,
        "num_answer_tokens": sum(label != -100 for label in labels),
        "truncated": truncated,
        "prompt_tokens": prompt_tokens,  # before the first answer token, untruncated: what --max_length must exceed
    }


def pack(dataset: datasets.Dataset, max_length: int) -> datasets.Dataset:
    """First-fit packing into rows of at most ``max_length`` tokens. ``position_ids`` restart at 0 with every sample:
    transformers then builds a block-diagonal causal mask (each sample attends only to itself, exactly as unpacked)."""
    rows, row = [], {"input_ids": [], "labels": [], "position_ids": []}
    for sample in dataset:
        if row["input_ids"] and len(row["input_ids"]) + len(sample["input_ids"]) > max_length:
            rows.append(row)
            row = {"input_ids": [], "labels": [], "position_ids": []}
        row["input_ids"] += sample["input_ids"]
        row["labels"] += sample["labels"]
        row["position_ids"] += list(range(len(sample["input_ids"])))
    rows.append(row)
    return datasets.Dataset.from_list(rows)


def collate(samples: list[dict], pad_token_id: int) -> dict:
    """Right-pad a batch: input ids with the pad token, labels with -100; an attention mask, or (packed rows) position
    ids, which restart for the padding too, so it is a sequence of its own. ``num_tokens``: the real tokens per row."""
    length = max(len(sample["input_ids"]) for sample in samples)
    batch = {
        "input_ids": torch.full((len(samples), length), pad_token_id),
        "labels": torch.full((len(samples), length), -100),
        "num_tokens": torch.tensor([len(sample["input_ids"]) for sample in samples]),
    }
    packed = "position_ids" in samples[0]
    batch["position_ids" if packed else "attention_mask"] = torch.zeros((len(samples), length), dtype=torch.long)
    for row, sample in enumerate(samples):
        size = len(sample["input_ids"])
        batch["input_ids"][row, :size] = torch.tensor(sample["input_ids"])
        batch["labels"][row, :size] = torch.tensor(sample["labels"])
        if packed:
            batch["position_ids"][row] = torch.tensor(sample["position_ids"] + list(range(length - size)))
        else:
            batch["attention_mask"][row, :size] = 1
    return batch


def prompt_of(sample: dict, fmt: str, tokenizer) -> str:
    """What the model is asked, for ``--generate_samples``: the conversation up to its first answer (with the
    generation prompt), the prompt, or the first 64 characters of a text."""
    if fmt == "messages":
        first_answer = next(
            index for index, message in enumerate(sample["messages"]) if message["role"] == "assistant"
        )
        return tokenizer.apply_chat_template(
            sample["messages"][:first_answer], tokenize=False, add_generation_prompt=True
        )
    return sample["prompt"] if fmt == "prompt_completion" else sample["text"][:64]


def exact_match(model, tokenizer, rows: datasets.Dataset, fmt: str, device) -> tuple[float, list[dict]]:
    """The share of ``rows`` whose greedy answer, stripped, equals the reference answer stripped, and each answer.
    Generates 2 tokens more than the longest reference has: a longer answer could not match anyway."""
    scored = []
    for row in rows:
        if fmt == "messages":
            first = next(index for index, message in enumerate(row["messages"]) if message["role"] == "assistant")
            question = row["messages"][first - 1]["content"] if first else ""
            reference = row["messages"][first]["content"]
        else:
            question, reference = row["prompt"], row["completion"]
        scored.append({"question": question, "reference": reference.strip()})
    max_new_tokens = max(len(tokenizer(s["reference"], add_special_tokens=False).input_ids) for s in scored) + 2
    for row, sample in zip(rows, scored):
        ids = tokenizer(prompt_of(row, fmt, tokenizer), return_tensors="pt", add_special_tokens=fmt != "messages")
        ids = ids.input_ids.to(device)
        with torch.no_grad():
            generated = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        sample["answer"] = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip()
    return sum(sample["answer"] == sample["reference"] for sample in scored) / len(scored), scored


def token_losses(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss over the answer tokens of ``batch``, and per sample, from the logits: the labels move to
    the logits' device (the last one of a device_map split). ``use_cache=False``: a cache would turn the packed
    block-diagonal mask off."""
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "num_tokens")}
    logits = model(**inputs, use_cache=False).logits
    targets = batch["labels"][:, 1:].to(logits.device)
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, ignore_index=-100, reduction="none"
    )
    return losses.sum(), losses.sum(dim=1)


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()
    lora = not args.full_finetune
    method = "qlora" if args.load_in_4bit else "lora" if lora else "full"

    # ------------------------------------------------------------------ Accelerator and seed
    # (This Accelerator block repeats in every recipe on purpose: each recipe is one file you can copy.)
    # Hang dumps: if a collective times out or a rank stops making progress, every rank that can still run writes
    # its stacks, step and collective to output_dir/debug/. Started first: NCCL reads its settings at start-up.
    hang_dump = HangDump(Path(args.output_dir) / "debug", args.dist_timeout)
    accelerator = build_accelerator(
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        # No gradient_accumulation_steps here: the loop below holds a step's micro-batches together to count their
        # answer tokens first, and skips the gradient sync of all but the last with accelerator.no_sync.
        log_with=args.report_to,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir)
    # Refuses combinations that cannot work (device_map with 2 processes, ddp with 1, fsdp without its config).
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/llm_finetune.py")
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason}); method: {method}")
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    if args.load_in_4bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise RecipeError(
                "--load_in_4bit needs bitsandbytes: pip install -r requirements.txt (bitsandbytes==0.50.2)."
            ) from None
        if accelerator.device.type not in ("cuda", "cpu"):
            raise RecipeError(f"--load_in_4bit runs on CUDA GPUs and the CPU here, not on {accelerator.device.type}.")
    checkpoints_dir = output_dir / "checkpoints"
    layout = "fsdp" if parallelism.name == "fsdp" else "replica"
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)

    # The base model: its config first, so that a model that is not a causal LM stops here, before any data work.
    args.model_name_or_path = args.model_name_or_path or default_base_model(accelerator, output_dir)
    try:
        config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
        raise RecipeError(
            f"Could not load model {args.model_name_or_path!r}: {str(error).splitlines()[0][:300]} Pass a local "
            "folder with config.json and weights, or a Hub name when online."
        ) from None
    if config.model_type in ENCODER_ONLY or getattr(config, "is_encoder_decoder", False):
        raise RecipeError(
            f"{args.model_name_or_path!r} is a {config.model_type} model, not a causal (decoder-only) LM, so it "
            "cannot generate answers. Use a decoder such as Llama, Qwen, Mistral, Gemma or GPT-2; to classify "
            "text, use recipes/transformer_finetune.py."
        )
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions and args.max_length > positions:
        # Longer rows would index past the position embeddings (an IndexError mid-run) or past what the model learned.
        accelerator.print(
            f"--max_length {args.max_length} is more than the {positions} positions of {args.model_name_or_path}: "
            f"samples are cut to {positions} tokens"
        )
        args.max_length = positions
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of attention and loss; any id will do
        accelerator.print(f"tokenizer: no pad token, using the end-of-sequence token {tokenizer.eos_token!r}")
    if tokenizer.chat_template is None:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        accelerator.print(
            "tokenizer: no chat template, using the recipe's default (<|role|> lines ending in the EOS token)"
        )

    # ------------------------------------------------------------------------------- data
    # main_process_first: the main process reads and tokenizes first (datasets caches it); the others read the cache.
    with accelerator.main_process_first():
        raw_datasets = load_raw_datasets(args)
        fmt = data_format(raw_datasets["train"].column_names)
        for split, dataset in raw_datasets.items():
            if len(dataset) == 0:
                raise RecipeError(f"The {split} split is empty: it needs at least one sample.")
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
        tokenized = raw_datasets.map(
            lambda sample: tokenize_sample(sample, fmt, tokenizer, args.max_length),
            remove_columns=raw_datasets["train"].column_names,
            desc="tokenizing",
        )
    counts = {}
    for split in ("train", "validation"):
        # Samples whose answers were cut off entirely by --max_length have nothing to learn: dropped, and counted.
        kept = tokenized[split].filter(lambda sample: sample["num_answer_tokens"] > 0)
        counts[split] = {
            "samples": len(tokenized[split]),
            "truncated": sum(tokenized[split]["truncated"]),
            "dropped_without_answer": len(tokenized[split]) - len(kept),
        }
        if len(kept) == 0:
            prompts = sorted(tokenized[split]["prompt_tokens"])
            median = prompts[len(prompts) // 2]
            raise RecipeError(
                f"--max_length {args.max_length} is shorter than the prompt of every {split} sample, so no answer "
                f"token is left to learn from. The shortest prompt has {prompts[0]} tokens and the median one "
                f"{median}: use --max_length {median + 64} or more to keep most samples with answers of up to 64 "
                "tokens."
            )
        tokenized[split] = kept.remove_columns(["truncated", "prompt_tokens"])
    accelerator.print(
        f"data: format {fmt}; "
        + "; ".join(
            f"{split} {c['samples']} samples ({c['truncated']} truncated to {args.max_length} tokens, "
            f"{c['dropped_without_answer']} "
            "dropped: no answer token left)"
            for split, c in counts.items()
        )
    )
    train_dataset, eval_dataset = tokenized["train"].remove_columns(["num_answer_tokens"]), tokenized["validation"]
    if args.packing:
        train_dataset = pack(train_dataset, args.max_length)
    eval_dataset = eval_dataset.remove_columns(["num_answer_tokens"])
    collator = lambda samples: collate(samples, tokenizer.pad_token_id)  # noqa: E731
    # The loaders get their own generator: one without draws a seed from the global RNG whenever it starts iterating.
    generator = torch.Generator().manual_seed(args.seed)
    if args.group_by_length:
        sampler = LengthGroupedShuffledSampler(
            [len(ids) for ids in train_dataset["input_ids"]], args.per_device_train_batch_size, seed=args.seed
        )
        train_dataloader = DataLoader(
            train_dataset,
            batch_size=args.per_device_train_batch_size,
            sampler=sampler,
            collate_fn=collator,
            generator=generator,
        )
    else:
        train_dataloader = DataLoader(
            train_dataset,
            batch_size=args.per_device_train_batch_size,
            shuffle=True,
            collate_fn=collator,
            generator=generator,
        )
    eval_dataloader = DataLoader(
        eval_dataset,
        batch_size=args.per_device_eval_batch_size or args.per_device_train_batch_size,
        collate_fn=collator,
    )
    data_parallel = parallelism.name in ("ddp", "fsdp")
    if len(train_dataloader) < (accelerator.num_processes if data_parallel else 1):
        raise RecipeError(
            f"{len(train_dataset)} training samples make {len(train_dataloader)} batch(es) of "
            f"{args.per_device_train_batch_size}, fewer than the {accelerator.num_processes} processes: some would "
            "get none. Lower --per_device_train_batch_size or add data."
        )

    # ------------------------------------------------------------------------------ model
    quantization = None
    if args.load_in_4bit:
        from transformers import BitsAndBytesConfig

        # NF4 with double quantization (QLoRA); the storage dtype is the compute dtype, so that FSDP2 sees one dtype
        # in every parameter it flattens and shards.
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_quant_storage=compute_dtype,
        )
    # LoRA freezes the base: keep it in the compute dtype (a 7B base in bf16 is 13.5 GB instead of 27); the adapter
    # stays float32 (PEFT upcasts it). A full fine-tune keeps float32 master weights under mixed-precision autocast.
    load_dtype = compute_dtype if lora else torch.float32
    split_over = split_devices(accelerator.device) if parallelism.name == "device_map" else []
    # QLoRA is quantized where it is loaded. One device: there. A split: on the CPU (a layer at a time, in host RAM),
    # then dispatch_on_devices below moves each block to its own device, so that no GPU ever holds more than its share
    # (loaded onto a GPU, the whole 4-bit model would sit there before being split: 35 GB for a 70B model).
    load_device = ({"": "cpu"} if split_over else {"": str(accelerator.device)}) if args.load_in_4bit else None
    # Low host-RAM loading (the FSDP config's fsdp_cpu_ram_efficient_loading): only the main process reads the
    # checkpoint; the others build the model's shape with no memory behind it (parameters on the meta device, buffers
    # real), and accelerator.prepare() hands every process its shard of the main process's weights. Without it each
    # of N processes holds the whole model in host RAM at once: 2 x 140 GB for a 70B model in bf16.
    ram_efficient = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true"  # set by the config
    low_ram = ram_efficient and parallelism.name == "fsdp"
    # QLoRA under FSDP2: built empty here, loaded one layer at a time and sharded after LoRA (shared/sharded_4bit.py).
    frugal_4bit = args.load_in_4bit and parallelism.name == "fsdp"
    if frugal_4bit:
        model = empty_4bit_model(config, quantization, load_dtype, trust_remote_code=args.trust_remote_code)
    elif low_ram and not accelerator.is_main_process and not args.load_in_4bit:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(
                config, dtype=load_dtype, trust_remote_code=args.trust_remote_code
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path,
            config=config,
            dtype=load_dtype,
            quantization_config=quantization,
            device_map=load_device,
            trust_remote_code=args.trust_remote_code,
        )
    total_before = sum(parameter.numel() for parameter in model.parameters())
    device_map = None
    if split_over:
        # One dispatcher for every recipe that splits (shared/model_split.py), before LoRA: the adapter's weights are
        # then created on the device of the layer they adapt, inside its block's hook.
        block_list = find_block_list(model, set(model._no_split_modules))
        plan = plan_device_map(
            model, len(split_over), last_cost=lm_head_cost_in_blocks(model, block_list, args.max_length)
        )
        model, device_map = dispatch_on_devices(model, plan, split_over)
    if args.gradient_checkpointing:
        # Non-reentrant: works with DDP and LoRA (a frozen base gives the reentrant version inputs without grad).
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if args.load_in_4bit:
            # Casts the remaining 16-bit weights (norms, embeddings) to float32 for stable training of the adapter.
            # Checkpointing is on already (above): PEFT would turn it on again through transformers' deprecated name.
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
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
                    task_type="CAUSAL_LM",
                ),
            )
        except ValueError as error:
            raise RecipeError(
                f"--lora_target_modules {' '.join(args.lora_target_modules)} matches no module of the model "
                f"({str(error).splitlines()[0][:200]}). Use 'all-linear' or names such as q_proj v_proj."
            ) from None
        if Path(args.model_name_or_path).is_dir():
            # adapter_config.json names its base: a local one by its absolute path, so that the adapter loads from any
            # folder of this machine (a relative path, read from elsewhere, is taken for a Hub name).
            model.peft_config["default"].base_model_name_or_path = str(Path(args.model_name_or_path).resolve())
        trainable, total = model.get_nb_trainable_parameters()  # counts 4-bit weights as the parameters they stand for
    else:
        trainable = total = total_before
    if frugal_4bit:
        load_4bit_sharded(accelerator, model, args.model_name_or_path, load_dtype)
    accelerator.print(
        f"model: {args.model_name_or_path}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trained "
        f"({trainable / total:.2%}); weights in {load_dtype if not args.load_in_4bit else '4-bit NF4'}"
    )

    # ------------------------------------------------------------------ optimizer and scheduler
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        eps=args.adam_epsilon,
    )
    # Optimizer steps per epoch: each process sees 1/num_processes of the batches (data parallel), grouped by the
    # accumulation; the last group of an epoch may be shorter, hence the ceiling divisions.
    batches_per_process = math.ceil(len(train_dataloader) / (accelerator.num_processes if data_parallel else 1))
    steps_per_epoch = math.ceil(batches_per_process / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_train_epochs = math.ceil(max_train_steps / steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        # The prepared scheduler steps once per process per optimizer step.
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )

    # ------------------------------------------------------------------------------ prepare
    if parallelism.name == "fsdp":
        block_class = wrap_at_blocks(accelerator, model, find_block_list(model, set(model._no_split_modules)))
        accelerator.print(f"fsdp: one unit per {block_class or 'configured block'}")
        check_offload_fits_host_ram(accelerator, model)  # offload config: refuse now, not at an OOM mid-run
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    loading = {}
    if low_ram:
        # What low-RAM loading gave each process, for results.json: the sum of every frozen weight's local shard
        # (tests compare them with the checkpoint's slices). A collective.
        loading = {
            "loading/shard_sums": per_rank(
                {
                    name: float((parameter.to_local() if hasattr(parameter, "to_local") else parameter).double().sum())
                    for name, parameter in model.named_parameters()
                    if not parameter.requires_grad
                }
            )
        }
    if lora:
        # Checkpoints hold the adapter, not a copy of the frozen base (13.5 GB for a 7B model); loaded non-strictly.
        trained_weights_only_in_checkpoints(accelerator)
    # Exact match of greedy answers to held-out questions, before training (the same function scores the end): on the
    # main process alone with the unwrapped model (the others wait untimed); not under FSDP2, where every forward pass
    # needs every process.
    exact_rows, exact_match_before = None, math.nan
    if args.exact_match_samples > 0 and not args.skip_eval and fmt != "text" and parallelism.name != "fsdp":
        shuffled = raw_datasets["validation"].shuffle(seed=args.seed)  # not the first N: those are one package
        exact_rows = shuffled.select(range(min(args.exact_match_samples, len(shuffled))))
        with main_process_alone(accelerator):
            if accelerator.is_main_process:
                model.eval()
                exact_match_before, _ = exact_match(
                    accelerator.unwrap_model(model), tokenizer, exact_rows, fmt, accelerator.device
                )
                accelerator.print(f"eval: exact match before training {exact_match_before:.1%}")
    elif args.exact_match_samples > 0 and not args.skip_eval and parallelism.name == "fsdp":
        accelerator.print("eval: no exact match under FSDP2 (generating needs every process in step); run it with ddp")
    global_batch_size = (
        args.per_device_train_batch_size
        * args.gradient_accumulation_steps
        * (accelerator.num_processes if data_parallel else 1)
    )
    run_config = {
        **vars(args),
        "method": method,
        "parallelism": parallelism.name,
        "num_processes": accelerator.num_processes,
        "data_format": fmt,
        "global_batch_size": global_batch_size,
        "max_train_steps": max_train_steps,
        "mixed_precision": accelerator.mixed_precision,
    }
    accelerator.print("config: " + json.dumps(run_config, sort_keys=True, default=str))
    if args.report_to:
        accelerator.init_trackers(
            "llm_finetune", {k: v for k, v in run_config.items() if isinstance(v, (int, float, str, bool))}
        )

    # ---------------------------------------------------------------------- training loop
    # load_state restores the adapter (or model), optimizer, scheduler, sampler and RNG states; non-strict because the
    # adapter checkpoints hold only the trained weights.
    resume = load_checkpoint(
        accelerator,
        checkpoint,
        steps_per_epoch,
        args.gradient_accumulation_steps,
        load_state=lambda folder: accelerator.load_state(str(folder), strict=not lora),
    )
    completed_steps = resume.completed_steps
    meter = ThroughputMeter(
        accelerator, warmup_steps=args.perf_warmup_steps, devices=sorted(set(split_over), key=str) or None
    )
    progress_bar = tqdm(
        total=max_train_steps, initial=completed_steps, disable=not accelerator.is_local_main_process, desc="training"
    )
    # The global loss of each step; a resumed run starts from the curve its checkpoint saved.
    loss_curve, logged = list(resume.history.get("train/loss_curve", [])), []
    # Data-parallel processes each hold 1/N of the batch; DDP and FSDP average gradients over them, so a process's sum
    # of token losses is scaled by N before the division by the step's global answer-token count.
    data_parallel_size = accelerator.num_processes if data_parallel else 1
    for epoch in range(resume.epoch, num_train_epochs):
        model.train()
        # Reseeds the shuffling for this epoch: same order on every process and after a resume.
        train_dataloader.set_epoch(epoch)
        active_dataloader = train_dataloader
        if epoch == resume.epoch and resume.batches_to_skip:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume.batches_to_skip)
        batches = iter(meter.timed(active_dataloader))
        while micro_batches := list(itertools.islice(batches, args.gradient_accumulation_steps)):
            # Exact normalisation: the step's loss is the sum over *all* its answer tokens (every micro-batch, every
            # process) divided by their count, which needs the count before the first backward. Sync point: the
            # all-reduce of one number per step.
            local_tokens = sum((batch["labels"][:, 1:] != -100).sum() for batch in micro_batches)
            step_tokens = accelerator.reduce(local_tokens.to(accelerator.device), reduction="sum")
            step_loss = torch.zeros((), device=accelerator.device)
            for index, batch in enumerate(micro_batches):
                # All micro-batches but the last skip the gradient all-reduce (DDP) / reduce-scatter (FSDP2).
                syncing = index == len(micro_batches) - 1
                with accelerator.no_sync(model) if not syncing else contextlib.nullcontext():
                    loss_sum, _ = token_losses(model, batch)
                    accelerator.backward(loss_sum * data_parallel_size / step_tokens)
                step_loss += loss_sum.detach()
            if args.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            completed_steps += 1
            progress_bar.update(1)
            # The step's global loss (sync point: .item()); the same number in 1 process or 2, with or without
            # accumulation.
            loss_curve.append((accelerator.reduce(step_loss, reduction="sum") / step_tokens).item())
            # Tokens computed (padding aside) and tokens learned from, all processes together (sync point: .item()).
            step_real_tokens = accelerator.reduce(
                sum(batch["num_tokens"].sum() for batch in micro_batches), reduction="sum"
            )
            meter.step(
                samples=sum(len(batch["input_ids"]) for batch in micro_batches) * data_parallel_size,
                tokens=int(step_real_tokens.item()),
                answer_tokens=int(step_tokens.item()),
            )
            hang_dump.step(completed_steps)
            logged.append(loss_curve[-1])
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                progress_bar.set_postfix({"train/loss": f"{sum(logged) / len(logged):.4f}"})
                accelerator.log(
                    {"train/loss": sum(logged) / len(logged), "train/learning_rate": lr_scheduler.get_last_lr()[0]},
                    step=completed_steps,
                )
                logged = []
            if isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0:
                save_checkpoint(
                    accelerator,
                    checkpoints_dir,
                    completed_steps,
                    args.checkpoints_total_limit,
                    layout=layout,
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
                layout=layout,
                history={"train/loss_curve": loss_curve},
            )
        if completed_steps >= max_train_steps:
            break
    progress_bar.close()
    perf = meter.summary(
        flops_per_token=lm_flops_per_token(
            config.hidden_size, config.num_hidden_layers, config.vocab_size, total, args.max_length
        )
    )
    perf["memory/model_state_bytes"] = per_rank(model_state_bytes(model, optimizer))  # a collective
    if parallelism.name == "fsdp":
        perf["fsdp/sharding"] = per_rank(sharding_facts(model, optimizer))

    # ------------------------------------------------------------------------------- save
    # Before the evaluation: nothing that can fail after the last optimizer step may lose the trained weights.
    hang_dump.phase("saving")
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    # The full weights on the main process (every shard of FSDP2, every device of a split): for LoRA only the adapter
    # is gathered, and a PeftModel's save_pretrained writes it (adapter_model.safetensors + adapter_config.json).
    state_dict = gathered_state_dict(accelerator, model, trained_only=lora)  # a collective
    unwrapped.save_pretrained(
        output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    # The merge runs on the main process alone (minutes for a 13B model): the others wait untimed, not in a barrier
    # bounded by --dist_timeout.
    with main_process_alone(accelerator):
        if args.merge_and_save and lora and accelerator.is_main_process:
            from peft import PeftModel

            # A fresh 16/32-bit copy of the base (a 4-bit base cannot take the merged weights exactly), with the
            # adapter.
            base = AutoModelForCausalLM.from_pretrained(
                args.model_name_or_path,
                dtype=compute_dtype if compute_dtype != torch.float16 else torch.float32,
                trust_remote_code=args.trust_remote_code,
            )
            merged = PeftModel.from_pretrained(base, output_dir).merge_and_unload()
            merged.save_pretrained(output_dir / "merged")
            tokenizer.save_pretrained(output_dir / "merged")
            accelerator.print(f"merged the adapter into the base model: {output_dir / 'merged'}")

    # ------------------------------------------------------------------------- evaluation
    hang_dump.phase("evaluation")
    model.eval()
    eval_loss_sum, eval_tokens, eval_samples = 0.0, 0, 0
    for batch in [] if args.skip_eval else eval_dataloader:
        with torch.no_grad():
            _, per_sample = token_losses(model, batch)
        tokens = (batch["labels"][:, 1:] != -100).sum(dim=1).to(per_sample.device)
        # gather_for_metrics drops the samples Accelerate repeated to give every process a full last batch.
        per_sample, tokens = accelerator.gather_for_metrics((per_sample, tokens))
        eval_loss_sum += per_sample.sum().item()
        eval_tokens += int(tokens.sum().item())
        eval_samples += len(tokens)
    eval_loss = eval_loss_sum / eval_tokens if eval_tokens else math.nan
    accelerator.print(
        f"eval: loss {eval_loss:.4f}, perplexity {math.exp(eval_loss) if eval_tokens else math.nan:.2f} on the answer "
        f"tokens of {eval_samples} validation samples ({eval_tokens} tokens)"
    )
    samples = []
    if args.generate_samples and accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        for row in raw_datasets["validation"].select(
            range(min(args.generate_samples, len(raw_datasets["validation"])))
        ):
            prompt = prompt_of(row, fmt, tokenizer)
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=fmt != "messages").input_ids.to(
                accelerator.device
            )
            with torch.no_grad():
                answer = unwrapped.generate(
                    ids, max_new_tokens=args.sample_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            samples.append(
                {"prompt": prompt, "answer": tokenizer.decode(answer[0, ids.shape[1] :], skip_special_tokens=True)}
            )
            accelerator.print(f"--- prompt:\n{prompt}\n--- answer (greedy):\n{samples[-1]['answer']}")

    exact_match_after, answers, chance = math.nan, [], math.nan
    if exact_rows is not None:
        with main_process_alone(accelerator):
            if accelerator.is_main_process:
                exact_match_after, answers = exact_match(
                    accelerator.unwrap_model(model), tokenizer, exact_rows, fmt, accelerator.device
                )
                # Chance: always giving the most common reference answer.
                references = [sample["reference"] for sample in answers]
                chance = max(map(references.count, references)) / len(references)
                accelerator.print(
                    f"eval: exact match {exact_match_before:.1%} before training, {exact_match_after:.1%} after, on "
                    f"{len(answers)} held-out questions (always the most common answer: {chance:.1%}); e.g."
                )
                for sample in answers[:3]:
                    accelerator.print(
                        f"  {sample['question']} -> {sample['answer']!r} (expected {sample['reference']!r})"
                    )
    perf_numbers = {k: v for k, v in perf.items() if isinstance(v, (int, float))}
    results = {
        "recipe": "llm_finetune",
        "model": args.model_name_or_path,
        "method": method,
        "parallelism": parallelism.name,
        "parallelism_requested": args.parallelism,
        **run_facts(accelerator),  # num_processes, distributed_type, distributed/backend, device
        "mixed_precision": accelerator.mixed_precision,
        "device_map": {name: str(device) for name, device in device_map.items()} if device_map else None,
        "device_map/hooks": execution_devices(
            accelerator.unwrap_model(model).get_base_model() if lora else unwrapped, device_map
        )
        if device_map
        else None,
        "data/format": fmt,
        "data/counts": counts,
        "global_batch_size": global_batch_size,
        "completed_steps": completed_steps,
        "resumed_from_step": resume.completed_steps,
        "model/trainable_parameters": trainable,
        "model/total_parameters": total,
        "train/loss": loss_curve[-1] if loss_curve else None,
        "train/loss_curve": loss_curve,
        "eval/loss": eval_loss,
        "eval/perplexity": math.exp(eval_loss) if eval_tokens else math.nan,
        "eval/num_samples": eval_samples,
        "eval/num_tokens": eval_tokens,
        "eval/exact_match_before": exact_match_before,
        "eval/exact_match": exact_match_after,
        "eval/exact_match_chance": chance,
        "eval/exact_match_num_questions": len(answers),
        "eval/exact_match_answers": answers,
        "samples": samples,
        **perf,
        **loading,
        "config": run_config,
    }
    accelerator.log(
        {**perf_numbers, "eval/loss": eval_loss, "eval/exact_match": exact_match_after}, step=completed_steps
    )
    write_results(accelerator, output_dir, results)
    accelerator.print(f"saved the {'adapter' if lora else 'model'}, tokenizer and results.json to {output_dir}")
    # Sync point: no process tears down its connections while another is still writing (see the other recipes).
    accelerator.wait_for_everyone()
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.free_memory(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
