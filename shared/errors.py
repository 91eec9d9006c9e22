"""Errors a user can read, printed once, and how the processes of a run stop together (docs/troubleshooting.md)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from accelerate.state import PartialState
from accelerate.utils import gather_object
from torch.optim.optimizer import register_optimizer_step_post_hook


# The rank whose RecipeError ended the run first, in the process group's store (read by install_peer_exit_hooks).
FAILED_RANK_KEY = "two_gpu_recipes/failed_rank"
# What gloo says when the process at the other end exited (NCCL: the watchdog reports a timeout instead).
PEER_ENDED = ("connection closed by peer", "connection reset by peer")


class RecipeError(SystemExit):
    """Bad input or setup: one paragraph on stderr, exit status 1, no traceback (``printed=False``: exit silently)."""

    def __init__(self, message: str, printed: bool = True):
        self.message = " ".join(message.split())
        rank, world_size = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
        # One line per rank, its newline in the message: Python writes a SystemExit's newline apart, and lines mix.
        prefix, end = ("[rank " + rank + "] ", "\n") if world_size > 1 else ("", "")
        super().__init__(prefix + "error: " + self.message + end if printed else 1)


@contextlib.contextmanager
def report_recipe_errors():
    """Around ``main()``: a RecipeError printed once per machine, its paragraph and rank left for the launcher."""
    try:
        yield
    except RecipeError as error:
        if error.code == 1 or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            raise
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            with contextlib.suppress(OSError):
                Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(
                    json.dumps({"message": "error: " + error.message, "timestamp": int(time.time())})
                )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.distributed_c10d._get_default_store().set(FAILED_RANK_KEY, os.environ["RANK"])
        if not first_to_report(error.message):
            raise SystemExit(1) from None
        raise


def first_to_report(message: str) -> bool:
    """True for the first process of this machine's launch to report ``message`` (a marker file, created once)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return True
    marker = Path(error_file).parent.parent / f"recipe_error_{hashlib.sha256(message.encode()).hexdigest()[:16]}"
    try:
        descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # this process's own earlier report of it (an error caught and raised again) counts
        with contextlib.suppress(OSError, ValueError):
            return int(marker.read_text() or 0) == os.getpid()
        return False
    except OSError:
        return True
    with os.fdopen(descriptor, "w") as file:
        file.write(str(os.getpid()))
    return True


def stop_if_found(problem: str | None, cleanup=None) -> None:
    """Stop every process if any found ``problem`` (None: nothing wrong), printed once, after ``cleanup()``."""
    state = PartialState()
    problems = gather_object([problem]) if state.num_processes > 1 else [problem]
    found = next((found for found in problems if found), None)
    if found:
        if cleanup is not None:
            cleanup()
        raise RecipeError(found, printed=state.is_main_process)


def install_peer_exit_hooks() -> None:
    """A rank stopped by another's exit says so in one line. Changes: ``sys.excepthook``, a global optimizer hook."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    rank, steps, previous_hook = os.environ.get("RANK", "0"), 0, sys.excepthook

    def count_step(optimizer, args, kwargs):
        nonlocal steps
        steps += 1

    def hook(kind, error, trace):
        # A collective's error only: a download's "Connection reset by peer" is this rank's own, with its traceback.
        files = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(trace)]
        collective = isinstance(error, torch.distributed.DistError) or any(
            "torch/distributed/" in file or "torch/autograd/" in file for file in files
        )
        if not collective or not any(words in f"{kind.__name__}: {error}".lower() for words in PEER_ENDED):
            return previous_hook(kind, error, trace)
        failed = "another process"
        with contextlib.suppress(Exception):  # no group, no store, or the store went with the failed process
            store = torch.distributed.distributed_c10d._get_default_store()
            failed = "rank " + store.get(FAILED_RANK_KEY).decode() if store.check([FAILED_RANK_KEY]) else failed
        # sys.__stderr__: torch's excepthook around this one holds sys.stderr back, and prints none if this one exits.
        said = f"[rank {rank}] stopped: {failed} ended first, at step {steps} ({'training' if steps else 'start-up'})"
        print(f"{said}; its error, if it had one, is above.", file=sys.__stderr__, flush=True)
        sys.stdout.flush()
        atexit._run_exitfuncs()  # the handlers a normal exit runs (a tracker's flush), before the launcher's SIGTERM
        # The failed process exits first (the launcher's root cause), and the launcher reads this line before it stops.
        time.sleep(2)
        os._exit(1)  # no traceback, and no wait for the threads of a run that is over

    register_optimizer_step_post_hook(count_step)
    sys.excepthook = hook


def set_stop_with_launcher() -> None:
    """Under a launcher, on Linux, die with it. Changes this process: its parent-death signal (prctl)."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ
    if launched and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)
