"""What only GPUs can show: these tests run where the hardware is there and skip with the reason elsewhere. On a
CPU-only machine (CI) the same code paths run as CPU processes in the other test files; benchmarks/gpu_check.py
measures them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.launch import REPO, launch_ok, read_facts, read_results, visible_gpus

import shared.accelerator
from lib.flops import lm_flops_per_token, peak_bf16_flops

TWO_GPUS = pytest.mark.skipif(
    visible_gpus() < 2,
    reason="needs 2 GPUs: NCCL refuses two ranks on one GPU, and a 2-GPU split "
    "needs two (CPU stand-ins run in test_lm_recipes.py and test_reliability.py)",
)
ONE_GPU = pytest.mark.skipif(visible_gpus() < 1, reason="needs a GPU (the CPU path runs everywhere else in the suite)")
SCRIPTS = Path(__file__).parent / "scripts"


def test_the_mfu_peak_table_knows_the_cards_users_have():
    """MFU divides by the peak of the GPU the run is on (dense bf16, from NVIDIA's datasheets), matched by name."""
    assert peak_bf16_flops("NVIDIA H200") == 989e12 and peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12 and peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") == 165e12 and peak_bf16_flops("NVIDIA GeForce RTX 3090") == 71e12
    assert peak_bf16_flops("NVIDIA L4") == 121e12 and peak_bf16_flops("NVIDIA L40S") == 362e12
    assert peak_bf16_flops("Some Future GPU") is None  # then no MFU is reported rather than a wrong one
    # 6N + 12 L H S with N the parameters less the input embedding: 125m-like shape, 32k vocabulary, 1,024 tokens.
    assert (
        lm_flops_per_token(768, 12, 32000, 134_000_000, 1024) == 6 * (134_000_000 - 32000 * 768) + 12 * 12 * 768 * 1024
    )


def test_one_process_on_a_gpu_gets_an_indexed_device_everywhere(monkeypatch):
    """One process on a GPU: Accelerate's device is ``torch.device("cuda")``, with no index, which
    ``torch.cuda.set_device`` refuses (this crashed every 1-process GPU launch). A fake Accelerator that reports
    exactly that, on a machine said to have one GPU: set_gpu_index and build_accelerator must give the run ``cuda:0``
    (results.json, memory keys, the split's devices) and set the current device by index. ``torch.cuda.set_device``
    is replaced by torch's own index check, which is what raised on the GPU."""
    from accelerate.utils import DistributedType

    calls = []

    class OneProcessOnAGpu:  # what Accelerate 1.16 reports for a 1-process CUDA launch, unless told the device
        def __init__(self, **kwargs):
            override = shared.accelerator.os.environ.get("ACCELERATE_TORCH_DEVICE")
            self.state = type("State", (), {"device": torch.device(override or "cuda")})()
            self.num_processes, self.distributed_type, self.mixed_precision = 1, DistributedType.NO, "no"

        @property
        def device(self):
            return self.state.device

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # set_gpu_index sets ACCELERATE_TORCH_DEVICE in os.environ: registered first so that monkeypatch removes it
    # after the test (every later launch would inherit cuda:0).
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "unset")
    monkeypatch.setattr(shared.accelerator, "Accelerator", OneProcessOnAGpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: calls.append(torch.cuda._utils._get_device_index(device))
    )
    for override in (None, "cuda"):  # Accelerate's own pick, and a user's ACCELERATE_TORCH_DEVICE=cuda
        calls.clear()
        if override:
            monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", override)
        else:
            monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
        shared.accelerator.set_gpu_index()  # the recipe's line before build_accelerator
        accelerator = shared.accelerator.build_accelerator()
        assert str(accelerator.device) == "cuda:0" and calls == [0], (override, accelerator.device, calls)
        from shared.model_split import split_devices

        assert [str(device) for device in split_devices(accelerator.device)] == ["cuda:0", "cpu"]


@pytest.mark.slow
@TWO_GPUS
def test_object_collectives_go_through_each_ranks_own_gpu(tmp_path):
    run = launch_ok("ddp_2gpu.yaml", SCRIPTS / "object_collective.py")
    seen = json.loads(run.output.split("OBJECTS ", 1)[1].splitlines()[0])
    assert seen["distributed/backend"] == "nccl"
    assert [(entry["device"], entry["current"]) for entry in seen["ranks"]] == [("cuda:0", 0), ("cuda:1", 1)]


@pytest.mark.slow
@TWO_GPUS
def test_the_model_sharding_config_splits_the_fine_tune_over_both_gpus(tmp_path):
    launch_ok(
        "model_sharding_2gpu.yaml",
        "transformer_finetune.py",
        "--output_dir",
        tmp_path,
        "--max_train_samples",
        "64",
        "--max_eval_samples",
        "16",
        "--max_length",
        "32",
        "--per_device_train_batch_size",
        "8",
        "--max_train_steps",
        "3",
        observe=True,  # its hooks, seen by the observer
    )
    results = read_results(tmp_path)
    assert results["parallelism"] == "device_map" and sorted(set(results["device_map"].values())) == [
        "cuda:0",
        "cuda:1",
    ]
    assert read_facts(tmp_path)["device_map/hooks"]["rank0"] == results["device_map"]  # the observer
    assert set(results["memory/peak_gib"]) == {"cuda:0", "cuda:1"}


@pytest.mark.slow
@ONE_GPU
def test_mfu_is_recorded_against_this_gpus_peak(tmp_path):
    """MFU is the benchmark runner's: the record of a one-GPU LM run divides the run's FLOP/s by this GPU's peak
    (benchmarks/lib/flops.py); the recipe's results.json names the device it ran on and carries no MFU."""
    from lib.specs import lm_runs

    shape = dict(steps=4, warmup=1, batch=4, block=64, vocab=512, corpus_mb=0.3, threads=None)
    matrix = {"name": "mfu", "groups": [{"name": "lm-tiny", "runs": lm_runs("tiny", ["single"], **shape)}]}
    (tmp_path / "matrix.json").write_text(json.dumps(matrix))
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--matrix", str(tmp_path / "matrix.json")]
    done = subprocess.run(
        [*command, "--output_dir", str(out), "--no_compare"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    record = json.loads((out / "runs" / "lm-tiny__single__r0.json").read_text())
    assert done.returncode == 0 and record["status"] == "ok", done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / record["results_file"]).read_text())
    # One name for the GPU everywhere (Accelerate's own 1-process device is "cuda", without the index).
    assert results["device"] == "cuda:0" and results["distributed/backend"] is None
    assert list(results["memory/peak_gib"]) == ["cuda:0"] and "perf/mfu" not in results
    peak = record["machine"]["gpus"][0]["peak_bf16_flops"]
    if peak:  # a GPU the table knows
        assert record["perf/peak_flops_per_device"] == peak and 0 < record["perf/mfu"] < 1


@ONE_GPU
def test_qlora_split_over_the_gpu_and_the_cpu_never_puts_the_whole_model_on_the_gpu(tmp_path):
    """QLoRA under the device_map split: quantized on the CPU, each block then moved to its device, so no GPU's peak
    nears the whole 4-bit model (loaded onto the GPU first, it sat there whole before the split). The same check
    benchmarks/gpu_check.py runs, with its numbers."""
    import gpu_check

    result = gpu_check.qlora_split_verdict(tmp_path, cuda=True)
    assert result["status"] == "ok", result["line"]


def test_the_indexed_device_test_leaves_no_device_override_behind():
    """Runs after the test above (file order): the launches of every later test inherit this process's environment."""
    import os

    assert "ACCELERATE_TORCH_DEVICE" not in os.environ
