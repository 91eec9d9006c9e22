"""What the classifier's device_map split puts where, printed before training: the parameter bytes of each device
the plan (``shared.model_split.plan_device_map``) names."""

from __future__ import annotations

from torch import nn


def parameter_bytes_per_device(model: nn.Module, plan: dict[str, int]) -> dict[int, int]:
    """Bytes of parameters each planned device holds (what the plan puts where, before training)."""
    totals: dict[int, int] = {}
    for name, index in plan.items():
        size = sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters())
        totals[index] = totals.get(index, 0) + size
    return totals
