"""The estimate as text: what was assumed, the table (GiB per device), the recommendation and the arithmetic behind
it, and why each setup that does not fit does not. (``--json`` prints the result of ``fits.plan`` itself.)"""

from __future__ import annotations

from tools.planner.launch import DATA_PLACEHOLDER, WEIGHTS_PLACEHOLDER
from tools.planner.tables import GIB, LABELS, SETUPS, gib

COLUMNS = (
    "GiB per GPU             weights q.const  grads  optim buffers  activ. (ckpt)  temp.    total   (ckpt)  "
    "host RAM  fits"
)
# Model state and buffers: the table's first five columns and the first five lines of the arithmetic, which goes on
# with the activations (with or without checkpointing) and the rest.
STATE_TERMS = ("parameters", "quantization_constants", "gradients", "optimizer", "buffers")
OTHER_TERMS = ("temporaries", "optimizer_step", "overhead")


def format_table(result: dict) -> str:
    """The estimate as a readable table (GiB per device), the recommendation and the arithmetic behind it."""
    lines = _assumed(result.get("assumed") or {}) + _heading(result["model"], result["inputs"])
    for name in SETUPS:
        if name in result["setups"]:
            lines += _rows(name, result["setups"][name], result["inputs"])
    lines.append("")
    lines += _recommendation(result["recommendation"], result["setups"])
    advice = [(name, setup["advice"]) for name, setup in result["setups"].items() if setup.get("advice")]
    if advice:
        lines.append("")
        lines.extend(f"{name} does not fit: {text}" for name, text in advice)
    return "\n".join(lines)


def _assumed(assumed: dict) -> list[str]:
    """One line naming every input the command line did not give, with the value used."""
    if not assumed:
        return []
    values = (
        f"{flag} {value:g}"
        + (" (twice the GPUs' memory, at least 64: a typical target's)" if flag == "--host_ram_gib" else "")
        if isinstance(value, (int, float))
        else f"{flag} {value}"
        for flag, value in assumed.items()
    )
    return ["assumed, not given (each changes the answer; pass the flag to say otherwise): " + ", ".join(values)]


def _heading(model: dict, inputs: dict) -> list[str]:
    method = inputs["method"]
    lora = f", LoRA r={inputs['lora_r']} ({model['lora_parameters'] / 1e6:,.1f}M)" if method != "full" else ""
    batch = f"micro-batch {inputs['micro_batch']}"
    if inputs["objective"] == "dpo":
        reference = {
            None: "the base with the adapter disabled",
            True: "precomputed before training",
            False: "a frozen copy",
        }[inputs["precompute_reference"]]
        lora = f"{lora}; reference: {reference}"
        batch = f"micro-batch {inputs['micro_batch']} pairs ({2 * inputs['micro_batch']} sequences)"
    if inputs["objective"] == "grpo":
        reference = "a frozen copy" if method == "full" else "the base with the adapter disabled"
        lora = f"{lora}; beta {inputs['beta']:g}" + (f" (reference: {reference})" if inputs["beta"] else "")
        batch = (
            f"micro-batch {inputs['micro_batch']} completions, the KV cache of {inputs['num_generations']} while "
            "generating"
        )
    objective = {"dpo": "DPO, ", "grpo": "GRPO, "}.get(inputs["objective"], "")
    pipeline = f"; pipeline: {inputs['pipeline_schedule']}, {inputs['num_microbatches']} micro-batches"
    pipeline = "" if objective else pipeline  # recipes/dpo.py and grpo.py have no pipeline
    return [
        f"model {model['name']}: {model['num_parameters'] / 1e6:,.1f}M parameters (hidden {model['hidden_size']}, "
        f"{model['num_layers']} blocks, {model['num_heads']} heads / {model['num_kv_heads']} K/V, MLP "
        f"{model['intermediate_size']}, vocabulary {model['vocab_size']})",
        f"{objective}{LABELS[method]}{lora}; mixed_precision={inputs['mixed_precision']}; {inputs['gpus']} GPU(s) x "
        f"{inputs['gpu_memory_gib']:g} GiB, host RAM {inputs['host_ram_gib']:g} GiB; sequence {inputs['seq_len']}, "
        f"{batch}; {inputs['attention']} attention; overhead {inputs['overhead_gib']:g} "
        f"GiB per GPU{pipeline}",
        "",
        COLUMNS,
    ]


def _rows(name: str, setup: dict, inputs: dict) -> list[str]:
    """One row per device of a split, one for identical replicas or shards; host RAM on the first row."""
    devices = setup["devices"][:1] if setup["identical"] else setup["devices"]
    rows = []
    for index, device in enumerate(devices):
        if not setup["identical"]:
            label = f"{name} {device['device']}"
        elif len(setup["devices"]) > 1:
            label = f"{name} (each GPU)"
        else:
            label = name
        host = f"{setup['host_ram'] / GIB:>9.1f}" if index == 0 else " " * 9
        rows.append(
            f"{label:<23}"
            + "".join(f"{_column(device, key) / GIB:>7.1f}" for key in STATE_TERMS)
            + f"{device['activations'] / GIB:>7.1f} ({device['activations_checkpointed'] / GIB:>5.1f})"
            + f"{device['temporaries'] / GIB:>7.1f}"
            + f"{device['total'] / GIB:>9.1f} ({device['total_checkpointed'] / GIB:>6.1f}){host}  "
            + _fits_cell(setup, device, inputs)
        )
    return rows


def _column(device: dict, key: str) -> int:
    """A state column's bytes: the weights column holds DPO's reference copy too (its own line in the arithmetic)."""
    return device[key] + (device["reference"] if key == "parameters" else 0)


def _fits_cell(setup: dict, device: dict, inputs: dict) -> str:
    """yes, with ckpt, no (every reason it does not fit, with its number: the advice names the same ones), or
    (no recipe)."""
    budget = inputs["gpu_memory_gib"] * GIB
    training = device["total_checkpointed"]
    reasons = [f"training {training / GIB:.1f} GiB"] if training > budget else []
    if (setup["gpu_load_peak"] or 0) > budget:
        reasons.append(f"loading {setup['gpu_load_peak'] / GIB:.1f} GiB")
    if not setup["fits_host"]:
        reasons.append(f"host RAM {setup['host_ram'] / GIB:.1f} GiB")
    if setup["recipe"] is None:
        return "(no recipe)"
    if reasons:
        return "no (" + "; ".join(reasons) + ")"
    if device["total_checkpointed" if inputs["gradient_checkpointing"] else "total"] <= budget:
        return "yes"
    return "with ckpt"


def _recommendation(recommendation: dict, setups: dict) -> list[str]:
    """The chosen setup, why, its launch line (or config), and the arithmetic of its fullest device."""
    if recommendation["setup"] is None:
        return [f"recommendation: none. {recommendation['reason']}"]
    name, checkpointing = recommendation["setup"], recommendation["gradient_checkpointing"]
    flag = " + --gradient_checkpointing" if checkpointing else ""
    lines = [f"recommendation: {name}{flag}. {recommendation['reason']}"]
    if recommendation.get("launch"):
        lines.append(f"launch: {recommendation['launch']}")
        if WEIGHTS_PLACEHOLDER in recommendation["launch"]:
            lines.append(
                f"        replace {WEIGHTS_PLACEHOLDER} with the folder that holds the model's weights and "
                "tokenizer (the planner read only a config.json, with no weights beside it)"
            )
        if DATA_PLACEHOLDER in recommendation["launch"]:
            lines.append(
                f"        replace {DATA_PLACEHOLDER} with your training data (JSON Lines, CSV or Parquet: messages, "
                "prompt + completion or text; for dpo.py prompt, chosen and rejected; for grpo.py a prompt and what "
                "the rewards read)"
            )
    elif recommendation.get("config"):
        lines.append(f"config: accelerate_configs/{recommendation['config']}")
    return lines + _arithmetic(name, setups[name], checkpointing)


def _arithmetic(name: str, setup: dict, checkpointing: bool) -> list[str]:
    """Every term of the fullest device with its formula, the three moments and the peak, and the host RAM."""
    total_key = "total_checkpointed" if checkpointing else "total"
    device = max(setup["devices"], key=lambda d: d[total_key])
    activations = "activations_checkpointed" if checkpointing else "activations"
    lines = [f"arithmetic ({name}, {device['device']}, bytes per element as the module docstring says):"]
    for term in (*STATE_TERMS[:1], "reference", *STATE_TERMS[1:], activations, *OTHER_TERMS, "kv_cache"):
        if term not in ("reference", "kv_cache") or device["arithmetic"][term] != "0":
            lines.append(f"  {term}: {device['arithmetic'][term]}")
    phases = device["phases_checkpointed" if checkpointing else "phases"]
    lines.append(
        "  peak = model state + buffers + overhead + the largest of: "
        + ", ".join(f"{phase.replace('_', ' ')} {gib(value)}" for phase, value in phases.items())
        + f" = {gib(device[total_key])}"
    )
    if setup.get("gpu_load_arithmetic"):
        lines.append(f"  loading peak (QLoRA one layer at a time, before training): {setup['gpu_load_arithmetic']}")
    lines.append(f"  host RAM: {setup['host_ram_arithmetic']}")
    return lines
