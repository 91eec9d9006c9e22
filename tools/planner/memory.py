"""The arithmetic of the fit planner: bytes per parameter, per token and per block, for what our recipes do.

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
  ``tests/test_plan.py`` and ``tools/activation_probe.py``), with SDPA (flash / memory-efficient attention: no
  a x s x s scores), per token:
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
  token). The optimizer step: the recipes' AdamW is fused (``fused=True``), which updates in place and allocates
  nothing state-sized; with fp16 they use torch's foreach AdamW, which adds one more copy of the trained weights'
  state (4 B each) while the gradients still exist.
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
  (fsdp_cpu_ram_efficient_loading); QLoRA loads straight onto each GPU, the checkpoint is memory-mapped; under FSDP
  only the main process reads it, one 16-bit tensor at a time) and, with offload, the process's shard of the model
  state (pinned). ``--host_ram_gib`` (default: a typical target's RAM) is what the machine has. QLoRA under FSDP
  loads one unit at a time, sharding each (recipes/llm_kit/sharded_4bit.py): its load peak (this GPU's shards, every
  quantization constant, one layer in 16 + 4 bits or one embeddings matrix in 16 bits, overhead) is reported beside
  the training peak and must fit too.

- DPO (``recipes/dpo.py``): a sample is a pair, a chosen and a rejected completion of one prompt, concatenated along
  the batch into one forward: every activation, the head's logits and the gradients in flight are those of
  2 x b sequences (b: pairs per device, the recipe's --per_device_train_batch_size), with the LM head counted as
  above. The reference model: with LoRA and QLoRA it is the base with the adapter disabled (PEFT's
  ``disable_adapter()``), no second copy; full fine-tuning either loads a frozen copy in the compute dtype
  (``--no-precompute_reference``: c B per parameter on every GPU, 1/N under FSDP, which the recipe prepares like
  the policy; in host RAM under offload, and a second loading copy) or computes the reference log-probabilities
  in one pass before training and keeps two numbers per sample (``--precompute_reference``, the recipe's default
  for full: nothing on the GPU). A reference forward during training runs under no_grad: it stores nothing, but
  while it runs its fp32 logits and their log-softmax (8 B per token and vocabulary entry) and one block's
  working set (3 f m + 2 h r per token) exist; it is counted on top of the policy's stored activations and head
  (TRL's DPOTrainer runs it after the policy's forward, the worse of the two orders), under FSDP with the
  reference copy's gathered units (root + 2 blocks).

- GRPO (``recipes/grpo.py``): training is SFT's on completions (``--micro_batch`` completions of ``--seq_len`` =
  prompt + completion tokens per forward). Generating, a process holds its weights (no activations: the step's are
  gone) and the KV cache of the rows it generates at once, planned as one group: ``--num_generations`` sequences of
  ``--seq_len`` tokens, 2 (K and V) x kv x (h / a) x c bytes per token and block (a larger round scales it
  linearly), with the last position's fp32 logits and sampling probabilities (8 B per row and vocabulary entry).
  With ``--beta`` > 0 a reference forward every step (LoRA: the adapter disabled; full: a frozen copy in the
  compute dtype, as DPO's ``--no-precompute_reference``). The generation split (``--generation_mode split``): the
  last GPU only generates (its weights as loaded, no gradients nor optimizer state, the KV cache), the others only
  train (no KV cache; two GPUs: one trainer, no DDP buckets).

This module holds the per-element, per-token and per-block formulas; ``devices.py`` adds them up for one GPU and
for the host.
"""

from __future__ import annotations

from tools.planner.shapes import ModelShape
from tools.planner.tables import (
    CONSTANT_BYTES,
    GENERATION_BYTES_PER_LOGIT,
    LOSS_BYTES_PER_LOGIT,
    NF4_BYTES,
    REFERENCE_BYTES_PER_LOGIT,
    RMSNORM_BYTES,
    millions,
)


# ------------------------------------------------------------------------------- bytes per element
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


# ------------------------------------------------------------------------------- parameters
def adapted_linears(shape: ModelShape, lora_targets=None) -> list | tuple:
    """The linear layers of one block that LoRA adapts: all of them ("all-linear", the recipe's default), or those
    whose last name is in ``lora_targets``."""
    if lora_targets is None:
        return shape.block_linears
    return [linear for linear in shape.block_linears if linear[0].split(".")[-1] in lora_targets]


def lora_params_per_block(shape: ModelShape, lora_r: int, lora_targets=None) -> int:
    """r x (in + out) for every adapted linear layer of one block (LoRA's A and B matrices)."""
    return sum(lora_r * (inputs + outputs) for _, inputs, outputs in adapted_linears(shape, lora_targets))


def model_state_bytes(method: str, p: dict, params: float, linear: float, adapter: float) -> dict:
    """Weights, gradients and optimizer state of ``params`` base parameters (``linear`` of them in the blocks'
    linear layers) and ``adapter`` LoRA parameters, each as (bytes, the formula behind them)."""
    if method == "full":  # fp32 weights, fp32 gradients, AdamW's m and v: 4 + 4 + 8 B
        return {
            "parameters": (params * p["master"], f"{millions(params)} x {p['master']} B"),
            "gradients": (params * p["grad"], f"{millions(params)} x {p['grad']} B"),
            "optimizer": (params * p["adam"], f"{millions(params)} x {p['adam']} B (AdamW m, v)"),
        }
    if method == "lora":  # the frozen base in the compute dtype, the fp32 adapter
        weights = (
            params * p["frozen"] + adapter * p["master"],
            f"{millions(params)} frozen x {p['frozen']} B + {millions(adapter)} LoRA x {p['master']} B",
        )
    else:  # QLoRA: 4-bit linear layers, everything else fp32, the fp32 adapter
        weights = (
            linear * NF4_BYTES + (params - linear) * p["nonquant"] + adapter * p["master"],
            f"{millions(linear)} 4-bit x {NF4_BYTES} B + {millions(params - linear)} not quantized x "
            f"{p['nonquant']} B + {millions(adapter)} LoRA x {p['master']} B",
        )
    return {  # only the adapter trains
        "parameters": weights,
        "gradients": (adapter * p["grad"], f"{millions(adapter)} LoRA x {p['grad']} B"),
        "optimizer": (adapter * p["adam"], f"{millions(adapter)} LoRA x {p['adam']} B (AdamW m, v)"),
    }


def quantization_constant_bytes(linear: float, p: dict) -> float:
    """The absmax constants of ``linear`` 4-bit weights (blocksize 64, ``tables.CONSTANT_BYTES``)."""
    return linear * CONSTANT_BYTES[p["double_quant"]]


# ------------------------------------------------------------------------------- activations
def block_activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    mixed_precision: str = "bf16",
    attention: str = "sdpa",
    method: str = "full",
    profile: dict | None = None,
    lora_dropout: float = 0.0,
    lora_r: int = 8,
    lora_targets=None,
) -> int:
    """Activations one decoder block keeps for backward: s x b x the bytes per token of ``block_bytes_per_token``,
    and with eager attention the a x s x s scores."""
    p = profile or precision_profile(method, mixed_precision)
    per_token = 0
    for term in block_bytes_per_token(shape, p, method, lora_dropout, lora_r, lora_targets):
        per_token += term  # added one by one, in this order: the float sum the tests pin
    total = seq_len * micro_batch * per_token
    if attention == "eager":  # the score matrix: softmax output, dropout mask and output (Korthikanti: 5 a s s b)
        total += 5 * shape.num_heads * seq_len * seq_len * micro_batch * p["compute"] / 2
    return int(total)


def block_bytes_per_token(shape: ModelShape, p: dict, method: str, lora_dropout: float, lora_r: int, lora_targets):
    """What one block keeps per token, one group of tensors a term (Korthikanti et al. 2022, section 4.1, itemized
    for transformers' Llama block under SDPA; the module docstring)."""
    h, f = shape.hidden_size, shape.intermediate_size
    c, m = p["compute"], p["mlp"]
    yield 2 * RMSNORM_BYTES * h  # the two RMSNorms' fp32 copies of their input
    yield c * (2 + 2 * shape.num_kv_heads / shape.num_heads) * h  # q, k, v (kv/a of q's width), attention output
    yield (3 if shape.gated_mlp else 1) * m * f  # gate, SiLU(gate), up (GeLU MLP: its input)
    if method == "full":
        yield from _trained_block_inputs(shape, p)
    else:
        yield from _adapter_inputs(shape, p, lora_dropout, lora_r, lora_targets)


def _trained_block_inputs(shape: ModelShape, p: dict):
    """Full fine-tuning: what the weights' gradients need, per token."""
    h, f = shape.hidden_size, shape.intermediate_size
    c, r, m = p["compute"], p["residual"], p["mlp"]
    yield 2 * r * h  # the norms' outputs: their weights train
    if p["casts"]:  # each layer's own 16-bit copy of its input; the MLP's last input is already 16-bit
        yield c * sum(inputs for _, inputs, _ in shape.block_linears if inputs != f) + m * f
    else:  # attention and MLP inputs shared by their projections, the attention output, the MLP's last input
        yield (2 * r + c) * h + m * f


def _adapter_inputs(shape: ModelShape, p: dict, lora_dropout: float, lora_r: int, lora_targets):
    """LoRA: per adapted layer, its input in the compute dtype, a 1-byte dropout mask and its rank-r middle."""
    c = p["compute"]
    mask = 1 if lora_dropout > 0 else 0
    # Without dropout and without a cast (adapter and activations in one dtype), the adapters of projections that
    # read one tensor (q, k, v; gate, up) keep that one tensor.
    shared = lora_dropout == 0 and c == p["master"]
    for name, inputs, _ in adapted_linears(shape, lora_targets):
        reads_shared = name.endswith(("k_proj", "v_proj", "up_proj"))
        yield c * lora_r + (0 if shared and reads_shared else (c + mask) * inputs)


def block_input_bytes(shape: ModelShape, seq_len: int, micro_batch: int, profile: dict) -> int:
    """What a checkpointed block keeps: its input, in the residual stream's dtype (r x s x b x h)."""
    return seq_len * micro_batch * shape.hidden_size * profile["residual"]


def head_activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, p: dict, method: str) -> int:
    """What the final norm, the LM head and the loss keep at the start of backward: the norm's fp32 copy and 12 B
    per vocabulary entry (the fp32 log-softmax output and its gradient in and out), per token."""
    if not shape.has_lm_head:
        return 0
    per_token = RMSNORM_BYTES * shape.hidden_size + p["logit_bytes"] * shape.vocab_size
    if method == "full":  # the norm's output (its weight trains) and the head's input (its weight trains)
        per_token += (p["residual"] + (p["compute"] if p["casts"] else p["residual"])) * shape.hidden_size
    return int(seq_len * micro_batch * per_token)


def gradients_in_flight_bytes(shape: ModelShape, tokens: int, p: dict) -> int:
    """The backward pass's gradients in flight through one block: 3 f m + 2 h r per token (GeLU MLP: 2 f m)."""
    f, h = shape.intermediate_size, shape.hidden_size
    return tokens * ((3 if shape.gated_mlp else 2) * f * p["mlp"] + 2 * h * p["residual"])


# ------------------------------------------------------------------------------- DPO's reference
def kv_cache_bytes(shape: ModelShape, rows: int, seq_len: int, p: dict) -> int:
    """The KV cache of ``rows`` sequences of ``seq_len`` tokens: K and V of every block, kv heads of h / a each, in
    the compute dtype (what the attention's projections return under autocast)."""
    head_dim = shape.hidden_size // shape.num_heads
    return int(rows * seq_len * shape.num_layers * 2 * shape.num_kv_heads * head_dim * p["compute"])


def generation_logit_bytes(shape: ModelShape, rows: int) -> int:
    """One generation step's last-position logits and sampling probabilities, fp32, per row (``rows``)."""
    return int(rows * GENERATION_BYTES_PER_LOGIT * shape.vocab_size) if shape.has_lm_head else 0


def reference_forward_bytes(shape: ModelShape, tokens: int, p: dict) -> int:
    """DPO's reference forward under no_grad: nothing stored for backward, but while it runs the fp32 logits of its
    ``tokens`` and their log-softmax (8 B per token and vocabulary entry) and one block's working set (3 f m + 2 h r
    per token, as the gradients in flight: GeLU MLP 2 f m)."""
    f, h = shape.intermediate_size, shape.hidden_size
    per_token = REFERENCE_BYTES_PER_LOGIT * shape.vocab_size if shape.has_lm_head else 0
    per_token += (3 if shape.gated_mlp else 2) * f * p["mlp"] + 2 * h * p["residual"]
    return int(tokens * per_token)
