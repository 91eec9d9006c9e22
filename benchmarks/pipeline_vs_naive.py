"""Naive device_map split vs pipeline parallelism, measured side by side on one machine.

Trains the same model on the same batches two ways and compares their ``perf/tokens_per_sec`` (warm-up steps
excluded):
- A: ``recipes/train_lm.py --parallelism device_map``, 1 process, the model split over two devices (one works at a
  time);
- B: ``recipes/pipeline_lm.py``, 2 processes, one stage each, for every ``--schedules`` x ``--microbatches``.
Runs alternate A B A B (each B right after its own A, all repeated ``--repeats`` times), so slow
drift of the machine hits both sides of a ratio alike. On a CPU-only machine every process uses one
thread: one core stands in for one GPU. The ideal ratio with p = 2 stages and m micro-batches is
2m / (m + 1): 1.33 at m = 2, 1.60 at m = 4, 1.78 at m = 8.

    python benchmarks/pipeline_vs_naive.py --output_dir outputs/pipeline_vs_naive

Writes ``OUTPUT_DIR/pipeline_vs_naive.json`` (every pair, the medians per configuration, the best m) and prints a
table: the median of the paired ratios, and ("pooled") the median pipeline throughput over the median of all naive
runs, steadier when single runs scatter more than the machine drifts. A shared machine skews such ratios (the pipeline
needs both cores, the naive split one), so every run also records the CPU time *other* processes used meanwhile (from
/proc/stat, minus the runs' own CPU time); a pair where that exceeds ``--max_foreign_share`` of the machine is measured
again (``--retries``) and, if still disturbed, kept but flagged and left out of the medians when clean pairs exist.
Pipeline runs go through ``benchmarks/stage_timers.py``, so the JSON also says where each stage's time goes (compute vs
waiting for the other stage). With the defaults (small preset, batch 16 x 256 tokens, 6 steps, 12 pairs) it takes about
20 minutes on 2 CPU cores; use --repeats 1 or fewer --microbatches for a quicker look. Never part of the test command.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAIVE, PIPELINE = REPO / "recipes" / "train_lm.py", REPO / "recipes" / "pipeline_lm.py"
TIMERS = REPO / "benchmarks" / "stage_timers.py"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where the runs and pipeline_vs_naive.json go.")
    parser.add_argument("--model_size", default="small", help="The recipe's --model_size.")
    parser.add_argument("--block_size", type=int, default=256, help="Tokens per sequence.")
    parser.add_argument(
        "--batch_size", type=int, default=16, help="Sequences per step (split into m micro-batches in pipeline runs)."
    )
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps per run, warm-up included.")
    parser.add_argument("--perf_warmup_steps", type=int, default=2, help="Steps left out of the throughput.")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="Values of m to measure.")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "1f1b"],
        choices=["gpipe", "1f1b"],
        help="Pipeline schedules to measure.",
    )
    parser.add_argument("--repeats", type=int, default=2, help="A B pairs per configuration.")
    parser.add_argument(
        "--corpus_max_mb", type=float, default=2, help="Default-corpus size (the runs only need a few batches)."
    )
    parser.add_argument(
        "--threads_per_process", type=int, default=1, help="CPU threads per process (1: one core per stand-in GPU)."
    )
    parser.add_argument(
        "--max_foreign_share",
        type=float,
        default=0.05,
        help="A run is disturbed if other processes used more than this share of all cores during it.",
    )
    parser.add_argument("--retries", type=int, default=2, help="Times a disturbed pair is measured again.")
    return parser.parse_args(argv)


def busy_cpu_seconds() -> float | None:
    """CPU time all processes on the machine have used (Linux /proc/stat: everything but idle/iowait)."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return None
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time used by this script's finished child processes (the launched runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_recipe(config: str, recipe: Path, out: Path, extra: list[str], args, timers: bool = False) -> dict:
    """One ``accelerate launch`` of a recipe: its results.json, plus the CPU time other processes used meanwhile."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / config),
    ]
    command += [str(TIMERS), str(recipe)] if timers else [str(recipe)]
    command += [
        "--model_size",
        args.model_size,
        "--block_size",
        str(args.block_size),
        "--per_device_train_batch_size",
        str(args.batch_size),
        "--max_train_steps",
        str(args.steps),
        "--perf_warmup_steps",
        str(args.perf_warmup_steps),
        "--corpus_max_mb",
        str(args.corpus_max_mb),
        "--max_eval_samples",
        str(args.batch_size),
        "--sample_tokens",
        "0",
        "--cpu_threads_per_process",
        str(args.threads_per_process),
        "--output_dir",
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_process), "TOKENIZERS_PARALLELISM": "false"}
    busy_before, own_before = busy_cpu_seconds(), own_cpu_seconds()
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(command)}):\n{completed.stdout[-4000:]}")
    results = json.loads((out / "results.json").read_text())
    wall = time.perf_counter() - started
    results["bench/wall_s"] = wall
    if busy_before is not None:
        foreign = (busy_cpu_seconds() - busy_before) - (own_cpu_seconds() - own_before)
        results["bench/foreign_cpu_s"] = foreign
        results["bench/foreign_share"] = max(0.0, foreign) / (wall * os.cpu_count())
    results["bench/stage_timers"] = [
        json.loads(path.read_text()) for path in sorted(out.glob("stage_timers_rank*.json"))
    ]
    return results


def main():
    args = parse_args()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    pairs = []
    for repeat in range(args.repeats):
        for schedule in args.schedules:
            for m in args.microbatches:
                if args.batch_size % m:
                    raise SystemExit(f"--batch_size {args.batch_size} does not divide into {m} micro-batches")
                for attempt in range(args.retries + 1):
                    tag = f"{schedule}_m{m}_r{repeat}" + (f"_retry{attempt}" if attempt else "")
                    naive = run_recipe(
                        "model_sharding_2gpu.yaml",
                        NAIVE,
                        output_dir / f"naive_{tag}",
                        ["--parallelism", "device_map"],
                        args,
                    )
                    pipeline = run_recipe(
                        "pipeline_2gpu.yaml",
                        PIPELINE,
                        output_dir / f"pipeline_{tag}",
                        ["--pipeline_schedule", schedule, "--num_microbatches", str(m)],
                        args,
                        timers=True,
                    )
                    foreign = [run.get("bench/foreign_share", 0.0) for run in (naive, pipeline)]
                    disturbed = max(foreign) > args.max_foreign_share
                    ratio = pipeline["perf/tokens_per_sec"] / naive["perf/tokens_per_sec"]
                    ideal = 2 * m / (m + 1)
                    print(
                        f"{tag}: naive {naive['perf/tokens_per_sec']:.0f} tok/s, pipeline "
                        f"{pipeline['perf/tokens_per_sec']:.0f} tok/s, "
                        f"ratio {ratio:.2f} (ideal {ideal:.2f}, {ratio / ideal:.0%}); other processes used "
                        f"{foreign[0]:.0%} / {foreign[1]:.0%} of the CPUs" + (" -> disturbed" if disturbed else ""),
                        flush=True,
                    )
                    if not disturbed or attempt == args.retries:
                        break
                pairs.append(
                    {
                        "schedule": schedule,
                        "num_microbatches": m,
                        "repeat": repeat,
                        "attempt": attempt,
                        "disturbed": disturbed,
                        "naive/tokens_per_sec": naive["perf/tokens_per_sec"],
                        "pipeline/tokens_per_sec": pipeline["perf/tokens_per_sec"],
                        "naive/step_time_s": naive["perf/step_time_s"],
                        "pipeline/step_time_s": pipeline["perf/step_time_s"],
                        "ratio": ratio,
                        "ideal_ratio": ideal,
                        "efficiency": ratio / ideal,
                        "blocks_per_stage": pipeline["blocks_per_stage"],
                        "stage_cost_share": pipeline["stage_cost_share"],
                        "stage_timers": pipeline["bench/stage_timers"],
                        "foreign_cpu_share": foreign,
                    }
                )

    # Single naive runs scatter by several percent here (shared, virtualised CPUs), more than drift
    # between neighbours, so the report also gives each configuration's median pipeline throughput
    # over the median of *all* undisturbed naive runs (same model and batch in every one of them).
    naive_runs = [pair["naive/tokens_per_sec"] for pair in pairs if not pair["disturbed"]] or [
        pair["naive/tokens_per_sec"] for pair in pairs
    ]
    pooled_naive = statistics.median(naive_runs)
    summary = []
    for schedule in args.schedules:
        for m in args.microbatches:
            measured = [pair for pair in pairs if pair["schedule"] == schedule and pair["num_microbatches"] == m]
            clean = [pair for pair in measured if not pair["disturbed"]] or measured
            ratios = [pair["ratio"] for pair in clean]
            timers = [pair["stage_timers"] for pair in clean]
            per_rank = {}
            for rank in range(len(timers[0])):
                names = timers[0][rank]["seconds_per_step"]
                per_rank[f"rank{rank}"] = {
                    name: statistics.median(t[rank]["seconds_per_step"].get(name, 0.0) for t in timers)
                    for name in names
                }
            summary.append(
                {
                    "schedule": schedule,
                    "num_microbatches": m,
                    "pairs_used": len(clean),
                    "only_disturbed_pairs": all(pair["disturbed"] for pair in clean),
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "ideal_ratio": 2 * m / (m + 1),
                    "efficiency": statistics.median(ratios) / (2 * m / (m + 1)),
                    "ratio_vs_pooled_naive": statistics.median(pair["pipeline/tokens_per_sec"] for pair in clean)
                    / pooled_naive,
                    "stage_seconds_per_step": per_rank,
                }
            )
    best = max(summary, key=lambda row: row["ratio_median"])
    report = {
        "config": vars(args),
        "pairs": pairs,
        "summary": summary,
        "naive/tokens_per_sec": {
            "median": pooled_naive,
            "min": min(naive_runs),
            "max": max(naive_runs),
            "runs": len(naive_runs),
        },
        "best": {
            "schedule": best["schedule"],
            "num_microbatches": best["num_microbatches"],
            "ratio": best["ratio_median"],
        },
    }
    (output_dir / "pipeline_vs_naive.json").write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"\npipeline vs naive device_map split, tokens/s ratio (median of {args.repeats} A/B pairs), "
        f"{args.model_size} model, batch {args.batch_size} x {args.block_size} tokens, {args.threads_per_process} "
        "thread(s) per process"
    )
    print(
        f"naive runs: median {pooled_naive:.0f} tok/s (min {min(naive_runs):.0f}, max {max(naive_runs):.0f}, "
        f"{len(naive_runs)} runs)"
    )
    print(
        f"{'schedule':>8} {'m':>3} {'ratio':>6} {'min':>6} {'max':>6} {'pooled':>6} {'ideal':>6} {'of ideal':>8}   "
        "per-step seconds: compute / waiting, stage 0 | stage 1"
    )
    for row in summary:
        stages = " | ".join(
            f"{times.get('compute', 0):.2f} / {times.get('p2p_wait', 0):.2f}"
            for times in row["stage_seconds_per_step"].values()
        )
        print(
            f"{row['schedule']:>8} {row['num_microbatches']:>3} {row['ratio_median']:>6.2f} {row['ratio_min']:>6.2f} "
            f"{row['ratio_max']:>6.2f} "
            f"{row['ratio_vs_pooled_naive']:>6.2f} {row['ideal_ratio']:>6.2f} {row['efficiency']:>8.0%}   {stages}"
            + ("   (disturbed runs only)" if row["only_disturbed_pairs"] else "")
        )
    print(
        f"best: {best['schedule']} with m = {best['num_microbatches']}: {best['ratio_median']:.2f}x; wrote "
        f"{output_dir / 'pipeline_vs_naive.json'}"
    )


if __name__ == "__main__":
    main()
