"""Profile a recipe, run unchanged with its own command line (through runpy): where its training steps' time goes.

    accelerate launch --config_file accelerate_configs/single_gpu.yaml benchmarks/profile_recipe.py --torch_profiler \\
        recipes/llm_finetune.py --max_train_steps 13 --perf_warmup_steps 2 --output_dir outputs/profiled
    python benchmarks/profile_recipe.py --summarize outputs/profiled     # the summary again, from the saved files
    accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml benchmarks/profile_recipe.py \\
        --stage_timers recipes/pipeline_lm.py --num_microbatches 4 --output_dir outputs/timed

One of two measurements per launch, each written by every process to the recipe's output folder:

``--torch_profiler`` (any recipe): ``torch.profiler`` over the ``PROFILED_STEPS`` optimizer steps after the recipe's
``--perf_warmup_steps`` (``RunRecord.step``, which every recipe calls once per optimizer step, marks them).

- ``profile_rank{R}.txt``: the operators by their own CPU time (and CUDA time on a GPU), over the profiled steps;
- ``profile_rank{R}.json``: per step, the host reads of a tensor's value (``aten::_local_scalar_dense``: ``.item()``,
  ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``) and the operators whose output size depends on the data
  (``nonzero``, boolean-mask indexing), each with the Python lines that asked for it. On a GPU each is a sync point,
  where the host waits for the device to finish everything queued, unless the tensor lives on the host: reads inside
  the data loader (collating, before the copy to the device) are counted apart (``host_reads``), and reads that
  C++ makes internally (the fused AdamW's step counters on a CPU) are not seen.

On a CPU every op runs on the host, so a read costs nothing here; the counts say what a GPU would wait for.

``--stage_timers`` (``recipes/pipeline_lm.py``; ``studies/pipeline_vs_naive.py`` runs it): timers around a few
functions of ``torch.distributed.pipelining`` (forward and backward of one micro-batch, the last stage's loss, waiting
on send/receive) and the optimizer step, with ``time.perf_counter`` (microseconds of overhead per call, tens of calls
per step). Only training steps after the recipe's ``--perf_warmup_steps`` are counted, like its throughput numbers.
``stage_timers_rank{R}.json`` holds seconds per optimizer step: ``compute`` (forward + backward + loss) and
``p2p_wait`` (waiting for the other stage: the bubble, plus transfers) add up to most of ``schedule_step`` (the rest
is the schedule's own Python); ``optimizer`` is AdamW's step, outside the schedule.
"""

import argparse
import atexit
import collections
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]  # the benchmarks' library (lib/), and shared/
from lib.launch import run_as_main
from lib.machine import library_versions, machine_info  # CPU model and flags, GPUs, versions: as every record

PROFILED_STEPS = 10  # RunRecord reads the losses every 10 steps: one whole window
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2")  # aten op names


# ------------------------------------------------------------------------------ --torch_profiler
class SyncReads(TorchDispatchMode):
    """Records every sync-point operator with the Python lines that called it (outside torch), per step."""

    def __init__(self):
        super().__init__()
        self.steps: list[collections.Counter] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.steps and func.__name__.split(".")[0] in SYNC_OPS:
            frames = [
                frame
                for frame in traceback.extract_stack()[:-1]
                if "/torch/" not in frame.filename or "/torch/utils/data/" in frame.filename
            ]
            innermost = frames[::-1][:3]
            where = " <- ".join(f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" for frame in innermost)
            if any("/torch/utils/data/" in frame.filename for frame in frames):
                where = "host (data loader): " + where
            self.steps[-1][where] += 1
        return func(*args, **(kwargs or {}))


def summarize(steps: list[collections.Counter], step_times: list[float], averages) -> dict:
    device = [sum(n for where, n in step.items() if not where.startswith("host")) for step in steps]
    sources = collections.Counter()
    for step in steps:
        sources.update(step)
    total = sum(event.self_cpu_time_total for event in averages) or 1.0
    top = sorted(averages, key=lambda event: event.self_cpu_time_total, reverse=True)[:12]
    return {
        "profiled_steps": len(steps),
        "step_time_s": step_times,
        "device_reads_each_step": device,
        "steps_with_a_device_read": sum(1 for count in device if count),
        "host_reads_each_step": [sum(n for where, n in step.items() if where.startswith("host")) for step in steps],
        "reads_by_source": dict(sources.most_common(15)),
        "top_ops_self_cpu_share": {event.key: round(event.self_cpu_time_total / total, 4) for event in top},
    }


def profiled_recipe(argv: list[str]) -> None:
    from shared import results

    out = Path(argv[argv.index("--output_dir") + 1]) if "--output_dir" in argv else Path(".")
    warmup = int(argv[argv.index("--perf_warmup_steps") + 1]) if "--perf_warmup_steps" in argv else 2
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # Steps 1..warmup run unprofiled (start-up, first-call costs); the next PROFILED_STEPS are recorded.
    prof = profile(activities=activities, schedule=schedule(wait=warmup, warmup=0, active=PROFILED_STEPS, repeat=1))
    reads, step_times, last = SyncReads(), [], [time.perf_counter()]
    original = results.RunRecord.step

    def step(self, completed_steps, *args, **kwargs):
        original(self, completed_steps, *args, **kwargs)  # (inside the step it marks: its reads count)
        now = time.perf_counter()
        if warmup < completed_steps <= warmup + PROFILED_STEPS:
            step_times.append(round(now - last[0], 6))
        last[0] = now
        prof.step()  # one optimizer step ends here
        if completed_steps == warmup:
            reads.__enter__()
            reads.active = True
        if warmup <= completed_steps < warmup + PROFILED_STEPS:
            reads.steps.append(collections.Counter())
        elif completed_steps == warmup + PROFILED_STEPS:
            reads.__exit__(None, None, None)
            reads.active = False

    results.RunRecord.step = step
    prof.start()
    try:
        run_as_main(argv)
    finally:
        prof.stop()
        if getattr(reads, "active", False):  # the run ended inside the profiled steps
            reads.__exit__(None, None, None)
    rank = os.environ.get("RANK", "0")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out / f"profile_rank{rank}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=30) + "\n")
    summary = summarize(reads.steps, step_times, prof.key_averages())
    summary |= {"command": argv, "machine": machine_info(), "versions": library_versions()}
    (out / f"profile_rank{rank}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if rank == "0":
        print(
            f"profile: {summary['steps_with_a_device_read']} of {summary['profiled_steps']} optimizer steps read "
            f"a device value (reads per step {summary['device_reads_each_step']}); see {out}/profile_rank{rank}.*"
        )


# ------------------------------------------------------------------------------ --stage_timers
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


def timed_recipe(argv: list[str]) -> None:
    from torch.distributed.pipelining import schedules, stage

    recipe, *recipe_args = argv
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

    run_as_main(argv)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        for path in sorted(Path(sys.argv[2]).glob("profile_rank*.json")):
            print(path.name, json.dumps(json.loads(path.read_text()), indent=2))
    elif len(sys.argv) < 3 or not sys.argv[2].endswith(".py"):
        sys.exit(__doc__)
    elif sys.argv[1] == "--torch_profiler":
        profiled_recipe(sys.argv[2:])
    elif sys.argv[1] == "--stage_timers":
        timed_recipe(sys.argv[2:])
    else:
        sys.exit(f"unknown measurement {sys.argv[1]}: --torch_profiler or --stage_timers\n\n{__doc__}")
