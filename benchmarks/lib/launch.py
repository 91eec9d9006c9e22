"""Launching a recipe and reading what it wrote; running one unchanged inside a wrapper.

``launch_and_wait`` waits for one command (``accelerate launch`` of a recipe, or of a wrapper around it) and returns
its results file with the wall time and the share of the CPUs other processes used meanwhile. ``run_as_main`` is the
wrapper's side: a profiler, a clock or the model-state count patches what it measures, then runs the recipe file as
``__main__`` with the recipe's own command line, so the recipe itself carries no instrumentation.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

from lib.machine import busy_cpu_seconds, foreign_cpu_seconds, own_cpu_seconds

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"


def accelerate_launch(config: str, *launch_args: str) -> list[str]:
    """``accelerate launch --config_file accelerate_configs/<config>`` (and launch options), in this interpreter."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config), *launch_args]


def launch_and_wait(
    command: list[str], out: Path, *, results_name: str = "results.json", threads: int | None = None
) -> dict:
    """One launch, waited for: ``out/<results_name>`` as the run wrote it, plus ``bench/wall_s``, and the CPU time
    other processes used meanwhile (``bench/foreign_cpu_s``) as a share of all cores (``bench/foreign_share``). Its
    output goes to ``out/launch.log``; a launch that fails stops the caller with the output's tail.

    ``threads``: OMP_NUM_THREADS of every process (on a CPU, one core stands in for one GPU). The default model and
    data are local, so the Hub is offline unless the environment says otherwise."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    busy_before, own_before, started = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - started
    (out / "launch.log").write_text(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({' '.join(command)}):\n{done.stdout[-4000:]}")
    results = json.loads((out / results_name).read_text())
    results["bench/wall_s"] = wall
    foreign = foreign_cpu_seconds(busy_before, own_before)
    if foreign is not None:
        results["bench/foreign_cpu_s"] = foreign
        results["bench/foreign_share"] = max(0.0, foreign) / (wall * os.cpu_count())
    return results


def run_as_main(argv: list[str]) -> None:
    """Run the recipe file ``argv[0]`` as ``__main__`` with its own command line ``argv[1:]``, in this process (after
    the caller patched what it measures)."""
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def run_as_main_after_each_step(argv: list[str], after_step) -> None:
    """``run_as_main``, with ``after_step(samples, tokens)`` called after each of the recipe's optimizer steps (its
    ``RunRecord.step``, which every recipe calls once per step with the step's global counts)."""
    from shared import results

    record_step = results.RunRecord.step

    def step(self, completed_steps, loss, samples, tokens=0, answer_tokens=0) -> None:
        record_step(self, completed_steps, loss, samples, tokens, answer_tokens)
        after_step(samples, tokens)

    results.RunRecord.step = step
    run_as_main(argv)


def run_as_main_recording_model_state(argv: list[str]) -> None:
    """``run_as_main``, with every process writing the bytes of model state it holds (``lib.model_state``) to
    ``<--output_dir>/model_state_rank<R>.json`` when the recipe hands its model and optimizer to
    ``accelerator.free_memory`` at the end (every recipe does, after writing its results.json)."""
    import torch
    from accelerate import Accelerator

    from lib.model_state import model_state_bytes, reshard_fsdp2_modules

    output_dir = Path(argv[argv.index("--output_dir") + 1])
    free_memory = Accelerator.free_memory

    def recorded(self, *objects):
        models = [candidate for candidate in objects if isinstance(candidate, torch.nn.Module)]
        optimizers = [candidate for candidate in objects if isinstance(candidate, torch.optim.Optimizer)]
        if models:
            if self.is_fsdp2:
                reshard_fsdp2_modules(models[0])
            state = model_state_bytes(models[0], optimizers[0] if optimizers else None)
            (output_dir / f"model_state_rank{self.process_index}.json").write_text(json.dumps(state) + "\n")
        return free_memory(self, *objects)

    Accelerator.free_memory = recorded  # the recipe calls it on its instance: looked up on the class at each call
    run_as_main(argv)
