"""Hang dumps: when a collective times out, or a rank makes no progress, every rank that can still run writes to
``<output_dir>/debug/`` its Python stacks (all threads, ``faulthandler``), the step and the collective it was waiting
in; under NCCL torch's flight recorder adds its trace of the last collectives. A stopped or dead rank writes nothing,
itself the clue: the others' dumps name the collective that waited for it. Active with 2+ processes only.

Put it in front of any recipe of the launch line; it reads the recipe's ``--output_dir`` and ``--dist_timeout`` and
runs the recipe unchanged (runpy, as ``python recipe.py`` would):

    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml tools/hang_dump.py recipes/train_lm.py \\
        --output_dir outputs/train_lm --dist_timeout 120

Before the recipe starts it sets NCCL's flight-recorder variables (NCCL reads them when the process group starts),
registers a ``sys.excepthook`` and counts optimizer steps through torch's global optimizer step hook."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import json
import os
import runpy
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# What gloo says when the process at the other end exited (as shared.errors.PEER_ENDED): not a hang of this rank, and
# the recipe's install_peer_exit_hooks prints its one line for it.
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
        clear_earlier_dumps(self.folder, self.rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
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
        if any(words in text.lower() for words in PEER_ENDED):  # another process ended first: nothing to dump here
            return self._previous_hook(kind, error, trace)
        if isinstance(error, torch.distributed.DistError) or any(word in text.lower() for word in HANG_ERRORS):
            details = "".join(traceback.format_exception(kind, error, trace))
            path = self._write("error", text, traceback.extract_tb(trace), details)
            waiting = json.loads(path.with_suffix(".json").read_text())["waiting_in"]
            print(
                f"[rank {self.rank}] error: a collective failed at step {self.completed_steps} "
                f"({self.current_phase}), waiting in {waiting}: {str(error).splitlines()[0][:300]}. Every rank that "
                f"could still run wrote its stacks, step and collective to {self.folder}/ (this one: {path.name}).",
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


def clear_earlier_dumps(folder: Path, rank: int, restart: int) -> None:
    """What ``rank`` wrote in an earlier run into the same folder describes that run, not this one: removed. In an
    attempt torchrun restarted (``restart`` > 0, --max_restarts) the earlier attempts' dumps are why it restarted:
    each is kept, renamed after its attempt (rank0_error.attempt0.txt)."""
    for stale in folder.glob(f"rank{rank}_*"):
        with contextlib.suppress(OSError):
            if not restart:
                stale.unlink()
            elif ".attempt" not in stale.name:
                stale.rename(stale.with_name(f"{stale.stem}.attempt{restart - 1}{stale.suffix}"))


def waiting_in(frames) -> str:
    """The innermost torch.distributed call of a stack and the line of our code that made it, e.g. ``all_reduce
    (called from recipes/linear_toy.py:158)``; a backward pass stands for DDP/FSDP's gradient collectives."""
    ours = [frame for frame in frames if "site-packages" not in frame.filename and "/lib/python" not in frame.filename]
    caller = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "unknown"
    if any(frame.filename.startswith("<frozen importlib") for frame in frames):  # a slow import, not a hang
        return f"no collective on the stack (importing, at {caller})"
    for frame in reversed(frames):
        if "torch/distributed" in frame.filename.replace("\\", "/") and not frame.name.startswith("_"):
            return f"{frame.name} (called from {caller})"
        if frame.name in ("backward", "_engine_run_backward"):
            return f"backward: the gradient all-reduce / reduce-scatter (called from {caller})"
    return f"no collective on the stack (at {caller})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s RECIPE [RECIPE FLAGS]")
    parser.add_argument("recipe", help="The recipe to run, e.g. recipes/train_lm.py; the flags after it are its own.")
    parser.add_argument("recipe_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if not Path(args.recipe).is_file():
        parser.error(f"{args.recipe!r} is not a file: name the recipe to run first, then its flags")
    # The recipe's own values of the two flags this reads, with the recipes' defaults (outputs/<recipe name>, and
    # add_reliability_flags's 600 s); the recipe parses and checks all of its flags itself.
    flags = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    flags.add_argument("--output_dir", default=str(Path("outputs") / Path(args.recipe).stem))
    flags.add_argument("--dist_timeout", default="600")
    try:
        known, _ = flags.parse_known_args(args.recipe_flags)
        dist_timeout = float(known.dist_timeout)
    except (argparse.ArgumentError, ValueError):  # the recipe stops first, with its own message
        known, dist_timeout = argparse.Namespace(output_dir=flags.get_default("output_dir")), None
    HangDump(Path(known.output_dir) / "debug", dist_timeout)
    # As ``python recipe.py`` would: its own folder first on sys.path (not tools/), its own command line.
    sys.path[0], sys.argv = str(Path(args.recipe).resolve().parent), [args.recipe, *args.recipe_flags]
    runpy.run_path(args.recipe, run_name="__main__")


if __name__ == "__main__":
    main()
