"""The benchmark runner and compare tool, end to end on the smoke matrix (tiny model, 2 steps).

One runner call launches the smoke matrix (single, ddp, the raw torchrun + DDP baseline, the naive
device_map split, a GPipe pipeline) plus a run that cannot start and one whose config file does not
exist; the tests then read its records, its summary and plots, resume it, and gate a doctored copy
of its results with compare.py's regression check. No assertion on speed: two steps of a tiny model
say nothing about it, and the runs overlap (--jobs 2) to keep the test short. The reports say so
themselves: a smoke run is marked as a plumbing check, and its ratios are not judged against targets.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.launch import visible_gpus, zygotes
from harness.zygote import FORKED_PYTHON

REPO = Path(__file__).resolve().parents[1]
import run as runner

SMOKE_SETUPS = {"single", "ddp", "raw_ddp", "device_map", "pipeline-gpipe-m2"}


def cli(script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def forked_python_environment() -> dict | None:
    """What tests/harness/forked_python needs to find the suite's zygotes (tests/harness/zygote.py), which it asks for
    a copy of a process that imported torch, transformers and PEFT instead of starting one; None on a machine with a
    GPU, where launches start (a CUDA context does not survive a fork)."""
    if visible_gpus():
        return None
    forked = zygotes()
    for zygote in forked.pair:
        zygote.wait_until_ready()
    sockets = os.pathsep.join(str(zygote.path) for zygote in forked.pair)
    return {"ZYGOTE_SOCKETS": sockets, "ZYGOTE_PYTHON": sys.executable}


# A benchmark script with ``sys.executable`` set to forked_python: the Python processes its launches start
# (Accelerate's launcher and its workers, torchrun and its workers, compare.py) are copies of the suite's zygotes, as
# the recipes' launches in the other tests are; their command lines and environments stay the script's.
FORKING_RUNNER = (
    "import os, runpy, sys\n"
    "sys.executable, sys.argv = sys.argv[1], sys.argv[2:]\n"
    "sys.path[0] = os.path.dirname(sys.argv[0])  # as python SCRIPT sets it\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def forking_cli(script: str, *args, timeout: float) -> subprocess.CompletedProcess:
    """``cli``, with the script's launches forked from the zygotes where there is no GPU."""
    found = forked_python_environment()
    if found is None:
        return cli(script, *args, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-c", FORKING_RUNNER, FORKED_PYTHON, str(REPO / "benchmarks" / script), *map(str, args)],
        cwd=REPO,
        env={**os.environ, **found},
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
    first = forking_cli("run.py", "--matrix", root / "matrix.json", "--output_dir", out, "--jobs", "2", timeout=600)
    records = {path.stem: json.loads(path.read_text()) for path in (out / "runs").glob("*.json")}
    return {"root": root, "out": out, "first": first, "records": records}


@pytest.mark.slow
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
    # Bytes of model state, counted in each process by the runner's wrapper (benchmarks/with_model_state.py): under DDP
    # every rank holds all of what one process holds; the pipeline's two stages hold the model's parameters between
    # them.
    single = ok["single"]["memory/model_state_bytes"]
    assert set(single) == {"rank0"} and single["rank0"]["optimizer"] > single["rank0"]["parameters"] > 0
    assert ok["ddp"]["memory/model_state_bytes"] == {"rank0": single["rank0"], "rank1": single["rank0"]}
    stages = ok["pipeline-gpipe-m2"]["memory/model_state_bytes"]
    assert set(stages) == {"rank0", "rank1"}
    assert sum(stage["parameters"] for stage in stages.values()) == single["rank0"]["parameters"]
    assert ok["raw_ddp"]["memory/model_state_bytes"] is None  # torchrun's baseline runs without the wrapper
    assert {record["purpose"] for record in records.values()} == {"smoke"}  # failed and skipped runs too


@pytest.mark.slow
def test_failed_run_recorded_and_others_go_on(bench):
    assert bench["first"].returncode == 1  # a failed run makes the runner's exit code non-zero
    failed = bench["records"]["broken__missing-script__r0"]
    assert failed["status"] == "failed" and "no_such_recipe.py" in failed["error_tail"]
    skipped = bench["records"]["broken__missing-config__r0"]
    assert skipped["status"] == "skipped" and "no_such_config.yaml" in skipped["reason"]


@pytest.mark.slow
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


def ratio_lines(text: str) -> list[str]:
    section = text.split("## Ratios")[1].split("\n\n")[1]
    return [line for line in section.splitlines()[2:] if line.startswith("| ")]


@pytest.mark.slow
def test_smoke_summary_is_a_plumbing_check_that_judges_no_target(bench):
    """A new user's smoke run reads as what it is: one line at the top says the numbers check the plumbing and mean
    nothing, and no ratio is judged against its target or shown in bold."""
    stdout, summary = bench["first"].stdout, (bench["out"] / "summary.md").read_text()
    assert stdout.startswith("Smoke matrix (") and "checks the plumbing" in stdout.splitlines()[0]
    for text in (stdout, summary):
        report = text[text.index("# Benchmark results") :]
        assert report.count("plumbing check") == 1 and report.index("plumbing check") < report.index("## Runs")
        assert "mean nothing about speed or accuracy" in report
        rows = ratio_lines(report)
        assert len(rows) == 3 and all("not judged: smoke run" in row for row in rows), rows
        assert not any(word in row for row in rows for word in (" met", "missed", "**", "(!)")), rows
        assert ">= 0.92" not in report and "<= 1.02" not in report


@pytest.mark.slow
def test_accuracy_table_tells_two_runs_apart(bench, tmp_path):
    """Two folders with the same setups (two machines, two commits): each accuracy row names its input and the seeds
    of its runs, so no two rows read alike. The same records without the smoke marking are judged again."""
    first, second = tmp_path / "machine_a", tmp_path / "machine_b"
    for folder in (first, second):
        shutil.copytree(bench["out"] / "runs", folder)
    for path in second.glob("*.json"):  # the second folder as a measurement, with other seeds
        record = json.loads(path.read_text())
        record.pop("purpose")
        record.update(matrix="cpu", seed=43)
        path.write_text(json.dumps(record))
    both = cli("compare.py", first, second, "--output_dir", tmp_path / "report")
    assert both.returncode == 0, both.stdout + both.stderr
    table = both.stdout.split("## Accuracy and model state")[1].split("\n\n")[1].splitlines()
    assert table[0].startswith("| input | group | setup | runs (seeds) |"), table[0]
    rows = [row for row in table[2:] if row.startswith("| ")]
    assert len(rows) == 8 and len(set(rows)) == 8, rows
    assert f"| {first} | lm-tiny-data_parallel | ddp | 1 (42) |" in both.stdout
    assert f"| {second} | lm-tiny-data_parallel | ddp | 1 (43) |" in both.stdout
    # The smoke folder's ratios stay unjudged; the measurement folder's are judged (met or missed), in bold.
    records = len(list(first.glob("*.json")))
    banner = f"**Smoke run ({records} of {2 * records} records; their ratios are not judged):"
    assert both.stdout.count(banner) == 1 and both.stdout.count("plumbing check") == 1
    rows = ratio_lines(both.stdout)
    assert [row.startswith(f"| {first}: ") for row in rows if "not judged: smoke run" in row] == [True] * 3, rows
    judged = [row for row in rows if row.startswith(f"| {second}: ")]
    assert len(judged) == 3 and all("| **" in row for row in judged), judged
    assert sum(" met |" in row or " missed |" in row for row in judged) == 2, judged  # ddp efficiency and overhead


@pytest.mark.slow
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


@pytest.mark.slow
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
    # Other work (a smoke matrix's 8 x 32 against a real 32 x 256): no verdict on speed, and said why.
    other = tmp_path / "other_work"
    shutil.copytree(bench["out"] / "runs", other)
    for path in other.glob("*.json"):
        record = json.loads(path.read_text())
        if record.get("status") == "ok":  # (the fixture's failed launches have no measurements)
            record["global_batch_size"], record["perf/samples_per_sec"] = record["global_batch_size"] * 4, 1e-3
            path.write_text(json.dumps(record))
    unlike = cli("compare.py", "--baseline", baseline, "--candidate", other, "--threshold", "0.1")
    assert unlike.returncode == 2 and "REGRESSION" not in unlike.stdout, unlike.stdout + unlike.stderr
    assert "not compared: the work differs" in unlike.stdout and "global batch or sequence length" in unlike.stdout


def test_gpu_check_dry_run_prints_the_plan_without_a_gpu():
    """The prepared GPU check plans its launches on any machine (CI has no GPU): the two-GPU checks added for two,
    every command a real launch of a recipe with a config that exists, then the steps the script runs itself (the
    QLoRA split's launch among them), and on one GPU the two-process checks it cannot run, with why."""
    one = cli("gpu_check.py", "--dry_run", "--gpus", "1", timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    planned = [line for line in one.stdout.splitlines()[1:] if line.startswith("  ") and " min  [" in line]
    launches = [line for line in planned if " min  [after]  " not in line]
    assert [line.split()[0] for line in planned if line not in launches] == [
        "llm-qlora-bf16-reload",
        "qlora-split",
        "planner-peaks",
        "two-rank-probe",
    ]
    assert [line.split()[0] for line in launches] == [
        "finetune-fp32",
        "finetune-bf16",
        "finetune-fp16",
        "finetune-device_map",
        "lm-base",
        "lm-fsdp-1process",
        "lm-device_map",
        "linear_toy",
        "llm-lora-bf16",
        "llm-lora-bf16-no_gc",
        "llm-qlora-bf16",
        "llm-qlora-fsdp-1process",
        "llm-qlora-fsdp-offload-1process",
        "lm-single",
    ]
    for line in launches:
        config = line.split("--config_file ")[1].split()[0]
        script = next(part for part in line.split() if part.startswith("recipes/"))
        assert (REPO / config).is_file() and (REPO / script).is_file(), line
    assert "--mixed_precision fp16" in one.stdout and "--num_processes 1" in one.stdout
    assert "cannot run on one GPU" in one.stdout and "Duplicate GPU" in one.stdout
    two = cli("gpu_check.py", "--dry_run", "--gpus", "2", timeout=120)
    assert two.returncode == 0 and {"lm-ddp", "lm-fsdp", "lm-pipeline-1f1b-m4", "finetune-ddp"} <= set(
        two.stdout.split()
    )
    assert "cannot run on one GPU" not in two.stdout


def test_gpu_check_time_budget_sums_what_the_plan_runs():
    """The one-GPU plan's estimate comes from its own entries: every launch and every step the script runs itself
    (the QLoRA split's launch, the adapter reload, the probe, the planner) carries its minutes, and the printed total
    is at least what they add up to (the parallel phases' work shared over PARALLEL_JOBS), within one device call."""
    import gpu_check

    plan = gpu_check.checks(1, False)
    assert {"qlora-split", "llm-qlora-bf16-reload", "two-rank-probe", "planner-peaks"} <= {c["name"] for c in plan}
    assert all(check["minutes"] > 0 for check in plan), plan
    one_at_a_time = sum(check["minutes"] for check in plan if check["phase"] in ("alone", "after"))
    shared = sum(check["minutes"] for check in plan if check["phase"] in ("compare", "llm"))
    floor = one_at_a_time + shared / gpu_check.PARALLEL_JOBS
    dry = cli("gpu_check.py", "--dry_run", "--gpus", "1", timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    printed = float(dry.stdout.split(" steps of its own, about ")[1].split(" minutes")[0])
    assert printed == round(gpu_check.estimated_minutes(plan, gpu_check.PARALLEL_JOBS), 1)
    assert floor <= printed < 7, (floor, printed)


def test_gpu_check_perf_plan_measures_the_performance_targets():
    """--perf plans the performance issue's runs, each alone, in one device call (under 9 minutes): the LM eager and
    with --compile, FSDP2 in one process at the same shape, the fine-tune's plain padded loop and its recommended flags
    in the same precision, then vs_trl.py at the GPU preset."""
    perf = cli("gpu_check.py", "--perf", "--dry_run", "--gpus", "1", timeout=120)
    assert perf.returncode == 0, perf.stdout + perf.stderr
    assert float(perf.stdout.split(" steps of its own, about ")[1].split(" minutes")[0]) < 9
    launches = {line.split()[0]: line for line in perf.stdout.splitlines() if " min  [alone]" in line}
    assert list(launches) == [
        "lm-single",
        "lm-single-compile",
        "lm-fsdp-1process-speed",
        "finetune-plain",
        "finetune-recommended",
    ]
    assert "--compile" in launches["lm-single-compile"] and "--compile" not in launches["lm-single"]
    shape = launches["lm-single"].split("train_lm.py")[1].split("--output_dir")[0]
    assert shape.replace("--parallelism single", "--parallelism fsdp") in launches["lm-fsdp-1process-speed"]
    assert "fsdp_2gpu.yaml --num_processes 1" in launches["lm-fsdp-1process-speed"]
    assert "--pad_to_max_length" in launches["finetune-plain"]
    assert "--group_by_length" not in launches["finetune-plain"]
    assert "--group_by_length" in launches["finetune-recommended"]
    assert all("--mixed_precision bf16" in line for line in launches.values())
    assert "vs_trl.py --preset gpu-1b" in perf.stdout


def test_gpu_check_perf_verdicts_say_which_target_was_missed(tmp_path):
    """The --perf verdicts on fabricated runs: a target met passes, one missed says "below target" with its numbers
    (a finding, not a failed check), a missing run fails; the LLM recipe must also match TRL's validation loss."""
    import gpu_check

    runs = {
        "lm-single": {
            "perf/tokens_per_sec": 1000.0,
            "mfu": 0.30,
            "perf/step_time_p90_s": 1.1,
            "train/loss_curve": [7.0, 6.51],
        },
        "lm-single-compile": {
            "perf/tokens_per_sec": 1500.0,
            "mfu": 0.46,
            "perf/step_time_p90_s": 0.7,
            "train/loss_curve": [7.0, 6.5],
        },
        "lm-fsdp-1process-speed": {"perf/tokens_per_sec": 900.0, "perf/step_time_p90_s": 1.2},
        "finetune-recommended": {"perf/samples_per_sec": 140.0, "perf/step_time_p90_s": 0.2},
    }
    records = {name: fabricated_run(tmp_path, name, **results) for name, results in runs.items()}
    records["finetune-plain"] = {"status": "failed", "reason": "exit code 1"}
    vs_trl = {
        "summary": [
            {"key": "perf/tokens_per_sec", "median": 1.4, "interval": [1.3, 1.5]},
            {"key": "eval/loss", "median": 1.05},
        ]
    }
    verdicts = {row["comparison"]: row for row in gpu_check.judge_perf(records, tmp_path, True, vs_trl)}
    status = {name: row["status"] for name, row in verdicts.items()}
    assert status == {
        "LM MFU, one GPU": "pass",
        "LM --compile / eager": "pass",
        "LM --compile = eager": "pass",
        "LM FSDP2 in 1 process / single": "below target",
        "fine-tune recommended flags / plain loop": "fail",  # the plain run failed
        "LLM recipe / TRL SFTTrainer": "below target",  # 1.4x faster, but at 1.05x TRL's validation loss
    }
    assert "46.0%" in verdicts["LM MFU, one GPU"]["line"]
    assert "0.900x" in verdicts["LM FSDP2 in 1 process / single"]["line"]
    assert "1.0500x TRL's" in verdicts["LLM recipe / TRL SFTTrainer"]["line"]
    (tmp_path / "work" / "lm-single-compile" / "results.json").write_text(
        json.dumps({"perf/tokens_per_sec": 1500.0, "train/loss_curve": [7.0, 5.0]})
    )  # a compile that trains otherwise
    rows = {row["comparison"]: row for row in gpu_check.judge_perf(records, tmp_path, True, vs_trl)}
    assert rows["LM --compile = eager"]["status"] == "fail" and "5 vs 6.51" in rows["LM --compile = eager"]["line"]
    vs_trl["summary"][1]["median"] = 1.0
    assert gpu_check.judge_perf(records, tmp_path, True, vs_trl)[-1]["status"] == "pass"
    skipped = gpu_check.judge_perf(records, tmp_path, True, {"error": "TRL is not installed here"})[-1]
    assert skipped["status"] == "skipped" and "TRL" in skipped["line"]
    # --only left runs out: their comparisons are skipped, not failed (the check's exit code stays 0)
    del records["lm-fsdp-1process-speed"], records["finetune-plain"]
    rows = {row["comparison"]: row["status"] for row in gpu_check.judge_perf(records, tmp_path, True, None)}
    assert rows["LM FSDP2 in 1 process / single"] == rows["fine-tune recommended flags / plain loop"] == "skipped"
    assert rows["LLM recipe / TRL SFTTrainer"] == "skipped" and rows["LM --compile / eager"] == "pass"


def test_gpu_check_only_pulls_in_the_references_its_comparisons_need():
    import gpu_check

    def names(*words):
        return {check["name"] for check in gpu_check.select(gpu_check.checks(1, False), list(words))}

    assert names("fp16") == {"finetune-fp16", "finetune-fp32"}
    assert names("lm-device_map") == {"lm-device_map", "lm-base"}
    assert names("llm-lora-bf16") == {"llm-lora-bf16", "llm-lora-bf16-no_gc", "lm-base"}
    assert names("llm-qlora-bf16") == {"llm-qlora-bf16", "llm-qlora-bf16-reload", "lm-base"}
    assert names("qlora-fsdp-offload") == {"llm-qlora-fsdp-offload-1process", "llm-qlora-bf16", "lm-base"}
    assert names("split") == {"qlora-split"}


def fabricated_run(root: Path, name: str, **results) -> dict:
    """A record and results.json as the runner leaves them, with made-up numbers: ``peak`` the record's peak memory,
    ``mfu`` the MFU the runner computes (the recipes' results.json carry none)."""
    folder = root / "work" / name
    folder.mkdir(parents=True)
    peak, mfu = results.pop("peak", None), results.pop("mfu", None)
    (folder / "results.json").write_text(json.dumps({"config": {}, **results}))
    return {
        "status": "ok",
        "run_id": name,
        "results_file": f"work/{name}/results.json",
        "memory/peak_gib": {"cuda:0": peak},
        **({"perf/mfu": mfu} if mfu is not None else {}),
    }


def test_mfu_is_the_runners_over_the_gpus_the_run_computed_on(tmp_path):
    """The runner's MFU of an LM run (the recipes report none): tokens/s x FLOPs per token over the peak of each GPU
    the run computed on, one per process or the GPUs of a device_map split, whose CPU part is no GPU; none off CUDA."""
    model_config = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512}
    results = {
        "perf/tokens_per_sec": 1000.0,
        "model/num_parameters": 200_000,
        "config": {"model_config": model_config},
    }
    gpus = [{"name": "NVIDIA H100 80GB HBM3", "peak_bf16_flops": 989e12}]
    one_gpu = 1000.0 * runner.flops_per_token(model_config, 200_000, 64)["flops/per_token"] / 989e12

    def mfu(device: str, processes: int = 1, split: list[str] | None = None) -> float | None:
        record = {"recipe": "train_lm", "processes": processes, "sequence_length": 64}
        runner.add_flops(record, {**results, "device": device, "device_map_devices": split}, tmp_path, gpus)
        assert record["perf/achieved_tflops"] > 0
        return record.get("perf/mfu")

    assert mfu("cuda:0") == pytest.approx(one_gpu)
    assert mfu("cuda:0", processes=2) == pytest.approx(one_gpu / 2)
    assert mfu("cuda:0", split=["cuda:0", "cuda:1"]) == pytest.approx(one_gpu / 2)
    assert mfu("cuda:0", split=["cuda:0", "cpu"]) == pytest.approx(one_gpu)  # a split over one GPU and the CPU
    assert mfu("cpu") is None


def test_gpu_check_comparisons_fail_with_their_numbers(tmp_path):
    """Each comparison of gpu_check.py, fed fabricated runs: one inside its tolerance passes, one beyond it fails and
    says the numbers (remove a comparison and its run goes unjudged: this test fails)."""
    import gpu_check

    plan = [
        check
        for check in gpu_check.checks(1, False)
        if check["name"] not in ("llm-qlora-bf16-reload",) and check["recipe"] != "train_lm"
    ]
    plan += [{"name": "lm-base", "recipe": "-"}, {"name": "lm-fsdp-1process", "recipe": "-"}]
    plan += [{"name": "lm-device_map", "recipe": "-"}]
    reference = [2.0, 1.5, 1.0]
    runs = {
        "finetune-fp32": dict(**{"train/loss_curve": reference}),
        "finetune-bf16": {"train/loss_curve": [2.02, 1.52, 1.01]},  # within 0.05 + 10 %
        "finetune-fp16": {"train/loss_curve": [2.0, 1.5, 1.4], "train/grad_scale": 1.0},  # 0.4 off; scaler off
        "finetune-device_map": {"train/loss_curve": [2.0, float("nan"), 1.0]},
        "lm-base": {"train/loss_curve": [7.0, 6.5]},
        "lm-fsdp-1process": {"train/loss_curve": [7.0, 6.5001]},  # 1.5e-5 relative: inside 1e-3
        "lm-device_map": {"train/loss_curve": [7.0, 6.52]},  # 3e-3 relative: beyond
        "llm-lora-bf16": {"peak": 1.0},
        "llm-lora-bf16-no_gc": {"peak": 1.05},  # checkpointing saved 5 % only
        "linear_toy": {"eval/max_abs_weight_error": 0.5},
        "llm-qlora-bf16": {"train/loss_curve": [3.0, 2.5, 2.0]},
        "llm-qlora-fsdp-1process": {"train/loss_curve": [3.0, 2.53, 2.01]},  # within 0.02 + 2 %
        "llm-qlora-fsdp-offload-1process": {"train/loss_curve": [3.0, 2.5, 2.3]},  # 0.3 off
    }
    records = {name: fabricated_run(tmp_path, name, **results) for name, results in runs.items()}
    verdicts = {row["comparison"]: row for row in gpu_check.judge(plan, records, tmp_path, cuda=True)}
    status = {name: row["status"] for name, row in verdicts.items()}
    assert status == {
        "finetune bf16 = fp32": "pass",
        "finetune fp16 = fp32": "fail",
        "fp16 GradScaler scales": "fail",
        "finetune device_map = single": "fail",
        "lm FSDP2 in 1 process = single": "pass",
        "lm device_map split = single": "fail",
        "gradient checkpointing saves memory": "fail",
        "linear_toy = its true line": "fail",
        "QLoRA under FSDP2 in 1 process = one-GPU QLoRA": "pass",
        "QLoRA under FSDP2 + CPU offload in 1 process = one-GPU QLoRA": "fail",
    }
    assert (
        "0.3 at point 2 (2.3 vs 2)" in verdicts["QLoRA under FSDP2 + CPU offload in 1 process = one-GPU QLoRA"]["line"]
    )
    assert "0.4 at point 2 (1.4 vs 1)" in verdicts["finetune fp16 = fp32"]["line"]
    assert "scale 1.0" in verdicts["fp16 GradScaler scales"]["line"]
    assert "inf at point 1" in verdicts["finetune device_map = single"]["line"]
    assert "6.52 vs 6.5" in verdicts["lm device_map split = single"]["line"]
    assert "+4.8% saved" in verdicts["gradient checkpointing saves memory"]["line"]
    assert verdicts["lm device_map split = single"]["tolerance"] == gpu_check.TOLERANCE["lm-fp32"]

    # The planner: within 15 % passes; 20 % under says so, and the 4-bit facts of a base that stayed 16-bit fail.
    assert gpu_check.compare_planner("p", 10.0, 11.0, 0.15)["status"] == "pass"
    missed = gpu_check.compare_planner("p", 10.0, 8.0, 0.15)
    assert missed["status"] == "fail" and "-20.0%" in missed["line"] and "8.000 GiB" in missed["line"]
    facts = dict(linear4bit=0, params4bit=0, quantizable_linear=84, params4bit_bytes=0, bf16_bytes_of_same=0)
    assert gpu_check.compare_4bit("q", facts, 0.3)["status"] == "fail"
    packed = dict(facts, linear4bit=84, params4bit=84, params4bit_bytes=25, bf16_bytes_of_same=100)
    assert gpu_check.compare_4bit("q", packed, 0.3)["status"] == "pass"
    assert gpu_check.compare_4bit("q", dict(packed, params4bit_bytes=50), 0.3)["status"] == "fail"
    some = gpu_check.compare_4bit("q", dict(packed, linear4bit=80, params4bit=80), 0.3)  # 4 layers left in 16 bits
    assert some["status"] == "fail" and "80 Linear4bit modules" in some["line"] and "84 quantizable" in some["line"]


def test_gpu_check_qlora_split_verdict_reads_the_load_peak():
    """The QLoRA split's verdict takes each GPU's peak over the whole run: a loader that put the whole 4-bit model on
    cuda:0 before splitting it shows only in the load peak (the counter restarts for training), and fails; a record
    without a load peak cannot pass."""
    import gpu_check

    whole = 0.4  # GiB of 4-bit weights
    split = {"memory/load_peak_gib": {"cuda:0": 0.15, "cpu": 2.0}, "memory/peak_gib": {"cuda:0": 0.2, "cpu": 2.1}}
    assert gpu_check.split_peaks_verdict("s", split, whole)["status"] == "pass"
    whole_first = dict(split, **{"memory/load_peak_gib": {"cuda:0": 0.41, "cpu": 2.0}})
    failed = gpu_check.split_peaks_verdict("s", whole_first, whole)
    assert failed["status"] == "fail" and failed["peaks"] == {"cuda:0": 0.41}, failed
    assert "loading {'cuda:0': 0.41" in failed["line"] and "(0.3000)" in failed["line"]
    no_load_peak = {"memory/peak_gib": split["memory/peak_gib"]}
    assert gpu_check.split_peaks_verdict("s", no_load_peak, whole)["status"] == "fail"
    two_ranks = {"memory/load_peak_gib": {"rank0/cuda:0": 0.1, "rank1/cuda:1": 0.35}, "memory/peak_gib": {}}
    assert gpu_check.split_peaks_verdict("s", two_ranks, whole)["peaks"] == {"rank0/cuda:0": 0.1, "rank1/cuda:1": 0.35}


@pytest.mark.slow
def test_gpu_check_two_rank_probe_runs_on_the_cpu():
    """The one-GPU probe of the collectives DDP and FSDP2 need, as two gloo ranks on one device: here the CPU."""
    import gpu_check

    probe = gpu_check.two_rank_probe("cpu", timeout=240)
    assert probe == {"device": "cpu", "backend": "gloo", **{op: "ok" for op in gpu_check.PROBE_COLLECTIVES}}


# ----------------------------------------------------------------------------- equal work per step
def record(group: str, setup: str, round_: int, recipe: str = "train_lm", processes: int = 2, **fields) -> dict:
    """A runner record with made-up numbers: each round the setup runs 10 % faster than its reference would."""
    from lib.records import SCHEMA

    return {
        "schema": SCHEMA,
        "status": "ok",
        "_input": "",
        "run_id": f"{setup}-{round_}",
        "group": group,
        "setup": setup,
        "round": round_,
        "recipe": recipe,
        "processes": processes,
        "perf/step_time_s": 1.0,
        "perf/samples_per_sec": 10.0 + round_,
        **fields,
    }


@pytest.mark.parametrize(
    "group, reference, setup, recipe, work, unequal",
    [
        # The recipe against raw PyTorch: the same blocks, but the recipe's steps hold half the tokens.
        ("lm-tiny-data_parallel", "raw_ddp", "ddp", "train_lm", "perf/tokens_per_step", (8192, 4096)),
        # Pipeline vs the naive split over the same batch, but 2,048 tokens per step on one side.
        (
            "lm-small-pipeline-gpipe",
            "device_map",
            "pipeline-gpipe-m2",
            "pipeline_lm",
            "perf/tokens_per_step",
            (4096, 2048),
        ),
        # The fine-tune against its plain loop: 32 vs 16 samples per step.
        ("finetune-equal-accuracy", "ddp+fixed", "ddp", "transformer_finetune", "perf/samples_per_step", (32, 16)),
    ],
)
def test_a_ratio_of_unequal_work_per_step_is_refused(group, reference, setup, recipe, work, unequal):
    """compare.py puts each side's work per optimizer step in every ratio's row (``equal_work``) and refuses to
    judge a ratio whose sides differ by more than 1 %: no ratio, no verdict, the numbers named instead. Within 1 %
    the same ratio is judged."""
    import compare

    def rows(a, b):
        records = [
            record(group, name, r, recipe, **{work: value})
            for r in range(3)
            for name, value in ((reference, a), (setup, b))
        ]
        found = [row for row in compare.ratios(compare.configurations(records)) if row["setup"] == setup]
        return found, compare.markdown(records)

    (row,), report = rows(*unequal)
    assert row["equal_work"]["equal"] is False and row["ratio"] is None and row["pooled"] is None
    assert row["equal_work"][work.split("/")[1]] == {"reference": unequal[0], "setup": unequal[1]}
    (line,) = [line for line in ratio_lines(report) if setup in line]
    measure = work.split("/")[1].replace("_", " ")
    assert f"not judged: unequal work per step ({measure}: reference {unequal[0]:,} vs setup {unequal[1]:,})" in line
    assert not any(word in line for word in (" met", "missed", "**0", "**1"))
    (row,), report = rows(unequal[0], unequal[0] * 0.995)  # within 1 %: judged
    assert row["equal_work"]["equal"] is True and row["ratio"] is not None and "unequal work" not in report


def test_ddp_scaling_compares_the_work_of_each_process():
    """DDP scaling efficiency compares 1 process with 2 at the same per-process batch: twice the global work per step
    is the same work per process, judged; a per-process batch that changed is not."""
    import compare

    def row(ddp_tokens):
        group = "lm-tiny-data_parallel"
        records = [record(group, "single", r, processes=1, **{"perf/tokens_per_step": 4096}) for r in range(3)]
        records += [record(group, "ddp", r, **{"perf/tokens_per_step": ddp_tokens}) for r in range(3)]
        return next(
            row
            for row in compare.ratios(compare.configurations(records))
            if row["comparison"] == "ddp scaling efficiency"
        )

    judged = row(8192)
    assert judged["equal_work"]["tokens_per_step"] == {"reference": 4096, "setup": 4096} and judged["ratio"]
    assert row(4096)["ratio"] is None  # 2 processes sharing one process's batch


@pytest.mark.slow
def test_vs_trl_refuses_to_judge_sides_of_unequal_work(tmp_path, monkeypatch):
    """vs_trl.py records each side's real tokens and samples per optimizer step (``equal_work`` in vs_trl.json); where
    they differ by more than 1 % (steps of 4 x 2 samples against 4 x 2 packed rows of 2,048 tokens, at the gpu-1b
    preset's shape) it stops after that round and writes no ratio and no verdict, says why, and exits 1.
    Fabricated launches: nothing trains here."""
    import vs_trl

    def launch(command, out, settings, results_name):
        side = "trl" if "--trl_worker" in command else "recipe"
        results = {
            "perf/tokens_per_sec": 1000.0,
            "perf/samples_per_sec": 10.0,
            "perf/step_time_s": 0.1,
            "perf/tokens_per_step": tokens[side],
            "perf/samples_per_step": 8.0,
            "memory/peak_gib": {"cpu": 1.0},
            "eval/loss": 2.0,
            "bench/wall_s": 10.0,
            "bench/foreign_share": 0.0,
            "num_processes": 1,
        }
        if side == "recipe":
            return {**results, "train/loss_curve": [3.0] * 20}
        return {
            **results,
            "eval/trl_eval_loss": 2.0,
            "train/loss_log": [(10, 3.0), (20, 3.0)],
            "labels_check": {"samples_checked": 1, "num_differing": 0, "differing": []},
            "torch_threads": 1,
            "trl/optim": "adamw_torch_fused",
            "trl/padding_free": True,
            "model/trainable_parameters": 1,
            **cpu_clock,
        }

    cpu_clock = {
        "perf/cpu_s": 1.0,
        "perf/cpu_step_s": [0.1] * 20,
        "perf/samples_per_cpu_s": 1.0,
        "perf/tokens_per_cpu_s": 1.0,
    }
    monkeypatch.setattr(vs_trl, "launch", launch)
    monkeypatch.setattr(vs_trl, "build_inputs", lambda work, settings: (work / "model", work / "t", work / "v"))
    monkeypatch.setattr(vs_trl, "recipe_cpu_clock", lambda out, warmup: cpu_clock)
    monkeypatch.setattr(
        vs_trl,
        "adapter_difference",
        lambda a, b: {"same_tensors": True, "max_abs_diff": 0.0, "relative_diff": 0.0, "tensors": 1},
    )
    argv = ["--preset", "cpu-tiny", "--repeats", "3", "--breakdown_repeats", "0", "--work_dir", str(tmp_path / "w")]

    tokens = {"recipe": 437.0, "trl": 15835.0}
    assert vs_trl.main([*argv, "--output_dir", str(tmp_path / "unequal")]) == 1
    report = json.loads((tmp_path / "unequal" / "vs_trl.json").read_text())
    assert report["equal_work"]["equal"] is False and report["summary"] == [] and len(report["rounds"]) == 1
    assert report["equal_work"]["tokens_per_step"] == {"recipe": 437.0, "trl": 15835.0}
    assert "Not judged" in report["refused"] and "tokens per step: recipe 437 vs trl 15,835" in report["refused"]
    summary = (tmp_path / "unequal" / "summary.md").read_text()
    assert report["refused"] in summary and "**0" not in summary and "**1" not in summary

    tokens = {"recipe": 15835.0, "trl": 15800.0}  # 0.2 % apart: judged
    assert vs_trl.main([*argv, "--output_dir", str(tmp_path / "equal")]) == 0
    report = json.loads((tmp_path / "equal" / "vs_trl.json").read_text())
    assert report["equal_work"]["equal"] is True and report["refused"] is None and len(report["rounds"]) == 3
    assert {row["key"] for row in report["summary"]} >= {"perf/tokens_per_sec", "perf/samples_per_sec"}


def test_gpu_check_and_pipeline_vs_naive_refuse_unequal_work(tmp_path):
    """gpu_check.py's speed ratios (the fine-tune against its plain loop, ...) and pipeline_vs_naive.py's pairs check
    the work per step of both runs like compare.py: unequal work is not judged (a failed check: the plan meant it
    equal), and names the numbers; a refused vs_trl.py report is a failed comparison, not a skipped one."""
    import gpu_check
    import pipeline_vs_naive

    name = "fine-tune recommended flags / plain loop"
    plain = {"perf/samples_per_sec": 100.0, "perf/samples_per_step": 32}
    fast = {"perf/samples_per_sec": 150.0, "perf/samples_per_step": 16}
    row = gpu_check.speed_ratio(name, fast, plain, "perf/samples_per_sec", 1.3)
    assert row["status"] == "fail" and row["value"] is None and row["equal_work"]["equal"] is False
    assert "not judged: unequal work per step (samples per step: candidate 16 vs reference 32)" in row["line"]
    same = gpu_check.speed_ratio(name, dict(fast, **{"perf/samples_per_step": 32}), plain, "perf/samples_per_sec", 1.3)
    assert same["status"] == "pass" and same["value"] == 1.5
    refused = {"refused": "Not judged: the two sides did different work per optimizer step (...)", "summary": []}
    trl = gpu_check.judge_perf({}, tmp_path, False, refused)[-1]
    assert trl["status"] == "fail" and trl["line"] == refused["refused"]

    naive = {"recipe": "train_lm", "perf/tokens_per_step": 4096, "perf/samples_per_step": 16}
    assert pipeline_vs_naive.pair_work(naive, dict(naive), "naive", "gpipe")["equal"] is True
    with pytest.raises(SystemExit, match=r"naive and gpipe did different work .* \(tokens per step: naive 4,096 vs"):
        pipeline_vs_naive.pair_work(naive, dict(naive, **{"perf/tokens_per_step": 2048}), "naive", "gpipe")


# ----------------------------------------------------------------------------- layers
def imported_names(path: Path) -> set[str]:
    """The top-level names a file imports (``import a.b`` and ``from a.b import c``: ``a``), at any depth."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_benchmarks_import_only_their_library():
    """The tools (runner, compare, GPU check, profiler, the runner's model-state wrapper) and the studies import
    ``lib`` and never each other: a study that needs what another has (launching, the equal-work check, an interval)
    finds it in ``lib``. ``lib`` imports neither. A tool or study that needs another's output runs it as a command."""
    tools = sorted((REPO / "benchmarks").glob("*.py"))
    studies = sorted((REPO / "benchmarks" / "studies").glob("*.py"))
    library = sorted((REPO / "benchmarks" / "lib").glob("*.py"))
    assert {path.name for path in tools} == {
        "run.py",
        "compare.py",
        "gpu_check.py",
        "profile_recipe.py",
        "with_model_state.py",
    }
    assert {path.name for path in studies} >= {"vs_trl.py", "pipeline_vs_naive.py", "raw_ddp_lm.py", "loading.py"}
    ours = {path.stem for path in tools + studies}
    for path in tools + studies + library:
        others = imported_names(path) & ours - {path.stem}
        assert not others, f"{path.relative_to(REPO)} imports {sorted(others)}: put what it needs in benchmarks/lib/"
    for path in library:  # lib imports lib and shared/, never a recipe or a tool
        assert not imported_names(path) & {"recipes", "tools"}, f"{path.name} imports beyond lib and shared"


def test_a_study_finds_what_it_needs_in_the_library(tmp_path):
    """What a new side-by-side study uses, from ``lib`` alone: launching a command and reading its results with the
    CPU share other processes took, the equal-work refusal, and the 95 % interval of a ratio from A B rounds."""
    from lib.launch import accelerate_launch, launch_and_wait
    from lib.records import equal_work, unequal_work_text
    from lib.stats import paired_ratio

    assert accelerate_launch("ddp_2gpu.yaml")[-1].endswith("accelerate_configs/ddp_2gpu.yaml")
    write = "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'perf/tokens_per_sec': 10.0}))"
    results = launch_and_wait([sys.executable, "-c", write, str(tmp_path / "results.json")], tmp_path)
    assert results["perf/tokens_per_sec"] == 10.0 and results["bench/wall_s"] > 0
    assert (tmp_path / "launch.log").is_file()
    with pytest.raises(SystemExit, match="launch failed"):
        launch_and_wait([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "failed")
    work = equal_work({"dpo": {"tokens_per_step": 4096}, "trl": {"tokens_per_step": 2048}})
    assert work["equal"] is False and "dpo 4,096 vs trl 2,048" in unequal_work_text(work)
    ratio = paired_ratio([1.2, 1.1, 1.3, 1.25], [1.0, 1.0, 1.0, 1.0])
    assert ratio["median"] == pytest.approx(1.225) and ratio["interval"][0] <= 1.225 <= ratio["interval"][1]
    assert ratio["pooled"] == pytest.approx(1.225) and len(ratio["rounds"]) == 4


def test_dpo_vs_trl_judges_only_equal_work_and_equal_losses(tmp_path, monkeypatch):
    """studies/dpo_vs_trl.py gives a speed verdict only where both sides trained the same tokens per step (within
    1 %) on identically tokenized pairs, and exits 1 when a step's loss differs by more than 1e-4 (the equality
    claim), saying so in summary.md. Fabricated launches: nothing trains here."""
    import dpo_vs_trl

    def fake_side(out, warmup):
        side, log = ("trl" if out.name.startswith("trl") else "recipe"), []
        for step in (1, 2):
            log.append({"step": step, **{f"train/{name}": 0.5 for name in dpo_vs_trl.METRICS}})
        log[-1]["train/loss"] += loss_offset[side]
        steps = [{"cpu_s": 0.1, "samples": 8, "tokens": tokens[side]}] * 6
        ids = {
            "pairs_checked": 8,
            "pairs_prepared_by_trl": 8,
            "num_differing": 0,
            "differing": [],
            "pairs_dropped_by_recipe": 0,
        }
        return dpo_vs_trl.side(steps, warmup, [0.2] * 6, {"cpu": 1.0}, log) | {"ids_check": ids, "profile": None}

    monkeypatch.setattr(dpo_vs_trl, "launch", lambda command, out, s: 1.0)
    monkeypatch.setattr(dpo_vs_trl, "build_inputs", lambda work, s: (work / "m", work / "t", work / "v"))
    monkeypatch.setattr(dpo_vs_trl, "recipe_side", fake_side)
    monkeypatch.setattr(dpo_vs_trl, "trl_side", fake_side)
    monkeypatch.setattr(
        dpo_vs_trl,
        "adapter_difference",
        lambda a, b: {
            "same_tensors": True,
            "tensors": 1,
            "max_abs_diff": 0.0,
            "max_abs_value": 1.0,
            "relative_diff": 0.0,
        },
    )
    argv = ["--preset", "cpu-tiny", "--work_dir", str(tmp_path / "w"), "--output_dir"]

    tokens, loss_offset = {"recipe": 1000, "trl": 1100}, {"recipe": 0.0, "trl": 0.0}
    assert dpo_vs_trl.main([*argv, str(tmp_path / "unequal")]) == 1
    report = json.loads((tmp_path / "unequal" / "dpo_vs_trl.json").read_text())
    assert report["equal_work"]["equal"] is False and report["summary"] == []
    assert "tokens per step: recipe 1,000 vs trl 1,100" in report["refused"]

    tokens, loss_offset = {"recipe": 1000, "trl": 1000}, {"recipe": 0.0, "trl": 2e-4}
    assert dpo_vs_trl.main([*argv, str(tmp_path / "loss")]) == 1
    assert "BEYOND 0.0001" in (tmp_path / "loss" / "summary.md").read_text()

    loss_offset = {"recipe": 0.0, "trl": 5e-5}
    assert dpo_vs_trl.main([*argv, str(tmp_path / "equal")]) == 0
    report = json.loads((tmp_path / "equal" / "dpo_vs_trl.json").read_text())
    assert report["refused"] is None and report["equality"]["max_loss_abs_diff"] == pytest.approx(5e-5)
    assert [row["key"] for row in report["summary"]][0] == "perf/samples_per_cpu_s"
    assert all(row["interval"] is not None for row in report["summary"])  # 3 rounds


@pytest.mark.slow
def test_grpo_vs_trl_gives_trl_s_losses_and_gradients(tmp_path, monkeypatch):
    """studies/grpo_vs_trl.py's first case, where TRL is installed: recipes/grpo.py and TRL's GRPOTrainer on the same
    fixed completions, DAPO with the KL term and 2 iterations per round: every step's loss and LoRA gradient within
    1e-6 (the study exits 1 otherwise). Its other cases (each loss type, accumulation, the other options) run in the
    study itself."""
    pytest.importorskip("trl")
    import grpo_vs_trl

    found = forked_python_environment()
    if found is not None:  # the study's launches (the recipe's and TRL's sides) forked from the zygotes, as run.py's
        for name, value in found.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "executable", FORKED_PYTHON)
    argv = ["--cases", "dapo", "--work_dir", str(tmp_path / "work"), "--output_dir", str(tmp_path / "out")]
    assert grpo_vs_trl.main(argv) == 0, (tmp_path / "out" / "summary.md").read_text()
    report = json.loads((tmp_path / "out" / "grpo_vs_trl.json").read_text())
    steps = report["cases"]["dapo"]["comparison"]["steps"]
    assert len(steps) == grpo_vs_trl.STEPS and all(step["parameters"] > 0 for step in steps)
    assert max(step["loss_abs_diff"] for step in steps) <= 1e-6 and max(s["grad_max_abs_diff"] for s in steps) <= 1e-6
    assert steps[1]["loss_recipe"] != steps[0]["loss_recipe"]  # the second step's ratio is against the first's policy


def test_grpo_speed_refuses_to_judge_sides_of_unequal_work(tmp_path, monkeypatch):
    """grpo_vs_trl.py --speed records, for every round, what both sides did (the global batch of completions per
    step, measured steps, generations, completion length, trainable parameters, mean completion lengths): a TRL side
    that counted one process's completions in 2 processes (16 per step against the recipe's 32) gets no ratio, the
    summary says why, and the study exits 1. Fabricated launches: nothing trains here."""
    import grpo_vs_trl

    def launch_and_wait(command, out, results_name="results.json", threads=None):
        if "--trl_worker" in command:
            return {
                "perf/completions_per_sec": 10.0,
                "completions/mean_length": [32.0] * 12,
                "perf/measured_steps": 10,
                "global_batch_size": trl_batch,
                "num_generations": 8,
                "max_completion_length": 32,
                "model/trainable_parameters": 7,
                "train/rewards": [0.0] * 12,
            }
        return {
            "perf/completions_per_sec": 13.0,
            "train/log": [{"train/completions/mean_length": 31.9}] * 12,
            "perf/measured_steps": 10,
            "global_batch_size": 32,
            "config": {"num_generations": 8, "max_completion_length": 32},
            "model/trainable_parameters": 7,
            "train/rewards": [0.0] * 12,
        }

    monkeypatch.setattr(grpo_vs_trl, "launch_and_wait", launch_and_wait)
    monkeypatch.setattr(grpo_vs_trl, "build_inputs", lambda work, model, vocab_size: (work / "m", work / "p"))
    argv = ["--speed", "--speed_cases", "lora", "--work_dir", str(tmp_path / "w")]

    trl_batch = 16
    assert grpo_vs_trl.main([*argv, "--output_dir", str(tmp_path / "unequal")]) == 1
    case = json.loads((tmp_path / "unequal" / "grpo_vs_trl.json").read_text())["cases"]["lora"]
    assert case["equal_work"] is False and case["ratio"] is None
    assert case["rounds"][0]["work"]["global_batch_size"] == [32, 16]
    assert "Unequal work" in (tmp_path / "unequal" / "summary.md").read_text()

    trl_batch = 32
    assert grpo_vs_trl.main([*argv, "--output_dir", str(tmp_path / "equal")]) == 0
    case = json.loads((tmp_path / "equal" / "grpo_vs_trl.json").read_text())["cases"]["lora"]
    assert case["equal_work"] is True and case["ratio"]["median"] == pytest.approx(1.3)
