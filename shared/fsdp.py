"""FSDP2 through Accelerate: the launch config (``fsdp_2gpu.yaml``) does the work in ``accelerator.prepare``."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, gather_object
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy

from .errors import RecipeError
from .parallelism import fsdp_launch_config


def set_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """FSDP2 on the CPU, as on GPUs. Changes: the Accelerator's FSDP state, and ``PartialState._shared_state``."""
    if accelerator.device.type != "cpu" or not fsdp_launch_config():
        return
    plugin = FullyShardedDataParallelPlugin()  # read from the launch config's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise RecipeError(
            f"On CPU only FSDP version 2 runs (torch's fully_shard over gloo); the launch config has "
            f"fsdp_version {plugin.fsdp_version}. Use accelerate_configs/fsdp_2gpu.yaml."
        )
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)  # what AcceleratorState does on GPUs
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # the offload config, unpinned (pinned memory needs a GPU)
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # collectives read it from here
    if not accelerator.is_fsdp2:
        raise RecipeError(
            "Could not switch Accelerate to FSDP2 on CPU (this Accelerate version keeps its state differently); run "
            "the FSDP config on GPUs, or use accelerate==1.16.0 from requirements.txt."
        )


def set_wrap_at_blocks(accelerator: Accelerator, model: torch.nn.Module, block_list: str) -> str | None:
    """FSDP shards at ``block_list``'s block class, returned. Changes: the plugin's classes to wrap."""
    plugin = accelerator.state.fsdp_plugin
    if accelerator.distributed_type != DistributedType.FSDP or plugin.transformer_cls_names_to_wrap:
        return None
    block_class = type(model.get_submodule(block_list)[0]).__name__
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = [block_class]
    return block_class


def set_keep_gathered_in_one_process(accelerator: Accelerator) -> None:
    """FSDP2 in 1 process, no offload: no resharding after forward. Changes: the plugin's ``reshard_after_forward``."""
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes == 1:
        plugin = accelerator.state.fsdp_plugin  # (no plugin attribute at all without FSDP)
        if not isinstance(plugin.cpu_offload, CPUOffloadPolicy):
            plugin.reshard_after_forward = False


def gathered_state_dict(accelerator: Accelerator, model: torch.nn.Module, trained_only: bool = False) -> dict:
    """The model's full weights on the main process (``trained_only``: the trained ones alone); a collective."""
    if trained_only and accelerator.is_fsdp2:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return get_model_state_dict(model, options=options)
    return accelerator.get_state_dict(model)


def available_host_ram() -> tuple[int, str]:
    """Bytes of RAM this machine can still give, and where the figure comes from."""
    if os.environ.get("RECIPES_HOST_RAM_GIB"):
        return int(float(os.environ["RECIPES_HOST_RAM_GIB"]) * 2**30), "RECIPES_HOST_RAM_GIB"
    figures = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        figures.append((int(meminfo["MemAvailable"].split()[0]) * 1024, "MemAvailable"))
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            figures.append((int(limit) - used, "the cgroup's memory.max"))
    except (OSError, KeyError, ValueError):
        pass
    return min(figures) if figures else (2**62, "unknown")


def check_offload_fits_host_ram(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Under CPU offload, refuse a machine that cannot hold its share of the offloaded state; before ``prepare``."""
    plugin = accelerator.state.fsdp_plugin
    offload = getattr(plugin, "cpu_offload", None) if accelerator.distributed_type == DistributedType.FSDP else None
    if not (isinstance(offload, CPUOffloadPolicy) or getattr(offload, "offload_params", False)):
        return
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    share = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) / accelerator.num_processes
    needed = int((4 * trained + frozen) * share)
    available, source = available_host_ram()
    verdicts = gather_object([(needed, available, source)])
    short = [(need, have, where) for need, have, where in verdicts if need > have]
    if short:
        need, have, where = short[0]
        raise RecipeError(
            "FSDP2 with CPU offload keeps the parameters, gradients and AdamW state in host RAM: this machine's "
            f"share is {need / 2**30:.2f} GiB (trained {trained / 2**30:.2f} GiB x 4 for weights, gradients and 2 "
            f"moments, frozen {frozen / 2**30:.2f} GiB once, x {share:.2f} for its processes), but only "
            f"{have / 2**30:.2f} GiB is free ({where}). Use a machine with more RAM, LoRA or QLoRA (--load_in_4bit) "
            "to shrink the state, or fsdp_2gpu.yaml when 1/N of it fits on each GPU; python tools/plan.py "
            "--cpu_offload estimates both."
        )
