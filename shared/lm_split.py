"""Splitting a decoder language model over devices or pipeline stages: the LM-specific parts.

The plan itself comes from ``shared/model_split.py`` (whole blocks, balanced by compute, embeddings
with the first part, everything after the blocks with the last). What a decoder LM adds:
- the cost of what follows the blocks: the LM head is a (hidden x vocabulary) matmul plus a softmax
  and cross-entropy over the vocabulary, often worth several blocks, so it must count;
- the plan as block counts per part, which pipeline stages use, so that the naive split and the
  pipeline cut the model in the same place;
- dispatching the naive split on real devices, the same code on two GPUs and on two CPU "devices".
"""

from __future__ import annotations

import torch
from accelerate import dispatch_model
from torch import nn

# Softmax + cross-entropy over the vocabulary, per token and vocabulary entry, in "FLOP
# equivalents" of the matmuls. Not a count: exp/log over a float32 row of vocab_size run far below
# matmul speed. Measured inside the pipeline on CPU (1 thread, fp32, small preset: hidden 256,
# vocabulary 8192, 256 tokens): the LM head + loss cost 3.1 decoder blocks, of which the head's
# matmul explains 2.3; see benchmarks/README.md. On GPUs the ratio of softmax to matmul speed is
# different again, so treat the split as a good first guess and check the stage timers.
LOSS_COST_PER_VOCAB_ENTRY = 180.0


def _matmul_flops_per_token(module: nn.Module) -> float:
    """Forward FLOPs per token of the matrix multiplies in ``module`` (2 per multiply-add)."""
    flops = 0.0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            flops += 2 * sub.in_features * sub.out_features
        elif type(sub).__name__ == "Conv1D":  # GPT-2's transposed Linear
            flops += 2 * sub.weight.numel()
    return flops


def lm_head_cost_in_blocks(model: nn.Module, block_list: str, sequence_length: int) -> float:
    """Estimated compute of the LM head and loss, in units of one decoder block.

    A block: its matmuls plus attention's two sequence-length products (QK^T and AV, 2 x seq x
    hidden FLOPs each, per token). The head: its matmul plus ``LOSS_COST_PER_VOCAB_ENTRY`` per
    vocabulary entry. Backward costs about twice the forward for both, so the ratio holds for a
    training step. The final norm and the embedding lookup are negligible.
    """
    block = _matmul_flops_per_token(model.get_submodule(f"{block_list}.0")) + 4 * sequence_length * model.config.hidden_size
    head = model.get_output_embeddings()
    vocab_size = head.weight.shape[0]
    return (2 * head.weight.numel() + LOSS_COST_PER_VOCAB_ENTRY * vocab_size) / block


def blocks_per_part(plan: dict[str, int], block_list: str) -> list[int]:
    """``{"model.layers.0": 0, ..., "model.layers.6": 1, ...}`` -> ``[5, 2]``: blocks each part runs."""
    parts = [part for name, part in plan.items() if name.startswith(block_list + ".") and name[len(block_list) + 1:].isdigit()]
    return [parts.count(part) for part in range(max(plan.values()) + 1)]


def block_ranges(counts: list[int]) -> list[range]:
    """``[5, 2]`` -> ``[range(0, 5), range(5, 7)]``: the block indices each part owns."""
    starts = [sum(counts[:part]) for part in range(len(counts))]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def split_devices(device: torch.device) -> list[torch.device]:
    """The devices a one-process split uses: every visible GPU when there are two or more, otherwise
    the one device twice (two CPU "devices", or one GPU), so the same split-and-move code runs and
    can be tested anywhere; it is just not faster there."""
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    return [device, device]


def dispatch_on_devices(model: nn.Module, plan: dict[str, int], devices: list[torch.device]) -> tuple[nn.Module, dict]:
    """Move each planned module to its device and attach Accelerate's hooks that move activations.

    The device_map holds ``torch.device`` objects, not strings: Accelerate reads the *strings*
    ``"cpu"``/``"disk"`` as offload targets (and warns about parameters on the meta device), while
    ``torch.device("cpu")`` is an execution device, which is what a CPU "device" is here.
    ``force_hooks`` attaches the hooks even when every entry is the same device (a CPU-only
    machine), so the tested path is the GPU path. ``hf_device_map`` is what transformers sets for
    ``from_pretrained(device_map=...)``: ``accelerator.prepare`` reads it to leave the placement
    alone (without it, prepare would move the whole model to the first GPU) and to refuse a
    distributed mode.
    """
    device_map = {name: devices[part] for name, part in plan.items()}
    model = dispatch_model(model, device_map=device_map, force_hooks=True)
    model.hf_device_map = dict(device_map)
    return model, device_map
