"""The main process works alone for longer than --dist_timeout (a merge, a pretraining) while the others wait: the
wait must not be bounded by the collective timeout. ``python main_process_alone.py TIMEOUT_S WORK_S``."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.accelerator import build_accelerator, main_process_alone

timeout, work = float(sys.argv[1]), float(sys.argv[2])
accelerator = build_accelerator(dist_timeout=timeout)
with main_process_alone(accelerator):
    if accelerator.is_main_process:
        time.sleep(work)
accelerator.wait_for_everyone()  # bounded by the timeout again: the group still works after the long wait
print(f"rank {accelerator.process_index}: waited {work} s for the main process with --dist_timeout {timeout}")
accelerator.end_training()
