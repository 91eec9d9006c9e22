"""Offline default data sets built from text every Python installation has: the standard library. No download, no
Hub; files are read as text and parsed with ``ast``, nothing from them is imported or executed."""

from __future__ import annotations

import ast
import hashlib
import platform
import sysconfig
from pathlib import Path

import datasets

# Well-populated packages in every supported Python (distutils and lib2to3 went in 3.12/3.13). Docstrings on 3.11: 629
# tkinter, 295 asyncio, 267 email, 259 importlib, 222 logging, 201 xml, 179 unittest, 158 multiprocessing.
DOCSTRING_PACKAGES = ("asyncio", "email", "importlib", "logging", "multiprocessing", "tkinter", "unittest", "xml")
TEST_FOLDERS = {"test", "tests", "idle_test"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def in_validation_split(group: str, validation_percent: int) -> bool:
    """Deterministic split by group (a top-level class or function with everything nested in it, so near-identical
    method docstrings never straddle the split); md5, not ``hash()``, which Python randomizes per process."""
    return int(hashlib.md5(group.encode()).hexdigest(), 16) % 100 < validation_percent


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


def public_definitions(stdlib: str, packages: list[str]):
    """``(module, node)`` for every public top-level function and class of ``packages`` (test folders aside), read
    with ``ast``: what the offline question sets ask about."""
    root = Path(stdlib)
    for package in sorted(packages):
        files = [p for p in (root / package).rglob("*.py") if not TEST_FOLDERS & set(p.relative_to(root).parts)]
        for path in sorted(files):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for top in tree.body:
                if isinstance(top, (ast.FunctionDef, ast.ClassDef)) and not top.name.startswith("_"):
                    yield module, top


def _question_rows(stdlib: str, cache_key: str, packages: list[str], validation_percent: int):
    """One conversation per documented public function: its call as the question, its docstring's first paragraph as
    the answer (``cache_key``: the Python version and this code's version, which ``datasets`` keys its cache on)."""
    # Public functions, and public methods of public classes (grouped by class for the split).
    for module, top in public_definitions(stdlib, packages):
        methods = [node for node in top.body if isinstance(node, ast.FunctionDef)]
        for node in [top] if isinstance(top, ast.FunctionDef) else methods:
            answer = (ast.get_docstring(node) or "").split("\n\n")[0]
            if len(answer) > 40 and not node.name.startswith("_"):
                name = f"{module}.{top.name}" + (f".{node.name}" if node is not top else "")
                held_out = in_validation_split(f"{module}:{top.name}", validation_percent)
                split = "validation" if held_out else "train"
                question = f"What does {name}({ast.unparse(node.args)}) do?"
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                yield {"messages": messages, "split": split}


def stdlib_questions(packages=DOCSTRING_PACKAGES, validation_percent: int = 10) -> datasets.DatasetDict:
    """Questions about standard-library functions answered by their docstrings, as ``messages`` conversations
    (``train``/``validation``): the offline default of ``recipes/llm_finetune.py``. Call under main_process_first."""
    rows = datasets.Dataset.from_generator(_question_rows, gen_kwargs={
        "stdlib": str(stdlib_root()), "cache_key": f"{platform.python_version()}-v1", "packages": sorted(packages),
        "validation_percent": validation_percent})
    return split_by_column(rows)


def _name_rows(stdlib: str, cache_key: str, packages: list[str], validation_percent: int):
    """Is this dotted name (read with ``ast``) a class, a function or a method? Asked of every public top-level
    function and class, and of one public method per class (picked by md5), so that methods do not outnumber the
    rest 4 to 1. The answer follows from the name by Python's naming conventions, which a model can learn."""
    for module, top in public_definitions(stdlib, packages):
        name = f"{module}.{top.name}"
        names = [(name, "class" if isinstance(top, ast.ClassDef) else "function")]
        methods = [node.name for node in getattr(top, "body", []) if isinstance(top, ast.ClassDef)
                   and isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
        if methods:
            names.append((f"{name}.{methods[int(hashlib.md5(name.encode()).hexdigest(), 16) % len(methods)]}",
                          "method"))
        # Split by top-level definition: a class and its method are on one side.
        split = "validation" if in_validation_split(f"{module}:{top.name}", validation_percent) else "train"
        for asked, kind in names:
            question = f"Is `{asked}` a class, a function or a method?"
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": kind}]
            yield {"messages": messages, "split": split}


def stdlib_names(packages=DOCSTRING_PACKAGES, validation_percent: int = 10) -> datasets.DatasetDict:
    """Is a standard-library name a class, a function or a method: one-word answers, as ``messages`` conversations
    (``train``/``validation``, held out by top-level definition), the offline default of ``recipes/llm_finetune.py``.
    ``datasets`` caches them by ``cache_key``: change its version with the code. Call under ``main_process_first``."""
    rows = datasets.Dataset.from_generator(_name_rows, gen_kwargs={
        "stdlib": str(stdlib_root()), "cache_key": f"{platform.python_version()}-v2", "packages": sorted(packages),
        "validation_percent": validation_percent})
    return split_by_column(rows)


def split_by_column(rows: datasets.Dataset) -> datasets.DatasetDict:
    """``train`` and ``validation`` by the ``split`` column, which goes."""
    return datasets.DatasetDict({split: rows.filter(lambda value, wanted=split: value == wanted, input_columns="split")
                                 .remove_columns("split") for split in ("train", "validation")})


def stdlib_docstrings(packages=DOCSTRING_PACKAGES, min_chars: int = 40,
                      validation_percent: int = 20) -> datasets.DatasetDict:
    """Docstrings of the standard library labelled by their top-level package (topic classification): ``train`` and
    ``validation`` with ``text``, ``label`` (the package name) and ``source``. Built once per Python installation, then
    read from the ``datasets`` cache: call it under ``accelerator.main_process_first()``."""
    rows = datasets.Dataset.from_generator(_docstring_rows, gen_kwargs={
        "stdlib": str(stdlib_root()), "python_version": platform.python_version(), "packages": sorted(packages),
        "min_chars": min_chars, "validation_percent": validation_percent})
    return split_by_column(rows)
