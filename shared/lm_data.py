"""Text for the language-model recipes: the offline default corpus, a byte-level BPE tokenizer trained on it, and
packing token streams into fixed-length blocks.

The default corpus is the Python standard library's own source (``*.py``; tests, codec tables and site-packages left
out): about 12 MB of real text every machine with Python has, split into train and validation *by file*.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from datasets import DatasetDict, load_dataset

from .data import TEST_FOLDERS, stdlib_root

# Not ordinary source: test suites (generated data, fixtures), codec tables (walls of hex), whatever pip installed.
EXCLUDED_STDLIB_FOLDERS = {"site-packages", "dist-packages", "encodings"} | TEST_FOLDERS
END_OF_TEXT = "<|endoftext|>"


def standard_library_files(max_mb: float | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by path (the same split and tokens on every machine with the same
    Python version), optionally only the first ``max_mb`` MB."""
    root = stdlib_root()
    files = sorted(path for path in root.rglob("*.py")
                   if path.is_file() and not set(path.relative_to(root).parts[:-1]) & EXCLUDED_STDLIB_FOLDERS)
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


def load_text_corpus(*, dataset_name: str | None, dataset_config_name: str | None, train_file: str | None,
                     validation_file: str | None, validation_split_percentage: float,
                     corpus_max_mb: float | None) -> tuple[DatasetDict, str, bool]:
    """The raw text as a ``DatasetDict`` (``train``, ``validation``; a ``text`` column), a description, and
    ``documents``: True when each example is a whole document (the default corpus: one per file), so the packer puts
    an end-of-text token between examples; text files (one example per line, line breaks kept) and Hub datasets are
    pieces of running text, joined as they are."""
    if dataset_name is not None:
        raw = load_dataset(dataset_name, dataset_config_name)
        if "validation" not in raw:
            # Same convention as transformers' run_clm: hold out the first N% of the train split.
            held_out = f"{validation_split_percentage:g}%"
            raw = DatasetDict({
                "train": load_dataset(dataset_name, dataset_config_name, split=f"train[{held_out}:]"),
                "validation": load_dataset(dataset_name, dataset_config_name, split=f"train[:{held_out}]"),
            })
        features = raw["train"].features.items()
        text_columns = [name for name, feature in features if getattr(feature, "dtype", None) == "string"]
        if not text_columns:
            raise ValueError(f"dataset {dataset_name!r} has no string column to train on")
        column = "text" if "text" in text_columns else text_columns[0]
        raw = DatasetDict({split: raw[split].select_columns([column]).rename_column(column, "text") if column != "text"
                           else raw[split].select_columns(["text"]) for split in ("train", "validation")})
        return raw, f"Hub dataset {dataset_name}" + (f" ({dataset_config_name})" if dataset_config_name else ""), False

    if train_file is not None:
        files = {"train": [train_file], **({"validation": [validation_file]} if validation_file else {})}
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
    return raw, (f"Python standard library source ({len(train_files)} train files, {len(validation_files)} validation "
                 f"files, {megabytes:.1f} MB) from {stdlib_root()}"), True


def train_bpe_tokenizer(texts, vocab_size: int):
    """Train a byte-level BPE tokenizer (the GPT-2 recipe) on ``texts``, wrapped for transformers (``save_pretrained``,
    ``AutoTokenizer.from_pretrained``). Byte-level: every string encodes (no unknown token) and decodes back exactly,
    indentation included, which matters for source code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    # The end-of-text token doubles as padding: generation wants a pad id, and training never pads.
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)


def tokenize_and_pack(raw: DatasetDict, tokenizer, block_size: int,
                      documents: bool) -> tuple[DatasetDict, dict[str, int]]:
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
        return {"input_ids": [stream[start:start + block_size] for start in range(0, usable, block_size)]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="tokenizing")
    packed = tokenized.map(pack, batched=True, batch_size=1000, remove_columns=["num_tokens"],
                           desc=f"packing into blocks of {block_size}")
    return packed, {split: sum(tokenized[split]["num_tokens"]) for split in tokenized}
