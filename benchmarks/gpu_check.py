"""The prepared GPU check: prove and measure the CUDA paths of every recipe, in one short script.

    python benchmarks/gpu_check.py --dry_run                  # the plan: commands and minutes (works without a GPU)
    python benchmarks/gpu_check.py                            # run it: writes benchmarks/results/<gpu-name>/
    python benchmarks/gpu_check.py --only finetune lm-single  # a subset (names contain one of the words)

On one GPU (under 8 minutes on an H100/H200-class card): the fine-tune in bf16 and in fp16 with GradScaler, and split
over cuda:0 + the CPU (a real two-device split on one GPU: it catches device mismatches such as labels on one device
and logits on another); the language model on one GPU (bf16, MFU), under FSDP2 in 1 process (FSDP2's CUDA code path:
mixed precision, DTensor shards, sharded checkpoints) and split over cuda:0 + the CPU; the linear toy. With two or more
GPUs also DDP, FSDP2, the device_map split over two GPUs and the 1F1B pipeline. Two-process checks need two GPUs: NCCL
refuses two ranks on one GPU (the test suite covers those paths with CPU processes).

Every check goes through ``benchmarks/run.py`` (the same launches, records and summary as the CPU reference results,
so ``benchmarks/compare.py benchmarks/results/cpu benchmarks/results/<gpu>`` compares them), and
``gpu_check.json`` adds per check: pass/fail, tokens/s, MFU, peak memory per device and the fit planner's estimate
for it (``tools/plan.py``). The exit code is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import run as runner  # noqa: E402  (the matrix runner: launches, records, summary)

# Minutes each check takes on an H100-class GPU, start-up (imports, data, tokenizer) included: for the plan and the
# budget. The start-up is most of it.
MINUTES = {"linear_toy": 0.3, "finetune": 0.7, "lm": 0.9, "lm-device_map": 1.2, "llm": 0.8}
LM_SIZE = dict(steps=30, warmup=10, batch=8, block=1024, vocab=8192, corpus_mb=4, threads=None)  # 350m, bf16
SPLIT_SIZE = dict(steps=6, warmup=2, batch=4, block=512, vocab=8192, corpus_mb=2, threads=None)  # 125m over GPU + CPU
FINETUNE = [
    "--max_train_samples",
    "2048",
    "--max_eval_samples",
    "512",
    "--per_device_train_batch_size",
    "32",
    "--perf_warmup_steps",
    "5",
]


def finetune(setup: str, config: str, *extra: str, steps: int = 40) -> dict:
    return {
        "setup": setup,
        "recipe": "transformer_finetune",
        "size": "minilm-l6",
        "launcher": "accelerate",
        "config": config,
        "script": "recipes/transformer_finetune.py",
        "args": FINETUNE + ["--max_train_steps", str(steps), *extra],
        "minutes": MINUTES["finetune"],
    }


def lm(setup: str, size: str, shape: dict, *extra: str, launch_args: tuple[str, ...] = ()) -> dict:
    """A train_lm/pipeline_lm run spec from the runner's own builder, with this check's extra flags."""
    base = setup.split(":")[0]
    spec = runner.lm_runs(size, [base], **shape)[0]
    minutes = MINUTES["lm-device_map"] if base == "device_map" else MINUTES["lm"]
    return {
        **spec,
        "setup": setup.split(":")[-1],
        "args": spec["args"] + list(extra),
        "launch_args": list(launch_args),
        "minutes": minutes,
    }


def llm(name: str, config: str, base: Path, *extra: str, launch_args: tuple[str, ...] = ()) -> dict:
    """A recipes/llm_finetune.py check on the base model the lm-base check saved (offline: no Hub model here)."""
    args = [
        "--model_name_or_path",
        str(base),
        "--max_train_steps",
        "20",
        "--max_length",
        "512",
        "--per_device_train_batch_size",
        "4",
        "--gradient_checkpointing",
        "--perf_warmup_steps",
        "3",
        *extra,
    ]
    return {
        "name": name,
        "setup": name.removeprefix("llm-"),
        "recipe": "llm_finetune",
        "size": "125m",
        "launcher": "accelerate",
        "config": config,
        "script": "recipes/llm_finetune.py",
        "args": args,
        "launch_args": list(launch_args),
        "minutes": MINUTES["llm"],
    }


def checks(gpus: int, tiny: bool, output_dir: Path = Path("benchmarks/results/gpu")) -> list[dict]:
    """The plan for this many GPUs. ``tiny``: the same launches at test sizes (a rehearsal on any machine)."""
    big, split, lm_size, split_size = (
        (
            "tiny",
            "tiny",
            dict(LM_SIZE, steps=4, warmup=1, block=64, vocab=512, corpus_mb=0.3),
            dict(SPLIT_SIZE, steps=3, warmup=1, block=64, vocab=512, corpus_mb=0.3),
        )
        if tiny
        else ("350m", "125m", LM_SIZE, SPLIT_SIZE)
    )
    bf16 = ["--mixed_precision", "bf16"] if not tiny else []
    base_dir = output_dir / "work" / "lm-base" / "base" / "r0"
    plan = [
        {"name": "finetune-bf16", **finetune("single+bf16", "single_gpu.yaml", "--mixed_precision", "bf16")},
        {"name": "finetune-fp16", **finetune("single+fp16", "single_gpu.yaml", "--mixed_precision", "fp16")},
        {
            "name": "finetune-device_map",
            **finetune("device_map", "model_sharding_2gpu.yaml", "--parallelism", "device_map", steps=10),
        },
        {"name": "lm-single", **lm("single:single+bf16", big, lm_size, *bf16)},
        {
            "name": "lm-fsdp-1process",
            **lm("fsdp:fsdp-1process+bf16", big, lm_size, *bf16, launch_args=("--num_processes", "1")),
        },
        {"name": "lm-device_map", **lm("device_map", split, split_size, *bf16)},
        # The LLM recipe needs a pretrained causal LM: the lm-base check trains and keeps one (125m, a few steps).
        {
            "name": "lm-base",
            **lm("single:base", "tiny" if tiny else "125m", dict(lm_size, steps=5, warmup=1)),
            "keep_outputs": True,
        },
        llm("llm-lora-bf16", "single_gpu.yaml", base_dir, *bf16),
        llm("llm-qlora-bf16", "single_gpu.yaml", base_dir, "--load_in_4bit", *bf16),
        {
            "name": "linear_toy",
            "setup": "single",
            "recipe": "linear_toy",
            "size": "linear",
            "launcher": "accelerate",
            "config": "single_gpu.yaml",
            "script": "recipes/linear_toy.py",
            "args": ["--max_train_steps", "200"],
            "minutes": MINUTES["linear_toy"],
        },
    ]
    if tiny:  # fp16 needs a GPU; on CPU the rehearsal keeps fp32 and test sizes
        plan = [check for check in plan if check["name"] != "finetune-fp16"]
        shrink = {
            "--max_train_samples": "64",
            "--max_eval_samples": "16",
            "--per_device_train_batch_size": "4",
            "--max_train_steps": "3",
            "--max_length": "64",
        }
        for check in plan:
            args = [arg for arg in check["args"] if arg not in ("bf16", "--mixed_precision")]
            check["args"] = [
                shrink.get(args[i - 1], arg) if i and check["recipe"] != "train_lm" else arg
                for i, arg in enumerate(args)
            ]
    if gpus >= 2 or tiny:
        plan += [
            {"name": "lm-ddp", **lm("ddp:ddp+bf16", big, lm_size, *bf16)},
            {"name": "lm-fsdp", **lm("fsdp:fsdp+bf16", big, lm_size, *bf16)},
            {"name": "lm-pipeline-1f1b-m4", **lm("pipeline-1f1b-m4:pipeline-1f1b-m4+bf16", big, lm_size, *bf16)},
            {"name": "finetune-ddp", **finetune("ddp+bf16", "ddp_2gpu.yaml", *bf16)},
            llm("llm-lora-fsdp", "fsdp_2gpu.yaml", base_dir, *bf16),
            llm("llm-qlora-fsdp-offload", "fsdp_offload_2gpu.yaml", base_dir, "--load_in_4bit", *bf16),
            # The rest of the README's "what fits on two 24 GB cards" launch lines, at this check's size.
            llm("llm-lora-ddp", "ddp_2gpu.yaml", base_dir, *bf16),
            llm("llm-qlora-ddp", "ddp_2gpu.yaml", base_dir, "--load_in_4bit", *bf16),
            llm("llm-qlora-fsdp", "fsdp_2gpu.yaml", base_dir, "--load_in_4bit", *bf16),
            llm(
                "llm-qlora-device_map",
                "model_sharding_2gpu.yaml",
                base_dir,
                "--load_in_4bit",
                "--parallelism",
                "device_map",
                *bf16,
            ),
        ]
    return plan


def gpu_names() -> list[str]:
    """GPU names from nvidia-smi (no torch import here: the runner's machine record has the rest)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def planner_estimate(record: dict, gpu_memory_gib: float) -> dict | None:
    """The fit planner's per-device peak for an LM check's setup, in GiB (``tools/plan.py --json``)."""
    if record.get("recipe") not in ("train_lm", "pipeline_lm") or record.get("status") != "ok":
        return None
    setup, processes = record.get("parallelism"), max(1, record["processes"])
    per_device = record["global_batch_size"] // (processes if setup in ("ddp", "fsdp") else 1)
    micro = per_device // record["num_microbatches"] if setup == "pipeline" else per_device
    command = [
        sys.executable,
        str(REPO / "tools" / "plan.py"),
        "--model_size",
        record["size"],
        "--gpus",
        str(max(2, processes)),
        "--gpu_memory_gib",
        str(gpu_memory_gib),
        "--seq_len",
        str(record["sequence_length"]),
        "--micro_batch",
        str(micro),
        "--mixed_precision",
        record.get("mixed_precision") or "no",
        "--json",
    ]
    if setup == "pipeline":
        command += [
            "--num_microbatches",
            str(record["num_microbatches"]),
            "--pipeline_schedule",
            record["pipeline_schedule"],
        ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    estimate = json.loads(done.stdout)["setups"].get(setup)
    if estimate is None:
        return None
    peak = estimate.get("peak") or max(device["total"] for device in estimate["devices"])
    return {"setup": setup, "peak_gib": round(peak / 2**30, 3)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir", default=None, help="Where the results go (default: benchmarks/results/<gpu-name>)."
    )
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="Print the plan (commands, estimated minutes) and exit 0; no GPU needed.",
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="Run only the checks whose names contain one of these words."
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="Plan for this many GPUs (default: the ones nvidia-smi lists)."
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="The same launches at test sizes in fp32: a rehearsal of the script itself, also on a CPU-only machine.",
    )
    parser.add_argument(
        "--timeout", type=float, default=240, help="Seconds one check may take before it is recorded as failed."
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = gpu_names()
    gpus = args.gpus if args.gpus is not None else max(1, len(names))
    label = re.sub(r"[^A-Za-z0-9]+", "-", names[0]).strip("-").lower() if names else "no-gpu"
    output_dir = Path(args.output_dir or REPO / "benchmarks" / "results" / (label + ("-tiny" if args.tiny else "")))
    plan = checks(gpus, args.tiny, output_dir.resolve())
    if args.only:  # the LLM checks need the base model: --only llm keeps lm-base too
        wanted = set(args.only) | ({"lm-base"} if any("llm" in word for word in args.only) else set())
        plan = [check for check in plan if any(word in check["name"] for word in wanted)]
    total = sum(check["minutes"] for check in plan)
    print(
        f"GPU check: {gpus} GPU(s) ({', '.join(names) if names else 'none found here: the plan for ' + str(gpus)}); "
        f"{len(plan)} checks, about {total:.1f} minutes; results to {output_dir}"
    )
    matrix = {
        "name": "gpu_check" + ("-tiny" if args.tiny else ""),
        "repeats": 1,
        "threads_per_process": None,
        "groups": [
            {
                "name": check["name"],
                "runs": [{key: value for key, value in check.items() if key not in ("name", "minutes")}],
            }
            for check in plan
        ],
    }
    for check, group in zip(plan, matrix["groups"]):
        spec = {**group["runs"][0], "run_id": f"{check['name']}/{check['setup']}/r0"}
        command = runner.command_for(spec, output_dir / "work" / spec["run_id"])
        shown = " ".join(command).replace(str(REPO) + "/", "").replace(sys.executable, "python")
        print(f"  {check['name']:<22} ~{check['minutes']:.1f} min  {shown}")
    if args.dry_run:
        return 0
    if not names and not args.tiny:
        print(
            "error: no GPU found (nvidia-smi lists none). Run with --dry_run to see the plan, or --tiny to rehearse "
            "the script on this machine.",
            file=sys.stderr,
        )
        return 2
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "gpu_check_matrix.json").write_text(json.dumps(matrix, indent=2) + "\n")
    status = runner.main(
        [
            "--matrix",
            str(output_dir / "gpu_check_matrix.json"),
            "--output_dir",
            str(output_dir),
            "--timeout",
            str(args.timeout),
        ]
    )
    records = {
        json.loads(path.read_text())["group"]: json.loads(path.read_text())
        for path in (output_dir / "runs").glob("*.json")
    }
    memory_gib = 80.0  # the planner's per-device estimate does not depend on it (only whether it fits)
    summary = []
    for check in plan:
        record = records.get(check["name"], {})
        row = {
            "check": check["name"],
            "status": record.get("status", "missing"),
            "reason": record.get("reason"),
            "perf/tokens_per_sec": record.get("perf/tokens_per_sec"),
            "perf/samples_per_sec": record.get("perf/samples_per_sec"),
            "perf/mfu": record.get("perf/mfu"),
            "memory/peak_gib": record.get("memory/peak_gib"),
            "plan/estimate": planner_estimate(record, memory_gib),
        }
        summary.append(row)
        mfu = f"MFU {row['perf/mfu']:.1%}" if row["perf/mfu"] else "MFU -"
        print(
            f"{row['status'].upper():>7} {check['name']:<22} tokens/s {row['perf/tokens_per_sec'] or 0:>10.0f}  {mfu} "
            f" peak {row['memory/peak_gib']}  planner {row['plan/estimate']}"
        )
    (output_dir / "gpu_check.json").write_text(json.dumps({"gpus": names, "checks": summary}, indent=2) + "\n")
    return 1 if status or any(row["status"] != "ok" for row in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
