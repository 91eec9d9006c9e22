"""Every recipe that logs to trackers (``--report_to``): ``train/learning_rate`` at step N is the rate step N's
optimizer step used, as the HF Trainer (and TRL, through it) logs it, not the rate the scheduler set for the next step.
Read from TensorBoard's event files of a 3-step run with a linear schedule and no warm-up: L, 2L/3, L/3; the recipes of
a method TRL defines (SFT, DPO, GRPO) get that schedule from their defaults, TRL's, and the others from flags. And each
``train/*`` value is logged once per step: the run's summary at the end does not log the last step's again (a second
point at that step, the last step's loss where the loop logged its window's mean)."""

from pathlib import Path

import numpy as np
import pytest
from harness.launch import ONE_PROCESS, Job, launch_all

from .catalogue import RECIPE_NAMES, flags, tiny_args, tiny_models

LOGGING = [name for name in RECIPE_NAMES if "--report_to" in flags(name)]
RATE, STEPS = 1e-3, 3
# TRL's SFTConfig, DPOConfig and GRPOConfig: lr_scheduler_type "linear", warmup_steps 0.
TRL_METHODS = {"llm_finetune.py", "dpo.py", "grpo.py"}


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict:
    """Per recipe: {train/* tag: [(step, value) of each event]} of its tiny run, logging every step, 1 process."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = tmp_path_factory.mktemp("logs")
    models, jobs = tiny_models(root), {}
    for name in LOGGING:
        no_warmup = ("--warmup_ratio", "0") if "--warmup_ratio" in flags(name) else ("--num_warmup_steps", "0")
        args = (*tiny_args(name, models), "--max_train_steps", STEPS, "--logging_steps", "1", "--learning_rate", RATE)
        if name not in TRL_METHODS:  # their own defaults (a warm-up, cosine) are not TRL's: asked for by flags
            args += ("--lr_scheduler_type", "linear", *no_warmup)
        args += ("--report_to", "tensorboard")
        jobs[name] = Job(ONE_PROCESS, name, (*map(str, args), "--output_dir", root / Path(name).stem))
    runs, found = launch_all(jobs), {}
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}: {run}"
        events = next((root / Path(name).stem).rglob("events.out.tfevents*"))
        accumulator = EventAccumulator(str(events.parent)).Reload()
        train_tags = [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("train/")]
        found[name] = {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in train_tags}
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", LOGGING)
def test_the_logged_learning_rate_is_the_one_the_step_used(logged, name):
    expected = {step: RATE * (1 - (step - 1) / STEPS) for step in range(1, STEPS + 1)}
    rates = dict(logged[name]["train/learning_rate"])
    assert rates.keys() == expected.keys(), rates
    np.testing.assert_allclose([rates[step] for step in expected], list(expected.values()), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", LOGGING)
def test_each_train_value_is_logged_once_per_step(logged, name):
    assert "train/loss" in logged[name], sorted(logged[name])
    steps = {tag: [step for step, _ in events] for tag, events in logged[name].items()}
    twice = {tag: found for tag, found in steps.items() if len(found) != len(set(found))}
    assert not twice, f"{name} logs these train/* values more than once at a step: {twice}"
