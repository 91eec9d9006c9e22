"""The Accelerator for the hardware found, its process group, and the process-wide settings beside it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import warnings
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from .errors import RecipeError, stop_if_found
from .parallelism import fsdp_launch_config


def check_process_count(accelerator: Accelerator) -> None:
    """Refuse a launch of N processes (``WORLD_SIZE``) whose Accelerator joined fewer: each would train alone."""
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:
        raise RecipeError(
            f"The launcher started {expected} processes (WORLD_SIZE={expected}) but the Accelerator sees "
            f"{accelerator.num_processes} (distributed_type={accelerator.distributed_type.value}), so every process "
            "would train alone on the full data set and the results would be silently wrong. On a machine without "
            "CUDA build the Accelerator with cpu=True (shared.accelerator.build_accelerator does) or export "
            "ACCELERATE_USE_CPU=1; on a GPU machine check that the GPUs are visible (CUDA_VISIBLE_DEVICES, "
            "nvidia-smi)."
        )


def distributed_backend(cpu: bool) -> str:
    """NCCL between GPUs, gloo between CPU processes, and both for an FSDP config that keeps tensors on the CPU."""
    offload, state_dict = os.environ.get("FSDP_OFFLOAD_PARAMS", "false"), os.environ.get("FSDP_STATE_DICT_TYPE")
    cpu_tensors = offload.lower() == "true" or state_dict == "FULL_STATE_DICT"
    return "gloo" if cpu else "cuda:nccl,cpu:gloo" if fsdp_launch_config() and cpu_tensors else "nccl"


def init_group_after_restart(cpu: bool, dist_timeout: float | None = None) -> None:
    """After ``--max_restarts``, start the default group under this attempt's own store keys (torchrun reuses its)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    timeout = {"timeout": timedelta(seconds=dist_timeout)} if dist_timeout is not None else {}
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = torch.distributed.TCPStore(address, port, is_master=False, **timeout)
    store = torch.distributed.PrefixStore(f"two_gpu_recipes/restart_{restart}", agent_store)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = distributed_backend(cpu)
    torch.distributed.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, **timeout)


def set_gpu_index() -> None:
    """One process on a GPU: its device ``cuda:N``, not ``cuda``; changes ``os.environ["ACCELERATE_TORCH_DEVICE"]``."""
    if torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if os.environ.get("ACCELERATE_TORCH_DEVICE", "cuda") == "cuda" and not os.environ.get("ACCELERATE_USE_CPU"):
            os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{torch.cuda.current_device()}"


def build_accelerator(dist_timeout: float | None = None, **accelerator_kwargs) -> Accelerator:
    """An Accelerator on CUDA, else on the CPU over gloo (real DDP), checked for size; ``dist_timeout`` (seconds)
    bounds every collective. Starts the process group (a collective) and sets the current CUDA device."""
    cpu = accelerator_kwargs.setdefault("cpu", not torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (a backend given to 1 process makes Accelerate start a group)
        timeout = {"timeout": timedelta(seconds=dist_timeout)} if dist_timeout is not None else {}
        handlers = list(accelerator_kwargs.pop("kwargs_handlers", None) or [])
        handlers.append(InitProcessGroupKwargs(backend=distributed_backend(cpu), **timeout))
        accelerator_kwargs["kwargs_handlers"] = handlers
    init_group_after_restart(cpu=cpu, dist_timeout=dist_timeout)
    if not cpu and accelerator_kwargs.get("dataloader_config") is not None:
        # Batches copied to the GPU non_blocking, from pinned memory: queued behind the step, not a sync in each.
        config = accelerator_kwargs["dataloader_config"]
        accelerator_kwargs["dataloader_config"] = dataclasses.replace(config, non_blocking=True)
    accelerator = Accelerator(**accelerator_kwargs)
    check_process_count(accelerator)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # Accelerate has no fp16 autocast on the CPU: the run would be fp32 throughout, recorded as fp16.
        stop_if_found(
            "Mixed precision fp16 (--mixed_precision fp16, or the launch config's mixed_precision) does nothing on "
            "the CPU this run uses: Accelerate has no fp16 autocast there, so it would train in fp32 and record fp16. "
            "Pass --mixed_precision bf16 (autocast on the CPU too) or --mixed_precision no, or run fp16 on a CUDA GPU."
        )
    if accelerator.device.type == "cuda" and accelerator.device.index is not None:
        # Object collectives under NCCL use the current CUDA device: unset (a restarted group), every rank uses cuda:0.
        torch.cuda.set_device(accelerator.device)
    return accelerator


@contextlib.contextmanager
def main_process_alone(accelerator: Accelerator):
    """The main process works alone inside the block (a merge: minutes); the others wait at its end, untimed."""
    several = accelerator.num_processes > 1 and torch.distributed.is_initialized()
    # Sync point: making a group is a collective, before the main process goes off on its own.
    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(days=7)) if several else None
    yield  # (no finally: a main process that failed must not release the others into its missing output)
    if group is not None:
        torch.distributed.barrier(group=group)  # sync point: the others wait here, untimed, for the main one
        torch.distributed.destroy_process_group(group)


def fused_adamw(accelerator: Accelerator) -> bool:
    """AdamW fused (transformers' and TRL's default) except with fp16's GradScaler, whose skipped steps it hides."""
    return accelerator.mixed_precision != "fp16"


def set_quiet_library_logs(accelerator: Accelerator) -> None:
    """Library warnings once, no colour codes in logs. Changes: transformers' and datasets' logging, warnings."""
    import datasets
    import transformers

    if not accelerator.is_local_main_process:
        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity_error()
    if not sys.stderr.isatty():
        for handler in transformers.utils.logging.get_logger().handlers:
            handler.addFilter(_strip_colours)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def _strip_colours(record) -> bool:
    """A logging filter: the message without ANSI colour codes (transformers' LOAD REPORT has them)."""
    record.msg = re.sub(r"\x1b\[[0-9;]*m", "", str(record.msg))
    return True
