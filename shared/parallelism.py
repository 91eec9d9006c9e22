"""How the model is trained: what the launch config implies or ``--parallelism`` asks, or a refusal naming a launch."""

from __future__ import annotations

import os
from collections import namedtuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from .errors import RecipeError


# The launch config of each way of training (accelerate_configs/).
CONFIG_FOR = {"single": "single_gpu.yaml", "ddp": "ddp_2gpu.yaml", "fsdp": "fsdp_2gpu.yaml"}
CONFIG_FOR |= {"device_map": "model_sharding_2gpu.yaml", "pipeline": "pipeline_2gpu.yaml"}


def fsdp_launch_config() -> bool:
    """True when the launch config asks for FSDP (``accelerate launch`` sets ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


# How the model is trained (``single``, ``ddp``, ``fsdp``, ``device_map``, ``pipeline``), and why.
Parallelism = namedtuple("Parallelism", "name reason")


def choose_parallelism(accelerator: Accelerator, requested: str, recipe: str) -> Parallelism:
    """The parallelism ``--parallelism`` (``auto``: the launch's) gives, or one paragraph for what cannot work."""
    processes = accelerator.num_processes
    fsdp = accelerator.distributed_type == DistributedType.FSDP or fsdp_launch_config()
    gpus = torch.cuda.device_count() if accelerator.device.type == "cuda" else 0
    why = "the launch config" if requested == "auto" else f"--parallelism {requested}"
    if requested == "auto":
        requested = "fsdp" if fsdp else "ddp" if processes > 1 else "device_map" if gpus >= 2 else "single"
    config = CONFIG_FOR.get(requested, CONFIG_FOR["single"])
    launch = f"accelerate launch --config_file accelerate_configs/{config} {recipe}"
    if requested == "fsdp" and not fsdp:
        raise RecipeError(
            f"--parallelism fsdp needs the FSDP launch config, which says how to shard (this launch is "
            f"{accelerator.distributed_type.value}): {launch}"
        )
    if requested != "fsdp" and fsdp:
        raise RecipeError(
            f"The launch config is FSDP but --parallelism is {requested}: FSDP is not combined with {requested} here "
            f"(Accelerate would shard the model anyway). Use --parallelism fsdp (or auto), or launch {requested} "
            f"with its own config: {launch}"
        )
    if requested in ("single", "device_map") and processes > 1:  # single: DDP under a 1-process batch arithmetic
        what = "splits the model inside" if requested == "device_map" else "trains in"
        raise RecipeError(
            f"--parallelism {requested} {what} one process, but this launch has {processes} processes: Accelerate "
            "refuses to train a device_map model in a distributed mode, and wraps another in DDP while the recipe "
            f"counts one process's batches. Launch it with 1 process: {launch} (on a CPU too), or --parallelism auto."
        )
    if requested in ("ddp", "pipeline") and processes < 2:
        ddp = "--parallelism ddp needs 2 or more processes"
        what = "A pipeline runs one stage per process" if requested == "pipeline" else ddp
        raise RecipeError(
            f"{what}, but this launch has {processes} process. Launch it with 2: {launch} (on a "
            "CPU-only machine too: 2 gloo processes)."
        )
    on_cpu = 'two CPU "devices" (the GPU code path: same hooks, not faster)'
    devices = f"{gpus} GPUs" if gpus >= 2 else "1 GPU and the CPU" if gpus == 1 else on_cpu
    one_process = " (1 process: FSDP2's full code path, nothing to shard over)" if processes == 1 else ""
    reason = {
        "fsdp": f"{processes} process(es), each holding 1/{processes} of every parameter, gradient and optimizer "
        f"state{one_process}",
        "ddp": f"{processes} processes ({accelerator.distributed_type.value}), each a full replica, gradients "
        "averaged",
        "device_map": f"1 process, the model split over {devices}",
        "pipeline": f"{processes} processes, one pipeline stage each",
        "single": f"1 process on {accelerator.device}",
    }[requested]
    return Parallelism(requested, f"{reason} ({why})")
