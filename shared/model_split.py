"""Splitting a Transformer over devices, so that it fits (one device computes at a time): the plan and the hooks."""

from __future__ import annotations

from itertools import accumulate

import torch
from accelerate import dispatch_model
from torch import nn

# Softmax + cross-entropy per token and vocabulary entry, in matmul FLOPs: measured on CPU (docs/benchmarks.md).
LOSS_COST_PER_VOCAB_ENTRY = 180.0


def find_block_list(model: nn.Module, block_classes: set[str]) -> str:
    """Name of the ``ModuleList`` of Transformer blocks (``bert.encoder.layer``); FSDP2's subclasses count."""
    for name, module in model.named_modules():
        blocks = isinstance(module, nn.ModuleList) and len(module)
        if blocks and all(block_classes & {cls.__name__ for cls in type(m).__mro__} for m in module):
            return name
    raise ValueError(f"no ModuleList of {sorted(block_classes)} found in {type(model).__name__}")


def balanced_partition(costs: list[float], num_parts: int) -> list[int]:
    """The part index of every item, ``costs`` cut into ``num_parts`` contiguous groups of the least largest total."""
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot cut {n} items into {num_parts} non-empty parts")
    prefix = list(accumulate(costs, initial=0.0))
    # best[k][i]: smallest possible maximum load when the first i items form k parts.
    best = [[float("inf")] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    parts, i = [0] * n, n
    for k in range(num_parts, 0, -1):
        j = cut[k][i]
        parts[j:i] = [k - 1] * (i - j)
        i = j
    return parts


def plan_device_map(model: nn.Module, num_devices: int, last_cost: float = 0.0) -> dict[str, int]:
    """``{module_name: device_index}``, whole blocks balanced by compute (``last_cost``: the head's, in blocks)."""
    block_list = find_block_list(model, set(getattr(model, "_no_split_modules", None) or []))
    num_blocks = len(model.get_submodule(block_list))
    if num_blocks < num_devices:
        raise ValueError(
            f"{type(model).__name__} has {num_blocks} blocks, fewer than the {num_devices} devices to split over"
        )
    # The modules after the blocks share a device with the last block: their cost is folded in.
    block_costs = [1.0] * num_blocks
    block_costs[-1] += last_cost
    block_device = balanced_partition(block_costs, num_devices)
    plan: dict[str, int] = {}
    path = block_list.split(".")
    # From the root down to the blocks: siblings before their branch go to the first device, those after to the last.
    for depth in range(len(path)):
        parent = model.get_submodule(".".join(path[:depth])) if depth else model
        before = True
        for name, child in parent.named_children():
            if name == path[depth]:
                before = False
                continue
            if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                plan[".".join(path[:depth] + [name])] = 0 if before else num_devices - 1
    for index, device in enumerate(block_device):
        plan[f"{block_list}.{index}"] = device
    for depth in range(len(path) + 1):  # parameters held by a module on the path itself: plan by hand
        prefix = ".".join(path[:depth])
        if any(True for _ in (model.get_submodule(prefix) if prefix else model).parameters(recurse=False)):
            raise ValueError(f"{type(model).__name__}.{prefix} holds parameters directly; plan it by hand")
    return plan


def _matmul_flops_per_token(module: nn.Module) -> float:
    """Forward FLOPs per token of the matrix multiplies in ``module`` (2 per multiply-add)."""
    flops = 0.0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            flops += 2 * sub.in_features * sub.out_features
        elif type(sub).__name__ == "Conv1D":  # GPT-2's transposed Linear
            flops += 2 * sub.weight.numel()
    return flops


def lm_head_cost_in_blocks(model: nn.Module, block_list: str, sequence_length: int) -> float:
    """The LM head and loss's compute in decoder blocks (attention: QK^T and AV, 2 x seq x hidden FLOPs per token)."""
    attention = 4 * sequence_length * model.config.hidden_size
    block = _matmul_flops_per_token(model.get_submodule(f"{block_list}.0")) + attention
    head = model.get_output_embeddings()
    return (2 * head.weight.numel() + LOSS_COST_PER_VOCAB_ENTRY * head.weight.shape[0]) / block


def split_devices(device: torch.device) -> list[torch.device]:
    """The devices a one-process split uses: every GPU of 2+, else one GPU and the CPU, else two CPU "devices"."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        return [torch.device("cuda", i) for i in range(count)] if count >= 2 else [device, torch.device("cpu")]
    return [device, device]


def dispatch_on_devices(model: nn.Module, plan: dict[str, int], devices: list[torch.device]) -> tuple[nn.Module, dict]:
    """Each planned module on its device, with Accelerate's hooks (on one device too), the model and the map."""
    device_map = {name: devices[part] for name, part in plan.items()}
    embeddings = model.get_input_embeddings()
    holds_embeddings = lambda name: any(module is embeddings for module in model.get_submodule(name).modules())
    main = next(device for name, device in device_map.items() if holds_embeddings(name))
    # skip_keys: a causal LM picks the hidden states of the positions in logits_to_keep on its last device, not main.
    model = dispatch_model(model, device_map, main_device=main, force_hooks=True, skip_keys=["logits_to_keep"])
    model.hf_device_map = dict(device_map)
    return model, device_map
