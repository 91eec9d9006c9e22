"""Bad data files, refused alike by every recipe that reads them: an empty file, a row with nothing in its label or
text cell, a line that is not JSON. Each is one paragraph naming the file, the 1-based row or line and the column, in
the same words in every recipe (shared/data.py writes them), and a non-zero exit; never a traceback, never a run that
trains on a hole (a missing label became a class "None", an empty text a 71-line tokenizer traceback).

The recipes are found, not listed: every recipes/*.py whose ``--help`` offers ``--train_file`` (each imported here,
its own parser asked). ``DATA_SHAPES`` says how each one's data looks: a good row, the columns a hole goes in, the
flags that reach its data check with a tiny model. A recipe found without an entry fails the test named for it until
one is added; a case a recipe cannot have is listed with its reason, and nothing else is skipped.
Each refusal is a 1-process launch (``python recipe.py``, forked from the test zygote): the refusals come before any
training."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness.launch import ONE_PROCESS, RECIPES, Job, launch_all
from harness.models import save_tiny_llama

ROWS, BAD_ROW = 8, 3  # the files' good rows, and the 1-based row (or line) that holds the hole or the broken JSON
# The cases every data-reading recipe gets.
CASES = ("empty_file", "missing_label", "empty_text", "malformed_line")


@dataclass
class DataShape:
    """How a recipe's training data looks. ``row(i)``: a good row; ``suffix``: the file it is written to (``.csv``
    writes an empty cell for a hole, ``.jsonl`` a JSON null or ""); ``label``/``text``: the column a missing label or
    an empty text goes in; ``args``: the flags that reach the data check (a tiny model, no training);
    ``not_applicable``: a case the recipe cannot have, and why; ``default_base``: without a model flag the recipe
    builds its default base (pretrained first with recipes/train_lm.py when there is none), which bad data must not
    wait for."""

    row: Callable[[int], dict] | None = None
    suffix: str = ".jsonl"
    label: str | None = None
    text: str | None = None
    args: Callable[[dict], tuple] = lambda models: ()
    not_applicable: dict[str, str] = field(default_factory=dict)
    default_base: bool = False


TINY_LLAMA = lambda models: ("--model_name_or_path", models["llama"], "--max_train_steps", "1")
NO_LABEL = "no label column: the answer is text, blanked in the empty_text case"
# One entry per recipe whose --help offers --train_file.
DATA_SHAPES = {
    # The labelled CSV of the docs (a hole is an empty cell: pandas reads it as NaN, the column as floats).
    "transformer_finetune.py": DataShape(
        row=lambda i: {"text": f"sample {i} about {'cats' if i % 2 else 'dogs'}", "label": i % 5 + 1},
        suffix=".csv",
        label="label",
        text="text",
        args=lambda models: ("--max_train_steps", "1"),  # the offline default model (MiniLM)
    ),
    "llm_finetune.py": DataShape(
        row=lambda i: {"prompt": f"Is item {i} a class?", "completion": "a class"},
        text="completion",
        args=TINY_LLAMA,
        not_applicable={"missing_label": NO_LABEL},
        default_base=True,
    ),
    "dpo.py": DataShape(
        row=lambda i: {"prompt": f"Is item {i} a class?", "chosen": "a class", "rejected": "a function"},
        text="chosen",
        args=TINY_LLAMA,
        not_applicable={"missing_label": NO_LABEL},
        default_base=True,
    ),
    # Prompts with the column the accuracy reward reads (a reward column's hole: no answer to score against).
    "grpo.py": DataShape(
        row=lambda i: {"prompt": f"Is item {i} a class?", "answer": "a class"},
        label="answer",
        text="prompt",
        args=lambda models: (*TINY_LLAMA(models), "--num_generations", "2", "--max_completion_length", "4"),
        default_base=True,
    ),
    "train_lm.py": DataShape(
        suffix=".txt",
        args=lambda models: ("--model_size", "tiny", "--max_train_steps", "1"),
        not_applicable={
            "missing_label": "plain text, no columns",
            "empty_text": "plain text: an empty line is part of the running text, not a hole",
            "malformed_line": "plain text has no syntax to break",
        },
    ),
    "pipeline_lm.py": DataShape(
        not_applicable=dict.fromkeys(
            CASES,
            "its data is train_lm.py's (lm_kit.data, every other line equal: test_layout.py), tested there; a "
            "pipeline launches only in 2 processes",
        )
    ),
}


def recipe_module(path: Path):
    """The recipe imported by path (its main() is not run)."""
    spec = importlib.util.spec_from_file_location(f"_bad_data_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def offers_train_file(path: Path) -> bool:
    """Whether the recipe's own ``--help`` offers ``--train_file``."""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        recipe_module(path).parse_args(["--help"])
    return "--train_file" in shown.getvalue()


DATA_RECIPES = [path.name for path in sorted(RECIPES.glob("*.py")) if offers_train_file(path)]


def write_data(folder: Path, name: str, shape: DataShape, case: str) -> Path:
    """The training file of ``case`` for ``shape``: ``ROWS`` good rows, with the hole or broken line at ``BAD_ROW``."""
    path = folder / f"{name}{'.jsonl' if case == 'malformed_line' else shape.suffix}"
    if case == "empty_file":
        path.write_text("")
        return path
    rows = [shape.row(i) for i in range(ROWS)]
    if case in ("missing_label", "empty_text"):
        column = shape.label if case == "missing_label" else shape.text
        rows[BAD_ROW - 1][column] = None if case == "missing_label" else ""
    if path.suffix == ".csv":
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)  # (None and "" are both an empty cell)
        return path
    lines = [json.dumps(row) for row in rows]
    if case == "malformed_line":
        lines[BAD_ROW - 1] = lines[BAD_ROW - 1][:14]  # cut inside its first string
    path.write_text("\n".join(lines) + "\n")
    return path


def expected(case: str, shape: DataShape, path: Path) -> str:
    """The words every recipe says for ``case``."""
    column = shape.label if case == "missing_label" else shape.text
    return {
        "empty_file": f"--train_file '{path}' is empty: it needs",
        "missing_label": f"Row {BAD_ROW} of --train_file '{path}' has no '{column}' (it is empty or null)",
        "empty_text": f"Row {BAD_ROW} of --train_file '{path}' has no '{column}'",
        "malformed_line": f"Could not read --train_file '{path}': line {BAD_ROW} is not valid JSON "
        "(Unterminated string starting at column",  # (said "starting at at column" once)
    }[case]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every applicable (recipe, case), launched in one process each, two at a time."""
    root = tmp_path_factory.mktemp("bad_data")
    models = {"llama": root / "llama"}
    save_tiny_llama(models["llama"], num_hidden_layers=1)
    jobs, files = {}, {}
    for recipe in DATA_RECIPES:
        shape = DATA_SHAPES.get(recipe)
        for case in CASES if shape else ():
            if case in shape.not_applicable:
                continue
            name = f"{recipe[:-3]}-{case}"
            files[name] = write_data(root, name, shape, case)
            args = ("--train_file", files[name], *shape.args(models), "--output_dir", root / "out" / name)
            jobs[name] = Job(ONE_PROCESS, recipe, args)
    return {name: (run, files[name]) for name, run in launch_all(jobs).items()}


def test_every_recipe_that_reads_data_files_has_a_data_shape():
    assert {"transformer_finetune.py", "llm_finetune.py", "dpo.py", "train_lm.py"} <= set(DATA_RECIPES)
    missing = [recipe for recipe in DATA_RECIPES if recipe not in DATA_SHAPES]
    assert not missing, (
        f"{missing} offer --train_file but have no entry in DATA_SHAPES (tests/conformance/test_bad_data.py): add "
        "one saying how a good row looks, the label or text column a hole goes in and the flags that reach the data "
        "check, so that they get the bad-data cases every recipe gets"
    )
    for recipe, shape in DATA_SHAPES.items():
        assert recipe in DATA_RECIPES, f"{recipe} has a data shape but no --train_file (or no longer exists)"
        assert set(shape.not_applicable) <= set(CASES) and all(shape.not_applicable.values()), recipe


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("recipe", DATA_RECIPES)
def test_bad_data_is_refused_in_one_paragraph_naming_the_file_the_row_and_the_column(refusals, recipe, case):
    shape = DATA_SHAPES.get(recipe)
    assert shape is not None, f"{recipe}: no entry in DATA_SHAPES (see test_every_recipe_that_reads_data_files_...)"
    if case in shape.not_applicable:
        pytest.skip(f"{recipe}: {shape.not_applicable[case]}")
    run, path = refusals[f"{recipe[:-3]}-{case}"]
    assert run.returncode != 0, str(run)
    paragraphs = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in run.output and len(paragraphs) == 1, str(run)
    assert expected(case, shape, path) in " ".join(run.output.split()), str(run)
    assert "train/loss" not in run.output, str(run)  # refused before any training


# What a recipe prints when it starts on its default base: pretraining one (llm_kit.loading.default_base_model), or
# continuing the SFT adapter in outputs/llm_finetune (llm_kit.adapters.starting_point), whichever this machine has.
DEFAULT_BASE_LINES = ("no base model yet: pretraining one first", "offline default: continuing the SFT adapter")
DEFAULT_BASE_RECIPES = [recipe for recipe, shape in DATA_SHAPES.items() if shape.default_base]


@pytest.fixture(scope="module")
def refusals_without_a_model(tmp_path_factory):
    """Each recipe with a default base, launched with a broken --train_file and no model flag (one process each)."""
    root = tmp_path_factory.mktemp("bad_data_no_model")
    files = {
        recipe: write_data(root, recipe[:-3], DATA_SHAPES[recipe], "malformed_line") for recipe in DEFAULT_BASE_RECIPES
    }
    jobs = {
        recipe: Job(
            ONE_PROCESS, recipe, ("--train_file", path, "--max_train_steps", "1", "--output_dir", root / recipe)
        )
        for recipe, path in files.items()
    }
    return {recipe: (run, files[recipe]) for recipe, run in launch_all(jobs).items()}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", DEFAULT_BASE_RECIPES)
def test_bad_data_is_refused_before_the_default_base_is_built(refusals_without_a_model, recipe):
    """Without a model flag the base may take minutes to pretrain: a file that cannot be read is refused first."""
    run, path = refusals_without_a_model[recipe]
    assert run.returncode != 0, str(run)
    assert expected("malformed_line", DATA_SHAPES[recipe], path) in " ".join(run.output.split()), str(run)
    assert not [line for line in DEFAULT_BASE_LINES if line in run.output], str(run)
