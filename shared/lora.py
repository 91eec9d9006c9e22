"""The LoRA adapter every recipe that fine-tunes with one adds: PEFT's ``get_peft_model``, with readable refusals."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import RecipeError


def lora_model(
    model: torch.nn.Module,
    name_or_path: str,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    task_type: str,
) -> torch.nn.Module:
    """``get_peft_model`` with a LoRA adapter; a local base named by its absolute path, to load from anywhere."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules[0] if target_modules == ["all-linear"] else target_modules  # PEFT's one-word form
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type)
    try:
        model = get_peft_model(model, config)
    except ValueError as error:
        raise RecipeError(
            f"--lora_target_modules {' '.join(target_modules)} matches no module of the model "
            f"({str(error).splitlines()[0][:200]}). Use 'all-linear' or names of the model's linear "
            "layers (such as q_proj v_proj, or query value)."
        ) from None
    if Path(name_or_path).is_dir():
        model.peft_config["default"].base_model_name_or_path = str(Path(name_or_path).resolve())
    return model
