"""Batches of similar length (``--group_by_length``), shuffled as whole batches: with dynamic padding every batch is
padded to its longest sample, so a 10-token and a 400-token text in one batch waste most of the compute on padding."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler


class LengthGroupedShuffledSampler(Sampler[int]):
    """Yields indices in batch-aligned runs of similar length (``batch_size`` equal to the DataLoader's; under DDP
    Accelerate hands whole batches to processes, so they stay similar). Per epoch (seed + epoch: every process and a
    resumed run agree; Accelerate's loader calls ``set_epoch``): shuffle, cut into mega-batches of
    ``mega_batch_batches`` batches, sort each by length, cut into batches, shuffle the batches, the short one last."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, mega_batch_batches: int = 50):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0
        self.mega_batch_size = batch_size * mega_batch_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        batches = []
        for start in range(0, len(order), self.mega_batch_size):
            mega_batch = sorted(order[start:start + self.mega_batch_size], key=lambda i: -self.lengths[i])
            batches += [mega_batch[i:i + self.batch_size] for i in range(0, len(mega_batch), self.batch_size)]
        full = [batch for batch in batches if len(batch) == self.batch_size]
        short = [batch for batch in batches if len(batch) < self.batch_size]
        full = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
        for batch in full + short:
            yield from batch
