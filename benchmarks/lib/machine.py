"""The machine a benchmark ran on, as every record states it: CPU model and vector flags, cores, RAM, GPUs, library
versions; and the CPU time other processes used during a launch. Torch-free: the runner's parent process stays light.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from lib.flops import peak_bf16_flops

LIBRARIES = ["torch", "accelerate", "transformers", "datasets", "tokenizers", "numpy", "evaluate"]
CPU_FLAGS = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "sve"}


def gpu_info() -> list[dict]:
    """GPU names and memory from nvidia-smi (no torch import: the runner stays light)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, memory, driver = (part.strip() for part in line.split(","))
        gpus.append(
            {
                "name": name,
                "memory_gib": round(float(memory) / 1024, 1),
                "driver": driver,
                "peak_bf16_flops": peak_bf16_flops(name),
            }
        )
    return gpus


def machine_info() -> dict:
    """CPU model, cores, RAM, GPUs. tools/check_setup.py reads the same /proc files, but importing it
    would load torch into the runner's long-lived parent process."""
    cpu_model = platform.processor() or None
    memory_gib, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu_model in (None, "", platform.processor()):
                cpu_model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                # The vector extensions that decide CPU speed here: without avx512_bf16/amx_bf16, bf16 autocast is
                # emulated (~10x slower than fp32 on our machines), so CPU numbers are compared in fp32.
                flags = sorted(set(line.split(":", 1)[1].split()) & CPU_FLAGS)
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory_gib = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return {
        "cpu_model": cpu_model,
        "cpu_cores": os.cpu_count(),
        "cpu_flags": flags,
        "memory_gib": memory_gib,
        "os": platform.platform(),
        "gpus": gpu_info(),
    }


def library_versions(names=LIBRARIES) -> dict:
    """Python's version and each installed library's (None when it is missing)."""
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def busy_cpu_seconds() -> float | None:
    """CPU time all processes on the machine have used (Linux /proc/stat: everything but idle/iowait)."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return None
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time used by this process's finished child processes (the launched runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def foreign_cpu_seconds(busy_before: float | None, own_before: float) -> float | None:
    """CPU time other processes used since ``busy_cpu_seconds()`` and ``own_cpu_seconds()`` read ``busy_before`` and
    ``own_before`` (the machine's busy time minus this process's children's): divided by the wall time and the cores,
    it shows a ratio taken while the machine was busy. None where /proc/stat cannot be read."""
    if busy_before is None:
        return None
    return (busy_cpu_seconds() - busy_before) - (own_cpu_seconds() - own_before)
