"""The text-classification fine-tune's inputs, read and checked before any training: the train/validation splits (the
user's files, a Hub data set, or the offline default), their labels, and the model config that names the labels. Every
problem is one readable paragraph (``RecipeError``) that names the file, column or label at fault."""

from __future__ import annotations

import ast
import os
import platform
from collections.abc import Callable
from pathlib import Path

import datasets
from transformers import AutoConfig

from shared.data import DOCSTRING_PACKAGES, TEST_FOLDERS, in_validation_split, load_data_files, refuse_empty_cells
from shared.data import split_by_column, stdlib_root
from shared.errors import RecipeError


def load_splits(
    train_file: str | None,
    validation_file: str | None,
    dataset_name: str | None,
    dataset_config_name: str | None,
    seed: int,
    text_columns: list[str],
    label_column: str,
) -> datasets.DatasetDict:
    """train/validation splits from the user's files (validation: 10% of train, split by ``seed``, when not given), a
    Hub data set (its test split stands in for a missing validation split), or the offline default (docstrings). The
    columns and every cell of them are checked (``check_columns``) before anything is split off, so that a bad row is
    named by its place in the file."""
    if train_file:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        raw = load_data_files(files, needs="at least one row (a CSV: a header line and rows)")
        sources = {split: f"--{split}_file {file!r}" for split, file in files.items()}
    elif dataset_name:
        try:
            raw = datasets.load_dataset(dataset_name, dataset_config_name)
        except Exception as error:  # offline, unknown name, or a bad configuration: all end here
            offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
            raise RecipeError(
                f"Could not load the Hub data set {dataset_name!r} ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:300]})."
                + (" The Hub is switched off here (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE=1)." if offline else "")
                + " Without internet, pass local files with --train_file/--validation_file."
            ) from None
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw["test"]
        raw = {split: raw[split] for split in ("train", "validation") if split in raw}
        sources = {split: f"the {split} split of {dataset_name}" for split in raw}
    else:
        raw = stdlib_docstrings()
        sources = {split: f"the {split} split of the offline default" for split in raw}
    check_columns(raw, text_columns, label_column, sources)
    if "validation" not in raw:
        raw = raw["train"].train_test_split(test_size=0.1, seed=seed)
        raw["validation"] = raw.pop("test")
    return datasets.DatasetDict({"train": raw["train"], "validation": raw["validation"]})


# The two text columns of sentence-pair data sets (GLUE, SuperGLUE, SNLI, common CSVs), in the order they are read.
PAIR_COLUMNS = [
    ("sentence1", "sentence2"),
    ("question1", "question2"),
    ("premise", "hypothesis"),
    ("question", "sentence"),
    ("question", "passage"),
    ("text_a", "text_b"),
    ("text1", "text2"),
]


def check_columns(raw: dict, text_columns: list[str], label_column: str, sources: dict[str, str]) -> None:
    """Refuse a split without the text or label columns, or without rows, one text read alone where the data holds a
    sentence pair (the label of a pair depends on both texts, and a model that sees one of them trains silently to
    about the majority baseline), and a row with nothing in a text or label cell, named by its place in
    ``sources[split]`` (a missing label would become a class of its own, an empty text a tokenizer's traceback)."""
    for split, dataset in raw.items():
        found = dataset.column_names
        pair = next((pair for pair in PAIR_COLUMNS if set(pair) <= set(found)), None)
        missing = [column for column in (*text_columns, label_column) if column not in found]
        if missing:
            hint = f" This looks like sentence pairs: --text_column {pair[0]} {pair[1]}." if pair else ""
            raise RecipeError(
                f"The {split} split has no column {' or '.join(repr(c) for c in missing)}; columns "
                f"found: {found}. Name the right ones with --text_column and --label_column.{hint}"
            )
        if len(dataset) == 0:
            raise RecipeError(f"The {split} split is empty: it needs at least one row.")
        unused = [
            pair
            for pair in PAIR_COLUMNS
            if text_columns[0] in pair
            and len(text_columns) == 1
            and set(pair) <= set(found)
            and label_column not in pair
        ]
        if unused:
            (first, second), other = unused[0], next(c for c in unused[0] if c != text_columns[0])
            raise RecipeError(
                f"The {split} split has a column {other!r} beside --text_column {text_columns[0]}: it looks like "
                f"the other text of a sentence pair, and a pair's label depends on both texts: a model shown "
                f"{text_columns[0]!r} alone trains without an error to about the majority baseline. Pass "
                f"--text_column {first} {second} to tokenize them as a pair (the model's separator and token type "
                f"ids); if {other!r} is not a text of the pair, drop or rename that column."
            )
        refuse_empty_cells(dataset, [*text_columns, label_column], sources[split])


def choose_task(raw: datasets.DatasetDict, label_column: str, task: str) -> tuple[str, str]:
    """Regression or classification, and why. ``task`` "auto": labels that are numbers with a fractional part (STS-B's
    0.0-5.0 similarity scores) are scores to fit; names, integers and whole numbers are classes."""
    if task != "auto":
        return task, f"--task {task}"
    values = raw["train"][label_column]
    fractional = next((v for v in values if isinstance(v, float) and v == v and not v.is_integer()), None)
    if fractional is not None:
        return "regression", (
            f"auto: {label_column!r} holds fractional numbers such as {fractional}: scores, fitted "
            "with a one-output head and MSE; --task classification reads them as class names"
        )
    return "classification", (
        f"auto: {label_column!r} holds names or whole numbers: classes; --task regression fits numbers as scores"
    )


def read_labels(
    raw: datasets.DatasetDict, label_column: str, regression: bool = False
) -> tuple[list[str] | None, Callable[[list], list]]:
    """The label names, and a function from a batch of label values to ids; regression: no names, and the values as
    floats (each checked to be a number). ClassLabel columns keep their names and ids; other values (strings,
    integers) get ids in the sorted order of the values seen in training (integers in numeric order, ``label_name``),
    one mapping for both splits. Not ``Dataset.class_encode_column``: it encodes each split of a DatasetDict on its
    own (two mappings) and sorts integers as text (10 before 2)."""
    if regression:
        for split, dataset in raw.items():
            for value in dataset[label_column]:
                try:
                    if float(value) != float(value) or isinstance(
                        value, bool
                    ):  # NaN (holes were refused with their row)
                        raise ValueError
                except (TypeError, ValueError):
                    raise RecipeError(
                        f"--task regression fits a number per row, and a row of the {split} split has "
                        f"{label_column!r} = {value!r}. Fix that row, or pass --task classification if "
                        "the labels are class names."
                    ) from None
        return None, lambda values: [float(value) for value in values]
    feature = raw["train"].features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        names, to_ids = list(feature.names), list
    else:
        names = sorted(
            {label_name(label) for label in raw["train"][label_column]},
            key=lambda s: (len(s), s) if s.lstrip("-").isdigit() else (0, s),
        )
        unseen = sorted({label_name(label) for label in raw["validation"][label_column]} - set(names))
        if unseen:
            raise RecipeError(
                f"The validation split has labels never seen in training: {unseen[:10]}"
                f"{' ...' if len(unseen) > 10 else ''}. The model can only predict the {len(names)} "
                "training labels; fix the data or the split, or, if the labels are scores, fit them "
                "with --task regression."
            )
        to_id = {name: index for index, name in enumerate(names)}
        to_ids = lambda values: [to_id[label_name(value)] for value in values]
    if len(names) < 2:
        raise RecipeError(
            f"Training data has {len(names)} distinct label(s) in {label_column!r}; classification needs at least 2."
        )
    return names, to_ids


def label_name(value) -> str:
    """A label's name: its text, a whole number as an integer ("5", also where a column was read as floats: 5.0)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def baselines(train_labels, validation_labels, regression: bool) -> dict:
    """What a model that ignores its input scores: always the most frequent training label (its accuracy), or always
    the training mean (its MSE; its correlation is 0)."""
    if regression:
        mean = sum(train_labels) / len(train_labels)
        return {"eval/mean_baseline_mse": sum((y - mean) ** 2 for y in validation_labels) / len(validation_labels)}
    return {"eval/majority_baseline_accuracy": majority_baseline_accuracy(train_labels, validation_labels)}


def majority_baseline_accuracy(train_labels, validation_labels) -> float:
    """The accuracy of always predicting the most frequent training label (the lowest id on a tie)."""
    train_labels, validation_labels = list(train_labels), list(validation_labels)
    majority = max(sorted(set(train_labels)), key=train_labels.count)
    return validation_labels.count(majority) / len(validation_labels)


def load_model_config(name: str, label_names: list[str] | None, max_length: int, trust_remote_code: bool):
    """The model's config with the label names (saved with the model: it predicts names), or for regression (no names)
    one output named "score" and ``problem_type="regression"`` (the saved model's own loss is then MSE), checked
    against ``max_length``; a Hub name while the Hub is off is refused with what to pass (a local folder without
    config.json: ``shared.flags.model_problem``, checked first)."""
    labels, problem = (label_names, {}) if label_names else (["score"], {"problem_type": "regression"})
    try:
        config = AutoConfig.from_pretrained(
            name,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)},
            trust_remote_code=trust_remote_code,
            **problem,
        )
    except (OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise RecipeError(
            f"Could not load model {name!r}: {str(error).splitlines()[0][:300]} "
            + (
                "The Hub is switched off here (HF_HUB_OFFLINE=1), so a Hub name cannot be downloaded: pass a local "
                "path (a folder with config.json and weights), or leave --model_name_or_path out for the offline "
                "default."
                if offline and not Path(name).expanduser().is_dir()
                else "Pass a local folder with config.json and weights, or a Hub name when online."
            )
        ) from None
    # RoBERTa's family numbers positions from pad_token_id + 1 (fairseq's way): roberta-base's 514 take 512 tokens.
    offset = config.pad_token_id + 1 if config.model_type in PAD_OFFSET_POSITIONS else 0
    positions = getattr(config, "max_position_embeddings", max_length + offset) - offset
    if max_length > positions:
        raise RecipeError(
            f"--max_length {max_length} is beyond what {name!r} can take "
            f"(max_position_embeddings={config.max_position_embeddings}"
            + (f", numbered from pad_token_id + 1 = {offset}" if offset else "")
            + f"). Use --max_length {positions} or less."
        )
    return config


# The model types whose position ids start after the pad token's id (transformers' create_position_ids_from_input_ids).
PAD_OFFSET_POSITIONS = {"roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "camembert", "xmod"}
PAD_OFFSET_POSITIONS |= {"data2vec-text", "longformer", "ibert", "mpnet", "luke", "markuplm", "layoutlmv3", "lilt"}
PAD_OFFSET_POSITIONS |= {"esm"}


def _docstring_rows(stdlib: str, python_version: str, packages: list[str], min_chars: int, validation_percent: int):
    """One row per docstring: text, label (package), source (file:group), split (``python_version``: the cache key)."""
    root = Path(stdlib)
    for package in sorted(packages):
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if TEST_FOLDERS & set(path.relative_to(root).parts):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            # The module docstring is its own group; each top-level definition groups its nested ones.
            groups = [("<module>", [tree])]
            groups += [(node.name, list(ast.walk(node))) for node in tree.body if hasattr(node, "name")]
            for group_name, nodes in groups:
                source = f"{relative}:{group_name}"
                split = "validation" if in_validation_split(source, validation_percent) else "train"
                for node in nodes:
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        docstring = ast.get_docstring(node)
                        if docstring and len(docstring) > min_chars:
                            yield {"text": docstring, "label": package, "source": source, "split": split}


def stdlib_docstrings(
    packages=DOCSTRING_PACKAGES, min_chars: int = 40, validation_percent: int = 20
) -> datasets.DatasetDict:
    """Docstrings of the standard library labelled by their top-level package (topic classification): ``train`` and
    ``validation`` with ``text``, ``label`` (the package name) and ``source``. Built once per Python installation, then
    read from the ``datasets`` cache: call it under ``accelerator.main_process_first()``."""
    rows = datasets.Dataset.from_generator(
        _docstring_rows,
        gen_kwargs={
            "stdlib": str(stdlib_root()),
            "python_version": platform.python_version(),
            "packages": sorted(packages),
            "min_chars": min_chars,
            "validation_percent": validation_percent,
        },
    )
    return split_by_column(rows)
