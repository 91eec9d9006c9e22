"""The optimizer and learning-rate schedule of the LLM recipes (``llm_finetune.py``, ``dpo.py``, ``grpo.py``): AdamW
over the trained parameters (the adapter's, or every weight) and a ``transformers.get_scheduler`` schedule."""

from __future__ import annotations

import torch
from transformers import get_scheduler

from shared.accelerator import fused_adamw

# The flags ``adamw_and_scheduler`` takes, by the names the recipes' parsers give them.
OPTIMIZER_FLAGS = ("learning_rate", "weight_decay", "adam_epsilon", "lr_scheduler_type", "num_warmup_steps")


def adamw_and_scheduler(
    accelerator,
    model,
    max_train_steps: int,
    *,
    learning_rate: float,
    weight_decay: float,
    adam_epsilon: float,
    lr_scheduler_type: str,
    num_warmup_steps: int,
) -> tuple:
    """AdamW over ``model``'s trained parameters (fused where the device has it) and its schedule over
    ``max_train_steps``. The warm-up and training steps are multiplied by the processes: the prepared scheduler
    steps once per process per optimizer step."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=learning_rate,
        weight_decay=weight_decay,
        eps=adam_epsilon,
        fused=fused_adamw(accelerator),
    )
    processes = accelerator.num_processes
    lr_scheduler = get_scheduler(
        lr_scheduler_type, optimizer, num_warmup_steps * processes, max_train_steps * processes
    )
    return optimizer, lr_scheduler
