"""One GPU's bill and the host's: the formulas of ``memory.py`` added up for what a device holds and runs.

Every term comes with the formula behind it (``arithmetic`` in the result), in the words the table prints. The peak is
model state + buffers + overhead + the largest of three moments: the start of backward (everything stored, the head's
backward), a block's backward (its recomputation and the gradients in flight; the head's tensors are gone) and the
optimizer step (activations gone, the step's temporary).
"""

from __future__ import annotations

from tools.planner.memory import (
    block_activation_bytes,
    block_input_bytes,
    generation_logit_bytes,
    kv_cache_bytes,
    gradients_in_flight_bytes,
    head_activation_bytes,
    lora_params_per_block,
    model_state_bytes,
    quantization_constant_bytes,
    reference_forward_bytes,
)
from tools.planner.shapes import ModelShape
from tools.planner.tables import (
    CONSTANT_BYTES,
    GIB,
    NF4_BYTES,
    PROCESS_BASELINE_GIB,
    SEQUENCES_PER_SAMPLE,
    gib,
    millions,
)

MODEL_STATE = ("parameters", "reference", "gradients", "optimizer", "quantization_constants")


def reference_copy(request: dict) -> bool:
    """A frozen second model in the compute dtype: DPO with full fine-tuning and ``--no-precompute_reference``, GRPO
    with full fine-tuning and ``--beta`` > 0."""
    if request["objective"] == "grpo":
        return request["method"] == "full" and request["beta"] > 0
    return request["objective"] == "dpo" and request["method"] == "full" and not request["precompute_reference"]


def reference_forward(request: dict) -> bool:
    """A reference forward every step: DPO with LoRA or QLoRA (the adapter disabled) or with a reference copy; GRPO
    with ``--beta`` > 0."""
    if request["objective"] == "grpo":
        return request["beta"] > 0
    return request["objective"] == "dpo" and (request["method"] != "full" or reference_copy(request))


def sequences(request: dict) -> int:
    """Sequences per forward on one device: the micro-batch, twice for DPO (chosen and rejected in one batch)."""
    return request["micro_batch"] * SEQUENCES_PER_SAMPLE[request["objective"]]


def device_estimate(label, kind, state, compute, shape, request, p, buckets=False) -> dict:
    """One GPU's estimate. ``state``: the parameters whose state this GPU holds (``params``, ``linear``,
    ``adapter``, ``constants_linear``: the 4-bit weights whose constants it keeps); ``compute``: what it runs
    (``blocks``, ``has_head``, ``in_flight`` micro-batches of activations); ``state["reference"]``: the parameters
    of DPO's reference copy it holds (0 without one). ``kind``: replica, split, fsdp, offload.
    ``buckets``: DDP's gradient buckets. ``request``: what ``fits.plan`` was asked; ``p``: ``precision_profile``."""
    method = request["method"]
    trained = state["params"] if method == "full" else state["adapter"]
    terms = _model_state_terms(kind, method, p, state)  # name -> (bytes, formula)
    terms["reference"] = _reference_term(kind, p, state.get("reference", 0))
    terms["buffers"] = _buffers(kind, buckets, shape, request, p, trained)
    activations = _activations(shape, request, p, compute)
    terms["activations"] = activations["term"]
    terms["activations_checkpointed"] = activations["term_checkpointed"]
    temporaries = _temporaries(kind, shape, request, p, compute)
    terms["temporaries"] = temporaries["term"]
    # The recipes' AdamW is fused: it updates weights and state in place, with no state-sized temporary. With fp16's
    # GradScaler they use the foreach one (shared.accelerator.fused_adamw), which allocates one more copy of the state.
    step = trained * p["adam"] / 2 if request["mixed_precision"] == "fp16" and kind != "offload" else 0
    what = "foreach AdamW's temporary (fp16)" if step else "fused AdamW: in place, no temporary"
    terms["optimizer_step"] = (step, f"{what} {millions(trained)} x {p['adam'] // 2 if step else 0} B = {gib(step)}")
    terms["kv_cache"] = _generation(shape, request, p, compute.get("generates", request["objective"] == "grpo"))
    terms["overhead"] = (request["overhead"], f"CUDA context, NCCL, fragmentation = {gib(request['overhead'])}")
    return _bill(label, kind, state, compute, p, terms, _moments(activations, temporaries, step, terms["kv_cache"][0]))


def generator_estimate(label: str, shape: ModelShape, request: dict, p: dict, state: dict) -> dict:
    """The generation split's generating GPU: the weights as loaded (``state``; LoRA: the frozen base and the
    adapter; QLoRA: with its constants), no gradients, optimizer state or activations; the KV cache."""
    terms = {name: (0, "0") for name in (*MODEL_STATE, "buffers", "activations", "activations_checkpointed")}
    terms.update({name: (0, "0") for name in ("temporaries", "optimizer_step")})
    held = model_state_bytes(request["method"], p, state["params"], state["linear"], state["adapter"])
    weights, formula = held["parameters"]
    terms["parameters"] = (weights, f"{formula} = {gib(weights)} (generates only: no gradients, no optimizer state)")
    if request["method"] == "qlora":
        constants = quantization_constant_bytes(state["constants_linear"], p)
        quantized = millions(state["constants_linear"])
        terms["quantization_constants"] = (constants, f"{quantized} 4-bit weights' constants = {gib(constants)}")
    terms["kv_cache"] = _generation(shape, request, p, True)
    terms["overhead"] = (request["overhead"], f"CUDA context, NCCL, fragmentation = {gib(request['overhead'])}")
    compute = dict(blocks=shape.num_layers, has_head=True, in_flight=0)
    phases = {"generation": terms["kv_cache"][0]}
    return _bill(label, "generator", {**state, "adapter": 0}, compute, p, terms, (phases, phases))


def _generation(shape: ModelShape, request: dict, p: dict, generates: bool) -> tuple:
    """GRPO's generation on this GPU: the KV cache of one group (``num_generations`` x ``seq_len`` tokens) and one
    step's logits."""
    if not generates:
        return 0, "0"
    rows, s = request["num_generations"], request["seq_len"]
    kv, logits = kv_cache_bytes(shape, rows, s, p), generation_logit_bytes(shape, rows)
    head_dim = shape.hidden_size // shape.num_heads
    return kv + logits, (
        f"KV cache {rows} completions x {s} tokens x {shape.num_layers} blocks x 2 x {shape.num_kv_heads} x "
        f"{head_dim} x {p['compute']} B = {gib(kv)} + the step's logits {gib(logits)} = {gib(kv + logits)}"
    )


def _model_state_terms(kind: str, method: str, p: dict, state: dict) -> dict:
    """Weights, gradients, optimizer state (in host RAM under offload) and the 4-bit weights' constants."""
    terms = {}
    held = model_state_bytes(method, p, state["params"], state["linear"], state["adapter"])
    for name, (value, formula) in held.items():
        if kind == "offload":  # the shards live in host RAM
            terms[name] = (0, f"0 on the GPU (in host RAM: {gib(value)})")
        else:
            terms[name] = (value, f"{formula} = {gib(value)}")
    if method != "qlora":
        terms["quantization_constants"] = (0, "0")
        return terms
    constants = quantization_constant_bytes(state["constants_linear"], p)
    terms["quantization_constants"] = (
        constants,
        f"{millions(state['constants_linear'])} 4-bit weights x {CONSTANT_BYTES[p['double_quant']]:.4f} B = "
        f"{gib(constants)}",
    )
    return terms


def _reference_term(kind: str, p: dict, reference: float) -> tuple:
    """DPO's frozen reference copy: weights only, in the compute dtype (host RAM under offload)."""
    value = reference * p["compute"]
    if not reference:
        return 0, "0"
    if kind == "offload":
        return 0, f"0 on the GPU (the reference copy's shard in host RAM: {gib(value)})"
    return value, f"reference copy {millions(reference)} x {p['compute']} B = {gib(value)}"


def _buffers(kind, buckets, shape: ModelShape, request: dict, p: dict, trained: float) -> tuple:
    """DDP's gradient buckets; FSDP2's gathered units (root + 2 blocks) and their unsharded gradients, and under
    offload the host-to-GPU copies of the units' shards."""
    method, c = request["method"], p["compute"]
    if buckets:
        buffers = trained * p["grad"]
        return buffers, f"DDP gradient buckets {millions(trained)} x {p['grad']} B = {gib(buffers)}"
    if kind not in ("fsdp", "offload"):
        return 0, f"0 = {gib(0)}"
    per_block_lora = 0
    if method != "full":
        per_block_lora = lora_params_per_block(shape, request["lora_r"], request["lora_targets"])
    unit_params = shape.embedding_params + shape.head_params + 2 * shape.block_params
    unit_linear, unit_adapter = 2 * shape.block_linear_params, 2 * per_block_lora
    if method == "qlora":  # the 4-bit weights are gathered as they are
        gathered = unit_linear * NF4_BYTES + (unit_params - unit_linear) * c + unit_adapter * c
    else:
        gathered = unit_params * c + unit_adapter * c
    unit_trained = unit_params if method == "full" else unit_adapter
    buffers = gathered + unit_trained * c
    formula = f"gathered root + 2 blocks {gib(gathered)} + their unsharded gradients {millions(unit_trained)} x {c} B"
    if kind == "offload":  # the units' shards copied to the GPU before the all-gather, gradients back
        gpus = request["gpus"]
        staging = model_state_bytes(method, p, unit_params, unit_linear, unit_adapter)["parameters"][0] / gpus
        staging += unit_trained * p["grad"] / gpus
        buffers += staging
        formula += f" + host-to-GPU copies of their shards {gib(staging)}"
    return buffers, f"{formula} = {gib(buffers)}"


def _activations(shape: ModelShape, request: dict, p: dict, compute: dict) -> dict:
    """Every block computed here, ``in_flight`` micro-batches of them, and the head's; without and with
    checkpointing (each block keeps its input; one block is recomputed at a time)."""
    blocks, in_flight = compute["blocks"], compute["in_flight"]
    s, b = request["seq_len"], sequences(request)
    block = block_activation_bytes(
        shape,
        s,
        b,
        attention=request["attention"],
        method=request["method"],
        profile=p,
        lora_dropout=request["lora_dropout"],
        lora_r=request["lora_r"],
        lora_targets=request["lora_targets"],
    )
    block_input = block_input_bytes(shape, s, b, p)
    head = head_activation_bytes(shape, s, b, p, request["method"]) if compute["has_head"] else 0
    found = {
        "blocks_stored": in_flight * blocks * block,
        "blocks_stored_checkpointed": in_flight * blocks * block_input,
        "heads": in_flight * head,
        "recomputed": block if blocks else 0,
    }
    stored = found["blocks_stored"] + found["heads"]
    checkpointed = found["blocks_stored_checkpointed"] + max(found["heads"], found["recomputed"])
    found["term"] = (stored, f"{in_flight} x ({blocks} blocks x {gib(block)} + head {gib(head)}) = {gib(stored)}")
    found["term_checkpointed"] = (
        checkpointed,
        f"{in_flight} x {blocks} block inputs x {gib(block_input)} + the larger of the head {gib(found['heads'])} "
        f"and one block recomputed {gib(found['recomputed'])} = {gib(checkpointed)}",
    )
    return found


def _temporaries(kind: str, shape: ModelShape, request: dict, p: dict, compute: dict) -> dict:
    """Autocast's 16-bit weight copies, the fp32 head's cast, the dequantized 4-bit weight, gradients in flight, and
    DPO's reference forward."""
    method, c, blocks = request["method"], p["compute"], compute["blocks"]
    head_weights = shape.lm_head_params if compute["has_head"] else 0
    tokens = request["seq_len"] * sequences(request)
    found = dict(copies=0, copies_one_block=0, head_copy=0, dequantized=0, working=0, reference=0)
    if method == "full" and p["weight_copies"]:  # autocast's cache keeps every cast until the forward returns
        found["copies"] = 2 * (blocks * shape.block_linear_params + head_weights)
        found["copies_one_block"] = 2 * shape.block_linear_params if blocks else 0
    if method != "full" and kind not in ("fsdp", "offload") and c < p["master"]:  # the fp32 adapter, cast
        per_block_lora = lora_params_per_block(shape, request["lora_r"], request["lora_targets"])
        found["copies"] = 2 * blocks * per_block_lora
    if method == "qlora" and p["head_copy"]:
        found["head_copy"] = head_weights * c
    if method == "qlora" and blocks:  # one weight at a time, the largest linear layer
        found["dequantized"] = max(inputs * outputs for _, inputs, outputs in shape.block_linears) * c
    if blocks:
        found["working"] = gradients_in_flight_bytes(shape, tokens, p)
    if reference_forward(request) and blocks:
        found["reference"] = reference_forward_bytes(shape, tokens, p)
        if reference_copy(request) and kind in ("fsdp", "offload"):  # the copy's units, gathered as it computes
            found["reference"] += (shape.embedding_params + shape.head_params + 2 * shape.block_params) * c
    parts = [
        (found["copies"], f"autocast's 16-bit copies of the {'fp32' if method == 'full' else 'LoRA'} weights"),
        (found["head_copy"], "the fp32 LM head cast for its matmul"),
        (found["dequantized"], "one dequantized 4-bit weight"),
        (found["working"], "gradients in flight through one block"),
        (found["reference"], "the reference forward (no_grad: its logits, one block's working set)"),
    ]
    parts = [(value, what) for value, what in parts if value]
    total = sum(value for value, _ in parts)
    formula = " + ".join(f"{what} {gib(value)}" for value, what in parts) + f" = {gib(total)}" if parts else "0"
    found["term"] = (total, formula)
    return found


def _moments(activations: dict, temporaries: dict, step: float, generation: float = 0) -> tuple[dict, dict]:
    """What exists besides the fixed state at the three moments, without and with checkpointing (and GRPO's
    generation, the step's activations gone). Autocast's cache keeps every weight copy until the forward returns, so
    checkpointing frees them only for the blocks' backward."""
    stored, checkpointed = activations["blocks_stored"], activations["blocks_stored_checkpointed"]
    heads, recomputed = activations["heads"], activations["recomputed"]
    copies, head_copy = temporaries["copies"], temporaries["head_copy"]
    working, dequantized = temporaries["working"], temporaries["dequantized"]
    phases = {
        "start_of_backward": stored + heads + copies + head_copy,
        "block_backward": stored + copies + working + dequantized,
        "optimizer_step": step,
    }
    phases_checkpointed = {
        "start_of_backward": checkpointed + heads + copies + head_copy,
        "block_backward": checkpointed + recomputed + temporaries["copies_one_block"] + working + dequantized,
        "optimizer_step": step,
    }
    if generation:  # GRPO: before the step's forward, with nothing of it stored yet
        phases["generation"] = phases_checkpointed["generation"] = generation
    if temporaries["reference"]:  # DPO: after the policy's forward, before its backward
        reference = temporaries["reference"] + dequantized
        phases["reference_forward"] = stored + heads + reference
        phases_checkpointed["reference_forward"] = checkpointed + heads + reference
    return phases, phases_checkpointed


def _bill(label, kind, state, compute, p, terms, moments) -> dict:
    """The device's result: every term in whole bytes, the peak without and with checkpointing, the formulas."""
    phases, phases_checkpointed = moments
    values = {name: int(value) for name, (value, _) in terms.items()}
    model_state = sum(values[name] for name in MODEL_STATE)
    fixed = model_state + values["buffers"] + values["overhead"]
    return {
        "device": label,
        "num_parameters": int(state["params"] + state["adapter"]),
        "blocks": compute["blocks"],
        "in_flight": compute["in_flight"],
        **values,
        "model_state": model_state,
        "adapter": {
            "parameters": int(state["adapter"]),
            "bytes": int(state["adapter"] * (p["master"] + p["grad"] + p["adam"])) if kind != "offload" else 0,
        },
        "phases": {name: int(value) for name, value in phases.items()},
        "phases_checkpointed": {name: int(value) for name, value in phases_checkpointed.items()},
        "total": int(fixed + max(phases.values())),
        "total_checkpointed": int(fixed + max(phases_checkpointed.values())),
        "arithmetic": {name: formula for name, (_, formula) in terms.items()},
    }


# ------------------------------------------------------------------------------- the host
def host_ram(
    request, p, shape, processes: int, loaders: int, offloaded_per_process: int, split=False, layer_by_layer=False
) -> dict:
    """Host RAM: per process a baseline, the loading copy (``loaders`` processes read the whole checkpoint) and the
    offloaded shard of the model state; the machine needs the sum."""
    loading, how = _loading_copy(request["method"], p, shape, split, layer_by_layer)
    if reference_copy(request):  # DPO's frozen reference, loaded in the compute dtype by the same processes
        extra = shape.num_parameters * p["compute"]
        loading += extra
        how += f" + the reference copy {millions(shape.num_parameters)} x {p['compute']} B = {gib(extra)}"
    baseline = int(PROCESS_BASELINE_GIB * GIB)
    per_process = []
    for rank in range(processes):
        copy = loading if rank < loaders else 0
        per_process.append(
            {
                "process": rank,
                "baseline": baseline,
                "loading": int(copy),
                "offloaded": int(offloaded_per_process),
                "total": int(baseline + copy + offloaded_per_process),
            }
        )
    machine = sum(process["total"] for process in per_process)
    formula = (
        f"{processes} process(es) x {PROCESS_BASELINE_GIB:g} GiB baseline + {loaders} x ({how})"
        + (f" + {processes} x offloaded state {gib(offloaded_per_process)}" if offloaded_per_process else "")
        + f" = {gib(machine)}"
    )
    return {"host_ram": int(machine), "host_ram_per_process": per_process, "host_ram_arithmetic": formula}


def _loading_copy(
    method: str, p: dict, shape: ModelShape, split: bool, layer_by_layer: bool = False
) -> tuple[float, str]:
    """The model as one loading process holds it before ``prepare``: fp32 (full), the compute dtype (LoRA). QLoRA
    loads onto the GPU, except for a split (device_map), which the recipe quantizes on the CPU before dispatching;
    under FSDP2 (``layer_by_layer``) the main process reads one 16-bit tensor at a time (the largest: an embeddings
    or LM head matrix, or a layer's largest weight) on its way to the GPU, where it is sharded."""
    if method == "qlora" and layer_by_layer:
        largest = max(shape.embedding_params, shape.lm_head_params, *(i * o for _, i, o in shape.block_linears))
        loading = largest * p["compute"]
        return loading, f"its largest tensor {millions(largest)} x {p['compute']} B = {gib(loading)}"
    if method == "qlora" and split:
        linear = shape.num_layers * shape.block_linear_params
        loading = (
            linear * (NF4_BYTES + CONSTANT_BYTES[p["double_quant"]]) + (shape.num_parameters - linear) * p["compute"]
        )
        return loading, f"the 4-bit model quantized on the CPU {gib(loading)}"
    if method == "qlora":
        return 0, "QLoRA loads onto the GPU (the checkpoint is memory-mapped)"
    dtype = 4 if method == "full" else p["frozen"]
    loading = shape.num_parameters * dtype
    return loading, f"the loading copy {millions(shape.num_parameters)} x {dtype} B = {gib(loading)}"
