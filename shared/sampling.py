"""Batches of similar length (``--group_by_length``), shuffled as whole batches.

With dynamic padding every batch is padded to its longest sample, so mixing a 10-token and a
400-token docstring in one batch wastes most of the compute on padding. This sampler orders indices
so that each run of ``batch_size`` consecutive indices has similar lengths, and shuffles the order of
those batches every epoch.
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler


class LengthGroupedShuffledSampler(Sampler[int]):
    """Yields indices in batch-aligned runs of similar length; use it with ``batch_size`` equal to the
    DataLoader's. Under DDP, Accelerate hands whole batches to processes, so each process's batches
    keep their similar lengths.

    Per epoch (seeded by ``seed + epoch``, so every process and a resumed run agree): shuffle all
    indices, cut them into mega-batches of ``mega_batch_batches`` batches, sort each mega-batch by
    length (randomness stays in which samples share a batch), cut into batches, shuffle the batches,
    and keep the one short batch, if any, last so the DataLoader's chunking stays aligned.
    ``set_epoch`` is called by Accelerate's prepared DataLoader.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, mega_batch_batches: int = 50):
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.mega_batch_size = batch_size * mega_batch_batches
        self.epoch = 0

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
