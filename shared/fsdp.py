"""FSDP2 through Accelerate: what to shard, and proof that it was sharded. The launch config (``fsdp_2gpu.yaml``)
does the work: ``accelerator.prepare`` applies torch's ``fully_shard`` to every block (the class ``wrap_at_blocks``
reads from the model), the embeddings, the final norm + head, then the root; clipping, sharded ``save_state`` and
``get_state_dict`` (gathered) follow. On CPU ``shared.runtime.use_fsdp_on_cpu`` keeps Accelerate on this path."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType



def wrap_at_blocks(accelerator: Accelerator, model: torch.nn.Module, block_list: str) -> str | None:
    """Make FSDP shard ``model`` one block at a time: the class of the ``block_list`` ModuleList's blocks, found at run
    time, so one config serves every model (None when not under FSDP or the config names its own). Not the default
    (every ``_no_split_modules`` class): for BERT-like models that holds the embeddings too, which Accelerate then
    shards twice, and ``fully_shard`` rejects it (Accelerate 1.16). Call before ``prepare``."""
    plugin = accelerator.state.fsdp_plugin
    if accelerator.distributed_type != DistributedType.FSDP or plugin.transformer_cls_names_to_wrap:
        return None
    block_class = type(model.get_submodule(block_list)[0]).__name__
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = [block_class]
    return block_class


def sharding_facts(model: torch.nn.Module) -> dict[str, int]:
    """What this process holds: DTensor (FSDP2-sharded) parameters, its elements (``local_numel``) against the model's
    (``global_numel``), and the modules ``fully_shard`` was applied to (each block, embeddings, norm + head, root)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    parameters = list(model.parameters())
    return {
        "parameters": len(parameters),
        "dtensor_parameters": sum(isinstance(parameter, DTensor) for parameter in parameters),
        # A DTensor's numel() is the global tensor's; to_local() is this process's shard.
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in parameters),
        "global_numel": sum(parameter.numel() for parameter in parameters),
        "fsdp_modules": sum(isinstance(module, FSDPModule) for module in model.modules()),
    }
