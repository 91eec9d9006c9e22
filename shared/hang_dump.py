"""Hang dumps: when a collective times out, or a rank makes no progress, every rank that can still run writes to
``<output_dir>/debug/`` its Python stacks (all threads, ``faulthandler``), the step and the collective it was waiting
in; under NCCL torch's flight recorder adds its trace of the last collectives. A stopped or dead rank writes nothing,
itself the clue: the others' dumps name the collective that waited for it. Active with 2+ processes only.

A recipe starts it with one line at the top of ``main()``, before the Accelerator: ``hang_dump.start(output_dir /
"debug", dist_timeout)``. That line sets NCCL's flight-recorder variables (NCCL reads them when the process group
starts), registers a ``sys.excepthook``, and counts optimizer steps through torch's global optimizer step hook."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .runtime import FAILED_RANK_KEY  # the rank whose RecipeError ended the run (shared.runtime.report_recipe_errors)

# What gloo says when the process at the other end exited (NCCL: the watchdog reports a timeout instead).
PEER_ENDED = ("connection closed by peer", "connection reset by peer")
# Words of the errors a timed-out or broken collective raises (gloo: "Timed out waiting 5000ms for recv operation",
# "Connection closed by peer"; NCCL: "Watchdog caught collective operation timeout").
HANG_ERRORS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "nccl",
    "gloo",
    "processgroup",
)


class HangDump:
    """Start it before the Accelerator (NCCL reads its settings when the group starts). Every optimizer step counts as
    progress (torch's global step hook). After 0.8 x ``dist_timeout`` without one, while the main thread waits in a
    collective, a watcher writes ``rank{R}_stalled.txt`` (a stuck rank leaves its stacks before the timeout kills the
    run); a process dying of a collective error writes ``rank{R}_error.txt`` and one line on stderr naming the
    folder."""

    def __init__(self, debug_dir: str | os.PathLike, dist_timeout_s: float | None):
        self.folder, self.rank = Path(debug_dir).resolve(), int(os.environ.get("RANK", "0"))
        self.active = int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.completed_steps, self.current_phase, self.last_progress = 0, "start-up", time.monotonic()
        self.stall_after_s = max(1.0, 0.8 * dist_timeout_s) if dist_timeout_s else None
        if not self.active:
            return
        # torch's NCCL flight recorder: keep the last 2,000 collectives and dump them on a timeout, beside ours.
        # (torch 2.13 names: TORCH_FR_* replaced TORCH_NCCL_TRACE_BUFFER_SIZE / _DEBUG_INFO_TEMP_FILE.)
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(self.folder / "nccl_trace_rank_"))
        # What this rank wrote in an earlier run into the same output_dir describes that run, not this one.
        for stale in self.folder.glob(f"rank{self.rank}_*"):
            with contextlib.suppress(OSError):
                stale.unlink()
        if torch.cuda.is_available():
            with contextlib.suppress(OSError):  # NCCL writes here; a bad --output_dir is the recipe's to report
                self.folder.mkdir(parents=True, exist_ok=True)
        # Our own dumps create the folder when they write; an empty one is removed at exit (no empty debug/ beside
        # every result).
        atexit.register(self._remove_if_empty)
        self._previous_hook = sys.excepthook
        sys.excepthook = self._on_uncaught
        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: self.step())
        if self.stall_after_s:  # a daemon: it never keeps a finished run alive
            threading.Thread(target=self._watch, name="hang-dump-watcher", daemon=True).start()

    def _remove_if_empty(self) -> None:
        with contextlib.suppress(OSError):  # not empty, or another rank removed it first
            self.folder.rmdir()

    def step(self) -> None:
        """One more optimizer step of this process (steps skipped by fp16's scaler or before a resume not counted)."""
        self.completed_steps, self.current_phase, self.last_progress = (
            self.completed_steps + 1,
            "training",
            time.monotonic(),
        )

    def _watch(self) -> None:
        reported = None
        while True:
            time.sleep(min(1.0, self.stall_after_s / 4))
            idle = time.monotonic() - self.last_progress
            if idle > self.stall_after_s and reported != self.last_progress:
                main = sys._current_frames().get(threading.main_thread().ident)
                frames = traceback.extract_stack(main) if main else []
                if waiting_in(frames).startswith("no collective"):  # a long evaluation or save, not a hang
                    continue
                reported = self.last_progress
                self._write("stalled", f"no progress for {idle:.0f} s", frames)

    def _on_uncaught(self, kind, error, trace) -> None:
        text = f"{kind.__name__}: {error}"
        if any(words in text.lower() for words in PEER_ENDED):
            # A peer exited (its own error, if any, is above; the launcher names it): one line instead of a traceback
            # and a dump of a process that was only waiting for it.
            # sys.__stderr__: torch's own excepthook (around this one) collects sys.stderr to prefix it, and prints
            # nothing of it when this one exits the process.
            print(
                f"[rank {self.rank}] stopped: {failed_rank()} ended first, at step {self.completed_steps} "
                f"({self.current_phase}); its error, if it had one, is above.",
                file=sys.__stderr__,
                flush=True,
            )
            sys.stdout.flush()
            # The failed process exits first (its exit is what the launcher reports as the root cause, with its
            # paragraph) and the launcher reads this line before it stops reading our output.
            time.sleep(2)
            os._exit(1)  # (no traceback, and no wait for threads of a run that is over)
        if isinstance(error, torch.distributed.DistError) or any(word in text.lower() for word in HANG_ERRORS):
            details = "".join(traceback.format_exception(kind, error, trace))
            path = self._write("error", text, traceback.extract_tb(trace), details)
            waiting = json.loads(path.with_suffix(".json").read_text())["waiting_in"]
            print(
                f"[rank {self.rank}] error: a collective failed at step {self.completed_steps} "
                f"({self.current_phase}), "
                f"waiting in {waiting}: {str(error).splitlines()[0][:300]}. Every rank that could still run wrote "
                "its "
                f"stacks, step and collective to {self.folder}/ (this one: "
                f"{path.name}).",
                file=sys.stderr,
                flush=True,
            )
        self._previous_hook(kind, error, trace)

    def _write(self, event: str, reason: str, frames, error_text: str = "") -> Path:
        """``rank{R}_{event}.txt`` (reason, step, collective, every thread's stack) and a ``.json`` of the facts."""
        facts = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "event": event,
            "reason": reason,
            "step": self.completed_steps,
            "phase": self.current_phase,
            "waiting_in": waiting_in(frames),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}_{event}.txt"
        with open(path, "w") as dump:
            dump.write(json.dumps(facts, indent=2) + "\n\n" + error_text + "\nPython stacks of every thread:\n")
            dump.flush()
            faulthandler.dump_traceback(file=dump, all_threads=True)
        path.with_suffix(".json").write_text(json.dumps(facts, indent=2) + "\n")
        return path


# The run's one HangDump, started by ``start`` (a recipe's main() calls it before the process group).
_current: HangDump | None = None


def start(debug_dir: str | os.PathLike, dist_timeout_s: float | None) -> HangDump:
    """Start this process's hang dumps (once; a second call returns the first one)."""
    global _current
    if _current is None:
        _current = HangDump(debug_dir, dist_timeout_s)
    return _current


def failed_rank() -> str:
    """``rank N`` when a RecipeError of rank N ended the run (it leaves its rank in the group's store, see
    shared.runtime.report_recipe_errors), else ``another process``."""
    with contextlib.suppress(Exception):  # no group, no store, or the store went with the failed process
        store = torch.distributed.distributed_c10d._get_default_store()
        if store.check([FAILED_RANK_KEY]):
            return "rank " + store.get(FAILED_RANK_KEY).decode()
    return "another process"


def waiting_in(frames) -> str:
    """The innermost torch.distributed call of a stack and the line of our code that made it, e.g. ``all_reduce
    (called from recipes/linear_toy.py:158)``; a backward pass stands for DDP/FSDP's gradient collectives."""
    ours = [frame for frame in frames if "site-packages" not in frame.filename and "/lib/python" not in frame.filename]
    caller = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "unknown"
    for frame in reversed(frames):
        if "torch/distributed" in frame.filename.replace("\\", "/") and not frame.name.startswith("_"):
            return f"{frame.name} (called from {caller})"
        if frame.name in ("backward", "_engine_run_backward"):
            return f"backward: the gradient all-reduce / reduce-scatter (called from {caller})"
    return f"no collective on the stack (at {caller})"
