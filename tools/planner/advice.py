"""What would fit instead: for a setup that does not fit, the first change that makes it fit; when nothing fits, the
smallest need and the fewest such GPUs on which FSDP would fit. Each alternative is estimated, not guessed."""

from __future__ import annotations

from tools.planner.setups import estimate
from tools.planner.shapes import ModelShape
from tools.planner.tables import LABELS, METHODS, gib


def advice_for(shape: ModelShape, request: dict, name: str, setup: dict) -> str:
    """Why ``name`` does not fit, by how much, and the first change that makes it (or its offload twin) fit."""
    problems = _problems(request, setup)
    for changes, target, label in _alternatives(request, name):
        other = estimate(shape, {**request, **changes})
        if target in other and other[target]["fits"]:
            return "; ".join(problems) + f". {label} fits: {gib(other[target]['peak'])} per GPU"
    return "; ".join(problems) + ". No change of checkpointing, micro-batch, method or offload makes it fit"


def _problems(request: dict, setup: dict) -> list[str]:
    budget, host_budget = request["budget"], request["host_budget"]
    problems = []
    if setup["peak"] > budget:
        problems.append(f"needs {gib(setup['peak'])} per GPU, {gib(setup['over_by'])} over {gib(budget)}")
    if setup["gpu_load_peak"] is not None and setup["gpu_load_peak"] > budget:
        problems.append(
            f"loading needs {gib(setup['gpu_load_peak'])} per GPU: {setup['recipe']} loads one layer at a "
            f"time and keeps this GPU's shard, but the shards, constants and the layer in flight exceed the card "
            f"(training itself needs {gib(setup['peak'])})"
        )
    if not setup["fits_host"]:
        problems.append(
            f"needs {gib(setup['host_ram'])} of host RAM, {gib(setup['host_over_by'])} more than the machine's "
            f"{gib(host_budget)} (--host_ram_gib)"
        )
    return problems


def _alternatives(request: dict, name: str) -> list[tuple[dict, str, str]]:
    """(changes to the request, the setup to try them on, how to say it), in the order they are tried: checkpointing,
    a micro-batch of 1, a lighter method, offload."""
    lighter = list(METHODS[METHODS.index(request["method"]) + 1 :])
    alternatives = []
    if request.get("precompute_reference") is False:  # DPO: drop the reference copy first, it costs one pass
        alternatives.append(({"precompute_reference": True}, name, "--precompute_reference"))
    if not request["gradient_checkpointing"]:
        alternatives.append(({"gradient_checkpointing": True}, name, "with --gradient_checkpointing"))
    if request["micro_batch"] > 1:
        alternatives.append(
            ({"gradient_checkpointing": True, "micro_batch": 1}, name, "--gradient_checkpointing --micro_batch 1")
        )
    for method in lighter:
        alternatives.append(({"method": method, "gradient_checkpointing": True}, name, f"{LABELS[method]}"))
    if name == "fsdp":
        alternatives.append(({"gradient_checkpointing": True}, "fsdp_offload", "fsdp_offload"))
    if name in ("fsdp", "fsdp_offload"):
        for method in lighter:
            alternatives.append(
                ({"method": method, "gradient_checkpointing": True}, "fsdp_offload", f"{LABELS[method]} + offload")
            )
    return alternatives


def nothing_fits(shape: ModelShape, request: dict, setups: dict, preference: list[str]) -> str:
    """The reason when no setup fits: the smallest need, what blocks it, the first advice that helps (in order of
    ``preference``), and on how many such GPUs FSDP would fit."""
    gpus, budget = request["gpus"], request["budget"]
    best = min(setups, key=lambda name: setups[name]["peak_checkpointed"])
    state = max(device["model_state"] for device in setups[best]["devices"])
    reason = (
        f"Nothing fits {gpus} x {gib(budget)} and {gib(request['host_budget'])} of host RAM, even with "
        f"--gradient_checkpointing: the smallest GPU need is {best}'s {gib(setups[best]['peak_checkpointed'])} "
        "per GPU" + (f", of which model state {gib(state)}" if state else "")
    )
    if setups[best]["peak_checkpointed"] <= budget:
        blockers = []
        if (setups[best]["gpu_load_peak"] or 0) > budget:
            blockers.append(f"loading needs {gib(setups[best]['gpu_load_peak'])} per GPU")
        if not setups[best]["fits_host"]:
            blockers.append(f"it needs {gib(setups[best]['host_ram'])} of host RAM")
        reason += ", but " + " and ".join(blockers) if blockers else ""
    reason += "."
    helpful = [text for text in (setups[name].get("advice", "") for name in preference) if " fits: " in text]
    if helpful:
        reason += " " + helpful[0].split(". ")[-1] + "."
    return reason + _more_gpus(shape, request, setups)


def _more_gpus(shape: ModelShape, request: dict, setups: dict) -> str:
    """The fewest such GPUs on which FSDP fits with checkpointing (its per-GPU need falls as GPUs are added), or why
    no number does."""
    budget = request["budget"]

    def fsdp_fits_on(count: int) -> dict | None:
        wider = estimate(shape, {**request, "gpus": count, "gradient_checkpointing": True}, only="fsdp")["fsdp"]
        return wider if wider["peak_checkpointed"] <= budget and wider["gpu_load_peak"] in (None, 0) else None

    low, high = request["gpus"] + 1, 1024
    if "fsdp" in setups and (setups["fsdp"]["gpu_load_peak"] or 0) > budget:
        return (
            f" Loading needs {gib(setups['fsdp']['gpu_load_peak'])} per GPU under FSDP (this GPU's shards, all the "
            "quantization constants and one layer in flight); more GPUs shrink the shards only."
        )
    if fsdp_fits_on(high) is None:
        return (
            " No number of such GPUs is enough under FSDP: what is not sharded (activations, gathered units, "
            "quantization constants) does not fit; use a shorter sequence or QLoRA."
        )
    while low < high:  # bisection: the fewest GPUs on which FSDP fits
        middle = (low + high) // 2
        low, high = (low, middle) if fsdp_fits_on(middle) else (middle + 1, high)
    wider = fsdp_fits_on(low)
    return (
        f" FSDP would fit on {low} such GPUs ({gib(wider['peak_checkpointed'])} each, with "
        "--gradient_checkpointing; host RAM aside); or shrink the model state (LoRA, QLoRA) or offload it to CPU."
    )
