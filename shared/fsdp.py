"""FSDP2 (fully sharded data parallel) through Accelerate, on GPUs and on a CPU-only machine.

On GPUs the FSDP launch config (``accelerate_configs/fsdp_2gpu.yaml``) does everything: Accelerate
builds its FSDP plugin from it and ``accelerator.prepare(model, optimizer, ...)`` applies torch's
``fully_shard`` to every transformer block (the class ``wrap_at_blocks`` reads from the model), the
embeddings, the final norm + head, then the root; ``clip_grad_norm_``, ``save_state``/``load_state``
(sharded, with torch.distributed.checkpoint) and ``get_state_dict`` (the whole model, gathered) know
about it.

On CPU there is one snag. ``build_accelerator`` must pass ``cpu=True`` there (see runtime.py), and
with ``cpu=True`` Accelerate sets ``distributed_type`` to MULTI_CPU and drops the FSDP config (checked
with accelerate 1.16 and torch 2.13: ``AcceleratorState`` only turns MULTI_GPU-like types into FSDP): the
model would be wrapped in plain DDP, every process holding everything, while the run still looked
like FSDP. torch's ``fully_shard`` works over gloo on CPU, and so does the rest of Accelerate's
FSDP2 code, so ``use_fsdp_on_cpu`` puts the Accelerator into the state a GPU launch gets (FSDP, with
the plugin the config describes). Why this rather than calling ``fully_shard`` ourselves on CPU:
one code path. The recipes then run Accelerate's own FSDP2 preparation, clipping, sharded
checkpoints and full-state-dict gathering on CPU exactly as on GPUs, so the CPU tests check the
code a GPU run uses; a hand-rolled CPU twin would need its own checkpoint and save code, and the
tests would check the twin. The price is that the switch sets two attributes of Accelerate's state
(``distributed_type``, ``fsdp_plugin``); ``use_fsdp_on_cpu`` checks that Accelerate then reports
FSDP2, and ``sharding_per_rank`` lets every run record (and the tests assert) that the parameters
really are sharded DTensors.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from .results import per_rank
from .runtime import RecipeError, fsdp_launch_config

FSDP_CONFIG = "accelerate_configs/fsdp_2gpu.yaml"


def wrap_at_blocks(accelerator: Accelerator, model: torch.nn.Module, block_list: str) -> str | None:
    """Make FSDP shard ``model`` one transformer block at a time: the class of the blocks in the
    ``block_list`` ModuleList (e.g. ``model.layers`` -> LlamaDecoderLayer, ``bert.encoder.layer`` ->
    BertLayer), found at run time, so one config serves every model. Call before ``prepare``; returns
    the class name (None when not under FSDP, or when the config names its own classes to wrap).

    Why not the config's default (every class in the model's ``_no_split_modules``): for BERT-like
    models that list also holds the embeddings module, and Accelerate then shards the word
    embeddings a second time inside it, which ``fully_shard`` rejects (Accelerate 1.16)."""
    if accelerator.distributed_type != DistributedType.FSDP or accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap:
        return None
    block_class = type(model.get_submodule(block_list)[0]).__name__
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = [block_class]
    return block_class


def sharding_facts(model: torch.nn.Module) -> dict[str, int]:
    """What this process holds of the model's parameters: how many are DTensors (sharded by FSDP2),
    the elements it holds (``local_numel``) against the whole model's (``global_numel``), and the
    modules ``fully_shard`` was applied to (``fsdp_modules``: each block, the embeddings, the final
    norm and the head, which Accelerate shards as one group, and the root)."""
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


def sharding_per_rank(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """``sharding_facts`` of every process, as ``{"rank0": {...}, ...}``. A collective: call it on all."""
    return per_rank(sharding_facts(model))


def check_fsdp_request(accelerator: Accelerator, parallelism: str, recipe: str) -> None:
    """Refuse FSDP asked without the FSDP launch config or with one process, and the FSDP config
    combined with another parallelism (Accelerate would shard the model anyway)."""
    is_fsdp = accelerator.distributed_type == DistributedType.FSDP or fsdp_launch_config()
    launch_line = f"accelerate launch --config_file {FSDP_CONFIG} {recipe}"
    if parallelism == "fsdp" and accelerator.num_processes < 2:
        raise RecipeError(
            f"FSDP (--parallelism fsdp, or auto with an FSDP config) shards the model over processes, but this launch has "
            f"{accelerator.num_processes} process. Launch it with 2: {launch_line} (on a CPU-only machine too: 2 gloo "
            "processes, really sharded)."
        )
    if parallelism == "fsdp" and not is_fsdp:
        raise RecipeError(
            f"--parallelism fsdp needs the FSDP launch config, which says how to shard (this launch is "
            f"{accelerator.distributed_type.value}): {launch_line}"
        )
    if parallelism != "fsdp" and is_fsdp:
        raise RecipeError(
            f"The launch config is FSDP but --parallelism is {parallelism}: FSDP is not combined with {parallelism} "
            f"here (Accelerate would shard the model anyway). Use --parallelism fsdp (or auto), or launch "
            f"{parallelism} with its own config (accelerate_configs/{_CONFIG_FOR.get(parallelism, 'single_gpu.yaml')})."
        )


_CONFIG_FOR = {"ddp": "ddp_2gpu.yaml", "pipeline": "pipeline_2gpu.yaml", "device_map": "model_sharding_2gpu.yaml"}
