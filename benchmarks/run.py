"""Run a benchmark matrix (recipe x setup x size) through ``accelerate launch`` and write one JSON per run.

    python benchmarks/run.py --matrix cpu --output_dir outputs/bench_cpu      # the reference CPU matrix
    python benchmarks/run.py --matrix gpu --output_dir outputs/bench_gpu      # one GPU: 350M, bf16, compiled
    python benchmarks/run.py --matrix smoke --output_dir outputs/bench_smoke  # 2 steps of tiny models (the test)
    python benchmarks/run.py --matrix cpu --dump_matrix > my_matrix.json      # edit it, then --matrix my_matrix.json

Every run goes through ``accelerate launch --config_file accelerate_configs/<setup's config>`` (the
raw PyTorch baseline through ``torchrun``), with warm-up steps left out of the numbers
(``--perf_warmup_steps``), the final evaluation and checkpoints off, and one thread per process on CPU
(one core stands in for one GPU). A matrix is a list of *groups*: runs that are compared with each
other. Each group runs as rounds, A B A B (``--repeats`` rounds of all its setups, back to back), so
slow drift of a shared machine hits both sides of a ratio alike; ``benchmarks/compare.py`` pairs the
runs of one round and reports the median ratio. The schema of the per-run JSON is in
``docs/benchmarks.md``.

Robust and resumable: a failed run is recorded (``status: failed`` with the tail of its output) and the
matrix goes on; a setup whose config file does not exist is recorded as skipped; running the same
command again skips every run already recorded as ok with the same command line (failed and skipped
runs are tried again). At the end ``compare.py`` writes ``summary.md`` and ``plots/`` into the output dir.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from datetime import datetime, UTC
from pathlib import Path

import psutil
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]  # the benchmarks' library (lib/), and shared/
from lib.launch import CONFIGS
from lib.machine import busy_cpu_seconds, library_versions, machine_info, own_cpu_seconds
from lib.records import LM_RECIPES, SCHEMA, summarize  # the record schema, shared with compare.py
from lib.specs import command_for, finetune_runs, llm_runs, lm_runs
from lib.flops import lm_flops_per_token  # torch-free: the runner stays light

RUN_MARKER = "TWO_GPU_RECIPES_BENCH_RUN"  # in every process of a run, to find and kill them all on timeout

KEEP_FILES = {"results.json", "config.json", "launch.log"}  # what stays in work/<run>/ after a successful run


# ------------------------------------------------------------------------------ the matrices
# The small LM preset's benchmark shape (9.7M parameters, compute-bound on CPU), shared by the CPU matrices so their
# figures stay comparable with each other.
SMALL_LM = dict(steps=6, warmup=2, batch=16, block=256, vocab=8192, corpus_mb=2, threads=1)


def matrix_preset(name: str) -> dict:
    """The named matrices. Sizes are chosen for their machines (see docs/benchmarks.md)."""
    pipelines = lambda schedule: [f"pipeline-{schedule}-m{m}" for m in (2, 4, 8)]
    if name == "smoke":
        # Tiny model, 2 steps (1 measured): exercises every code path of the runner and compare.py.
        tiny = dict(steps=2, warmup=1, batch=4, block=32, vocab=512, corpus_mb=0.3, threads=1)
        groups = [
            {"name": "lm-tiny-data_parallel", "runs": lm_runs("tiny", ["single", "ddp", "raw_ddp"], **tiny)},
            {"name": "lm-tiny-pipeline", "runs": lm_runs("tiny", ["device_map", "pipeline-gpipe-m2"], **tiny)},
        ]
        # purpose "smoke": every record carries it, and compare.py then judges no target and says once, at the top,
        # that these numbers check the plumbing only (2 steps, 1 measured, of a 0.6M model: start-up dominates).
        return {"name": name, "purpose": "smoke", "repeats": 1, "threads_per_process": 1, "groups": groups}
    if name == "cpu":
        # 2-core CPU machines, 1 thread per process. small: 9.7M parameters, compute-bound on one core
        # (~5 s per step of 16 x 256 tokens); tiny: 0.6M, where start-up and communication dominate.
        small = SMALL_LM
        tiny = dict(small, steps=24, warmup=4)
        groups = [
            {"name": "lm-tiny-data_parallel", "runs": lm_runs("tiny", ["single", "ddp", "raw_ddp"], **tiny)},
            {
                "name": "lm-small-data_parallel",
                "runs": lm_runs("small", ["single", "ddp", "raw_ddp", "fsdp"], **small),
            },
            {
                "name": "lm-small-pipeline-gpipe",
                "runs": lm_runs("small", ["device_map", *pipelines("gpipe")], **small),
            },
            {"name": "lm-small-pipeline-1f1b", "runs": lm_runs("small", ["device_map", *pipelines("1f1b")], **small)},
            # One epoch over the same 640 docstrings each (20 steps of 2 x 16), with and without length grouping.
            {
                "name": "finetune-group_by_length",
                "runs": finetune_runs(["ddp", "ddp+group_by_length"], steps=None, warmup=2, max_train_samples=640),
            },
        ]
        return {"name": name, "repeats": 2, "threads_per_process": 1, "groups": groups}
    if name == "perf":
        # The performance issue's measurements, >= 5 A/B rounds each for intervals: DDP against raw PyTorch and with
        # 16-bit gradient compression (fp16 on CPU: Accelerate allows its bf16 hook on NCCL only); the fine-tune
        # against a plain loop at equal accuracy (3 seeds, whole epochs, evaluated). The pipeline schedules are
        # measured by benchmarks/studies/pipeline_vs_naive.py --num_layers 13: the small preset's 7 blocks cannot be
        # cut into 4 stages of equal cost, which would charge interleaved 1F1B for the split, not the schedule.
        small = SMALL_LM
        groups = [
            {"name": "lm-small-ddp", "runs": lm_runs("small", ["raw_ddp", "ddp", "ddp+fp16hook"], **small)},
            {
                "name": "finetune-equal-accuracy",
                "repeats": 3,
                "runs": finetune_runs(
                    ["ddp+fixed", "ddp", "ddp+group_by_length"],
                    steps=None,
                    warmup=2,
                    evaluate=True,
                    seeds=[42, 43, 44],
                ),
            },
        ]
        return {"name": name, "repeats": 5, "threads_per_process": 1, "groups": groups}
    if name == "overhead":
        # The recipe against raw torchrun + DDP alone, long enough to resolve 2 %: 14 measured steps per run (the perf
        # matrix measures 4), 8 A/B rounds.
        small = {**SMALL_LM, "steps": 16}
        groups = [{"name": "lm-small-ddp-overhead", "runs": lm_runs("small", ["raw_ddp", "ddp"], **small)}]
        return {"name": name, "repeats": 8, "threads_per_process": 1, "groups": groups}
    if name == "llm":
        # LoRA against a full fine-tune and QLoRA against LoRA, 1 and 2 processes, on the small preset (9.7M) that
        # the llm-base group pretrains for 100 steps and keeps (fp32 on CPU: bf16 is emulated there).
        base = "{output_dir}/work/llm-base/base/r0"
        base_run = lm_runs("small", ["single"], **{**SMALL_LM, "steps": 100})[0]
        groups = [
            {"name": "llm-base", "repeats": 1, "runs": [{**base_run, "setup": "base", "keep_outputs": True}]},
            {
                "name": "llm-small-methods",
                "runs": llm_runs(
                    ["full-1p", "lora-1p", "qlora-1p", "full-2p", "lora-2p"], steps=8, warmup=2, base=base
                ),
            },
        ]
        return {"name": name, "repeats": 2, "threads_per_process": 1, "groups": groups}
    if name == "gpu":
        # One GPU: the 350M preset (GPT-3 Medium shape) in bf16, torch.compile (inductor) + SDPA attention,
        # for MFU; the same run uncompiled beside it. 10 warm-up steps absorb compilation.
        big = dict(steps=40, warmup=10, batch=16, block=1024, vocab=8192, corpus_mb=4, threads=None)
        groups = [
            {"name": "lm-350m-single_gpu", "runs": lm_runs("350m", ["single+bf16+compile", "single+bf16"], **big)}
        ]
        return {"name": name, "repeats": 1, "threads_per_process": None, "groups": groups}
    raise SystemExit(
        f"unknown --matrix {name!r}: use smoke, cpu, perf, overhead, llm, gpu or a JSON file (see --dump_matrix)"
    )


def load_matrix(value: str) -> dict:
    path = Path(value)
    if path.suffix == ".json" or path.is_file():
        return json.loads(path.read_text())
    return matrix_preset(value)


def plan_runs(matrix: dict, repeats: int) -> list[dict]:
    """Order the runs: group by group, round by round, all setups of a group within a round (A B A B)."""
    planned = []
    for group in matrix["groups"]:
        for round_index in range(group.get("repeats", repeats)):  # a group may set its own rounds
            for spec in group["runs"]:
                run_id = f"{group['name']}/{spec['setup']}/r{round_index}"
                seed = ["--seed", str(spec["seeds"][round_index % len(spec["seeds"])])] if spec.get("seeds") else []
                planned.append(
                    {
                        **spec,
                        "args": spec["args"] + seed,
                        "group": group["name"],
                        "round": round_index,
                        "run_id": run_id,
                    }
                )
    return planned


# ------------------------------------------------------------------------------ FLOPs and MFU
def flops_per_token(model_config: dict, num_parameters: int, sequence_length: int) -> dict:
    """Training FLOPs per token (lib.flops: 6N + 12 L H S), with the parts the records keep."""
    hidden, layers = model_config["hidden_size"], model_config["num_hidden_layers"]
    return {
        "model/non_embedding_parameters": num_parameters - model_config["vocab_size"] * hidden,
        "flops/per_token": lm_flops_per_token(
            hidden, layers, model_config["vocab_size"], num_parameters, sequence_length
        ),
        "flops/attention_per_token": 12 * layers * hidden * sequence_length,
    }


def add_flops(record: dict, results: dict, run_dir: Path, gpus: list[dict]) -> None:
    """FLOPs per token, achieved FLOP/s and (on CUDA) MFU, for the language-model runs: MFU against the peak of the
    machine's GPU (lib.flops), from the run's tokens/s (the recipes' results.json carry no MFU)."""
    if record["recipe"] not in LM_RECIPES or not results.get("perf/tokens_per_sec"):
        return
    model_config = results.get("config", {}).get("model_config") or {}
    saved = run_dir / "config.json"  # save_pretrained's full config (the results hold only non-default keys)
    if saved.is_file():
        model_config = {**model_config, **json.loads(saved.read_text())}
    if not all(key in model_config for key in ("hidden_size", "num_hidden_layers", "vocab_size")):
        return
    record.update(flops_per_token(model_config, results["model/num_parameters"], record["sequence_length"]))
    achieved = results["perf/tokens_per_sec"] * record["flops/per_token"]
    record["perf/achieved_tflops"] = achieved / 1e12
    on_cuda = str(results.get("device", "")).startswith("cuda")
    peak = gpus[0]["peak_bf16_flops"] if gpus else None
    if on_cuda and peak:
        # GPUs the run computes on: one per process, or the GPUs of a device_map split (not its CPU part).
        split = [device for device in results.get("device_map_devices") or [] if device.startswith("cuda")]
        used = max(record["processes"], len(split))
        record["perf/peak_flops_per_device"] = peak
        record["perf/mfu"] = achieved / (peak * used)


# ------------------------------------------------------------------------------ model-state bytes
def model_state(run_dir: Path) -> dict | None:
    """Bytes of parameters, gradients and optimizer state per rank (``{"rank0": {...}, ...}``), as the recipe's
    processes held them at the end: written beside results.json by benchmarks/with_model_state.py, which every recipe
    launch goes through (None for the raw baseline)."""
    files = sorted(
        run_dir.glob("model_state_rank*.json"), key=lambda path: int(path.stem.removeprefix("model_state_rank"))
    )
    return {path.stem.removeprefix("model_state_"): json.loads(path.read_text()) for path in files} or None


# ------------------------------------------------------------------------------ one run
def spec_hash(spec: dict) -> str:
    """Identifies what a run does (its command without paths), to tell a finished run from a changed one."""
    key = json.dumps(
        {
            k: spec.get(k)
            for k in ("recipe", "setup", "size", "launcher", "config", "script", "args", "processes")
            + (("launch_args",) if spec.get("launch_args") else ())
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def kill_run(marker: str) -> None:
    """Kill every process of a run: torchrun starts workers in sessions of their own, so the launcher's
    process group is not enough; each process carries the run's marker in its environment."""
    for process in psutil.process_iter():
        try:
            if process.environ().get(RUN_MARKER) == marker:
                process.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def execute(
    spec: dict, output_dir: Path, threads: int | None, timeout: float, measure_foreign: bool, context: dict
) -> dict:
    """Launch one run, wait for it (killing it at ``timeout``), and return its record."""
    run_dir = output_dir / "work" / spec["run_id"]
    record = {
        "schema": SCHEMA,
        "run_id": spec["run_id"],
        "group": spec["group"],
        "round": spec["round"],
        "setup": spec["setup"],
        "recipe": spec["recipe"],
        "size": spec["size"],
        "spec_hash": spec_hash(spec),
        "launcher": "torchrun"
        if spec["launcher"] == "torchrun"
        else f"accelerate launch --config_file accelerate_configs/{spec['config']}",
        "config_file": None if spec["launcher"] == "torchrun" else f"accelerate_configs/{spec['config']}",
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **context,
    }
    if spec["launcher"] != "torchrun" and not (CONFIGS / spec["config"]).is_file():
        return {**record, "status": "skipped", "reason": f"accelerate_configs/{spec['config']} does not exist (yet)"}
    if run_dir.exists():
        shutil.rmtree(run_dir)  # never read a results.json left by an earlier attempt
    run_dir.mkdir(parents=True)
    command = command_for(spec, run_dir)
    record["command"] = " ".join(command).replace(str(REPO) + "/", "").replace(sys.executable, "python")
    marker = uuid.uuid4().hex
    env = {**os.environ, RUN_MARKER: marker, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("HF_HUB_OFFLINE", "1")  # the default model and data are local: never wait on the network
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    log_path = run_dir / "launch.log"
    busy_before, own_before = busy_cpu_seconds(), own_cpu_seconds()
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, None
        finally:
            kill_run(marker)  # also reaps workers a crashed launcher left behind
            process.wait()
    record["wall_s"] = round(time.perf_counter() - started, 1)
    if measure_foreign and busy_before is not None:
        # CPU time other processes used meanwhile, as a share of all cores (lib.machine: the studies' check too).
        foreign = (busy_cpu_seconds() - busy_before) - (own_cpu_seconds() - own_before)
        record["foreign_cpu_share"] = round(max(0.0, foreign) / (record["wall_s"] * os.cpu_count()), 4)
    tail = log_path.read_text(errors="replace")[-3000:]
    results_path = run_dir / "results.json"
    if timed_out or returncode != 0 or not results_path.is_file():
        why = (
            f"timed out after {timeout:.0f} s"
            if timed_out
            else f"exit code {returncode}"
            if returncode
            else "no results.json"
        )
        return {**record, "status": "failed", "reason": why, "error_tail": tail}
    results = json.loads(results_path.read_text())
    record.update(summarize(results, threads))
    record["memory/model_state_bytes"] = model_state(run_dir)
    add_flops(record, results, run_dir, context["machine"]["gpus"])
    for path in run_dir.iterdir():
        # Keep the numbers and the log, not the trained weights (hundreds of MB per run at 350M) or tokenizers.
        if (
            path.is_file()
            and path.name not in KEEP_FILES
            and not path.name.startswith("stage_timers")
            and not spec.get("keep_outputs")
        ):
            path.unlink()
    return {**record, "status": "ok", "results_file": str(results_path.relative_to(output_dir))}


def write_record(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: an interrupted runner never leaves half a record


def record_path(output_dir: Path, run_id: str) -> Path:
    return output_dir / "runs" / (run_id.replace("/", "__") + ".json")


def is_done(path: Path, spec: dict) -> bool:
    if not path.is_file():
        return False
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    # Skipped runs are looked at again: their config file may exist by now.
    return record.get("status") == "ok" and record.get("spec_hash") == spec_hash(spec)


# ------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--matrix",
        default="cpu",
        help="A preset (smoke, cpu, perf, overhead, llm, gpu) or a JSON file in the --dump_matrix format.",
    )
    parser.add_argument(
        "--output_dir",
        help="Where runs/*.json, work/ (each run's output), summary.md and plots/ go. "
        "Run again with the same folder to resume.",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="Rounds per group, A B A B (default: the matrix's own, 2 for cpu)."
    )
    parser.add_argument(
        "--groups", nargs="+", default=None, help="Run only the groups whose name contains one of these strings."
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="Seconds one run may take before it is killed and recorded as failed.",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="Runs launched at once. Anything but 1 makes runs compete for the cores: for smoke tests only, never "
        "for numbers.",
    )
    parser.add_argument(
        "--threads_per_process",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of every run (default: the matrix's, 1 for CPU matrices; recipes with "
        "--cpu_threads_per_process get it from the matrix).",
    )
    parser.add_argument(
        "--dump_matrix",
        action="store_true",
        help="Print the matrix as JSON and exit (edit it, pass it back with --matrix).",
    )
    parser.add_argument("--no_compare", action="store_true", help="Do not write summary.md and plots at the end.")
    args = parser.parse_args(argv)
    if not args.dump_matrix and not args.output_dir:
        parser.error("--output_dir is required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    matrix = load_matrix(args.matrix)
    if args.groups:
        matrix["groups"] = [group for group in matrix["groups"] if any(part in group["name"] for part in args.groups)]
    if args.dump_matrix:
        print(json.dumps(matrix, indent=2))
        return 0
    repeats = args.repeats or matrix.get("repeats", 1)
    threads = args.threads_per_process if args.threads_per_process is not None else matrix.get("threads_per_process")
    output_dir = Path(args.output_dir).resolve()
    (output_dir / "runs").mkdir(parents=True, exist_ok=True)
    planned = plan_runs(matrix, repeats)
    context = {
        "machine": machine_info(),
        "versions": library_versions(),
        "matrix": matrix.get("name", args.matrix),
        "purpose": matrix.get("purpose", "measurement"),
    }
    if context["purpose"] == "smoke":
        print(
            f"Smoke matrix ({len(planned)} runs): it checks the plumbing; its numbers mean nothing about speed or "
            "accuracy."
        )
    (output_dir / "matrix.json").write_text(json.dumps({**matrix, "repeats": repeats}, indent=2) + "\n")

    todo = [spec for spec in planned if not is_done(record_path(output_dir, spec["run_id"]), spec)]
    counts = {"ok": 0, "failed": 0, "skipped": 0, "done before": len(planned) - len(todo)}
    progress = tqdm(
        total=len(planned), initial=counts["done before"], desc="benchmark runs", unit="run", dynamic_ncols=True
    )

    def finish(record: dict) -> None:
        write_record(record_path(output_dir, record["run_id"]), record)
        counts[record["status"]] += 1
        progress.update(1)
        progress.set_postfix_str(f"{record['run_id']}: {record['status']}")
        if record["status"] == "failed":
            progress.write(
                f"FAILED {record['run_id']} ({record['reason']}): "
                + record["error_tail"].strip().splitlines()[-1][:300]
            )

    def run_one(spec: dict) -> dict:
        try:
            return execute(spec, output_dir, threads, args.timeout, args.jobs == 1, context)
        except Exception:  # a bug in reading one run's output must not stop the matrix
            return {
                "schema": SCHEMA,
                "run_id": spec["run_id"],
                "group": spec["group"],
                "round": spec["round"],
                "setup": spec["setup"],
                "recipe": spec["recipe"],
                "size": spec["size"],
                "spec_hash": spec_hash(spec),
                "status": "failed",
                "reason": "runner error",
                "error_tail": traceback.format_exc()[-3000:],
                **context,
            }

    if args.jobs == 1:
        for spec in todo:
            progress.set_description(spec["run_id"])
            finish(run_one(spec))
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in concurrent.futures.as_completed([pool.submit(run_one, spec) for spec in todo]):
                finish(future.result())
    progress.close()
    print(
        f"{len(planned)} runs: {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped, "
        f"{counts['done before']} already done; records in {output_dir / 'runs'}"
    )
    compared = 0
    if not args.no_compare:
        sys.stdout.flush()  # compare.py's report follows this process's own lines
        compare = [sys.executable, str(REPO / "benchmarks" / "compare.py"), str(output_dir / "runs")]
        compared = subprocess.run([*compare, "--output_dir", str(output_dir)], cwd=REPO).returncode
    return 1 if counts["failed"] or compared else 0


if __name__ == "__main__":
    sys.exit(main())
