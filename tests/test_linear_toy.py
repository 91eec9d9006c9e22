"""The linear toy under 1 and 2 processes: DDP and accumulation equal 1-process training."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from harness.launch import ONE_PROCESS, REPO, Job, devices_for, launch_all, launch_ok, read_results, visible_gpus
from safetensors.torch import load_file

STEPS = "30"


def weights(results: dict) -> np.ndarray:
    return np.array(results["model/weight"] + [results["model/bias"]])


WRAPPED = "model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)"


def copy_project(destination: Path) -> Path:
    """A user's project: the recipe alone (the tutorial's example is one file), nothing else from this repository."""
    destination.mkdir()
    shutil.copy(REPO / "recipes" / "linear_toy.py", destination / "train.py")
    return destination / "train.py"


def launch_runs(root, jobs: dict[str, Job], trained: bool = True) -> dict:
    """A scenario's launches, two at a time, on the kind of device the 2-process runs get (CPU processes where there
    are fewer than 2 GPUs). Name -> its folder, run and log, and where ``trained`` (each run must succeed) its
    results.json."""
    finished = launch_all(jobs, cpu_only=visible_gpus() < 2)
    out = {}
    for name, run in finished.items():
        out[name] = {"dir": root / name, "run": run, "log": run.output}
        if trained:
            assert run.returncode == 0, f"{name}: {run}"
            out[name]["results"] = read_results(root / name)
    return out


# ----------------------------------------------------------------------------- one process, DDP, accumulation
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Three runs with the same seed and global batch of 16: 1 process x 16, 2 processes x 8, and 1 process x 8 with 2
    accumulation steps."""
    root = tmp_path_factory.mktemp("linear_toy")
    train = ("--max_train_steps", STEPS)
    jobs = {
        "single": Job("single_gpu.yaml", "linear_toy.py", (*train, "--per_device_train_batch_size", "16")),
        "ddp": Job("ddp_2gpu.yaml", "linear_toy.py", (*train, "--per_device_train_batch_size", "8")),
        "accumulation": Job(
            "single_gpu.yaml",
            "linear_toy.py",
            (*train, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"),
        ),
    }
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    return launch_runs(root, jobs)


@pytest.mark.slow
def test_ddp_ends_with_the_same_weights_as_one_process(trained):
    single, ddp = trained["single"]["results"], trained["ddp"]["results"]
    assert ddp["num_processes"] == 2 and ddp["distributed_type"] in ("MULTI_CPU", "MULTI_GPU")
    assert single["num_processes"] == 1
    assert single["global_batch_size"] == ddp["global_batch_size"] == 16
    assert np.abs(weights(single) - weights(ddp)).max() <= 1e-5
    # Same data in the same order: the per-step global losses agree too.
    np.testing.assert_allclose(single["train/loss_curve"], ddp["train/loss_curve"], rtol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_ends_with_the_same_weights(trained):
    single, accumulation = trained["single"]["results"], trained["accumulation"]["results"]
    assert accumulation["global_batch_size"] == 16
    assert accumulation["completed_steps"] == single["completed_steps"] == int(STEPS)
    assert np.abs(weights(single) - weights(accumulation)).max() <= 1e-5
    np.testing.assert_allclose(single["train/loss_curve"], accumulation["train/loss_curve"], rtol=1e-5)


@pytest.mark.slow
def test_loss_goes_down_and_the_true_weights_are_learned(trained):
    results = trained["ddp"]["results"]
    curve = results["train/loss_curve"]
    assert len(curve) == int(STEPS)
    assert curve[-1] < 0.1 * curve[0]
    assert np.abs(np.array(results["model/weight"]) - results["true/weight"]).max() < 0.1


@pytest.mark.slow
def test_results_json_holds_what_users_compare(trained):
    results = trained["ddp"]["results"]
    for key in (
        "num_processes",
        "distributed_type",
        "parallelism",
        "global_batch_size",
        "train/loss",
        "model/weight",
        "true/weight",
        "perf/samples_per_sec",
        "perf/step_time_s",
        "memory/peak_gib",
        "config",
    ):
        assert key in results, key
    assert results["parallelism"] == "ddp"
    assert results["config"]["per_device_train_batch_size"] == 8
    assert results["perf/samples_per_sec"] > 0
    # The devices the run reports, against what this machine offers (two GPUs, or two CPU processes).
    devices = devices_for(2)
    assert set(results["memory/peak_gib"]) == {f"rank{rank}/{device}" for rank, device in enumerate(devices)}
    assert results["distributed/backend"] == ("nccl" if devices[0].startswith("cuda") else "gloo")


@pytest.mark.slow
def test_saved_safetensors_are_the_learned_weights(trained):
    out = trained["ddp"]["dir"]
    saved = load_file(out / "model.safetensors")
    results = trained["ddp"]["results"]
    np.testing.assert_allclose(saved["weight"].numpy()[0], results["model/weight"], rtol=0, atol=0)


@pytest.mark.slow
def test_only_the_main_process_prints(trained):
    log = trained["ddp"]["log"]
    assert log.count("learned weight:") == 1
    assert "global batch size 16 = 8 per device x 2 processes x 1 accumulation steps" in log


# ----------------------------------------------------------------------------- a user's copy
@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """A user's project holding the recipe alone, and one with the tutorial's bug: the model left out of prepare(), so
    gradients are never averaged. Both as the ddp run, 2 processes x 8."""
    root = tmp_path_factory.mktemp("linear_toy_copies")
    copied = copy_project(root / "project")
    broken = copy_project(root / "broken")
    broken.write_text(
        broken.read_text().replace(
            WRAPPED, "optimizer, train_dataloader = accelerator.prepare(optimizer, train_dataloader)"
        )
    )
    args = ("--max_train_steps", STEPS, "--per_device_train_batch_size", "8")
    jobs = {
        "copied": Job("ddp_2gpu.yaml", copied, (*args, "--output_dir", root / "copied")),
        "broken": Job("ddp_2gpu.yaml", broken, (*args, "--output_dir", root / "broken")),
    }
    out = launch_runs(root, jobs)
    out["broken"]["script"] = broken
    return out


@pytest.mark.slow
def test_a_copied_recipe_runs_unchanged(copies, trained):
    assert np.abs(weights(copies["copied"]["results"]) - weights(trained["ddp"]["results"])).max() == 0


@pytest.mark.slow
def test_equivalence_check_catches_a_model_not_wrapped_in_ddp(copies, trained):
    """The tutorial's bug, reproduced: leave the model out of prepare(), so gradients are never
    averaged. Each process then trains on its own half of the data and the weights must differ
    from 1-process training: proof that the equivalence test above can fail."""
    assert WRAPPED in (REPO / "recipes" / "linear_toy.py").read_text()
    assert WRAPPED not in copies["broken"]["script"].read_text()
    assert np.abs(weights(copies["broken"]["results"]) - weights(trained["single"]["results"])).max() > 1e-4


def test_model_sharding_config_trains_on_one_device(tmp_path):
    launch_ok("model_sharding_2gpu.yaml", "linear_toy.py", "--output_dir", tmp_path, "--max_train_steps", "5")
    results = read_results(tmp_path)
    assert results["num_processes"] == 1 and results["parallelism"] == "single"


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Bad input, each refused. Argument checking needs no launcher: one process."""
    root = tmp_path_factory.mktemp("linear_toy_refusals")
    blocker = root / "a_file"
    blocker.write_text("not a folder")
    jobs = {
        "batch_size_zero": Job(
            ONE_PROCESS,
            "linear_toy.py",
            ("--per_device_train_batch_size", "0", "--output_dir", root / "batch_size_zero"),
        ),
        "output_dir": Job(
            "ddp_2gpu.yaml", "linear_toy.py", ("--max_train_steps", "2", "--output_dir", blocker / "out")
        ),
        "too_small": Job(
            "ddp_2gpu.yaml",
            "linear_toy.py",
            ("--num_samples", "16", "--per_device_train_batch_size", "16", "--output_dir", root / "too_small"),
        ),
        # The silent-duplicate trap: a plain Accelerator() under a 2-process config without CUDA (GPUs hidden here,
        # so the trap is reproduced on every machine).
        "plain_accelerator": Job(
            "ddp_2gpu.yaml", Path(__file__).parent / "scripts" / "plain_accelerator.py", kwargs={"cpu_only": True}
        ),
    }
    return launch_runs(root, jobs, trained=False)


@pytest.mark.slow
def test_batch_size_zero_is_refused(refusals):
    run = refusals["batch_size_zero"]["run"]
    assert run.returncode != 0
    assert "--per_device_train_batch_size: must be a whole number >= 1, got 0" in run.output


@pytest.mark.slow
def test_output_dir_that_cannot_be_created_is_refused(refusals):
    run = refusals["output_dir"]["run"]
    assert run.returncode != 0
    assert "Cannot use --output_dir" in run.output and "a_file/out" in run.output


@pytest.mark.slow
def test_data_set_too_small_for_the_global_batch_is_refused(refusals):
    run = refusals["too_small"]["run"]
    assert run.returncode != 0
    assert "One optimizer step needs 32 samples" in run.output


@pytest.mark.slow
def test_processes_expected_but_not_seen_is_refused(refusals):
    """The silent-duplicate trap: a plain Accelerator() under a 2-process config without CUDA."""
    run = refusals["plain_accelerator"]["run"]
    assert run.returncode != 0
    assert "The launcher started 2 processes (WORLD_SIZE=2) but the Accelerator sees 1" in run.output
    assert "processes seen" not in run.output
