"""Each rank reports, through an object collective, the CUDA device it is on: under NCCL an object collective goes
through the *current* CUDA device, so every rank must have set its own (shared.accelerator.build_accelerator does)."""

import json
import sys
from pathlib import Path

import torch
from accelerate.utils import gather_object

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.accelerator import build_accelerator, set_gpu_index

set_gpu_index()
accelerator = build_accelerator(dist_timeout=60)
seen = gather_object(
    [
        {
            "rank": accelerator.process_index,
            "device": str(accelerator.device),
            "current": torch.cuda.current_device() if torch.cuda.is_available() else None,
        }
    ]
)
if accelerator.is_main_process:
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    print("OBJECTS " + json.dumps({"ranks": seen, "distributed/backend": backend}))
accelerator.wait_for_everyone()
accelerator.end_training()
