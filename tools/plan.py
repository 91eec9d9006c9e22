"""The fit planner: will a model train on N GPUs of M GiB, under which setup, and which one to use.

    python tools/plan.py --model_size 1.3b --gpus 2 --gpu_memory_gib 24 --seq_len 1024 --micro_batch 4
    python tools/plan.py --model_name_or_path path/to/model --gpus 2 --gpu_memory_gib 24 --json

It estimates, per device, the memory of five setups: ``single`` (one GPU), ``ddp`` (a full replica
per GPU), ``fsdp`` (full shard: everything divided by N), ``pipeline`` (one contiguous group of
blocks per GPU, m micro-batches in flight) and ``device_map`` (the same split inside one process,
one micro-batch at a time). Nothing is loaded: a preset's shape is arithmetic, a
``--model_name_or_path`` is read from its ``config.json`` and built on the meta device (no weights).

The memory model, per device, in bytes (s = sequence length, b = micro-batch, h = hidden size,
f = MLP width, a = heads, V = vocabulary, P = parameters the device holds):

- Model state, the ZeRO accounting (Rajbhandari et al. 2020, "ZeRO", section 3.1): mixed-precision
  AdamW holds 2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master weights, Adam's m and v)
  = 16 bytes per parameter; fp32 AdamW 4 + 4 + 8. (Accelerate's autocast keeps fp32 weights and
  gradients instead, 4 + 4 + 8: the same 16 bytes.) DDP divides none of it; FSDP divides all of it.
- Activations per decoder block, after Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models" (arXiv:2205.05198, section 4.1), whose GPT block stores
  s*b*h*(34 + 5*a*s/h) bytes in 16-bit. Here, for the blocks our recipes train, with PyTorch's SDPA
  (flash / memory-efficient attention: the a*s*s score matrix is never stored, so the 5*a*s/h term
  drops), no dropout (its masks are the paper's 2 of the 34), a SwiGLU MLP of width f (gate, up,
  SiLU(gate) and their product: 8*f/h; a GeLU MLP stores 4*f/h) and grouped K/V heads:
      s*b*h * (4 norms + 2 QKV input + 2 Q + 4*kv/a K,V + 2 attention output + 2 MLP input + 8*f/h)
  = s*b*h * (16 + 8*f/h) for Llama-style blocks (GPT-3's f = 4h GeLU block: 32, the paper's 34 less
  the dropout masks). ``--attention eager`` adds the paper's 5*a*s*s*b. fp32 doubles every term.
  With activation checkpointing each block keeps only its input, 2*s*b*h, and one block's full
  activations exist again while it is recomputed (the paper's "full recomputation").
- The LM head: its and the final norm's inputs (4*s*b*h) and the logits: 16-bit logits plus the fp32
  upcast and log-softmax of the loss, 2 + 4 + 4 = 10 bytes per token and vocabulary entry (fp32:
  4 + 4 = 8). Checkpointing does not touch it; often the largest single tensor of a step.
- Buffers: DDP's gradient buckets, a second copy of the gradients (``gradient_as_bucket_view=False``,
  the default). FSDP's unsharded units: the root (embeddings, final norm, LM head, kept gathered) and
  two blocks (the one computing, the one prefetched), weights and gradients in the compute dtype.
- Overhead: ``--overhead_gib`` per device, default 1.0: the CUDA context (0.3-0.5 GiB with lazy
  module loading, not counted by ``torch.cuda.max_memory_allocated``), NCCL buffers, and allocator
  fragmentation. Activations are the least exact term: keep a few GiB of headroom.

The recommendation, in a fixed order of preference (the first that fits wins; a setup that fits
without activation checkpointing beats every setup that needs it, since recomputation costs about
one extra forward pass, ~33 % more compute): ``ddp`` (every GPU computes, only gradients travel,
overlapped with backward) > ``fsdp`` (every GPU computes; parameters are all-gathered in forward and
backward, ~1.5x DDP's traffic) > ``pipeline`` (every GPU computes except for the bubble,
(p-1)/(m+p-1) of the time) > ``single`` (one GPU computes) > ``device_map`` (fits larger models,
but one GPU computes at a time: no faster than one GPU).

Pipeline and device_map split the blocks as the recipe does (``recipes/pipeline_lm.py``): whole
blocks, balanced by compute, the embeddings on the first device and the LM head (+ loss) on the last.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Tools import the helper module; they are run from anywhere, so the repository root goes first on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.model_presets import MODEL_PRESETS  # noqa: E402
from shared.model_split import LOSS_COST_PER_VOCAB_ENTRY, balanced_partition  # noqa: E402
from shared.runtime import positive_float, positive_int  # noqa: E402


GIB = 1024**3
# Llama-2-7B's shape (meta-llama/Llama-2-7b-hf config.json; vocabulary 32000, untied LM head: 6,738,415,616
# parameters). Only the planner offers it: the recipes would not train it on CPU.
LLAMA_2_7B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    intermediate_size=11008,
    max_position_embeddings=4096,
)
MODEL_SIZES = {**MODEL_PRESETS, "7b": LLAMA_2_7B}
DEFAULT_VOCAB_SIZE = 32000  # Llama-2's; the recipe trains its own tokenizer, --vocab_size 8192 by default
SETUPS = ("single", "ddp", "fsdp", "pipeline", "device_map")
PREFERENCE = ("ddp", "fsdp", "pipeline", "single", "device_map")
# Bytes per parameter: (weights, gradients, optimizer state), AdamW. fp16 and bf16 cost the same.
STATE_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "no": (4, 4, 8)}
# Bytes per activation element, and per logit (16-bit logits + fp32 upcast + fp32 log-softmax).
ACTIVATION_BYTES = {"bf16": 2, "fp16": 2, "no": 4}
LOSS_BYTES_PER_LOGIT = {"bf16": 10, "fp16": 10, "no": 8}
DEFAULT_OVERHEAD_GIB = 1.0
# The accelerate config for each setup on two GPUs (accelerate_configs/).
CONFIGS = {
    "single": "single_gpu.yaml",
    "ddp": "ddp_2gpu.yaml",
    "fsdp": "fsdp_2gpu.yaml",
    "pipeline": "pipeline_2gpu.yaml",
    "device_map": "model_sharding_2gpu.yaml",
}


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model: sizes and parameter counts, no weights."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool  # SwiGLU-style (gate and up projections) rather than one GeLU projection
    embedding_params: int  # everything before the blocks
    block_params: int  # one block
    head_params: int  # everything after the blocks (final norm, LM head unless tied, pooler)
    block_matmul_flops: int  # forward matmul FLOPs per token of one block (for the compute-balanced split)
    head_matmul_flops: int  # forward matmul FLOPs per token of the LM head (0 without one)
    has_lm_head: bool

    @property
    def num_parameters(self) -> int:
        return self.embedding_params + self.num_layers * self.block_params + self.head_params


def preset_shape(model_size: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> ModelShape:
    """The shape of a named size (``shared/model_presets.py``, plus ``7b``) as the recipe builds it:
    a ``LlamaConfig`` with untied LM head and as many K/V heads as heads. Counted by arithmetic; the
    tests check it against ``numel()`` of the real model built on the meta device."""
    if model_size not in MODEL_SIZES:
        raise ValueError(f"unknown --model_size {model_size!r}; choose from {', '.join(MODEL_SIZES)}")
    preset = MODEL_SIZES[model_size]
    h, f, heads = preset["hidden_size"], preset["intermediate_size"], preset["num_attention_heads"]
    kv_heads = heads
    attention = 2 * h * h + 2 * h * kv_heads * (h // heads)  # q, o; k, v
    mlp = 3 * h * f  # gate, up, down
    return ModelShape(
        name=model_size,
        hidden_size=h,
        num_layers=preset["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=f,
        vocab_size=vocab_size,
        gated_mlp=True,
        embedding_params=vocab_size * h,
        block_params=attention + mlp + 2 * h,  # + two RMSNorm weights
        head_params=h + vocab_size * h,  # final norm + untied LM head
        block_matmul_flops=2 * (attention + mlp),
        head_matmul_flops=2 * vocab_size * h,
        has_lm_head=True,
    )


def shape_from_config(config, name: str | None = None) -> ModelShape:
    """The shape of any transformers model from its config, counted exactly on the meta device.

    A causal LM when the config says so (``architectures``, or the model type when there are
    none), otherwise the base model (e.g. a BERT encoder: no LM head, no logits).
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as transformers_logging

    from shared.model_split import (
        _matmul_flops_per_token,
        find_block_list,
    )  # the recipe's own count, so the split matches

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        causal = any(arch.endswith(("ForCausalLM", "LMHeadModel")) for arch in architectures)
    else:
        causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with init_empty_weights():  # parameters on the meta device: shapes only, no memory
            model = (AutoModelForCausalLM if causal else AutoModel).from_config(config)
    finally:
        transformers_logging.set_verbosity(verbosity)
    block_list = find_block_list(model, set(getattr(model, "_no_split_modules", None) or []))
    blocks = model.get_submodule(block_list)
    before = after = 0
    blocks_seen = False
    for parameter_name, parameter in model.named_parameters():  # tied weights are listed once
        if parameter_name.startswith(block_list + "."):
            blocks_seen = True
        elif blocks_seen:
            after += parameter.numel()
        else:
            before += parameter.numel()
    h = config.hidden_size
    f = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    heads = config.num_attention_heads
    projections_to_f = sum(
        1 for module in blocks[0].modules() if isinstance(module, torch.nn.Linear) and module.out_features == f
    )
    head = model.get_output_embeddings() if causal else None
    return ModelShape(
        name=name or getattr(config, "name_or_path", "") or config.model_type,
        hidden_size=h,
        num_layers=len(blocks),
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate_size=f,
        vocab_size=config.vocab_size,
        gated_mlp=projections_to_f >= 2,
        embedding_params=before,
        block_params=sum(p.numel() for p in blocks[0].parameters()),
        head_params=after,
        block_matmul_flops=int(_matmul_flops_per_token(blocks[0])),
        head_matmul_flops=2 * head.weight.numel() if head is not None else 0,
        has_lm_head=head is not None,
    )


def block_activation_bytes(
    shape: ModelShape, seq_len: int, micro_batch: int, mixed_precision: str = "bf16", attention: str = "sdpa"
) -> int:
    """Activations one decoder block keeps for backward (formula in the module docstring)."""
    h, f = shape.hidden_size, shape.intermediate_size
    coefficient = 4 + 2 + 2 + 4 * shape.num_kv_heads / shape.num_heads + 2 + 2 + (8 if shape.gated_mlp else 4) * f / h
    sixteen_bit = seq_len * micro_batch * h * coefficient
    if attention == "eager":  # the score matrix: softmax output, dropout mask and output (Korthikanti)
        sixteen_bit += 5 * shape.num_heads * seq_len * seq_len * micro_batch
    return int(sixteen_bit * ACTIVATION_BYTES[mixed_precision] / 2)


def head_activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, mixed_precision: str = "bf16") -> int:
    """What the final norm, the LM head and the loss keep: their inputs and the logits."""
    tokens = seq_len * micro_batch
    inputs = 2 * tokens * shape.hidden_size * ACTIVATION_BYTES[mixed_precision]  # final norm + head inputs
    return inputs + (LOSS_BYTES_PER_LOGIT[mixed_precision] * tokens * shape.vocab_size if shape.has_lm_head else 0)


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


def _device(
    label,
    params,
    blocks,
    has_head,
    in_flight,
    buffers,
    shape,
    seq_len,
    micro_batch,
    mixed_precision,
    attention,
    overhead,
):
    """One device's estimate; ``in_flight`` micro-batches of activations at once."""
    weight_bytes, grad_bytes, optimizer_bytes = STATE_BYTES[mixed_precision]
    block = block_activation_bytes(shape, seq_len, micro_batch, mixed_precision, attention)
    block_input = seq_len * micro_batch * shape.hidden_size * ACTIVATION_BYTES[mixed_precision]
    head = head_activation_bytes(shape, seq_len, micro_batch, mixed_precision) if has_head else 0
    activations = in_flight * (blocks * block + head)
    # Checkpointed: every block keeps its input, and one block at a time is recomputed in full.
    checkpointed = in_flight * (blocks * block_input + head) + (block if blocks else 0)
    state = {
        "parameters": int(params * weight_bytes),
        "gradients": int(params * grad_bytes),
        "optimizer": int(params * optimizer_bytes),
    }
    fixed = sum(state.values()) + buffers + overhead
    return {
        "device": label,
        "num_parameters": int(params),
        "blocks": blocks,
        "in_flight": in_flight,
        **state,
        "model_state": sum(state.values()),
        "buffers": int(buffers),
        "activations": activations,
        "activations_checkpointed": checkpointed,
        "overhead": overhead,
        "total": fixed + activations,
        "total_checkpointed": fixed + checkpointed,
    }


def _estimate_setups(
    shape, gpus, seq_len, micro_batch, mixed_precision, num_microbatches, pipeline_schedule, attention, overhead
):
    common = dict(
        shape=shape,
        seq_len=seq_len,
        micro_batch=micro_batch,
        mixed_precision=mixed_precision,
        attention=attention,
        overhead=overhead,
    )
    total_params = shape.num_parameters
    setups = {
        "single": {
            "devices": [_device("gpu0", total_params, shape.num_layers, True, 1, 0, **common)],
            "identical": True,
        }
    }
    if gpus < 2:
        return setups
    grad_bytes = STATE_BYTES[mixed_precision][1]
    # DDP: a full replica per GPU, plus gradient buckets (a second copy of the gradients).
    setups["ddp"] = {
        "devices": [
            _device(f"gpu{rank}", total_params, shape.num_layers, True, 1, total_params * grad_bytes, **common)
            for rank in range(gpus)
        ],
        "identical": True,
    }
    # FSDP full shard: 1/N of every tensor; unsharded: the root unit and two blocks (weights + gradients).
    compute_bytes = STATE_BYTES[mixed_precision][0] + grad_bytes
    gathered = (shape.embedding_params + shape.head_params + 2 * shape.block_params) * compute_bytes
    setups["fsdp"] = {
        "devices": [
            _device(f"gpu{rank}", total_params / gpus, shape.num_layers, True, 1, gathered, **common)
            for rank in range(gpus)
        ],
        "identical": True,
    }
    if shape.num_layers < gpus:
        return setups  # fewer blocks than GPUs: no split gives every GPU a block
    counts = split_blocks(shape, gpus, seq_len)
    for name in ("pipeline", "device_map"):
        devices = []
        for part, blocks in enumerate(counts):
            first, last = part == 0, part == gpus - 1
            params = (
                blocks * shape.block_params
                + (shape.embedding_params if first else 0)
                + (shape.head_params if last else 0)
            )
            if name == "device_map":
                in_flight = 1
            elif pipeline_schedule == "gpipe":
                in_flight = num_microbatches  # all forwards before any backward
            else:
                in_flight = min(num_microbatches, gpus - part)  # 1F1B: stage i holds p - i micro-batches
            label = f"stage{part}" if name == "pipeline" else f"gpu{part}"
            devices.append(_device(label, params, blocks, last, in_flight, 0, **common))
        setups[name] = {"devices": devices, "identical": False, "blocks_per_device": counts}
    return setups


def _summarize(setups: dict, budget: int) -> None:
    for setup in setups.values():
        setup["peak"] = max(device["total"] for device in setup["devices"])
        setup["peak_checkpointed"] = max(device["total_checkpointed"] for device in setup["devices"])
        setup["fits"] = setup["peak"] <= budget
        setup["fits_with_checkpointing"] = setup["peak_checkpointed"] <= budget


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
) -> dict:
    """Per-device memory of every setup on ``gpus`` GPUs of ``gpu_memory_gib``, and the recommendation.

    ``micro_batch``: sequences per forward pass on one device (pipeline: per micro-batch, with
    ``num_microbatches`` of them per batch). ``mixed_precision``: ``bf16``/``fp16`` (mixed-precision
    AdamW, 16 bytes per parameter) or ``no`` (fp32 AdamW). Returns a JSON-ready dict; every memory
    number is in bytes, per device. Raises ValueError on impossible inputs.
    """
    for flag, value in (
        ("gpus", gpus),
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("num_microbatches", num_microbatches),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{flag} must be a whole number >= 1, got {value}")
    if not gpu_memory_gib > 0:
        raise ValueError(f"--gpu_memory_gib must be > 0, got {gpu_memory_gib}")
    if not overhead_gib >= 0:
        raise ValueError(f"--overhead_gib must be >= 0, got {overhead_gib}")
    if mixed_precision not in STATE_BYTES:
        raise ValueError(f"--mixed_precision must be one of {', '.join(STATE_BYTES)}, got {mixed_precision!r}")
    if pipeline_schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"--pipeline_schedule must be 1f1b or gpipe, got {pipeline_schedule!r}")
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"--attention must be sdpa or eager, got {attention!r}")
    budget = int(gpu_memory_gib * GIB)
    arguments = dict(
        seq_len=seq_len,
        micro_batch=micro_batch,
        mixed_precision=mixed_precision,
        num_microbatches=num_microbatches,
        pipeline_schedule=pipeline_schedule,
        attention=attention,
        overhead=int(overhead_gib * GIB),
    )
    setups = _estimate_setups(shape, gpus, **arguments)
    _summarize(setups, budget)
    result = {
        "model": {**asdict(shape), "num_parameters": shape.num_parameters},
        "inputs": {
            "gpus": gpus,
            "gpu_memory_gib": gpu_memory_gib,
            "seq_len": seq_len,
            "micro_batch": micro_batch,
            "mixed_precision": mixed_precision,
            "num_microbatches": num_microbatches,
            "pipeline_schedule": pipeline_schedule,
            "attention": attention,
            "overhead_gib": overhead_gib,
            "bytes_per_parameter": sum(STATE_BYTES[mixed_precision]),
        },
        "setups": setups,
    }
    result["recommendation"] = _recommend(shape, gpus, budget, setups, arguments)
    return result


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _recommend(shape, gpus, budget, setups, arguments) -> dict:
    chosen = None
    for checkpointing in (False, True):
        for name in PREFERENCE:
            if name in setups and setups[name]["fits_with_checkpointing" if checkpointing else "fits"]:
                chosen = (name, checkpointing)
                break
        if chosen:
            break
    memory = _gib(budget)
    if chosen is None:
        return {
            "setup": None,
            "gradient_checkpointing": None,
            "reason": _nothing_fits(shape, gpus, budget, setups, arguments),
        }
    name, checkpointing = chosen
    key = "peak_checkpointed" if checkpointing else "peak"
    peak = _gib(setups[name][key])
    if name == "ddp":
        reason = (
            f"DDP fits ({peak} of {memory} per GPU): each GPU holds a full replica and computes its share of every "
            "batch; only gradients travel, overlapped with the backward pass. The fastest setup when it fits."
        )
    elif name == "fsdp":
        reason = (
            f"DDP needs {_gib(setups['ddp'][key])} per GPU, more than {memory}: data parallelism divides the batch, "
            f"not the model, so every GPU would hold all of the model state. FSDP (full shard) divides parameters, "
            f"gradients and optimizer state by {gpus} ({peak} per GPU) and every GPU still computes; the price is "
            "all-gathering the parameters in forward and backward (about 1.5x DDP's traffic)."
        )
    elif name == "pipeline":
        m, p = arguments["num_microbatches"], gpus
        reason = (
            f"Neither DDP ({_gib(setups['ddp'][key])}) nor FSDP ({_gib(setups['fsdp'][key])} per GPU) fits {memory}. "
            f"The pipeline gives each GPU a contiguous group of blocks ({setups[name]['blocks_per_device']}; largest "
            f"stage {peak}) and keeps every GPU busy except for the bubble, (p-1)/(m+p-1) = "
            f"{(p - 1) / (m + p - 1):.0%} with m = {m} micro-batches."
        )
    elif name == "single":
        reason = (
            f"One GPU: the model fits ({peak} of {memory})."
            if gpus == 1
            else f"The model fits one GPU ({peak}) but no setup that uses all {gpus} does."
        )
    else:
        reason = (
            f"Only the naive device_map split fits ({peak} on its fullest GPU): it lets the model fit, but one GPU "
            "computes at a time, so it is no faster than one GPU."
        )
    if checkpointing:
        device = max(setups[name]["devices"], key=lambda d: d["total"])
        reason += (
            f" Needs --gradient_checkpointing: the activations ({_gib(device['activations'])}) are what does not fit "
            f"({_gib(setups[name]['peak'])} without it); checkpointed they take "
            f"{_gib(device['activations_checkpointed'])}, for about one extra forward pass (~33 % more compute)."
        )
    config = CONFIGS[name] if gpus == 2 or name == "single" else None
    return {
        "setup": name,
        "gradient_checkpointing": checkpointing,
        "reason": reason,
        "peak_bytes": setups[name][key],
        "config": config,
        "launch": _launch_line(shape, name, checkpointing, config, arguments),
    }


def _launch_line(shape, name, checkpointing, config, arguments) -> str | None:
    """The recipe command for a named preset the recipe trains (recipes/pipeline_lm.py), else None."""
    if config is None or shape.name not in MODEL_PRESETS:
        return None
    batch = arguments["micro_batch"] * (arguments["num_microbatches"] if name == "pipeline" else 1)
    flags = [
        f"--model_size {shape.name}",
        f"--vocab_size {shape.vocab_size}",
        f"--block_size {arguments['seq_len']}",
        f"--per_device_train_batch_size {batch}",
    ]
    if name == "pipeline":
        flags.append(
            f"--parallelism pipeline --pipeline_schedule {arguments['pipeline_schedule']} "
            f"--num_microbatches {arguments['num_microbatches']}"
        )
    if arguments["mixed_precision"] != "no":
        flags.append(f"--mixed_precision {arguments['mixed_precision']}")
    if checkpointing:
        flags.append("--gradient_checkpointing")
    return f"accelerate launch --config_file accelerate_configs/{config} recipes/pipeline_lm.py " + " ".join(flags)


def _nothing_fits(shape, gpus, budget, setups, arguments) -> str:
    best = min(setups, key=lambda name: setups[name]["peak_checkpointed"])
    state = max(device["model_state"] for device in setups[best]["devices"])
    reason = (
        f"Nothing fits {gpus} x {_gib(budget)}, even with --gradient_checkpointing: the smallest need is {best}'s "
        f"{_gib(setups[best]['peak_checkpointed'])} per GPU, of which model state {_gib(state)}."
    )
    if arguments["micro_batch"] > 1:
        smaller = _estimate_setups(shape, gpus, **{**arguments, "micro_batch": 1})
        _summarize(smaller, budget)
        for name in PREFERENCE:
            if name in smaller and smaller[name]["fits_with_checkpointing"]:
                return (
                    reason + f" With --micro_batch 1 and --gradient_checkpointing, {name} fits "
                    f"({_gib(smaller[name]['peak_checkpointed'])})."
                )
    for more in range(gpus + 1, 1025):
        wider = _estimate_setups(shape, more, **arguments)
        _summarize(wider, budget)
        if wider["fsdp"]["fits_with_checkpointing"]:
            return reason + (
                f" FSDP would fit on {more} such GPUs ({_gib(wider['fsdp']['peak_checkpointed'])} each, with "
                "--gradient_checkpointing); or shrink the optimizer state (8-bit Adam, LoRA) or offload it to CPU."
            )
    return (
        reason
        + " No number of such GPUs is enough under FSDP: the activations alone do not fit; use a shorter sequence."
    )


# ------------------------------------------------------------------------------- the command
class _OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr and exit code 2, without the usage block."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    parser = _OneLineParser(prog="python tools/plan.py", description=__doc__.split("\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model_size",
        choices=list(MODEL_SIZES),
        default=None,
        help="A named shape: the recipe's presets (recipes/pipeline_lm.py --model_size) or 7b (Llama-2-7B). Default: "
        "1.3b.",
    )
    model.add_argument(
        "--model_name_or_path",
        default=None,
        help="A model folder (or Hub id, when online): only its config.json is read, the model is built on the meta "
        "device.",
    )
    parser.add_argument(
        "--vocab_size",
        type=positive_int,
        default=DEFAULT_VOCAB_SIZE,
        help="Vocabulary of a --model_size model (default 32000, Llama-2's; the recipe's default is 8192).",
    )
    parser.add_argument("--gpus", type=positive_int, default=2, help="Number of GPUs.")
    parser.add_argument("--gpu_memory_gib", type=positive_float, default=24.0, help="Memory of one GPU, in GiB.")
    parser.add_argument(
        "--seq_len", type=positive_int, default=1024, help="Tokens per sequence (the recipe's --block_size)."
    )
    parser.add_argument(
        "--micro_batch",
        type=positive_int,
        default=4,
        help="Sequences per forward pass per GPU (the recipe's --per_device_train_batch_size; pipeline: per "
        "micro-batch).",
    )
    parser.add_argument(
        "--mixed_precision",
        choices=list(STATE_BYTES),
        default="bf16",
        help="bf16/fp16: mixed-precision AdamW, 2+2+12 bytes per parameter; no: fp32 AdamW, 4+4+8.",
    )
    parser.add_argument(
        "--num_microbatches", type=positive_int, default=8, help="Pipeline: micro-batches per batch (m)."
    )
    parser.add_argument(
        "--pipeline_schedule",
        choices=["1f1b", "gpipe"],
        default="1f1b",
        help="Pipeline: 1f1b holds at most p micro-batches' activations per stage, gpipe all m.",
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="sdpa (flash/memory-efficient: no score matrix stored) or eager (stores a x s x s scores).",
    )
    parser.add_argument(
        "--overhead_gib",
        type=float,
        default=DEFAULT_OVERHEAD_GIB,
        help="Fixed memory per GPU outside tensors: CUDA context, NCCL, fragmentation (default 1.0).",
    )
    parser.add_argument("--json", action="store_true", help="Print the full estimate as JSON instead of the table.")
    return parser.parse_args(argv)


def load_shape(args: argparse.Namespace) -> ModelShape:
    """The model shape the command line asks for; ValueError with a one-line reason if it cannot."""
    if not args.model_name_or_path:
        return preset_shape(args.model_size or "1.3b", args.vocab_size)
    from transformers import AutoConfig

    location = args.model_name_or_path
    folder = Path(location).expanduser()
    if folder.exists() and not (folder / "config.json").is_file():
        raise ValueError(f"--model_name_or_path {location}: no config.json in that folder")
    if not folder.exists() and (folder.is_absolute() or location.startswith((".", "~")) or location.count("/") > 1):
        raise ValueError(f"--model_name_or_path {location}: no such folder")
    try:
        config = AutoConfig.from_pretrained(location)
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError or hub errors
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--model_name_or_path {location}: not a local model folder and not loadable ({first_line})"
        ) from None
    try:
        return shape_from_config(config, name=location)
    except (ValueError, KeyError, AttributeError) as error:
        raise ValueError(f"--model_name_or_path {location}: cannot read its shape ({error})") from None


def format_table(result: dict) -> str:
    """The estimate as a readable table (GiB per device) followed by the recommendation."""
    model, inputs = result["model"], result["inputs"]
    lines = [
        f"model {model['name']}: {model['num_parameters'] / 1e6:,.1f}M parameters (hidden {model['hidden_size']}, "
        f"{model['num_layers']} blocks, {model['num_heads']} heads, MLP {model['intermediate_size']}, vocabulary "
        f"{model['vocab_size']})",
        f"{inputs['gpus']} GPU(s) x {inputs['gpu_memory_gib']:g} GiB; sequence {inputs['seq_len']}, micro-batch "
        f"{inputs['micro_batch']}; AdamW, mixed_precision={inputs['mixed_precision']} "
        f"({inputs['bytes_per_parameter']} B/parameter); {inputs['attention']} attention; overhead "
        f"{inputs['overhead_gib']:g} GiB per GPU; pipeline: {inputs['pipeline_schedule']}, "
        f"{inputs['num_microbatches']} micro-batches",
        "",
        "GiB per device       params  grads  optim  buffers  activ. (ckpt)    total  (ckpt)  fits",
    ]
    for name in SETUPS:
        if name not in result["setups"]:
            continue
        setup = result["setups"][name]
        devices = setup["devices"][:1] if setup["identical"] else setup["devices"]
        for device in devices:
            label = {"single": "single", "ddp": "ddp", "fsdp": "fsdp"}.get(name)
            if label is None:
                label = f"{name} {device['device']}"
            elif setup["identical"] and len(setup["devices"]) > 1:
                label += " (each GPU)"
            fits = (
                "yes"
                if device["total"] <= inputs["gpu_memory_gib"] * GIB
                else ("with ckpt" if device["total_checkpointed"] <= inputs["gpu_memory_gib"] * GIB else "no")
            )
            lines.append(
                f"{label:<19}"
                + "".join(f"{device[key] / GIB:>7.1f}" for key in ("parameters", "gradients", "optimizer"))
                + f"{device['buffers'] / GIB:>9.1f}{device['activations'] / GIB:>7.1f} "
                f"({device['activations_checkpointed'] / GIB:>4.1f})"
                + f"{device['total'] / GIB:>9.1f} ({device['total_checkpointed'] / GIB:>5.1f})  {fits}"
            )
    recommendation = result["recommendation"]
    lines.append("")
    if recommendation["setup"] is None:
        lines.append(f"recommendation: none. {recommendation['reason']}")
    else:
        flag = " + --gradient_checkpointing" if recommendation["gradient_checkpointing"] else ""
        lines.append(f"recommendation: {recommendation['setup']}{flag}. {recommendation['reason']}")
        if recommendation.get("launch"):
            lines.append(f"launch: {recommendation['launch']}")
        elif recommendation.get("config"):
            lines.append(f"config: accelerate_configs/{recommendation['config']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        shape = load_shape(args)
        result = plan(
            shape,
            args.gpus,
            args.gpu_memory_gib,
            args.seq_len,
            args.micro_batch,
            args.mixed_precision,
            args.num_microbatches,
            args.pipeline_schedule,
            args.attention,
            args.overhead_gib,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
