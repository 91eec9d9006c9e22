"""The LoRA adapter every recipe that fine-tunes with one adds: PEFT's ``get_peft_model``, with readable refusals."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import RecipeError

# The flags that shape the adapter, named as lora_model's arguments; a resume keeps them (``save_checkpoint``'s
# ``unchanged``).
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


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
    settings = dict(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets)
    config = LoraConfig(**settings, task_type=task_type)
    try:
        model = get_peft_model(model, config)
    except ValueError as error:
        raise RecipeError(
            f"--lora_target_modules {' '.join(lora_target_modules)} matches no module of the model "
            f"({str(error).splitlines()[0][:200]}). Use 'all-linear' or names of the model's linear "
            "layers (such as q_proj v_proj, or query value)."
        ) from None
    if Path(name_or_path).is_dir():
        model.peft_config["default"].base_model_name_or_path = str(Path(name_or_path).resolve())
    return model
