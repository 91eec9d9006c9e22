"""A recipe copied into another project runs unchanged, both ways the README allows: ``shared/`` beside the recipe,
or one folder up (``recipes/x.py`` + ``shared/``). Every recipe imports its helpers from the copied ``shared/`` (not
this repository's), and the fine-tune, the recipe with files of its own in ``shared/`` (the offline metric modules),
trains, saves and evaluates from a copy."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from launch import REPO

RECIPES = sorted(path.name for path in (REPO / "recipes").glob("*.py"))


def copy_project(root, layout: str):
    """The recipes and shared/ copied into ``root``: ``beside`` (root/x.py, root/shared) or ``one_up``
    (root/recipes/x.py, root/shared)."""
    recipes = root if layout == "beside" else root / "recipes"
    recipes.mkdir(parents=True)
    for name in RECIPES:
        shutil.copy(REPO / "recipes" / name, recipes / name)
    shutil.copytree(REPO / "shared", root / "shared", ignore=shutil.ignore_patterns("__pycache__"))
    return recipes


def plain_env() -> dict:
    """No PYTHONPATH: only what the copied recipe puts on sys.path itself."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


@pytest.mark.slow  # a process per layout importing all five recipes: the fast lane's largest cost
@pytest.mark.parametrize("layout", ["beside", "one_up"])
def test_every_copied_recipe_imports_the_copied_shared(tmp_path, layout):
    recipes = copy_project(tmp_path / "project", layout)
    # Import every recipe as a module (its top level runs: the sys.path rule, the helpers, module-level paths), in a
    # process started outside this repository, and report where each found shared/.
    probe = (
        "import importlib.util, json, sys\n"
        f"folder = {str(recipes)!r}\n"
        "found = {}\n"
        f"for name in {RECIPES!r}:\n"
        "    spec = importlib.util.spec_from_file_location(name[:-3], folder + '/' + name)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    found[name] = [sys.modules['shared'].__file__, str(getattr(module, 'METRICS_DIR', ''))]\n"
        "print('FOUND ' + json.dumps(found))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=plain_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.split("FOUND ", 1)[1])
    assert sorted(found) == RECIPES
    for name, (shared_file, metrics_dir) in found.items():
        assert shared_file == str(tmp_path / "project" / "shared" / "__init__.py"), name
        if metrics_dir:  # resources the recipe reads from shared/ must be the copy's, and be there
            assert metrics_dir == str(tmp_path / "project" / "shared" / "metrics"), name
            assert (tmp_path / "project" / "shared" / "metrics" / "accuracy" / "accuracy.py").is_file()


@pytest.mark.slow
def test_a_copied_fine_tune_trains_saves_and_evaluates(tmp_path):
    """The case that crashed after training and lost the model: shared/ beside the recipe, evaluation's metric
    modules looked up one folder too high."""
    recipes = copy_project(tmp_path / "project", "beside")
    out = tmp_path / "out"
    tiny = ["--max_train_samples", "32", "--max_eval_samples", "16", "--max_length", "32"]
    tiny += ["--per_device_train_batch_size", "8", "--max_train_steps", "2", "--output_dir", str(out)]
    done = subprocess.run(
        [sys.executable, str(recipes / "transformer_finetune.py"), *tiny],
        cwd=tmp_path,
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert 0 <= results["eval/accuracy"] <= 1 and results["eval/num_samples"] == 16
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
