"""A process that has imported torch, transformers and PEFT once, and forks a fresh copy of itself for each Python
process of a launch (``launch.py`` asks it), the way multiprocessing's forkserver does: importing those libraries
is most of a tiny run's time.

A copy runs what the process would have run, in a session of its own, with that process's environment, working folder
and standard streams:

- the launcher, ``python -m accelerate.commands.launch ARGS`` (or ``python -m torch.distributed.run ARGS``, the
  benchmark runner's raw baseline): the launcher module runs as ``__main__`` with ``sys.executable`` set to
  ``forked_python``, so the ``python SCRIPT ARGS`` processes it starts (its 1-process launcher's child; torchrun's
  workers) are copies too;
- ``python [-u] SCRIPT ARGS`` (a recipe): the script runs as ``__main__``, as ``python`` runs it.

``forked_python`` stands in for ``python``: it asks for a copy with its own environment, folder and streams,
passes signals on, dies with its parent (``PR_SET_PDEATHSIG``) and exits as the copy does; when it goes, the zygote
kills the copy's process group. Only on a machine without GPUs (a CUDA context does not survive a fork) and for
launches whose environment differs from this process's in nothing read at import time (``launch.py`` decides).
What differs from a started process: the copies of one launch share their zygote's hash seed (launch.py starts
two, and odd ranks are copies of the second: ranks do not share one; ``random`` and NumPy's global generator are
reseeded), their tracebacks show runpy's frames, and the objects the zygote made importing the libraries are frozen
(``gc.freeze()``, as fork servers do): a copy's garbage collections, and the one at its exit, skip them (a started
process spends about 1.5 s of CPU at its exit walking them). A copy exits through Python's own teardown, as a started
process does.

Usage: ``python tests/harness/zygote.py SOCKET_PATH`` (launch.py starts one per test session);
``python tests/harness/zygote.py --client ARGS`` (forked_python)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import sys

# Accelerate's launcher, and torchrun (the benchmarks' raw PyTorch baseline): their workers are copies too.
LAUNCHERS = ("accelerate.commands.launch", "torch.distributed.run")
FORKED_PYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forked_python")


def preload() -> None:
    # What every recipe imports first. Not datasets (pyarrow starts a thread, and a fork copies no threads), not
    # Accelerate's launcher module (importing it configures the root logger).
    import accelerate  # noqa: F401
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, get_scheduler  # noqa: F401


def run_python(argv: list[str]) -> int:
    """``python ARGV`` in this process (``[-u] SCRIPT ARGS`` or ``[-u] -m MODULE ARGS``), with the exit code Python
    would give: a SystemExit's code, its message printed to stderr; an uncaught exception's traceback and 1."""
    import runpy

    argv = argv[1:] if argv[:1] == ["-u"] else list(argv)  # unbuffered already: PYTHONUNBUFFERED=1
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def child(request: dict, fds: list[int]) -> int:
    """The forked copy: its session, standard streams (``fds``: stdin, stdout, stderr, or one log file for stdout and
    stderr), environment and folder, then ``python ARGV``; returns its exit code, with which the copy then exits
    through Python's own teardown (atexit handlers, threads, module and object teardown), as a started process does:
    a crash there fails the launch."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stdin, stdout, stderr = fds if len(fds) == 3 else (os.open(os.devnull, os.O_RDONLY), fds[0], fds[0])
        for target, fd in enumerate((stdin, stdout, stderr)):
            os.dup2(fd, target)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # (random reseeds itself in a forked child: random.py registers os.register_at_fork; numpy does not.)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        argv = request["argv"]
        if any(argv[:2] == ["-m", launcher] for launcher in LAUNCHERS):
            sys.executable = FORKED_PYTHON  # what the launcher and torchrun start its processes with
        code = run_python(argv)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    return code


def serve(socket_path: str) -> None:
    preload()
    gc.freeze()  # the libraries' objects: no collection in a copy walks them again
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path + ".tmp")
    server.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # pid -> the connection that asked for it

    def kill_group(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def stop(*_) -> None:
        for pid in running:
            kill_group(pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    os.replace(socket_path + ".tmp", socket_path)  # appears once it answers
    while os.getppid() == parent:  # until the test session is gone
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is not server:  # the asking process closed its end: it is gone, and so is its copy
                selector.unregister(key.fileobj)
                kill_group(key.data)
                continue
            connection, _ = server.accept()
            fds = []
            try:
                connection.settimeout(10)
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                request = json.loads(message.decode())
                connection.settimeout(None)
            except (OSError, ValueError):  # a process that went before it asked
                for fd in fds:
                    os.close(fd)
                connection.close()
                continue
            pid = os.fork()
            if pid == 0:
                selector.close()
                server.close()
                for other in running.values():
                    other.close()
                raise SystemExit(child(request, fds))  # out of serve(): the interpreter's own exit
            for fd in fds:
                os.close(fd)
            running[pid] = connection
            try:
                connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                selector.register(connection, selectors.EVENT_READ, data=pid)
            except OSError:
                kill_group(pid)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            kill_group(pid)  # what it started and left behind
            connection = running.pop(pid)
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(connection)
            with contextlib.suppress(OSError):  # the asking process may be gone
                connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()
    stop()


def client(argv: list[str]) -> None:
    """``python ARGV`` for a launcher (forked_python): a copy from the zygote runs it with this process's
    environment, folder and standard streams; signals to this process are passed on, and it exits as the copy does."""
    import ctypes

    if sys.platform.startswith("linux"):  # dies with its parent, as the recipes' workers do (shared/errors.py)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sockets = os.environ["ZYGOTE_SOCKETS"].split(os.pathsep)  # one zygote, one hash seed, per rank's parity
    connection.connect(sockets[int(os.environ.get("RANK", "0")) % len(sockets)])
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
    replies = connection.makefile("r")
    pid = json.loads(replies.readline())["pid"]
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, lambda number, frame: os.kill(pid, number))
    line = replies.readline()
    code = json.loads(line)["returncode"] if line else -signal.SIGKILL
    if code < 0:  # ended by a signal: end the same way, so that the launcher reports it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        client(sys.argv[2:])
    else:
        serve(sys.argv[1])
