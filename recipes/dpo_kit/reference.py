"""The reference policy of DPO (``recipes/dpo.py``): its log-probs of the completions (``dpo_kit.loss``'s
``sequence_logps``), scored live (the same model with the adapter switched off, or a continued adapter's frozen copy:
``llm_kit.adapters.reference_policy``) or computed in one pass before training (a full fine-tune keeps one model),
and dropout switched off so that the policy starts as the reference (TRL's ``disable_dropout``)."""

from __future__ import annotations

import math

import torch

from llm_kit.adapters import reference_policy
from dpo_kit.loss import sequence_logps


def disable_dropout(model: torch.nn.Module) -> int:
    """Every dropout probability of ``model`` set to 0, LoRA's included, as TRL's ``disable_dropout`` (on by default)
    does to the policy and the reference: its ``nn.Dropout`` modules, and the float attributes that attention
    functions read in train mode (``attention_dropout`` of Llama, Qwen2, Mistral ..., which TRL's helper leaves on).
    Returns how many were above 0."""
    switched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            switched, module.p = switched + (module.p > 0), 0.0
        for name, value in list(vars(module).items()):
            if "drop" in name and isinstance(value, float):
                switched += value > 0
                setattr(module, name, 0.0)
    return switched


def reference_logps(accelerator, model, batch: dict, precomputed: torch.Tensor | None) -> torch.Tensor:
    """The reference's log-probs of the batch's rows: looked up by pair index when precomputed, else one forward
    without gradients through ``reference_policy`` (the prepared model, unwrapped from DDP: no gradient to sync)."""
    if precomputed is not None:
        return precomputed[batch["index"]].T.flatten()  # (pairs, 2) -> chosen rows, then rejected rows
    unwrapped = accelerator.unwrap_model(model)
    with torch.no_grad(), reference_policy(unwrapped):
        return sequence_logps(unwrapped, batch)


def precompute_reference(accelerator, model, dataloader) -> torch.Tensor:
    """The model's log-probs of every pair's chosen and rejected completion, ``(size, 2)`` on every process, by pair
    index: one pass before training (every process takes its share; ``gather_for_metrics`` drops repeats)."""
    model.eval()
    size = len(dataloader.dataset)
    table = torch.full((size, 2), math.nan, device=accelerator.device)
    for batch in dataloader:
        with torch.no_grad():
            chosen, rejected = sequence_logps(model, batch).chunk(2)
        index, chosen, rejected = accelerator.gather_for_metrics((batch["index"], chosen, rejected))
        table[index] = torch.stack([chosen, rejected], dim=1).float()
    accelerator.print(f"reference: the log-probs of {size} pairs computed before training (training holds one model)")
    return table
