"""The collectives of ``recipes/grpo.py`` that the split layout runs over the trainers' group alone (the generating
process takes no part): a gather, and a stop that any member's problem triggers."""

from __future__ import annotations

import torch

from shared.errors import RecipeError, stop_if_found


def gather(accelerator, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``accelerator.gather`` (every process's ``tensor``, concatenated), or over ``group`` alone (the split layout's
    trainers: the generating process takes no part). Every member passes the same shape."""
    if group is None:
        return accelerator.gather(tensor)
    pieces = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces)


def stop_if_any(accelerator, problem: str | None, group=None) -> None:
    """``shared.errors.stop_if_found`` (a paragraph found by any process stops every process, printed once), or over
    ``group`` alone: its members stop, and the generating process, waiting for them, is stopped with them by the
    launcher."""
    if group is None:
        return stop_if_found(problem)
    problems = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(problems, problem, group=group)
    found = next((found for found in problems if found), None)
    if found:
        raise RecipeError(found, printed=accelerator.is_main_process)
