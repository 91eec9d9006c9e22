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
    "memory/model_state_bytes",
    "train/padding_fraction",
    "model/num_parameters",
    "model/trainable_parameters",
    "train/loss",
    "eval/accuracy",
    "eval/f1",
    "eval/loss",
    "method",
    "stages_per_process",
)


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
