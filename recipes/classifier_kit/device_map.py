"""The classifier's device_map split (``recipes/transformer_finetune.py``): the model placed over two devices by the
dispatcher every splitting recipe uses (``shared.model_split``), and what it puts where, printed before training."""

from __future__ import annotations

import json

import torch
from torch import nn

from shared.model_split import dispatch_on_devices, plan_device_map, split_devices
from shared.errors import RecipeError


def parameter_bytes_per_device(model: nn.Module, plan: dict[str, int]) -> dict[int, int]:
    """Bytes of parameters each planned device holds (what the plan puts where, before training)."""
    totals: dict[int, int] = {}
    for name, index in plan.items():
        size = sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters())
        totals[index] = totals.get(index, 0) + size
    return totals


def split_model(model, model_name: str, device: torch.device, print_fn):
    """device_map: the model split over two devices by one dispatcher for every recipe that splits (shared/
    model_split.py): two GPUs, one GPU + the CPU, or two CPU "devices" (the same AlignDevicesHook per block as on
    GPUs)."""
    split_over = split_devices(device)
    try:
        plan = plan_device_map(model, len(split_over))
    except ValueError as error:
        raise RecipeError(f"Cannot split {model_name!r} over {len(split_over)} devices: {error}.") from None
    model, device_map = dispatch_on_devices(model, plan, split_over)
    planned = parameter_bytes_per_device(model, plan)
    gib = {f"device {i} ({split_over[i]})": round(size / 2**30, 4) for i, size in sorted(planned.items())}
    print_fn("device_map: parameters per device (GiB): " + json.dumps(gib))
    print_fn("device_map: " + json.dumps({name: str(device) for name, device in device_map.items()}))
    return model, sorted(set(split_over), key=str)
