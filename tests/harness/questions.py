"""Questions about standard-library functions, answered by their docstrings: long answers, the SFT data on which the
tests build their tiny models' tokenizers and chats (``models.save_tiny_llama``) and the benchmarks compare the recipe
with TRL (they import it from here: a fixture of the tests, built on the LLM recipes' kit). The recipe's own offline
default is ``llm_kit.sft_data.stdlib_names``, one-word answers. Callers put the repository root and ``recipes/`` (the
kits) on ``sys.path`` first."""

from __future__ import annotations

import ast
import platform

import datasets
from llm_kit.sft_data import public_definitions

from shared.data import DOCSTRING_PACKAGES, in_validation_split, split_by_column, stdlib_root


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
    (``train``/``validation``). Call under main_process_first."""
    rows = datasets.Dataset.from_generator(
        _question_rows,
        gen_kwargs={
            "stdlib": str(stdlib_root()),
            "cache_key": f"{platform.python_version()}-v1",
            "packages": sorted(packages),
            "validation_percent": validation_percent,
        },
    )
    return split_by_column(rows)
