"""The fit planner: will a model train on N GPUs of M GiB, how (full, LoRA, QLoRA), under which setup, and which one.

    python tools/plan.py --model_size 1.3b --gpus 2 --gpu_memory_gib 24 --seq_len 1024 --micro_batch 4
    python tools/plan.py --model_size 70b --method qlora --gpus 2 --gpu_memory_gib 24 --seq_len 1024 --micro_batch 1
    python tools/plan.py --model_name_or_path path/to/model_or/config.json --method lora --json

It estimates, per GPU and for the host, the memory of six setups: ``single`` (one GPU), ``ddp`` (a full replica per
GPU), ``fsdp`` (FSDP2 full shard: the model state divided by N), ``fsdp_offload`` (FSDP2 with CPU offload: parameters,
gradients and optimizer state in host RAM, only the units being computed on the GPU), ``pipeline`` (one contiguous
group of blocks per GPU, m micro-batches in flight; full fine-tuning only, ``recipes/pipeline_lm.py``) and
``device_map`` (the same split inside one process, one micro-batch at a time). Nothing is loaded: a preset's shape is
arithmetic, a ``--model_name_or_path`` (a folder or a config.json) is built on the meta device (no weights).

What the numbers describe is what our recipes do (``recipes/llm_finetune.py`` for LoRA and QLoRA and models given by
name, ``recipes/train_lm.py`` / ``pipeline_lm.py`` for full fine-tuning of the presets), in bytes (s = sequence
length, b = micro-batch, h = hidden size, f = MLP width, a = heads, kv = K/V heads, V = vocabulary, P = parameters
the GPU holds, A = LoRA parameters, Q = parameters of the blocks' linear layers, the ones bitsandbytes quantizes):

- Model state. Full fine-tuning keeps fp32 weights whatever ``--mixed_precision`` says: the recipes load the model
  in fp32 and Accelerate's mixed precision is autocast over fp32 master weights, so AdamW holds 4 (weights) + 4
  (fp32 gradients) + 8 (m, v) = 16 B per parameter (the ZeRO paper's 2 + 2 + 12 = 16 describes a different
  implementation with the same total: Rajbhandari et al. 2020, section 3.1). LoRA: the frozen base in the compute
  dtype (``--mixed_precision bf16``: 2 B/parameter; ``no``: 4), the adapter (r x (in + out) per adapted linear layer,
  all of q, k, v, o, gate, up, down by default) in fp32 with fp32 gradients and AdamW state (PEFT upcasts the
  adapter): 16 B per adapter parameter. QLoRA (``BitsAndBytesConfig(nf4, double quantization, quant_storage =
  compute dtype)``, what the recipe uses): Q x 0.5 B (4-bit NF4) plus the quantization constants, blocksize 64:
  an 8-bit absmax per 64 weights and an fp32 absmax per 256 of those, 1/64 + 4/16384 = 0.0159 B (0.127 bits) per
  weight (without double quantization an fp32 absmax per 64: 0.0625 B, 0.5 bits); everything else (embeddings,
  norms, LM head) in fp32, because ``peft.prepare_model_for_kbit_training`` casts every 16-bit parameter that is not
  4-bit to fp32. The constants are an attribute of each 4-bit weight, not a parameter: FSDP neither shards nor
  offloads them, every GPU keeps all of them (an assumption).
- Activations per decoder block, after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models" (arXiv:2205.05198, section 4.1), itemized for the tensors transformers' Llama block keeps for
  backward (checked tensor by tensor with ``torch.autograd`` saved-tensor hooks on a small Llama on CPU, see
  ``tests/test_plan.py``), with SDPA (flash / memory-efficient attention: no a x s x s scores), per token:
  2 x 4 (RMSNorm normalizes in fp32 and keeps that copy) + c x (2 + 2 kv/a) (q, k, v, attention output)
  + 3 m f/h (gate, SiLU(gate), up) + for full fine-tuning the linear layers' inputs (under autocast each layer
  casts its fp32 input to 16 bits and keeps that copy: 6 c + m f/h) and 2 r (the norms' outputs, their weights
  train), + for LoRA, per adapted layer, its input in the compute dtype and (``--lora_dropout`` > 0) a 1-byte
  dropout mask: (c + 1) x (6 + f/h) (without dropout and without a cast, q/k/v and gate/up share one input).
  c: compute dtype bytes; r: the residual stream's (fp32 under autocast when the
  weights or embeddings are fp32: full fine-tuning, and QLoRA after prepare_model_for_kbit_training; 16-bit for LoRA
  and under FSDP2, which gathers 16-bit weights); m: the MLP's (QLoRA: bitsandbytes returns its input's dtype, so
  fp32 under autocast). A frozen base still needs these activations: the gradient reaches the adapters of the first
  blocks only through every block above them. ``--attention eager`` adds Korthikanti's 5 a s s b (16-bit).
  With activation checkpointing each block keeps only its input, r x s x b x h, and one block's full activations
  exist again while it is recomputed (the paper's "full recomputation").
- The LM head and loss: the final norm's fp32 copy, the head's input (full fine-tuning) and 12 B per token and
  vocabulary entry: the recipes take the fp32 logits (Accelerate's autocast returns fp32 outputs) and keep only the
  loss, so at the start of backward the fp32 log-softmax output (saved) and its gradient in and out exist.
  Checkpointing does not touch it; often the largest single tensor of a step.
- Buffers: DDP's gradient buckets (a second copy of the trained weights' gradients, ``gradient_as_bucket_view=False``,
  Accelerate's default). FSDP2's gathered units: the root (embeddings, final norm, LM head, kept gathered) and two
  blocks (the one computing, the one prefetched) in the compute dtype (MixedPrecisionPolicy(param_dtype=bf16)), and
  their unsharded 16-bit gradients; with CPU offload also the host-to-GPU copies of those units' shards.
- Temporaries: under autocast (single, DDP, device_map) the 16-bit copy of every fp32 weight a matrix multiply
  uses: Accelerate wraps the whole forward in one autocast region, whose cache keeps the cast of every weight that
  requires grad until the forward returns, so for full fine-tuning all of them exist at once (2 B per weight of
  the blocks and the head, also with checkpointing); QLoRA's fp32 head is cast and kept for backward too; under
  FSDP2 the gathered weights are already 16-bit, no copy. QLoRA dequantizes one weight at a time to the compute
  dtype (the largest linear layer). The backward pass's gradients in flight through one block (3 f m + 2 h r per
  token). The optimizer step: torch's foreach AdamW (the default on CUDA) allocates one more copy of the trained
  weights' state (4 B each) while the gradients still exist.
- The peak is model state + buffers + overhead + the largest of three moments: the start of backward (everything
  stored, the LM head's and loss's tensors, autocast's copies), a block's backward (its recomputation, the
  gradients in flight, the dequantized weight; the head's tensors are gone) and the optimizer step (activations
  gone, the step's temporary).
- Overhead: ``--overhead_gib`` per GPU, default 1.0: the CUDA context (0.3-0.5 GiB with lazy module loading, not
  counted by ``torch.cuda.max_memory_reserved``), NCCL's buffers and allocator fragmentation. Checked against
  published measurements (``tests/test_plan.py``: Answer.AI's FSDP-QLoRA benchmarks), the estimate is within 5 % of
  the peak allocated memory and 0-15 % below the peak reserved memory (the allocator's cache grows with the
  activations): a fit above 90 % of the GPU is called tight, keep that headroom.
- Host RAM, per process and for the machine: a baseline of 1.5 GiB per process (Python, torch, the CUDA libraries),
  the loading copy (full fine-tuning: the model in fp32, LoRA: in the compute dtype, held by every process before
  ``prepare`` moves it to the GPU; under ``fsdp_offload_2gpu.yaml`` only the main process reads it
  (fsdp_cpu_ram_efficient_loading); QLoRA loads straight onto each GPU, the checkpoint is memory-mapped) and, with
  offload, the process's shard of the model state (pinned). ``--host_ram_gib`` (default: this machine's RAM) is
  what the machine has. A QLoRA model is quantized on each GPU as it loads, before FSDP shards it: that load peak
  (the whole 4-bit model per GPU) must fit too.

The recommendation, in a fixed order of preference (the first that fits wins; a setup that fits without activation
checkpointing beats every setup that needs it, since recomputation costs about one extra forward pass, ~33 % more
compute; ``--gradient_checkpointing`` asks for it and the estimate assumes it): ``ddp`` (every GPU computes, only
gradients travel, overlapped with backward) > ``fsdp`` (every GPU computes; parameters are all-gathered in forward
and backward, ~1.5x DDP's traffic) > ``pipeline`` (full fine-tuning of the presets; every GPU computes except for the
bubble, (p-1)/(m+p-1) of the time) > ``single`` (one GPU computes) > ``device_map`` (fits larger models, but one GPU
computes at a time) > ``fsdp_offload`` (fits the largest models; every block crosses PCIe twice per step and AdamW
steps on the CPU: several times slower). ``--cpu_offload`` puts ``fsdp_offload`` first. A tight DDP fit yields to
FSDP when FSDP fits with room to spare. A setup that does not fit says by how much and what would fit instead
(checkpointing, a micro-batch of 1, LoRA, QLoRA, offload, more GPUs).

Pipeline and device_map split the blocks as the recipes do (``recipes/pipeline_lm.py``): whole blocks, balanced by
compute, the embeddings on the first device and the LM head (+ loss) on the last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Tools import the helper module; they are run from anywhere, so the repository root goes first on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.model_presets import MODEL_PRESETS  # noqa: E402
from shared.model_split import LOSS_COST_PER_VOCAB_ENTRY, balanced_partition  # noqa: E402
from shared.runtime import positive_float, positive_int  # noqa: E402

GIB = 1024**3


def _llama(hidden, blocks, heads, kv_heads, mlp, positions):
    return dict(
        hidden_size=hidden,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        max_position_embeddings=positions,
    )


# Shapes only the planner offers (the recipes would not train them on CPU), from each model's config.json on the Hub;
# all have vocabulary 32000 and an untied LM head. 70b and 34b use grouped-query attention (8 K/V heads).
PLANNER_SHAPES = {
    # meta-llama/Llama-2-7b-hf/config.json: 6,738,415,616 parameters
    "7b": _llama(4096, 32, 32, 32, 11008, 4096),
    # meta-llama/Llama-2-13b-hf/config.json: 13,015,864,320 parameters
    "13b": _llama(5120, 40, 40, 40, 13824, 4096),
    # codellama/CodeLlama-34b-hf/config.json (rope_theta 1e6, which does not change memory): 33,743,970,304 parameters
    "34b": _llama(8192, 48, 64, 8, 22016, 16384),
    # meta-llama/Llama-2-70b-hf/config.json: 68,976,648,192 parameters
    "70b": _llama(8192, 80, 64, 8, 28672, 4096),
}
MODEL_SIZES = {
    **{name: {**shape, "num_key_value_heads": shape["num_attention_heads"]} for name, shape in MODEL_PRESETS.items()},
    **PLANNER_SHAPES,
}
# The Hub model each planner shape is, for the recipe's launch line (recipes/llm_finetune.py --model_name_or_path).
HUB_NAMES = {
    "7b": "meta-llama/Llama-2-7b-hf",
    "13b": "meta-llama/Llama-2-13b-hf",
    "34b": "codellama/CodeLlama-34b-hf",
    "70b": "meta-llama/Llama-2-70b-hf",
}
DEFAULT_VOCAB_SIZE = 32000  # Llama-2's; the LM recipes train their own tokenizer, --vocab_size 8192 by default
SETUPS = ("single", "ddp", "fsdp", "fsdp_offload", "pipeline", "device_map")
PREFERENCE = ("ddp", "fsdp", "pipeline", "single", "device_map", "fsdp_offload")
METHODS = ("full", "lora", "qlora")
MIXED_PRECISION = ("no", "bf16", "fp16")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Bytes per 4-bit weight (two per byte) and of its quantization constants (blocksize 64): with double quantization
# an 8-bit absmax per 64 weights plus an fp32 absmax per 256 of those; without, an fp32 absmax per 64 weights.
NF4_BYTES = 0.5
CONSTANT_BYTES = {True: 1 / 64 + 4 / (64 * 256), False: 4 / 64}
# Per token and vocabulary entry at the start of backward: the fp32 log-softmax output and its gradient in and out.
LOSS_BYTES_PER_LOGIT = 12
RMSNORM_BYTES = 4  # LlamaRMSNorm normalizes in fp32 and keeps that copy for backward
DEFAULT_OVERHEAD_GIB = 1.0
# Above this share of the GPU a fit is called tight: published peaks (reserved memory) run up to ~15 % above the
# estimate (tests/test_plan.py's validations).
TIGHT = 0.9
PROCESS_BASELINE_GIB = 1.5  # host RSS of a training process before any model: Python, torch, the CUDA libraries
# The accelerate config for each setup on two GPUs (accelerate_configs/).
CONFIGS = {
    "single": "single_gpu.yaml",
    "ddp": "ddp_2gpu.yaml",
    "fsdp": "fsdp_2gpu.yaml",
    "fsdp_offload": "fsdp_offload_2gpu.yaml",
    "pipeline": "pipeline_2gpu.yaml",
    "device_map": "model_sharding_2gpu.yaml",
}
# What a config.json needs for the planner to read a shape from it (transformers' names; aliases such as GPT-2's
# n_embd count).
REQUIRED_CONFIG_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


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
    # One block's linear layers as (name inside the block, in_features, out_features): what bitsandbytes quantizes
    # and what LoRA's "all-linear" adapts.
    block_linears: tuple = ()

    @property
    def num_parameters(self) -> int:
        return self.embedding_params + self.num_layers * self.block_params + self.head_params

    @property
    def block_linear_params(self) -> int:
        return sum(inputs * outputs for _, inputs, outputs in self.block_linears)

    @property
    def lm_head_params(self) -> int:
        return self.head_matmul_flops // 2


def preset_shape(model_size: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> ModelShape:
    """The shape of a named size (``shared/model_presets.py``, plus the Llama-2 / CodeLlama shapes above) as
    transformers builds it: a ``LlamaConfig`` with untied LM head. Counted by arithmetic; the tests check it against
    ``numel()`` of the real model built on the meta device."""
    if model_size not in MODEL_SIZES:
        raise ValueError(f"unknown --model_size {model_size!r}; choose from {', '.join(MODEL_SIZES)}")
    preset = MODEL_SIZES[model_size]
    h, f, heads = preset["hidden_size"], preset["intermediate_size"], preset["num_attention_heads"]
    kv_heads = preset["num_key_value_heads"]
    kv_width = kv_heads * (h // heads)
    linears = (
        ("self_attn.q_proj", h, h),
        ("self_attn.k_proj", h, kv_width),
        ("self_attn.v_proj", h, kv_width),
        ("self_attn.o_proj", h, h),
        ("mlp.gate_proj", h, f),
        ("mlp.up_proj", h, f),
        ("mlp.down_proj", f, h),
    )
    matmul = sum(inputs * outputs for _, inputs, outputs in linears)
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
        block_params=matmul + 2 * h,  # + two RMSNorm weights
        head_params=h + vocab_size * h,  # final norm + untied LM head
        block_matmul_flops=2 * matmul,
        head_matmul_flops=2 * vocab_size * h,
        has_lm_head=True,
        block_linears=linears,
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
    linears = []
    for module_name, module in blocks[0].named_modules():
        if isinstance(module, torch.nn.Linear):
            linears.append((module_name, module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D":  # GPT-2's transposed Linear: weight (in, out)
            linears.append((module_name, *module.weight.shape))
    projections_to_f = sum(1 for _, _, outputs in linears if outputs == f)
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
        block_linears=tuple(linears),
    )


# ------------------------------------------------------------------------------- precision
def precision_profile(method: str, mixed_precision: str, sharded: bool = False, overrides: dict | None = None) -> dict:
    """Bytes per element of everything the estimate counts, for what the recipes do (module docstring).

    ``sharded``: under FSDP2, whose MixedPrecisionPolicy gathers 16-bit weights, so the forward runs on 16-bit
    weights and activations (no autocast copies, 16-bit residual stream). ``overrides`` describe other published
    setups (pure bf16 training, another loader) for the validations in the tests.
    """
    mixed = mixed_precision != "no"
    c = 2 if mixed else 4
    fp32_stream = mixed and not sharded  # fp32 weights or embeddings under autocast keep the residual stream fp32
    profile = dict(
        compute=c,
        master=4,  # the trained weights (full: the model, LoRA: the adapter): fp32 ...
        grad=4,  # ... with fp32 gradients ...
        adam=8,  # ... and fp32 AdamW m and v
        frozen=c,  # LoRA's frozen base: loaded in the compute dtype
        nonquant=4,  # QLoRA's embeddings, norms, head: fp32 after prepare_model_for_kbit_training
        double_quant=True,
        residual=4 if method in ("full", "qlora") and fp32_stream else c,
        mlp=4 if method == "qlora" and fp32_stream else c,
        casts=method == "full" and fp32_stream,  # every linear layer keeps its own 16-bit copy of its fp32 input
        weight_copies=method == "full" and fp32_stream,  # autocast's cached 16-bit copies of the fp32 weights
        head_copy=method == "qlora" and fp32_stream,  # the fp32 LM head cast to 16 bits, kept for backward
        logit_bytes=LOSS_BYTES_PER_LOGIT,
    )
    unknown = set(overrides or {}) - set(profile)
    if unknown:
        raise ValueError(f"unknown precision overrides {sorted(unknown)}")
    profile.update(overrides or {})
    return profile


def lora_params_per_block(shape: ModelShape, lora_r: int, lora_targets=None) -> int:
    """r x (in + out) for every adapted linear layer of one block (LoRA's A and B matrices)."""
    return sum(lora_r * (inputs + outputs) for _, inputs, outputs in _adapted(shape, lora_targets))


def _adapted(shape: ModelShape, lora_targets):
    if lora_targets is None:  # the recipe's default: "all-linear", every linear layer of the blocks
        return shape.block_linears
    return [linear for linear in shape.block_linears if linear[0].split(".")[-1] in lora_targets]


def block_activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    mixed_precision: str = "bf16",
    attention: str = "sdpa",
    method: str = "full",
    profile: dict | None = None,
    lora_dropout: float = 0.05,
    lora_r: int = 8,
    lora_targets=None,
) -> int:
    """Activations one decoder block keeps for backward (formula in the module docstring)."""
    p = profile or precision_profile(method, mixed_precision)
    h, f = shape.hidden_size, shape.intermediate_size
    c, r, m = p["compute"], p["residual"], p["mlp"]
    per_token = 2 * RMSNORM_BYTES * h + c * (2 + 2 * shape.num_kv_heads / shape.num_heads) * h
    per_token += (3 if shape.gated_mlp else 1) * m * f  # gate, SiLU(gate), up (GeLU MLP: its input)
    if method == "full":
        per_token += 2 * r * h  # the norms' outputs: their weights train
        if p["casts"]:  # each layer's own 16-bit copy of its input; the MLP's last input is already 16-bit
            per_token += c * sum(inputs for _, inputs, _ in shape.block_linears if inputs != f) + m * f
        else:  # attention and MLP inputs shared by their projections, the attention output, the MLP's last input
            per_token += (2 * r + c) * h + m * f
    else:  # the adapters: each keeps its input in the compute dtype, a 1-byte dropout mask, its rank-r middle
        mask = 1 if lora_dropout > 0 else 0
        # Without dropout and without a cast (adapter and activations in one dtype), the adapters of projections
        # that read one tensor (q, k, v; gate, up) keep that one tensor.
        shared = lora_dropout == 0 and c == p["master"]
        for name, inputs, _ in _adapted(shape, lora_targets):
            reads_shared = name.endswith(("k_proj", "v_proj", "up_proj"))
            per_token += c * lora_r + (0 if shared and reads_shared else (c + mask) * inputs)
    total = seq_len * micro_batch * per_token
    if attention == "eager":  # the score matrix: softmax output, dropout mask and output (Korthikanti)
        total += 5 * shape.num_heads * seq_len * seq_len * micro_batch * c / 2
    return int(total)


def block_input_bytes(shape: ModelShape, seq_len: int, micro_batch: int, profile: dict) -> int:
    """What a checkpointed block keeps: its input, in the residual stream's dtype."""
    return seq_len * micro_batch * shape.hidden_size * profile["residual"]


def head_activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    mixed_precision: str = "bf16",
    method: str = "full",
    profile=None,
) -> int:
    """What the final norm, the LM head and the loss keep at the start of backward."""
    if not shape.has_lm_head:
        return 0
    p = profile or precision_profile(method, mixed_precision)
    per_token = RMSNORM_BYTES * shape.hidden_size + p["logit_bytes"] * shape.vocab_size
    if method == "full":  # the norm's output (its weight trains) and the head's input (its weight trains)
        per_token += (p["residual"] + (p["compute"] if p["casts"] else p["residual"])) * shape.hidden_size
    return int(seq_len * micro_batch * per_token)


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


# ------------------------------------------------------------------------------- per device
def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB" if value >= GIB or not value else f"{value / 2**20:,.0f} MiB"


def _millions(value: float) -> str:
    return f"{value / 1e6:,.1f}M"


def _state_bytes(method: str, p: dict, params: float, linear: float, adapter: float) -> dict:
    """Weights, gradients and optimizer state of ``params`` base parameters (``linear`` of them in the blocks'
    linear layers) and ``adapter`` LoRA parameters, with the formula behind each."""
    if method == "full":
        return {
            "parameters": (params * p["master"], f"{_millions(params)} x {p['master']} B"),
            "gradients": (params * p["grad"], f"{_millions(params)} x {p['grad']} B"),
            "optimizer": (params * p["adam"], f"{_millions(params)} x {p['adam']} B (AdamW m, v)"),
        }
    if method == "lora":
        weights = (
            params * p["frozen"] + adapter * p["master"],
            f"{_millions(params)} frozen x {p['frozen']} B + {_millions(adapter)} LoRA x {p['master']} B",
        )
    else:
        weights = (
            linear * NF4_BYTES + (params - linear) * p["nonquant"] + adapter * p["master"],
            f"{_millions(linear)} 4-bit x {NF4_BYTES} B + {_millions(params - linear)} not quantized x "
            f"{p['nonquant']} B + {_millions(adapter)} LoRA x {p['master']} B",
        )
    return {
        "parameters": weights,
        "gradients": (adapter * p["grad"], f"{_millions(adapter)} LoRA x {p['grad']} B"),
        "optimizer": (adapter * p["adam"], f"{_millions(adapter)} LoRA x {p['adam']} B (AdamW m, v)"),
    }


def _device(label, kind, state, compute, shape, a, p, buckets=False):
    """One GPU's estimate. ``state``: the parameters whose state this GPU holds (``params``, ``linear``,
    ``adapter``, ``constants_linear``: the 4-bit weights whose constants it keeps); ``compute``: what it runs
    (``blocks``, ``has_head``, ``in_flight`` micro-batches of activations). ``kind``: replica, split, fsdp, offload."""
    method, gpus = a["method"], a["gpus"]
    c = p["compute"]
    tokens = a["seq_len"] * a["micro_batch"]
    per_block_lora = lora_params_per_block(shape, a["lora_r"], a["lora_targets"]) if method != "full" else 0
    terms, formulas = {}, {}

    def add(name, value, formula):
        terms[name] = int(value)
        formulas[name] = formula

    state_terms = _state_bytes(method, p, state["params"], state["linear"], state["adapter"])
    for name, (value, formula) in state_terms.items():
        if kind == "offload":  # the shards live in host RAM
            add(name, 0, f"0 on the GPU (in host RAM: {_gib(value)})")
        else:
            add(name, value, f"{formula} = {_gib(value)}")
    constants = state["constants_linear"] * CONSTANT_BYTES[p["double_quant"]] if method == "qlora" else 0
    add(
        "quantization_constants",
        constants,
        f"{_millions(state['constants_linear'])} 4-bit weights x {CONSTANT_BYTES[p['double_quant']]:.4f} B = "
        f"{_gib(constants)}"
        if method == "qlora"
        else "0",
    )
    trained = state["params"] if method == "full" else state["adapter"]
    # Buffers: DDP's gradient buckets; FSDP2's gathered units (root + 2 blocks) and their unsharded gradients.
    buffers, buffer_formula = 0, "0"
    if buckets:
        buffers = trained * p["grad"]
        buffer_formula = f"DDP gradient buckets {_millions(trained)} x {p['grad']} B"
    elif kind in ("fsdp", "offload"):
        unit_params = shape.embedding_params + shape.head_params + 2 * shape.block_params
        unit_linear, unit_adapter = 2 * shape.block_linear_params, 2 * per_block_lora
        if method == "qlora":
            gathered = unit_linear * NF4_BYTES + (unit_params - unit_linear) * c + unit_adapter * c
        else:
            gathered = unit_params * c + unit_adapter * c
        unit_trained = unit_params if method == "full" else unit_adapter
        buffers = gathered + unit_trained * c
        buffer_formula = (
            f"gathered root + 2 blocks {_gib(gathered)} + their unsharded gradients {_millions(unit_trained)} x {c} B"
        )
        if kind == "offload":  # the units' shards copied to the GPU before the all-gather, gradients back
            staging = _state_bytes(method, p, unit_params, unit_linear, unit_adapter)["parameters"][0] / gpus
            staging += unit_trained * p["grad"] / gpus
            buffers += staging
            buffer_formula += f" + host-to-GPU copies of their shards {_gib(staging)}"
    add("buffers", buffers, f"{buffer_formula} = {_gib(buffers)}")
    # Activations: every block computed here, in_flight micro-batches of them, and the head's.
    blocks, in_flight = compute["blocks"], compute["in_flight"]
    arguments = dict(
        attention=a["attention"],
        method=method,
        profile=p,
        lora_dropout=a["lora_dropout"],
        lora_r=a["lora_r"],
        lora_targets=a["lora_targets"],
    )
    block = block_activation_bytes(shape, a["seq_len"], a["micro_batch"], **arguments)
    block_input = block_input_bytes(shape, a["seq_len"], a["micro_batch"], p)
    head = (
        head_activation_bytes(shape, a["seq_len"], a["micro_batch"], method=method, profile=p)
        if compute["has_head"]
        else 0
    )
    stored, stored_checkpointed = in_flight * blocks * block, in_flight * blocks * block_input
    heads = in_flight * head
    recomputed = block if blocks else 0
    activations, checkpointed = stored + heads, stored_checkpointed + max(heads, recomputed)
    add(
        "activations",
        activations,
        f"{in_flight} x ({blocks} blocks x {_gib(block)} + head {_gib(head)}) = {_gib(activations)}",
    )
    add(
        "activations_checkpointed",
        checkpointed,
        f"{in_flight} x {blocks} block inputs x {_gib(block_input)} + the larger of the head {_gib(heads)} and one "
        f"block recomputed {_gib(recomputed)} = {_gib(checkpointed)}",
    )
    # Temporaries: autocast's 16-bit weight copies, the dequantized 4-bit weight, gradients in flight.
    head_weights = shape.lm_head_params if compute["has_head"] else 0
    copies = copies_one_block = head_copy = dequantized = working = 0
    if method == "full" and p["weight_copies"]:
        copies = 2 * (blocks * shape.block_linear_params + head_weights)
        copies_one_block = 2 * shape.block_linear_params if blocks else 0
    if method != "full" and kind not in ("fsdp", "offload") and c < p["master"]:
        copies = 2 * blocks * per_block_lora
    if method == "qlora" and p["head_copy"]:
        head_copy = head_weights * c
    if method == "qlora" and blocks:
        dequantized = max(inputs * outputs for _, inputs, outputs in shape.block_linears) * c
    if blocks:
        f, h = shape.intermediate_size, shape.hidden_size
        working = tokens * ((3 if shape.gated_mlp else 2) * f * p["mlp"] + 2 * h * p["residual"])
    parts = [
        (copies, f"autocast's 16-bit copies of the {'fp32' if method == 'full' else 'LoRA'} weights"),
        (head_copy, "the fp32 LM head cast for its matmul"),
        (dequantized, "one dequantized 4-bit weight"),
        (working, "gradients in flight through one block"),
    ]
    parts = [(value, what) for value, what in parts if value]
    temporaries = sum(value for value, _ in parts)
    add(
        "temporaries",
        temporaries,
        " + ".join(f"{what} {_gib(value)}" for value, what in parts) + f" = {_gib(temporaries)}" if parts else "0",
    )
    step = 0 if kind == "offload" else trained * p["adam"] / 2  # foreach AdamW: one more state-sized tensor
    add("optimizer_step", step, f"foreach AdamW's temporary {_millions(trained)} x {p['adam'] // 2} B = {_gib(step)}")
    add("overhead", a["overhead"], f"CUDA context, NCCL, fragmentation = {_gib(a['overhead'])}")
    # The peak is the largest of three moments: the start of backward (everything stored, the head's backward),
    # a block's backward (its recomputation and the gradients in flight; the head's tensors are gone) and the
    # optimizer step (activations gone, the step's temporary). Autocast's cache keeps every weight copy until the
    # forward returns, so checkpointing frees them only for the blocks' backward.
    phases = {
        "start_of_backward": stored + heads + copies + head_copy,
        "block_backward": stored + copies + working + dequantized,
        "optimizer_step": step,
    }
    phases_checkpointed = {
        "start_of_backward": stored_checkpointed + heads + copies + head_copy,
        "block_backward": stored_checkpointed + recomputed + copies_one_block + working + dequantized,
        "optimizer_step": step,
    }
    model_state = sum(terms[name] for name in ("parameters", "gradients", "optimizer", "quantization_constants"))
    fixed = model_state + terms["buffers"] + terms["overhead"]
    return {
        "device": label,
        "num_parameters": int(state["params"] + state["adapter"]),
        "blocks": blocks,
        "in_flight": in_flight,
        **terms,
        "model_state": model_state,
        "adapter": {
            "parameters": int(state["adapter"]),
            "bytes": int(state["adapter"] * (p["master"] + p["grad"] + p["adam"])) if kind != "offload" else 0,
        },
        "phases": {name: int(value) for name, value in phases.items()},
        "phases_checkpointed": {name: int(value) for name, value in phases_checkpointed.items()},
        "total": int(fixed + max(phases.values())),
        "total_checkpointed": int(fixed + max(phases_checkpointed.values())),
        "arithmetic": formulas,
    }


def _host(a, p, shape, processes: int, loaders: int, offloaded_per_process: int, split: bool = False) -> dict:
    """Host RAM: per process a baseline, the loading copy (``loaders`` processes read the whole checkpoint) and the
    offloaded shard of the model state; the machine needs the sum. QLoRA loads onto the GPU, except for a split
    (device_map), which the recipe quantizes on the CPU before dispatching it."""
    method = a["method"]
    if method == "qlora" and split:
        linear = shape.num_layers * shape.block_linear_params
        loading = (
            linear * (NF4_BYTES + CONSTANT_BYTES[p["double_quant"]]) + (shape.num_parameters - linear) * p["compute"]
        )
        how = f"the 4-bit model quantized on the CPU {_gib(loading)}"
    elif method == "qlora":
        loading, how = 0, "QLoRA loads onto the GPU (the checkpoint is memory-mapped)"
    else:
        dtype = 4 if method == "full" else p["frozen"]
        loading = shape.num_parameters * dtype
        how = f"the loading copy {_millions(shape.num_parameters)} x {dtype} B = {_gib(loading)}"
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
        + (f" + {processes} x offloaded state {_gib(offloaded_per_process)}" if offloaded_per_process else "")
        + f" = {_gib(machine)}"
    )
    return {"host_ram": int(machine), "host_ram_per_process": per_process, "host_ram_arithmetic": formula}


def _estimate_setups(shape: ModelShape, a: dict, only: str | None = None) -> dict:
    gpus, method = a["gpus"], a["method"]
    p_replica = precision_profile(method, a["mixed_precision"], False, a["profile"])
    p_sharded = precision_profile(method, a["mixed_precision"], True, a["profile"])
    per_block_lora = lora_params_per_block(shape, a["lora_r"], a["lora_targets"]) if method != "full" else 0
    total_params, total_linear = shape.num_parameters, shape.num_layers * shape.block_linear_params
    total_adapter = shape.num_layers * per_block_lora
    everything = dict(params=total_params, linear=total_linear, adapter=total_adapter, constants_linear=total_linear)
    whole = dict(blocks=shape.num_layers, has_head=True, in_flight=1)
    setups = {}

    def replica(name, processes, buckets):
        device = _device("gpu0", "replica", everything, whole, shape, a, p_replica, buckets)
        devices = [device] + [{**device, "device": f"gpu{rank}"} for rank in range(1, processes)]
        setups[name] = {"devices": devices, "identical": True, **_host(a, p_replica, shape, processes, processes, 0)}

    if only in (None, "single"):
        replica("single", 1, False)
    if gpus < 2 or only == "single":
        return setups
    if only in (None, "ddp"):
        replica("ddp", gpus, True)  # a full replica per GPU, plus gradient buckets (a second copy of the gradients)
    # FSDP2 full shard: 1/N of every parameter, gradient and optimizer state (not of the 4-bit weights' constants).
    shard = {key: value / gpus for key, value in everything.items()}
    shard["constants_linear"] = total_linear
    for name, kind in (("fsdp", "fsdp"), ("fsdp_offload", "offload")):
        if only not in (None, name):
            continue
        device = _device("gpu0", kind, shard, whole, shape, a, p_sharded)
        devices = [device] + [{**device, "device": f"gpu{rank}"} for rank in range(1, gpus)]
        offloaded = 0
        if kind == "offload":
            state = _state_bytes(method, p_sharded, shard["params"], shard["linear"], shard["adapter"])
            offloaded = int(sum(value for value, _ in state.values()))
        # fsdp_2gpu.yaml: every process reads the checkpoint; fsdp_offload_2gpu.yaml: only the main process does.
        loaders = gpus if kind == "fsdp" else 1
        setups[name] = {"devices": devices, "identical": True, **_host(a, p_sharded, shape, gpus, loaders, offloaded)}
    if shape.num_layers < gpus or only not in (None, "pipeline", "device_map"):
        return setups  # fewer blocks than GPUs: no split gives every GPU a block
    counts = split_blocks(shape, gpus, a["seq_len"])
    for name in ("pipeline", "device_map"):
        if only not in (None, name):
            continue
        devices = []
        for part, blocks in enumerate(counts):
            first, last = part == 0, part == gpus - 1
            params = (
                blocks * shape.block_params
                + (shape.embedding_params if first else 0)
                + (shape.head_params if last else 0)
            )
            linear = blocks * shape.block_linear_params
            held = dict(params=params, linear=linear, adapter=blocks * per_block_lora, constants_linear=linear)
            if name == "device_map":
                in_flight = 1
            elif a["pipeline_schedule"] == "gpipe":
                in_flight = a["num_microbatches"]  # all forwards before any backward
            else:
                in_flight = min(a["num_microbatches"], gpus - part)  # 1F1B: stage i holds p - i micro-batches
            label = f"stage{part}" if name == "pipeline" else f"gpu{part}"
            runs = dict(blocks=blocks, has_head=last, in_flight=in_flight)
            devices.append(_device(label, "split", held, runs, shape, a, p_replica))
        processes = gpus if name == "pipeline" else 1  # pipeline_lm.py: one process per stage, each builds the model
        setups[name] = {
            "devices": devices,
            "identical": False,
            "blocks_per_device": counts,
            **_host(a, p_replica, shape, processes, processes, 0, split=name == "device_map"),
        }
    return setups


def _load_peak(shape: ModelShape, a: dict, name: str) -> int | None:
    """QLoRA under FSDP2: recipes/llm_finetune.py loads the model onto each GPU (device_map={"": device}) and
    quantizes it there before FSDP shards it, so every GPU briefly holds the whole 4-bit model (with fp32
    non-quantized parts and the fp32 adapter, prepare_model_for_kbit_training and PEFT run before prepare())."""
    if a["method"] != "qlora" or name not in ("fsdp", "fsdp_offload"):
        return None
    p = precision_profile("qlora", a["mixed_precision"], False, a["profile"])
    linear = shape.num_layers * shape.block_linear_params
    adapter = shape.num_layers * lora_params_per_block(shape, a["lora_r"], a["lora_targets"])
    weights = _state_bytes("qlora", p, shape.num_parameters, linear, adapter)["parameters"][0]
    return int(weights + linear * CONSTANT_BYTES[p["double_quant"]] + a["overhead"])


def _summarize(setups: dict, shape: ModelShape, a: dict) -> None:
    budget, host_budget = a["budget"], a["host_budget"]
    for name, setup in setups.items():
        setup["peak_without_checkpointing"] = max(device["total"] for device in setup["devices"])
        setup["peak_checkpointed"] = max(device["total_checkpointed"] for device in setup["devices"])
        setup["gradient_checkpointing"] = bool(a["gradient_checkpointing"])
        setup["peak"] = setup["peak_checkpointed" if a["gradient_checkpointing"] else "peak_without_checkpointing"]
        setup["gpu_load_peak"] = _load_peak(shape, a, name)
        loads = setup["gpu_load_peak"] is None or setup["gpu_load_peak"] <= budget
        setup["fits_host"] = setup["host_ram"] <= host_budget
        setup["fits_gpu"] = setup["peak"] <= budget and loads
        setup["fits"] = setup["fits_gpu"] and setup["fits_host"]
        setup["fits_with_checkpointing"] = setup["peak_checkpointed"] <= budget and loads and setup["fits_host"]
        setup["fits_without_checkpointing"] = (
            setup["peak_without_checkpointing"] <= budget and loads and setup["fits_host"]
        )
        setup["over_by"] = max(0, setup["peak"] - budget)
        setup["host_over_by"] = max(0, setup["host_ram"] - host_budget)
        setup["recipe"] = _recipe(shape, a["method"], name)


def _recipe(shape: ModelShape, method: str, name: str) -> str | None:
    """The recipe that trains this setup, or None (pipelines are full fine-tuning of the presets only)."""
    if name == "pipeline":
        return "recipes/pipeline_lm.py" if method == "full" and shape.name in MODEL_PRESETS else None
    if method == "full" and shape.name in MODEL_PRESETS:
        return "recipes/train_lm.py"
    return "recipes/llm_finetune.py"


# ------------------------------------------------------------------------------- the plan
def machine_ram_gib() -> float:
    """This machine's physical RAM, in GiB (the default of --host_ram_gib)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


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
    lora_r: int = 8,
    lora_dropout: float = 0.05,
    gradient_checkpointing: bool = False,
    cpu_offload: bool = False,
    host_ram_gib: float | None = None,
    lora_targets=None,
    precision: dict | None = None,
    advise: bool = True,
) -> dict:
    """Per-GPU and host memory of every setup on ``gpus`` GPUs of ``gpu_memory_gib``, and the recommendation.

    ``micro_batch``: sequences per forward pass on one device (pipeline: per micro-batch, with
    ``num_microbatches`` of them per batch). ``method``: full, lora or qlora (LoRA rank ``lora_r`` on
    ``lora_targets``, default every linear layer of the blocks). ``gradient_checkpointing``: the estimate and the
    recommendation assume it (False: the recommendation adds it only when needed). ``cpu_offload``: prefer
    ``fsdp_offload``. ``host_ram_gib``: the machine's RAM (default: this machine's). ``precision``: overrides of
    ``precision_profile`` for setups other than our recipes'. Returns a JSON-ready dict; every memory number is
    in bytes (per GPU, or for the host). Raises ValueError on impossible inputs.
    """
    for flag, value in (
        ("gpus", gpus),
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("num_microbatches", num_microbatches),
        ("lora_r", lora_r),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{flag} must be a whole number >= 1, got {value}")
    if not gpu_memory_gib > 0:
        raise ValueError(f"--gpu_memory_gib must be > 0, got {gpu_memory_gib}")
    if not overhead_gib >= 0:
        raise ValueError(f"--overhead_gib must be >= 0, got {overhead_gib}")
    if host_ram_gib is not None and not host_ram_gib > 0:
        raise ValueError(f"--host_ram_gib must be > 0, got {host_ram_gib}")
    if not 0 <= lora_dropout < 1:
        raise ValueError(f"--lora_dropout must be in [0, 1), got {lora_dropout}")
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"--mixed_precision must be one of {', '.join(MIXED_PRECISION)}, got {mixed_precision!r}")
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if pipeline_schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"--pipeline_schedule must be 1f1b or gpipe, got {pipeline_schedule!r}")
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"--attention must be sdpa or eager, got {attention!r}")
    if method != "full" and not _adapted(shape, lora_targets):
        raise ValueError(f"{shape.name}: LoRA finds no linear layer to adapt in its blocks")
    host_ram_gib = machine_ram_gib() if host_ram_gib is None else host_ram_gib
    a = dict(
        gpus=gpus,
        seq_len=seq_len,
        micro_batch=micro_batch,
        mixed_precision=mixed_precision,
        num_microbatches=num_microbatches,
        pipeline_schedule=pipeline_schedule,
        attention=attention,
        overhead=int(overhead_gib * GIB),
        method=method,
        lora_r=lora_r,
        lora_dropout=lora_dropout,
        lora_targets=tuple(lora_targets) if lora_targets is not None else None,
        gradient_checkpointing=gradient_checkpointing,
        cpu_offload=cpu_offload,
        budget=int(gpu_memory_gib * GIB),
        host_budget=int(host_ram_gib * GIB),
        profile=precision,
    )
    setups = _estimate(shape, a)
    if advise:
        for name, setup in setups.items():
            if not setup["fits"] and setup["recipe"]:  # no advice for what no recipe trains (a LoRA pipeline)
                setup["advice"] = _advise(shape, a, name, setup)
    adapter = shape.num_layers * lora_params_per_block(shape, lora_r, a["lora_targets"]) if method != "full" else 0
    result = {
        "model": {**asdict(shape), "num_parameters": shape.num_parameters, "lora_parameters": adapter},
        "inputs": {
            "gpus": gpus,
            "gpu_memory_gib": gpu_memory_gib,
            "host_ram_gib": round(host_ram_gib, 2),
            "seq_len": seq_len,
            "micro_batch": micro_batch,
            "method": method,
            "lora_r": lora_r if method != "full" else None,
            "lora_dropout": lora_dropout if method != "full" else None,
            "mixed_precision": mixed_precision,
            "gradient_checkpointing": gradient_checkpointing,
            "cpu_offload": cpu_offload,
            "num_microbatches": num_microbatches,
            "pipeline_schedule": pipeline_schedule,
            "attention": attention,
            "overhead_gib": overhead_gib,
            "precision": precision_profile(method, mixed_precision, False, precision),
        },
        "setups": setups,
    }
    result["recommendation"] = _recommend(shape, a, setups)
    result["best"] = result["recommendation"]["setup"]
    return result


def _estimate(shape: ModelShape, a: dict, only: str | None = None) -> dict:
    setups = _estimate_setups(shape, a, only)
    _summarize(setups, shape, a)
    return setups


def _order(a: dict, setups: dict) -> list[str]:
    order = [name for name in PREFERENCE if name in setups and setups[name]["recipe"]]
    if a["cpu_offload"] and "fsdp_offload" in order:
        order.remove("fsdp_offload")
        order.insert(0, "fsdp_offload")
    return order


def _fits(setup: dict, checkpointing: bool) -> bool:
    return setup["fits_with_checkpointing" if checkpointing else "fits_without_checkpointing"]


def _choose(a: dict, setups: dict):
    """The first setup in order of preference that fits (without checkpointing if any does); a tight DDP fit yields
    to FSDP when FSDP fits comfortably (both compute on every GPU; FSDP's margin is worth its traffic)."""
    for checkpointing in (True,) if a["gradient_checkpointing"] else (False, True):
        fitting = [name for name in _order(a, setups) if _fits(setups[name], checkpointing)]
        if fitting:
            key = "peak_checkpointed" if checkpointing else "peak_without_checkpointing"
            tight = {name for name in fitting if setups[name][key] > TIGHT * a["budget"]}
            if fitting[0] == "ddp" and "ddp" in tight and "fsdp" in fitting and "fsdp" not in tight:
                return "fsdp", checkpointing
            return fitting[0], checkpointing
    return None


LABELS = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}


def _advise(shape: ModelShape, a: dict, name: str, setup: dict) -> str:
    """Why ``name`` does not fit, by how much, and the first change that makes it (or its offload twin) fit."""
    budget, host_budget = a["budget"], a["host_budget"]
    problems = []
    if setup["peak"] > budget:
        problems.append(f"needs {_gib(setup['peak'])} per GPU, {_gib(setup['over_by'])} over {_gib(budget)}")
    if setup["gpu_load_peak"] is not None and setup["gpu_load_peak"] > budget:
        problems.append(
            f"loading needs {_gib(setup['gpu_load_peak'])} per GPU: recipes/llm_finetune.py quantizes the whole model "
            f"on each GPU before FSDP shards it (training itself needs {_gib(setup['peak'])}: a loader that "
            "quantizes on the CPU and shards before moving to the GPU would fit)"
        )
    if not setup["fits_host"]:
        problems.append(
            f"needs {_gib(setup['host_ram'])} of host RAM, {_gib(setup['host_over_by'])} more than the machine's "
            f"{_gib(host_budget)} (--host_ram_gib)"
        )
    lighter = [method for method in METHODS[METHODS.index(a["method"]) + 1 :]]
    variants = []
    if not a["gradient_checkpointing"]:
        variants.append(({"gradient_checkpointing": True}, name, "with --gradient_checkpointing"))
    if a["micro_batch"] > 1:
        variants.append(
            ({"gradient_checkpointing": True, "micro_batch": 1}, name, "--gradient_checkpointing --micro_batch 1")
        )
    for method in lighter:
        variants.append(({"method": method, "gradient_checkpointing": True}, name, f"{LABELS[method]}"))
    if name == "fsdp":
        variants.append(({"gradient_checkpointing": True}, "fsdp_offload", "fsdp_offload"))
    if name in ("fsdp", "fsdp_offload"):
        for method in lighter:
            variants.append(
                ({"method": method, "gradient_checkpointing": True}, "fsdp_offload", f"{LABELS[method]} + offload")
            )
    for changes, target, label in variants:
        other = _estimate(shape, {**a, **changes})
        if target in other and other[target]["fits"]:
            return "; ".join(problems) + f". {label} fits: {_gib(other[target]['peak'])} per GPU"
    return "; ".join(problems) + ". No change of checkpointing, micro-batch, method or offload makes it fit"


def _recommend(shape: ModelShape, a: dict, setups: dict) -> dict:
    chosen = _choose(a, setups)
    memory = _gib(a["budget"])
    if chosen is None:
        return {"setup": None, "gradient_checkpointing": None, "reason": _nothing_fits(shape, a, setups)}
    name, checkpointing = chosen
    key = "peak_checkpointed" if checkpointing else "peak_without_checkpointing"
    peak = _gib(setups[name][key])
    gpus = a["gpus"]
    if name == "ddp":
        reason = (
            f"DDP fits ({peak} of {memory} per GPU): each GPU holds a full replica and computes its share of every "
            "batch; only gradients travel, overlapped with the backward pass. The fastest setup when it fits."
        )
    elif name == "fsdp" and _fits(setups["ddp"], checkpointing):
        reason = (
            f"DDP fits, but tightly ({_gib(setups['ddp'][key])} of {memory} per GPU; measured peaks run up to ~15 % "
            f"above these estimates): FSDP divides the model state by {gpus} ({peak} per GPU), every GPU still "
            "computes, for about 1.5x DDP's traffic."
        )
    elif name == "fsdp":
        reason = (
            f"DDP needs {_gib(setups['ddp'][key])} per GPU, more than {memory}: data parallelism divides the batch, "
            f"not the model, so every GPU would hold all of the model state. FSDP (full shard) divides parameters, "
            f"gradients and optimizer state by {gpus} ({peak} per GPU) and every GPU still computes; the price is "
            "all-gathering the parameters in forward and backward (about 1.5x DDP's traffic)."
        )
    elif name == "pipeline":
        m, p = a["num_microbatches"], gpus
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
    elif name == "device_map":
        reason = (
            f"Only the naive device_map split fits ({peak} on its fullest GPU): it lets the model fit, but one GPU "
            "computes at a time, so it is no faster than one GPU."
        )
    else:
        host = setups[name]
        reason = (
            f"FSDP2 with CPU offload fits ({peak} per GPU, {_gib(host['host_ram'])} of host RAM): parameters, "
            "gradients and optimizer state live in host RAM and each block crosses PCIe to the GPU and back every "
            "step, AdamW steps on the CPU: several times slower than FSDP without offload."
        )
        if not a["cpu_offload"]:
            reason = f"Nothing fits without offload ({setups['fsdp'].get('advice', 'FSDP does not fit')}). " + reason
    if checkpointing and not a["gradient_checkpointing"]:
        device = max(setups[name]["devices"], key=lambda d: d["total"])
        reason += (
            f" Needs --gradient_checkpointing: the activations ({_gib(device['activations'])}) are what does not fit "
            f"({_gib(setups[name]['peak_without_checkpointing'])} without it); checkpointed they take "
            f"{_gib(device['activations_checkpointed'])}, for about one extra forward pass (~33 % more compute)."
        )
    if setups[name][key] > TIGHT * a["budget"]:
        reason += (
            f" Tight: {peak} of {memory}, and measured peaks (the allocator's reserved memory) run up to ~15 % above "
            "these estimates"
            + (
                f"; --gradient_checkpointing brings it to {_gib(setups[name]['peak_checkpointed'])}."
                if not checkpointing
                else f"; a shorter --seq_len{' or --micro_batch' if a['micro_batch'] > 1 else ''} leaves headroom."
            )
        )
    config = CONFIGS[name] if gpus == 2 or name == "single" else None
    return {
        "setup": name,
        "gradient_checkpointing": checkpointing,
        "reason": reason,
        "peak_bytes": setups[name][key],
        "host_ram_bytes": setups[name]["host_ram"],
        "config": config,
        "launch": launch_line(shape, name, checkpointing, config, a),
    }


# In a launch line, for a config.json with no weights beside it: the one word the user must replace (a bare word, so
# that the shell does not read it as a redirection); the text output says so under the line.
WEIGHTS_PLACEHOLDER = "FOLDER_WITH_THE_WEIGHTS"


def loadable_location(location: str) -> str:
    """What ``recipes/llm_finetune.py --model_name_or_path`` can load for the planner's ``--model_name_or_path``: a Hub
    name as it is; a config.json or a folder by the folder, when the weights lie there; otherwise the placeholder."""
    path = Path(location)
    if not path.exists():
        return location  # a Hub name
    folder = path.parent if path.is_file() else path
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")) or any(folder.glob("*.safetensors.index.json")):
        return str(folder)
    return WEIGHTS_PLACEHOLDER


def launch_line(shape: ModelShape, name: str, checkpointing: bool, config: str | None, a: dict) -> str | None:
    """The recipe command for this setup: train_lm.py / pipeline_lm.py for full fine-tuning of a preset the
    recipes build, llm_finetune.py for a model it can load by name or path; None when there is neither."""
    if config is None:
        return None
    method = a["method"]
    flags = []
    if method == "full" and shape.name in MODEL_PRESETS:
        recipe = "pipeline_lm.py" if name == "pipeline" else "train_lm.py"
        batch = a["micro_batch"] * (a["num_microbatches"] if name == "pipeline" else 1)
        flags += [
            f"--model_size {shape.name}",
            f"--vocab_size {shape.vocab_size}",
            f"--block_size {a['seq_len']}",
            f"--per_device_train_batch_size {batch}",
        ]
        if name == "pipeline":
            flags.append(f"--pipeline_schedule {a['pipeline_schedule']} --num_microbatches {a['num_microbatches']}")
    elif name == "pipeline":
        return None
    else:
        preset = shape.name in MODEL_PRESETS
        location = HUB_NAMES.get(shape.name) or (None if preset else loadable_location(shape.name))
        if location is None:
            return None
        recipe = "llm_finetune.py"
        flags.append(f"--model_name_or_path {location}")
        flags += {"full": ["--full_finetune"], "lora": [], "qlora": ["--load_in_4bit"]}[method]
        if method != "full" and a["lora_r"] != 8:
            flags.append(f"--lora_r {a['lora_r']}")
        flags += [f"--max_length {a['seq_len']}", f"--per_device_train_batch_size {a['micro_batch']}"]
    if name == "device_map":
        # Explicit: on a 2-GPU box the 1-process config would pick it anyway, on one GPU or none it would not.
        flags.append("--parallelism device_map")
    if a["mixed_precision"] != "no":
        flags.append(f"--mixed_precision {a['mixed_precision']}")
    if checkpointing:
        flags.append("--gradient_checkpointing")
    return f"accelerate launch --config_file accelerate_configs/{config} recipes/{recipe} " + " ".join(flags)


def _nothing_fits(shape: ModelShape, a: dict, setups: dict) -> str:
    gpus, budget = a["gpus"], a["budget"]
    best = min(setups, key=lambda name: setups[name]["peak_checkpointed"])
    state = max(device["model_state"] for device in setups[best]["devices"])
    reason = (
        f"Nothing fits {gpus} x {_gib(budget)} and {_gib(a['host_budget'])} of host RAM, even with "
        f"--gradient_checkpointing: the smallest GPU need is {best}'s {_gib(setups[best]['peak_checkpointed'])} "
        "per GPU" + (f", of which model state {_gib(state)}" if state else "")
    )
    if setups[best]["peak_checkpointed"] <= budget:
        blockers = []
        if (setups[best]["gpu_load_peak"] or 0) > budget:
            blockers.append(f"loading needs {_gib(setups[best]['gpu_load_peak'])} per GPU")
        if not setups[best]["fits_host"]:
            blockers.append(f"it needs {_gib(setups[best]['host_ram'])} of host RAM")
        reason += ", but " + " and ".join(blockers) if blockers else ""
    reason += "."
    advice = [setups[name].get("advice", "") for name in _order(a, setups)]
    helpful = [text for text in advice if " fits: " in text]
    if helpful:
        reason += " " + helpful[0].split(". ")[-1] + "."

    def fsdp_fits_on(count: int) -> dict | None:
        wider = _estimate(shape, {**a, "gpus": count, "gradient_checkpointing": True}, only="fsdp")["fsdp"]
        return wider if wider["peak_checkpointed"] <= budget and wider["gpu_load_peak"] in (None, 0) else None

    low, high = gpus + 1, 1024
    if "fsdp" in setups and (setups["fsdp"]["gpu_load_peak"] or 0) > budget:
        return reason + (
            f" More GPUs do not help FSDP here: recipes/llm_finetune.py loads the whole 4-bit model onto each GPU "
            f"({_gib(setups['fsdp']['gpu_load_peak'])}) before sharding it."
        )
    if fsdp_fits_on(high) is None:
        return (
            reason + " No number of such GPUs is enough under FSDP: what is not sharded (activations, gathered units, "
            "quantization constants) does not fit; use a shorter sequence or QLoRA."
        )
    while low < high:  # the fewest GPUs on which FSDP fits: its per-GPU need falls as GPUs are added
        middle = (low + high) // 2
        low, high = (low, middle) if fsdp_fits_on(middle) else (middle + 1, high)
    wider = fsdp_fits_on(low)
    return reason + (
        f" FSDP would fit on {low} such GPUs ({_gib(wider['peak_checkpointed'])} each, with "
        "--gradient_checkpointing; host RAM aside); or shrink the model state (LoRA, QLoRA) or offload it to CPU."
    )


# ------------------------------------------------------------------------------- the command
class _OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr and exit code 2, without the usage block. ``--help`` shows every default."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=_HelpWithDefaults, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message}\n")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help, unless its help names its default already or it has none."""

    def _get_help_string(self, action):
        text = action.help or ""
        named = "default" in text.lower()
        if action.default in (None, False, argparse.SUPPRESS) or named or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


# What the planner assumes when a flag is not given: said on its first line, since each changes the answer.
ASSUMED = {
    "--gpus": "gpus",
    "--gpu_memory_gib": "gpu_memory_gib",
    "--seq_len": "seq_len",
    "--micro_batch": "micro_batch",
    "--mixed_precision": "mixed_precision",
    "--method": "method",
    "--host_ram_gib": "host_ram_gib",
}


def assumptions(argv: list[str], result: dict) -> dict:
    """The inputs of ``ASSUMED`` this command line did not give, with the values the estimate used."""
    given = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    return {flag: result["inputs"][key] for flag, key in ASSUMED.items() if flag not in given}


def parse_args(argv=None) -> argparse.Namespace:
    parser = _OneLineParser(prog="python tools/plan.py", description=__doc__.split("\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model_size",
        choices=list(MODEL_SIZES),
        default=None,
        help="A named shape: the recipes' presets (recipes/train_lm.py --model_size) or 7b, 13b, 70b (Llama-2) and "
        "34b (CodeLlama). Default: 1.3b.",
    )
    model.add_argument(
        "--model_name_or_path",
        default=None,
        help="A model folder or its config.json (or a Hub id, when online): only the config is read, the model is "
        "built on the meta device, no weights needed.",
    )
    parser.add_argument(
        "--vocab_size",
        type=positive_int,
        default=DEFAULT_VOCAB_SIZE,
        help="Vocabulary of a --model_size model (default 32000, Llama-2's; the LM recipes' default is 8192).",
    )
    parser.add_argument(
        "--method",
        choices=list(METHODS),
        default="full",
        help="full fine-tuning, lora (frozen base in the compute dtype + fp32 adapter) or qlora (4-bit NF4 base, "
        "double quantization): recipes/llm_finetune.py's --full_finetune, default and --load_in_4bit.",
    )
    parser.add_argument(
        "--lora_r", type=positive_int, default=8, help="LoRA rank, on every linear layer of the blocks (default 8)."
    )
    parser.add_argument(
        "--lora_dropout",
        type=float,
        default=0.05,
        help="Dropout on the LoRA path (default 0.05, the recipe's): > 0 keeps a 1-byte mask per adapted input.",
    )
    parser.add_argument("--gpus", type=positive_int, default=2, help="Number of GPUs.")
    parser.add_argument("--gpu_memory_gib", type=positive_float, default=24.0, help="Memory of one GPU, in GiB.")
    parser.add_argument(
        "--host_ram_gib",
        type=positive_float,
        default=None,
        help="The machine's RAM, in GiB (default: this machine's), for the loading copy and offloaded state.",
    )
    parser.add_argument(
        "--seq_len",
        type=positive_int,
        default=1024,
        help="Tokens per sequence (the recipes' --block_size, --max_length).",
    )
    parser.add_argument(
        "--micro_batch",
        type=positive_int,
        default=4,
        help="Sequences per forward pass per GPU (the recipes' --per_device_train_batch_size; pipeline: per "
        "micro-batch).",
    )
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Assume activation checkpointing (both are always estimated; without this flag the recommendation "
        "adds it only when nothing fits without).",
    )
    parser.add_argument(
        "--cpu_offload",
        action="store_true",
        help="Prefer FSDP2 with CPU offload of parameters, gradients and optimizer state (fsdp_offload_2gpu.yaml); "
        "without it, offload is recommended only when nothing else fits.",
    )
    parser.add_argument(
        "--mixed_precision",
        choices=list(MIXED_PRECISION),
        default="bf16",
        help="bf16/fp16: autocast (full fine-tuning keeps fp32 weights, 4+4+8 B/parameter; LoRA's frozen base is "
        "16-bit); no: everything fp32.",
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


def _needed_fields() -> str:
    return (
        "the planner needs a config.json with model_type (an architecture transformers knows, e.g. llama, mistral, "
        "qwen2, gpt2) and hidden_size, num_hidden_layers, num_attention_heads, vocab_size (and intermediate_size "
        "where the architecture has one)"
    )


def read_config(location: str):
    """A transformers config from a folder with config.json, a config.json file or a Hub id; ValueError with one
    line naming what is missing when the planner cannot use it."""
    import inspect

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(location).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model_name_or_path {location}: no config.json in that folder")
        path = path / "config.json"
    elif not path.exists():
        local = path.is_absolute() or location.startswith((".", "~")) or location.endswith(".json")
        if local or location.count("/") > 1:
            raise ValueError(f"--model_name_or_path {location}: no such folder or file")
        try:  # a Hub id
            return AutoConfig.from_pretrained(location)
        except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError or hub errors
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(
                f"--model_name_or_path {location}: not a local model folder and not loadable ({first_line})"
            ) from None
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"--model_name_or_path {location}: {path.name} is not JSON ({error}); {_needed_fields()}"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model_name_or_path {location}: {path.name} is not a JSON object; {_needed_fields()}")
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        what = f"model_type {model_type!r} is not an architecture" if model_type else "it has no model_type"
        raise ValueError(
            f"--model_name_or_path {location}: {what} transformers {transformers.__version__} knows; "
            + _needed_fields()
        )
    config_class = CONFIG_MAPPING[model_type]
    aliases = getattr(config_class, "attribute_map", {})  # e.g. GPT-2's hidden_size -> n_embd
    needed = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    if "intermediate_size" in inspect.signature(config_class.__init__).parameters:
        needed.append("intermediate_size")
    missing = [field for field in needed if field not in raw and aliases.get(field) not in raw]
    if missing:
        raise ValueError(
            f"--model_name_or_path {location}: its config.json ({model_type}) lacks {', '.join(missing)}; "
            f"{_needed_fields()}"
        )
    return config_class.from_dict(raw)


def load_shape(args: argparse.Namespace) -> ModelShape:
    """The model shape the command line asks for; ValueError with a one-line reason if it cannot."""
    if not args.model_name_or_path:
        return preset_shape(args.model_size or "1.3b", args.vocab_size)
    location = args.model_name_or_path
    config = read_config(location)
    try:
        return shape_from_config(config, name=location)
    except (ValueError, KeyError, AttributeError, TypeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--model_name_or_path {location}: cannot build its shape on the meta device ({first_line}); "
            f"{_needed_fields()}"
        ) from None


def format_table(result: dict) -> str:
    """The estimate as a readable table (GiB per device), the recommendation and the arithmetic behind it."""
    model, inputs = result["model"], result["inputs"]
    method = inputs["method"]
    lora = f", LoRA r={inputs['lora_r']} ({model['lora_parameters'] / 1e6:,.1f}M)" if method != "full" else ""
    assumed = result.get("assumed") or {}
    lines = (
        [
            "assumed, not given (each changes the answer; pass the flag to say otherwise): "
            + ", ".join(
                f"{flag} {value:g}" + (" (this machine's)" if flag == "--host_ram_gib" else "")
                if isinstance(value, (int, float))
                else f"{flag} {value}"
                for flag, value in assumed.items()
            )
        ]
        if assumed
        else []
    )
    lines += [
        f"model {model['name']}: {model['num_parameters'] / 1e6:,.1f}M parameters (hidden {model['hidden_size']}, "
        f"{model['num_layers']} blocks, {model['num_heads']} heads / {model['num_kv_heads']} K/V, MLP "
        f"{model['intermediate_size']}, vocabulary {model['vocab_size']})",
        f"{LABELS[method]}{lora}; mixed_precision={inputs['mixed_precision']}; {inputs['gpus']} GPU(s) x "
        f"{inputs['gpu_memory_gib']:g} GiB, host RAM {inputs['host_ram_gib']:g} GiB; sequence {inputs['seq_len']}, "
        f"micro-batch {inputs['micro_batch']}; {inputs['attention']} attention; overhead {inputs['overhead_gib']:g} "
        f"GiB per GPU; pipeline: {inputs['pipeline_schedule']}, {inputs['num_microbatches']} micro-batches",
        "",
        "GiB per GPU             weights q.const  grads  optim buffers  activ. (ckpt)  temp.    total   (ckpt)  "
        "host RAM  fits",
    ]
    budget = inputs["gpu_memory_gib"] * GIB
    for name in SETUPS:
        if name not in result["setups"]:
            continue
        setup = result["setups"][name]
        devices = setup["devices"][:1] if setup["identical"] else setup["devices"]
        for index, device in enumerate(devices):
            label = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "fsdp_offload": "fsdp_offload"}.get(name)
            if label is None:
                label = f"{name} {device['device']}"
            elif setup["identical"] and len(setup["devices"]) > 1:
                label += " (each GPU)"
            # Every reason it does not fit, with its number: the text below names the same ones.
            training = device["total_checkpointed"]
            reasons = [f"training {training / GIB:.1f} GiB"] if training > budget else []
            if (setup["gpu_load_peak"] or 0) > budget:
                reasons.append(f"loading {setup['gpu_load_peak'] / GIB:.1f} GiB")
            if not setup["fits_host"]:
                reasons.append(f"host RAM {setup['host_ram'] / GIB:.1f} GiB")
            if setup["recipe"] is None:
                fits = "(no recipe)"
            elif reasons:
                fits = "no (" + "; ".join(reasons) + ")"
            elif device["total_checkpointed" if inputs["gradient_checkpointing"] else "total"] <= budget:
                fits = "yes"
            else:
                fits = "with ckpt"
            host = f"{setup['host_ram'] / GIB:>9.1f}" if index == 0 else " " * 9
            lines.append(
                f"{label:<23}"
                + "".join(
                    f"{device[key] / GIB:>7.1f}"
                    for key in ("parameters", "quantization_constants", "gradients", "optimizer", "buffers")
                )
                + f"{device['activations'] / GIB:>7.1f} ({device['activations_checkpointed'] / GIB:>5.1f})"
                + f"{device['temporaries'] / GIB:>7.1f}"
                + f"{device['total'] / GIB:>9.1f} ({device['total_checkpointed'] / GIB:>6.1f}){host}  {fits}"
            )
    recommendation = result["recommendation"]
    lines.append("")
    if recommendation["setup"] is None:
        lines.append(f"recommendation: none. {recommendation['reason']}")
    else:
        name = recommendation["setup"]
        flag = " + --gradient_checkpointing" if recommendation["gradient_checkpointing"] else ""
        lines.append(f"recommendation: {name}{flag}. {recommendation['reason']}")
        if recommendation.get("launch"):
            lines.append(f"launch: {recommendation['launch']}")
            if WEIGHTS_PLACEHOLDER in recommendation["launch"]:
                lines.append(
                    f"        replace {WEIGHTS_PLACEHOLDER} with the folder that holds the model's weights and "
                    "tokenizer (the planner read only a config.json, with no weights beside it)"
                )
        elif recommendation.get("config"):
            lines.append(f"config: accelerate_configs/{recommendation['config']}")
        setup = result["setups"][name]
        device = max(setup["devices"], key=lambda d: d["total_checkpointed" if flag else "total"])
        lines.append(f"arithmetic ({name}, {device['device']}, bytes per element as the module docstring says):")
        activations = "activations_checkpointed" if recommendation["gradient_checkpointing"] else "activations"
        for term in (
            "parameters",
            "quantization_constants",
            "gradients",
            "optimizer",
            "buffers",
            activations,
            "temporaries",
            "optimizer_step",
            "overhead",
        ):
            lines.append(f"  {term}: {device['arithmetic'][term]}")
        total = device["total_checkpointed" if recommendation["gradient_checkpointing"] else "total"]
        phases = device["phases_checkpointed" if recommendation["gradient_checkpointing"] else "phases"]
        lines.append(
            "  peak = model state + buffers + overhead + the largest of: "
            + ", ".join(f"{phase.replace('_', ' ')} {_gib(value)}" for phase, value in phases.items())
            + f" = {_gib(total)}"
        )
        lines.append(f"  host RAM: {setup['host_ram_arithmetic']}")
    advice = [(name, setup["advice"]) for name, setup in result["setups"].items() if setup.get("advice")]
    if advice:
        lines.append("")
        lines.extend(f"{name} does not fit: {text}" for name, text in advice)
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
            method=args.method,
            lora_r=args.lora_r,
            lora_dropout=args.lora_dropout,
            gradient_checkpointing=args.gradient_checkpointing,
            cpu_offload=args.cpu_offload,
            host_ram_gib=args.host_ram_gib,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result["assumed"] = assumptions(sys.argv[1:] if argv is None else list(argv), result)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
