"""The Accelerator for the hardware found, its process group, and the process-wide settings beside it.

The trap this module exists for: without CUDA, a plain ``Accelerator()`` under a 2-process MULTI_GPU config does *not*
start DDP: each process trains alone on the whole data set, two runs that look fine in the logs. ``cpu=True`` joins
them over gloo; ``build_accelerator`` always passes the right value, then checks the process count."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from .errors import RecipeError, stop_if_found
from .parallelism import fsdp_launch_config


def check_process_count(accelerator: Accelerator) -> None:
    """Fail loudly if the launcher started N processes (``WORLD_SIZE``) but the Accelerator joined fewer: each would
    train alone on the full data set (the trap above). Stop before any work is wasted."""
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
    """The one backend rule of every recipe: NCCL between GPUs, gloo between CPU processes (Accelerate would take MPI
    on CPU when torch has it; gloo is in every torch build), and gloo beside NCCL for an FSDP config that keeps tensors
    on the CPU (offload, full state dict), as Accelerate's PartialState does; results.json: ``distributed/backend``."""
    offload, state_dict = os.environ.get("FSDP_OFFLOAD_PARAMS", "false"), os.environ.get("FSDP_STATE_DICT_TYPE")
    cpu_tensors = offload.lower() == "true" or state_dict == "FULL_STATE_DICT"
    return "gloo" if cpu else "cuda:nccl,cpu:gloo" if fsdp_launch_config() and cpu_tensors else "nccl"


def init_group_after_restart(cpu: bool, dist_timeout: float | None = None) -> None:
    """After ``accelerate launch --max_restarts N`` restarted the workers, join them under fresh store keys: torchrun's
    static rendezvous hands them the *same* TCPStore as the crashed attempt, with no per-attempt prefix (torch 2.13):
    a worker can read a dead peer's address (gloo: ``connectFullMesh ... Connection refused``; NCCL can hang). A group
    created here under a ``restart_<n>`` prefix gives every attempt its own keys; Accelerate then uses it. Changes
    this process: starts torch.distributed's default process group (a no-op on a first attempt)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    timeout = {"timeout": timedelta(seconds=dist_timeout)} if dist_timeout is not None else {}
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = torch.distributed.TCPStore(address, port, is_master=False, **timeout)
    store = torch.distributed.PrefixStore(f"two_gpu_recipes/restart_{restart}", agent_store)
    torch.distributed.init_process_group(
        backend=distributed_backend(cpu),
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        **timeout,
    )


def set_gpu_index() -> None:
    """One process on a GPU: Accelerate's device would be ``torch.device("cuda")``, with no index (several processes
    get cuda:<local rank>); torch.cuda.set_device refuses it, and results would name the GPU "cuda" here and "cuda:0"
    there. Sets ``ACCELERATE_TORCH_DEVICE`` (Accelerate's own override of the device it picks) to cuda:<current>,
    before the Accelerator is built. A no-op without CUDA or with several processes. Changes this process: writes
    ``os.environ["ACCELERATE_TORCH_DEVICE"]``, read by every Accelerator built after it."""
    if torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if os.environ.get("ACCELERATE_TORCH_DEVICE", "cuda") == "cuda" and not os.environ.get("ACCELERATE_USE_CPU"):
            os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{torch.cuda.current_device()}"


def build_accelerator(dist_timeout: float | None = None, **accelerator_kwargs) -> Accelerator:
    """An Accelerator on CUDA when present and on the CPU over gloo otherwise, checked for size. Keyword arguments go
    to ``Accelerator``; ``cpu`` defaults to "no CUDA here" (a 2-process MULTI_GPU config then runs real DDP over gloo).
    ``dist_timeout`` (seconds) bounds every collective: a hung or dead peer fails the others after that long, with an
    error naming the collective, instead of the backend's default (10 minutes for NCCL, 30 for gloo). Building it
    starts the process group (a collective) under a multi-process launch, and on a GPU makes the Accelerator's device
    the current CUDA device (``torch.cuda.set_device``)."""
    cpu = accelerator_kwargs.setdefault("cpu", not torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (a backend given to 1 process makes Accelerate start a group)
        timeout = {"timeout": timedelta(seconds=dist_timeout)} if dist_timeout is not None else {}
        handlers = list(accelerator_kwargs.pop("kwargs_handlers", None) or [])
        handlers.append(InitProcessGroupKwargs(backend=distributed_backend(cpu), **timeout))
        accelerator_kwargs["kwargs_handlers"] = handlers
    init_group_after_restart(cpu=cpu, dist_timeout=dist_timeout)
    if not cpu and accelerator_kwargs.get("dataloader_config") is not None:
        # A prepared loader then copies each batch to the GPU with non_blocking=True. From the pinned memory the
        # recipes' loaders use on a GPU, the copy is queued behind the running step; from pageable memory CUDA would
        # first wait for the GPU to finish everything queued: a sync point in every step. (A copy: the caller's
        # configuration stays as it was.)
        accelerator_kwargs["dataloader_config"] = dataclasses.replace(
            accelerator_kwargs["dataloader_config"], non_blocking=True
        )
    accelerator = Accelerator(**accelerator_kwargs)
    check_process_count(accelerator)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # Accelerate has no fp16 autocast on the CPU: the run would be fp32 throughout, recorded as fp16.
        stop_if_found(
            "Mixed precision fp16 (--mixed_precision fp16, or the launch config's "
            "mixed_precision) does nothing on the CPU this run uses: Accelerate has no fp16 autocast there, "
            "so it would train in fp32 and record fp16. Pass --mixed_precision bf16 (autocast on the CPU "
            "too) or --mixed_precision no, or run fp16 on a CUDA GPU."
        )
    if accelerator.device.type == "cuda" and accelerator.device.index is not None:
        # Object collectives under NCCL (gather_object, the pipeline's state-dict gather) go through the *current* CUDA
        # device: unset, every rank uses cuda:0, or hangs. Accelerate sets it when it starts the group; this line also
        # covers a group started by init_group_after_restart.
        torch.cuda.set_device(accelerator.device)
    return accelerator


@contextlib.contextmanager
def main_process_alone(accelerator: Accelerator):
    """The main process works alone inside the ``with`` block (merging a 13B model, pretraining a base model:
    minutes), and the other processes wait for it at the end, with no time limit. ``wait_for_everyone`` would bound
    that wait by ``--dist_timeout`` (600 s by default: long enough for any collective, too short for a merge) and kill
    a run that was only slow. The wait is a barrier of a gloo group made for it with a week's timeout (gloo needs no
    GPU memory). If the main process fails instead, it exits, and the launcher stops the others."""
    several = accelerator.num_processes > 1 and torch.distributed.is_initialized()
    # Sync point: making a group is a collective, before the main process goes off on its own.
    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(days=7)) if several else None
    yield  # (no finally: a main process that failed must not release the others into its missing output)
    if group is not None:
        torch.distributed.barrier(group=group)  # sync point: the others wait here, untimed, for the main one
        torch.distributed.destroy_process_group(group)


def fused_adamw(accelerator: Accelerator) -> bool:
    """AdamW fused (one kernel updates a device's parameters; transformers' and TRL's default) except with fp16's
    GradScaler: there torch's fused step copies the scale to CPU parameters without waiting (a split over cuda:0 +
    CPU, offload), and Accelerate cannot tell a skipped step (the schedule would advance on it)."""
    return accelerator.mixed_precision != "fp16"


def set_quiet_library_logs(accelerator: Accelerator) -> None:
    """transformers' and datasets' warnings from the main process only (every process loads the same model and data:
    one LOAD REPORT per process otherwise), without terminal colour codes when stderr is not a terminal (a log
    file), and without the FutureWarning PEFT 0.21 triggers by reading transformers' deprecated
    ``is_gradient_checkpointing`` (nothing a user can act on). Call it once, in ``main()``. Changes this process:
    transformers' and datasets' log levels, a filter on transformers' log handlers, a ``warnings`` filter."""
    import warnings

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
    """A logging filter: the record's message without ANSI colour codes (transformers' LOAD REPORT has them)."""
    record.msg = re.sub(r"\x1b\[[0-9;]*m", "", str(record.msg))
    return True
