"""Test-only facts about a finished run, taken by the observer (``sitecustomize.py``) in each process when the recipe
hands its prepared model to ``accelerator.free_memory``, and written to ``<output_dir>.observed/facts-rank<R>.json``
(``read_facts`` in launch.py reads them). None of this is in a recipe or in ``results.json``:

- ``fsdp/sharding``: what this process holds under FSDP2 (``sharding_facts``);
- ``device_map/hooks``: the execution device of the hook Accelerate attached to each module of a device_map split;
- ``compile/compiled_modules``: how many modules run compiled;
- ``loading/shard_sums``: with FSDP2 low host-RAM loading, the sum of every frozen weight's local shard (tests compare
  them with the checkpoint's slices);
- ``memory/model_state_bytes``: the bytes of parameters, gradients and optimizer state this process holds (counted by
  benchmarks/lib/model_state.py, which the benchmark records use too);
- ``model/tied_embeddings``: whether the LM head's weight is the embedding's own parameter (tied: one parameter), after
  sharding too.
"""

import importlib.util
import os
from pathlib import Path

import torch

# benchmarks/lib/model_state.py, loaded by its path: a copied recipe's process has no repository on sys.path.
_spec = importlib.util.spec_from_file_location(
    "model_state", Path(__file__).resolve().parents[3] / "benchmarks" / "lib" / "model_state.py"
)
model_state = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_state)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2) local shard; other tensors as they are (a DTensor's numel() is the global tensor's)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def sharding_facts(model: torch.nn.Module, optimizer=None) -> dict:
    """DTensor (FSDP2-sharded) parameters, elements held (``local_numel``) against the model's (``global_numel``), the
    modules ``fully_shard`` was applied to, and where the shards and the optimizer state live: ``offloaded_parameters``
    counts the parameters FSDP2 keeps on the CPU (torch has no public accessor, hence ``_get_fsdp_state``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    parameters = list(model.parameters())
    states = [module._get_fsdp_state() for module in model.modules() if isinstance(module, FSDPModule)]
    # fully_shard([embeddings, norm, head]) gives several modules one state: count each group once.
    groups = {id(state): state._fsdp_param_group for state in states if state._fsdp_param_group is not None}.values()
    optimizer_values = [v for state in (optimizer.state.values() if optimizer else []) for v in state.values()]
    return {
        "parameters": len(parameters),
        "dtensor_parameters": sum(isinstance(parameter, DTensor) for parameter in parameters),
        "local_numel": sum(local(p).numel() for p in parameters),
        "global_numel": sum(parameter.numel() for parameter in parameters),
        "fsdp_modules": len(states),
        "offloaded_parameters": sum(fsdp_param.offload_to_cpu for group in groups for fsdp_param in group.fsdp_params),
        "shard_devices": sorted({str(local(p).device) for p in parameters}),
        "optimizer_state_devices": sorted(
            {str(getattr(v, "device", "none")) for v in optimizer_values if isinstance(v, torch.Tensor) and v.ndim}
        ),
    }


def execution_devices(model: torch.nn.Module, device_map: dict) -> dict:
    """The execution device of the hook Accelerate attached to each planned module (None: no hook): proof that a split
    really went through the hooks, on CPU as on GPUs."""
    hooks = {name: getattr(model.get_submodule(name), "_hf_hook", None) for name in device_map}
    return {
        name: str(hook.execution_device) if hasattr(hook, "execution_device") else None for name, hook in hooks.items()
    }


def compiled_modules(model: torch.nn.Module) -> int:
    """``torch.compile`` wrappers (regional compilation wraps each decoder block) and modules compiled in place
    (``module.compile()``, regional compilation under FSDP2). 0 without ``--compile``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return sum(
        isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None
        for module in model.modules()
    )


def run_facts(accelerator, model: torch.nn.Module, optimizer=None) -> dict:
    """This process's facts about the model it trained (see the module's docstring)."""
    facts = {"compile/compiled_modules": compiled_modules(model)}
    if accelerator.is_fsdp2:
        # FSDP2 leaves the root's parameters unsharded after a forward without backward (an evaluation): resharded,
        # the facts describe the sharded state that training held.
        model_state.reshard_fsdp2_modules(model)
        facts["fsdp/sharding"] = sharding_facts(model, optimizer)
        if os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true":
            facts["loading/shard_sums"] = {
                name: float(local(parameter).double().sum())
                for name, parameter in model.named_parameters()
                if not parameter.requires_grad
            }
    facts["memory/model_state_bytes"] = model_state.model_state_bytes(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    base = unwrapped if "hf_device_map" in vars(unwrapped) else base  # the map is relative to the model it was set on
    device_map = getattr(base, "hf_device_map", None)
    facts["device_map/hooks"] = execution_devices(base, device_map) if device_map else None
    embeddings = [getattr(base, f"get_{side}_embeddings", lambda: None)() for side in ("input", "output")]
    if all(hasattr(module, "weight") for module in embeddings):  # one parameter, or two that look alike
        facts["model/tied_embeddings"] = embeddings[0].weight is embeddings[1].weight
    return facts
