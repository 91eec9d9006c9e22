"""A recipe copied into another project runs unchanged. Each recipe's docstring names its copy unit (the recipe, its
own kit beside it, the ``shared/`` core), exactly what it imports; the unit alone, copied both ways the README allows
(``shared/`` beside the recipe, or one folder up: ``recipes/x.py`` + ``recipes/x_kit/`` + ``shared/``), imports its
helpers from the copy (not this repository's), and every recipe with a kit trains, saves and evaluates from a copy
(the fine-tune on its own: files of its kit, the offline metric modules, are read at evaluation)."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import ONE_PROCESS, REPO, Job, Run, launch, launch_all, read_results
from harness.models import save_tiny_llama

RECIPES = sorted(path.name for path in (REPO / "recipes").glob("*.py"))
LAYOUTS = ("beside", "one_up")  # shared/ beside the recipe, or one folder up


def imported_unit(name: str) -> list[str]:
    """What ``recipes/<name>`` imports from this repository, as the paths a user copies: itself, its kits
    (``recipes/llm_kit/``) and ``shared/``."""
    tree = ast.parse((REPO / "recipes" / name).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    tops = {module.split(".")[0] for module in modules}
    kits = sorted(f"recipes/{top}/" for top in tops if (REPO / "recipes" / top).is_dir() and top.endswith("_kit"))
    return [f"recipes/{name}", *kits, *(["shared/"] if "shared" in tops else [])]


def named_unit(name: str) -> list[str] | None:
    """The unit the recipe's docstring names: "copy recipes/x.py, recipes/x_kit/ and shared/ (and
    accelerate_configs/ ...", or None when it names none."""
    docstring = ast.get_docstring(ast.parse((REPO / "recipes" / name).read_text())) or ""
    found = re.search(r"\bcopy (.+?)\s+\(and\s+accelerate_configs/", docstring, re.DOTALL)
    return re.findall(r"recipes/[\w.]+/?|shared/", found.group(1)) if found else None


@pytest.mark.parametrize("name", RECIPES)
def test_the_docstring_names_exactly_what_to_copy(name):
    assert named_unit(name) == imported_unit(name), (
        f"{name}'s docstring names {named_unit(name)} to copy; it imports {imported_unit(name)}"
    )


def copy_unit(name: str, root, layout: str):
    """The recipe's unit (as its docstring names it) copied into ``root``: ``beside`` (root/x.py, root/x_kit/,
    root/shared) or ``one_up`` (root/recipes/x.py, root/recipes/x_kit/, root/shared). Returns the recipe's folder."""
    recipes = root if layout == "beside" else root / "recipes"
    recipes.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__")
    for part in named_unit(name) or imported_unit(name):
        if part == "shared/":
            shutil.copytree(REPO / "shared", root / "shared", ignore=ignore)
        elif part.endswith("/"):
            shutil.copytree(REPO / part, recipes / part.removeprefix("recipes/"), ignore=ignore)
        else:
            shutil.copy(REPO / part, recipes / part.removeprefix("recipes/"))
    return recipes


def plain_env() -> dict:
    """No PYTHONPATH: only what the copied recipe puts on sys.path itself."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def run_without_pythonpath(script: Path, *args, cwd: Path) -> Run:
    """``python SCRIPT ARGS`` in ``cwd`` with no PYTHONPATH: forked from the suite's zygotes where the suite runs
    without one (as CI does: theirs has none either), else started with it removed."""
    if "PYTHONPATH" not in os.environ:
        return launch(ONE_PROCESS, script, *args, cwd=cwd, timeout=600)
    command = [sys.executable, str(script), *map(str, args)]
    done = subprocess.run(command, cwd=cwd, env=plain_env(), capture_output=True, text=True, timeout=600)
    return Run(done.returncode, done.stdout + done.stderr)


@pytest.fixture(scope="module")
def imported_copies(tmp_path_factory) -> dict:
    """Every recipe's unit copied both ways, each layout in a project of its own, and imported in one process: layout
    -> (the recipe's project, its copied folder, what it imported)."""
    root = tmp_path_factory.mktemp("copies")
    projects = {(layout, name): root / layout / name.removesuffix(".py") for layout in LAYOUTS for name in RECIPES}
    folders = {
        f"{layout}/{name}": str(copy_unit(name, project, layout)) for (layout, name), project in projects.items()
    }
    # Import every recipe as a module (its top level runs: the sys.path rule, the helpers, module-level paths), each
    # from its own copied unit, in one process run outside this repository (the helpers of the recipe before are
    # forgotten first), and report the file of every helper module it imported.
    probe = root / "probe.py"  # run as a script in root: its folder first on sys.path, as python -c puts ''
    probe.write_text(
        "import importlib.util, json, sys\n"
        "found = {}\n"
        f"for key, folder in {folders!r}.items():\n"
        "    name = key.split('/')[1]\n"
        "    helpers = [m for m in sys.modules if m.split('.')[0] == 'shared' or m.split('.')[0].endswith('_kit')]\n"
        "    for module in helpers:\n"
        "        del sys.modules[module]\n"
        "    spec = importlib.util.spec_from_file_location(name[:-3], folder + '/' + name)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    helpers = {m: getattr(sys.modules[m], '__file__', None) for m in sys.modules\n"
        "               if m.split('.')[0] == 'shared' or m.split('.')[0].endswith('_kit')}\n"
        "    found[key] = [helpers, str(getattr(module, 'METRICS_DIR', ''))]\n"
        "print('FOUND ' + json.dumps(found))\n"
    )
    done = run_without_pythonpath(probe, cwd=root)
    assert done.returncode == 0, done.output[-3000:]
    found = json.loads(done.output.split("FOUND ", 1)[1].splitlines()[0])
    return {
        layout: {
            name: (projects[layout, name], folders[f"{layout}/{name}"], found.get(f"{layout}/{name}"))
            for name in RECIPES
        }
        for layout in LAYOUTS
    }


@pytest.mark.slow  # one process importing every recipe in both layouts: the fast lane's largest cost
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_copied_unit_imports_its_own_copy(imported_copies, layout):
    copies = imported_copies[layout]
    assert all(imported is not None for _, _, imported in copies.values()), copies
    for name, (project, folder, (helpers, metrics_dir)) in copies.items():
        if "shared/" in imported_unit(name):  # (the linear toy imports nothing of this repository)
            assert helpers.get("shared") == str(project / "shared" / "__init__.py"), name
        else:
            assert not helpers, (name, helpers)
        for module, file in helpers.items():
            assert file and file.startswith(str(project) + os.sep), f"{name} imported {module} from {file}"
        if metrics_dir:  # resources the recipe reads from its kit must be the copy's, and be there
            assert metrics_dir == folder + "/classifier_kit/metrics", name
            assert (project / metrics_dir / "accuracy" / "accuracy.py").is_file()


@pytest.mark.slow
def test_a_copied_fine_tune_trains_saves_and_evaluates(tmp_path):
    """The case that crashed after training and lost the model: the recipe copied with its unit, evaluation's metric
    modules looked up where the copy does not have them."""
    recipes = copy_unit("transformer_finetune.py", tmp_path / "project", "beside")
    out = tmp_path / "out"
    tiny = ["--max_train_samples", "32", "--max_eval_samples", "16", "--max_length", "32"]
    tiny += ["--per_device_train_batch_size", "8", "--max_train_steps", "2", "--output_dir", str(out)]
    done = run_without_pythonpath(recipes / "transformer_finetune.py", *tiny, cwd=tmp_path)
    assert done.returncode == 0, done.output[-5000:]
    results = json.loads((out / "results.json").read_text())
    assert 0 <= results["eval/accuracy"] <= 1 and results["eval/num_samples"] == 16
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


@pytest.mark.slow
def test_every_copied_recipe_with_a_kit_trains_saves_and_evaluates(tmp_path):
    """Each LM and LLM recipe copied alone (its unit, as its docstring names it, in both layouts) into a project of its
    own trains, saves its model or adapter, and evaluates, from the copy, every flag but the sizes its default (GRPO:
    its exact match of greedy answers)."""
    base = tmp_path / "tiny_llama"
    save_tiny_llama(base, num_hidden_layers=2)
    lm = ("--model_size", "tiny", "--corpus_max_mb", "0.5", "--vocab_size", "512", "--block_size", "32")
    lm += ("--max_train_steps", "2", "--per_device_train_batch_size", "4", "--max_eval_samples", "8")
    llm = ("--model_name_or_path", base, "--max_train_steps", "2", "--max_length", "64")
    llm += ("--per_device_train_batch_size", "4", "--max_eval_samples", "8", "--exact_match_samples", "2")
    grpo = ("--model_name_or_path", base, "--max_train_steps", "2", "--per_device_train_batch_size", "4")
    grpo += (
        "--num_generations",
        "2",
        "--max_completion_length",
        "4",
        "--max_eval_samples",
        "8",
        "--exact_match_samples",
        "2",
    )
    # recipe: (config, layout, flags, the weights it saves, an evaluation metric)
    cases = {
        "train_lm.py": ("single_gpu.yaml", "one_up", lm, "model.safetensors", "eval/perplexity"),
        "pipeline_lm.py": ("pipeline_2gpu.yaml", "beside", lm, "model.safetensors", "eval/perplexity"),
        "llm_finetune.py": ("single_gpu.yaml", "beside", llm, "adapter_model.safetensors", "eval/loss"),
        "dpo.py": ("single_gpu.yaml", "one_up", llm, "adapter_model.safetensors", "eval/rewards/accuracies"),
        "grpo.py": ("single_gpu.yaml", "beside", grpo, "adapter_model.safetensors", "eval/exact_match"),
    }
    jobs = {}
    for name, (config, layout, flags, _, _) in cases.items():
        recipes = copy_unit(name, tmp_path / name.removesuffix(".py"), layout)
        jobs[name] = Job(config, recipes / name, (*flags, "--output_dir", tmp_path / "out" / name))
    runs = launch_all(jobs)
    for name, (_, _, _, weights, metric) in cases.items():
        out = tmp_path / "out" / name
        assert runs[name].returncode == 0, f"{name}: {runs[name]}"
        results = read_results(out)
        assert results["completed_steps"] == 2 and (out / weights).is_file(), (name, sorted(os.listdir(out)))
        assert isinstance(results.get(metric), float), (name, sorted(key for key in results if key.startswith("eval")))
