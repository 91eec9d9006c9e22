"""LoRA target names, checked alike by every recipe that offers ``--lora_target_modules``: PEFT adapts the names that
match and skips the others without a word, so one unmatched name among matching ones would train a smaller adapter
than asked (q_proj on Phi-3, whose attention is one fused qkv_proj). Every recipe adds its adapter through
``shared.lora.lora_model``, which refuses such a name in one paragraph naming it and the model's linear layers.

The recipes are found, not listed: every recipes/*.py whose ``--help`` offers ``--lora_target_modules``, launched in
one process on its tiny run with one name that matches and one that does not (refused before training)."""

from __future__ import annotations

import pytest
from harness.launch import ONE_PROCESS, Job, launch_all

from .catalogue import RECIPE_NAMES, flags, tiny_models, tiny_run

LORA_RECIPES = [name for name in RECIPE_NAMES if "--lora_target_modules" in flags(name)]
# A name of each tiny model's attention, and its linear layers as the refusal lists them.
LAYERS = {
    "llama": ("q_proj", "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj lm_head"),
    "bert": ("query", "query key value dense"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Each recipe launched with ``--lora_target_modules <a layer> no_such_proj``, one process each, two at a time."""
    root = tmp_path_factory.mktemp("lora_targets")
    models = tiny_models(root)
    jobs = {}
    for recipe in LORA_RECIPES:
        model = "bert" if recipe == "transformer_finetune.py" else "llama"
        targets = ("--lora_target_modules", LAYERS[model][0], "no_such_proj")
        targets += ("--lora_r", "4") if recipe == "transformer_finetune.py" else ()  # (its default: a full fine-tune)
        args = (*tiny_run(recipe, models), "--max_train_steps", "1", *targets, "--output_dir", root / recipe)
        jobs[recipe] = (model, Job(ONE_PROCESS, recipe, args))
    runs = launch_all({recipe: job for recipe, (_, job) in jobs.items()})
    return {recipe: (jobs[recipe][0], run) for recipe, run in runs.items()}


def test_the_four_recipes_with_an_adapter_offer_lora_target_modules():
    assert {"llm_finetune.py", "dpo.py", "grpo.py", "transformer_finetune.py"} <= set(LORA_RECIPES)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", LORA_RECIPES)
def test_a_lora_target_that_names_no_layer_is_refused_though_another_matches(refusals, recipe):
    model, run = refusals[recipe]
    assert run.returncode != 0, str(run)
    paragraphs = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in run.output and len(paragraphs) == 1, str(run)
    said = " ".join(run.output.split())
    name, linear = LAYERS[model]
    assert f"--lora_target_modules {name} no_such_proj: no layer of the " in said, str(run)
    assert f"that LoRA adapts is named (or ends in) no_such_proj. Its linear layers are named {linear}" in said
    assert "train/loss" not in run.output, str(run)  # refused before any training
