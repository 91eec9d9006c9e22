"""The split layout of ``recipes/grpo.py`` (``--generation_mode split``): the last process only generates, the others
only train, data parallel among themselves. The trainers train on round k while the generating process makes round
k + 1 with the weights they sent after round k - 1: one round off-policy, corrected by the clipped ratio against the
log-probs the generating policy gave its own tokens (``Rollouts.logps``, as PPO, and TRL with
``num_iterations`` > 1, do). A step then takes the longer of generating and training instead of their sum.

Which process generates: the last. Accelerate's main process (rank 0) writes a checkpoint's model, optimizer and
scheduler files, results.json and the logs; here they are the trainers', so the main process is a trainer.

The process groups (made by every process, in the same order, as ``torch.distributed.new_group`` requires):
``trainers`` (ranks 0 .. N - 2: their DDP, when there are 2 or more of them, and the gathers of their rewards and
metrics; Accelerate's ``prepare`` would wrap the model over every process, and each all-reduce would wait for the
generating one, which never trains) and ``link`` (rank 0 and the generating process: the weights). A round goes to
every process of the default group (each trainer takes its share).

Every round, the same collectives in the same order on both sides::

    generating process:  make round k + 1 | stop? checkpoint? | receive the weights after round k | send round k + 1
    trainers:            train on round k | stop? checkpoint? | send the weights after round k    | receive round k + 1

(before the first round, in ``prepare``, the generating process receives the trainers' weights; it makes the first
round and sends it).
A checkpoint at the end of round k holds the trainers' state and, from the generating process, round k + 1, already
made with the weights after round k - 1 (``IN_FLIGHT``): the resumed generating process loads the trainers' weights
and sends that round first, so a resumed run trains on exactly what the uninterrupted one did. Another process count
is another number of trainers: the round is global and each trainer takes its share (``keep_global_batch`` keeps the
batch)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from shared.errors import RecipeError

from .rollout import Rollouts, sampling_noise

IN_FLIGHT = "round_in_flight.pt"  # in a checkpoint: the round the generating process made before it was saved
BUCKET_ELEMENTS = 2**26  # weights are sent in flat buffers of at most this many elements (256 MiB of fp32)


# The flags ``split_layout`` takes (what the generating process's rounds follow), by the recipe's names.
SPLIT_FLAGS = ("num_iterations", "num_generations", "seed")


def split_layout(
    accelerator,
    generation_mode: str,
    parallelism: str,
    num_iterations: int = 1,
    num_generations: int = 2,
    seed: int = 0,
) -> SplitLayout | None:
    """The split layout's process groups and roles (a collective: every process makes them), None for ``colocate``;
    refused in one process (nobody to split with) and under FSDP (the trainers replicate the model). The generating
    process makes ``num_generations`` completions of each prompt with the round's noise (from ``seed``), a round per
    ``num_iterations`` optimizer steps."""
    if generation_mode != "split":
        return None
    if accelerator.num_processes < 2 or parallelism != "ddp":
        raise RecipeError(
            f"--generation_mode split runs one process that only generates beside the processes that train, data "
            f"parallel among themselves, but this launch has {accelerator.num_processes} process(es) with "
            f"parallelism {parallelism}. Launch it with 2 or more processes and accelerate_configs/ddp_2gpu.yaml "
            "(on a CPU-only machine too: 2 gloo processes), or use --generation_mode colocate (the default), which "
            "also runs in one process and under FSDP."
        )
    return SplitLayout(accelerator, num_iterations, num_generations, seed)


class SplitLayout:
    """The roles, groups and transfers of the split layout. On the trainers it is their ``Generator``
    (``rollout.Generator``): ``generate`` receives their share of the round the generating process made, ``update``
    sends it the weights after a round. On the generating process, ``serve`` is its whole training loop."""

    def __init__(self, accelerator, num_iterations: int, num_generations: int, seed: int):
        self.num_iterations, self.num_generations, self.seed = num_iterations, num_generations, seed
        self.accelerator, world = accelerator, accelerator.num_processes
        self.rank, self.generator_rank = accelerator.process_index, world - 1
        self.generates = self.rank == self.generator_rank
        self.trainers = torch.distributed.new_group(list(range(world - 1)))
        self.link = torch.distributed.new_group([0, self.generator_rank])
        self.in_flight = None  # the generating process's next round, saved by a checkpoint at a round's end
        self.busy = self.idle = 0.0  # seconds, from the first round on
        self.clock = None  # a trainer's (``tick``)
        trainers = "rank 0 trains" if world == 2 else f"ranks 0-{world - 2} train, data parallel"
        accelerator.print(f"generation: split (rank {world - 1} generates every round, one ahead; {trainers})")

    # --------------------------------------------------------------------------- both sides
    def data_parallel(self, model):
        """The trainers' model in DDP over their own group when there are 2 or more of them; the generating
        process's, and a lone trainer's, as it is (nothing to average)."""
        if self.generates or self.generator_rank < 2:
            return model
        device = self.accelerator.device
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, process_group=self.trainers
        )

    def prepare(self, model, optimizer, lr_scheduler) -> tuple:
        """``accelerator.prepare`` for this layout: the model not in DDP over every process (each all-reduce would wait
        for the generating process, which never trains) but over the trainers' group (``data_parallel``), and the
        generating process given rank 0's weights (a new adapter's initialisation included)."""
        model = self.data_parallel(self.accelerator.prepare_model(model, evaluation_mode=True))
        self.send_weights(model)
        return (model, *self.accelerator.prepare(optimizer, lr_scheduler))

    def update(self, model) -> None:
        """After every round, on both sides (the trainers' ``Generator.update``): the weights the trainers trained go
        to the generating process (``send_weights``). A trainer counts it as idle time."""
        self.tick(busy=True)
        self.send_weights(model)
        self.tick(busy=False)

    def send_weights(self, model) -> None:
        """The trained weights (LoRA: the adapter alone; a full fine-tune: every weight) from rank 0 to the generating
        process, in flat buffers over ``link``; the other trainers take no part."""
        if self.rank not in (0, self.generator_rank):
            return
        params = [p for p in self.accelerator.unwrap_model(model).parameters() if p.requires_grad]
        with torch.no_grad():
            for bucket in buckets(params):
                flat = torch.cat([p.detach().reshape(-1) for p in bucket])
                torch.distributed.broadcast(flat, src=0, group=self.link)
                if self.generates:
                    for param, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                        param.copy_(piece.view_as(param))

    def save_state(self, folder: Path, write_state=None) -> None:
        """A checkpoint's files (``save_checkpoint(write_state=...)``): ``accelerator.save_state`` (the main process:
        the trainers' model, optimizer and scheduler; every process: its RNG states), and from the generating process
        the round it has made for after the checkpoint. ``write_state(folder)``, when given, replaces ``save_state``
        (LoRA: the adapter alone)."""
        (write_state or (lambda folder: self.accelerator.save_state(str(folder))))(folder)
        if self.in_flight is not None:
            torch.save(self.in_flight, Path(folder) / IN_FLIGHT)

    def times(self) -> dict:
        """Each role's busy and idle seconds over the training loop (a collective: the main process gets the
        generating process's)."""
        mine = {"role": "generator" if self.generates else "trainer", "busy": self.busy, "idle": self.idle}
        everyone = [None] * self.accelerator.num_processes
        torch.distributed.all_gather_object(everyone, mine)
        generator, trainer = everyone[self.generator_rank], everyone[0]
        return {
            "perf/generator_busy_s": generator["busy"],
            "perf/generator_idle_s": generator["idle"],
            "perf/trainer_busy_s": trainer["busy"],
            "perf/trainer_idle_s": trainer["idle"],
        }

    # --------------------------------------------------------------------------- the trainers
    def generate(self, prompt_ids: list[list[int]], noise: torch.Tensor) -> Rollouts:
        """This trainer's rows of the next round (``prompt_ids``: its share, rows ``rank x len(prompt_ids)`` on),
        received from the generating process with the log-probs its policy gave them. Waiting for it is idle time."""
        self.tick(busy=True)
        received = [None]
        torch.distributed.broadcast_object_list(received, src=self.generator_rank)
        made = received[0]
        rows = range(self.rank * len(prompt_ids), (self.rank + 1) * len(prompt_ids))
        if [made["prompt_ids"][row] for row in rows] != prompt_ids:  # the same rounds, in the same order
            raise RuntimeError(f"the generating process sent round {made['round']}, not this trainer's prompts")
        self.tick(busy=False)
        return Rollouts(
            [made["completion_ids"][row] for row in rows],
            [made["truncated"][row] for row in rows],
            [made["logps"][row] for row in rows],
        )

    def tick(self, busy: bool) -> None:
        """A trainer's clock: the time since its last tick is busy (training) or idle (waiting for a round, sending
        the weights). Its first tick starts it. The generating process counts its own (``serve``)."""
        now = time.perf_counter()
        if self.clock is not None and not self.generates:
            self.busy, self.idle = self.busy + (now - self.clock) * busy, self.idle + (now - self.clock) * (not busy)
        self.clock = now

    # --------------------------------------------------------------------------- the generating process
    def serve(
        self, generator, model, prompt_rounds, at_step_end, checkpoint: Path | None, resume, max_train_steps: int
    ) -> None:
        """The generating process's loop, round by round in step with the trainers' (the module's docstring):
        ``prompt_rounds`` are the rounds' prompts from the one ``resume`` (a ``ResumePoint``) reached on (every
        process reads the same), each prompt repeated ``num_generations`` times and sampled with the round's noise
        (``sampling_noise``), the whole global batch at once by ``generator`` (a ``PolicyGenerator`` that returns its
        log-probs); ``at_step_end(completed_steps)`` takes part in the trainers' stop and checkpoint at a round's end.
        Resumed from ``checkpoint``, the round it holds (``IN_FLIGHT``) is sent first."""
        num_iterations, num_generations, seed = self.num_iterations, self.num_generations, self.seed
        completed_steps = resume.completed_steps
        first_round, last_round = completed_steps // num_iterations, math.ceil(max_train_steps / num_iterations) - 1
        prompt_rounds, started = iter(prompt_rounds), time.perf_counter()
        if completed_steps >= max_train_steps:  # resumed from the checkpoint of the last step: no round left to make
            return
        saved, prompts = Path(checkpoint or "") / IN_FLIGHT, next(prompt_rounds)
        if checkpoint is not None and saved.is_file():  # what the uninterrupted run made for this round
            self.in_flight = torch.load(saved, weights_only=True)
        else:
            if checkpoint is not None:  # saved at its run's last step, where no next round was made
                print(
                    f"{checkpoint} holds no round in flight (its run ended there): round {first_round} is made now, "
                    "with the trained weights, so from here the run is not the one a longer uninterrupted run trains",
                    flush=True,
                )
            self.in_flight = self.make(generator, prompts, first_round, num_generations, seed)
        for round_index in range(first_round, last_round + 1):
            made, self.in_flight = self.in_flight, None
            torch.distributed.broadcast_object_list([made], src=self.generator_rank)
            if round_index < last_round:  # the next round, made while the trainers train on this one
                self.in_flight = self.make(generator, next(prompt_rounds), round_index + 1, num_generations, seed)
            at_step_end(min((round_index + 1) * num_iterations, max_train_steps))
            self.update(model)
        self.idle = time.perf_counter() - started - self.busy

    def make(self, generator, prompts: list[dict], round_index: int, num_generations: int, seed: int) -> dict:
        """One round: every prompt ``num_generations`` times, sampled with the round's noise, with the generating
        policy's log-probs."""
        started = time.perf_counter()
        prompt_ids = [row["prompt_ids"] for row in prompts for _ in range(num_generations)]
        noise = sampling_noise(seed, round_index, len(prompt_ids), generator.config.max_new_tokens)
        rollouts = generator.generate(prompt_ids, noise)
        self.busy += time.perf_counter() - started
        return {
            "round": round_index,
            "prompt_ids": prompt_ids,
            "completion_ids": rollouts.completion_ids,
            "truncated": rollouts.truncated,
            "logps": rollouts.logps,
        }


def buckets(params: list[torch.Tensor]):
    """``params`` in groups of one dtype and at most ``BUCKET_ELEMENTS`` elements (a larger one alone)."""
    for dtype in sorted({p.dtype for p in params}, key=str):
        bucket, size = [], 0
        for param in (p for p in params if p.dtype == dtype):
            if bucket and size + param.numel() > BUCKET_ELEMENTS:
                yield bucket
                bucket, size = [], 0
            bucket, size = bucket + [param], size + param.numel()
        if bucket:
            yield bucket
