"""Prints what a test of the harness asks about this process: its rank's string hash (a per-process random seed),
whether observer/ was loaded and Accelerate's free_memory patched; with --crash_at_exit, it leaves an object whose
finalizer crashes the interpreter (SIGSEGV) during Python's own teardown, after the script has ended."""

import ctypes
import os
import sys

import accelerate

print(
    f"rank {os.environ.get('RANK', '0')}: hash {hash('two-gpu-recipes')}, observer {'sitecustomize' in sys.modules}, "
    f"free_memory from {accelerate.Accelerator.free_memory.__module__}",
    flush=True,
)


class CrashAtTeardown:
    def __del__(self):
        ctypes.string_at(0)  # reads address 0: SIGSEGV


if "--crash_at_exit" in sys.argv:
    sys.modules["__crash_at_teardown__"] = type(sys)("__crash_at_teardown__")
    sys.modules["__crash_at_teardown__"].keep = CrashAtTeardown()
