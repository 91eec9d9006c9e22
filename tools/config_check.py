"""Check Accelerate config files for the mistakes that launch without an error but run the wrong thing.

    python tools/config_check.py accelerate_configs/*.yaml

Exit code 1 and one line per problem if any file has one. What it catches:
- ``distributed_type: NO`` unquoted: YAML reads it as the boolean false (write ``'NO'``);
- ``distributed_type: 'NO'`` with ``num_processes`` > 1: Accelerate silently starts ONE process;
- a multi-process type (``MULTI_GPU``...) with ``num_processes: 1``: no data parallelism at all;
- a file Accelerate's own loader rejects, or that does not exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from accelerate.commands.config.config_args import load_config_from_file

MULTI_PROCESS_TYPES = {
    "MULTI_GPU",
    "MULTI_CPU",
    "MULTI_NPU",
    "MULTI_XPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_HPU",
    "FSDP",
    "DEEPSPEED",
}


def config_problems(path: str | Path) -> list[str]:
    """Problems found in one config file (an empty list when it is fine)."""
    path = Path(path)
    if not path.is_file():
        return [f"{path}: does not exist"]
    raw = yaml.safe_load(path.read_text()) or {}
    problems = []
    distributed_type = raw.get("distributed_type")
    if isinstance(distributed_type, bool):
        problems.append(
            f"{path}: distributed_type: NO is unquoted, so YAML reads it as {distributed_type}; write "
            "distributed_type: 'NO'"
        )
        distributed_type = "NO"
    num_processes = raw.get("num_processes", 1)
    if distributed_type == "NO" and num_processes > 1:
        problems.append(
            f"{path}: distributed_type 'NO' with num_processes: {num_processes}: Accelerate starts ONE process and "
            "ignores num_processes; use MULTI_GPU for data parallelism"
        )
    if str(distributed_type) in MULTI_PROCESS_TYPES and num_processes == 1 and raw.get("num_machines", 1) == 1:
        problems.append(
            f"{path}: distributed_type {distributed_type} with num_processes: 1 trains on one process only"
        )
    try:
        load_config_from_file(str(path))
    except Exception as error:  # whatever Accelerate's loader rejects, report it in one line
        problems.append(f"{path}: Accelerate cannot load it: {type(error).__name__}: {error}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config_files", nargs="+", help="Accelerate config files (accelerate_configs/*.yaml).")
    paths = parser.parse_args(argv).config_files
    problems = [problem for path in paths for problem in config_problems(path)]
    for problem in problems:
        print(f"error: {problem}")
    if not problems:
        print(f"ok: {len(paths)} config file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
