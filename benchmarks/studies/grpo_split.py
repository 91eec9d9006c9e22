"""recipes/grpo.py's split layout against its colocated layout, both in 2 processes: a split step takes the longer of
generating and training instead of their sum.

    python benchmarks/studies/grpo_split.py --output_dir benchmarks/results/cpu-grpo-split
    python benchmarks/studies/grpo_split.py --dry_run --output_dir outputs/grpo_split           # the plan

Both sides launch the recipe unchanged with ``accelerate_configs/ddp_2gpu.yaml`` (2 gloo processes, one thread each:
on a CPU one core stands in for one GPU), on ``grpo_vs_trl.py``'s speed model (a 4.2M-parameter Llama with random
weights, a LoRA adapter, ``SETTINGS``), the same prompts, 16 completions per optimizer step of up to 32 tokens,
sampled (random weights almost never end a completion early: both sides generate and train the same number of tokens,
checked). Colocated: each process generates 8 completions and trains on them; split: rank 1 generates all 16, rank 0
trains on all 16 (``--per_device_train_batch_size`` 16: the same global batch). Rounds A B A B.

Recorded per run: the trainer's median step time (``perf/step_time_s``), completions per second after the warm-up,
and in split mode each role's busy and idle seconds (``perf/generator_busy_s``, ...), from which a step's generating
and training time (busy seconds over the rounds); the verdict compares the split step with their sum and their
maximum. Equal work is asserted in the record: same model, prompts, completions per step, completion length (mean
within 2 %). Writes ``OUTPUT_DIR/grpo_split.json`` and ``OUTPUT_DIR/summary.md``; runs go to --work_dir.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "recipes")]  # lib/, shared/, the recipes' kits
from lib.grpo_inputs import SPEED_MODEL, SPEED_VOCAB_SIZE, build_inputs  # grpo_vs_trl.py --speed's model, prompts
from lib.launch import accelerate_launch, launch_and_wait  # a side in its own processes
from lib.machine import library_versions, machine_info  # as every record
from lib.stats import paired_ratio  # 95 % interval of a median ratio

RECIPE = REPO / "recipes" / "grpo.py"
COMPLETIONS_PER_STEP = 16
SETTINGS = {  # grpo_vs_trl.py --speed's
    "num_generations": 8,
    "max_completion_length": 32,
    "learning_rate": 1e-4,
    "max_train_steps": 12,
    "perf_warmup_steps": 2,
    "seed": 42,
    "logging_steps": 1,
}
# Per process: colocated, each of the 2 processes generates and trains its half; split, the one trainer trains all.
SIDES = {"colocate": COMPLETIONS_PER_STEP // 2, "split": COMPLETIONS_PER_STEP}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where grpo_split.json and summary.md go.")
    parser.add_argument("--work_dir", help="Runs and model (default: outputs/grpo_split_work/<output_dir>).")
    parser.add_argument("--repeats", type=int, default=3, help="A B rounds (3 or more give an interval).")
    parser.add_argument("--dry_run", action="store_true", help="Print both command lines.")
    return parser.parse_args(argv)


def command(mode: str, model_dir: Path, train_file: Path, out: Path) -> list[str]:
    flags = [word for key, value in SETTINGS.items() for word in (f"--{key}", str(value))]
    return [
        *accelerate_launch("ddp_2gpu.yaml"),
        str(RECIPE),
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(train_file),
        "--validation_file",
        str(train_file),
        "--generation_mode",
        mode,
        "--per_device_train_batch_size",
        str(SIDES[mode]),
        *flags,
        "--mixed_precision",
        "no",
        "--skip_eval",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
    ]


def measured(results: dict) -> dict:
    """What one run says: its step time, completions/s, mean completion length, and (split) each role's seconds per
    round."""
    steps = results["completed_steps"]
    out = {
        "step_time_s": results["perf/step_time_s"],
        "completions_per_sec": results["perf/completions_per_sec"],
        "global_batch_size": results["global_batch_size"],
        "mean_length": statistics.mean(entry["train/completions/mean_length"] for entry in results["train/log"]),
        "foreign_share": results.get("bench/foreign_share"),
    }
    if "perf/generator_busy_s" in results:
        out["generate_s_per_step"] = results["perf/generator_busy_s"] / steps
        out["train_s_per_step"] = results["perf/trainer_busy_s"] / steps
        out["generator_idle_share"] = results["perf/generator_idle_s"] / (
            results["perf/generator_busy_s"] + results["perf/generator_idle_s"]
        )
        out["trainer_idle_share"] = results["perf/trainer_idle_s"] / (
            results["perf/trainer_busy_s"] + results["perf/trainer_idle_s"]
        )
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    output_dir = Path(args.output_dir).resolve()
    relative = output_dir.relative_to(REPO) if output_dir.is_relative_to(REPO) else Path(output_dir.name)
    work = Path(args.work_dir).resolve() if args.work_dir else REPO / "outputs" / "grpo_split_work" / relative
    if args.dry_run:
        for mode in SIDES:
            print(" ".join(command(mode, work / "model", work / "prompts.jsonl", work / mode)))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    model_dir, train_file = build_inputs(work, SPEED_MODEL, SPEED_VOCAB_SIZE)
    rounds = []
    for index in range(args.repeats):
        run = {}
        for mode in SIDES:  # A B in every round: a shared machine's drift hits both sides alike
            out = work / f"{mode}_r{index}"
            run[mode] = measured(launch_and_wait(command(mode, model_dir, train_file, out), out, threads=1))
        rounds.append(run)
        print(f"round {index}: {json.dumps(run)}", flush=True)
    split = [r["split"] for r in rounds]
    equal = all(
        r["split"]["global_batch_size"] == r["colocate"]["global_batch_size"] == COMPLETIONS_PER_STEP
        and abs(r["split"]["mean_length"] / r["colocate"]["mean_length"] - 1) <= 0.02
        for r in rounds
    )
    median = {key: statistics.median(s[key] for s in split) for key in ("step_time_s", "generate_s_per_step")}
    median["train_s_per_step"] = statistics.median(s["train_s_per_step"] for s in split)
    longer, total = (
        max(median["generate_s_per_step"], median["train_s_per_step"]),
        sum(median[key] for key in ("generate_s_per_step", "train_s_per_step")),
    )
    report = {
        "benchmark": "grpo_split",
        "command": "python benchmarks/studies/grpo_split.py " + " ".join(argv),
        "settings": {**SETTINGS, "model": SPEED_MODEL, "vocab_size": SPEED_VOCAB_SIZE, "per_process": SIDES},
        "equal_work": equal,
        "rounds": rounds,
        "split_step": {**median, "longer_of_the_two_s": longer, "sum_of_the_two_s": total},
        "split_over_colocate_completions_per_sec": paired_ratio(
            [r["split"]["completions_per_sec"] for r in rounds], [r["colocate"]["completions_per_sec"] for r in rounds]
        ),
        "machine": machine_info(),
        "versions": library_versions(["torch", "transformers", "accelerate", "peft"]),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "grpo_split.json").write_text(json.dumps(report, indent=2) + "\n")
    ratio = report["split_over_colocate_completions_per_sec"]
    interval = ratio["interval"] and f"[{ratio['interval'][0]:.3f}, {ratio['interval'][1]:.3f}]"
    lines = [
        "# recipes/grpo.py: the split layout against colocated, 2 processes of 1 thread each",
        "",
        f"Command: `{report['command']}`; settings `{json.dumps(report['settings'])}`; machine "
        f"{report['machine']['cpu_model']} ({report['machine']['cpu_cores']} cores, flags "
        f"{' '.join(report['machine']['cpu_flags'])}).",
        "",
        "| round | colocated step s | split step s | split: generate s/step | split: train s/step | generator idle | "
        "trainer idle | completions/s colocated, split | mean length colocated, split | others' CPU share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {i} | {r['colocate']['step_time_s']:.3f} | {r['split']['step_time_s']:.3f} | "
            f"{r['split']['generate_s_per_step']:.3f} | {r['split']['train_s_per_step']:.3f} | "
            f"{r['split']['generator_idle_share']:.0%} | {r['split']['trainer_idle_share']:.0%} | "
            f"{r['colocate']['completions_per_sec']:.1f}, {r['split']['completions_per_sec']:.1f} | "
            f"{r['colocate']['mean_length']:.1f}, {r['split']['mean_length']:.1f} | "
            f"{r['colocate']['foreign_share'] or 0:.0%}, {r['split']['foreign_share'] or 0:.0%} |"
            for i, r in enumerate(rounds)
        ),
        "",
        f"Split step (median) {median['step_time_s']:.3f} s; generating {median['generate_s_per_step']:.3f} s and "
        f"training {median['train_s_per_step']:.3f} s a step: their longer {longer:.3f} s, their sum {total:.3f} s. "
        f"Split / colocated completions/s: median {ratio['median']:.3f}, 95 % interval {interval or '- (< 3 rounds)'}"
        + ("." if equal else "; UNEQUAL WORK (completion lengths or batches differ): no verdict."),
        "",
    ]
    (output_dir / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
