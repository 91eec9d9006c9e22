"""The prepared GPU check: prove the CUDA paths of every recipe against references computed in the same run.

    python benchmarks/gpu_check.py --dry_run                  # the plan: commands, comparisons, minutes (no GPU)
    python benchmarks/gpu_check.py                            # run it: writes benchmarks/results/<gpu-name>/
    python benchmarks/gpu_check.py --only finetune lm-single  # a subset (names contain one of the words), with the
                                                              # reference runs its comparisons need
    python benchmarks/gpu_check.py --tiny                     # the same script at test sizes in fp32, on any machine
    python benchmarks/gpu_check.py --perf                     # the performance plan instead (~8 minutes, below)

A launch that exits 0 proves nothing, so every check is a comparison with a reference from the same run, and fails
with its numbers when it is off (the tolerances and why are at ``TOLERANCE``):

- the fine-tune in bf16, in fp16 (GradScaler really scaling: its scale from results.json) and split over cuda:0 + the
  CPU against the same fine-tune in fp32 (same data, seed and steps): the logged loss curves;
- the language model (125m, fp32) under FSDP2 in 1 process and split over cuda:0 + the CPU against the same model on
  one GPU: the loss of every step;
- LoRA with --gradient_checkpointing against LoRA without: a lower peak of allocated CUDA memory;
- QLoRA: the base really is 4-bit (bitsandbytes ``Linear4bit`` modules, ``Params4bit`` bytes against a bf16 load), and
  the saved adapter reloaded on the 4-bit base changes the logits as it does on the full-precision base;
- QLoRA under FSDP2 in one process (the layer-by-layer 4-bit loader, FSDP2's bf16 policy over ``Linear4bit``), without
  and with CPU offload, bf16, --gradient_checkpointing, against the one-GPU QLoRA run: the loss of every step;
- QLoRA split over cuda:0 + the CPU: no GPU's peak, loading included, nears the whole 4-bit model;
- the linear toy against the line its data came from; every LM run's peak against the fit planner's estimate;
- two ranks on one GPU over gloo: which of the collectives DDP and FSDP2 need work on CUDA tensors (NCCL refuses two
  ranks on one device, so the recipes' two-process paths need two GPUs; ``TWO_PROCESS_ON_ONE_GPU`` says which).

``--perf`` measures the performance issue's figures instead, each launch alone, judged against ``TARGETS`` (a miss
is reported "below target", not failed): the LM's MFU (350m, bf16, --compile) and --compile against eager; FSDP2 in one
process against the same run without it; the fine-tune's recommended flags against its plain padded loop; the LLM
recipe against TRL's SFTTrainer (``benchmarks/studies/vs_trl.py --preset gpu-1b``: TRL must be carried, see
``run_vs_trl``).

The comparison runs go two or three at a time (they read losses and per-process peaks, not speed); the 350m bf16 speed
check (tokens/s, MFU) runs alone at the end. Every launch goes through ``benchmarks/run.py`` (the records and summary
of the CPU reference results). ``gpu_check.json``: per comparison its verdict, numbers and tolerance; per launch its
status, throughput and peak memory. The exit code is 1 when a launch failed or a comparison is off.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]  # the benchmarks' library (lib/), and shared/
from lib.records import equal_work, unequal_work_text, work_per_step  # the work check of every comparison
from lib.specs import command_for, finetune_runs, lm_runs  # the runner's run specs, and their command lines

# Minutes each launch takes on an H100/H200-class GPU, start-up (imports, data, tokenizer: 30-40 s) included, from
# the previous run's timings (H200: fine-tune 0.026 s/step, LM 350m bf16 8x1024 0.117 s/step, LLM LoRA 0.28 s/step,
# the 125m split over cuda:0 + CPU 7.1 s/step at 4x512 in bf16; fp32 at 4x256 is about a quarter of that work).
MINUTES = {"linear_toy": 0.3, "finetune": 0.7, "lm-ref": 0.6, "lm-device_map": 0.8, "lm-speed": 0.8, "llm": 0.8}
# --perf (not measured yet: estimates): --compile adds the inductor compile of one decoder block, its backward and the
# rest of the model (regional: ~1 min with 16 CPU cores); vs_trl.py at its gpu-1b preset builds and saves a 1.2B
# model once, then runs the recipe and TRL twice each, 20 steps (2 x 2 launches of ~50 s: start-up, ~0.5 s a step).
MINUTES |= {"lm-compile": 1.6, "vs_trl": 3.5}
# The performance issue's targets, judged by the --perf plan. Missing one is a finding ("below target"), not a broken
# code path: it does not fail the check.
TARGETS = {
    "lm-mfu": 0.45,  # single-GPU bf16 MFU of the LM with --compile (nanochat: 48 % on an H100)
    "fsdp-1process": 0.95,  # FSDP2 in one process against the same run without it (tokens/s)
    "finetune-vs-plain": 1.3,  # the fine-tune's recommended flags against its plain padded loop (samples/s)
    "llm-vs-trl": 1.3,  # recipes/llm_finetune.py against TRL's SFTTrainer (tokens/s)
    "llm-vs-trl-loss": 1.02,  # ... at a validation loss no worse than this times TRL's
}
# The steps this script runs itself after the launches (phase "after"), each with its minutes: the QLoRA adapter's
# reload (two loads of the 125m base, four forward passes), the QLoRA split (a 0.2B bf16 Llama built and saved, then
# one launch of 2 steps: start-up, 4-bit loading on the CPU, the move to cuda:0), the two-rank probe (two spawned
# processes importing torch) and the planner (tools/plan.py once per LM run).
AFTER_MINUTES = {"reload": 0.4, "split": 1.0, "probe": 0.2, "planner": 0.2}
PARALLEL_JOBS = 3  # comparison launches at once: start-up is CPU work and the card has room for three small runs
# The comparison shape of the LM: small enough that the split's CPU half takes well under a second per step.
REF_SHAPE = dict(steps=6, warmup=1, batch=4, block=256, vocab=8192, corpus_mb=2, threads=None)  # 125m, fp32
SPEED_SHAPE = dict(steps=30, warmup=10, batch=8, block=1024, vocab=8192, corpus_mb=4, threads=None)  # 350m, bf16
FINETUNE = [
    "--max_train_samples",
    "2048",
    "--max_eval_samples",
    "512",
    "--per_device_train_batch_size",
    "32",
    "--perf_warmup_steps",
    "5",
    "--logging_steps",  # a log line per 5 steps; the curve the comparisons read holds every step's global loss
    "5",
]

# Each tolerance with why. |candidate - reference| <= atol + rtol * |reference| at every point of a loss curve.
TOLERANCE = {
    # bf16 keeps 8 bits of mantissa (0.4 % per rounding); fp16 10 bits, but its loss scale can skip steps. MiniLM also
    # has dropout 0.1, whose masks need not repeat across dtypes, so the curves are two samples of one training: 10 %
    # of the loss (+0.05 for the low end) holds them and still fails a run that diverges, stalls or turns NaN.
    "finetune-precision": dict(rtol=0.10, atol=0.05),
    # The split draws the dropout masks of its CPU layers from the CPU generator: another sample of the same training,
    # in fp32.
    "finetune-device_map": dict(rtol=0.10, atol=0.05),
    # The LM has no dropout and runs in fp32 (no TF32: torch's default for matmuls): only the order of sums differs
    # (CPU vs GPU kernels for the split's CPU half, FSDP2's one-rank reduce-scatter), 1e-6 per op, grown over 6 steps.
    "lm-fp32": dict(rtol=1e-3, atol=1e-4),
    # A checkpointed block keeps only its input for backward; 10 % of the peak is far below what 12 blocks save.
    "gradient-checkpointing-saving": 0.10,
    # QLoRA under FSDP2 in one process against the one-GPU QLoRA run, both bf16: the same NF4 weights and the same
    # bf16 matmuls (FSDP2's policy casts the adapter to bf16 where the one-GPU run's autocast does); gradients are
    # reduced in bf16 (Accelerate's reduce_dtype) and the offloaded run steps AdamW on the CPU: bf16 rounding (0.4 %
    # per rounding) moving 20 steps by ~1 %. A loader that gives FSDP2 other weights, or an adapter that does not
    # train, moves the curve by far more.
    "qlora-fsdp": dict(rtol=0.02, atol=0.02),
    # Params4bit bytes / bf16 bytes of the same weights: NF4 is 4 bits of 16 (0.25); its scales are held apart.
    "4bit-bytes-ratio": 0.30,
    # ||delta_4bit - delta_full|| / ||delta_full||, delta = logits with the adapter - logits without. The adapter's
    # effect passes through NF4 weights downstream (16 levels per 64-weight block): 0.16 of it on the CPU rehearsal's
    # 125m base with the dequantized weights in fp32; bitsandbytes' CPU 4-bit kernel computes at about bf16 precision
    # and brings it to 0.35-0.44 there. An adapter that did not load (delta 0) gives 1.0, another adapter more.
    "adapter-reload": 0.6,
    # --compile against eager, same run otherwise: inductor fuses ops and rounds each fused kernel once (in bf16 here),
    # which moves the loss by ~1e-3 over 30 steps; a compiled graph that computes something else moves it by far more.
    "compile": dict(rtol=0.02, atol=0.01),
    # The planner's estimate of a peak against the measured one (the bar).
    "planner": 0.15,
    # The toy fits y = w.x + b from noisy samples; its test asserts 0.1.
    "linear_toy-weight": 0.1,
}

# The two-process paths that cannot run on one GPU, and why (printed with the plan, written to gpu_check.json).
TWO_PROCESS_ON_ONE_GPU = {
    "lm-ddp, finetune-ddp, llm-*-ddp": "the recipes take NCCL between GPUs, and NCCL refuses two ranks on one device "
    "('Duplicate GPU detected'); the probe shows which collectives gloo takes on cuda:0 tensors instead",
    "lm-fsdp, llm-*-fsdp*": "FSDP2 over NCCL, same refusal; its all_gather_into_tensor/reduce_scatter_tensor over "
    "gloo on cuda:0 are in the probe",
    "lm-pipeline-1f1b-m4": "stage-to-stage send/recv over NCCL between two devices: two ranks on cuda:0 are refused",
    "llm-qlora-device_map, the device_map split over two GPUs": "needs a second CUDA device; one GPU runs the split "
    "over cuda:0 + the CPU instead (lm-device_map, finetune-device_map)",
}


# ------------------------------------------------------------------------------ the plan
def finetune(name: str, setup: str, config: str, *extra: str, steps: int = 40, needs=()) -> dict:
    return {
        "name": name,
        "setup": setup,
        "recipe": "transformer_finetune",
        "size": "minilm-l6",
        "launcher": "accelerate",
        "config": config,
        "script": "recipes/transformer_finetune.py",
        "args": FINETUNE + ["--max_train_steps", str(steps), *extra],
        "minutes": MINUTES["finetune"],
        "needs": list(needs),
    }


def lm(name: str, setup: str, size: str, shape: dict, *extra: str, minutes: float, launch_args=(), needs=()) -> dict:
    """A train_lm/pipeline_lm run spec from the runner's own builder, with this check's extra flags."""
    base = setup.split(":")[0]
    spec = lm_runs(size, [base], **shape)[0]
    return {
        **spec,
        "name": name,
        "setup": setup.split(":")[-1],
        "args": spec["args"] + list(extra),
        "launch_args": list(launch_args),
        "minutes": minutes,
        "needs": list(needs),
    }


def llm(
    name: str, config: str, base: Path, *extra: str, gradient_checkpointing: bool = True, needs=(), launch_args=()
) -> dict:
    """A recipes/llm_finetune.py check on the base model the lm-base check saved (offline: no Hub model here)."""
    args = ["--model_name_or_path", str(base), "--max_train_steps", "20", "--max_length", "512"]
    # --learning_rate 1e-3 (the README's offline line): at the default 2e-4 a few steps on the one-word offline
    # answers leave an adapter whose effect on the logits is near the 4-bit kernel's rounding, and the reload check
    # then compares noise. --exact_match_samples 0: its generations are not what these checks measure.
    args += ["--learning_rate", "1e-3", "--exact_match_samples", "0"]
    args += ["--per_device_train_batch_size", "4", "--perf_warmup_steps", "3", *extra]
    args += ["--gradient_checkpointing"] if gradient_checkpointing else []
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
        "needs": ["lm-base", *needs],
    }


def after(name: str, what: str, minutes: float, needs=()) -> dict:
    """A step this script runs itself once the launches are done (phase "after"), with its own estimate."""
    return {
        "name": name,
        "phase": "after",
        "recipe": None,
        "config": None,
        "script": None,
        "args": [],
        "what": what,
        "minutes": minutes,
        "needs": list(needs),
    }


def checks(gpus: int, tiny: bool, output_dir: Path = Path("benchmarks/results/gpu")) -> list[dict]:
    """The launches for this many GPUs, each with its phase and the launches its comparisons need (``needs``).

    Phases: "compare" (two or three at a time), "llm" (after lm-base, whose model they fine-tune), "alone" (speed).
    ``tiny``: the same launches at test sizes in fp32 (a rehearsal on any machine).
    """
    speed_size, ref_size, speed_shape, ref_shape = "350m", "125m", SPEED_SHAPE, REF_SHAPE
    if tiny:
        # The reference LM stays 125m (at a test shape): it is also the QLoRA base, and bitsandbytes' CPU 4-bit kernel
        # needs every Linear's output size divisible by 32 (the tiny preset's MLP has 176).
        speed_size, speed_shape = "tiny", dict(SPEED_SHAPE, steps=4, warmup=1, block=64, vocab=512, corpus_mb=0.3)
        ref_shape = dict(REF_SHAPE, steps=3, batch=2, block=64, vocab=512, corpus_mb=0.3)
    bf16 = ["--mixed_precision", "bf16"] if not tiny else []
    base_dir = output_dir / "work" / "lm-base" / "base" / "r0"
    compare = [
        finetune("finetune-fp32", "single", "single_gpu.yaml"),
        finetune("finetune-bf16", "single+bf16", "single_gpu.yaml", *bf16, needs=["finetune-fp32"]),
        finetune(
            "finetune-fp16", "single+fp16", "single_gpu.yaml", "--mixed_precision", "fp16", needs=["finetune-fp32"]
        ),
        finetune(
            "finetune-device_map",
            "device_map",
            "model_sharding_2gpu.yaml",
            "--parallelism",
            "device_map",
            needs=["finetune-fp32"],
        ),
        # The LM reference (one GPU, fp32), kept: the LLM checks fine-tune it.
        {**lm("lm-base", "single:base", ref_size, ref_shape, minutes=MINUTES["lm-ref"]), "keep_outputs": True},
        lm(
            "lm-fsdp-1process",
            "fsdp:fsdp-1process",
            ref_size,
            ref_shape,
            minutes=MINUTES["lm-ref"],
            launch_args=("--num_processes", "1"),
            needs=["lm-base"],
        ),
        lm("lm-device_map", "device_map", ref_size, ref_shape, minutes=MINUTES["lm-device_map"], needs=["lm-base"]),
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
            "needs": [],
        },
    ]
    phases = [(compare, "compare")]
    phases.append(
        (
            [
                llm("llm-lora-bf16", "single_gpu.yaml", base_dir, *bf16, needs=["llm-lora-bf16-no_gc"]),
                llm("llm-lora-bf16-no_gc", "single_gpu.yaml", base_dir, *bf16, gradient_checkpointing=False),
                # Kept: the adapter is reloaded on the 4-bit base after the run.
                {**llm("llm-qlora-bf16", "single_gpu.yaml", base_dir, "--load_in_4bit", *bf16), "keep_outputs": True},
                # QLoRA under FSDP2 as each GPU of fsdp_2gpu.yaml / fsdp_offload_2gpu.yaml runs it, in one process:
                # CUDA's 4-bit kernels under FSDP2's bf16 policy, which the CPU tests cannot run.
                *(
                    llm(
                        f"llm-qlora-{setup}-1process",
                        config,
                        base_dir,
                        "--load_in_4bit",
                        *bf16,
                        launch_args=("--num_processes", "1"),
                        needs=["llm-qlora-bf16"],
                    )
                    for setup, config in (("fsdp", "fsdp_2gpu.yaml"), ("fsdp-offload", "fsdp_offload_2gpu.yaml"))
                ),
            ],
            "llm",
        )
    )
    alone = [lm("lm-single", "single:single+bf16", speed_size, speed_shape, *bf16, minutes=MINUTES["lm-speed"])]
    if gpus >= 2 or tiny:
        two = dict(size=speed_size, shape=speed_shape, minutes=MINUTES["lm-speed"])
        alone += [
            lm("lm-ddp", "ddp:ddp+bf16", two["size"], two["shape"], *bf16, minutes=two["minutes"]),
            lm("lm-fsdp", "fsdp:fsdp+bf16", two["size"], two["shape"], *bf16, minutes=two["minutes"]),
            lm(
                "lm-pipeline-1f1b-m4",
                "pipeline-1f1b-m4:pipeline-1f1b-m4+bf16",
                two["size"],
                two["shape"],
                *bf16,
                minutes=two["minutes"],
            ),
            finetune("finetune-ddp", "ddp+bf16", "ddp_2gpu.yaml", *bf16),
        ]
    if gpus >= 2:  # not in a CPU rehearsal unless asked for (--gpus 2): on the 125m base they take half an hour there
        alone += [
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
    phases.append((alone, "alone"))
    ran_after = [
        after(
            "llm-qlora-bf16-reload",
            "llm-qlora-bf16's adapter reloaded on the 4-bit and the bf16 base",
            AFTER_MINUTES["reload"],
            needs=["llm-qlora-bf16"],
        ),
        after(
            "qlora-split",
            "QLoRA split over cuda:0 + the CPU: a weights-dominant base built, then one launch (qlora_split_verdict)",
            AFTER_MINUTES["split"],
        ),
        after("planner-peaks", "tools/plan.py's peak for each LM run", AFTER_MINUTES["planner"]),
    ]
    if gpus < 2:
        ran_after.append(
            after(
                "two-rank-probe",
                "two gloo ranks on one device: the collectives DDP and FSDP2 need",
                AFTER_MINUTES["probe"],
            )
        )
    phases.append((ran_after, "after"))
    plan = [{**check, "phase": phase} for group, phase in phases for check in group]
    if tiny:  # fp16 needs a GPU; on CPU the rehearsal keeps fp32 and test sizes
        plan = [check for check in plan if check["name"] != "finetune-fp16"]
        shrink = {
            "--max_train_samples": "64",
            "--max_eval_samples": "16",
            "--per_device_train_batch_size": "4",
            "--max_train_steps": "4",
            "--max_length": "64",
            "--logging_steps": "2",
        }
        for check in (check for check in plan if check["phase"] != "after"):
            args = [arg for arg in check["args"] if arg not in ("bf16", "--mixed_precision")]
            check["args"] = [
                shrink.get(args[i - 1], arg) if i and check["recipe"] not in ("train_lm", "linear_toy") else arg
                for i, arg in enumerate(args)
            ]
    return plan


def perf_checks(tiny: bool) -> list[dict]:
    """The --perf plan: the performance issue's speed runs, each alone on the GPU. The LM (350m, bf16, 8 x 1,024)
    without and with --compile (MFU), under FSDP2 in one process (against the same run without it); the fine-tune's
    plain padded loop (every text padded to --max_length, random batches: what most examples run) against its
    recommended --group_by_length, both in bf16. The LLM recipe against TRL runs after them (``run_vs_trl``)."""
    size, shape = "350m", SPEED_SHAPE
    bf16 = ["--mixed_precision", "bf16"]
    if tiny:
        size, shape, bf16 = "tiny", dict(SPEED_SHAPE, steps=4, warmup=1, block=64, vocab=512, corpus_mb=0.3), []
    plain = finetune_runs(["single+fixed"], steps=40, warmup=5, max_train_samples=2048)[0]
    fast = finetune_runs(["single+group_by_length"], steps=40, warmup=5, max_train_samples=2048)[0]
    finetunes = [
        {**plain, "name": "finetune-plain", "args": plain["args"] + FINETUNE[4:6] + bf16},  # same precision
        {**fast, "name": "finetune-recommended", "args": fast["args"] + FINETUNE[4:6] + bf16},
    ]
    if tiny:
        finetunes = [
            {
                **run,
                "args": run["args"]
                + [
                    "--max_train_steps",
                    "4",
                    "--perf_warmup_steps",
                    "1",
                    "--max_train_samples",
                    "64",
                    "--max_length",
                    "64",
                ],
            }
            for run in finetunes
        ]
    plan = [
        lm("lm-single", "single:single+bf16", size, shape, *bf16, minutes=MINUTES["lm-speed"]),
        lm(
            "lm-single-compile",
            "single:single+bf16+compile",
            size,
            shape,
            *bf16,
            "--compile",
            minutes=MINUTES["lm-compile"],
        ),
        lm(
            "lm-fsdp-1process-speed",
            "fsdp:fsdp-1process+bf16",
            size,
            shape,
            *bf16,
            launch_args=("--num_processes", "1"),
            minutes=MINUTES["lm-speed"],
        ),
        *({**run, "minutes": MINUTES["finetune"], "needs": []} for run in finetunes),
    ]
    ran_after = [
        after("planner-peaks", "tools/plan.py's peak for each LM run", AFTER_MINUTES["planner"]),
        after(
            "vs_trl",
            "benchmarks/studies/vs_trl.py --preset gpu-1b --repeats 2 --max_train_steps 20 (--tiny: cpu-tiny)",
            MINUTES["vs_trl"],
        ),
    ]
    return [{**check, "phase": "alone"} for check in plan] + [{**step, "phase": "after"} for step in ran_after]


def select(plan: list[dict], words: list[str]) -> list[dict]:
    """The checks whose names contain one of ``words``, with every launch their comparisons need (transitively)."""
    by_name = {check["name"]: check for check in plan}
    wanted = {check["name"] for check in plan if any(word in check["name"] for word in words)}
    todo = list(wanted)
    while todo:
        for need in by_name[todo.pop()]["needs"]:
            if need in by_name and need not in wanted:
                wanted.add(need)
                todo.append(need)
    return [check for check in plan if check["name"] in wanted]


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


# ------------------------------------------------------------------------------ verdicts (pure: tested on fabricated
# records in tests/test_benchmarks.py)
def verdict(name: str, ok: bool, line: str, tolerance, **numbers) -> dict:
    return {"comparison": name, "status": "pass" if ok else "fail", "line": line, "tolerance": tolerance, **numbers}


def skipped(name: str, reason: str) -> dict:
    return {"comparison": name, "status": "skipped", "line": reason, "tolerance": None}


def compare_curves(name: str, candidate: list | None, reference: list | None, rtol: float, atol: float) -> dict:
    """Two loss curves of the same training: equal length, finite, and within atol + rtol * |reference| everywhere."""
    tolerance = {"rtol": rtol, "atol": atol}
    if not candidate or not reference or len(candidate) != len(reference):
        line = f"loss curves of different lengths: {len(candidate or [])} vs reference {len(reference or [])}"
        return verdict(name, False, line, tolerance, candidate=candidate, reference=reference)
    worst, worst_step, excess = 0.0, 0, -math.inf
    for step, (got, want) in enumerate(zip(candidate, reference)):
        diff = abs(got - want) if math.isfinite(got) and math.isfinite(want) else math.inf
        if diff - (atol + rtol * abs(want)) > excess:
            worst, worst_step, excess = diff, step, diff - (atol + rtol * abs(want))
    ok = excess <= 0
    line = (
        f"max |loss - reference| {worst:.3g} at point {worst_step} ({candidate[worst_step]:.5g} vs "
        f"{reference[worst_step]:.5g}); allowed {atol:g} + {rtol:g} x |reference|"
    )
    return verdict(
        name, ok, line, tolerance, max_abs_diff=worst, at=worst_step, candidate=candidate, reference=reference
    )


def compare_grad_scale(name: str, scale: float | None, losses: list | None) -> dict:
    """fp16: GradScaler's scale above 1 (it multiplies the loss before backward) and a finite loss curve."""
    finite = bool(losses) and all(math.isfinite(value) for value in losses)
    ok = scale is not None and scale > 1 and finite
    line = f"GradScaler scale {scale} (must be > 1: None means no scaler, 1.0 a disabled one); losses finite: {finite}"
    return verdict(name, ok, line, "> 1", grad_scale=scale)


def compare_less_memory(name: str, with_gc: float | None, without_gc: float | None, min_saving: float) -> dict:
    """Gradient checkpointing: the peak with it at least ``min_saving`` (a fraction) below the peak without it."""
    if with_gc is None or without_gc is None:
        return verdict(name, False, f"a peak is missing: {with_gc} with, {without_gc} without", min_saving)
    saving = 1 - with_gc / without_gc
    line = f"peak {with_gc:.3f} GiB with checkpointing vs {without_gc:.3f} without: {saving:+.1%} saved"
    return verdict(name, saving >= min_saving, line + f" (need >= {min_saving:.0%})", min_saving, saving=saving)


def compare_planner(name: str, measured: float | None, estimate: float | None, tolerance: float) -> dict:
    """The fit planner's peak against the measured one: within ``tolerance``, else by how much it misses."""
    if not measured or not estimate:
        return verdict(name, False, f"no estimate or measurement: {estimate} vs measured {measured}", tolerance)
    miss = estimate / measured - 1
    line = f"planner {estimate:.3f} GiB vs measured {measured:.3f} GiB: {miss:+.1%} (allowed +-{tolerance:.0%})"
    return verdict(name, abs(miss) <= tolerance, line, tolerance, estimate_gib=estimate, measured_gib=measured)


def compare_at_most(name: str, value: float | None, limit: float, what: str) -> dict:
    ok = value is not None and math.isfinite(value) and value <= limit
    return verdict(name, ok, f"{what} {value} (allowed <= {limit:g})", limit, value=value)


def compare_4bit(name: str, facts: dict, max_ratio: float) -> dict:
    """The 4-bit base: every Linear the bf16 base quantizes is a Linear4bit, and its weights take ~1/4 of the bytes."""
    ratio = facts["params4bit_bytes"] / facts["bf16_bytes_of_same"] if facts["bf16_bytes_of_same"] else None
    ok = facts["linear4bit"] > 0 and facts["linear4bit"] == facts["params4bit"] == facts["quantizable_linear"]
    ok = ok and ratio is not None and ratio <= max_ratio
    line = (
        f"{facts['linear4bit']} Linear4bit modules, {facts['params4bit']} Params4bit weights of "
        f"{facts['quantizable_linear']} quantizable Linear layers; weight bytes {ratio} of bf16 "
        f"(allowed <= {max_ratio})"
    )
    return verdict(name, ok, line, max_ratio, bytes_ratio=ratio, **facts)


# ------------------------------------------------------------------------------ measurements in this process
def planner_estimate(record: dict, results: dict) -> dict | None:
    """The fit planner's peak for the device a check's peak is read on (``tools/plan.py --json``), in GiB.

    Like for like: the planner gets the run's vocabulary; FSDP2 in one process holds the whole model (the planner's
    "single"); the split over cuda:0 + CPU is compared on cuda:0 with the planner's first GPU of a two-GPU split.
    """
    setup, processes = record.get("parallelism"), max(1, record["processes"])
    per_device = record["global_batch_size"] // (processes if setup in ("ddp", "fsdp") else 1)
    micro = per_device // record["num_microbatches"] if setup == "pipeline" else per_device
    planned = "single" if processes == 1 and setup in ("ddp", "fsdp") else setup
    gpus = 1 if planned == "single" else max(2, processes)
    command = [sys.executable, str(REPO / "tools" / "plan.py"), "--model_size", record["size"], "--gpus", str(gpus)]
    command += ["--gpu_memory_gib", "80", "--seq_len", str(record["sequence_length"]), "--micro_batch", str(micro)]
    command += ["--mixed_precision", record.get("mixed_precision") or "no", "--json"]
    command += ["--vocab_size", str(results["config"]["vocab_size"])] if results["config"].get("vocab_size") else []
    if setup == "pipeline":
        command += ["--num_microbatches", str(record["num_microbatches"])]
        command += ["--pipeline_schedule", record["pipeline_schedule"]]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    estimate = json.loads(done.stdout)["setups"].get(planned)
    if estimate is None:
        return None
    peak = estimate["devices"][0]["total"] if planned == "device_map" else estimate.get("peak")
    peak = peak or max(device["total"] for device in estimate["devices"])
    return {"setup": planned, "gpus": gpus, "peak_gib": round(peak / 2**30, 3)}


def qlora_facts(base_dir: Path, adapter_dir: Path) -> dict:
    """Load the base as the recipe's --load_in_4bit does, count what bitsandbytes made of it, and reload the adapter.

    The adapter reference: its effect on the logits of a fixed probe (logits with it - without it) on the 4-bit base
    against the same on the full-precision base. The 4-bit model computes in fp32 here, so the difference left is the
    NF4 rounding of the layers the effect passes through, not bf16 noise.
    """
    import bitsandbytes as bnb
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    device = "cuda:0" if torch.cuda.is_available() else "cpu"

    def load_4bit(dtype):
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
        )
        return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config, device_map={"": device})

    facts = {"device": device}
    quantized = load_4bit(torch.bfloat16)  # as the recipe loads it on a GPU in bf16
    bf16 = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    names_4bit = {name for name, module in quantized.named_modules() if isinstance(module, bnb.nn.Linear4bit)}
    params_4bit = [param for param in quantized.parameters() if isinstance(param, bnb.nn.Params4bit)]
    # bitsandbytes leaves the output layer (lm_head) in 16 bits: every other Linear must be 4-bit.
    quantizable = {
        name for name, module in bf16.named_modules() if isinstance(module, torch.nn.Linear) and name != "lm_head"
    }
    facts.update(
        linear4bit=len(names_4bit & quantizable), params4bit=len(params_4bit), quantizable_linear=len(quantizable)
    )
    facts["params4bit_bytes"] = sum(param.numel() * param.element_size() for param in params_4bit)
    facts["bf16_bytes_of_same"] = sum(
        module.weight.numel() * module.weight.element_size()
        for name, module in bf16.named_modules()
        if name in names_4bit
    )
    del quantized, bf16

    probe = torch.arange(64).remainder(200).add(3).unsqueeze(0)  # fixed token ids inside any vocabulary here
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(device)
        full_base = full(probe.to(device)).logits.float()
        full_adapted = PeftModel.from_pretrained(full, adapter_dir)(probe.to(device)).logits.float()
        del full
        four = load_4bit(torch.float32)
        four_base = four(probe.to(device)).logits.float()
        four_adapted = PeftModel.from_pretrained(four, adapter_dir)(probe.to(device)).logits.float()
    delta_full, delta_4bit = full_adapted - full_base, four_adapted - four_base
    facts["adapter_effect_norm"] = delta_full.norm().item()
    facts["adapter_effect_4bit_norm"] = delta_4bit.norm().item()
    facts["adapter_relative_error"] = ((delta_4bit - delta_full).norm() / delta_full.norm().clamp_min(1e-12)).item()
    facts["base_4bit_vs_full_max_abs"] = (four_base - full_base).abs().max().item()
    return facts


def weights_dominant_base(folder: Path) -> int:
    """A Llama whose 4-bit weights outweigh everything else a short QLoRA step holds (8 blocks of hidden 1,024, a
    vocabulary of ~400), saved in bf16 with a tokenizer in ``folder``; returns the count of its quantizable Linear
    weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "recipes"))  # the recipes' kits (llm_kit/, lm_kit/)
    sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: its standard-library questions
    from harness.questions import stdlib_questions
    from lm_kit.data import train_bpe_tokenizer

    questions = stdlib_questions()
    tokenizer = train_bpe_tokenizer((m["content"] for row in questions["train"] for m in row["messages"]), 400)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return sum(
        module.weight.numel()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    )


def qlora_split_verdict(output_dir: Path, cuda: bool) -> dict:
    """QLoRA under the device_map split (one GPU: cuda:0 + the CPU; two: both GPUs): no GPU ever holds the whole
    4-bit model. The recipe quantizes on the CPU and moves each block to its device; loaded onto a GPU first, the
    whole model sat there before the split. Measured: each GPU's peak against the whole model's 4-bit weights, on a
    base whose weights dominate (a rank-1 adapter on q_proj, 2 steps of one sample of up to 64 tokens)."""
    name = "QLoRA split never holds the whole 4-bit model on one GPU"
    if not cuda:
        return skipped(name, "on the CPU both parts of the split are host RAM")
    base = output_dir / "work" / "qlora-split" / "base"
    linear = weights_dominant_base(base)
    out = output_dir / "work" / "qlora-split" / "out"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "model_sharding_2gpu.yaml"),
        str(REPO / "recipes" / "llm_finetune.py"),
        "--model_name_or_path",
        str(base),
        "--load_in_4bit",
        "--lora_r",
        "1",
        "--lora_target_modules",
        "q_proj",
        "--parallelism",
        "device_map",
        "--mixed_precision",
        "bf16",
        "--max_train_steps",
        "2",
        "--max_train_samples",
        "16",
        "--max_length",
        "64",
        "--per_device_train_batch_size",
        "1",
        "--skip_eval",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",  # a rerun of the check replaces this run
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return verdict(name, False, f"the launch failed: {(done.stderr or done.stdout).strip()[-400:]}", None)
    results = json.loads((out / "results.json").read_text())
    return split_peaks_verdict(name, results, whole_gib=linear / 2 / 2**30)  # NF4: half a byte per weight


def split_peaks_verdict(name: str, results: dict, whole_gib: float, limit: float = 0.75) -> dict:
    """Each GPU's peak over the whole run against ``limit`` x the whole 4-bit model: the larger of its peak while
    loading and preparing (``memory/load_peak_gib``, taken before the counter restarts for training) and its training
    peak (``memory/peak_gib``). The training peak alone never sees a model that sat whole on one GPU while loading."""
    loading, training = results.get("memory/load_peak_gib") or {}, results.get("memory/peak_gib") or {}
    peaks = {}
    for device, gib in [*loading.items(), *training.items()]:
        if device.split("/")[-1].startswith("cuda"):  # "cuda:0", or "rank1/cuda:1" in a multi-process record
            peaks[device] = max(gib, peaks.get(device, 0.0))
    ok = (
        bool(peaks)
        and any(d.split("/")[-1].startswith("cuda") for d in loading)
        and max(peaks.values()) <= (limit * whole_gib)
    )
    line = (
        f"peaks {peaks} GiB (loading {loading}, training {training}); the whole 4-bit model is {whole_gib:.4f} "
        f"GiB, allowed <= {limit} of it ({limit * whole_gib:.4f})"
    )
    return verdict(name, ok, line, limit, peaks=peaks, whole_4bit_gib=whole_gib)


# Each collective with its check: rank r contributes a tensor full of (r + 1).
PROBE_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")


def _probe_rank(rank: int, port: int, device: str, out: str) -> None:
    """One rank of the two-rank probe: every collective of PROBE_COLLECTIVES on ``device`` tensors, over gloo."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    found = {}
    for op in PROBE_COLLECTIVES:
        mine = torch.full((4,), float(rank + 1), device=device)
        try:
            if op == "all_reduce":  # DDP's gradient sync
                dist.all_reduce(mine)
                got, want = mine, torch.full((4,), 3.0)
            elif op == "broadcast":  # DDP's parameter sync at wrap time
                dist.broadcast(mine, src=0)
                got, want = mine, torch.full((4,), 1.0)
            elif op == "all_gather_into_tensor":  # FSDP2's unshard before forward/backward
                got = torch.empty(8, device=device)
                dist.all_gather_into_tensor(got, mine)
                want = torch.tensor([1.0] * 4 + [2.0] * 4)
            else:  # FSDP2's gradient reduce-scatter
                got = torch.empty(4, device=device)
                dist.reduce_scatter_tensor(got, torch.cat([mine, mine]))
                want = torch.full((4,), 3.0)
            right = torch.equal(got.cpu(), want) and got.device.type == torch.device(device).type
            found[op] = "ok" if right else f"wrong result {got.cpu().tolist()}"
        except Exception as error:  # the finding: this backend does not take it on this device
            found[op] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        # After every collective: if a later one hangs, what worked before it is still reported.
        Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def two_rank_probe(device: str, timeout: float = 120) -> dict:
    """Two processes on one device (cuda:0, or the CPU in a rehearsal) over gloo: which collectives work there."""
    import torch.multiprocessing as mp

    with socket.socket() as free:  # a free port for the rendezvous
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_probe_rank, args=(port, device, out), nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            # join() returns when any rank ends: wait for both, and no longer than the deadline (a hung collective).
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks did not finish in {timeout:.0f} s (a collective hung)")
        except Exception as error:  # a rank died or hung: the finding is that this setup does not run
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            done = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]
            why = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"
            return {"device": device, "error": why, "before_it": done}
        ranks = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(2)]
    return {
        "device": device,
        "backend": "gloo",
        **{
            op: ranks[0][op] if ranks[0][op] == ranks[1][op] else [ranks[0][op], ranks[1][op]]
            for op in PROBE_COLLECTIVES
        },
    }


# ------------------------------------------------------------------------------ the comparisons of one run
def peak_on(record: dict, device: str) -> float | None:
    """The peak on ``device`` (e.g. cuda:0) of a record's per-device peaks."""
    return (record.get("memory/peak_gib") or {}).get(device)


def judge(plan: list[dict], records: dict, output_dir: Path, cuda: bool) -> list[dict]:
    """Every comparison whose launches are in the plan, from their records and results.json files."""
    names = {check["name"] for check in plan}

    def results(name: str) -> dict | None:
        record = records.get(name, {})
        if record.get("status") != "ok":
            return None
        return json.loads((output_dir / record["results_file"]).read_text())

    def curves(name: str, candidate: str, reference: str, tolerance: dict) -> dict:
        got, want = results(candidate), results(reference)
        if got is None or want is None:
            missing = candidate if got is None else reference
            return verdict(name, False, f"{missing} did not finish: nothing to compare", tolerance)
        return compare_curves(name, got.get("train/loss_curve"), want.get("train/loss_curve"), **tolerance)

    verdicts = []
    if {"finetune-bf16", "finetune-fp32"} <= names:
        verdicts.append(
            curves("finetune bf16 = fp32", "finetune-bf16", "finetune-fp32", TOLERANCE["finetune-precision"])
        )
    if {"finetune-fp16", "finetune-fp32"} <= names:
        verdicts.append(
            curves("finetune fp16 = fp32", "finetune-fp16", "finetune-fp32", TOLERANCE["finetune-precision"])
        )
        fp16 = results("finetune-fp16") or {}
        verdicts.append(
            compare_grad_scale("fp16 GradScaler scales", fp16.get("train/grad_scale"), fp16.get("train/loss_curve"))
        )
    elif not cuda and "finetune-bf16" in names:
        verdicts.append(skipped("finetune fp16 = fp32", "fp16 with GradScaler needs CUDA: not in the CPU rehearsal"))
    if {"finetune-device_map", "finetune-fp32"} <= names:
        verdicts.append(
            curves(
                "finetune device_map = single",
                "finetune-device_map",
                "finetune-fp32",
                TOLERANCE["finetune-device_map"],
            )
        )
    for candidate, what in (("lm-fsdp-1process", "FSDP2 in 1 process"), ("lm-device_map", "device_map split")):
        if {candidate, "lm-base"} <= names:
            verdicts.append(curves(f"lm {what} = single", candidate, "lm-base", TOLERANCE["lm-fp32"]))
    if {"llm-lora-bf16", "llm-lora-bf16-no_gc"} <= names:
        name = "gradient checkpointing saves memory"
        if not cuda:
            verdicts.append(skipped(name, "CPU peaks are the process's RSS, where test-size activations are noise"))
        else:
            with_gc, without_gc = (
                peak_on(records.get(n, {}), "cuda:0") for n in ("llm-lora-bf16", "llm-lora-bf16-no_gc")
            )
            verdicts.append(compare_less_memory(name, with_gc, without_gc, TOLERANCE["gradient-checkpointing-saving"]))
    if "llm-qlora-bf16-reload" in names:
        verdicts += qlora_verdicts(records, output_dir)
    for candidate, what in (
        ("llm-qlora-fsdp-1process", "FSDP2"),
        ("llm-qlora-fsdp-offload-1process", "FSDP2 + CPU offload"),
    ):
        if {candidate, "llm-qlora-bf16"} <= names:
            name = f"QLoRA under {what} in 1 process = one-GPU QLoRA"
            verdicts.append(curves(name, candidate, "llm-qlora-bf16", TOLERANCE["qlora-fsdp"]))
    if "linear_toy" in names:
        toy = results("linear_toy") or {}
        error = toy.get("eval/max_abs_weight_error")
        verdicts.append(
            compare_at_most("linear_toy = its true line", error, TOLERANCE["linear_toy-weight"], "max |w - w_true|")
        )
    for check in plan if "planner-peaks" in names else []:
        record = records.get(check["name"], {})
        if check["recipe"] not in ("train_lm", "pipeline_lm") or record.get("status") != "ok":
            continue
        name = f"planner peak {check['name']}"
        if not cuda:
            verdicts.append(skipped(name, "the planner estimates CUDA tensors; a CPU peak is the process's RSS"))
            continue
        estimate = planner_estimate(record, results(check["name"])) or {}
        measured = peak_on(record, "cuda:0") or max((record.get("memory/peak_gib") or {0: None}).values())
        verdicts.append(
            {**compare_planner(name, measured, estimate.get("peak_gib"), TOLERANCE["planner"]), "plan": estimate}
        )
    return verdicts


def target(name: str, value: float | None, floor: float, line: str, **numbers) -> dict:
    """A performance target: "pass" at or above ``floor``, else "below target" (reported; not a failed check)."""
    ok = value is not None and math.isfinite(value) and value >= floor
    status = "pass" if ok else "below target" if value is not None else "fail"
    return {"comparison": name, "status": status, "line": line, "tolerance": floor, "value": value, **numbers}


def speed_ratio(name: str, candidate: dict | None, reference: dict | None, key: str, floor: float) -> dict:
    """candidate / reference of a throughput ``key`` (higher is better), with the spread of their step times: the
    ratio of the p90 step times (of RunRecord's windows of 10 steps) beside the median's (one run each: no rounds to
    bootstrap here). Runs of unequal work per optimizer step are not compared (a failed check: the plan's runs were
    meant to do the same work)."""
    if not candidate or not reference or not candidate.get(key) or not reference.get(key):
        return target(name, None, floor, f"a run is missing or has no {key}")
    work = equal_work({"candidate": work_per_step(candidate), "reference": work_per_step(reference)})
    if work["equal"] is False:
        return target(
            name, None, floor, f"not judged: unequal work per step ({unequal_work_text(work)})", equal_work=work
        )
    ratio = candidate[key] / reference[key]
    p90 = reference.get("perf/step_time_p90_s"), candidate.get("perf/step_time_p90_s")
    spread = p90[0] / p90[1] if all(p90) else None
    line = f"{ratio:.3f}x {key} ({candidate[key]:.4g} vs {reference[key]:.4g})"
    line += f"; the p90 of the step-time windows gives {spread:.3f}x" if spread else ""
    return target(name, ratio, floor, line + f" (target >= {floor}x)", p90_ratio=spread, equal_work=work)


def judge_perf(records: dict, output_dir: Path, cuda: bool, vs_trl: dict | None) -> list[dict]:
    """The --perf plan's verdicts against ``TARGETS``: MFU, FSDP2 in one process, the fine-tune against its plain
    loop, the LLM recipe against TRL (``vs_trl``: vs_trl.py's JSON, ``{"error": ...}``, or None when it was left out).
    A comparison whose runs ``--only`` left out is skipped, not failed."""

    def results(name: str) -> dict | None:
        record = records.get(name, {})
        return json.loads((output_dir / record["results_file"]).read_text()) if record.get("status") == "ok" else None

    def planned(row: dict, *runs: str) -> dict:
        missing = [run for run in runs if run not in records]
        return skipped(row["comparison"], f"not in this plan (--only): {', '.join(missing)}") if missing else row

    compiled, eager = results("lm-single-compile"), results("lm-single")
    mfu = records.get("lm-single-compile", {}).get("perf/mfu")  # the runner's, against this GPU's peak
    verdicts = []
    if cuda:
        line = f"MFU {mfu if mfu is None else f'{mfu:.1%}'} (350m, bf16, 8 x 1,024, --compile; eager: "
        line += f"{records.get('lm-single', {}).get('perf/mfu') or 0:.1%}); target >= {TARGETS['lm-mfu']:.0%}"
        verdicts.append(planned(target("LM MFU, one GPU", mfu, TARGETS["lm-mfu"], line), "lm-single-compile"))
    else:
        verdicts.append(skipped("LM MFU, one GPU", "MFU needs a GPU's peak FLOP/s"))
    pair = ("lm-single-compile", "lm-single")
    verdicts.append(planned(speed_ratio("LM --compile / eager", compiled, eager, "perf/tokens_per_sec", 1.0), *pair))
    if compiled and eager:  # the same training: inductor's fused kernels round differently, nothing more
        verdicts.append(
            compare_curves(
                "LM --compile = eager",
                compiled.get("train/loss_curve"),
                eager.get("train/loss_curve"),
                **TOLERANCE["compile"],
            )
        )
    fsdp = speed_ratio(
        "LM FSDP2 in 1 process / single",
        results("lm-fsdp-1process-speed"),
        eager,
        "perf/tokens_per_sec",
        TARGETS["fsdp-1process"],
    )
    verdicts.append(planned(fsdp, "lm-fsdp-1process-speed", "lm-single"))
    finetune = speed_ratio(
        "fine-tune recommended flags / plain loop",
        results("finetune-recommended"),
        results("finetune-plain"),
        "perf/samples_per_sec",
        TARGETS["finetune-vs-plain"],
    )
    verdicts.append(planned(finetune, "finetune-recommended", "finetune-plain"))
    if vs_trl is None:
        verdicts.append(skipped("LLM recipe / TRL SFTTrainer", "vs_trl.py not in this plan (--only)"))
    elif "error" in vs_trl:
        verdicts.append(skipped("LLM recipe / TRL SFTTrainer", vs_trl["error"]))
    elif vs_trl.get("refused"):  # the two sides did different work per step: a comparison set up wrong
        verdicts.append(target("LLM recipe / TRL SFTTrainer", None, TARGETS["llm-vs-trl"], vs_trl["refused"]))
    else:
        ratios = {row["key"]: row for row in vs_trl["summary"]}
        speed, loss = ratios.get("perf/tokens_per_sec", {}), ratios.get("eval/loss", {})
        ok_loss = loss.get("median") is not None and loss["median"] <= TARGETS["llm-vs-trl-loss"]
        line = (
            f"{speed.get('median') or 0:.3f}x tokens/s [{speed.get('interval')}] at validation loss "
            f"{loss.get('median') or 0:.4f}x TRL's (targets >= {TARGETS['llm-vs-trl']}x, loss <= "
            f"{TARGETS['llm-vs-trl-loss']}x)"
        )
        row = target(
            "LLM recipe / TRL SFTTrainer",
            speed.get("median"),
            TARGETS["llm-vs-trl"],
            line,
            interval=speed.get("interval"),
            loss_ratio=loss.get("median"),
        )
        if row["status"] == "pass" and not ok_loss:  # faster at a worse loss does not count
            row["status"] = "below target"
        verdicts.append(row)
    return verdicts


def run_vs_trl(output_dir: Path, tiny: bool, timeout: float) -> dict:
    """benchmarks/studies/vs_trl.py at its GPU preset (a 1B Llama shape, 2,048-token packed rows, bf16), 2 rounds A B
    A B of 20 steps; at its tests' tiny preset with --tiny. TRL is not on the GPU machine's image: carry it (bash
    ../shared/device/bundle.sh trl==1.16.0)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return {"error": "TRL is not installed here (bundle it: bash ../shared/device/bundle.sh trl==1.16.0)"}
    out = output_dir / "vs_trl"
    study = REPO / "benchmarks" / "studies" / "vs_trl.py"
    command = [
        sys.executable,
        str(study),
        "--output_dir",
        str(out),
        "--repeats",
        "2",
        "--breakdown_repeats",
        "0",
        "--work_dir",
        str(output_dir / "work" / "vs_trl"),
    ]
    command += (
        ["--preset", "cpu-tiny", "--max_train_steps", "4", "--perf_warmup_steps", "1"]
        if tiny
        else ["--preset", "gpu-1b", "--max_train_steps", "20"]
    )
    print("  " + " ".join(command).replace(str(REPO) + "/", ""), flush=True)
    try:
        done = subprocess.run(command, cwd=REPO, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"vs_trl.py ran past {timeout:.0f} s"}
    (output_dir / "vs_trl.log").write_text(done.stdout + done.stderr)
    if (out / "vs_trl.json").is_file() and json.loads((out / "vs_trl.json").read_text()).get("refused"):
        return json.loads((out / "vs_trl.json").read_text())  # no verdict: unequal work per step, said why
    if done.returncode != 0 or not (out / "vs_trl.json").is_file():
        return {"error": f"vs_trl.py exited {done.returncode}: {(done.stderr or done.stdout)[-300:]}"}
    return json.loads((out / "vs_trl.json").read_text())


def qlora_verdicts(records: dict, output_dir: Path) -> list[dict]:
    names = ("QLoRA base is 4-bit", "QLoRA adapter reloads")
    record = records.get("llm-qlora-bf16", {})
    if record.get("status") != "ok" or records.get("lm-base", {}).get("status") != "ok":
        return [verdict(name, False, "llm-qlora-bf16 or lm-base did not finish", None) for name in names]
    try:
        facts = qlora_facts(output_dir / "work" / "lm-base" / "base" / "r0", output_dir / "work" / record["run_id"])
    except Exception as error:  # a verdict, not a crash: the other comparisons still get written
        return [verdict(name, False, f"could not load: {type(error).__name__}: {error}"[:400], None) for name in names]
    return [
        compare_4bit(names[0], facts, TOLERANCE["4bit-bytes-ratio"]),
        compare_at_most(
            names[1],
            facts["adapter_relative_error"],
            TOLERANCE["adapter-reload"],
            f"||effect on 4-bit - on full base|| / ||on full base|| (effect norm {facts['adapter_effect_norm']:.4g})",
        ),
    ]


# ------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir", default=None, help="Where the results go (default: benchmarks/results/<gpu-name>)."
    )
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="Print the plan (commands, comparisons, estimated minutes) and exit 0; no GPU needed.",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="Run only the checks whose names contain one of these words, and the launches their comparisons need.",
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="Plan for this many GPUs (default: the ones nvidia-smi lists)."
    )
    parser.add_argument(
        "--perf",
        action="store_true",
        help="The performance plan instead (perf_checks and vs_trl.py, each alone): MFU, FSDP2 in 1 process, the "
        "fine-tune against its plain loop, the LLM recipe against TRL; judged against TARGETS.",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="The same launches at test sizes in fp32: a rehearsal of the script itself, also on a CPU-only machine.",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="Seconds one launch may take before it is recorded as failed (default 240; --tiny: 900, for QLoRA's slow "
        "CPU kernels on a busy machine).",
    )
    return parser.parse_args(argv)


def estimated_minutes(plan: list[dict], jobs: int) -> float:
    """The plan's wall time, from its own entries only (every launch and every step this script runs carries its
    minutes): a parallel phase takes its launches' minutes / jobs, plus a quarter for contention (the start-ups share
    the CPU cores, the split's CPU half most), and never less than its longest launch; "alone" and "after" run one at
    a time."""
    total = 0.0
    for phase in ("compare", "llm", "alone", "after"):
        minutes = [check["minutes"] for check in plan if check["phase"] == phase]
        if phase in ("alone", "after"):
            total += sum(minutes)
        elif minutes:
            total += max(max(minutes), 1.25 * sum(minutes) / jobs)
    return total


def run_phases(plan: list[dict], output_dir: Path, timeout: float, jobs: int, name: str) -> int:
    """Each phase through the runner (one matrix file each, one runs/ folder); the summary with the last."""
    status = 0
    phases = [phase for phase in ("compare", "llm", "alone") if any(check["phase"] == phase for check in plan)]
    for phase in phases:
        group = [check for check in plan if check["phase"] == phase]
        matrix = {
            "name": name,
            "repeats": 1,
            "threads_per_process": None,
            "groups": [
                {
                    "name": check["name"],
                    "runs": [{k: v for k, v in check.items() if k not in ("name", "minutes", "needs", "phase")}],
                }
                for check in group
            ],
        }
        path = output_dir / f"gpu_check_matrix_{phase}.json"
        path.write_text(json.dumps(matrix, indent=2) + "\n")
        argv = ["--matrix", str(path), "--output_dir", str(output_dir), "--timeout", str(timeout)]
        argv += ["--jobs", str(jobs if phase != "alone" else 1)] + ([] if phase == phases[-1] else ["--no_compare"])
        sys.stdout.flush()  # the runner's lines follow this script's own
        status |= subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), *argv], cwd=REPO).returncode
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    names = gpu_names()
    gpus = args.gpus if args.gpus is not None else max(1, len(names))
    label = re.sub(r"[^A-Za-z0-9]+", "-", names[0]).strip("-").lower() if names else "no-gpu"
    suffix = ("-perf" if args.perf else "") + ("-tiny" if args.tiny else "")
    output_dir = Path(args.output_dir or REPO / "benchmarks" / "results" / (label + suffix))
    output_dir = output_dir.resolve()
    plan = perf_checks(args.tiny) if args.perf else checks(gpus, args.tiny, output_dir)
    if args.only:
        plan = select(plan, args.only)
    jobs = 1 if args.tiny else PARALLEL_JOBS  # the rehearsal runs on small shared machines: one launch at a time
    steps = sum(check["phase"] == "after" for check in plan)
    print(
        f"GPU check: {gpus} GPU(s) ({', '.join(names) if names else 'none found here: the plan for ' + str(gpus)}); "
        f"{len(plan) - steps} launches and {steps} steps of its own, about "
        f"{estimated_minutes(plan, PARALLEL_JOBS):.1f} minutes; results to {output_dir}"
    )
    for check in plan:
        if check["phase"] == "after":
            shown = check["what"]
        else:
            spec = {**check, "run_id": f"{check['name']}/{check['setup']}/r0"}
            command = command_for(spec, output_dir / "work" / spec["run_id"])
            shown = " ".join(command).replace(str(REPO) + "/", "").replace(sys.executable, "python")
        print(f"  {check['name']:<32} ~{check['minutes']:.1f} min  [{check['phase']}]  {shown}")
    print(
        "Comparisons (tolerances in benchmarks/gpu_check.py TOLERANCE): "
        + ", ".join(f"{k} {v}" for k, v in TOLERANCE.items())
    )
    if args.perf:
        print("Targets: " + ", ".join(f"{k} {v}" for k, v in TARGETS.items()))
    elif gpus < 2:
        print("Two-process checks that cannot run on one GPU, and why:")
        for what, why in TWO_PROCESS_ON_ONE_GPU.items():
            print(f"  {what}: {why}")
        print(f"  instead: a 2-rank gloo probe on cuda:0 tensors of {', '.join(PROBE_COLLECTIVES)}")
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
    timeout = args.timeout or (900 if args.tiny else 240)
    status = run_phases(plan, output_dir, timeout, jobs, "gpu_check" + ("-tiny" if args.tiny else ""))
    records = {}
    for path in (output_dir / "runs").glob("*.json"):
        record = json.loads(path.read_text())
        records[record["group"]] = record
    cuda = bool(names) and not args.tiny
    planned = {check["name"] for check in plan}
    launches = []
    for check in (check for check in plan if check["phase"] != "after"):
        record = records.get(check["name"], {})
        launches.append(
            {
                "check": check["name"],
                "status": record.get("status", "missing"),
                "reason": record.get("reason"),
                # Speed only from the launches that ran alone; the others shared the machine.
                "measured_alone": check["phase"] == "alone",
                **{key: record.get(key) for key in ("perf/tokens_per_sec", "perf/samples_per_sec", "perf/mfu")},
                "memory/peak_gib": record.get("memory/peak_gib"),
            }
        )
        mfu = f"MFU {record['perf/mfu']:.1%}" if record.get("perf/mfu") else "MFU -"
        alone = "" if check["phase"] == "alone" else " (shared machine)"
        print(
            f"{launches[-1]['status'].upper():>7} {check['name']:<32} "
            f"tokens/s {record.get('perf/tokens_per_sec') or 0:>10.0f}"
            f"{alone}  {mfu}  peak {record.get('memory/peak_gib')}"
        )
    verdicts = judge(plan, records, output_dir, cuda)  # (in the --perf plan: the planner against each LM peak)
    if args.perf:
        vs_trl = run_vs_trl(output_dir, args.tiny, timeout=2 * timeout) if "vs_trl" in planned else None
        verdicts += judge_perf(records, output_dir, cuda, vs_trl)
    if "qlora-split" in planned:
        verdicts.append(qlora_split_verdict(output_dir, cuda))
    if "two-rank-probe" in planned:
        probe = two_rank_probe("cuda:0" if cuda else "cpu")
        broken = "error" in probe
        line = "; ".join(f"{op} {probe.get(op)}" for op in PROBE_COLLECTIVES) if not broken else probe["error"]
        verdicts.append(
            {
                "comparison": f"two ranks on one {'GPU' if cuda else 'CPU'} over gloo",
                # The probe reports which collectives work; it fails only when it could not run at all.
                "status": "fail" if broken else "info",
                "line": line,
                "tolerance": None,
                "probe": probe,
                "cannot_run_on_one_gpu": TWO_PROCESS_ON_ONE_GPU,
            }
        )
    for row in verdicts:
        print(f"{row['status'].upper():>7} {row['comparison']}: {row['line']}")
    (output_dir / "gpu_check.json").write_text(
        json.dumps({"gpus": names, "tolerances": TOLERANCE, "comparisons": verdicts, "launches": launches}, indent=2)
        + "\n"
    )
    failed = (
        status or any(row["status"] != "ok" for row in launches) or any(row["status"] == "fail" for row in verdicts)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
