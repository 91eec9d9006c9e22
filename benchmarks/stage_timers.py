"""Run ``recipes/pipeline_lm.py`` with timers around each pipeline stage's compute and waits.

A profiling aid for ``benchmarks/pipeline_vs_naive.py``: where does a pipeline step's time go?

    accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml benchmarks/stage_timers.py \\
        recipes/pipeline_lm.py --num_microbatches 4 --output_dir outputs/timed

It wraps a few functions of ``torch.distributed.pipelining`` (forward and backward of one
micro-batch, the last stage's loss, waiting on send/receive) and the optimizer step with
``time.perf_counter`` (microseconds of overhead per call, tens of calls per step), then runs the
recipe unchanged. Only training steps after the recipe's ``--perf_warmup_steps`` are counted, like
its throughput numbers. Each process writes ``OUTPUT_DIR/stage_timers_rank{R}.json`` with seconds
per optimizer step: ``compute`` (forward + backward + loss) and ``p2p_wait`` (waiting for the other
stage: the bubble, plus transfers) add up to most of ``schedule_step`` (the rest is the schedule's
own Python); ``optimizer`` is AdamW's step, outside the schedule.
"""

import argparse
import atexit
import collections
import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.distributed.pipelining import schedules, stage

totals: dict[str, float] = collections.defaultdict(float)
state = {"train_calls": 0, "counting": False, "measured_calls": 0}


def synchronize() -> None:
    """Sync point: CUDA kernels run asynchronously, so a clock read without it would time the launch of the work,
    not the work (and charge it to whatever waits next). On CPU there is nothing to wait for."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(name, function):
    def wrapper(*args, **kwargs):
        if state["counting"]:
            synchronize()
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if state["counting"]:
                synchronize()
                totals[name] += time.perf_counter() - start

    return wrapper


def timed_schedule_step(function, skip_calls):
    def wrapper(self, *args, **kwargs):
        training = self._has_backward  # eval() calls step() with the backward switched off
        if training:
            state["train_calls"] += 1
            state["counting"] = state["train_calls"] > skip_calls
            state["measured_calls"] += state["counting"]
        else:
            state["counting"] = False
        if state["counting"]:
            synchronize()
        start = time.perf_counter()
        try:
            return function(self, *args, **kwargs)
        finally:
            if state["counting"]:
                synchronize()
                totals["schedule_step"] += time.perf_counter() - start

    return wrapper


def main():
    recipe, *recipe_args = sys.argv[1:]
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output_dir", default="outputs/pipeline_lm")
    parser.add_argument("--perf_warmup_steps", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    known, _ = parser.parse_known_args(recipe_args)
    accumulation = known.gradient_accumulation_steps
    skip_calls = known.perf_warmup_steps * accumulation

    base = stage._PipelineStageBase
    base.forward_one_chunk = timed("forward", base.forward_one_chunk)
    base.backward_one_chunk = timed("backward", base.backward_one_chunk)
    schedules._PipelineSchedule._maybe_compute_loss = timed("loss", schedules._PipelineSchedule._maybe_compute_loss)
    schedules._wait_batch_p2p = timed("p2p_wait", schedules._wait_batch_p2p)
    schedules.PipelineScheduleSingle.step = timed_schedule_step(schedules.PipelineScheduleSingle.step, skip_calls)
    torch.optim.AdamW.step = timed("optimizer", torch.optim.AdamW.step)

    @atexit.register
    def report():
        steps = state["measured_calls"] / accumulation
        if not steps:
            return
        per_step = {name: seconds / steps for name, seconds in totals.items()}
        per_step["compute"] = per_step.get("forward", 0) + per_step.get("backward", 0) + per_step.get("loss", 0)
        rank = int(os.environ.get("RANK", "0"))
        path = Path(known.output_dir) / f"stage_timers_rank{rank}.json"
        path.write_text(
            json.dumps({"rank": rank, "measured_steps": steps, "seconds_per_step": per_step}, indent=2) + "\n"
        )

    sys.argv = [recipe, *recipe_args]
    runpy.run_path(recipe, run_name="__main__")


if __name__ == "__main__":
    main()
