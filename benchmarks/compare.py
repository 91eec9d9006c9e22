"""Compare benchmark results: a markdown table, the ratios that matter, PNG plots, a regression gate.

    python benchmarks/compare.py outputs/bench_cpu                         # a runner's output folder
    python benchmarks/compare.py machine_a/ machine_b/ --output_dir outputs/a_vs_b
    python benchmarks/compare.py outputs/*/results.json                     # plain recipe results work too
    python benchmarks/compare.py --baseline before/ --candidate after/ --threshold 0.1   # exit 1 on a regression

Takes any number of files or folders (searched recursively) holding the runner's per-run records
(``benchmarks/run.py``, schema in ``docs/benchmarks.md``) or recipes' ``results.json``. Prints, and
writes to ``OUTPUT_DIR/summary.md``: one row per configuration (medians over its rounds) and the
ratios, each paired within a round (A B A B) and reported as the median over rounds:

- DDP scaling efficiency = throughput(ddp) / (processes x throughput(single)), same per-process batch;
- pipeline speedup = throughput(pipeline, m micro-batches) / throughput(naive device_map split),
  against the ideal p m / (m + p - 1) for p stages (2m / (m + 1) on two devices);
- overhead = recipe step time / raw PyTorch step time (``studies/raw_ddp_lm.py``, same model, data and batch);
- group_by_length speedup, FSDP vs DDP, torch.compile speedup: samples/s ratios.

Plots (``OUTPUT_DIR/plots``, matplotlib Agg): throughput per setup, pipeline speedup against the
ideal curve, peak memory per device. ``--baseline A --candidate B`` compares the throughput of every
configuration found in both and exits with 1 when one fell by more than ``--threshold``, so it can gate CI.

Records of a smoke run (``run.py --matrix smoke``: ``purpose`` "smoke") are a plumbing check: the report says so
once, at its top, and judges none of their ratios against the targets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks' library (lib/)
from lib.records import (  # the same field extraction as the runner's records
    LM_RECIPES,
    SCHEMA,
    equal_work,
    summarize,
    unequal_work_text,
    work_per_step,
)
from lib.stats import bootstrap_interval  # the 95 % interval of every study's ratios too

# The issue's targets, shown beside the measured ratios (CPU, 1 thread per process).
TARGETS = {
    "ddp scaling efficiency": (">=", 0.92),
    "overhead vs raw PyTorch": ("<=", 1.02),
    "group_by_length speedup": (">=", 1.3),
    "speedup over the plain loop": (">=", 1.3),  # at equal accuracy: read the accuracy table beside it
    "pipeline speedup m=4": (">=", 1.4),
}
# Said once at the top of a report with smoke runs (run.py --matrix smoke: its records say purpose "smoke").
SMOKE_NOTE = (
    "a plumbing check (2 steps of tiny models): it shows that the runner, the recipes and this report work end to "
    "end; its numbers mean nothing about speed or accuracy, and no target is judged on it."
)


# ------------------------------------------------------------------------------ loading
def plain_record(results: dict, path: Path) -> dict:
    """A recipe's results.json, not written by the runner, as a record (no group rounds: pooled ratios only)."""
    config = results.get("config", {})
    parallelism = results.get("parallelism")
    recipe = results.get("recipe", "unknown")
    setup = {"raw_ddp_lm": "raw_ddp"}.get(recipe, parallelism)
    if parallelism == "pipeline":
        setup = f"pipeline-{results.get('pipeline_schedule')}-m{results.get('num_microbatches')}"
    if config.get("group_by_length"):
        setup += "+group_by_length"
    if results.get("mixed_precision") == "bf16":
        setup += "+bf16"
    if config.get("compile"):
        setup += "+compile"
    size = config.get("model_size") if recipe in LM_RECIPES else Path(str(results.get("model", "model"))).name
    threads = config.get("cpu_threads")
    return {
        "schema": SCHEMA,
        "run_id": str(path),
        "status": "ok",
        "recipe": recipe,
        "size": size,
        "setup": setup,
        "group": f"{'lm' if recipe != 'transformer_finetune' else 'finetune'}-{size}",
        "round": None,
        **summarize(results, threads),
    }


def load(paths: list[str | Path]) -> list[dict]:
    """Every record under ``paths``. Each gets ``_input``: the folder it was found in, when it came from
    a folder (results from different folders, e.g. two machines, are kept apart), else ""."""
    records, plain = [], []
    referenced = set()
    for given in paths:
        given = Path(given)
        files = sorted(given.rglob("*.json")) if given.is_dir() else [given]
        label = str(given) if given.is_dir() else ""
        for file in files:
            try:
                data = json.loads(file.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(data, dict):
                continue
            if data.get("schema") == SCHEMA:
                records.append({**data, "_input": label})
                if data.get("results_file"):
                    # runs/<id>.json -> the runner's output dir holds results_file.
                    referenced.add((file.parent.parent / data["results_file"]).resolve())
            elif "perf/samples_per_sec" in data and "recipe" in data:
                plain.append((file, {**plain_record(data, file), "_input": label}))
    return records + [record for file, record in plain if file.resolve() not in referenced]


def is_smoke(record: dict) -> bool:
    """A record of a smoke run: ``purpose`` "smoke", or (records written before that field) the smoke matrix."""
    return record.get("purpose", "smoke" if record.get("matrix") == "smoke" else None) == "smoke"


def smoke_banner(records: list[dict]) -> str | None:
    """The one line that says the numbers are a plumbing check, when some records come from smoke runs."""
    smoke = sum(is_smoke(record) for record in records)
    if not smoke:
        return None
    scope = "" if smoke == len(records) else f" ({smoke} of {len(records)} records; their ratios are not judged)"
    return f"**Smoke run{scope}: {SMOKE_NOTE}**"


# ------------------------------------------------------------------------------ aggregation
def median(values):
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def config_key(record: dict, several_inputs: bool) -> tuple:
    return ((record["_input"],) if several_inputs else ()) + (record["group"], record["setup"])


def configurations(records: list[dict]) -> dict[tuple, list[dict]]:
    several = len({record["_input"] for record in records}) > 1
    grouped: dict[tuple, list[dict]] = {}
    for record in records:
        if record.get("status") == "ok":
            grouped.setdefault(config_key(record, several), []).append(record)
    return grouped


def split_setup(setup: str) -> tuple[str, frozenset]:
    base, *options = setup.split("+")
    return base, frozenset(options)


# Options that change only how data is fed or how gradients travel: a setup with one of them is compared with the
# same setup without it (samples/s ratio).
OPTION_COMPARISONS = {
    "group_by_length": "group_by_length speedup",
    "compile": "torch.compile speedup",
    "bf16hook": "bf16 gradient compression speedup",
    "fp16hook": "fp16 gradient compression speedup",
    "dynamic": "dynamic padding speedup",
}
# Setups compared by the bytes of model state one process holds (memory/model_state_bytes, rank 0) rather than speed.
MEMORY_COMPARISONS = {
    ("full", "lora"): "lora vs full model state",
    ("lora", "qlora"): "qlora vs lora model state",
    ("ddp", "fsdp"): "fsdp vs ddp model state",
}


def comparison(a: str, b: str) -> str | None:
    """What comparing setup b against setup a (the reference) measures, if anything."""
    (base_a, options_a), (base_b, options_b) = split_setup(a), split_setup(b)
    added = options_b - options_a
    if base_a == base_b and options_a - options_b == {"fixed"} and added <= {"group_by_length"}:
        return "speedup over the plain loop"  # the plain loop pads every text to --max_length
    if base_a == base_b and len(added) == 1 and options_a <= options_b and next(iter(added)) in OPTION_COMPARISONS:
        return OPTION_COMPARISONS[next(iter(added))]
    if options_a == options_b and base_a.startswith("pipeline-1f1b-") and base_b.startswith("pipeline-interleaved"):
        if base_a.split("-m")[-1] == base_b.split("-m")[-1]:
            return "interleaved vs 1f1b"
    if options_a == options_b and base_a.startswith("pipeline-1f1b-") and base_b.startswith("pipeline-zb"):
        if base_a.split("-m")[-1] == base_b.split("-m")[-1]:
            return "zero bubble vs 1f1b"
    if base_a == base_b and options_b - options_a == {"group_by_length"} and options_a <= options_b:
        return "group_by_length speedup"
    if base_a == base_b and options_b - options_a == {"compile"} and options_a <= options_b:
        return "torch.compile speedup"
    if options_a != options_b:
        return None
    method_a, method_b = base_a.split("-")[0], base_b.split("-")[0]  # llm setups: <method>-<processes>p
    if base_a.split("-")[1:] == base_b.split("-")[1:] and (method_a, method_b) in MEMORY_COMPARISONS:
        if (method_a, method_b) != ("ddp", "fsdp"):
            return MEMORY_COMPARISONS[(method_a, method_b)]
    return {
        ("single", "ddp"): "ddp scaling efficiency",
        ("raw_ddp", "ddp"): "overhead vs raw PyTorch",
        ("ddp", "fsdp"): "fsdp vs ddp throughput",
    }.get((base_a, base_b)) or (
        "pipeline speedup" if base_a == "device_map" and base_b.startswith("pipeline-") else None
    )


def model_state(record: dict) -> int | None:
    state = (record.get("memory/model_state_bytes") or {}).get("rank0") or {}
    return state.get("total")


def ratio_of(kind: str, a: dict, b: dict) -> float | None:
    """The ratio for one pair of runs (or of two configurations' medians)."""
    if kind.endswith("model state"):
        return model_state(b) / model_state(a) if model_state(a) and model_state(b) else None
    if kind == "overhead vs raw PyTorch":
        return (
            b["perf/step_time_s"] / a["perf/step_time_s"]
            if a.get("perf/step_time_s") and b.get("perf/step_time_s")
            else None
        )
    if not a.get("perf/samples_per_sec") or not b.get("perf/samples_per_sec"):
        return None
    ratio = b["perf/samples_per_sec"] / a["perf/samples_per_sec"]
    if kind == "ddp scaling efficiency":
        ratio /= b["processes"] / a["processes"]
    return ratio


def comparison_work(kind: str, runs_a: list[dict], runs_b: list[dict]) -> dict | None:
    """Each side's work per optimizer step (the median over its runs; ``lib.records.equal_work``), per process for DDP
    scaling (whose ratio is per process), and whether the two are equal. None for the model-state comparisons, which
    compare bytes held, not work done."""
    if kind.endswith("model state"):
        return None
    sides = {}
    for side, runs in (("reference", runs_a), ("setup", runs_b)):
        per_run = [work_per_step(run) for run in runs]
        work = {measure: median(work[measure] for work in per_run) for measure in per_run[0]}
        if kind == "ddp scaling efficiency":
            work = {measure: value / runs[0]["processes"] if value else value for measure, value in work.items()}
        sides[side] = work
    return equal_work(sides)


def medians(runs: list[dict]) -> dict:
    keys = (
        "perf/samples_per_sec",
        "perf/tokens_per_sec",
        "perf/step_time_s",
        "perf/step_time_p90_s",
        "perf/data_wait_fraction",
        "perf/mfu",
        "perf/achieved_tflops",
        "foreign_cpu_share",
    )
    first = runs[0]
    return {
        **{
            key: first.get(key)
            for key in (
                "recipe",
                "size",
                "setup",
                "group",
                "processes",
                "threads_per_process",
                "global_batch_size",
                "sequence_length",
                "num_microbatches",
                "pipeline_schedule",
                "stages_per_process",
                "memory/model_state_bytes",
            )
        },
        **{key: median(run.get(key) for run in runs) for key in keys},
    }


def ratios(grouped: dict[tuple, list[dict]]) -> list[dict]:
    """Every meaningful comparison between two configurations of the same group (and input)."""
    rows = []
    for key_a, runs_a in grouped.items():
        for key_b, runs_b in grouped.items():
            if key_a[:-1] != key_b[:-1]:
                continue
            kind = comparison(key_a[-1], key_b[-1])
            if not kind:
                continue
            rounds_a = {run["round"]: run for run in runs_a if run.get("round") is not None}
            paired = [ratio_of(kind, rounds_a[run["round"]], run) for run in runs_b if run.get("round") in rounds_a]
            paired = [value for value in paired if value is not None]
            pooled = ratio_of(kind, medians(runs_a), medians(runs_b))
            shares = [
                run.get("foreign_cpu_share") for run in runs_a + runs_b if run.get("foreign_cpu_share") is not None
            ]
            row = {
                "key": key_b,
                "group": key_a[-2],
                "reference": key_a[-1],
                "setup": key_b[-1],
                "comparison": kind,
                "ratio": median(paired) if paired else pooled,
                "paired": paired,
                "pooled": pooled,
                "ideal": None,
                "max_foreign_cpu_share": max(shares) if shares else None,
                "smoke": any(is_smoke(run) for run in runs_a + runs_b),
            }
            if kind in ("pipeline speedup", "interleaved vs 1f1b", "zero bubble vs 1f1b"):
                p, m = runs_b[0]["processes"], runs_b[0].get("num_microbatches")
                v = runs_b[0].get("stages_per_process") or (2 if "interleaved" in key_b[-1] else 1)
                row["m"], row["schedule"] = m, runs_b[0].get("pipeline_schedule")
                if m:  # the bubble of p stages over m micro-batches, v chunks per process (Narayanan et al. 2021)
                    row["ideal"] = {
                        "pipeline speedup": p * m / (m + (p - 1) / v),
                        "interleaved vs 1f1b": (m + p - 1) / (m + (p - 1) / v),
                        "zero bubble vs 1f1b": (m + p - 1) / m,
                    }[kind]
            row["equal_work"] = comparison_work(kind, runs_a, runs_b)
            if row["equal_work"] and row["equal_work"]["equal"] is False:  # a ratio of different work: no ratio
                row["refused"] = f"not judged: unequal work per step ({unequal_work_text(row['equal_work'])})"
                row["ratio"], row["paired"], row["pooled"] = None, [], None
            row["interval"] = bootstrap_interval(row["paired"])
            row["bound"], row["above_bound"] = physical_bound(row, runs_b[0]["processes"])
            rows.append(row)
    return sorted(rows, key=lambda row: (row["group"], row["comparison"], row["setup"]))


def beyond(value: float, bound: str | None) -> bool:
    """Whether ``value`` passes a bound written as physical_bound writes it ("<= 1.60", ">= 0.50")."""
    if not bound or value is None:
        return False
    limit = float(bound.split()[1])
    return value > limit + 1e-9 if bound.startswith("<=") else value < limit - 1e-9


def physical_bound(row: dict, processes: int) -> tuple[str | None, bool]:
    """The bound no correct measurement can pass, and whether this ratio passes it (then it is a measurement error:
    a disturbed reference run, a too-short run, clocks read before the GPU finished). Pipelines: their ideal
    (bubble-free beyond the schedule's own); DDP scaling efficiency: 1.0; FSDP model state per process: 1/N of
    DDP's."""
    ratio = row["ratio"]
    if ratio is None:
        return None, False
    bound = (
        f"<= {row['ideal']:.3f}"
        if row.get("ideal")
        else "<= 1.000"
        if row["comparison"] == "ddp scaling efficiency"
        else f">= {1 / processes:.3f}"
        if row["comparison"] == "fsdp vs ddp model state"
        else None
    )
    return bound, beyond(ratio, bound)


def target_of(row: dict) -> tuple[str, float] | None:
    name = row["comparison"] + (f" m={row['m']}" if row.get("m") else "")
    return TARGETS.get(name) or TARGETS.get(row["comparison"])


# ------------------------------------------------------------------------------ markdown
def fmt(value, spec: str = ".3g", none: str = "-") -> str:
    if value is None or value != value:  # None or NaN
        return none
    return format(value, spec)


def memory_text(runs: list[dict]) -> str:
    peaks: dict[str, float] = {}
    for run in runs:
        for device, gib in (run.get("memory/peak_gib") or {}).items():
            peaks[device] = max(peaks.get(device, 0.0), gib)
    return ", ".join(f"{device} {gib:.2f}" for device, gib in sorted(peaks.items())) or "-"


def machines_text(records: list[dict]) -> list[str]:
    lines = []
    for text in sorted(
        {
            json.dumps([record.get("machine"), record.get("versions")], sort_keys=True)
            for record in records
            if record.get("machine")
        }
    ):
        machine, versions = json.loads(text)
        gpus = ", ".join(f"{gpu['name']} ({gpu['memory_gib']} GiB)" for gpu in machine.get("gpus") or []) or "no GPU"
        libs = ", ".join(f"{name} {version}" for name, version in (versions or {}).items() if version)
        lines.append(
            f"- {machine.get('cpu_model')}, {machine.get('cpu_cores')} cores, {machine.get('memory_gib')} GiB; "
            f"{gpus}; {libs}"
        )
    return lines


def spread(runs: list[dict], name: str, spec: str) -> str:
    """Mean ± standard deviation of ``name`` over runs (rounds), or "-"."""
    values = [run[name] for run in runs if run.get(name) is not None]
    if not values:
        return "-"
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.mean(values), spec)} ± {format(deviation, spec)}"


def markdown(records: list[dict]) -> str:
    grouped = configurations(records)
    several = len({record["_input"] for record in records}) > 1
    lines = ["# Benchmark results", ""]
    banner = smoke_banner(records)
    if banner:
        lines += [banner, ""]
    machines = machines_text(records)
    if machines:
        lines += ["Machines:", *machines, ""]
    lines += [
        "## Runs (medians over rounds)",
        "",
        "| "
        + ("input | " if several else "")
        + "group | setup | processes x threads | global batch x seq | samples/s | tokens/s "
        "| step p50 / p90 (s) | data wait | peak memory (GiB) | MFU | runs | other CPU load |",
        "|" + " --- |" * (12 + several),
    ]
    for key, runs in grouped.items():
        m = medians(runs)
        lines.append(
            "| "
            + (f"{key[0]} | " if several else "")
            + f"{m['group']} | {m['setup']} | {m['processes']} x {fmt(m['threads_per_process'], 'd')} "
            f"| {m['global_batch_size']} x {m['sequence_length']} | {fmt(m['perf/samples_per_sec'], '.1f')} | "
            f"{fmt(m['perf/tokens_per_sec'], '.0f')} | {fmt(m['perf/step_time_s'], '.3f')} / "
            f"{fmt(m['perf/step_time_p90_s'], '.3f')} | {fmt(m['perf/data_wait_fraction'], '.1%')} | "
            f"{memory_text(runs)} | {fmt(m['perf/mfu'], '.1%')} | {len(runs)} | {fmt(m['foreign_cpu_share'], '.0%')} |"
        )
    quality = [
        (key, runs)
        for key, runs in grouped.items()
        if any(run.get("eval/accuracy") is not None or run.get("memory/model_state_bytes") for run in runs)
    ]
    if quality:
        # What a speed-up may cost: accuracy over the rounds (seeds), and the training state one process holds.
        lines += [
            "",
            "## Accuracy and model state (mean ± sd over rounds)",
            "",
            # input (with several folders) and the seeds tell apart two rows of one setup: two machines, or two
            # trainings of the same recipe with other seeds.
            "| "
            + ("input | " if several else "")
            + "group | setup | runs (seeds) | eval/accuracy | train/loss | model state, rank 0 (MB) "
            "| trained parameters |",
            "|" + " --- |" * (7 + several),
        ]
        for key, runs in quality:
            state, trained = model_state(runs[0]), runs[0].get("model/trainable_parameters")
            seeds = sorted({run.get("seed") for run in runs if run.get("seed") is not None})
            lines.append(
                "| "
                + (f"{key[0]} | " if several else "")
                + f"{key[-2]} | {key[-1]} | {len(runs)} ({', '.join(map(str, seeds)) or '-'}) "
                f"| {spread(runs, 'eval/accuracy', '.4f')} "
                f"| {spread(runs, 'train/loss', '.4f')} "
                f"| {fmt(state / 1e6 if state else None, '.2f')} | {fmt(trained, ',')} |"
            )
    rows = ratios(grouped)
    if rows:
        lines += [
            "",
            "## Ratios (paired within a round, median over rounds)",
            "",
            "| group | comparison | setup vs reference | ratio [95 % interval] | per round | pooled medians | ideal | "
            "of ideal | bound | target | max other CPU load |",
            "|" + " --- |" * 11,
        ]
        for row in rows:
            smoke = row["smoke"]  # a plumbing check: no verdict, nothing in bold
            target = target_of(row)
            met = (
                ""
                if not target or row["ratio"] is None
                else (
                    " met"
                    if (row["ratio"] >= target[1] if target[0] == ">=" else row["ratio"] <= target[1])
                    else " missed"
                )
            )
            verdict = f"{target[0]} {target[1]:g}{met}" if target else ""
            verdict = "not judged: smoke run" if smoke else verdict
            verdict = row.get("refused") or verdict
            ratio = fmt(row["ratio"], ".3f") if smoke else f"**{fmt(row['ratio'], '.3f')}**"
            interval = f" [{row['interval'][0]:.3f}, {row['interval'][1]:.3f}]" if row.get("interval") else ""
            rounds = ", ".join(
                fmt(v, ".3f") + (" (!)" if beyond(v, row.get("bound")) and not smoke else "") for v in row["paired"]
            )
            bound = (row.get("bound") or "") + (
                " **ABOVE BOUND: a measurement error**" if row.get("above_bound") and not smoke else ""
            )
            lines.append(
                f"| {(row['key'][0] + ': ') if several else ''}{row['group']} | {row['comparison']} | {row['setup']} "
                f"vs {row['reference']} "
                f"| {ratio}{interval} "
                f"| {rounds or '-'} "  # a single round beyond the bound is marked (!): that round was disturbed
                f"| {fmt(row['pooled'], '.3f')} | {fmt(row['ideal'], '.2f')} "
                f"| {fmt(row['ratio'] / row['ideal'] if row['ideal'] and row['ratio'] else None, '.0%')} | {bound} "
                f"| {verdict} | {fmt(row['max_foreign_cpu_share'], '.0%')} |"
            )
        lines += [
            "",
            "Intervals: 95 % percentile bootstrap of the median over rounds (3 rounds or more). A ratio beyond its "
            "physical bound (a pipeline above its ideal, DDP efficiency above 1, FSDP state below 1/N of DDP's) is a "
            "measurement error, not a result: measure it again.",
            "Other CPU load: the share of all cores that other processes used during a run (the largest of the runs "
            "behind a ratio); above a few percent the ratio is disturbed, measure it again on a quiet machine.",
        ]
    problems = [record for record in records if record.get("status") != "ok"]
    if problems:
        lines += [
            "",
            "## Failed and skipped runs",
            "",
            "| run | status | reason | last line of output |",
            "| --- | --- | --- | --- |",
        ]
        for record in problems:
            last = (record.get("error_tail") or "").strip().splitlines()[-1:] or [""]
            lines.append(
                f"| {record['run_id']} | {record['status']} | {record.get('reason')} | "
                f"{last[0][:200].replace('|', '/')} |"
            )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ plots
def plots(records: list[dict], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    grouped = configurations(records)
    written = []
    labels = {key: " / ".join(key) for key in grouped}
    # A smoke run's plots say so in their titles (a plot travels without the summary beside it), naming the inputs
    # that are smoke runs when others are not.
    smoke_inputs = sorted({record["_input"] or "given files" for record in records if is_smoke(record)})
    smoke = ""
    if smoke_inputs and len(smoke_inputs) < len({record["_input"] or "given files" for record in records}):
        smoke = f"\n(smoke runs, a plumbing check: {', '.join(smoke_inputs)}; the others are real)"
    elif smoke_inputs:
        smoke = "\n(smoke run: a plumbing check, the numbers mean nothing)"

    # Throughput per setup: tokens/s for the language models, samples/s otherwise; whiskers span the rounds.
    panels = {}
    for key, runs in grouped.items():
        metric = "perf/tokens_per_sec" if runs[0].get("perf/tokens_per_sec") else "perf/samples_per_sec"
        values = [run[metric] for run in runs if run.get(metric)]
        if values:
            panels.setdefault(metric, []).append((labels[key], statistics.median(values), min(values), max(values)))
    if panels:
        figure, axes = plt.subplots(
            len(panels),
            1,
            figsize=(9, 1.2 + 0.35 * sum(len(rows) for rows in panels.values()) + len(panels)),
            squeeze=False,
        )
        for axis, (metric, rows) in zip(axes[:, 0], sorted(panels.items())):
            names, mids, lows, highs = zip(*rows)
            axis.barh(
                range(len(rows)),
                mids,
                xerr=[[mid - low for mid, low in zip(mids, lows)], [high - mid for mid, high in zip(mids, highs)]],
                color="tab:blue",
                capsize=3,
            )
            axis.set_yticks(range(len(rows)), names, fontsize=8)
            axis.invert_yaxis()
            axis.set_xlabel(
                metric.split("/")[1].replace("_per_sec", "/s") + " (median; whiskers: min-max over rounds)"
            )
        figure.suptitle("Throughput per setup" + smoke)
        figure.tight_layout()
        written.append(folder / "throughput.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)

    # Pipeline speedup over the naive split against the ideal p m / (m + p - 1).
    pipeline_rows = [
        row for row in ratios(grouped) if row["comparison"] == "pipeline speedup" and row.get("m") and row["ratio"]
    ]
    if pipeline_rows:
        figure, axis = plt.subplots(figsize=(7, 4.5))
        top = max(row["m"] for row in pipeline_rows)
        stages = 2
        ms = [1 + i * (max(top, 2) - 1) / 100 for i in range(101)]
        axis.plot(ms, [stages * m / (m + stages - 1) for m in ms], "k--", label="ideal 2m/(m+1)")
        series = {}
        for row in pipeline_rows:
            series.setdefault(" / ".join(row["key"][:-1]) + f" {row['schedule']}", []).append(row)
        for name, rows in sorted(series.items()):
            rows.sort(key=lambda row: row["m"])
            axis.plot([row["m"] for row in rows], [row["ratio"] for row in rows], "o-", label=name)
            for row in rows:
                axis.scatter([row["m"]] * len(row["paired"]), row["paired"], s=10, color="grey", zorder=3)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xlabel("micro-batches m")
        axis.set_ylabel("throughput / naive device_map split")
        axis.set_title("Pipeline speedup (dots: single rounds)" + smoke)
        axis.legend(fontsize=8)
        figure.tight_layout()
        written.append(folder / "pipeline_speedup.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)

    # Peak memory per device (CPU: each process's peak RSS; CUDA: max allocated).
    memory = {labels[key]: {} for key in grouped}
    for key, runs in grouped.items():
        for run in runs:
            for device, gib in (run.get("memory/peak_gib") or {}).items():
                memory[labels[key]][device] = max(memory[labels[key]].get(device, 0.0), gib)
    memory = {name: peaks for name, peaks in memory.items() if peaks}
    if memory:
        width = 0.8 / max(len(peaks) for peaks in memory.values())
        figure, axis = plt.subplots(figsize=(9, 1.5 + 0.45 * len(memory)))
        for row, peaks in enumerate(memory.values()):
            for index, (device, gib) in enumerate(sorted(peaks.items())):
                axis.barh(row + index * width, gib, height=width, color=f"C{index}")
                axis.text(gib, row + index * width, f" {device}", va="center", fontsize=6)
        axis.set_yticks([row + 0.4 - width / 2 for row in range(len(memory))], list(memory), fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("peak memory per device (GiB)")
        axis.set_title("Peak memory per device" + smoke)
        figure.tight_layout()
        written.append(folder / "memory.png")
        figure.savefig(written[-1], dpi=110)
        plt.close(figure)
    return written


# ------------------------------------------------------------------------------ entry points
def report(paths: list[str | Path], output_dir: str | Path | None) -> str:
    """Print the markdown report; with ``output_dir``, also write summary.md and plots/ there."""
    records = load(paths)
    if not records:
        raise SystemExit(f"no benchmark records or results.json found in {', '.join(map(str, paths))}")
    text = markdown(records)
    print(text)
    if output_dir is not None:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "summary.md").write_text(text)
        written = plots(records, output_dir / "plots")
        print(
            f"wrote {output_dir / 'summary.md'} and {', '.join(path.name for path in written)} in "
            f"{output_dir / 'plots'}"
        )
    return text


def regressions(baseline: list[str], candidate: list[str], threshold: float) -> int:
    """Compare median throughput per configuration; 1 if any fell by more than ``threshold``."""
    baseline_records, candidate_records = load(baseline), load(candidate)
    banner = smoke_banner(baseline_records + candidate_records)
    if banner:
        print(banner.strip("*") + " This gate then checks its own plumbing only.\n")
    before = {key[-2:]: medians(runs) for key, runs in configurations(baseline_records).items()}
    after = {key[-2:]: medians(runs) for key, runs in configurations(candidate_records).items()}
    common = [key for key in before if key in after]
    if not common:
        print(
            f"no configuration (group, setup) is in both the baseline ({len(before)}) and the candidate ({len(after)})"
        )
        return 2
    failed, unlike = 0, 0
    print("| group | setup | baseline samples/s | candidate samples/s | change | |\n|" + " --- |" * 6)
    for key in sorted(common):
        a, b = before[key]["perf/samples_per_sec"], after[key]["perf/samples_per_sec"]
        shapes = (workload(before[key]), workload(after[key]))
        if shapes[0] != shapes[1]:  # a smoke run against a real baseline: other work, not a change in speed
            unlike += 1
            print(
                f"| {key[0]} | {key[1]} | {fmt(a, '.2f')} | {fmt(b, '.2f')} | | not compared: the work differs "
                f"({shapes[0]} vs {shapes[1]}) |"
            )
            continue
        change = b / a - 1 if a and b else None
        regressed = change is not None and change < -threshold
        failed += regressed
        print(
            f"| {key[0]} | {key[1]} | {fmt(a, '.2f')} | {fmt(b, '.2f')} | {fmt(change, '+.1%')} | "
            f"{'REGRESSION' if regressed else 'ok'} |"
        )
    compared = len(common) - unlike
    if unlike:
        print(
            f"{unlike} of {len(common)} configurations not compared: their global batch or sequence length differ "
            "between the baseline and the candidate (rerun both with the same matrix)"
        )
    if not compared:
        return 2
    print(f"{failed} of {compared} configurations lost more than {threshold:.0%} throughput")
    return 1 if failed else 0


def workload(summary: dict) -> str:
    """The work one step does, as the gate compares it: global batch x sequence length (and processes)."""
    return (
        f"{summary.get('global_batch_size')} x {summary.get('sequence_length')} on "
        f"{summary.get('processes')} process(es)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", help="Result files or folders (searched recursively).")
    parser.add_argument("--output_dir", default="outputs/compare", help="Where summary.md and plots/ go.")
    parser.add_argument("--baseline", nargs="+", help="Regression check: the reference results (files or folders).")
    parser.add_argument("--candidate", nargs="+", help="Regression check: the results to check against --baseline.")
    parser.add_argument("--threshold", type=float, default=0.1, help="Largest tolerated throughput loss (0.1 = 10%%).")
    args = parser.parse_args(argv)
    if args.baseline or args.candidate:
        if not (args.baseline and args.candidate):
            parser.error("--baseline and --candidate go together")
        return regressions(args.baseline, args.candidate, args.threshold)
    if not args.paths:
        parser.error("give result files or folders, or --baseline and --candidate")
    report(args.paths, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
