"""The benchmark record: its schema name and the fields taken from a recipe's results.json.

Shared by ``run.py`` (which writes records) and ``compare.py`` (which reads them and plain results.json files), so
neither imports the other for it. Plain Python: no torch.
"""

from __future__ import annotations

import json

SCHEMA = "two-gpu-recipes/benchmark-run/1"
# Recipes whose runs count tokens and FLOPs (the reference records from before the LM recipe was split say pipeline_lm
# for every LM setup).
LM_RECIPES = ("train_lm", "pipeline_lm", "raw_ddp_lm")
# Fields copied as they are from results.json into every record (each recipe writes the ones that apply to it).
COPIED = (
    "perf/samples_per_sec",
    "perf/tokens_per_sec",
    "perf/answer_tokens_per_sec",
    "perf/step_time_s",
    "perf/step_time_p90_s",
    "perf/data_wait_fraction",
    "memory/peak_gib",
    "memory/load_peak_gib",
    "memory/host_peak_gib",
    "train/padding_fraction",
    "model/num_parameters",
    "model/trainable_parameters",
    "train/loss",
    "eval/accuracy",
    "eval/f1",
    "eval/loss",
    "method",
    "stages_per_process",
    "perf/samples_per_step",
    "perf/tokens_per_step",
    "tokens_per_step",
)
# Two sides of a comparison whose work per optimizer step differs by more than this are not compared.
WORK_TOLERANCE = 0.01


def summarize(results: dict, threads: int | None) -> dict:
    """The schema's fields from a recipe's (or the raw baseline's) results.json."""
    config = results.get("config", {})
    parallelism = results.get("parallelism")
    processes = results.get("num_processes", 1)
    sequence_length = config.get("block_size") or config.get("max_length")
    return {
        "parallelism": parallelism,
        "pipeline_schedule": results.get("pipeline_schedule"),
        "num_microbatches": results.get("num_microbatches") if parallelism == "pipeline" else None,
        "group_by_length": bool(config.get("group_by_length", False)),
        "compile": bool(config.get("compile", False)),
        "mixed_precision": results.get("mixed_precision"),
        "device": results.get("device")
        or ("cuda" if "cuda" in json.dumps(results.get("memory/peak_gib", {})) else "cpu"),
        "processes": processes,
        "threads_per_process": config.get("cpu_threads") or threads,
        "global_batch_size": results.get("global_batch_size"),
        # the LM recipes: tokens per block; transformer_finetune: the truncation length (batches are
        # padded to their longest text, up to this).
        "sequence_length": sequence_length,
        "steps": results.get("completed_steps"),
        "warmup_steps": config.get("perf_warmup_steps"),
        "measured_steps": results.get("perf/measured_steps"),
        "seed": config.get("seed"),
        **{key: results.get(key) for key in COPIED},
    }


def work_per_step(record: dict) -> dict[str, float | None]:
    """The work of one optimizer step of a run (a record or a results.json): its real tokens (padding excluded) and
    samples, over the measured steps (``perf/*_per_step``). Runs recorded before those fields: the LM recipes' fixed
    ``global_batch_size`` blocks of ``tokens_per_step`` tokens; the fine-tunes' ``global_batch_size`` samples."""
    samples = record.get("perf/samples_per_step") or record.get("global_batch_size")
    tokens = record.get("perf/tokens_per_step") or record.get("tokens_per_step")
    if tokens is None and record.get("recipe") in LM_RECIPES and samples and record.get("sequence_length"):
        tokens = samples * record["sequence_length"]
    return {"tokens_per_step": tokens, "samples_per_step": samples}


def equal_work(sides: dict[str, dict], tolerance: float = WORK_TOLERANCE) -> dict:
    """Whether the sides of a side-by-side comparison (name -> ``work_per_step``) did the same work per optimizer
    step: every measure that all sides recorded within ``tolerance`` of its largest value. A throughput ratio of
    unequal work measures the batches, not the loop: ``equal`` False says not to judge it (None: nothing to compare,
    no measure recorded by every side). The record keeps each side's numbers beside the verdict."""
    record: dict = {}
    for measure in ("tokens_per_step", "samples_per_step"):
        values = {side: work.get(measure) for side, work in sides.items()}
        if all(value for value in values.values()):
            record[measure] = {side: round(value, 3) for side, value in values.items()}
    unequal = [
        measure for measure, values in record.items() if min(values.values()) < (1 - tolerance) * max(values.values())
    ]
    return {**record, "equal": not unequal if record else None, "tolerance": tolerance, "unequal": unequal}


def unequal_work_text(work: dict) -> str:
    """One sentence naming what differs, for a refusal: e.g. ``tokens_per_step recipe 437 vs trl 15,835``."""
    return "; ".join(
        f"{measure.replace('_', ' ')}: " + " vs ".join(f"{side} {value:,.0f}" for side, value in work[measure].items())
        for measure in work["unequal"]
    )
