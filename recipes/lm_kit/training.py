"""The language-model recipes' setup around their loop: the batch arithmetic decided before the Accelerator is built
(it takes the accumulation), the Accelerator's LM settings, and the data loaders."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, DDPCommunicationHookType, DistributedDataParallelKwargs
from accelerate.utils import TorchDynamoPlugin
from torch.utils.data import DataLoader

from shared.checkpoints import keep_global_batch, resolve_checkpoint


def data_parallel_size_of(parallelism: str) -> int:
    """How many of the launch's processes (``WORLD_SIZE``) split each batch, known from ``--parallelism`` before the
    Accelerator is built (it takes the accumulation, which depends on it): all of them under ddp, fsdp and auto (auto
    picks ddp or fsdp for 2 or more processes; for one, all is one); one under single, device_map (one process:
    ``choose_parallelism`` refuses more) and a pipeline (every stage reads every batch)."""
    return 1 if parallelism in ("single", "device_map", "pipeline") else int(os.environ.get("WORLD_SIZE", "1"))


# The flags ``resume_accumulation`` takes, by the names the recipes' parsers give them.
BATCH_FLAGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")


def resume_accumulation(
    output_dir: str,
    resume_from_checkpoint: str | None,
    data_parallel_size: int,
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int | None,
    seed: int,
) -> tuple[int, dict]:
    """``keep_global_batch`` for this launch, before the Accelerator: the accumulation to train with (the one passed,
    1 if none; on a resume, the one that keeps the checkpoint's global batch in this launch's process count, refusing
    another seed), and the batch's shape for ``save_checkpoint``. The checkpoint is the one this process finds on its
    own disk; ``set_start_checkpoint`` later makes every process agree on it, or stops them all."""
    checkpoints_dir = Path(output_dir) / "checkpoints"
    own = resolve_checkpoint(resume_from_checkpoint, checkpoints_dir) if resume_from_checkpoint else None
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    batch = per_device_train_batch_size, gradient_accumulation_steps
    return keep_global_batch(num_processes, own, *batch, data_parallel_size, seed)


def accelerator_settings(seed: int, compile: bool, ddp_bucket_cap_mb: int, ddp_comm_hook: str) -> dict:
    """``train_lm.py``'s keyword arguments to the Accelerator beyond the common ones: a seedable sampler with a fixed
    seed (it shuffles alike in every mode and process count: batch-for-batch equal runs), DDP's gradient buckets
    (compressed to 16 bits for the all-reduce or not; ddp only), and with ``--compile`` a regional compile in
    ``prepare()`` (each decoder block: the first block's compile serves all the others)."""
    ddp_kwargs = DistributedDataParallelKwargs(
        bucket_cap_mb=ddp_bucket_cap_mb, comm_hook=DDPCommunicationHookType(ddp_comm_hook)
    )
    return {
        "dynamo_plugin": TorchDynamoPlugin(backend="inductor", use_regional_compilation=True) if compile else None,
        "dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        "kwargs_handlers": [ddp_kwargs],
    }


def lm_dataloaders(data, train_batch_size: int, eval_batch_size: int, device: torch.device) -> tuple:
    """The training and validation loaders of ``data`` (``lm_datasets``). Training drops its short last batch (same
    shape batches: pipeline stages need them). Pinned on a GPU, so a batch's copy does not wait for the GPU. The
    validation loader has its own generator: without, each pass draws from the global RNG (an evaluation before
    training would change dropout)."""
    pinned = device.type == "cuda"
    train = DataLoader(data.train_dataset, train_batch_size, shuffle=True, drop_last=True, pin_memory=pinned)
    return train, DataLoader(data.eval_dataset, eval_batch_size, pin_memory=pinned, generator=torch.Generator())
