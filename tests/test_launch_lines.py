"""Every ``accelerate launch`` line we print for users works: the config headers in accelerate_configs/, the code
blocks of README.md and the docs/ pages, and the docstrings of the recipes and of the setup checker
(tools/check_setup.py, the one tool users launch with ``accelerate launch``).

Each line (joined across backslash continuations) is checked in-process, without training: Accelerate's own launch
parser reads it, Accelerate's own loader loads its config, the recipe exists and its own ``parse_args`` accepts the
flags, and the recipe's own decisions accept the combination: the ``choose_parallelism`` call in its ``main`` (with
the value it passes: ``args.parallelism``, or the ``"pipeline"`` that pipeline_lm.py hard-codes) and, where the recipe
has one, its ``check_pipeline_request``, called with a small fake Accelerator shaped like the config (its process
count and distributed type; an FSDP config also sets ``ACCELERATE_USE_FSDP``, as ``accelerate launch`` does).

The launch line each ``choose_parallelism`` refusal prints (``CONFIG_FOR``) gets the same check. Then every
(config, recipe) pair that no other test launches is launched for real, as written plus tiny-size flags (``TINY``);
today that is model_sharding_2gpu.yaml + check_setup.py, the only pair not in ``LAUNCHED_ELSEWHERE``.

Substitutions, all explicit here: shell variables in the SLURM example (``SHELL_VARIABLES``); documented placeholders
(``PLACEHOLDERS``: ``...`` and the users' own files) and Hub model names (``org/name``, or a legacy
``bert-base-uncased``; no internet in tests) are accepted as flag values in-process, and a line that holds one is never
launched: its pair must be launched elsewhere with a local stand-in (``LAUNCHED_ELSEWHERE``). README prose that only
mentions a launch (an inline fragment such as ``accelerate launch --max_restarts 1 ...``, an error message quoted in a
table) is not a launch line; fenced code is.
"""

import ast
import functools
import importlib.util
import io
import re
import shlex
import sys
from argparse import Namespace
from contextlib import redirect_stderr
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser
from accelerate.utils import DistributedType
from harness.launch import CONFIGS, RECIPES, REPO, Job, launch_all

# The SLURM example's variables, as one machine of the two would see them.
SHELL_VARIABLES = {"$SLURM_NODEID": "0", "$MASTER_ADDR": "127.0.0.1"}
# Flag values that stand for the user's own choice: a model ("..."), their data files.
PLACEHOLDERS = {"...", "chats.jsonl", "prompts.jsonl", "train.csv", "dev.csv", "YOUR_DATA.jsonl"}
# A Hub model: ``org/name``, or a legacy name without an org (bert-base-uncased).
HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
# The scripts a launch line may name: every recipe, and the setup checker (a diagnostic, so it lives in tools/).
SCRIPTS = sorted(RECIPES.glob("*.py")) + [REPO / "tools" / "check_setup.py"]

# (config, recipe) pairs another test launches, with tiny sizes and local stand-ins: where.
LAUNCHED_ELSEWHERE = {
    ("single_gpu.yaml", "linear_toy.py"): "test_linear_toy.py",
    ("ddp_2gpu.yaml", "linear_toy.py"): "test_linear_toy.py",
    ("model_sharding_2gpu.yaml", "linear_toy.py"): "test_linear_toy.py",
    ("multinode_2x2gpu.yaml", "linear_toy.py"): "test_reliability.py",
    ("single_gpu.yaml", "check_setup.py"): "test_check_setup.py",
    ("ddp_2gpu.yaml", "check_setup.py"): "test_check_setup.py",
    ("single_gpu.yaml", "transformer_finetune.py"): "test_transformer_finetune.py",
    ("ddp_2gpu.yaml", "transformer_finetune.py"): "test_transformer_finetune.py",
    ("model_sharding_2gpu.yaml", "transformer_finetune.py"): "test_transformer_finetune.py",
    ("fsdp_2gpu.yaml", "transformer_finetune.py"): "test_fsdp.py",
    ("single_gpu.yaml", "train_lm.py"): "test_lm_recipes.py",
    ("ddp_2gpu.yaml", "train_lm.py"): "test_lm_recipes.py",
    ("model_sharding_2gpu.yaml", "train_lm.py"): "test_lm_recipes.py",
    ("fsdp_2gpu.yaml", "train_lm.py"): "test_fsdp.py",
    ("fsdp_offload_2gpu.yaml", "train_lm.py"): "test_fsdp.py",
    ("pipeline_2gpu.yaml", "pipeline_lm.py"): "test_lm_recipes.py",
    ("single_gpu.yaml", "llm_finetune.py"): "test_llm_finetune.py",
    ("ddp_2gpu.yaml", "llm_finetune.py"): "test_llm_finetune.py",
    ("fsdp_2gpu.yaml", "llm_finetune.py"): "test_llm_finetune.py",
    ("fsdp_offload_2gpu.yaml", "llm_finetune.py"): "test_llm_finetune.py",
    ("model_sharding_2gpu.yaml", "llm_finetune.py"): "test_llm_finetune.py",
    ("single_gpu.yaml", "dpo.py"): "test_dpo.py",
    ("ddp_2gpu.yaml", "dpo.py"): "test_dpo.py",
    ("fsdp_2gpu.yaml", "dpo.py"): "test_dpo.py",
    ("fsdp_offload_2gpu.yaml", "dpo.py"): "test_dpo.py",
    ("single_gpu.yaml", "grpo.py"): "test_grpo.py",
    ("ddp_2gpu.yaml", "grpo.py"): "test_grpo.py",
    ("fsdp_2gpu.yaml", "grpo.py"): "test_grpo.py",
}
# Appended to a launched line (argparse keeps the last value of a flag, so these win over the line's sizes).
LM_TINY = (
    "--model_size",
    "tiny",
    "--corpus_max_mb",
    "0.5",
    "--vocab_size",
    "512",
    "--block_size",
    "32",
    "--max_train_steps",
    "2",
    "--per_device_train_batch_size",
    "4",
    "--max_eval_samples",
    "4",
    "--sample_tokens",
    "4",
)
TINY = {
    "check_setup.py": ("--sizes_mb", "1", "--iterations", "2", "--warmup", "1"),
    "linear_toy.py": ("--max_train_steps", "5"),
    "transformer_finetune.py": ("--max_train_steps", "2", "--max_train_samples", "32"),
    "train_lm.py": LM_TINY,
    "pipeline_lm.py": (*LM_TINY, "--num_microbatches", "2", "--per_device_eval_batch_size", "4"),
}


# ----------------------------------------------------------------------------- finding the lines
def joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(first line number, text) of each line, backslash continuations joined."""
    out, pending, first = [], "", None
    for number, line in lines:
        text, first = line.rstrip(), number if first is None else first
        if text.endswith("\\"):
            pending += text[:-1] + " "
        else:
            out.append((first, pending + text))
            pending, first = "", None
    return out


def docstring(path: Path) -> tuple[str, int, int]:
    """A module's docstring as Python reads it (``\\\\`` is one backslash), and its first and last source lines."""
    node = ast.parse(path.read_text()).body[0]
    assert isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant), f"{path.name} has no docstring"
    return node.value.value, node.lineno, node.end_lineno


def docstring_lines(path: Path) -> list[tuple[int, str]]:
    text, first, _ = docstring(path)
    return list(enumerate(text.splitlines(), first))


# The README and the pages its details moved to.
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_lines(path: Path) -> list[tuple[int, str]]:
    """A Markdown file's lines inside fenced code blocks, with their line numbers."""
    found, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
        elif fenced:
            found.append((number, line))
    return found


def command_of(text: str) -> str | None:
    """The ``accelerate launch ...`` command in a line of shell: from those words up to a trailing comment, ``&&``,
    or the closing quote of a ``bash -c '...'`` opened before it."""
    start = text.find("accelerate launch")
    if start < 0:
        return None
    command = text[start:].split(" && ")[0]
    if text[:start].count("'") % 2:
        command = command.replace("'", "")
    return shlex.join(shlex.split(command, comments=True))


def launch_lines() -> list[tuple[str, str]]:
    """(where, command) for every launch line: config headers, README code blocks, recipe docstrings."""
    found = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        comments = [
            (number, line.lstrip("#").strip())
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if line.startswith("#")
        ]
        found += [(f"accelerate_configs/{path.name}:{number}", line) for number, line in joined(comments)]
    for path in DOCS:
        where = path.relative_to(REPO).as_posix()
        found += [(f"{where}:{number}", line) for number, line in joined(code_lines(path))]
    for path in SCRIPTS:
        where = path.relative_to(REPO).as_posix()
        found += [(f"{where}:{number}", line) for number, line in joined(docstring_lines(path))]
    return [(where, command) for where, line in found if (command := command_of(line))]


LINES = launch_lines()


def substituted(command: str) -> list[str]:
    words = shlex.split(command)[2:]  # after "accelerate launch"
    unknown = [word for word in words if word.startswith("$") and word not in SHELL_VARIABLES]
    assert not unknown, f"shell variables with no stand-in in SHELL_VARIABLES: {unknown}"
    return [SHELL_VARIABLES.get(word, word) for word in words]


def stand_ins_needed(args: list[str]) -> list[str]:
    """The line's model and data values that are not files here: each must be a documented placeholder or (for the
    model) a Hub name. A line holding one is checked in-process only."""
    needed = []
    for flag, value in zip(args, args[1:]):
        if flag in ("--model_name_or_path", "--train_file", "--validation_file") and not (REPO / value).exists():
            hub_model = flag == "--model_name_or_path" and HUB_NAME.match(value)
            assert value in PLACEHOLDERS or hub_model, f"{flag} {value}: no such file, nor a placeholder or Hub model"
            needed.append(value)
    return needed


def parsed(command: str) -> Namespace:
    """Accelerate's own launch parser on the line (``--config_file``, launch options, script, script arguments)."""
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            return launch_command_parser().parse_args(substituted(command))
    except SystemExit:
        pytest.fail(f"accelerate launch rejects it: {stderr.getvalue().strip()}")


# ----------------------------------------------------------------------------- the recipe's own decisions
@functools.cache
def recipe_module(path: Path):
    """The recipe imported by path (its main() is not run)."""
    spec = importlib.util.spec_from_file_location(f"_launch_line_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def parallelism_argument(path: Path) -> ast.expr | None:
    """What the recipe passes to ``choose_parallelism``, read from its code: a literal (``"pipeline"``) or an
    argument (``args.parallelism``). None: the recipe does not choose one (check_setup.py runs under any config)."""
    calls = [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "choose_parallelism"
    ]
    if not calls:
        return None
    assert len(calls) == 1, f"{path.name} calls choose_parallelism {len(calls)} times"
    value = calls[0].args[1]
    assert isinstance(value, ast.Constant) or (
        isinstance(value, ast.Attribute) and getattr(value.value, "id", None) == "args"
    ), ast.unparse(value)
    return value


def requested_parallelism(path: Path, args: Namespace) -> str | None:
    """The parallelism the recipe asks choose_parallelism for, with these arguments."""
    value = parallelism_argument(path)
    return value if value is None else value.value if isinstance(value, ast.Constant) else getattr(args, value.attr)


def fake_accelerator(config, num_processes: int) -> SimpleNamespace:
    """What choose_parallelism reads of an Accelerator, as this config starts it on this machine."""
    return SimpleNamespace(
        num_processes=num_processes,
        distributed_type=DistributedType(config.distributed_type),
        device=torch.device("cpu"),  # (on GPUs only auto's pick differs, never a refusal)
    )


def check_launch_line(command: str, monkeypatch) -> tuple[str, str]:
    """Fail with the reason if the line cannot run; return its (config, recipe) file names."""
    launch_args = parsed(command)
    assert launch_args.config_file, "no --config_file"
    config_path = REPO / launch_args.config_file
    assert config_path.is_file(), f"no config {launch_args.config_file}"
    config = load_config_from_file(str(config_path))
    script = REPO / launch_args.training_script
    assert script.is_file() and script in SCRIPTS, f"no recipe or setup checker {launch_args.training_script}"
    stand_ins_needed(launch_args.training_script_args)

    module = recipe_module(script)
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            args = module.parse_args(launch_args.training_script_args)
    except SystemExit:
        pytest.fail(f"{script.name} rejects its flags: {stderr.getvalue().strip()}")
    num_processes = launch_args.num_processes or config.num_processes
    accelerator = fake_accelerator(config, num_processes)
    # accelerate launch sets this for an FSDP config; choose_parallelism reads it.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", str(config.distributed_type == DistributedType.FSDP).lower())
    requested = requested_parallelism(script, args)
    try:
        if requested is not None:
            module.choose_parallelism(accelerator, requested, script.relative_to(REPO).as_posix())
        if hasattr(module, "check_pipeline_request"):
            mixed_precision = args.mixed_precision or config.mixed_precision
            eval_batch_size = args.per_device_eval_batch_size or args.per_device_train_batch_size
            module.check_pipeline_request(
                pipeline_schedule=args.pipeline_schedule,
                num_microbatches=args.num_microbatches,
                stages_per_process=args.stages_per_process,
                per_device_train_batch_size=args.per_device_train_batch_size,
                eval_batch_size=eval_batch_size,
                num_processes=num_processes,
                mixed_precision=mixed_precision,
            )
    except SystemExit as refusal:  # RecipeError
        pytest.fail(f"{script.name} refuses this launch: {refusal.code}")
    return config_path.name, script.name


# ----------------------------------------------------------------------------- tests
def test_every_source_gives_launch_lines():
    sources = {where.split(":")[0] for where, _ in LINES}
    expected = {f"accelerate_configs/{path.name}" for path in CONFIGS.glob("*.yaml")}
    expected |= {path.relative_to(REPO).as_posix() for path in SCRIPTS} | {"README.md"}
    assert expected <= sources <= expected | {path.relative_to(REPO).as_posix() for path in DOCS}
    assert sum(where.startswith(("README.md", "docs/")) for where, _ in LINES) >= 20


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: path.name)
def test_docstrings_keep_their_line_breaks(path):
    """A single ``\\`` at a line's end inside a plain string swallows the newline: ``--help`` and ``help()`` would
    run a continued launch line into the next one. Docstrings write ``\\\\`` (one backslash when read)."""
    text, first, last = docstring(path)
    assert text.count("\n") == last - first, f"{path.name}'s docstring ends a line with \\ instead of \\\\"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.py")), ids=lambda path: path.name)
def test_help_opens_with_the_whole_first_paragraph(path, capsys):
    """``--help`` opens with the docstring's first paragraph, whole (not its first line, cut mid-sentence)."""
    with pytest.raises(SystemExit):
        recipe_module(path).parse_args(["--help"])
    text, _, _ = docstring(path)
    paragraph = " ".join(text.split("\n\n")[0].split())
    description = capsys.readouterr().out.split("\n\n")[1]
    assert " ".join(description.split()) == paragraph and paragraph.endswith("."), description


@pytest.mark.parametrize("where, command", LINES, ids=[f"{where}: {command[18:]}" for where, command in LINES])
def test_launch_line_is_one_the_recipe_accepts(where, command, monkeypatch):
    check_launch_line(command, monkeypatch)


@pytest.mark.parametrize(
    "command, refusal",
    [
        ("accelerate_configs/pipeline_2gpu.yaml recipes/pipeline_lm.py --parallelism pipeline", "rejects its flags"),
        ("accelerate_configs/fsdp_2gpu.yaml recipes/pipeline_lm.py --model_size 1.3b", "The launch config is FSDP"),
        ("accelerate_configs/ddp_2gpu.yaml recipes/train_lm.py --parallelism fsdp", "needs the FSDP launch config"),
        ("accelerate_configs/single_gpu.yaml recipes/pipeline_lm.py", "this launch has 1 process"),
        ("accelerate_configs/ddp_2gpu.yaml recipes/train_lm.py --parallelism device_map", "2 processes"),
        ("accelerate_configs/pipeline_2gpu.yaml recipes/pipeline_lm.py --num_microbatches 3", "does not divide"),
        ("accelerate_configs/no_such.yaml recipes/train_lm.py", "no config"),
        ("accelerate_configs/ddp_2gpu.yaml recipes/no_such.py", "no recipe"),
    ],
    ids=[
        "unknown_flag",
        "fsdp_pipeline",
        "fsdp_without_config",
        "pipeline_1_process",
        "device_map_2_processes",
        "microbatches",
        "config",
        "recipe",
    ],
)
def test_a_line_that_cannot_run_is_caught(command, refusal, monkeypatch):
    """The stale lines this test exists for, and one of each other kind."""
    with pytest.raises((pytest.fail.Exception, AssertionError)) as caught:
        check_launch_line(f"accelerate launch --config_file {command}", monkeypatch)
    assert refusal in str(caught.value)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.py")), ids=lambda path: path.name)
def test_the_launch_lines_in_refusals_are_ones_the_recipe_accepts(path, monkeypatch):
    """choose_parallelism's refusals end with a launch line for what was asked (``CONFIG_FOR``): with
    ``--parallelism X`` for a recipe that takes the flag, that line runs."""
    value = parallelism_argument(path)
    if value is None:
        pytest.skip(f"{path.name} chooses no parallelism")
    # The table of the very shared/parallelism.py the recipe imports.
    config_for = sys.modules[recipe_module(path).choose_parallelism.__module__].CONFIG_FOR
    if isinstance(value, ast.Constant):  # pipeline_lm.py: always the pipeline, no flag
        suggested = [(value.value, "")] if value.value in config_for else []
    else:
        suggested = [(requested, f" --{value.attr} {requested}") for requested in config_for]
    for requested, flag in suggested:
        if flag:
            try:
                with redirect_stderr(io.StringIO()):
                    recipe_module(path).parse_args(flag.split())
            except SystemExit:  # a parallelism this recipe does not offer
                continue
        line = f"accelerate launch --config_file accelerate_configs/{config_for[requested]} recipes/{path.name}{flag}"
        check_launch_line(line, monkeypatch)


def test_the_pairs_launched_elsewhere_are_still_launched_there():
    for (config, recipe), test_file in LAUNCHED_ELSEWHERE.items():
        text = (REPO / "tests" / test_file).read_text()
        assert config in text and recipe.removesuffix(".py") in text, f"{test_file} no longer launches {recipe}"


@pytest.mark.slow
def test_every_pair_no_other_test_launches_runs(tmp_path):
    """Launched as written (the first line of each pair), tiny sizes appended."""
    first_line = {}
    for _, command in LINES:
        launch_args = parsed(command)
        pair = (Path(launch_args.config_file).name, Path(launch_args.training_script).name)
        first_line.setdefault(pair, launch_args)
    jobs = {}
    for (config, recipe), launch_args in first_line.items():
        if (config, recipe) in LAUNCHED_ELSEWHERE:
            continue
        args = launch_args.training_script_args
        assert not stand_ins_needed(args), f"{config} {recipe} {args}: launch this pair in a test with stand-ins"
        assert recipe in TINY, f"no tiny sizes for {recipe}"
        script = REPO / launch_args.training_script
        jobs[f"{config} {recipe}"] = Job(
            CONFIGS / config, script, (*args, *TINY[recipe], "--output_dir", tmp_path / f"{config}-{recipe}")
        )
    assert jobs, "every pair is launched elsewhere: this test has nothing left to launch"
    for name, run in launch_all(jobs).items():
        assert run.returncode == 0, f"{name}: {run}"
        output_dir = tmp_path / name.replace(" ", "-")
        assert (output_dir / "results.json").is_file() or (output_dir / "setup.json").is_file(), name
