"""The user's data files, checked before ``datasets`` parses them, and the offline data sets' standard library."""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from pathlib import Path

import datasets

from .errors import RecipeError

DATA_FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Packages with many docstrings in every supported Python (docs/troubleshooting.md counts them).
DOCSTRING_PACKAGES = ("asyncio", "email", "importlib", "logging", "multiprocessing", "tkinter", "unittest", "xml")
TEST_FOLDERS = {"test", "tests", "idle_test"}


def check_data_files(files: dict[str, str], needs: str) -> None:
    """Refuse a file of ``files`` ({split: path}) that is missing or empty (it ``needs`` ...), naming its flag."""
    for split, file in files.items():
        if not Path(file).is_file():
            raise RecipeError(f"--{split}_file {file!r} does not exist (looked in {Path.cwd()}).")
        if not Path(file).stat().st_size or (
            Path(file).suffix.lower() != ".parquet" and not Path(file).read_bytes().strip()
        ):
            raise RecipeError(f"--{split}_file {file!r} is empty: it needs {needs}.")


def load_data_files(files: dict[str, str], needs: str) -> dict[str, datasets.Dataset]:
    """Each split of ``files`` ({split: path}) read by ``datasets``; a bad file is refused naming its flag."""
    check_data_files(files, needs)
    suffixes = {Path(file).suffix.lower() for file in files.values()}
    if len(suffixes) != 1 or next(iter(suffixes)) not in DATA_FILE_BUILDERS:
        raise RecipeError(f"Data files must all be one of {sorted(DATA_FILE_BUILDERS)}; got {sorted(files.values())}.")
    builder, raw = DATA_FILE_BUILDERS[suffixes.pop()], {}
    for split, file in files.items():
        try:
            raw[split] = datasets.load_dataset(builder, data_files={split: file}, split=split)
        except Exception as error:  # datasets raises many types for unreadable files; report them all plainly
            if "corresponds to no data" in str(error):  # a CSV file with a header and no rows
                raise RecipeError(f"--{split}_file {file!r} is empty: it needs {needs}.") from None
            raise RecipeError(f"Could not read --{split}_file {file!r}: {unreadable(file, error)}") from None
    return raw


def unreadable(file: str, error: Exception) -> str:
    """Why ``datasets`` could not read ``file``, at its 1-based line where there is one, else the innermost error."""
    suffix, causes = Path(file).suffix.lower(), [error]
    while causes[-1].__cause__ or causes[-1].__context__:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
    text = Path(file).read_text(encoding="utf-8", errors="replace") if "json" in suffix else ""
    for number, line in enumerate(text.splitlines() if suffix == ".jsonl" or text.startswith("{") else [], start=1):
        try:
            row = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError as bad:  # (a reason may end in "at": "Unterminated string starting at")
            reason = f"{bad.msg.removesuffix(' at')} at column {bad.colno}"
            return f"line {number} is not valid JSON ({reason}): {line.strip()[:120]!r}"
        if not isinstance(row, dict):
            return f"line {number} is a JSON {type(row).__name__}, not an object of columns: {line.strip()[:120]!r}"
    for cause in causes:  # pandas: "Error tokenizing data. C error: Expected 2 fields in line 7, saw 3"
        if fields := re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(cause)):
            header, number, found = fields.groups()
            return f"line {number} has {found} fields where the header has {header} (quote a text holding a comma)"
    return f"{type(causes[-1]).__name__}: {(str(causes[-1]).strip().splitlines() or [''])[0][:300]}"


def refuse_empty_cells(dataset: datasets.Dataset, columns: list[str], source: str, may_be_empty=()) -> None:
    """Refuse the first row with a missing or empty value in ``columns`` (empty is one in ``may_be_empty``)."""
    for number, values in enumerate(zip(*(dataset[column] for column in columns)), start=1):
        for column, value in zip(columns, values):
            blank = isinstance(value, str | list) and not (value.strip() if isinstance(value, str) else value)
            if value is None or value != value or (blank and column not in may_be_empty):
                raise RecipeError(no_value(f"Row {number} of {source}", column, value))


def no_value(where: str, column: str, value, needs: str = "") -> str:
    """The paragraph for a row with nothing in ``column``, from ``where`` (``needs``: what every row needs)."""
    said = "empty or null" if value is None or value != value else repr(value)
    return f"{where} has no {column!r} (it is {said}){': ' + needs if needs else ''}. Fill it in, or drop the row."


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def in_validation_split(group: str, validation_percent: int) -> bool:
    """Split by top-level definition (no near-twin methods on both sides), by md5: ``hash()`` varies per process."""
    return int(hashlib.md5(group.encode()).hexdigest(), 16) % 100 < validation_percent


def split_by_column(rows: datasets.Dataset) -> datasets.DatasetDict:
    """``train`` and ``validation`` by the ``split`` column, which goes."""
    kept = lambda split: rows.filter(lambda value, wanted=split: value == wanted, input_columns="split")
    return datasets.DatasetDict({split: kept(split).remove_columns("split") for split in ("train", "validation")})
