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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
RECIPES = REPO / "recipes"


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
    process = subprocess.Popen(command, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}\n{output[-4000:]}") from None
    return Run(process.returncode, output)


def launch_ok(config, script, *args, **kwargs) -> Run:
    """``launch`` and assert it exited 0."""
    run = launch(config, script, *args, **kwargs)
    assert run.returncode == 0, str(run)
    return run


def read_results(output_dir: str | Path) -> dict:
    return json.loads((Path(output_dir) / "results.json").read_text())
