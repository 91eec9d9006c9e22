"""The numbers the fit planner takes as given: units, model shapes, bytes per element, setups and their configs."""

from shared.presets import MODEL_PRESETS

# ------------------------------------------------------------------------------- units
GIB = 1024**3


def gib(value: float) -> str:
    """Bytes as the planner writes them: GiB from 1 GiB up, MiB below (and 0 as "0.0 GiB")."""
    return f"{value / GIB:.1f} GiB" if value >= GIB or not value else f"{value / 2**20:,.0f} MiB"


def millions(value: float) -> str:
    """A parameter count in millions: 6,738.4M."""
    return f"{value / 1e6:,.1f}M"


# ------------------------------------------------------------------------------- model shapes
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
# Every named shape: the recipes' presets (shared/presets.py, full multi-head attention) and the planner's own.
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
# Hub models the planner knows without the network (the fields of their config.json that change memory; the Hub's
# own file when online is the same shape): the 128k and 152k vocabularies of today's 70B models, untied.
HUB_CONFIGS = {
    # meta-llama/Llama-3.1-70B/config.json: 70,553,706,496 parameters
    "meta-llama/Llama-3.1-70B": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        tie_word_embeddings=False,
        **_llama(8192, 80, 64, 8, 28672, 131072),
    ),
    # Qwen/Qwen2.5-72B/config.json (q, k and v have biases): 72,706,203,648 parameters
    "Qwen/Qwen2.5-72B": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=152064,
        tie_word_embeddings=False,
        **_llama(8192, 80, 64, 8, 29568, 131072),
    ),
}
DEFAULT_VOCAB_SIZE = 32000  # Llama-2's; the LM recipes train their own tokenizer, --vocab_size 8192 by default

# ------------------------------------------------------------------------------- bytes per element
# Bytes per 4-bit weight (two per byte) and of its quantization constants (blocksize 64): with double quantization
# an 8-bit absmax per 64 weights plus an fp32 absmax per 256 of those; without, an fp32 absmax per 64 weights
# (Dettmers et al. 2023, "QLoRA", arXiv:2305.14314, section 3).
NF4_BYTES = 0.5
CONSTANT_BYTES = {True: 1 / 64 + 4 / (64 * 256), False: 4 / 64}
# Per token and vocabulary entry at the start of backward: the fp32 log-softmax output and its gradient in and out.
LOSS_BYTES_PER_LOGIT = 12
RMSNORM_BYTES = 4  # LlamaRMSNorm normalizes in fp32 and keeps that copy for backward
# DPO's reference forward (no_grad): per token and vocabulary entry, the fp32 logits and their fp32 log-softmax.
REFERENCE_BYTES_PER_LOGIT = 8
# GRPO's generation step: the last position's fp32 logits and the sampler's fp32 probabilities, per row and entry.
GENERATION_BYTES_PER_LOGIT = 8

# ------------------------------------------------------------------------------- fixed costs and margins
DEFAULT_OVERHEAD_GIB = 1.0  # per GPU: CUDA context, NCCL's buffers, allocator fragmentation
PROCESS_BASELINE_GIB = 1.5  # host RSS of a training process before any model: Python, torch, the CUDA libraries
# Above this share of the GPU a fit is called tight: published peaks (reserved memory) run up to ~15 % above the
# estimate (tests/test_plan.py's validations).
TIGHT = 0.9

# ------------------------------------------------------------------------------- what is asked, what is offered
METHODS = ("full", "lora", "qlora")  # from the heaviest to the lightest model state
LABELS = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}
MIXED_PRECISION = ("no", "bf16", "fp16")
# What the loss trains for: sft (recipes/llm_finetune.py, train_lm.py, pipeline_lm.py), dpo (recipes/dpo.py: a
# chosen and a rejected sequence per sample, against a frozen reference) or grpo (recipes/grpo.py: completions it
# generates, trained one sequence each; a KV cache while it generates).
OBJECTIVES = ("sft", "dpo", "grpo")
SEQUENCES_PER_SAMPLE = {"sft": 1, "dpo": 2, "grpo": 1}
# The table's order; generation_split: recipes/grpo.py --generation_mode split (one GPU generates, the others train).
SETUPS = ("single", "ddp", "fsdp", "fsdp_offload", "pipeline", "device_map", "generation_split")
# The recommendation's order: the first that fits wins (the fastest first; fits.py says why each stands where it does).
PREFERENCE = ("ddp", "fsdp", "generation_split", "pipeline", "single", "device_map", "fsdp_offload")
# The setups recipes/dpo.py trains: no pipeline, no device_map split; recipes/grpo.py also its generation split.
DPO_SETUPS = ("single", "ddp", "fsdp", "fsdp_offload")
GRPO_SETUPS = (*DPO_SETUPS, "generation_split")
# The accelerate config for each setup on two GPUs (accelerate_configs/).
CONFIGS = {
    "single": "single_gpu.yaml",
    "ddp": "ddp_2gpu.yaml",
    "fsdp": "fsdp_2gpu.yaml",
    "fsdp_offload": "fsdp_offload_2gpu.yaml",
    "pipeline": "pipeline_2gpu.yaml",
    "device_map": "model_sharding_2gpu.yaml",
    "generation_split": "ddp_2gpu.yaml",
}
