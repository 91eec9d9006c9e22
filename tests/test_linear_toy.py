"""The linear toy under 1 and 2 processes: DDP and accumulation equal 1-process training."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from launch import REPO, devices_for, launch, launch_ok, read_results, visible_gpus
from safetensors.torch import load_file

STEPS = "30"


def weights(results: dict) -> np.ndarray:
    return np.array(results["model/weight"] + [results["model/bias"]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs with the same seed and global batch of 16: one launch each, shared by the tests. The 1-process
    runs use the kind of device the 2-process run gets (CPU processes where there are fewer than 2 GPUs)."""
    root = tmp_path_factory.mktemp("linear_toy")
    same_devices_as_ddp = visible_gpus() < 2
    specs = {
        "single": ("single_gpu.yaml", "--per_device_train_batch_size", "16"),
        "ddp": ("ddp_2gpu.yaml", "--per_device_train_batch_size", "8"),
        "accumulation": (
            "single_gpu.yaml",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "2",
        ),
    }
    outputs = {}
    for name, (config, *args) in specs.items():
        out = root / name
        run = launch_ok(
            config,
            "linear_toy.py",
            "--output_dir",
            out,
            "--max_train_steps",
            STEPS,
            *args,
            cpu_only=same_devices_as_ddp if config == "single_gpu.yaml" else None,
        )
        outputs[name] = {"dir": out, "results": read_results(out), "log": run.output}
    return outputs


def test_ddp_ends_with_the_same_weights_as_one_process(runs):
    single, ddp = runs["single"]["results"], runs["ddp"]["results"]
    assert ddp["num_processes"] == 2 and ddp["distributed_type"] in ("MULTI_CPU", "MULTI_GPU")
    assert single["num_processes"] == 1
    assert single["global_batch_size"] == ddp["global_batch_size"] == 16
    assert np.abs(weights(single) - weights(ddp)).max() <= 1e-5
    # Same data in the same order: the per-step global losses agree too.
    np.testing.assert_allclose(single["train/loss_curve"], ddp["train/loss_curve"], rtol=1e-5)


def test_gradient_accumulation_ends_with_the_same_weights(runs):
    single, accumulation = runs["single"]["results"], runs["accumulation"]["results"]
    assert accumulation["global_batch_size"] == 16
    assert accumulation["completed_steps"] == single["completed_steps"] == int(STEPS)
    assert np.abs(weights(single) - weights(accumulation)).max() <= 1e-5
    np.testing.assert_allclose(single["train/loss_curve"], accumulation["train/loss_curve"], rtol=1e-5)


def test_loss_goes_down_and_the_true_weights_are_learned(runs):
    results = runs["ddp"]["results"]
    curve = results["train/loss_curve"]
    assert len(curve) == int(STEPS)
    assert curve[-1] < 0.1 * curve[0]
    assert np.abs(np.array(results["model/weight"]) - results["true/weight"]).max() < 0.1


def test_results_json_holds_what_users_compare(runs):
    results = runs["ddp"]["results"]
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


def test_saved_safetensors_are_the_learned_weights(runs):
    out = runs["ddp"]["dir"]
    saved = load_file(out / "model.safetensors")
    results = runs["ddp"]["results"]
    np.testing.assert_allclose(saved["weight"].numpy()[0], results["model/weight"], rtol=0, atol=0)


def test_only_the_main_process_prints(runs):
    log = runs["ddp"]["log"]
    assert log.count("learned weight:") == 1
    assert "global batch size 16 = 8 per device x 2 processes x 1 accumulation steps" in log


def copy_project(destination: Path) -> Path:
    """A user's project: the recipe alone (the tutorial's example is one file), nothing else from this repository."""
    destination.mkdir()
    shutil.copy(REPO / "recipes" / "linear_toy.py", destination / "train.py")
    return destination / "train.py"


def test_a_copied_recipe_runs_unchanged(runs, tmp_path):
    script = copy_project(tmp_path / "project")
    out = tmp_path / "out"
    launch_ok(
        "ddp_2gpu.yaml", script, "--output_dir", out, "--max_train_steps", STEPS, "--per_device_train_batch_size", "8"
    )
    assert np.abs(weights(read_results(out)) - weights(runs["ddp"]["results"])).max() == 0


def test_equivalence_check_catches_a_model_not_wrapped_in_ddp(runs, tmp_path):
    """The tutorial's bug, reproduced: leave the model out of prepare(), so gradients are never
    averaged. Each process then trains on its own half of the data and the weights must differ
    from 1-process training: proof that the equivalence test above can fail."""
    script = copy_project(tmp_path / "broken")
    source = script.read_text()
    wrapped = "model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)"
    assert wrapped in source
    script.write_text(
        source.replace(wrapped, "optimizer, train_dataloader = accelerator.prepare(optimizer, train_dataloader)")
    )
    out = tmp_path / "out"
    launch_ok(
        "ddp_2gpu.yaml", script, "--output_dir", out, "--max_train_steps", STEPS, "--per_device_train_batch_size", "8"
    )
    assert np.abs(weights(read_results(out)) - weights(runs["single"]["results"])).max() > 1e-4


def test_model_sharding_config_trains_on_one_device(tmp_path):
    launch_ok("model_sharding_2gpu.yaml", "linear_toy.py", "--output_dir", tmp_path, "--max_train_steps", "5")
    results = read_results(tmp_path)
    assert results["num_processes"] == 1 and results["parallelism"] == "single"


def test_batch_size_zero_is_refused(tmp_path):
    run = launch("single_gpu.yaml", "linear_toy.py", "--output_dir", tmp_path, "--per_device_train_batch_size", "0")
    assert run.returncode != 0
    assert "--per_device_train_batch_size: must be a whole number >= 1, got 0" in run.output


def test_output_dir_that_cannot_be_created_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    run = launch("ddp_2gpu.yaml", "linear_toy.py", "--output_dir", blocker / "out", "--max_train_steps", "2")
    assert run.returncode != 0
    assert "Cannot use --output_dir" in run.output and "a_file/out" in run.output


def test_data_set_too_small_for_the_global_batch_is_refused(tmp_path):
    run = launch(
        "ddp_2gpu.yaml",
        "linear_toy.py",
        "--output_dir",
        tmp_path,
        "--num_samples",
        "16",
        "--per_device_train_batch_size",
        "16",
    )
    assert run.returncode != 0
    assert "One optimizer step needs 32 samples" in run.output


def test_processes_expected_but_not_seen_is_refused():
    """The silent-duplicate trap: a plain Accelerator() under a 2-process config without CUDA (GPUs hidden here, so
    the trap is reproduced on every machine)."""
    run = launch("ddp_2gpu.yaml", Path(__file__).parent / "scripts" / "plain_accelerator.py", cpu_only=True)
    assert run.returncode != 0
    assert "The launcher started 2 processes (WORLD_SIZE=2) but the Accelerator sees 1" in run.output
    assert "processes seen" not in run.output
