"""Run a recipe unchanged (through runpy), each process writing the bytes of model state it holds at the end
(parameters, gradients, optimizer state: ``lib.model_state``) to ``<output_dir>/model_state_rank<R>.json``. The
benchmark runner launches every recipe through this file and keeps those numbers in its records
(``memory/model_state_bytes``); the recipes' results.json do not carry them.

    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml benchmarks/with_model_state.py \\
        recipes/train_lm.py --model_size tiny --max_train_steps 4 --output_dir outputs/state
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]  # the benchmarks' library (lib/), and shared/
from lib.launch import run_as_main_recording_model_state

if __name__ == "__main__":
    run_as_main_recording_model_state(sys.argv[1:])
