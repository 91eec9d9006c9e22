"""Every recipe that logs to trackers (``--report_to``): ``train/learning_rate`` at step N is the rate step N's
optimizer step used, as the HF Trainer (and TRL, through it) logs it, not the rate the scheduler set for the next step.
Read from TensorBoard's event files of a 3-step run with a linear schedule and no warm-up: L, 2L/3, L/3."""

from pathlib import Path

import numpy as np
import pytest
from harness.launch import ONE_PROCESS, Job, launch_all

from .catalogue import RECIPE_NAMES, flags, tiny_args, tiny_models

LOGGING = [name for name in RECIPE_NAMES if "--report_to" in flags(name)]
RATE, STEPS = 1e-3, 3


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict:
    """Per recipe: {step: logged train/learning_rate} of its tiny run, logging every step, 1 process."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = tmp_path_factory.mktemp("logs")
    models, jobs = tiny_models(root), {}
    for name in LOGGING:
        no_warmup = ("--warmup_ratio", "0") if "--warmup_ratio" in flags(name) else ("--num_warmup_steps", "0")
        args = (*tiny_args(name, models), "--max_train_steps", STEPS, "--logging_steps", "1", "--learning_rate", RATE)
        args += ("--lr_scheduler_type", "linear", *no_warmup, "--report_to", "tensorboard")
        jobs[name] = Job(ONE_PROCESS, name, (*map(str, args), "--output_dir", root / Path(name).stem))
    runs, found = launch_all(jobs), {}
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}: {run}"
        events = next((root / Path(name).stem).rglob("events.out.tfevents*"))
        scalars = EventAccumulator(str(events.parent)).Reload().Scalars("train/learning_rate")
        found[name] = {event.step: event.value for event in scalars}
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", LOGGING)
def test_the_logged_learning_rate_is_the_one_the_step_used(logged, name):
    expected = {step: RATE * (1 - (step - 1) / STEPS) for step in range(1, STEPS + 1)}
    assert logged[name].keys() == expected.keys(), logged[name]
    np.testing.assert_allclose([logged[name][step] for step in expected], list(expected.values()), rtol=1e-6)
