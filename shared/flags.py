"""The command line every recipe shares: argparse types, the reliability flags, paths checked, a helper's flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .errors import stop_if_found


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (batch sizes, steps), with a message naming the value."""
    return _positive(text, int, "a whole number >= 1")


def positive_float(text: str) -> float:
    """argparse type for amounts that must be > 0 (learning rates, sizes), with a message naming the value."""
    return _positive(text, float, "a number > 0")


def _positive(text: str, kind, words: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be {words}, got {value}")
    return value


def steps_or_epoch(text: str) -> int | str:
    """argparse type for ``--checkpointing_steps``: a number of optimizer steps, or ``epoch``."""
    return "epoch" if text == "epoch" else positive_int(text)


def flags(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """``{name: args.name}`` for ``names``: a helper's keyword arguments of the same names (a tuple ``*_FLAGS``)."""
    return {name: getattr(args, name) for name in names}


def add_reliability_flags(parser: argparse.ArgumentParser) -> None:
    """Checkpoints, resume, the collective timeout: one definition for every recipe."""
    add = parser.add_argument_group("checkpoints and reliability").add_argument
    add(
        "--checkpointing_steps",
        type=steps_or_epoch,
        help="Save a resumable checkpoint to output_dir/checkpoints/step_N every N steps or 'epoch', and the last.",
    )
    add(
        "--checkpoints_total_limit",
        type=positive_int,
        help="Keep only the newest N complete checkpoints (default: all; each save prints its size).",
    )
    add(
        "--resume_from_checkpoint",
        help="A checkpoint folder, or 'latest' (newest complete one under output_dir/checkpoints; "
        "starts fresh if there is none).",
    )
    add(
        "--overwrite_output_dir",
        action="store_true",
        help="Write into an --output_dir that holds an earlier run's model, results or checkpoints "
        "(refused otherwise, unless resuming).",
    )
    add("--save_on_each_node", action="store_true", help="No shared disk: every machine saves its own checkpoints.")
    add(
        "--dist_timeout",
        type=positive_float,
        default=600,
        help="Seconds any collective may wait for the other processes before the run fails with an "
        "error naming it (tools/hang_dump.py, put before the recipe, writes stacks to output_dir/debug/).",
    )


# What an earlier run leaves in its output_dir (the Hub scripts' check): a new run into it is refused unless asked.
RUN_OUTPUTS = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
RUN_OUTPUTS += ("adapter_model.safetensors", "results.json")


def prepare_output_dir(path: str | os.PathLike, overwrite: bool, resuming: str | None) -> Path:
    """``path``, refused if it holds an earlier run's output (unless ``overwrite`` or ``resuming``), or unwritable."""
    output_dir, problem = Path(path), None
    found = [name for name in RUN_OUTPUTS if (output_dir / name).is_file()]
    found += ["checkpoints/"] if any((output_dir / "checkpoints").glob("step_*")) else []
    if found and not (overwrite or resuming):
        problem = (
            f"--output_dir {str(path)!r} already holds an earlier run's output ({', '.join(found)}), which "
            "this run would overwrite. Pass --overwrite_output_dir to replace it, --resume_from_checkpoint "
            "latest to continue that run, or another --output_dir."
        )
    existing = next(folder for folder in [output_dir, *output_dir.absolute().parents] if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "is not a folder" if not existing.is_dir() else "is not writable"
        problem = (
            f"Cannot use --output_dir {str(path)!r}: {existing} {why}. Pass a folder you can write to; it is "
            "created if missing."
        )
    stop_if_found(problem)
    return output_dir


def model_problem(model_name_or_path: str) -> str | None:
    """What is wrong with ``--model_name_or_path`` as a local folder (missing, or no config.json), or None."""
    name, folder = model_name_or_path, Path(model_name_or_path).expanduser()
    windows = os.sep == "\\" and "\\" in name
    if (folder.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1 or windows) and not folder.exists():
        return (
            f"--model_name_or_path {name!r} does not exist. Pass a folder with config.json and weights, or a Hub name."
        )
    if not folder.is_dir() or (folder / "config.json").is_file():
        return None
    held = sorted(path.name for path in folder.iterdir())
    adapter = ": this one holds a LoRA adapter; its base is adapter_config.json's base_model_name_or_path"
    return (
        f"--model_name_or_path {name!r} holds no config.json (it holds: {', '.join(held[:8]) or 'nothing'}), so "
        "transformers cannot tell which model to build. Pass the folder save_pretrained wrote (config.json beside the "
        f"weights), or a Hub name{adapter if 'adapter_config.json' in held else ''}."
    )


# Any of these in a model folder is a tokenizer transformers can load (one file names the rest).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
TOKENIZER_FILES += ("spiece.model", "sentencepiece.bpe.model", "tekken.json")


def tokenizer_problem(model_name_or_path: str, tokenizer_name: str | None) -> str | None:
    """What is wrong with the tokenizer's local folder (no tokenizer files), or None."""
    source = tokenizer_name or model_name_or_path
    folder = Path(source).expanduser()
    if not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    flag = "--tokenizer_name" if tokenizer_name else "--model_name_or_path"
    held = ", ".join(sorted(path.name for path in folder.iterdir())[:8]) or "nothing"
    return (
        f"{flag} {source!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...; it holds: "
        f"{held}), so the text cannot be turned into the tokens the model was trained on. Pass --tokenizer_name "
        "with the folder or Hub name of the model's tokenizer (e.g. the model it was fine-tuned from), or save "
        f"the tokenizer into {source!r} (tokenizer.save_pretrained)."
    )
