"""The six setups, each as the devices it uses and what each holds and runs, and whether it fits.

``single`` (one GPU), ``ddp`` (a full replica per GPU), ``fsdp`` (FSDP2 full shard: the model state divided by N),
``fsdp_offload`` (FSDP2 with CPU offload: parameters, gradients and optimizer state in host RAM, only the units being
computed on the GPU), ``pipeline`` (one contiguous group of blocks per GPU, m micro-batches in flight; full
fine-tuning only, ``recipes/pipeline_lm.py``) and ``device_map`` (the same split inside one process, one micro-batch
at a time).

Pipeline and device_map split the blocks as the recipes do (``recipes/pipeline_lm.py``): whole blocks, balanced by
compute, the embeddings on the first device and the LM head (+ loss) on the last. DPO (``recipes/dpo.py``) trains
under single, ddp, fsdp and fsdp_offload only: no split is estimated for it. GRPO (``recipes/grpo.py``) trains
under those four colocated (each GPU generates its share, then trains) and ``generation_split`` (one GPU only
generates, the others only train).
"""

from __future__ import annotations

from shared.presets import MODEL_PRESETS
from shared.model_split import LOSS_COST_PER_VOCAB_ENTRY, balanced_partition
from tools.planner.devices import device_estimate, generator_estimate, host_ram, reference_copy
from tools.planner.memory import (
    lora_params_per_block,
    model_state_bytes,
    precision_profile,
    quantization_constant_bytes,
)
from tools.planner.shapes import ModelShape
from tools.planner.tables import DPO_SETUPS, GRPO_SETUPS, NF4_BYTES, gib


def estimate(shape: ModelShape, request: dict, only: str | None = None) -> dict:
    """Every setup's devices, host RAM and fit for what ``fits.plan`` was asked (``only``: that setup alone)."""
    setups = _estimate_setups(shape, request, only)
    for name, setup in setups.items():
        _summarize(name, setup, shape, request)
    return setups


def _estimate_setups(shape: ModelShape, request: dict, only: str | None) -> dict:
    gpus, method = request["gpus"], request["method"]
    p_replica = precision_profile(method, request["mixed_precision"], False, request["profile"])
    p_sharded = precision_profile(method, request["mixed_precision"], True, request["profile"])
    per_block_lora = 0
    if method != "full":
        per_block_lora = lora_params_per_block(shape, request["lora_r"], request["lora_targets"])
    total_linear = shape.num_layers * shape.block_linear_params
    everything = dict(
        params=shape.num_parameters,
        linear=total_linear,
        adapter=shape.num_layers * per_block_lora,
        constants_linear=total_linear,
        reference=shape.num_parameters if reference_copy(request) else 0,  # DPO's frozen copy, full fine-tuning
    )
    setups = {}
    if only in (None, "single"):
        setups["single"] = _replicas(shape, request, p_replica, everything, 1, buckets=False)
    if gpus < 2 or only == "single":
        return setups
    if only in (None, "ddp"):  # a full replica per GPU, plus gradient buckets (a second copy of the gradients)
        setups["ddp"] = _replicas(shape, request, p_replica, everything, gpus, buckets=True)
    for name in ("fsdp", "fsdp_offload"):
        if only in (None, name):
            setups[name] = _sharded(name, shape, request, p_sharded, everything)
    if request["objective"] == "grpo" and only in (None, "generation_split"):
        setups["generation_split"] = _generation_split(shape, request, p_replica, everything)
    if request["objective"] in ("dpo", "grpo"):
        return setups  # recipes/dpo.py and grpo.py have no block split
    if shape.num_layers < gpus or only not in (None, "pipeline", "device_map"):
        return setups  # fewer blocks than GPUs: no split gives every GPU a block
    counts = split_blocks(shape, gpus, request["seq_len"])
    for name in ("pipeline", "device_map"):
        if only in (None, name):
            setups[name] = _split(name, counts, shape, request, p_replica, per_block_lora)
    return setups


def _replicas(shape, request, p, everything, processes: int, buckets: bool) -> dict:
    """The whole model on each of ``processes`` GPUs (single, DDP): every GPU's bill is the first one's."""
    whole = dict(blocks=shape.num_layers, has_head=True, in_flight=1)
    device = device_estimate("gpu0", "replica", everything, whole, shape, request, p, buckets)
    devices = [device] + [{**device, "device": f"gpu{rank}"} for rank in range(1, processes)]
    return {"devices": devices, "identical": True, **host_ram(request, p, shape, processes, processes, 0)}


def _generation_split(shape, request, p, everything) -> dict:
    """recipes/grpo.py --generation_mode split: GPUs 0 .. N-2 train a full replica each (DDP buckets from two
    trainers on), no KV cache; the last GPU generates: its weights as loaded and the KV cache (no reference copy:
    the generating process never scores)."""
    trainers = request["gpus"] - 1
    whole = dict(blocks=shape.num_layers, has_head=True, in_flight=1, generates=False)
    trainer = device_estimate("gpu0", "replica", everything, whole, shape, request, p, buckets=trainers > 1)
    devices = [trainer] + [{**trainer, "device": f"gpu{rank}"} for rank in range(1, trainers)]
    devices.append(generator_estimate(f"gpu{trainers}", shape, request, p, {**everything, "reference": 0}))
    gpus = request["gpus"]
    return {"devices": devices, "identical": False, **host_ram(request, p, shape, gpus, gpus, 0)}


def _sharded(name, shape, request, p, everything) -> dict:
    """FSDP2 full shard: 1/N of every parameter, gradient and optimizer state (not of the 4-bit weights' constants:
    every GPU keeps all of them); under offload that 1/N lives in host RAM."""
    gpus = request["gpus"]
    kind = "fsdp" if name == "fsdp" else "offload"
    shard = {key: value / gpus for key, value in everything.items()}
    shard["constants_linear"] = everything["constants_linear"]
    whole = dict(blocks=shape.num_layers, has_head=True, in_flight=1)
    device = device_estimate("gpu0", kind, shard, whole, shape, request, p)
    devices = [device] + [{**device, "device": f"gpu{rank}"} for rank in range(1, gpus)]
    offloaded = 0
    if kind == "offload":
        state = model_state_bytes(request["method"], p, shard["params"], shard["linear"], shard["adapter"])
        offloaded = int(sum(value for value, _ in state.values()) + shard["reference"] * p["compute"])
    # fsdp_2gpu.yaml: every process reads the checkpoint; fsdp_offload_2gpu.yaml: only the main process does.
    # QLoRA: only the main process reads, one tensor at a time (recipes/llm_kit/sharded_4bit.py).
    qlora = request["method"] == "qlora"
    loaders = 1 if qlora or kind == "offload" else gpus
    return {
        "devices": devices,
        "identical": True,
        **host_ram(request, p, shape, gpus, loaders, offloaded, layer_by_layer=qlora),
    }


def _split(name, counts, shape, request, p, per_block_lora) -> dict:
    """Whole blocks per GPU (``counts``), the embeddings on the first, the LM head on the last. A pipeline keeps
    several micro-batches in flight (GPipe: all m; 1F1B: stage i holds p - i); device_map one."""
    gpus, devices = request["gpus"], []
    for part, blocks in enumerate(counts):
        first, last = part == 0, part == gpus - 1
        params = (
            blocks * shape.block_params + (shape.embedding_params if first else 0) + (shape.head_params if last else 0)
        )
        linear = blocks * shape.block_linear_params
        held = dict(params=params, linear=linear, adapter=blocks * per_block_lora, constants_linear=linear)
        held["reference"] = 0  # DPO has no split
        if name == "device_map":
            in_flight = 1
        elif request["pipeline_schedule"] == "gpipe":
            in_flight = request["num_microbatches"]  # all forwards before any backward
        else:
            in_flight = min(request["num_microbatches"], gpus - part)
        label = f"stage{part}" if name == "pipeline" else f"gpu{part}"
        runs = dict(blocks=blocks, has_head=last, in_flight=in_flight)
        devices.append(device_estimate(label, "split", held, runs, shape, request, p))
    processes = gpus if name == "pipeline" else 1  # pipeline_lm.py: one process per stage, each builds the model
    return {
        "devices": devices,
        "identical": False,
        "blocks_per_device": counts,
        **host_ram(request, p, shape, processes, processes, 0, split=name == "device_map"),
    }


# ------------------------------------------------------------------------------- the split
def head_cost_in_blocks(shape: ModelShape, seq_len: int) -> float:
    """The LM head and loss's compute in blocks, as ``shared.model_split.lm_head_cost_in_blocks`` counts it."""
    if not shape.has_lm_head:
        return 0.0
    block = shape.block_matmul_flops + 4 * seq_len * shape.hidden_size
    return (shape.head_matmul_flops + LOSS_COST_PER_VOCAB_ENTRY * shape.vocab_size) / block


def split_blocks(shape: ModelShape, num_parts: int, seq_len: int) -> list[int]:
    """Blocks per device of the recipe's split: whole blocks, balanced by compute, the LM head's cost
    on the last part (``shared.model_split.plan_device_map`` with ``last_cost``)."""
    costs = [1.0] * shape.num_layers
    costs[-1] += head_cost_in_blocks(shape, seq_len)
    parts = balanced_partition(costs, num_parts)
    return [parts.count(part) for part in range(num_parts)]


# ------------------------------------------------------------------------------- does it fit
def _summarize(name: str, setup: dict, shape: ModelShape, request: dict) -> None:
    """The setup's peaks, whether it fits the GPUs and the host (with and without checkpointing), and its recipe."""
    budget, host_budget = request["budget"], request["host_budget"]
    setup["peak_without_checkpointing"] = max(device["total"] for device in setup["devices"])
    setup["peak_checkpointed"] = max(device["total_checkpointed"] for device in setup["devices"])
    setup["gradient_checkpointing"] = bool(request["gradient_checkpointing"])
    setup["peak"] = setup["peak_checkpointed" if request["gradient_checkpointing"] else "peak_without_checkpointing"]
    setup["gpu_load_peak"], setup["gpu_load_arithmetic"] = gpu_load_peak(shape, request, name)
    loads = setup["gpu_load_peak"] is None or setup["gpu_load_peak"] <= budget
    setup["fits_host"] = setup["host_ram"] <= host_budget
    setup["fits_gpu"] = setup["peak"] <= budget and loads
    setup["fits"] = setup["fits_gpu"] and setup["fits_host"]
    loads_and_hosts = loads and setup["fits_host"]
    setup["fits_with_checkpointing"] = setup["peak_checkpointed"] <= budget and loads_and_hosts
    setup["fits_without_checkpointing"] = setup["peak_without_checkpointing"] <= budget and loads_and_hosts
    setup["over_by"] = max(0, setup["peak"] - budget)
    setup["host_over_by"] = max(0, setup["host_ram"] - host_budget)
    setup["recipe"] = recipe_for(shape, request["method"], name, request["objective"], request.get("beta", 0))


def gpu_load_peak(shape: ModelShape, request: dict, name: str) -> tuple[int | None, str | None]:
    """QLoRA under FSDP2: recipes/llm_finetune.py builds the 4-bit model empty and loads it one unit at a time
    (recipes/llm_kit/sharded_4bit.py), sharding each before the next: every decoder layer is read in 16 bits onto the
    GPU and
    quantized there, then FSDP2 keeps this GPU's 1/N; the embeddings and the final norm + LM head are sharded first
    and each process copies its rows of every matrix out of the one 16-bit read. The GPU's peak while loading: its
    shard of everything (4-bit layers, adapter, the parts not in 4 bits in fp32; none under offload: they go to host
    RAM), all the quantization constants (bitsandbytes keeps them beside each weight, outside the parameters FSDP2
    shards: every process holds all of them), one unit in flight (a layer in 16 and in 4 bits, or the largest
    matrix of the embeddings or head in 16 bits) and the overhead."""
    if request["method"] != "qlora" or name not in ("fsdp", "fsdp_offload"):
        return None, None
    p = precision_profile("qlora", request["mixed_precision"], False, request["profile"])
    gpus, layer = request["gpus"], shape.block_linear_params
    linear = shape.num_layers * layer
    adapter = shape.num_layers * lora_params_per_block(shape, request["lora_r"], request["lora_targets"])
    rest = shape.num_parameters - linear  # embeddings, norms, LM head: fp32
    held = linear * NF4_BYTES + adapter * p["master"] + rest * p["nonquant"]
    shards = 0 if name == "fsdp_offload" else held / gpus
    matrix = max(shape.embedding_params, shape.lm_head_params)
    in_flight = max(layer * (p["compute"] + NF4_BYTES), matrix * p["compute"])
    constants = quantization_constant_bytes(linear, p)
    peak = int(shards + constants + in_flight + request["overhead"])
    where = f"4-bit layers, adapter, the rest in fp32, / {gpus}" + (", offloaded: none" if not shards else "")
    return peak, (
        f"shards {gib(shards)} ({where}) + constants {gib(constants)} (all of them, on every GPU) + in "
        f"flight {gib(in_flight)} (the larger of one layer in 16 + 4 bits and one embeddings or head "
        f"matrix in 16 bits) + overhead {gib(request['overhead'])} = {gib(peak)}"
    )


def recipe_for(shape: ModelShape, method: str, name: str, objective: str = "sft", beta: float = 0) -> str | None:
    """The recipe that trains this setup, or None (pipelines are full fine-tuning of the presets only; DPO has no
    split; GRPO's full fine-tune with ``beta`` refuses FSDP2, which would not shard its frozen copy)."""
    if objective == "dpo":
        return "recipes/dpo.py" if name in DPO_SETUPS else None
    if objective == "grpo":
        refused = method == "full" and beta > 0 and name in ("fsdp", "fsdp_offload")
        return "recipes/grpo.py" if name in GRPO_SETUPS and not refused else None
    if name == "pipeline":
        return "recipes/pipeline_lm.py" if method == "full" and shape.name in MODEL_PRESETS else None
    if method == "full" and shape.name in MODEL_PRESETS:
        return "recipes/train_lm.py"
    return "recipes/llm_finetune.py"
