"""The supervised fine-tuning loss (``recipes/llm_finetune.py``; ``recipes/dpo.py`` takes its sequence log-probs
from it): the next-token cross-entropy on the answer tokens only, with logits only where a loss is taken
(``scored_positions``, found by the collate function) and the softmax in fp32, a chunk at a time
(``fp32_cross_entropy``, checkpointed)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def scored_positions(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The positions whose next token is scored (an answer token: label != -100), for ``logits_to_keep``, and their
    targets: ``loss_positions`` (rows, K) and ``loss_targets`` (rows, K), K the most any row has; a shorter row is
    filled with position 0 and target -100 (ignored). Found here on the CPU, while the loader prepares the batch: on
    the GPU, finding them (``nonzero``, a boolean mask) would wait for the device in every step."""
    scored = labels[:, 1:] != -100  # position t predicts token t + 1
    count = max(int(scored.sum(dim=1).max()), 1) if labels.numel() else 1
    # A stable sort puts each row's scored positions first, in order; the rest are the fillers.
    order = torch.sort((~scored).to(torch.uint8), dim=1, stable=True).indices[:, :count]
    targets = labels[:, 1:].gather(1, order)  # -100 wherever the position is not scored
    return {"loss_positions": torch.where(targets != -100, order, 0), "loss_targets": targets}


def token_losses(model, batch: dict, chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss over the answer tokens of ``batch``, and per sample. Two savings, each equal to the plain
    loss (full logits, then cross-entropy), in losses and gradients. Used by
    ``recipes/llm_finetune.py`` and, for the sequence log-probs of preference pairs, ``recipes/dpo.py``:

    - logits only where a loss is taken: transformers' ``logits_to_keep`` with the answer positions the collate
      function found (``scored_positions``), so the LM head skips every prompt and padding position;
    - the cross-entropy in fp32, ``chunk_tokens`` positions at a time, each chunk recomputed in backward
      (checkpointed): the softmax that backward needs exists for one chunk at a time, not for the batch (with a 128k
      vocabulary, 4,096 answer tokens would hold 2 GiB of it). The logits themselves are fp32 under mixed precision
      (Accelerate converts a prepared model's outputs to fp32), bf16 or fp32 as the model computes them otherwise.

    A model split over devices (one process, Accelerate's hooks): the hidden states end on the LM head's device, so
    the positions go there, and ``shared.model_split.dispatch_on_devices`` has the hooks leave them where they are (the
    model's own hook would move them to the first device): the same answer logits, not every position's (with a 128k
    vocabulary, several GB of them, copied to the first device). A model that ignores ``logits_to_keep`` returns
    every position's logits (checked by the shape): the answers' are then picked from them. ``use_cache=False``: a
    cache would turn the packed mask off."""
    inputs = {
        key: value
        for key, value in batch.items()
        if key not in ("labels", "num_tokens", "loss_positions", "loss_targets")
    }
    positions = batch["loss_positions"]
    if getattr(model, "hf_device_map", None):  # placed by Accelerate's hooks: split, or 4-bit on one device
        head = model.get_output_embeddings()
        device = getattr(getattr(head, "_hf_hook", None), "execution_device", None)
        positions = positions.to(head.weight.device if device is None else device)
    logits = model(**inputs, use_cache=False, logits_to_keep=positions).logits
    if logits.shape[:2] != positions.shape:  # every position's logits (rows, length, vocabulary): pick the answers'
        logits = torch.take_along_dim(logits, positions.to(logits.device)[..., None], dim=1)
    targets = batch["loss_targets"].to(logits.device).flatten()
    logits = logits.flatten(0, 1)
    losses = torch.cat(
        [
            checkpoint(fp32_cross_entropy, chunk, target, use_reentrant=False)
            for chunk, target in zip(logits.split(chunk_tokens), targets.split(chunk_tokens))
        ]
    )
    losses = losses.view(positions.shape)
    return losses.sum(), losses.sum(dim=1)


def fp32_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position loss, in fp32 whatever the logits' dtype (bf16 rounding in the softmax would bias the loss)."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="none")
