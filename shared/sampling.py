"""Batches of similar length (``--group_by_length``): with dynamic padding, less compute spent on padding."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices


class LengthGroupedShuffledSampler(Sampler[int]):
    """Batch-aligned runs of indices of similar length (transformers' grouping), seeded by epoch: a resume agrees."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = get_length_grouped_indices(self.lengths, self.batch_size, 50, generator)  # 50 batches a mega-batch
        # Mega-batches hold whole batches, so only the last batch of all can be short.
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        full = [batch for batch in batches if len(batch) == self.batch_size]
        short = [batch for batch in batches if len(batch) < self.batch_size]
        full = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
        for batch in full + short:
            yield from batch
