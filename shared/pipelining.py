"""Pipeline parallelism for a transformers decoder with ``torch.distributed.pipelining``: what ``pipeline_lm.py``
needs around ``PipelineStage``. Each process builds the full model from the same seed, then keeps its stage (the
embeddings and its blocks on the first, its blocks plus norm and LM head on the last), running the model's own
``forward`` with other stages' blocks replaced by a pass-through: parameter names stay the full model's."""

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

# Decoders whose base model adds nothing to ``inputs_embeds`` (rotary positions, applied inside attention), so a stage
# can call the base model's forward with hidden states. GPT-2 adds position embeddings there, Gemma scales: not listed.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def ideal_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Share of each device's time idle in a GPipe/1F1B step: (p - 1) / (m + p - 1). With p stages and m equal
    micro-batches a step takes m + p - 1 slots, of which each stage works m; m = 1 is the naive split."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class PassThroughBlock(nn.Module):
    """Stands in for a decoder block another stage owns: returns the hidden states unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class DecoderStage(nn.Module):
    """One pipeline stage of a causal LM: token ids (first stage) or hidden states in; hidden states, or logits on the
    last stage, out. ``causal_lm`` keeps the full model's attribute names, so its ``state_dict()`` keys are those of
    ``AutoModelForCausalLM`` for the owned weights."""

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
        return (f"pipeline mode supports decoders of type {', '.join(PIPELINE_MODEL_TYPES)}, got {config.model_type!r} (its "
                "base model may change inputs_embeds, e.g. GPT-2 adds position embeddings there)")
    if config.tie_word_embeddings:
        return ("the model ties its LM head to its input embeddings, but those live on different stages; "
                "save it untied (config.tie_word_embeddings=False) or use ddp/device_map")
    return None


def build_stage_module(model: nn.Module, blocks: range, stage_index: int, num_stages: int) -> DecoderStage:
    """Turn the full ``model`` into stage ``stage_index``: keep ``blocks``, the embeddings on the first stage, the final
    norm and LM head on the last; drop the rest (freed once the caller moves the stage and the full model goes)."""
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
    """Sum of next-token cross-entropies (labels of -100 ignored) divided by ``divisor``: transformers' causal-LM loss
    (shift by one, float32 logits) as a sum, so the caller normalises: by the step's tokens in training (each micro-batch
    adds its share of the step's mean), by 1 in evaluation (sums add up)."""
    # Shift the labels, not the logits: slicing (batch, seq, vocab) logits would copy the step's largest tensor.
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum") / divisor


def clip_grad_norm_across_stages(parameters, max_norm: float, device: torch.device) -> torch.Tensor:
    """``clip_grad_norm_`` for a model split over stages: clipping each stage's slice by its own norm would scale the
    stages differently, so the global norm is the root of the all-reduced sum of every stage's squared norms."""
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
    """Every stage's weights, merged into one full-model state dict on rank ``destination`` (None elsewhere):
    ``gather_object``, so only the destination receives (an all-gather would put the model on every rank)."""
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
                          optimizer, lr_scheduler, blocks_per_stage: list[int], total_limit: int | None = None) -> Path:
    """``shared.checkpoints.save_checkpoint`` for pipeline stages (same folder, atomic rename, ``progress.json`` last),
    but every process writes its own ``stage_{i}/`` (weights, optimizer, scheduler, RNG state): ``save_state`` writes
    weights from the main process only, right for replicas, losing every other stage here. Every process calls it."""

    def write_stage(tmp: Path) -> None:
        folder = tmp / f"stage_{accelerator.process_index}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in stage.state_dict().items()}, folder / "model.safetensors")
        torch.save(optimizer.state_dict(), folder / "optimizer.bin")
        torch.save(lr_scheduler.state_dict(), folder / "scheduler.bin")
        torch.save({"torch": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})},
                   folder / "rng_state.pth")
        # Every process writes the split (the same bytes, atomically): with save_on_each_node each machine needs it.
        (folder / PIPELINE_FILE).write_text(json.dumps({"num_stages": len(blocks_per_stage), "blocks_per_stage": blocks_per_stage}))
        os.replace(folder / PIPELINE_FILE, tmp / PIPELINE_FILE)

    return save_checkpoint(accelerator, checkpoints_dir, completed_steps, total_limit, write_state=write_stage, layout="pipeline")


def pipeline_split_of(checkpoint: Path) -> list[int] | None:
    """Blocks per stage of a pipeline checkpoint, or None for a checkpoint written by ``save_state``."""
    path = Path(checkpoint) / PIPELINE_FILE
    return json.loads(path.read_text())["blocks_per_stage"] if path.is_file() else None


def load_stage_checkpoint(checkpoint: Path, stage_index: int, stage: DecoderStage, optimizer, lr_scheduler) -> None:
    """Inverse of ``save_stage_checkpoint`` for one stage, same split; tensors are read to the CPU and copied to
    wherever the stage's parameters are (``load_state_dict`` of modules and optimizers both do that)."""
    folder = Path(checkpoint) / f"stage_{stage_index}"
    stage.load_state_dict(load_file(folder / "model.safetensors"))
    optimizer.load_state_dict(torch.load(folder / "optimizer.bin", map_location="cpu", weights_only=True))
    lr_scheduler.load_state_dict(torch.load(folder / "scheduler.bin", weights_only=True))
    rng = torch.load(folder / "rng_state.pth", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
