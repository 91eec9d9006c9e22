"""The decision: every setup estimated, which one to use, and why.

The recommendation, in a fixed order of preference (the first that fits wins; a setup that fits without activation
checkpointing beats every setup that needs it, since recomputation costs about one extra forward pass, ~33 % more
compute; ``--gradient_checkpointing`` asks for it and the estimate assumes it): ``ddp`` (every GPU computes, only
gradients travel, overlapped with backward) > ``fsdp`` (every GPU computes; parameters are all-gathered in forward
and backward, ~1.5x DDP's traffic) > ``pipeline`` (full fine-tuning of the presets; every GPU computes except for the
bubble, (p-1)/(m+p-1) of the time) > ``single`` (one GPU computes) > ``device_map`` (fits larger models, but one GPU
computes at a time) > ``fsdp_offload`` (fits the largest models; every block crosses PCIe twice per step and AdamW
steps on the CPU: several times slower). ``--cpu_offload`` puts ``fsdp_offload`` first. A tight DDP fit yields to
FSDP when FSDP fits with room to spare. A setup that does not fit says by how much and what would fit instead
(checkpointing, a micro-batch of 1, LoRA, QLoRA, offload, more GPUs: ``advice.py``).
"""

from __future__ import annotations

from dataclasses import asdict

from tools.planner.advice import advice_for, nothing_fits
from tools.planner.launch import launch_line
from tools.planner.memory import adapted_linears, lora_params_per_block, precision_profile
from tools.planner.setups import estimate
from tools.planner.shapes import ModelShape
from tools.planner.tables import (
    CONFIGS,
    DEFAULT_OVERHEAD_GIB,
    GIB,
    METHODS,
    MIXED_PRECISION,
    OBJECTIVES,
    PREFERENCE,
    TIGHT,
    gib,
)


def typical_host_ram_gib(gpus: int, gpu_memory_gib: float) -> float:
    """The default of --host_ram_gib: the RAM a machine with these GPUs usually has (workstations and cloud nodes
    pair each GPU with at least its own memory twice over: 2 x 24 GiB cards with 96-128 GiB, 8 x 80 GiB nodes with
    1-2 TiB), never less than 64 GiB. The target's, not this machine's: plans are often made on a laptop."""
    return max(64.0, 2.0 * gpus * gpu_memory_gib)


def plan(
    shape: ModelShape,
    gpus: int,
    gpu_memory_gib: float,
    seq_len: int,
    micro_batch: int,
    mixed_precision: str = "bf16",
    num_microbatches: int = 8,
    pipeline_schedule: str = "1f1b",
    attention: str = "sdpa",
    overhead_gib: float = DEFAULT_OVERHEAD_GIB,
    *,
    method: str = "full",
    objective: str = "sft",
    precompute_reference: bool | None = None,
    num_generations: int = 8,
    beta: float = 0.0,
    lora_r: int = 8,
    lora_dropout: float = 0.0,
    gradient_checkpointing: bool = False,
    cpu_offload: bool = False,
    host_ram_gib: float | None = None,
    lora_targets=None,
    precision: dict | None = None,
    advise: bool = True,
) -> dict:
    """Per-GPU and host memory of every setup on ``gpus`` GPUs of ``gpu_memory_gib``, and the recommendation.

    ``micro_batch``: sequences per forward pass on one device (pipeline: per micro-batch, with
    ``num_microbatches`` of them per batch; DPO: pairs, two sequences each). ``method``: full, lora or qlora (LoRA
    rank ``lora_r`` on ``lora_targets``, default every linear layer of the blocks). ``objective``: sft or dpo
    (``recipes/dpo.py``) or grpo (``recipes/grpo.py``); ``precompute_reference``: DPO with full fine-tuning only,
    reference log-probabilities computed before training (default, True) or a frozen reference copy (False).
    ``num_generations`` (GRPO: the sequences of one group, whose KV cache a generating GPU holds) and ``beta`` (GRPO:
    > 0, a reference forward; with full fine-tuning a frozen copy). ``gradient_checkpointing``: the
    estimate and the recommendation assume it (False: the recommendation weighs the best setup with and without it).
    ``cpu_offload``: prefer ``fsdp_offload``. ``host_ram_gib``: the target machine's RAM (default:
    ``typical_host_ram_gib``). ``precision``: overrides of ``precision_profile`` for setups other than our recipes'.
    Returns a JSON-ready dict; every memory number is in bytes (per GPU, or for the host). Raises ValueError on
    impossible inputs.
    """
    # What was asked, in one dict every estimate reads (the advice re-estimates with a few entries changed).
    request = dict(
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        host_ram_gib=host_ram_gib,
        seq_len=seq_len,
        micro_batch=micro_batch,
        method=method,
        objective=objective,
        # The recipe's default: full DPO precomputes; LoRA's reference is the base itself (the flag does not apply).
        precompute_reference=(precompute_reference is not False) if objective == "dpo" and method == "full" else None,
        num_generations=num_generations if objective == "grpo" else None,
        beta=beta if objective == "grpo" else None,
        lora_r=lora_r,
        lora_dropout=lora_dropout,
        mixed_precision=mixed_precision,
        gradient_checkpointing=gradient_checkpointing,
        cpu_offload=cpu_offload,
        num_microbatches=num_microbatches,
        pipeline_schedule=pipeline_schedule,
        attention=attention,
        overhead_gib=overhead_gib,
        lora_targets=tuple(lora_targets) if lora_targets is not None else None,
        profile=precision,
    )
    _check(shape, request, precompute_reference)
    _add_budgets(request)
    setups = estimate(shape, request)
    if advise:
        _advise_all(shape, request, setups)
    result = {"model": _model_facts(shape, request), "inputs": _inputs(request), "setups": setups}
    result["recommendation"] = recommend(shape, request, setups)
    result["best"] = result["recommendation"]["setup"]
    return result


def _check(shape: ModelShape, request: dict, precompute_reference: bool | None) -> None:
    """ValueError, naming the flag, for inputs no estimate can take."""
    for flag in ("gpus", "seq_len", "micro_batch", "num_microbatches", "lora_r"):
        value = request[flag]
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{flag} must be a whole number >= 1, got {value}")
    if not request["gpu_memory_gib"] > 0:
        raise ValueError(f"--gpu_memory_gib must be > 0, got {request['gpu_memory_gib']}")
    if not request["overhead_gib"] >= 0:
        raise ValueError(f"--overhead_gib must be >= 0, got {request['overhead_gib']}")
    if request["host_ram_gib"] is not None and not request["host_ram_gib"] > 0:
        raise ValueError(f"--host_ram_gib must be > 0, got {request['host_ram_gib']}")
    if not 0 <= request["lora_dropout"] < 1:
        raise ValueError(f"--lora_dropout must be in [0, 1), got {request['lora_dropout']}")
    if request["mixed_precision"] not in MIXED_PRECISION:
        allowed = ", ".join(MIXED_PRECISION)
        raise ValueError(f"--mixed_precision must be one of {allowed}, got {request['mixed_precision']!r}")
    if request["method"] not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {request['method']!r}")
    if request["pipeline_schedule"] not in ("1f1b", "gpipe"):
        raise ValueError(f"--pipeline_schedule must be 1f1b or gpipe, got {request['pipeline_schedule']!r}")
    if request["attention"] not in ("sdpa", "eager"):
        raise ValueError(f"--attention must be sdpa or eager, got {request['attention']!r}")
    if request["objective"] not in OBJECTIVES:
        raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {request['objective']!r}")
    if precompute_reference is not None and (request["objective"], request["method"]) != ("dpo", "full"):
        raise ValueError(
            "--precompute_reference / --no-precompute_reference apply to --objective dpo --method full only (with "
            "LoRA and QLoRA the reference is the base with the adapter disabled: no second model)"
        )
    generations = request["num_generations"]
    if request["objective"] == "grpo" and not (isinstance(generations, int) and generations >= 2):
        raise ValueError(f"--num_generations must be a whole number >= 2 (a group), got {generations}")
    if request["objective"] == "grpo" and not request["beta"] >= 0:
        raise ValueError(f"--beta must be >= 0, got {request['beta']}")
    if request["method"] != "full" and not adapted_linears(shape, request["lora_targets"]):
        raise ValueError(f"{shape.name}: LoRA finds no linear layer to adapt in its blocks")


def _add_budgets(request: dict) -> None:
    """What every estimate compares and adds, in bytes; the host's RAM is a typical target's unless given."""
    if request["host_ram_gib"] is None:
        request["host_ram_gib"] = typical_host_ram_gib(request["gpus"], request["gpu_memory_gib"])
    request["overhead"] = int(request["overhead_gib"] * GIB)
    request["budget"] = int(request["gpu_memory_gib"] * GIB)
    request["host_budget"] = int(request["host_ram_gib"] * GIB)


def _advise_all(shape: ModelShape, request: dict, setups: dict) -> None:
    """Advice for every setup that does not fit; none for what no recipe trains (a LoRA pipeline)."""
    for name, setup in setups.items():
        if not setup["fits"] and setup["recipe"]:
            setup["advice"] = advice_for(shape, request, name, setup)


def _model_facts(shape: ModelShape, request: dict) -> dict:
    """The shape as the result reports it, with its parameter count and the LoRA adapter's."""
    adapter = 0
    if request["method"] != "full":
        adapter = shape.num_layers * lora_params_per_block(shape, request["lora_r"], request["lora_targets"])
    return {**asdict(shape), "num_parameters": shape.num_parameters, "lora_parameters": adapter}


def _inputs(request: dict) -> dict:
    """What was asked, as the result reports it (LoRA's rank and dropout only for LoRA and QLoRA)."""
    lora = request["method"] != "full"
    return {
        "gpus": request["gpus"],
        "gpu_memory_gib": request["gpu_memory_gib"],
        "host_ram_gib": round(request["host_ram_gib"], 2),
        "seq_len": request["seq_len"],
        "micro_batch": request["micro_batch"],
        "method": request["method"],
        "objective": request["objective"],
        "precompute_reference": request["precompute_reference"],
        "num_generations": request["num_generations"],
        "beta": request["beta"],
        "lora_r": request["lora_r"] if lora else None,
        "lora_dropout": request["lora_dropout"] if lora else None,
        "mixed_precision": request["mixed_precision"],
        "gradient_checkpointing": request["gradient_checkpointing"],
        "cpu_offload": request["cpu_offload"],
        "num_microbatches": request["num_microbatches"],
        "pipeline_schedule": request["pipeline_schedule"],
        "attention": request["attention"],
        "overhead_gib": request["overhead_gib"],
        "precision": precision_profile(request["method"], request["mixed_precision"], False, request["profile"]),
    }


# ------------------------------------------------------------------------------- which one
def order(request: dict, setups: dict) -> list[str]:
    """The setups that a recipe trains, in order of preference (``--cpu_offload``: fsdp_offload first)."""
    names = [name for name in PREFERENCE if name in setups and setups[name]["recipe"]]
    if request["cpu_offload"] and "fsdp_offload" in names:
        names.remove("fsdp_offload")
        names.insert(0, "fsdp_offload")
    return names


def fits_with(setup: dict, checkpointing: bool) -> bool:
    return setup["fits_with_checkpointing" if checkpointing else "fits_without_checkpointing"]


def relative_speed(name: str, checkpointing: bool, request: dict) -> float:
    """A rough step rate relative to one GPU without checkpointing, to weigh a setup that needs checkpointing
    against one that does not: DDP computes on every GPU; FSDP too, ~10 % slower for its all-gathers; the pipeline
    loses its bubble, (p-1)/(m+p-1); one GPU and the device_map split compute on one GPU at a time; offload is
    several times slower (PCIe both ways every step, AdamW on the CPU). Checkpointing recomputes the forward: ~3/4."""
    gpus, m = request["gpus"], request["num_microbatches"]
    speed = {
        "ddp": gpus,
        "fsdp": 0.9 * gpus,
        "pipeline": gpus * (1 - (gpus - 1) / (m + gpus - 1)),
        "single": 1.0,
        "device_map": 1.0,
        "fsdp_offload": 0.3 * gpus,
        "generation_split": gpus - 1,  # the trainers' rate; generation overlaps their step (docs/grpo.md)
    }[name]
    return speed * (0.75 if checkpointing else 1.0)


def choose(request: dict, setups: dict):
    """The setup to use and whether it needs checkpointing. ``--gradient_checkpointing`` fixes checkpointing on;
    otherwise the best setup without it and the best with it are weighed by ``relative_speed`` (DDP with
    checkpointing on two GPUs beats a device_map split without it). Within each, the first in order of preference
    that fits; a tight DDP fit yields to FSDP when FSDP fits comfortably (both compute on every GPU; FSDP's margin is
    worth its traffic), and an FSDP fit that is tight even with checkpointing yields to FSDP + CPU offload when that
    fits comfortably (measured peaks run up to ~15 % above the estimates: a tight fit is a likely out-of-memory)."""
    best = [
        (name, checkpointing)
        for checkpointing in ((True,) if request["gradient_checkpointing"] else (False, True))
        if (name := _first_fit(request, setups, checkpointing))
    ]
    if not best:
        return None
    # A fit without checkpointing wins ties: the same speed for less compute.
    return max(best, key=lambda choice: (relative_speed(*choice, request), not choice[1]))


def _first_fit(request: dict, setups: dict, checkpointing: bool) -> str | None:
    fitting = [name for name in order(request, setups) if fits_with(setups[name], checkpointing)]
    if not fitting:
        return None
    key = "peak_checkpointed" if checkpointing else "peak_without_checkpointing"
    tight = {name for name in fitting if setups[name][key] > TIGHT * request["budget"]}
    if fitting[0] == "ddp" and "ddp" in tight and "fsdp" in fitting and "fsdp" not in tight:
        return "fsdp"
    # FSDP tight even with checkpointing: offloading is slower, but checkpointing would not make room.
    fsdp_tight = setups.get("fsdp", {}).get("peak_checkpointed", 0) > TIGHT * request["budget"]
    if fitting[0] == "fsdp" and fsdp_tight and "fsdp_offload" in fitting and "fsdp_offload" not in tight:
        return "fsdp_offload"
    return fitting[0]


def recommend(shape: ModelShape, request: dict, setups: dict) -> dict:
    """The chosen setup, whether it needs checkpointing, why, its config and launch line."""
    chosen = choose(request, setups)
    if chosen is None:
        reason = nothing_fits(shape, request, setups, order(request, setups))
        return {"setup": None, "gradient_checkpointing": None, "reason": reason}
    name, checkpointing = chosen
    key = "peak_checkpointed" if checkpointing else "peak_without_checkpointing"
    reason = _why(name, key, checkpointing, request, setups)
    if checkpointing and not request["gradient_checkpointing"]:
        reason += _why_checkpointing(setups[name])
        without = _first_fit(request, setups, False)
        if without:
            faster, slower = relative_speed(name, True, request), relative_speed(without, False, request)
            reason += (
                f" Chosen over the best setup without checkpointing, {without}: about {faster:.1f}x one GPU's "
                f"step rate against {slower:.1f}x."
            )
    if setups[name][key] > TIGHT * request["budget"]:
        reason += _why_tight(setups[name], key, checkpointing, request)
    config = CONFIGS[name] if request["gpus"] == 2 or name == "single" else None
    return {
        "setup": name,
        "gradient_checkpointing": checkpointing,
        "reason": reason,
        "peak_bytes": setups[name][key],
        "host_ram_bytes": setups[name]["host_ram"],
        "config": config,
        "launch": launch_line(shape, name, checkpointing, config, request),
    }


def _why(name: str, key: str, checkpointing: bool, request: dict, setups: dict) -> str:
    """Why this setup wins: what it costs and what the setups before it in the order lack."""
    memory, peak, gpus = gib(request["budget"]), gib(setups[name][key]), request["gpus"]
    if name == "ddp":
        return (
            f"DDP fits ({peak} of {memory} per GPU): each GPU holds a full replica and computes its share of every "
            "batch; only gradients travel, overlapped with the backward pass. The fastest setup when it fits."
        )
    if name == "fsdp" and fits_with(setups["ddp"], checkpointing):
        return (
            f"DDP fits, but tightly ({gib(setups['ddp'][key])} of {memory} per GPU; measured peaks run up to ~15 % "
            f"above these estimates): FSDP divides the model state by {gpus} ({peak} per GPU), every GPU still "
            "computes, for about 1.5x DDP's traffic."
        )
    if name == "fsdp":
        return (
            f"DDP needs {gib(setups['ddp'][key])} per GPU, more than {memory}: data parallelism divides the batch, "
            f"not the model, so every GPU would hold all of the model state. FSDP (full shard) divides parameters, "
            f"gradients and optimizer state by {gpus} ({peak} per GPU) and every GPU still computes; the price is "
            "all-gathering the parameters in forward and backward (about 1.5x DDP's traffic)."
        )
    if name == "generation_split":
        ddp = f"DDP ({gib(setups['ddp'][key])}) and FSDP ({gib(setups['fsdp'][key])} per GPU) do not fit"
        return (
            f"{ddp}. The generation split does ({peak} on its fullest GPU): {gpus - 1} GPU(s) only train (no KV "
            "cache) and one only generates (its weights and the KV cache: no gradients, no optimizer state), a round "
            "ahead; a step takes the longer of generating and training."
        )
    if name == "pipeline":
        m, p = request["num_microbatches"], gpus
        return (
            f"Neither DDP ({gib(setups['ddp'][key])}) nor FSDP ({gib(setups['fsdp'][key])} per GPU) fits {memory}. "
            f"The pipeline gives each GPU a contiguous group of blocks ({setups[name]['blocks_per_device']}; largest "
            f"stage {peak}) and keeps every GPU busy except for the bubble, (p-1)/(m+p-1) = "
            f"{(p - 1) / (m + p - 1):.0%} with m = {m} micro-batches."
        )
    if name == "single":
        if gpus == 1:
            return f"One GPU: the model fits ({peak} of {memory})."
        return f"The model fits one GPU ({peak}) but no setup that uses all {gpus} does."
    if name == "device_map":
        return (
            f"Only the naive device_map split fits ({peak} on its fullest GPU): it lets the model fit, but one GPU "
            "computes at a time, so it is no faster than one GPU."
        )
    reason = (
        f"FSDP2 with CPU offload fits ({peak} per GPU, {gib(setups[name]['host_ram'])} of host RAM): parameters, "
        "gradients and optimizer state live in host RAM and each block crosses PCIe to the GPU and back every "
        "step, AdamW steps on the CPU: several times slower than FSDP without offload."
    )
    if request["cpu_offload"]:
        return reason
    if fits_with(setups["fsdp"], checkpointing):
        return (
            f"FSDP fits, but tightly ({gib(setups['fsdp'][key])} of {memory} per GPU; measured peaks run up to "
            "~15 % above these estimates). " + reason
        )
    return f"Nothing fits without offload ({setups['fsdp'].get('advice', 'FSDP does not fit')}). " + reason


def _why_checkpointing(setup: dict) -> str:
    device = max(setup["devices"], key=lambda d: d["total"])
    return (
        f" Needs --gradient_checkpointing: the activations ({gib(device['activations'])}) are what does not fit "
        f"({gib(setup['peak_without_checkpointing'])} without it); checkpointed they take "
        f"{gib(device['activations_checkpointed'])}, for about one extra forward pass (~33 % more compute)."
    )


def _why_tight(setup: dict, key: str, checkpointing: bool, request: dict) -> str:
    if checkpointing:
        shorter = f"a shorter --seq_len{' or --micro_batch' if request['micro_batch'] > 1 else ''}"
        remedy = f"; {shorter} leaves headroom."
    else:
        remedy = f"; --gradient_checkpointing brings it to {gib(setup['peak_checkpointed'])}."
    return (
        f" Tight: {gib(setup[key])} of {gib(request['budget'])}, and measured peaks (the allocator's reserved memory) "
        "run up to ~15 % above these estimates" + remedy
    )
