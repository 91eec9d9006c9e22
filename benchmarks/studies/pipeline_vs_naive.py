"""Naive device_map split vs pipeline parallelism, or one pipeline schedule vs another, measured side by side.

Trains the same model on the same batches two ways and compares their ``perf/tokens_per_sec`` (warm-up steps
excluded):
- A, ``--baseline naive`` (default): ``recipes/train_lm.py --parallelism device_map``, 1 process, the model split over
  two devices (one works at a time); ``--baseline 1f1b``: ``recipes/pipeline_lm.py --pipeline_schedule 1f1b`` with the
  same m;
- B: ``recipes/pipeline_lm.py``, 2 processes, for every ``--schedules`` x ``--microbatches`` (interleaved1f1b and zbv
  with 2 stages per process).
Runs alternate A B A B (each B right after its own A, all repeated ``--repeats`` times), so slow
drift of the machine hits both sides of a ratio alike. On a CPU-only machine every process uses one
thread: one core stands in for one GPU.

The ideal ratio comes from the runs' own ``results.json``: a schedule whose ideal bubble is the share f of the step
(``pipeline/ideal_bubble_fraction``) keeps each device busy 1 - f of the time, the naive split 1/p, so the ideal is
(1 - f_B) / (1 - f_A). With p = 2 stages: against the naive split 2m / (m + 1) for GPipe and 1F1B (1.33 at m = 2, 1.60
at m = 4, 1.78 at m = 8); against 1F1B, interleaved with v = 2 gives (m + p - 1) / (m + (p - 1) / v) = 1.11 at
m = 4, 1.06 at m = 8, and zbv (ideally no bubble) (m + p - 1) / m = 1.25 at m = 4, 1.12 at m = 8. These assume
balanced stages; ``split`` (``ideal_ratio_for_split``) also counts the estimated compute each process holds
(``pipeline/process_cost_share``: a pipeline runs as fast as its busiest process). The small preset's 7 blocks + LM
head (~3 blocks) cut into 4 stages leave one process 60 % of the work; ``--num_layers 13`` balances both the 2-stage
(8 | 5 + head) and the 4-stage (4, 4, 4, 1 + head) split.

    python benchmarks/studies/pipeline_vs_naive.py --output_dir outputs/pipeline_vs_naive
    python benchmarks/studies/pipeline_vs_naive.py --output_dir outputs/schedules_vs_1f1b --baseline 1f1b \\
        --schedules interleaved1f1b zbv --microbatches 4 8 --num_layers 13

Writes ``OUTPUT_DIR/pipeline_vs_naive.json`` (every pair, the medians per configuration, the best one) and prints a
table: the median of the paired ratios, and ("pooled") the median B throughput over the median of all A runs,
steadier when single runs scatter more than the machine drifts. A shared machine skews such ratios (the pipeline
needs both cores, the naive split one), so every run also records the CPU time *other* processes used meanwhile (from
/proc/stat, minus the runs' own CPU time); a pair where that exceeds ``--max_foreign_share`` of the machine is measured
again (``--retries``) and, if still disturbed, kept but flagged and left out of the medians when clean pairs exist.
GPipe and 1F1B runs go through ``benchmarks/profile_recipe.py --stage_timers``, so the JSON also says where each
stage's time goes (compute vs waiting for the other stage); it times single-stage schedules only, so interleaved1f1b
and zbv runs have no stage profile. With the defaults (small preset, batch 16 x 256 tokens, 6 steps, 12 pairs) it
takes about 20 minutes on 2 CPU cores; use --repeats 1 or fewer --microbatches for a quicker look. Never part of the
test command.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]  # the benchmarks' library (lib/), and shared/
from lib.launch import accelerate_launch, launch_and_wait
from lib.records import equal_work, unequal_work_text, work_per_step  # the work check of every comparison
from lib.stats import bootstrap_interval  # the 95 % interval of a median ratio, as compare.py's

NAIVE, PIPELINE = REPO / "recipes" / "train_lm.py", REPO / "recipes" / "pipeline_lm.py"
PROFILER = REPO / "benchmarks" / "profile_recipe.py"
SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "zbv"]
# profile_recipe.py --stage_timers wraps the single-stage schedules' step(); the multi-stage ones run untimed.
TIMED_SCHEDULES = ("gpipe", "1f1b")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where the runs and pipeline_vs_naive.json go.")
    parser.add_argument("--model_size", default="small", help="The recipe's --model_size.")
    parser.add_argument(
        "--num_layers",
        type=int,
        default=None,
        help="The recipe's --num_layers (every run): a block count whose split over the stages balances.",
    )
    parser.add_argument("--block_size", type=int, default=256, help="Tokens per sequence.")
    parser.add_argument(
        "--batch_size", type=int, default=16, help="Sequences per step (split into m micro-batches in pipeline runs)."
    )
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps per run, warm-up included.")
    parser.add_argument("--perf_warmup_steps", type=int, default=2, help="Steps left out of the throughput.")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="Values of m to measure.")
    parser.add_argument(
        "--schedules", nargs="+", default=["gpipe", "1f1b"], choices=SCHEDULES, help="Pipeline schedules to measure."
    )
    parser.add_argument(
        "--baseline",
        choices=["naive", "1f1b"],
        default="naive",
        help="A side of each pair: the naive device_map split, or pipeline_lm.py's 1f1b at the same m.",
    )
    parser.add_argument(
        "--stages_per_process",
        type=int,
        default=None,
        help="pipeline_lm.py's --stages_per_process for interleaved1f1b runs (its default: 2).",
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


def run_recipe(config: str, recipe: Path, out: Path, extra: list[str], args, timers: bool = False) -> dict:
    """One ``accelerate launch`` of a recipe (``lib.launch``): its results.json, plus the CPU time other processes
    used meanwhile and, with ``timers``, each stage's seconds per step (``profile_recipe.py --stage_timers``)."""
    command = accelerate_launch(config) + ([str(PROFILER), "--stage_timers"] if timers else []) + [str(recipe)]
    command += [
        "--model_size",
        args.model_size,
        *(["--num_layers", str(args.num_layers)] if args.num_layers else []),
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
        "--overwrite_output_dir",  # a rerun of this benchmark replaces its runs
        *extra,
    ]
    results = launch_and_wait(command, out, threads=args.threads_per_process)
    results["bench/stage_timers"] = [
        json.loads(path.read_text()) for path in sorted(out.glob("stage_timers_rank*.json"))
    ]
    return results


def busy_fraction(results: dict) -> float:
    """Share of each device's step time a run keeps busy, ideally: 1 - the schedule's ideal bubble for a pipeline run,
    1 / stages for the naive split (one device works at a time)."""
    if "pipeline/ideal_bubble_fraction" in results:
        return 1 - results["pipeline/ideal_bubble_fraction"]
    return 1 / results["num_stages"]


def busiest_share(results: dict) -> float:
    """The estimated share of the model's compute on the busiest device of a pipeline run: its step time is about
    m / busy_fraction x this share of one micro-batch through the whole model. The naive split runs the whole model one
    device after the other, which that formula gives with 1 / stages (its own balance does not matter)."""
    if "pipeline/process_cost_share" in results:
        return max(results["pipeline/process_cost_share"])
    return 1 / results["num_stages"]


def run_baseline(args, m: int, out: Path) -> dict:
    """The A side of a pair."""
    if args.baseline == "naive":
        return run_recipe("model_sharding_2gpu.yaml", NAIVE, out, ["--parallelism", "device_map"], args)
    return run_recipe(
        "pipeline_2gpu.yaml",
        PIPELINE,
        out,
        ["--pipeline_schedule", "1f1b", "--num_microbatches", str(m)],
        args,
        timers=True,
    )


def pair_work(baseline: dict, pipeline: dict, baseline_name: str, schedule: str) -> dict:
    """Both runs' real tokens and samples per optimizer step (``lib.records.equal_work``); a pair whose work differs is
    refused: its tokens/s ratio would measure the batches, not the schedules."""
    work = equal_work({baseline_name: work_per_step(baseline), schedule: work_per_step(pipeline)})
    if work["equal"] is False:
        raise SystemExit(
            f"Not judged: {baseline_name} and {schedule} did different work per optimizer step "
            f"({unequal_work_text(work)}), so their tokens/s ratio would not compare the schedules. Both sides get "
            "--batch_size and --block_size from this script: a recipe that changed how it counts a step breaks it."
        )
    return work


def main():
    args = parse_args()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    schedules = [schedule for schedule in args.schedules if schedule != args.baseline]
    if not schedules:
        raise SystemExit(f"--schedules {' '.join(args.schedules)}: nothing to compare with --baseline {args.baseline}")
    pairs = []
    for repeat in range(args.repeats):
        for schedule in schedules:
            for m in args.microbatches:
                if args.batch_size % m:
                    raise SystemExit(f"--batch_size {args.batch_size} does not divide into {m} micro-batches")
                extra = ["--pipeline_schedule", schedule, "--num_microbatches", str(m)]
                if schedule == "interleaved1f1b" and args.stages_per_process:
                    extra += ["--stages_per_process", str(args.stages_per_process)]
                for attempt in range(args.retries + 1):
                    tag = f"{schedule}_m{m}_r{repeat}" + (f"_retry{attempt}" if attempt else "")
                    baseline = run_baseline(args, m, output_dir / f"{args.baseline}_{tag}")
                    pipeline = run_recipe(
                        "pipeline_2gpu.yaml",
                        PIPELINE,
                        output_dir / f"pipeline_{tag}",
                        extra,
                        args,
                        timers=schedule in TIMED_SCHEDULES,
                    )
                    work = pair_work(baseline, pipeline, args.baseline, schedule)
                    foreign = [run.get("bench/foreign_share", 0.0) for run in (baseline, pipeline)]
                    disturbed = max(foreign) > args.max_foreign_share
                    ratio = pipeline["perf/tokens_per_sec"] / baseline["perf/tokens_per_sec"]
                    ideal = busy_fraction(pipeline) / busy_fraction(baseline)
                    # Step time ~ (m + bubble) x the busiest device's work: the ideal on this run's split.
                    ideal_for_split = ideal * busiest_share(baseline) / busiest_share(pipeline)
                    print(
                        f"{tag}: {args.baseline} {baseline['perf/tokens_per_sec']:.0f} tok/s, {schedule} "
                        f"{pipeline['perf/tokens_per_sec']:.0f} tok/s, "
                        f"ratio {ratio:.2f} (ideal {ideal:.2f}, {ratio / ideal:.0%}; for this split "
                        f"{ideal_for_split:.2f}); other processes used "
                        f"{foreign[0]:.0%} / {foreign[1]:.0%} of the CPUs" + (" -> disturbed" if disturbed else ""),
                        flush=True,
                    )
                    if not disturbed or attempt == args.retries:
                        break
                pairs.append(
                    {
                        "schedule": schedule,
                        "baseline": args.baseline,
                        "num_microbatches": m,
                        "repeat": repeat,
                        "attempt": attempt,
                        "disturbed": disturbed,
                        "baseline/tokens_per_sec": baseline["perf/tokens_per_sec"],
                        "pipeline/tokens_per_sec": pipeline["perf/tokens_per_sec"],
                        "baseline/step_time_s": baseline["perf/step_time_s"],
                        "pipeline/step_time_s": pipeline["perf/step_time_s"],
                        "ratio": ratio,
                        "equal_work": work,
                        "ideal_ratio": ideal,
                        "ideal_ratio_for_split": ideal_for_split,
                        "efficiency": ratio / ideal,
                        "blocks_per_stage": pipeline["blocks_per_stage"],
                        "stage_cost_share": pipeline["stage_cost_share"],
                        "stages_of_processes": pipeline.get("pipeline/stages_of_processes"),
                        "process_cost_share": pipeline.get("pipeline/process_cost_share"),
                        "stage_timers": pipeline["bench/stage_timers"],
                        "baseline/stage_timers": baseline["bench/stage_timers"],
                        "foreign_cpu_share": foreign,
                    }
                )

    # Single naive runs scatter by several percent here (shared, virtualised CPUs), more than drift
    # between neighbours, so the report also gives each configuration's median pipeline throughput
    # over the median of *all* undisturbed baseline runs (same model and batch in every one of them; with --baseline
    # 1f1b only the runs of the same m).
    def pooled(m: int | None) -> list[float]:
        """Undisturbed baseline runs (all if none), of micro-batch count ``m`` (None: every run)."""
        same = [pair for pair in pairs if m is None or pair["num_microbatches"] == m]
        return [pair["baseline/tokens_per_sec"] for pair in same if not pair["disturbed"]] or [
            pair["baseline/tokens_per_sec"] for pair in same
        ]

    baseline_runs = pooled(None)
    summary = []
    for schedule in schedules:
        for m in args.microbatches:
            measured = [pair for pair in pairs if pair["schedule"] == schedule and pair["num_microbatches"] == m]
            clean = [pair for pair in measured if not pair["disturbed"]] or measured
            ratios = [pair["ratio"] for pair in clean]
            timers = [pair["stage_timers"] for pair in clean if pair["stage_timers"]]
            per_rank = {}
            for rank in range(len(timers[0]) if timers else 0):
                names = timers[0][rank]["seconds_per_step"]
                per_rank[f"rank{rank}"] = {
                    name: statistics.median(t[rank]["seconds_per_step"].get(name, 0.0) for t in timers)
                    for name in names
                }
            ideal = clean[0]["ideal_ratio"]
            summary.append(
                {
                    "schedule": schedule,
                    "baseline": args.baseline,
                    "num_microbatches": m,
                    "pairs_used": len(clean),
                    "only_disturbed_pairs": all(pair["disturbed"] for pair in clean),
                    "ratio_median": statistics.median(ratios),
                    "ratio_interval": bootstrap_interval(ratios),
                    # No correct measurement beats the schedule's ideal: above it is a measurement error.
                    "above_ideal": statistics.median(ratios) > ideal + 1e-9,
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "ideal_ratio": ideal,
                    "ideal_ratio_for_split": clean[0]["ideal_ratio_for_split"],
                    "efficiency": statistics.median(ratios) / ideal,
                    "ratio_vs_pooled_baseline": statistics.median(pair["pipeline/tokens_per_sec"] for pair in clean)
                    / statistics.median(pooled(None if args.baseline == "naive" else m)),
                    "process_cost_share": clean[0]["process_cost_share"],
                    "stage_seconds_per_step": per_rank,
                }
            )
    best = max(summary, key=lambda row: row["ratio_median"])
    report = {
        "config": vars(args),
        "pairs": pairs,
        "summary": summary,
        "baseline/tokens_per_sec": {
            "median": statistics.median(baseline_runs),
            "min": min(baseline_runs),
            "max": max(baseline_runs),
            "runs": len(baseline_runs),
        },
        "best": {
            "schedule": best["schedule"],
            "num_microbatches": best["num_microbatches"],
            "ratio": best["ratio_median"],
        },
    }
    (output_dir / "pipeline_vs_naive.json").write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"\n{'pipeline' if args.baseline == 'naive' else 'schedule'} vs {args.baseline}, tokens/s ratio (median of "
        f"{args.repeats} A/B pairs), {args.model_size} model"
        + (f" with {args.num_layers} blocks" if args.num_layers else "")
        + f", batch {args.batch_size} x {args.block_size} tokens, {args.threads_per_process} thread(s) per process"
    )
    print(
        f"{args.baseline} runs: median {statistics.median(baseline_runs):.0f} tok/s (min {min(baseline_runs):.0f}, "
        f"max {max(baseline_runs):.0f}, {len(baseline_runs)} runs)"
    )
    print(
        f"{'schedule':>15} {'m':>3} {'ratio':>6} {'min':>6} {'max':>6} {'pooled':>6} {'ideal':>6} {'of ideal':>8} "
        f"{'split':>6}   per-step seconds: compute / waiting, stage 0 | stage 1"
    )
    for row in summary:
        stages = " | ".join(
            f"{times.get('compute', 0):.2f} / {times.get('p2p_wait', 0):.2f}"
            for times in row["stage_seconds_per_step"].values()
        )
        interval = row["ratio_interval"]
        print(
            f"{row['schedule']:>15} {row['num_microbatches']:>3} {row['ratio_median']:>6.2f} {row['ratio_min']:>6.2f} "
            f"{row['ratio_max']:>6.2f} {row['ratio_vs_pooled_baseline']:>6.2f} {row['ideal_ratio']:>6.2f} "
            f"{row['efficiency']:>8.0%} {row['ideal_ratio_for_split']:>6.2f}   {stages or '(not timed)'}"
            + (f"   95 % interval [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
            + ("   ABOVE THE IDEAL: a measurement error" if row["above_ideal"] else "")
            + ("   (disturbed runs only)" if row["only_disturbed_pairs"] else "")
        )
    print(
        f"best: {best['schedule']} with m = {best['num_microbatches']}: {best['ratio_median']:.2f}x; wrote "
        f"{output_dir / 'pipeline_vs_naive.json'}"
    )


if __name__ == "__main__":
    main()
