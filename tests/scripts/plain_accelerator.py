"""The silent-duplicate trap, on purpose: a plain ``Accelerator()`` on a machine without CUDA.

Launched with a 2-process config on a CPU-only machine, each process sees a 1-process state;
``shared.accelerator.check_process_count`` must refuse to go on. (The test hides the GPUs, so the trap is
reproduced on every machine.)
"""

import sys
from pathlib import Path

from accelerate import Accelerator

sys.path.append(str(Path(__file__).resolve().parents[2]))
from shared.accelerator import check_process_count

accelerator = Accelerator()
check_process_count(accelerator)
print(f"processes seen: {accelerator.num_processes}")
