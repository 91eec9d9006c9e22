"""Text for the language-model recipes: the offline default corpus, a byte-level BPE tokenizer trained on it, and
packing token streams into fixed-length blocks; ``lm_datasets`` does all three for a recipe.

The default corpus is the Python standard library's own source (``*.py``; tests, codec tables and site-packages left
out): about 12 MB of real text every machine with Python has, split into train and validation *by file*.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import NamedTuple

from datasets import Dataset, DatasetDict, load_dataset

from shared.data import TEST_FOLDERS, check_data_files, stdlib_root
from shared.errors import RecipeError

# Not ordinary source: test suites (generated data, fixtures), codec tables (walls of hex), whatever pip installed.
EXCLUDED_STDLIB_FOLDERS = {"site-packages", "dist-packages", "encodings"} | TEST_FOLDERS
END_OF_TEXT = "<|endoftext|>"


def standard_library_files(max_mb: float | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by path (the same split and tokens on every machine with the same
    Python version), optionally only the first ``max_mb`` MB."""
    root = stdlib_root()
    files = sorted(
        path
        for path in root.rglob("*.py")
        if path.is_file() and not set(path.relative_to(root).parts[:-1]) & EXCLUDED_STDLIB_FOLDERS
    )
    if max_mb is not None:
        kept, total = [], 0
        for path in files:
            if kept and total >= max_mb * 1e6:
                break
            kept.append(path)
            total += path.stat().st_size
        files = kept
    return files


def split_by_file(files: list[Path], validation_percentage: float) -> tuple[list[Path], list[Path]]:
    """Every k-th file (k = 100 / percentage, from the first) goes to validation. By file, not by line: a held-out
    line whose neighbours were trained on would make validation perplexity look better than it is."""
    every = max(2, round(100 / validation_percentage))
    return [path for index, path in enumerate(files) if index % every], files[::every]


def load_text_corpus(
    *,
    dataset_name: str | None,
    dataset_config_name: str | None,
    train_file: str | None,
    validation_file: str | None,
    validation_split_percentage: float,
    corpus_max_mb: float | None,
) -> tuple[DatasetDict, str, bool]:
    """The raw text as a ``DatasetDict`` (``train``, ``validation``; a ``text`` column), a description, and
    ``documents``: True when each example is a whole document (the default corpus: one per file), so the packer puts
    an end-of-text token between examples; text files (one example per line, line breaks kept) and Hub datasets are
    pieces of running text, joined as they are."""
    if dataset_name is not None:
        raw = load_dataset(dataset_name, dataset_config_name)
        if "validation" not in raw:
            # Same convention as transformers' run_clm: hold out the first N% of the train split.
            held_out = f"{validation_split_percentage:g}%"
            raw = DatasetDict(
                {
                    "train": load_dataset(dataset_name, dataset_config_name, split=f"train[{held_out}:]"),
                    "validation": load_dataset(dataset_name, dataset_config_name, split=f"train[:{held_out}]"),
                }
            )
        features = raw["train"].features.items()
        text_columns = [name for name, feature in features if getattr(feature, "dtype", None) == "string"]
        if not text_columns:
            raise ValueError(f"dataset {dataset_name!r} has no string column to train on")
        column = "text" if "text" in text_columns else text_columns[0]
        raw = DatasetDict(
            {
                split: raw[split].select_columns([column]).rename_column(column, "text")
                if column != "text"
                else raw[split].select_columns(["text"])
                for split in ("train", "validation")
            }
        )
        return raw, f"Hub dataset {dataset_name}" + (f" ({dataset_config_name})" if dataset_config_name else ""), False

    if train_file is not None:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        check_data_files(files, needs="text to train on")  # (datasets' own error for an empty file is a traceback)
        raw = load_dataset("text", keep_linebreaks=True, data_files=files)
        if "validation" not in raw:
            split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, shuffle=False)
            raw = DatasetDict({"train": split["train"], "validation": split["test"]})
        description = f"text file {train_file}" + (f" (validation: {validation_file})" if validation_file else "")
        return raw, description, False

    files = standard_library_files(corpus_max_mb)
    train_files, validation_files = split_by_file(files, validation_split_percentage)
    if not train_files:
        raise ValueError("the default corpus needs at least two files; raise --corpus_max_mb")
    # sample_by="document": one example per file, so the train/validation split stays by file.
    data_files = {"train": [str(path) for path in train_files], "validation": [str(path) for path in validation_files]}
    raw = load_dataset("text", sample_by="document", data_files=data_files)
    megabytes = sum(path.stat().st_size for path in files) / 1e6
    return (
        raw,
        (
            f"Python standard library source ({len(train_files)} train files, {len(validation_files)} validation "
            f"files, {megabytes:.1f} MB) from {stdlib_root()}"
        ),
        True,
    )


def train_bpe_tokenizer(texts, vocab_size: int):
    """Train a byte-level BPE tokenizer (the GPT-2 recipe) on ``texts``, wrapped for transformers (``save_pretrained``,
    ``AutoTokenizer.from_pretrained``). Byte-level: every string encodes (no unknown token) and decodes back exactly,
    indentation included, which matters for source code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    # The end-of-text token doubles as padding: generation wants a pad id, and training never pads.
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)


def tokenize_and_pack(
    raw: DatasetDict, tokenizer, block_size: int, documents: bool
) -> tuple[DatasetDict, dict[str, int]]:
    """Tokenize every split and cut the token stream into blocks of exactly ``block_size`` tokens; returns the packed
    ``DatasetDict`` (``input_ids``) and each split's tokens before packing.

    Packing wastes no compute on padding and gives every batch the same shape (pipeline stages need it). The tail
    shorter than a block is dropped, per map batch of 1,000 examples, as in transformers' run_clm. ``datasets`` caches
    both ``map`` calls: call this under ``accelerator.main_process_first()`` and the others read the main's cache.
    """
    end_of_text = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        ids = [row + [end_of_text] for row in ids] if documents else ids
        return {"input_ids": ids, "num_tokens": [len(row) for row in ids]}

    def pack(batch):
        stream = list(itertools.chain.from_iterable(batch["input_ids"]))
        usable = len(stream) // block_size * block_size
        return {"input_ids": [stream[start : start + block_size] for start in range(0, usable, block_size)]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="tokenizing")
    packed = tokenized.map(
        pack, batched=True, batch_size=1000, remove_columns=["num_tokens"], desc=f"packing into blocks of {block_size}"
    )
    return packed, {split: sum(tokenized[split]["num_tokens"]) for split in tokenized}


class LMData(NamedTuple):
    train_dataset: Dataset
    eval_dataset: Dataset
    tokenizer: object
    facts: dict  # data/* entries of results.json: the corpus, blocks per split, tokens per split before packing


def load_tokenizer(
    accelerator,
    train_texts,
    vocab_size: int,
    output_dir: Path,
    checkpoint: Path | None,
    model_name_or_path: str | None,
):
    """The run's tokenizer: a resumed run's own (saved in its output folder, ``checkpoint.parents[1]``), a pretrained
    model's (its embeddings were trained for it), or else a byte-level BPE the main process trains on ``train_texts``
    and saves to ``output_dir``, where the other processes load it (call under ``main_process_first``). Without a pad
    token, the end-of-text token pads."""
    from transformers import AutoTokenizer

    run_folder = checkpoint.parents[1] if checkpoint is not None else None  # run_folder/checkpoints/step_N
    if run_folder is not None and (run_folder / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(run_folder)
    elif model_name_or_path:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        except (OSError, ValueError) as error:
            raise RecipeError(
                f"--model_name_or_path {model_name_or_path} has no loadable tokenizer ({error}); a "
                "pretrained model needs the tokenizer it was trained with."
            ) from None
    elif accelerator.is_main_process:
        tokenizer = train_bpe_tokenizer((row["text"] for row in train_texts), vocab_size=vocab_size)
        tokenizer.save_pretrained(output_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(output_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# The flags ``lm_datasets`` takes, by the names the recipes' parsers give them.
DATA_FLAGS = (
    "dataset_name",
    "dataset_config_name",
    "train_file",
    "validation_file",
    "validation_split_percentage",
    "corpus_max_mb",
    "model_name_or_path",
    "vocab_size",
    "block_size",
    "max_train_samples",
    "max_eval_samples",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
)


def lm_datasets(
    accelerator,
    data_parallel_size: int,
    output_dir: Path,
    checkpoint: Path | None,
    *,
    dataset_name: str | None,
    dataset_config_name: str | None,
    train_file: str | None,
    validation_file: str | None,
    validation_split_percentage: float,
    corpus_max_mb: float | None,
    model_name_or_path: str | None,
    vocab_size: int,
    block_size: int,
    max_train_samples: int | None,
    max_eval_samples: int | None,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
) -> LMData:
    """The training and validation blocks (``input_ids`` tensors of ``--block_size`` tokens), the tokenizer and the
    data facts, from the LM recipes' flags: the text (``--dataset_name``/``--dataset_config_name``, ``--train_file``/
    ``--validation_file``, or the default corpus, ``--corpus_max_mb``, ``--validation_split_percentage``), the
    tokenizer (``load_tokenizer``: ``--model_name_or_path``'s, a resumed run's, or one of ``--vocab_size`` trained here
    and saved to ``output_dir``), packed (``tokenize_and_pack``), then the first
    ``--max_train_samples``/``--max_eval_samples`` blocks. The main process works first (it reads, trains the tokenizer
    and tokenizes; datasets caches the results, the others then hit the cache). Refuses text that cannot be read, a
    split shorter than one block, and a training set shorter than one optimizer step (``--per_device_train_batch_size``
    x ``--gradient_accumulation_steps`` x ``data_parallel_size`` blocks)."""
    with accelerator.main_process_first():
        try:
            raw, corpus, documents = load_text_corpus(
                dataset_name=dataset_name,
                dataset_config_name=dataset_config_name,
                train_file=train_file,
                validation_file=validation_file,
                validation_split_percentage=validation_split_percentage,
                corpus_max_mb=corpus_max_mb,
            )
        except (OSError, ValueError, ConnectionError) as error:
            raise RecipeError(f"Could not load the training text: {error}") from None
        tokenizer = load_tokenizer(accelerator, raw["train"], vocab_size, output_dir, checkpoint, model_name_or_path)
        packed, token_counts = tokenize_and_pack(raw, tokenizer, block_size, documents)
    for split in ("train", "validation"):
        if len(packed[split]) == 0:
            raise RecipeError(
                f"The {split} text has {token_counts[split]} tokens, fewer than one block of "
                f"--block_size {block_size}. Use more text or a smaller --block_size."
            )
    train_dataset, eval_dataset = packed["train"], packed["validation"]
    if max_train_samples:
        train_dataset = train_dataset.select(range(min(max_train_samples, len(train_dataset))))
    if max_eval_samples:
        eval_dataset = eval_dataset.select(range(min(max_eval_samples, len(eval_dataset))))
    train_dataset.set_format("torch", columns=["input_ids"])
    eval_dataset.set_format("torch", columns=["input_ids"])
    batches_needed = data_parallel_size * gradient_accumulation_steps  # batches of one optimizer step
    if len(train_dataset) // per_device_train_batch_size < batches_needed:  # whole batches only (drop_last)
        raise RecipeError(
            f"One optimizer step needs {batches_needed * per_device_train_batch_size} blocks of "
            f"{block_size} tokens but the training set has {len(train_dataset)} ({token_counts['train']} "
            "tokens). Use more text, a smaller --block_size, --per_device_train_batch_size or "
            "--gradient_accumulation_steps."
        )
    accelerator.print(
        f"data: {corpus}: {len(train_dataset)} train / {len(eval_dataset)} validation blocks of "
        f"{block_size} tokens, vocabulary {len(tokenizer)}"
    )
    facts = {
        "data/corpus": corpus,
        "data/train_blocks": len(train_dataset),
        "data/validation_blocks": len(eval_dataset),
        "data/tokens": token_counts,
    }
    return LMData(train_dataset, eval_dataset, tokenizer, facts)
