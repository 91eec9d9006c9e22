"""Run a recipe the way users do, ``accelerate launch --config_file ...``, in a subprocess.

A hang fails the test instead of hanging CI: at the timeout every process of the run (launcher and
workers) is killed. Configs use ``main_process_port: 0`` so concurrent runs never collide.

Importing torch, transformers and PEFT is most of a tiny run's time. On a machine without GPUs ``launch`` runs every
Python process of a launch (Accelerate's launcher, and the processes it starts: the child of its 1-process launcher,
torchrun's workers) as a fork of the zygote (zygote.py), a process that imported those libraries once. The
launcher's code, the environment, the arguments and the recipe's code stay the user's. A launch whose processes the
observer records (``observer_env``) is forked from zygotes that loaded the observer's hooks at their start. Launches
that set another variable read at import time, the tests of the launch itself (``Launch``: killed launchers and
workers, restarts) and GPU machines start real processes; test_harness.py compares forked runs with started ones
(weights bit for bit, losses, a refusal's exit code and paragraph).

The suite runs on the hardware it finds: CPU only (CI), one GPU, two or more GPUs. A launch of more
processes than there are GPUs runs as CPU processes over gloo (CUDA hidden): NCCL refuses two ranks on
one GPU. Tests assert the devices a run reports against ``devices_for``, never a literal ``cpu``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"
# The ``config`` that runs ``python SCRIPT ARGS`` instead of ``accelerate launch``: one process, and no launcher
# importing torch before the script does (a few seconds a run). For refusals a single process sees before any
# training, where what is checked is the message; a refusal that must be printed once by 2 processes is launched.
ONE_PROCESS = None
RECIPES = REPO / "recipes"
RUN_MARKER = "TWO_GPU_RECIPES_TEST_RUN"
OBSERVER = Path(__file__).resolve().parent / "observer"
# The environment the suite started in, before any test changed it: the zygote's.
ENVIRONMENT_AT_IMPORT = dict(os.environ)


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr together, in order
    seconds: float = 0.0  # wall time, for messages only (tests never assert on it)

    def __str__(self) -> str:
        return f"exit code {self.returncode} after {self.seconds:.0f}s; last output:\n{self.output[-4000:]}"


def visible_gpus() -> int:
    """GPUs this machine gives the tests (0 in CI)."""
    import torch

    return torch.cuda.device_count()


def devices_for(num_processes: int) -> list[str]:
    """The device each process of an N-process launch uses here: one GPU each when there are enough, else the CPU."""
    return (
        [f"cuda:{rank}" for rank in range(num_processes)]
        if visible_gpus() >= num_processes
        else ["cpu"] * num_processes
    )


def launched_processes(config_path: Path, launch_args: tuple[str, ...]) -> int:
    """Processes a launch starts in all: ``--num_processes`` if given, else the config's ``num_processes``."""
    import yaml

    args = [str(arg) for arg in launch_args]
    if "--num_processes" in args:
        return int(args[args.index("--num_processes") + 1])
    return int((yaml.safe_load(config_path.read_text()) or {}).get("num_processes", 1)) if config_path.is_file() else 1


class Launch:
    """A launch in progress: ``start`` it, find its workers (to kill or stop one), ``finish`` it.

    Every process of the run (launcher, workers, anything they start) inherits a marker in its
    environment, so all of them can be found and killed, even workers whose launcher died: torchrun
    starts each worker in a session of its own, so killing the launcher's process group is not enough.
    The output goes to a file, not a pipe, so an orphaned worker cannot block reading it.
    """

    def __init__(
        self,
        config: str | Path | None,
        script: str | Path,
        *args,
        env: dict | None = None,
        launch_args: tuple[str, ...] = (),
        cpu_only: bool | None = None,
        forked: bool = False,
        observe: bool = False,
        cwd: str | Path = REPO,
    ):
        script_path = script if Path(script).is_absolute() else RECIPES / script
        if config is None:  # ``python SCRIPT ARGS``: one process, no launcher (see ``ONE_PROCESS``)
            assert not launch_args, "launch_args need accelerate launch"
            config_path = None
            self.command = [sys.executable, str(script_path), *map(str, args)]
        else:
            config_path = config if Path(config).is_absolute() else CONFIGS / config
            self.command = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(config_path),
                *map(str, launch_args),
                str(script_path),
                *map(str, args),
            ]
        self.marker = uuid.uuid4().hex
        full_env = Launch.environment(self.marker, env, observe=observe)
        if cpu_only is None:  # more processes than GPUs: CPU processes (NCCL refuses two ranks on one GPU)
            processes = 1 if config_path is None else launched_processes(Path(config_path), launch_args)
            cpu_only = processes > visible_gpus()
        if cpu_only:
            full_env["CUDA_VISIBLE_DEVICES"] = ""
        self.cpu_only = cpu_only
        self.log = tempfile.TemporaryFile("w+")
        self.started = time.monotonic()
        self.forked = None
        # A process count is the one launch argument a fork runs as a started launch does (torchrun's workers, more
        # of them); the others (ports, restarts, machines) are what the tests of the launch itself start for real.
        forkable = [str(arg) for arg in launch_args[::2]] in ([], ["--num_processes"])
        if forked and visible_gpus() == 0 and forkable:
            kind = RECORDING if "OBSERVE_DIR" in full_env else observe  # (observer_env: the hooks from the start)
            self.forked = zygotes(kind).start(self.command[1:], full_env, self.log, cwd)
            if self.forked is not None:
                return
        self.process = subprocess.Popen(
            self.command,
            cwd=cwd,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    @staticmethod
    def environment(marker: str, env: dict | None = None, base: dict | None = None, observe: bool = False) -> dict:
        """The environment of every process of a launch: ``base`` (this process's), the suite's settings, the
        observer's when ``observe``, ``env`` and the marker."""
        base = os.environ if base is None else base
        observer = {  # test-only facts (FSDP2 sharding, device_map hooks...) taken from outside the recipe: read_facts
            "OBSERVE_FACTS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(OBSERVER), base.get("PYTHONPATH")))),
        }
        return {
            **base,
            # One thread per process: 2 processes share the 2 cores of a CI machine.
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # Tests never reach the Hugging Face Hub.
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(observer if observe else {}),
            **(env or {}),
            RUN_MARKER: marker,
        }

    def processes(self) -> list[psutil.Process]:
        """Every process of the launch: those that carry its marker, and a forked launch's own pid and descendants (a
        fork keeps the environment of the zygote it was forked from; the zygote kills the fork of a forked_python
        that goes)."""
        found = []
        if self.forked is not None and self.forked.returncode is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(self.forked.pid)
                found = [process, *process.children(recursive=True)]
        for candidate in psutil.process_iter():
            try:
                if candidate.environ().get(RUN_MARKER) == self.marker and candidate not in found:
                    found.append(candidate)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def worker(self, rank: int, timeout: float = 120) -> psutil.Process:
        """The worker process of global rank ``rank`` (waits until it exists)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in self.processes():
                try:
                    if process.environ().get("RANK") == str(rank) and "accelerate" not in " ".join(process.cmdline()):
                        return process
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    pass
            time.sleep(0.2)
        raise AssertionError(f"no worker of rank {rank} appeared within {timeout}s: {' '.join(self.command)}")

    def finish(self, timeout: float = 300) -> Run:
        """Wait for the launcher to exit (killing everything at ``timeout``) and return its result."""
        process = self.forked or self.process
        try:
            process.wait(timeout=max(0.0, self.started + timeout - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for found in self.processes():
                try:
                    found.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
            process.wait()
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        seconds = time.monotonic() - self.started
        if timed_out:
            raise AssertionError(f"timed out after {timeout}s: {' '.join(self.command)}\n{output[-4000:]}")
        return Run(process.returncode, output, seconds)


# What may differ between a launch's environment and the zygote's: variables read when a run starts, not when a
# module is imported (the zygote imported its modules under its own environment). Any other difference (the observer's
# PYTHONPATH, OBSERVE_AVX512_BF16, a library's settings) starts the launch's processes the usual way. OBSERVE_DIR is
# read at a process's exit (where the observer writes; the recording zygotes installed its hooks). The last two are
# set in this process by what it imports, to what a recipe process that needs them sets itself: torch's
# TORCHINDUCTOR_CACHE_DIR once something compiles (bitsandbytes' kernels at import), read when a process first
# compiles; scikit-learn's KMP_DUPLICATE_LIB_OK (the metrics import it), read only by Intel's OpenMP, not by the GNU
# OpenMP of torch's wheels.
RUNTIME_VARIABLES = (
    RUN_MARKER,
    "ZYGOTE_SOCKETS",
    "PYTEST_CURRENT_TEST",
    "RECIPES_HOST_RAM_GIB",
    "OBSERVE_DIR",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHINDUCTOR_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",
)
RUNTIME_PREFIXES = ("ACCELERATE_", "FSDP_", "MASTER_", "TORCHELASTIC_")


class Forked:
    """A launch whose first process is a fork of the zygote (zygote.py): its pid, and its exit code once the
    zygote reports it (one JSON line each)."""

    def __init__(self, connection: socket.socket):
        self.connection, self.returncode = connection, None
        self.pid = self._reply()["pid"]

    def _reply(self) -> dict:
        line = b""
        while not line.endswith(b"\n"):  # byte by byte: nothing of the next reply is read ahead
            byte = self.connection.recv(1)
            assert byte, "the zygote ended before the launch did"
            line += byte
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("a forked launch", timeout)
            self.returncode = self._reply()["returncode"]
            self.connection.close()
        return self.returncode


# The zygotes' kind for launches the observer records (``observer_env``), beside those without the observer (False) and
# with its facts only (True).
RECORDING = "recording"


class Zygote:
    """One of the suite's zygote processes (zygote.py), started at the first forked launch that needs it, stopped
    at exit. Each has its own hash seed (Python draws one per process), as each process of a real launch has.
    ``observe``: False, True (the observer's facts) or ``RECORDING`` (its hooks installed at start, as
    ``observer_env`` installs them in a started process; OBSERVE_DIR here is the zygote's own folder, and each copy
    writes to its launch's at exit)."""

    def __init__(self, observe: bool | str):
        self.path = Path(tempfile.mkdtemp(prefix="zygote-")) / "socket"
        recording = {
            "OBSERVE_DIR": str(self.path.parent),
            "PYTHONPATH": os.pathsep.join(filter(None, (str(OBSERVER), ENVIRONMENT_AT_IMPORT.get("PYTHONPATH")))),
        }
        environment = Launch.environment(
            "zygote", recording if observe == RECORDING else None, base=ENVIRONMENT_AT_IMPORT, observe=observe is True
        )
        self.environment = {**environment, "CUDA_VISIBLE_DEVICES": ""}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("zygote.py")), str(self.path)],
            cwd=REPO,
            env=self.environment,
            start_new_session=True,
        )

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + 180
        while not self.path.exists():
            assert self.process.poll() is None, f"the zygote exited with {self.process.returncode}"
            assert time.monotonic() < deadline, "the zygote did not start within 180 s"
            time.sleep(0.1)
        assert self.process.poll() is None, f"the zygote exited with {self.process.returncode}"

    def stop(self) -> None:
        self.process.terminate()  # it kills the forks still running
        self.process.wait()
        shutil.rmtree(self.path.parent, ignore_errors=True)


class Zygotes:
    """Two zygotes of one kind (with the observer or without), so that the processes of a launch do not all share one
    hash seed: the launcher and even ranks are forks of the first, odd ranks of the second (forked_python picks
    by RANK)."""

    def __init__(self, observe: bool | str):
        self.pair = (Zygote(observe), Zygote(observe))
        self.environment = self.pair[0].environment

    def start(self, argv: list[str], environment: dict, log, cwd: str | Path = REPO) -> Forked | None:
        """``python ARGV`` forked with ``environment``, in ``cwd``, its output in ``log``; None where ``environment``
        differs from the zygotes' in a variable that may be read at import time."""
        differing = {
            name
            for name in set(environment) | set(self.environment)
            if environment.get(name) != self.environment.get(name)
        }
        if any(name not in RUNTIME_VARIABLES and not name.startswith(RUNTIME_PREFIXES) for name in differing):
            return None
        for zygote in self.pair:
            zygote.wait_until_ready()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(str(self.pair[0].path))
        # What forked_python, started by the launcher for each process, needs to find the zygotes.
        found = {
            "ZYGOTE_SOCKETS": os.pathsep.join(str(zygote.path) for zygote in self.pair),
            "ZYGOTE_PYTHON": sys.executable,
        }
        request = {"argv": argv, "env": {**environment, **found}, "cwd": str(cwd)}
        socket.send_fds(connection, [json.dumps(request).encode()], [log.fileno()])
        return Forked(connection)

    def stop(self) -> None:
        for zygote in self.pair:
            zygote.stop()


_zygotes: dict[bool, Zygotes] = {}
_zygote_lock = threading.Lock()


def zygotes(observe: bool | str = False) -> Zygotes:
    with _zygote_lock:
        if observe not in _zygotes:
            _zygotes[observe] = Zygotes(observe)
            atexit.register(_zygotes[observe].stop)
        return _zygotes[observe]


def launch(
    config,
    script,
    *args,
    timeout: float = 300,
    env: dict | None = None,
    launch_args: tuple[str, ...] = (),
    cpu_only: bool | None = None,
    forked: bool = True,
    observe: bool = False,
    cwd: str | Path = REPO,
) -> Run:
    """``accelerate launch --config_file CONFIG [launch_args] SCRIPT ARGS`` from ``cwd`` (the repo root), to the end
    (``python SCRIPT ARGS`` where CONFIG is ``ONE_PROCESS``).
    ``cpu_only``: hide the GPUs (default: when the launch has more processes than there are GPUs).
    ``forked``: its Python processes are forks of the zygotes where ``Launch`` can fork them. ``observe``: every
    process loads observer/ (its facts: ``read_facts``); off, Accelerate and the recipe run as a user's do."""
    launched = Launch(
        config,
        script,
        *args,
        env=env,
        launch_args=launch_args,
        cpu_only=cpu_only,
        forked=forked,
        observe=observe,
        cwd=cwd,
    )
    return launched.finish(timeout)


def launch_ok(config, script, *args, **kwargs) -> Run:
    """``launch`` and assert it exited 0."""
    run = launch(config, script, *args, **kwargs)
    assert run.returncode == 0, str(run)
    return run


def read_results(output_dir: str | Path) -> dict:
    return json.loads((Path(output_dir) / "results.json").read_text())


def read_facts(output_dir: str | Path) -> dict:
    """What observer/facts.py saw in each process of the run that wrote ``output_dir``, by fact:
    ``{"fsdp/sharding": {"rank0": ..., "rank1": ...}, "device_map/hooks": {"rank0": ...}, ...}``."""
    facts: dict = {}
    for path in sorted(Path(str(output_dir).rstrip("/") + ".observed").glob("facts-rank*.json")):
        rank = path.stem.removeprefix("facts-")
        for key, value in json.loads(path.read_text()).items():
            facts.setdefault(key, {})[rank] = value
    return facts


def observer_env(folder: Path) -> dict:
    """The environment that makes every process of a launch load ``observer/sitecustomize.py``, which writes what
    the process did (weights files opened, activation bytes saved per backward, 4-bit calls) in ``folder`` at exit."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "OBSERVE_DIR": str(folder),
        "PYTHONPATH": os.pathsep.join(filter(None, (str(OBSERVER), os.environ.get("PYTHONPATH")))),
    }


def observed(folder: Path, script: str) -> dict[str, dict]:
    """``rank0``, ``rank1``, ... -> what the observer saw in the process of that rank that ran ``script``."""
    seen = {}
    for path in sorted(Path(folder).glob("*.json")):
        process = json.loads(path.read_text())
        if Path(process["script"]).name == Path(script).name:
            rank = f"rank{process['rank']}"
            assert rank not in seen, f"two processes of {rank} ran {script} in {folder}"
            seen[rank] = process
    return seen


def assert_offloaded_apart_from_plain(offload: dict, plain: dict) -> None:
    """Two 2-process FSDP2 runs' ``fsdp/sharding`` facts, one under fsdp_offload_2gpu.yaml, one under fsdp_2gpu.yaml:
    FSDP2's own per-parameter state (``offload_to_cpu``, set by the CPUOffloadPolicy ``fully_shard`` got) is on for
    every parameter of the first and for none of the second. Where the shards and AdamW's state live tells the runs
    apart only where a rank computes on a GPU: the offloaded run keeps them in host RAM, the plain one on that GPU.
    On a CPU rank host and device are one memory (FSDP2's copies to and from the host return the same tensor, and
    pinned memory needs a GPU), so the policy state is the one fact that differs there."""
    assert set(offload) == set(plain) == {"rank0", "rank1"}
    for rank, facts in offload.items():
        assert facts["offloaded_parameters"] == facts["parameters"] > 0, (rank, facts)
        assert plain[rank]["offloaded_parameters"] == 0, (rank, plain[rank])
        device = devices_for(2)[int(rank.removeprefix("rank"))]
        if device != "cpu":
            assert facts["shard_devices"] == facts["optimizer_state_devices"] == ["cpu"], (rank, facts)
            assert plain[rank]["shard_devices"] == plain[rank]["optimizer_state_devices"] == [device], (rank, plain)


@dataclass
class Job:
    """One launch for ``launch_all``. ``after``: a job whose outputs this one reads (e.g. a checkpoint);
    ``prepare``: called just before the launch (e.g. to copy those outputs into place)."""

    config: str | Path | None
    script: str | Path
    args: tuple = ()
    env: dict | None = None
    after: str | None = None
    prepare: Callable[[], object] | None = None
    kwargs: dict = field(default_factory=dict)


def launch_all(jobs: dict, cpu_only: bool | None = None, workers: int = 2) -> dict[str, Run]:
    """Launch independent runs ``workers`` at a time and return name -> Run. Start-up (importing torch,
    transformers, datasets) is most of a tiny run's time and leaves a core idle whenever one process waits
    for another, so two launches at once keep a 2-core machine busy; a hang still fails through the timeout.

    ``jobs``: name -> ``Job`` or ``(config, script, *args)``, started in order; a job with ``after`` waits
    for that earlier job, which has started by then (the pool takes jobs first in, first out)."""
    jobs = {name: job if isinstance(job, Job) else Job(job[0], job[1], tuple(job[2:])) for name, job in jobs.items()}
    futures: dict[str, Future] = {}

    def run(job: Job) -> Run:
        if job.after is not None and futures[job.after].result().returncode != 0:
            return Run(1, f"not launched: {job.after}, whose outputs it needs, failed")
        if job.prepare is not None:
            job.prepare()
        return launch(job.config, job.script, *job.args, env=job.env, **{"cpu_only": cpu_only, **job.kwargs})

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for name, job in jobs.items():
            assert job.after is None or job.after in futures, f"{name} runs after {job.after}, which must come first"
            futures[name] = pool.submit(run, job)
        return {name: future.result() for name, future in futures.items()}
