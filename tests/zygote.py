"""A process that has imported torch, transformers, PEFT and Accelerate once, and forks a fresh copy of itself for each
1-process launch of the suite (``tests/launch.py`` sends it the command line), the way multiprocessing's forkserver
does. Importing those libraries is most of a tiny run's time; a fork skips it and changes nothing else of the run.

Each copy runs the command a user would type, in a session of its own, with the launch's environment, working folder
and log file:

- ``python SCRIPT ARGS``: SCRIPT runs as ``__main__``, as ``python`` would run it.
- ``python -m accelerate.commands.launch --config_file C SCRIPT ARGS``: Accelerate's own launcher code reads the config
  and, where it would start one ``python SCRIPT ARGS`` process with the environment its ``simple_launcher`` prepares,
  the copy takes that environment and runs the script itself. Anything else (more processes, a config the launcher
  refuses, another interpreter) replaces the copy with the real launcher (``os.execve``).

Only on a machine without GPUs (a CUDA context does not survive a fork), and only for launches whose environment
differs from this process's in nothing read at import time (``tests/launch.py`` decides). The reply to a request is
the copy's pid, then its exit code as ``subprocess`` reports it (negative: killed by that signal).

Usage: ``python tests/zygote.py SOCKET_PATH`` (started once per test session by ``tests/launch.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys

LAUNCHER = "accelerate.commands.launch"


def preload() -> None:
    # What every recipe imports first; datasets stays out: pyarrow starts a thread, and a fork copies no threads.
    import accelerate.commands.launch  # noqa: F401
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, get_scheduler  # noqa: F401


def run_script(argv: list[str]) -> int:
    """``python SCRIPT ARGS`` in this process: the script as ``__main__``, its folder first on ``sys.path``; the exit
    code Python would give (a SystemExit's message printed to stderr, an uncaught exception's traceback)."""
    import runpy

    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def run_launch(argv: list[str]) -> int:
    """``accelerate launch ARGS`` where Accelerate's launcher would start one plain ``python SCRIPT ARGS``: the script
    runs here with the environment the launcher prepares for it. Otherwise the real launcher replaces this process."""
    from accelerate.commands import launch as accelerate_launch

    try:
        args = accelerate_launch.launch_command_parser().parse_args(argv)
        args, defaults, _ = accelerate_launch._validate_launch_command(args)
        other_launcher = (
            not args.cpu
            and (args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.multi_gpu or args.tpu)
            or defaults is not None
            and defaults.compute_environment != accelerate_launch.ComputeEnvironment.LOCAL_MACHINE
        )
        command, environment = (
            (None, None) if other_launcher else accelerate_launch.prepare_simple_launcher_cmd_env(args)
        )
    except BaseException:  # the real launcher says what is wrong, in its own words
        command = None
    if command is None or command[0] != sys.executable or len(command) < 2 or command[1].startswith("-"):
        os.execve(sys.executable, [sys.executable, "-m", LAUNCHER, *argv], dict(os.environ))
    os.environ.clear()
    os.environ.update(environment)
    return run_script(command[1:])


def child(request: dict, fds: list[int]) -> None:
    """The forked copy: the launch's session, standard streams (``fds``: a log file for stdout and stderr, or the
    asking process's stdin, stdout and stderr), environment and folder, then its command; never returns."""
    code = 1
    try:
        os.setsid()
        stdin, stdout, stderr = fds if len(fds) == 3 else (os.open(os.devnull, os.O_RDONLY), fds[0], fds[0])
        for target, fd in enumerate((stdin, stdout, stderr)):
            os.dup2(fd, target)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = request["argv"]
        code = run_launch(argv[2:]) if argv[:2] == ["-m", LAUNCHER] else run_script(argv)
        import threading

        threading._shutdown()  # non-daemon threads finish, as at the end of any Python program
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(socket_path: str) -> None:
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path + ".tmp")
    server.listen(64)
    os.replace(socket_path + ".tmp", socket_path)  # appears once it answers
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is not server:  # the asking process closed its end: it is gone, and so is its copy
                pid = key.data
                selector.unregister(key.fileobj)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                continue
            connection, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            request = json.loads(message.decode())
            pid = os.fork()
            if pid == 0:
                selector.close()
                server.close()
                for other in running.values():
                    other.close()
                child(request, fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            running[pid] = connection
            selector.register(connection, selectors.EVENT_READ, data=pid)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = running.pop(pid)
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(connection)
            with contextlib.suppress(OSError):  # the asking process may be gone
                connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()
        if os.getppid() == 1:  # the test session is gone
            return


def client(argv: list[str]) -> None:
    """Stands in for ``python ARGV`` as a launcher's worker (``accelerate launch --no_python tests/forked_python``):
    the zygote forks a copy that runs ARGV with this process's environment, folder and standard streams; signals to
    this process are passed on to it, and this process exits as it does."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(os.environ["ZYGOTE_SOCKET"])
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
