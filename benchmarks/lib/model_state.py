"""The bytes of model state one process holds at the end of a run, taken from outside the recipe when it hands its
model and optimizer to ``accelerator.free_memory``: by the runner's wrapper (``benchmarks/with_model_state.py``, for
the records' ``memory/model_state_bytes``) and by the tests' observer (``tests/harness/observer/facts.py``).
results.json does not carry it."""

from __future__ import annotations

import torch


def reshard_fsdp2_modules(model: torch.nn.Module) -> None:
    """After a forward without backward (an evaluation) FSDP2 leaves the root unsharded: resharded, the bytes counted
    are those training held."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of model state this process holds: parameters, gradients (one per trainable parameter), optimizer state
    (the ZeRO accounting that decides whether a model fits; activations come on top). DDP holds all of it on every
    process, FSDP 1/N (a DTensor reports its *global* shape: its local shard is counted). Tied weights count once."""
    local = lambda tensor: tensor.to_local() if hasattr(tensor, "to_local") else tensor
    shards = {local(param).data_ptr(): (local(param), param.requires_grad) for param in model.parameters()}
    parameters = sum(shard.numel() * shard.element_size() for shard, _ in shards.values())
    gradients = sum(shard.numel() * shard.element_size() for shard, trained in shards.values() if trained)
    optimizer_state = sum(
        local(value).numel() * local(value).element_size()
        for state in (optimizer.state.values() if optimizer else ())
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )  # Adam's 0-d step counter too: it is state
    return {
        "parameters": parameters,
        "gradients": gradients,
        "optimizer": optimizer_state,
        "total": parameters + gradients + optimizer_state,
    }
