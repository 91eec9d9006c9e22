"""The benchmark runner and compare tool, end to end on the smoke matrix (tiny model, 2 steps).

One runner call launches the smoke matrix (single, ddp, the raw torchrun + DDP baseline, the naive
device_map split, a GPipe pipeline) plus a run that cannot start and one whose config file does not
exist; the tests then read its records, its summary and plots, resume it, and gate a doctored copy
of its results with compare.py's regression check. No assertion on speed: two steps of a tiny model
say nothing about it, and the runs overlap (--jobs 2) to keep the test short.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import run as runner  # noqa: E402

SMOKE_SETUPS = {"single", "ddp", "raw_ddp", "device_map", "pipeline-gpipe-m2"}


def cli(script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    matrix = runner.matrix_preset("smoke")
    # A run that fails to start (its script does not exist) and one whose config file does not exist.
    bad = {"recipe": "pipeline_lm", "size": "tiny", "launcher": "accelerate", "args": []}
    matrix["groups"].append(
        {
            "name": "broken",
            "runs": [
                {**bad, "setup": "missing-script", "config": "single_gpu.yaml", "script": "recipes/no_such_recipe.py"},
                {
                    **bad,
                    "setup": "missing-config",
                    "config": "no_such_config.yaml",
                    "script": "recipes/pipeline_lm.py",
                },
            ],
        }
    )
    (root / "matrix.json").write_text(json.dumps(matrix))
    out = root / "out"
    first = cli("run.py", "--matrix", root / "matrix.json", "--output_dir", out, "--jobs", "2", timeout=600)
    records = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    return {"root": root, "out": out, "first": first, "records": records}


def test_runs_recorded_with_the_schema(bench):
    records = bench["records"]
    ok = {record["setup"]: record for record in records.values() if record["status"] == "ok"}
    assert set(ok) == SMOKE_SETUPS, bench["first"].stdout[-3000:] + bench["first"].stderr[-3000:]
    for record in ok.values():
        assert record["schema"] == runner.SCHEMA
        assert record["machine"]["cpu_cores"] >= 1 and record["versions"]["torch"]
        assert record["perf/samples_per_sec"] > 0 and record["perf/tokens_per_sec"] > 0
        assert record["perf/step_time_p90_s"] >= record["perf/step_time_s"] > 0
        assert 0 <= record["perf/data_wait_fraction"] < 1
        assert record["memory/peak_gib"] and record["flops/per_token"] > 6 * record["model/non_embedding_parameters"]
        assert record["threads_per_process"] == 1 and record["sequence_length"] == 32 and record["measured_steps"] == 1
    assert ok["ddp"]["processes"] == ok["raw_ddp"]["processes"] == 2 and ok["single"]["processes"] == 1
    assert (
        ok["ddp"]["global_batch_size"] == ok["raw_ddp"]["global_batch_size"] == 2 * ok["single"]["global_batch_size"]
    )
    assert ok["raw_ddp"]["recipe"] == "raw_ddp_lm" and ok["raw_ddp"]["launcher"] == "torchrun"
    assert ok["pipeline-gpipe-m2"]["parallelism"] == "pipeline" and ok["pipeline-gpipe-m2"]["num_microbatches"] == 2
    assert ok["device_map"]["config_file"] == "accelerate_configs/model_sharding_2gpu.yaml"
    assert "perf/mfu" not in ok["single"]  # MFU only on CUDA


def test_failed_run_recorded_and_others_go_on(bench):
    assert bench["first"].returncode == 1  # a failed run makes the runner's exit code non-zero
    failed = bench["records"]["broken__missing-script__r0"]
    assert failed["status"] == "failed" and "no_such_recipe.py" in failed["error_tail"]
    skipped = bench["records"]["broken__missing-config__r0"]
    assert skipped["status"] == "skipped" and "no_such_config.yaml" in skipped["reason"]


def test_summary_table_and_plots(bench):
    out, stdout = bench["out"], bench["first"].stdout
    for text in (
        "## Runs",
        "ddp scaling efficiency",
        "overhead vs raw PyTorch",
        "pipeline speedup",
        "## Failed and skipped runs",
    ):
        assert text in stdout and text in (out / "summary.md").read_text()
    for name in ("throughput.png", "pipeline_speedup.png", "memory.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_skips_finished_runs(bench):
    before = {path.name: path.read_text() for path in (bench["out"] / "runs").glob("lm-*.json")}
    again = cli(
        "run.py",
        "--matrix",
        bench["root"] / "matrix.json",
        "--output_dir",
        bench["out"],
        "--groups",
        "lm-tiny",
        "--no_compare",
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "5 already done" in again.stdout
    assert before == {path.name: path.read_text() for path in (bench["out"] / "runs").glob("lm-*.json")}


def test_regression_gate(bench, tmp_path):
    baseline, same, doctored = tmp_path / "baseline", tmp_path / "same", tmp_path / "doctored"
    for folder in (baseline, same, doctored):
        shutil.copytree(bench["out"] / "runs", folder)
    record_file = doctored / "lm-tiny-data_parallel__ddp__r0.json"
    record = json.loads(record_file.read_text())
    record["perf/samples_per_sec"] *= 0.8  # 20% slower: beyond a 10% threshold
    record_file.write_text(json.dumps(record))

    flagged = cli("compare.py", "--baseline", baseline, "--candidate", doctored, "--threshold", "0.1")
    assert flagged.returncode == 1, flagged.stdout + flagged.stderr
    assert "REGRESSION" in flagged.stdout and "-20.0%" in flagged.stdout
    assert cli("compare.py", "--baseline", baseline, "--candidate", doctored, "--threshold", "0.25").returncode == 0
    unchanged = cli("compare.py", "--baseline", baseline, "--candidate", same, "--threshold", "0.1")
    assert unchanged.returncode == 0 and "REGRESSION" not in unchanged.stdout, unchanged.stdout + unchanged.stderr


def test_gpu_check_dry_run_prints_the_plan_without_a_gpu():
    """The prepared GPU check plans its launches on any machine (CI has no GPU): under 8 minutes on one GPU, the
    two-GPU checks added for two, every command a real launch of a recipe with a config that exists."""
    one = cli("gpu_check.py", "--dry_run", "--gpus", "1", timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    minutes = float(one.stdout.split("checks, about ")[1].split(" minutes")[0])
    assert minutes < 8
    names = [line.split()[0] for line in one.stdout.splitlines()[1:] if line.startswith("  ")]
    assert names == [
        "finetune-bf16",
        "finetune-fp16",
        "finetune-device_map",
        "lm-single",
        "lm-fsdp-1process",
        "lm-device_map",
        "lm-base",
        "llm-lora-bf16",
        "llm-qlora-bf16",
        "linear_toy",
    ]
    for line in one.stdout.splitlines()[1:]:
        config = line.split("--config_file ")[1].split()[0]
        script = next(part for part in line.split() if part.startswith("recipes/"))
        assert (REPO / config).is_file() and (REPO / script).is_file(), line
    assert "--mixed_precision fp16" in one.stdout and "--num_processes 1" in one.stdout
    two = cli("gpu_check.py", "--dry_run", "--gpus", "2", timeout=120)
    assert two.returncode == 0 and {"lm-ddp", "lm-fsdp", "lm-pipeline-1f1b-m4", "finetune-ddp"} <= set(
        two.stdout.split()
    )
