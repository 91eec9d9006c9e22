"""Two sides of a study compared: the adapters they saved, and a number of each (the studies against TRL)."""

from __future__ import annotations

from pathlib import Path


def adapter_difference(a: Path, b: Path) -> dict:
    """Tensor-by-tensor comparison of the LoRA adapters saved in folders ``a`` and ``b``: the largest absolute
    difference, the largest weight of ``a``, and the norm of the difference over the norm of ``a`` (all tensors
    together)."""
    from safetensors.torch import load_file

    first, second = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    if set(first) != set(second):
        only_first, only_second = sorted(set(first) - set(second))[:5], sorted(set(second) - set(first))[:5]
        return {"same_tensors": False, "only_in_first": only_first, "only_in_second": only_second}
    diffs = {k: first[k].double() - second[k].double() for k in first}
    return {
        "same_tensors": True,
        "tensors": len(first),
        "max_abs_diff": max(float(d.abs().max()) for d in diffs.values()),
        "max_abs_value": max(float(t.abs().max()) for t in first.values()),
        "relative_diff": sum(float(d.pow(2).sum()) for d in diffs.values()) ** 0.5
        / sum(float(t.double().pow(2).sum()) for t in first.values()) ** 0.5,
    }


def value_of(side: dict, key: str) -> float:
    """A number of one side; peak memory: the sum over the devices (or processes) it lists."""
    value = side[key]
    return sum(value.values()) if isinstance(value, dict) else value
