"""The LoRA adapter every recipe that fine-tunes with one adds: PEFT's ``get_peft_model``, with readable refusals."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.pytorch_utils import Conv1D

from .errors import RecipeError

# The flags that shape the adapter (lora_model's arguments), kept by a resume (``save_checkpoint``'s ``unchanged``).
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
# The layers PEFT's LoRA adapts (GPT-2's Conv1D too); a target names one by its whole name, or its end after a dot.
ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd, Conv1D, torch.nn.MultiheadAttention)


def lora_model(
    model: torch.nn.Module,
    name_or_path: str,
    *,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    lora_target_modules: list[str],
    task_type: str,
) -> torch.nn.Module:
    """``get_peft_model`` with a LoRA adapter; a local base named by its absolute path, to load from anywhere."""
    from peft import LoraConfig, get_peft_model

    targets = lora_target_modules[0] if lora_target_modules == ["all-linear"] else lora_target_modules  # PEFT's form
    adaptable = [(n, m) for n, m in model.named_modules() if isinstance(m, ADAPTABLE)]
    suffixes = {".".join(name.split(".")[i:]) for name, _ in adaptable for i in range(name.count(".") + 1)}
    unmatched = [] if targets == "all-linear" else [target for target in targets if target not in suffixes]
    if unmatched:  # PEFT would adapt the others without a word (q_proj on Phi-3, whose attention is one qkv_proj)
        linear = dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in adaptable if isinstance(m, torch.nn.Linear | Conv1D))
        raise RecipeError(
            f"--lora_target_modules {' '.join(lora_target_modules)}: no layer of the {type(model).__name__} that LoRA "
            f"adapts is named (or ends in) {', '.join(unmatched)}. Its linear layers are named {' '.join(linear)}: "
            "name those (e.g. the attention's), or use all-linear (every one but the output head)."
        )
    settings = dict(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets)
    model = get_peft_model(model, LoraConfig(**settings, task_type=task_type))
    if Path(name_or_path).is_dir():
        model.peft_config["default"].base_model_name_or_path = str(Path(name_or_path).resolve())
    return model
