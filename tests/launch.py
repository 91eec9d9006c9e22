"""Run a recipe the way users do, ``accelerate launch --config_file ...``, in a subprocess.

A hang fails the test instead of hanging CI: the whole process group (launcher and workers) is
killed at the timeout. Configs use ``main_process_port: 0`` so concurrent runs never collide.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
RECIPES = REPO / "recipes"
RUN_MARKER = "TWO_GPU_RECIPES_TEST_RUN"


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr together, in order

    def __str__(self) -> str:
        return f"exit code {self.returncode}; last output:\n{self.output[-4000:]}"


def launch(config: str | Path, script: str | Path, *args: str, timeout: float = 300, env: dict | None = None,
           launch_args: tuple[str, ...] = ()) -> Run:
    """``accelerate launch --config_file CONFIG [launch_args] SCRIPT ARGS`` from the repo root."""
    config_path = config if Path(config).is_absolute() else CONFIGS / config
    script_path = script if Path(script).is_absolute() else RECIPES / script
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path),
               *launch_args, str(script_path), *map(str, args)]
    full_env = {
        **os.environ,
        # One thread per process: 2 processes share the 2 cores of a CI machine.
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # Tests never reach the Hugging Face Hub.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    # Every process of this run (launcher, workers, anything they start) inherits this marker, so
    # all of them can be found and killed, even workers whose launcher died (torchrun starts each
    # worker in a session of its own, so killing the launcher's process group is not enough).
    marker = uuid.uuid4().hex
    full_env[RUN_MARKER] = marker
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: an orphaned worker cannot block reading it
        process = subprocess.Popen(command, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_run(marker)
            process.wait()
        log.seek(0)
        output = log.read()
    if timed_out:
        raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}\n{output[-4000:]}")
    return Run(process.returncode, output)


def kill_run(marker: str) -> None:
    """SIGKILL every process that carries this run's marker."""
    for candidate in psutil.process_iter():
        try:
            if candidate.environ().get(RUN_MARKER) == marker:
                candidate.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def launch_ok(config, script, *args, **kwargs) -> Run:
    """``launch`` and assert it exited 0."""
    run = launch(config, script, *args, **kwargs)
    assert run.returncode == 0, str(run)
    return run


def read_results(output_dir: str | Path) -> dict:
    return json.loads((Path(output_dir) / "results.json").read_text())
