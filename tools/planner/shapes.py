"""What the planner knows of a model: its sizes and parameter counts, no weights.

A named size is arithmetic (``preset_shape``); a ``--model_name_or_path`` (a folder or a config.json) is read
(``read_config``) and built on the meta device (``shape_from_config``), so any architecture transformers knows counts
exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tools.planner.tables import DEFAULT_VOCAB_SIZE, HUB_CONFIGS, MODEL_SIZES


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
    # The attention kernel transformers runs the model with by default: eager where the model cannot run sdpa
    # (Gemma 2's soft-capping), which stores every head's score matrix.
    attention: str = "sdpa"

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
    """The shape of a named size (``shared/presets.py``, plus the Llama-2 / CodeLlama shapes of ``tables.py``)
    as transformers builds it: a ``LlamaConfig`` with untied LM head. Counted by arithmetic; the tests check it
    against ``numel()`` of the real model built on the meta device."""
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


# ------------------------------------------------------------------------------- any transformers model
def shape_from_config(config, name: str | None = None) -> ModelShape:
    """The shape of any transformers model from its config, counted exactly on the meta device.

    A causal LM when the config says so (``architectures``, or the model type when there are
    none), otherwise the base model (e.g. a BERT encoder: no LM head, no logits).
    """
    # The recipe's own count of a block's FLOPs and its own block finder, so that the split matches.
    from shared.model_split import _matmul_flops_per_token, find_block_list

    model, causal = _meta_model(config)
    block_list = find_block_list(model, set(getattr(model, "_no_split_modules", None) or []))
    blocks = model.get_submodule(block_list)
    before, after = _parameters_around(model, block_list)
    h = config.hidden_size
    f = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    heads = config.num_attention_heads
    linears = _linear_layers(blocks[0])
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
        attention="eager" if model.config._attn_implementation == "eager" else "sdpa",
    )


def _meta_model(config):
    """The model built from ``config`` on the meta device (shapes only, no memory), and whether it is a causal LM."""
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as transformers_logging

    architectures = getattr(config, "architectures", None) or []
    if architectures:
        causal = any(arch.endswith(("ForCausalLM", "LMHeadModel")) for arch in architectures)
    else:
        causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with init_empty_weights():
            model = (AutoModelForCausalLM if causal else AutoModel).from_config(config)
        # Built empty, a tied LM head gets a matrix of its own (a Gemma-2-9B counted 0.9B too large): tied again, as
        # from_pretrained ties it.
        model.tie_weights()
    finally:
        transformers_logging.set_verbosity(verbosity)
    return model, causal


def _parameters_around(model, block_list: str) -> tuple[int, int]:
    """Parameters before the blocks (embeddings) and after them (final norm, LM head, pooler)."""
    before = after = 0
    blocks_seen = False
    for parameter_name, parameter in model.named_parameters():  # tied weights are listed once
        if parameter_name.startswith(block_list + "."):
            blocks_seen = True
        elif blocks_seen:
            after += parameter.numel()
        else:
            before += parameter.numel()
    return before, after


def _linear_layers(block) -> list[tuple[str, int, int]]:
    """(name inside the block, in_features, out_features) of every linear layer of one block."""
    import torch

    linears = []
    for module_name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):
            linears.append((module_name, module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D":  # GPT-2's transposed Linear: weight (in, out)
            linears.append((module_name, *module.weight.shape))
    return linears


# ------------------------------------------------------------------------------- reading a config
def needed_fields() -> str:
    """What the planner needs of a config.json, in the words every refusal ends with."""
    return (
        "the planner needs a config.json with model_type (an architecture transformers knows, e.g. llama, mistral, "
        "qwen2, gpt2) and hidden_size, num_hidden_layers, num_attention_heads, vocab_size (and intermediate_size "
        "where the architecture has one)"
    )


def read_config(location: str):
    """A transformers config from a folder with config.json, a config.json file or a Hub id; ValueError with one
    line naming what is missing when the planner cannot use it."""
    path = _config_file(location)
    if path is None:  # a Hub id
        return _config_from_dict(location, HUB_CONFIGS[location]) if location in HUB_CONFIGS else _hub_config(location)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"--model_name_or_path {location}: {path.name} is not JSON ({error}); {needed_fields()}"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model_name_or_path {location}: {path.name} is not a JSON object; {needed_fields()}")
    return _config_from_dict(location, raw)


def _config_file(location: str) -> Path | None:
    """The config.json that ``location`` names (a folder holding one, or the file), None for a Hub id."""
    path = Path(location).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model_name_or_path {location}: no config.json in that folder")
        return path / "config.json"
    if not path.exists():
        local = path.is_absolute() or location.startswith((".", "~")) or location.endswith(".json")
        if local or location.count("/") > 1:
            raise ValueError(f"--model_name_or_path {location}: no such folder or file")
        return None
    return path


def _hub_config(location: str):
    """The config of a Hub id: from the local cache when the Hub cannot be reached (at once: transformers would retry
    for half a minute before failing), else downloaded."""
    from transformers import AutoConfig

    offline = not hub_reachable()
    try:
        return AutoConfig.from_pretrained(location, local_files_only=offline)
    except Exception as error:
        if offline:
            raise ValueError(
                f"--model_name_or_path {location}: not a local folder or file, and the Hugging Face Hub cannot be "
                "reached from this machine (offline, and not in the local cache). Pass the model's folder or its "
                "config.json instead (only the config is read)."
            ) from None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--model_name_or_path {location}: not a local model folder and not loadable ({first_line})"
        ) from None


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the Hub's host does not answer a TCP connection within ``timeout``."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _config_from_dict(location: str, raw: dict):
    """The config class of ``raw["model_type"]`` built from ``raw``, once every field the planner reads is there."""
    import inspect

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        what = f"model_type {model_type!r} is not an architecture" if model_type else "it has no model_type"
        raise ValueError(
            f"--model_name_or_path {location}: {what} transformers {transformers.__version__} knows; "
            + needed_fields()
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
            f"{needed_fields()}"
        )
    return config_class.from_dict(raw)
