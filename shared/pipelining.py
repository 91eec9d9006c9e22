"""Pipeline parallelism for a transformers decoder with ``torch.distributed.pipelining``: the pieces
the recipe needs around ``PipelineStage`` and the schedules.

Each process builds the full model from the same seed (so weights equal a 1-process run's), then
keeps only its stage: the embeddings and its blocks on the first stage, its blocks plus the final
norm and LM head on the last. The stage runs the model's own transformers ``forward`` (masks,
rotary position tables), with the blocks it does not own replaced by a pass-through, so parameter
names stay those of the full model and the stages' state dicts merge back into one checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .checkpoints import save_checkpoint

# Decoders whose base model adds nothing to ``inputs_embeds`` (positions are rotary, applied inside
# attention), so a stage that receives hidden states can call the base model's forward with them.
# GPT-2 adds position embeddings there and Gemma scales by sqrt(hidden): not safe, so not listed.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def ideal_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Share of each device's time spent idle in a GPipe/1F1B step: (p - 1) / (m + p - 1).

    With p stages and m equal micro-batches the step takes m + p - 1 slots, of which each stage
    works m. m = 1 is the naive split (p - 1) / p: one device works, the others wait.
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class PassThroughBlock(nn.Module):
    """Stands in for a decoder block another stage owns: returns the hidden states unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class DecoderStage(nn.Module):
    """One pipeline stage of a causal LM. Input: token ids (first stage) or hidden states. Output:
    hidden states, or logits on the last stage.

    Built by ``build_stage_module``; ``causal_lm`` keeps the full model's attribute names, so
    ``causal_lm.state_dict()`` keys are those of ``AutoModelForCausalLM`` for the owned weights.
    """

    def __init__(self, causal_lm: nn.Module, is_first: bool, is_last: bool):
        super().__init__()
        self.causal_lm = causal_lm
        self.is_first = is_first
        self.is_last = is_last

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        base = self.causal_lm.base_model
        if self.is_first:
            hidden = base(input_ids=inputs, use_cache=False).last_hidden_state
        else:
            hidden = base(inputs_embeds=inputs, use_cache=False).last_hidden_state
        return self.causal_lm.lm_head(hidden) if self.is_last else hidden


def check_pipeline_model(config) -> str | None:
    """Why a model with this transformers ``config`` cannot be split by ``build_stage_module``, or None."""
    if config.model_type not in PIPELINE_MODEL_TYPES:
        return (f"pipeline mode supports decoders of type {', '.join(PIPELINE_MODEL_TYPES)}, got {config.model_type!r} "
                "(its base model may change inputs_embeds, e.g. GPT-2 adds position embeddings there)")
    if config.tie_word_embeddings:
        return ("the model ties its LM head to its input embeddings, but those live on different stages; "
                "save it untied (config.tie_word_embeddings=False) or use ddp/device_map")
    return None


def build_stage_module(model: nn.Module, blocks: range, stage_index: int, num_stages: int) -> DecoderStage:
    """Turn the full ``model`` into stage ``stage_index``: keep ``blocks``, and the embeddings on the
    first stage, the final norm and LM head on the last; drop the rest (memory is freed once the
    caller moves the stage to its device and the full model goes out of scope)."""
    base = model.base_model
    for index in range(len(base.layers)):
        if index not in blocks:
            base.layers[index] = PassThroughBlock()
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    if not is_first:
        base.embed_tokens = None  # never called: later stages pass inputs_embeds
    if not is_last:
        base.norm = nn.Identity()  # the final norm belongs to the last stage
        model.lm_head = None
    return DecoderStage(model, is_first=is_first, is_last=is_last)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """Sum of next-token cross-entropies (labels of -100 ignored) divided by ``divisor``.

    The same loss as transformers' causal LMs (shift by one, float32 logits), written as a sum so
    the caller chooses the normalisation: tokens x micro-batches x accumulation steps in training
    (each micro-batch contributes its share of the step's mean), 1 in evaluation (sums add up).
    """
    # Shift the labels, not the logits: slicing (batch, seq, vocab) logits would copy the largest
    # tensor of the step; the last position gets label -100 instead.
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum") / divisor


def clip_grad_norm_across_stages(parameters, max_norm: float, device: torch.device) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model split over pipeline stages.

    Each stage holds a slice of the gradients; clipping each slice by its own norm would scale the
    stages differently. The global norm is the square root of the all-reduced sum of every stage's
    squared norms; every stage then scales by the same factor.
    """
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for grad in grads:
        squares += torch.linalg.vector_norm(grad.detach(), dtype=torch.float32) ** 2
    dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    total_norm = squares.sqrt()
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.detach().mul_(scale.to(grad.dtype))
    return total_norm


def gather_full_state_dict(stage: DecoderStage, destination: int = 0) -> dict[str, torch.Tensor] | None:
    """Every stage's weights, merged into one full-model state dict on rank ``destination`` (None elsewhere).

    Uses ``torch.distributed.gather_object`` (only the destination receives) rather than an
    all-gather, which would put a full copy of the model on every rank.
    """
    local = {name: tensor.detach().cpu() for name, tensor in stage.causal_lm.state_dict().items()}
    parts = [None] * dist.get_world_size() if dist.get_rank() == destination else None
    dist.gather_object(local, parts, dst=destination)
    if parts is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        overlap = merged.keys() & part.keys()
        if overlap:
            raise RuntimeError(f"two stages both hold {sorted(overlap)[:3]}")
        merged.update(part)
    return merged


PIPELINE_FILE = "pipeline.json"


def save_stage_checkpoint(accelerator, checkpoints_dir: str | os.PathLike, completed_steps: int, stage: DecoderStage,
                          optimizer, lr_scheduler, blocks_per_stage: list[int]) -> Path:
    """``shared.checkpoints.save_checkpoint`` for pipeline stages: same folder
    (``checkpoints_dir/step_{completed_steps:06d}``), same atomic temporary-folder-then-rename, same
    ``progress.json`` written last; but every process writes its own ``stage_{i}/`` (weights,
    optimizer, scheduler, RNG state), because ``accelerator.save_state`` writes the weights from
    the main process only, which is right for replicas and loses every other stage here. Every
    process must call it.
    """

    def write_stage(tmp: Path) -> None:
        folder = tmp / f"stage_{accelerator.process_index}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in stage.state_dict().items()}, folder / "model.safetensors")
        torch.save(optimizer.state_dict(), folder / "optimizer.bin")
        torch.save(lr_scheduler.state_dict(), folder / "scheduler.bin")
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, folder / "rng_state.pth")
        if accelerator.is_main_process:
            (tmp / PIPELINE_FILE).write_text(json.dumps({"num_stages": len(blocks_per_stage), "blocks_per_stage": blocks_per_stage}) + "\n")

    return save_checkpoint(accelerator, checkpoints_dir, completed_steps, write_state=write_stage)


def pipeline_split_of(checkpoint: Path) -> list[int] | None:
    """Blocks per stage of a pipeline checkpoint, or None for a checkpoint written by ``save_state``."""
    path = Path(checkpoint) / PIPELINE_FILE
    return json.loads(path.read_text())["blocks_per_stage"] if path.is_file() else None


def load_stage_checkpoint(checkpoint: Path, stage_index: int, stage: DecoderStage, optimizer, lr_scheduler) -> None:
    """Inverse of ``save_stage_checkpoint`` for one stage, with the same split. Tensors are read to
    the CPU and copied to wherever the stage's parameters are (``load_state_dict`` of modules and
    optimizers both do that)."""
    folder = Path(checkpoint) / f"stage_{stage_index}"
    stage.load_state_dict(load_file(folder / "model.safetensors"))
    optimizer.load_state_dict(torch.load(folder / "optimizer.bin", map_location="cpu", weights_only=True))
    lr_scheduler.load_state_dict(torch.load(folder / "scheduler.bin", weights_only=True))
    rng = torch.load(folder / "rng_state.pth", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
