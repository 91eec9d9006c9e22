"""The fit planner: will a model train on N GPUs of M GiB, how (full, LoRA, QLoRA), under which setup, and which one.

    python tools/plan.py --model_size 1.3b --gpus 2 --gpu_memory_gib 24 --seq_len 1024 --micro_batch 4
    python tools/plan.py --model_size 70b --method qlora --gpus 2 --gpu_memory_gib 24 --seq_len 1024 --micro_batch 1
    python tools/plan.py --model_name_or_path path/to/model_or/config.json --method lora --json
    python tools/plan.py --model_size 7b --objective dpo --method lora --micro_batch 1 --gradient_checkpointing

It estimates, per GPU and for the host, the memory of six setups: ``single`` (one GPU), ``ddp`` (a full replica per
GPU), ``fsdp`` (FSDP2 full shard: the model state divided by N), ``fsdp_offload`` (FSDP2 with CPU offload: parameters,
gradients and optimizer state in host RAM, only the units being computed on the GPU), ``pipeline`` (one contiguous
group of blocks per GPU, m micro-batches in flight; full fine-tuning only, ``recipes/pipeline_lm.py``) and
``device_map`` (the same split inside one process, one micro-batch at a time). Nothing is loaded: a preset's shape is
arithmetic, a ``--model_name_or_path`` (a folder or a config.json) is built on the meta device (no weights).
``--objective dpo`` plans ``recipes/dpo.py``: two sequences per sample (chosen and rejected), a reference model (LoRA:
the base with the adapter disabled; full: precomputed, or a frozen copy with ``--no-precompute_reference``), and
single, ddp, fsdp and fsdp_offload only.

This file only runs the command; the planner is the package ``tools/planner/``. Bytes per element, per token and per
block, and the sources of each formula: ``tools/planner/memory.py``'s docstring. The order of preference and why:
``tools/planner/fits.py``. The table: ``tools/planner/report.py``.
"""

import sys
from pathlib import Path

# Tools import the helper module; they are run from anywhere, so the repository root goes first on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
