"""A run stopped by a signal ends with a checkpoint. SLURM (``#SBATCH --signal=TERM@120``), Kubernetes and spot
machines send SIGTERM some time before they kill; Ctrl-C sends SIGINT. Either one is noted, the optimizer step in
progress finishes, every process stops after the same step (each may get the signal a moment apart, so they agree in
a collective), the recipe saves a checkpoint, says which and how to resume, and exits with 128 + the signal's number
(130: Ctrl-C, 143: SIGTERM), which tells a scheduler to requeue the job."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from .checkpoints import resume_command, where_to_resume


class StopOnSignals:
    """What ``install_stop_on_signals`` returns: ``requested`` after every optimizer step, ``exit`` after the
    checkpoint it asks for. A second Ctrl-C stops at once (saying where to resume); a second SIGTERM is ignored (SLURM
    signals the launcher, which passes it on, and the workers themselves)."""

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
        """True on every process when any of them got a signal. A collective under several processes: a CPU
        all-reduce on a gloo group of its own (made at the first call, which every process makes after step 1), so
        no device waits for it."""
        self.completed_steps = completed_steps
        flag = torch.tensor([self.signal])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            self.group = self.group or torch.distributed.new_group(backend="gloo")
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self.signal = self.signal or int(flag)
        return bool(flag)

    def exit(self, checkpoint: Path) -> None:
        """Say, once, which signal stopped the run, the checkpoint just saved and how to resume; then exit with 128 +
        the signal's number on every process."""
        if os.environ.get("RANK", "0") == "0":
            name = signal.Signals(self.signal).name
            print(
                f"stopped by {name} after step {self.completed_steps}: saved the checkpoint {checkpoint}. Resume with "
                f"{resume_command()}",
                flush=True,
            )
        raise SystemExit(128 + self.signal)


def install_stop_on_signals(checkpoints_dir: str | os.PathLike) -> StopOnSignals:
    """Replace this process's SIGTERM and SIGINT handlers with ``StopOnSignals``'s (SIGINT no longer raises
    KeyboardInterrupt at once). Call it once, at the top of ``main()``."""
    stop = StopOnSignals(Path(checkpoints_dir))
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop.noted)
    return stop
