"""Planning a device_map: a Transformer's blocks split into contiguous, compute-balanced groups.

A device_map sends each submodule to a device; Accelerate's ``dispatch_model`` then moves the
activations between devices during forward and backward. Only one device computes at a time (the
next one waits for its input), so a split like this lets a model *fit*; it does not make it faster.

The plan here balances compute, not bytes: every Transformer block costs the same, the modules in
front of the blocks (embeddings) go to the first device and those after them (pooler, heads) to the
last, each with a cost you give in units of one block. A plan is device *indices*; ``map_to_devices``
turns it into real devices, ``cuda:0``/``cuda:1`` on a GPU box or ``cpu``/``cpu`` in tests, so the
same code path runs everywhere.
"""

from __future__ import annotations

import torch


def find_block_list(model: torch.nn.Module, block_classes: set[str]) -> str:
    """Name of the ``ModuleList`` that holds the Transformer blocks (e.g. ``bert.encoder.layer``)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(type(child).__name__ in block_classes for child in module):
            return name
    raise ValueError(f"no ModuleList of {sorted(block_classes)} found in {type(model).__name__}")


def balanced_partition(costs: list[float], num_parts: int) -> list[int]:
    """Cut ``costs`` into ``num_parts`` contiguous, non-empty groups that minimize the largest group's
    total; returns the part index of every item. Exact (dynamic programming), fine for < 1000 items."""
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot cut {n} items into {num_parts} non-empty parts")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
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


def plan_device_map(model: torch.nn.Module, num_devices: int, block_classes: set[str] | None = None,
                    first_cost: float = 0.0, last_cost: float = 0.0) -> dict[str, int]:
    """Split ``model`` over ``num_devices``: whole blocks only, balanced by compute.

    ``first_cost``/``last_cost``: the compute of the modules before/after the blocks, in blocks
    (an embedding lookup is ~0; an LM head over a large vocabulary can cost more than a block).
    Returns ``{module_name: device_index}`` covering every parameter of the model exactly once.
    """
    block_classes = block_classes or set(getattr(model, "_no_split_modules", None) or [])
    block_list = find_block_list(model, block_classes)
    num_blocks = len(model.get_submodule(block_list))
    if num_blocks < num_devices:
        raise ValueError(f"{type(model).__name__} has {num_blocks} blocks, fewer than the {num_devices} devices to split over")
    # The modules before/after the blocks share a device with the first/last block, so their cost is
    # folded into that block's.
    block_costs = [1.0] * num_blocks
    block_costs[0] += first_cost
    block_costs[-1] += last_cost
    block_device = balanced_partition(block_costs, num_devices)

    plan: dict[str, int] = {}
    path = block_list.split(".")
    # Walk from the root down to the block list. Siblings that come before the branch leading to the
    # blocks go to the first device, those after it to the last device.
    for depth in range(len(path)):
        parent = model.get_submodule(".".join(path[:depth])) if depth else model
        branch = path[depth]
        names = [name for name, _ in parent.named_children()]
        before = True
        for name in names:
            full = ".".join(path[:depth] + [name])
            if name == branch:
                before = False
                continue
            if any(True for _ in parent.get_submodule(name).parameters()) or any(True for _ in parent.get_submodule(name).buffers()):
                plan[full] = 0 if before else num_devices - 1
    for index, device in enumerate(block_device):
        plan[f"{block_list}.{index}"] = device
    # Parameters held directly by a module on the path (not by a child) stay with the first device.
    for depth in range(len(path) + 1):
        prefix = ".".join(path[:depth])
        module = model.get_submodule(prefix) if prefix else model
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"{type(model).__name__}.{prefix} holds parameters directly; plan it by hand")
    return plan


def map_to_devices(plan: dict[str, int], devices: list[str | torch.device]) -> dict[str, str]:
    """Turn a plan of device indices into a device_map for ``dispatch_model``."""
    return {name: str(devices[index]) for name, index in plan.items()}


def parameter_bytes_per_device(model: torch.nn.Module, plan: dict[str, int]) -> dict[int, int]:
    """Bytes of parameters each planned device holds (what the plan puts where, before training)."""
    totals: dict[int, int] = {}
    for name, index in plan.items():
        module = model.get_submodule(name)
        totals[index] = totals.get(index, 0) + sum(p.numel() * p.element_size() for p in module.parameters())
    return totals
