"""Building the Accelerator for the hardware found, and choosing where the model lives.

The one trap this module exists for: on a machine without CUDA, a plain ``Accelerator()`` launched
with a 2-process MULTI_GPU config does *not* start DDP. Each process silently builds its own
single-process state and trains alone on the whole data set, so you get two independent runs that
look fine in the logs. ``Accelerator(cpu=True)`` makes Accelerate join the processes over gloo
instead. ``build_accelerator`` always passes the right value and then checks the process count.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs


class RecipeError(SystemExit):
    """Bad input or setup, reported as one readable paragraph and a non-zero exit (no traceback).

    It subclasses ``SystemExit`` so that a recipe can ``raise RecipeError("...")`` anywhere and the
    interpreter prints the message to stderr and exits with status 1, with no wrapper around
    ``main()``. Under a multi-process launch every process that hits the error prints it with its
    rank, so a problem seen by only one rank is not lost.
    """

    def __init__(self, message: str):
        self.message = " ".join(message.split())
        rank, world_size = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
        prefix = f"[rank {rank}] " if world_size > 1 else ""
        # One line: terminals wrap it, and it stays greppable in logs.
        super().__init__(prefix + "error: " + self.message)


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (batch sizes, steps), with a message naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type for amounts that must be > 0 (learning rates, sizes), with a message naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value}")
    return value


def check_process_count(accelerator: Accelerator) -> None:
    """Fail loudly if the launcher started N processes but the Accelerator joined fewer.

    ``WORLD_SIZE`` is set by ``accelerate launch``/torchrun for every process it starts. If the
    Accelerator reports fewer processes, each process is training on its own (the silent-duplicate
    trap described at the top of this module), so stop before any work is wasted.
    """
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:
        raise RecipeError(
            f"The launcher started {expected} processes (WORLD_SIZE={expected}) but the Accelerator sees "
            f"{accelerator.num_processes} (distributed_type={accelerator.distributed_type.value}), so every "
            "process would train alone on the full data set and the results would be silently wrong. "
            "On a machine without CUDA build the Accelerator with cpu=True (shared.build_accelerator does) "
            "or export ACCELERATE_USE_CPU=1; on a GPU machine check that the GPUs are visible "
            "(CUDA_VISIBLE_DEVICES, nvidia-smi)."
        )


def join_restarted_elastic_group(cpu: bool, dist_timeout: float | None = None) -> None:
    """After ``accelerate launch --max_restarts N`` restarted the workers, join them under fresh keys.

    torchrun's static rendezvous (what ``accelerate launch`` uses on one machine) hands the restarted
    workers the *same* TCPStore as the attempt that crashed, without a per-attempt prefix (torch
    2.13). The backend's address keys of the dead workers are still in it, so a restarted worker
    that reads its peer's key before the peer rewrites it connects to a dead address: gloo fails
    with ``connectFullMesh ... Connection refused`` (NCCL can hang). Creating the default process
    group ourselves under a ``restart_<n>`` prefix gives every attempt its own keys; Accelerate
    then finds the group initialised and uses it. First attempts and non-elastic launches are left
    to Accelerate unchanged.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    timeout = timedelta(seconds=dist_timeout) if dist_timeout is not None else None
    agent_store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        **({"timeout": timeout} if timeout else {}),
    )
    torch.distributed.init_process_group(
        backend=distributed_backend(cpu),
        store=torch.distributed.PrefixStore(f"two_gpu_recipes/restart_{restart}", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        **({"timeout": timeout} if timeout else {}),
    )


def distributed_backend(cpu: bool) -> str:
    """The one backend rule of every recipe: NCCL between GPUs, gloo between CPU processes (Accelerate would take
    MPI on CPU when torch was built with it; gloo is what every torch build has). Recorded in results.json."""
    return "gloo" if cpu else "nccl"


def build_accelerator(dist_timeout: float | None = None, **accelerator_kwargs) -> Accelerator:
    """Return an Accelerator that uses CUDA when present and CPU/gloo otherwise, checked for size.

    Keyword arguments go to ``Accelerator`` unchanged (mixed_precision, gradient_accumulation_steps, log_with,
    dataloader_config, ...). ``cpu`` defaults to "no CUDA here", which is what makes a 2-process MULTI_GPU config
    run real DDP over gloo on a CPU-only machine. ``dist_timeout`` (seconds) bounds every collective: if a peer
    hangs or dies, the others raise an error naming the collective after that long instead of the backend's
    default (10 minutes for NCCL, 30 for gloo).
    """
    cpu = accelerator_kwargs.setdefault("cpu", not torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (a backend given to a 1-process run makes Accelerate start a group)
        timeout = {"timeout": timedelta(seconds=dist_timeout)} if dist_timeout is not None else {}
        handlers = list(accelerator_kwargs.pop("kwargs_handlers", None) or [])
        handlers.append(InitProcessGroupKwargs(backend=distributed_backend(cpu), **timeout))
        accelerator_kwargs["kwargs_handlers"] = handlers
    join_restarted_elastic_group(cpu=cpu, dist_timeout=dist_timeout)
    accelerator = Accelerator(**accelerator_kwargs)
    check_process_count(accelerator)
    if accelerator.device.type == "cuda":
        # Object collectives (gather_object, the pipeline's state-dict gather) under NCCL go through the *current*
        # CUDA device: unset, every rank would use cuda:0 (or hang). Accelerate sets it when it starts the group;
        # a group started by join_restarted_elastic_group is covered by this line too.
        torch.cuda.set_device(accelerator.device)
    if cpu and fsdp_launch_config() and accelerator.num_processes > 1:
        # cpu=True makes Accelerate drop an FSDP config and run plain DDP; switch it back to its FSDP2 path, the one a
        # GPU launch takes (shared/fsdp.py says why).
        use_fsdp_on_cpu(accelerator)
    return accelerator


def fsdp_launch_config() -> bool:
    """True when the launch config asks for FSDP (``accelerate launch`` sets ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def use_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Make a ``cpu=True`` Accelerator launched with an FSDP config run FSDP2, as on GPUs (shared/fsdp.py's
    docstring says why); every process calls it, before ``prepare``."""
    plugin = FullyShardedDataParallelPlugin()  # read from the launch config's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise RecipeError(f"On CPU only FSDP version 2 runs (torch's fully_shard over gloo); the launch config has "
                          f"fsdp_version {plugin.fsdp_version}. Use accelerate_configs/fsdp_2gpu.yaml.")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)  # what AcceleratorState does on GPUs
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    # Collectives (gather, reduce) read the distributed type from PartialState's shared state.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if not accelerator.is_fsdp2:
        raise RecipeError("Could not switch Accelerate to FSDP2 on CPU (this Accelerate version keeps its state "
                          "differently); run the FSDP config on GPUs, or use accelerate==1.16.0 from requirements.txt.")


def run_facts(accelerator: Accelerator) -> dict:
    """What every results.json records about how the run was distributed: backend, devices, process count."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    return {"num_processes": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value,
            "distributed/backend": torch.distributed.get_backend() if initialized else None,
            "device": str(accelerator.device)}


@dataclass(frozen=True)
class Placement:
    """Where the model lives: ``ddp`` (one replica per process), ``fsdp`` (1/N of every parameter per
    process), ``device_map`` (one process, model split over several devices) or ``single`` (one
    process, one device), and why."""

    name: str
    reason: str


def choose_placement(accelerator: Accelerator) -> Placement:
    """Pick the placement the launch config implies and say why.

    - an FSDP launch config: ``fsdp``, every process holds 1/N of the model state and trains on its
      shard (with one process the recipes refuse it: there is nothing to shard over);
    - more than one process: ``ddp``, every process holds a full replica and trains on its shard;
    - one process that sees two or more GPUs: ``device_map``, the model is split over them
      (Accelerate refuses to train a device_map model in any distributed mode, which is why
      ``model_sharding_2gpu.yaml`` is a 1-process, ``distributed_type: 'NO'`` config);
    - otherwise ``single``.
    """
    if accelerator.distributed_type == DistributedType.FSDP or fsdp_launch_config():
        return Placement(
            "fsdp",
            f"{accelerator.num_processes} process(es), FSDP launch config: each holds 1/{accelerator.num_processes} of every "
            "parameter, gradient and optimizer state, gathers one block at a time, and trains on its shard",
        )
    if accelerator.num_processes > 1:
        return Placement(
            "ddp",
            f"{accelerator.num_processes} processes ({accelerator.distributed_type.value}): each holds a full "
            "replica and gradients are averaged across processes",
        )
    visible_gpus = torch.cuda.device_count() if accelerator.device.type == "cuda" else 0
    if visible_gpus >= 2:
        return Placement("device_map", f"1 process that sees {visible_gpus} GPUs: the model is split across them")
    device_words = "1 GPU" if visible_gpus == 1 else f"device {accelerator.device}"
    return Placement("single", f"1 process on {device_words}")


def prepare_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (with parents) and check that it is writable, or fail with a clear message."""
    output_dir = Path(path)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise RecipeError(
            f"Cannot use --output_dir {str(path)!r}: {error.strerror or error}. Pass a folder you can "
            "write to; it is created if missing."
        ) from None
    return output_dir
