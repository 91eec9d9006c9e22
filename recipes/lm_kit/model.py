"""The language model of ``recipes/train_lm.py`` and ``recipes/pipeline_lm.py``: its shape (a preset's or a pretrained
model's), checked against the run before any data work; the model itself, pretrained or new; its AdamW parameter
groups; a whole model from gathered weights."""

from __future__ import annotations

import torch
from accelerate.utils import set_seed
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from shared.errors import RecipeError
from shared.flags import model_problem

from shared.presets import MODEL_PRESETS


# The flags ``lm_config`` takes, by the names the recipes' parsers give them.
MODEL_FLAGS = ("model_name_or_path", "model_size", "num_layers", "vocab_size", "block_size")


def lm_config(
    *,
    num_stages: int,
    split_by: str,
    check=None,
    model_name_or_path: str | None,
    model_size: str,
    num_layers: int | None,
    vocab_size: int,
    block_size: int,
):
    """The model's configuration, from the recipe's flags: ``--model_name_or_path``'s, or the Llama-architecture preset
    ``--model_size`` (``MODEL_PRESETS``) with ``--num_layers`` blocks if given, an untied LM head (a split can then put
    the embeddings on the first part and the head on the last) and ``--vocab_size`` (``build_lm`` fits it to the
    trained tokenizer). Refuses, before any data work, a ``--block_size`` beyond the model's positions, what
    ``check(config)`` refuses if given (a recipe's own limits: pipeline_lm.py's decoders whose stages it can cut), and
    fewer blocks than the ``num_stages`` that ``split_by`` (the parallelism's name) cuts the model into."""
    if model_name_or_path:
        if problem := model_problem(model_name_or_path):  # a missing path, a folder without config.json
            raise RecipeError(problem)
        try:
            config = AutoConfig.from_pretrained(model_name_or_path)
        except (OSError, ValueError) as error:  # a Hub name offline or unknown, a config transformers cannot read
            raise RecipeError(f"Could not load --model_name_or_path {model_name_or_path!r}: {error}") from None
    else:
        preset = dict(MODEL_PRESETS[model_size])
        if num_layers:
            preset["num_hidden_layers"] = num_layers
        config = LlamaConfig(
            **preset,
            num_key_value_heads=preset["num_attention_heads"],
            vocab_size=vocab_size,
            tie_word_embeddings=False,
        )
    if block_size > config.max_position_embeddings:
        raise RecipeError(
            f"--block_size {block_size} is longer than the model's {config.max_position_embeddings} positions "
            f"(max_position_embeddings). Use --block_size {config.max_position_embeddings} or less."
        )
    if check is not None:
        check(config)
    if config.num_hidden_layers < num_stages:
        raise RecipeError(
            f"The model has {config.num_hidden_layers} decoder layers but {split_by} needs at least one per stage "
            f"({num_stages} stages). Use a model with more layers (--num_layers {num_stages} or more) or fewer "
            "stages."
        )
    return config


def build_lm(model_name_or_path: str | None, config, tokenizer, seed: int):
    """The causal LM: ``model_name_or_path``'s pretrained weights, or new ones of ``config`` fitted to the trained
    ``tokenizer``: the vocabulary it learned (smaller than ``--vocab_size`` on a small corpus), and its one special
    token as both bos and eos (never a pad id, which would freeze its embedding). Seeded with ``seed`` right before,
    whatever the data work drew: every process and every mode starts from the same weights."""
    set_seed(seed)
    if model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(model_name_or_path, config=config)
    config.update(
        {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id}
    )
    return AutoModelForCausalLM.from_config(config)


def whole_model(config, state_dict: dict):
    """A plain causal LM (on the CPU) holding ``state_dict``, the whole weights gathered from shards or stages: strict,
    every weight must be there. What the main process saves and samples from when no process holds the whole model."""
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state_dict, strict=True)
    return model


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (linear and embedding weights), none on norms/biases."""
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return [
        {"params": [parameter for parameter in parameters if parameter.ndim >= 2], "weight_decay": weight_decay},
        {"params": [parameter for parameter in parameters if parameter.ndim < 2], "weight_decay": 0.0},
    ]


def save_lm(model, state_dict: dict, tokenizer, folder) -> None:
    """``config.json``, ``model.safetensors`` (the weights of ``state_dict``) and the tokenizer, into ``folder``."""
    model.save_pretrained(folder, state_dict=state_dict)
    tokenizer.save_pretrained(folder)
