"""A run stopped by SIGTERM or Ctrl-C ends with a checkpoint, then exits 128 + the signal (a scheduler requeues)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from .checkpoints import resume_command, where_to_resume


class StopOnSignals:
    """``requested`` after every optimizer step, ``exit`` after the checkpoint it asks for; a second Ctrl-C stops."""

    def __init__(self, checkpoints_dir: Path):
        self.checkpoints_dir, self.signal, self.group, self.completed_steps = checkpoints_dir, 0, None, 0

    def noted(self, number: int, frame) -> None:
        if number == self.signal == signal.SIGINT:
            if os.environ.get("RANK", "0") == "0":  # printed once (the Accelerator may not be built yet)
                resume = where_to_resume(self.checkpoints_dir)
                print(f"interrupted by a second Ctrl-C in step {self.completed_steps + 1}: {resume}", flush=True)
            raise SystemExit(128 + number)
        self.signal = self.signal or number

    def requested(self, completed_steps: int) -> bool:
        """True on every process when any of them got a signal: a CPU all-reduce on a gloo group of its own."""
        self.completed_steps = completed_steps
        flag = torch.tensor([self.signal])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            self.group = self.group or torch.distributed.new_group(backend="gloo")
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self.signal = self.signal or int(flag)
        return bool(flag)

    def exit(self, checkpoint: Path) -> None:
        """Say once which signal stopped the run and how to resume; exit with 128 + its number on every process."""
        if os.environ.get("RANK", "0") == "0":
            name, steps = signal.Signals(self.signal).name, self.completed_steps
            said = f"stopped by {name} after step {steps}: saved the checkpoint {checkpoint}"
            print(f"{said}. Resume with {resume_command()}", flush=True)
        raise SystemExit(128 + self.signal)


def install_stop_on_signals(checkpoints_dir: str | os.PathLike) -> StopOnSignals:
    """Replace this process's SIGTERM and SIGINT handlers with ``StopOnSignals``'s, returned."""
    stop = StopOnSignals(Path(checkpoints_dir))
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop.noted)
    return stop
