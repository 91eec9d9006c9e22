"""Reading the data every recipe family reads: the user's data files (CSV, JSON, JSON Lines, Parquet), checked before
``datasets`` parses them, and the basics of the offline default data sets, built from text every Python installation
has, the standard library (no download, no Hub; files are read as text and parsed with ``ast``, nothing from them is
imported or executed). Each recipe's own data set lives beside it, in its kit."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import datasets

from .runtime import RecipeError

DATA_FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Well-populated packages in every supported Python (distutils and lib2to3 went in 3.12/3.13). Docstrings on 3.11: 629
# tkinter, 295 asyncio, 267 email, 259 importlib, 222 logging, 201 xml, 179 unittest, 158 multiprocessing.
DOCSTRING_PACKAGES = ("asyncio", "email", "importlib", "logging", "multiprocessing", "tkinter", "unittest", "xml")
TEST_FOLDERS = {"test", "tests", "idle_test"}


def data_file_builder(files: dict[str, str], needs: str) -> str:
    """The ``datasets`` builder (``csv``, ``json``, ``parquet``) for ``files`` ({split: path}, all of one kind), after
    refusing a file that is missing or empty, naming its flag (``needs``: what an empty file lacks, said then)."""
    for split, file in files.items():
        if not Path(file).is_file():
            raise RecipeError(f"--{split}_file {file!r} does not exist (looked in {Path.cwd()}).")
        if not Path(file).stat().st_size or (
            Path(file).suffix.lower() != ".parquet" and not Path(file).read_bytes().strip()
        ):
            raise RecipeError(f"--{split}_file {file!r} is empty: it needs {needs}.")
    suffixes = {Path(file).suffix.lower() for file in files.values()}
    if len(suffixes) != 1 or next(iter(suffixes)) not in DATA_FILE_BUILDERS:
        raise RecipeError(f"Data files must all be one of {sorted(DATA_FILE_BUILDERS)}; got {sorted(files.values())}.")
    return DATA_FILE_BUILDERS[suffixes.pop()]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def in_validation_split(group: str, validation_percent: int) -> bool:
    """Deterministic split by group (a top-level class or function with everything nested in it, so near-identical
    method docstrings never straddle the split); md5, not ``hash()``, which Python randomizes per process."""
    return int(hashlib.md5(group.encode()).hexdigest(), 16) % 100 < validation_percent


def split_by_column(rows: datasets.Dataset) -> datasets.DatasetDict:
    """``train`` and ``validation`` by the ``split`` column, which goes."""
    return datasets.DatasetDict(
        {
            split: rows.filter(lambda value, wanted=split: value == wanted, input_columns="split").remove_columns(
                "split"
            )
            for split in ("train", "validation")
        }
    )
