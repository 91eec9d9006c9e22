"""Pipeline parallelism for ``recipes/pipeline_lm.py``: the pieces around ``torch.distributed.pipelining`` that are
not the training story. Which stages each process holds, the stage modules cut from one full model, the schedules
(with a ZB-V evaluation fix), the one gradient-norm clip over all stages, checkpoints in which every stage saves its
own part, the gather of every stage's weights into one model, evaluation through the pipeline, and the facts
results.json records (the ideal bubble).

Each process builds the full model from the same seed (weights equal a 1-process run's), then keeps its stages: each
its blocks, plus the embeddings on the first stage and the final norm and LM head on the last. A stage runs the
model's own forward (masks, rotary tables) with the other stages' blocks replaced by a pass-through, so parameter
names stay the full model's and the stages' state dicts merge back into one checkpoint."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import BACKWARD_INPUT
from transformers.loss.loss_utils import ForCausalLMLoss

from shared.errors import RecipeError

from lm_kit.eval import perplexity_results
from lm_kit.split import block_ranges

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
# The schedules that run several stages per process, and how they lay the stages out over the processes: in a loop
# (process r: stages r, r + p, r + 2p, ...) or in a V (process r: stages r and 2p - 1 - r).
STAGE_LAYOUTS = {"interleaved1f1b": "loop", "zbv": "v"}
# Decoders whose base model adds nothing to ``inputs_embeds`` (rotary positions, applied inside attention), so a stage
# can call the base model's forward with hidden states. GPT-2 adds position embeddings there, Gemma scales: not listed.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PIPELINE_FILE = "pipeline.json"


# ----------------------------------------------------------------------------- what runs where
def check_pipeline_request(
    *,
    pipeline_schedule: str,
    num_microbatches: int,
    stages_per_process: int | None,
    per_device_train_batch_size: int,
    eval_batch_size: int,
    num_processes: int,
    mixed_precision: str,
) -> int:
    """Refuse pipeline settings (the recipe's flags of those names) that cannot work, before any data or model work;
    return the stages per process."""
    microbatches, schedule = num_microbatches, pipeline_schedule
    for flag, size in (
        ("--per_device_train_batch_size", per_device_train_batch_size),
        ("--per_device_eval_batch_size", eval_batch_size),
    ):
        if size % microbatches:
            raise RecipeError(
                f"{flag} {size} does not divide into --num_microbatches {microbatches}: every micro-batch must have "
                f"the same shape (pipeline stages exchange fixed-size buffers). Use a batch size that is a multiple "
                f"of {microbatches}, e.g. {microbatches * max(1, round(size / microbatches))}."
            )
    if mixed_precision == "fp16":
        raise RecipeError(
            "fp16 needs a gradient scaler shared by all stages, which this recipe does not set up; "
            "use --mixed_precision bf16."
        )
    if schedule == "1f1b" and microbatches < num_processes:
        raise RecipeError(
            f"--pipeline_schedule 1f1b needs --num_microbatches >= the number of stages "
            f"({num_processes}); got {microbatches}."
        )
    if schedule not in STAGE_LAYOUTS:
        if stages_per_process not in (None, 1):
            raise RecipeError(
                f"--pipeline_schedule {schedule} runs one stage per process, but --stages_per_process is "
                f"{stages_per_process}: use --pipeline_schedule interleaved1f1b (or zbv, 2 stages) for several."
            )
        return 1
    stages_per_process = stages_per_process or 2
    if schedule == "interleaved1f1b" and microbatches < num_processes:
        # torch runs it, but each micro-batch then travels the p x v stages mostly alone: no 1F1B steady state, and
        # not the bubble the interleaved schedule is for (Narayanan et al. assume m a multiple of p).
        raise RecipeError(
            f"--pipeline_schedule interleaved1f1b needs --num_microbatches >= the number of processes "
            f"({num_processes}); got {microbatches}: with fewer, every process waits for each micro-batch to come "
            "round its stages again."
        )
    if schedule == "interleaved1f1b" and microbatches % max(1, microbatches // num_processes):
        # torch's ScheduleInterleaved1F1B runs the micro-batches in rounds of about one per process
        # (rounds = max(1, m // p)) and needs whole rounds (torch/distributed/pipelining/schedules.py).
        rounds = max(1, microbatches // num_processes)
        raise RecipeError(
            f"--pipeline_schedule interleaved1f1b runs the micro-batches in max(1, m // processes) = {rounds} rounds "
            f"of equal size, and --num_microbatches {microbatches} does not divide into {rounds}. Use a multiple of "
            f"the {num_processes} processes, e.g. --num_microbatches {num_processes * rounds}."
        )
    if schedule == "zbv" and stages_per_process != 2:
        raise RecipeError(
            f"--pipeline_schedule zbv holds exactly 2 stages per process (down the V and back up), but "
            f"--stages_per_process is {stages_per_process}: leave it out, or use interleaved1f1b."
        )
    if schedule == "zbv" and microbatches < 2 * num_processes - 1:
        raise RecipeError(
            f"--pipeline_schedule zbv needs --num_microbatches >= 2 x processes - 1 = {2 * num_processes - 1}, got "
            f"{microbatches}: with fewer it is no zero-bubble schedule (torch's ScheduleZBVZeroBubble builds the V "
            "for 2p - 1 micro-batches and leaves the missing ones' slots idle). Use more micro-batches, or 1f1b."
        )
    return stages_per_process


def stages_of_process(rank: int, num_processes: int, stages_per_process: int, layout: str = "loop") -> list[int]:
    """The pipeline stages process ``rank`` holds, first to last. ``loop``: r, r + p, r + 2p, ... (one stage per
    process: just r); ``v``: down the processes and back up, r, 2p - 1 - r, 2p + r, ... The same mappings as torch's
    schedules (``generate_stage_to_rank_mapping`` in torch/distributed/pipelining/_utils.py). Either way a process's
    first stage is stage r."""
    p = num_processes
    if layout == "v":
        return [k * p + (rank if k % 2 == 0 else p - 1 - rank) for k in range(stages_per_process)]
    return [k * p + rank for k in range(stages_per_process)]


def stage_layout(schedule: str, num_processes: int, stages_per_process: int) -> list[list[int]]:
    """The stages of every process, as ``schedule`` lays them out: ``[[0], [1]]``, ``[[0, 2], [1, 3]]`` (loop),
    ``[[0, 3], [1, 2]]`` (V)."""
    layout = STAGE_LAYOUTS.get(schedule, "loop")
    return [stages_of_process(rank, num_processes, stages_per_process, layout) for rank in range(num_processes)]


def check_pipeline_model(stages_of_processes: list[list[int]], config) -> None:
    """Refuse a model (its transformers ``config``) that ``build_stage_modules`` cannot cut into the stages of
    ``stages_of_processes``, before any data work."""
    num_processes, stages_per_process = len(stages_of_processes), len(stages_of_processes[0])
    num_stages = num_processes * stages_per_process
    problem = None
    if config.model_type not in PIPELINE_MODEL_TYPES:
        problem = (
            f"pipeline mode supports decoders of type {', '.join(PIPELINE_MODEL_TYPES)}, got "
            f"{config.model_type!r} (its base model may change inputs_embeds, e.g. GPT-2 adds position "
            "embeddings there)"
        )
    elif config.tie_word_embeddings:
        problem = (
            "the model ties its LM head to its input embeddings, but those live on different stages; save it "
            "untied (config.tie_word_embeddings=False) or use ddp/device_map"
        )
    elif stages_per_process > 1 and config.num_hidden_layers < num_stages:
        problem = (
            f"the model has {config.num_hidden_layers} decoder blocks, fewer than the {num_stages} stages of "
            f"{num_processes} processes x --stages_per_process {stages_per_process}, and every stage needs "
            f"at least one whole block. Use --num_layers {num_stages} or more, or a smaller "
            "--stages_per_process"
        )
    if problem:
        raise RecipeError(f"Cannot split this model into pipeline stages: {problem}.")


def ideal_bubble_slots(schedule: str, num_processes: int, stages_per_process: int) -> float:
    """Idle time of each device in one step, in units of one micro-batch's forward + backward through that device's
    share of the model, with balanced stages, free communication and m >= p. A step then takes m + bubble units, of
    which each device works m. gpipe, 1f1b: p - 1 (warm-up and cool-down; m = 1 is the naive split). interleaved1f1b:
    (p - 1) / v, the warm-up runs chunks 1/v as long (Narayanan et al. 2021, arXiv:2104.04473, section 2.2: bubble time
    fraction (p - 1) / (v m) of the ideal time). zbv: 0, the ideal ZB-V is built for: forward, input gradient and
    weight gradient of a stage take equal time and m >= 2p - 1 (Qi et al. 2024, arXiv:2401.10241, section 6)."""
    if schedule == "zbv":
        return 0.0
    return (num_processes - 1) / stages_per_process


def pipeline_facts(
    schedule: str, microbatches: int, stages_of_processes: list[list[int]], stage_costs: list[float]
) -> dict:
    """What results.json records about the pipeline (benchmarks/studies/pipeline_vs_naive.py reads it)."""
    bubble = ideal_bubble_slots(schedule, len(stages_of_processes), len(stages_of_processes[0]))
    return {
        "pipeline_schedule": schedule,
        "num_microbatches": microbatches,
        "stages_per_process": len(stages_of_processes[0]),
        "pipeline/stages_of_processes": stages_of_processes,
        # Estimated compute of each process: the sum over its stages (a multi-stage schedule runs as fast as its
        # busiest process).
        "pipeline/process_cost_share": [
            sum(stage_costs[index] for index in indices) / sum(stage_costs) for indices in stages_of_processes
        ],
        # The share of each device's step time the schedule leaves idle with balanced stages, b / (m + b) for b idle
        # slots (ideal_bubble_slots): gpipe and 1f1b (p-1)/(m+p-1), interleaved1f1b (p-1)/(v*m+p-1), zbv 0.
        "pipeline/ideal_bubble_fraction": bubble / (microbatches + bubble),
        # The same bubble relative to the ideal compute time, b / m: Narayanan et al.'s (p-1)/(v*m).
        "pipeline/ideal_bubble_over_compute": bubble / microbatches,
    }


# ----------------------------------------------------------------------------- the stages and their schedules
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
        self.causal_lm, self.is_first, self.is_last = causal_lm, is_first, is_last

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        base = self.causal_lm.base_model
        if self.is_first:
            hidden = base(input_ids=inputs, use_cache=False).last_hidden_state
        else:
            hidden = base(inputs_embeds=inputs, use_cache=False).last_hidden_state
        return self.causal_lm.lm_head(hidden) if self.is_last else hidden


def build_stage_module(model: nn.Module, blocks: range, stage_index: int, num_stages: int) -> DecoderStage:
    """Stage ``stage_index`` of the full ``model``: ``blocks``, the embeddings on the first stage, the final norm and
    LM head on the last. Nothing is copied and ``model`` is left whole: the stage is a shallow copy of the causal LM
    and of its base model (same submodules, same forward) whose own module tables hold a pass-through for every other
    block, so one process can cut several stages from one model; the parts no stage keeps are freed with the full
    model."""
    causal_lm, base = copy.copy(model), copy.copy(model.base_model)
    # copy.copy shares the module tables too: give each shell its own before changing an entry.
    causal_lm._modules, base._modules = dict(model._modules), dict(model.base_model._modules)
    setattr(causal_lm, model.base_model_prefix, base)
    base.layers = nn.ModuleList(
        block if index in blocks else PassThroughBlock() for index, block in enumerate(model.base_model.layers)
    )
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    if not is_first:
        base.embed_tokens = None  # never called: later stages pass inputs_embeds
    if not is_last:
        base.norm = nn.Identity()  # the final norm belongs to the last stage
        causal_lm.lm_head = None
    return DecoderStage(causal_lm, is_first=is_first, is_last=is_last)


def build_stage_modules(model: nn.Module, blocks_per_stage: list[int], stage_indices: list[int]) -> nn.ModuleList:
    """This process's stages of the full ``model``, one module each, as one ``ModuleList`` (``train()``,
    ``parameters()`` and the optimizer cover them all)."""
    ranges = block_ranges(blocks_per_stage)
    return nn.ModuleList(build_stage_module(model, ranges[index], index, len(ranges)) for index in stage_indices)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """transformers' own causal-LM loss (``ForCausalLMLoss``: float32 logits, the labels shifted by one, -100
    ignored) as a sum divided by ``divisor``, so the caller normalises: by the step's tokens in training (each
    micro-batch adds its share of the step's mean), by 1 in evaluation (sums add up)."""
    return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=divisor)


@dataclass
class Pipeline:
    """This process's side of the pipeline: the training schedule over its stages, the schedule evaluation runs forward
    only (the same one, except under zbv: see ``zbv_eval_schedule``), whether it holds the first stage (it feeds the
    tokens) and the last (it computes the loss), and the loss divisor of one micro-batch."""

    name: str
    microbatches: int
    autocast: object  # accelerator.autocast: the stages compute in the run's mixed precision
    schedule: object
    eval_schedule: object
    stage_modules: nn.ModuleList
    holds_first: bool
    holds_last: bool
    divisor: float

    def step(self, input_ids: torch.Tensor) -> torch.Tensor | float:
        """One ``schedule.step``: every micro-batch of ``input_ids`` through every stage, forward and backward, in the
        schedule's order. Returns the sum of the micro-batch losses on the process with the last stage (each is its
        summed token losses over ``divisor``, the predicted tokens of the whole optimizer step, so they add up to the
        step's mean loss, as accelerator.backward's 1/accumulation does), 0 elsewhere."""
        losses = []
        with self.autocast():
            self.schedule.step(
                *((input_ids,) if self.holds_first else ()),
                target=input_ids if self.holds_last else None,
                losses=losses if self.holds_last else None,
                loss_kwargs={"divisor": self.divisor},
            )
        return torch.stack(losses).sum().detach().float() if self.holds_last else 0.0

    def facts(self, stages_of_processes: list[list[int]], stage_costs: list[float]) -> dict:
        """What results.json records about the pipeline (``pipeline_facts``)."""
        return pipeline_facts(self.name, self.microbatches, stages_of_processes, stage_costs)


# The flags ``build_pipeline`` takes, by the names the recipe's parser gives them.
PIPELINE_FLAGS = (
    "pipeline_schedule",
    "num_microbatches",
    "per_device_train_batch_size",
    "block_size",
    "gradient_accumulation_steps",
)


def build_pipeline(
    accelerator,
    stage_modules: nn.ModuleList,
    stages_of_processes: list[list[int]],
    *,
    pipeline_schedule: str,
    num_microbatches: int,
    per_device_train_batch_size: int,
    block_size: int,
    gradient_accumulation_steps: int,
) -> Pipeline:
    """The schedules of ``--pipeline_schedule`` over ``--num_microbatches`` for this process's ``stage_modules``, and
    the ideal bubble, printed. The stages' input/output shapes are inferred on the first step, and gradients are
    scaled by the loss rather than by the schedule: ``scale_grads=True`` would divide *all* accumulated gradients by m
    after every ``step()``, so with gradient accumulation the earlier batches would be divided again."""
    name, microbatches, device = pipeline_schedule, num_microbatches, accelerator.device
    stage_indices = stages_of_processes[accelerator.process_index]
    num_stages = sum(len(indices) for indices in stages_of_processes)
    stages = [
        PipelineStage(module, stage_index=index, num_stages=num_stages, device=device)
        for index, module in zip(stage_indices, stage_modules)
    ]
    # gpipe and 1f1b take the process's one stage, the other schedules the list of its stages.
    schedule = SCHEDULES[name](
        stages if name in STAGE_LAYOUTS else stages[0],
        n_microbatches=microbatches,
        loss_fn=causal_lm_loss,
        scale_grads=False,
    )
    eval_schedule = schedule
    if name == "zbv":
        eval_schedule = zbv_eval_schedule(stage_modules, stage_indices, num_stages, microbatches, device)
    # Each micro-batch's loss is divided by the predicted tokens of the whole optimizer step: (batch / m) x (block - 1)
    # x m x accumulation.
    divisor = per_device_train_batch_size * (block_size - 1) * gradient_accumulation_steps
    bubble = ideal_bubble_slots(name, len(stages_of_processes), len(stage_indices))
    accelerator.print(
        f"pipeline: {name}, {num_stages} stages on {len(stages_of_processes)} processes "
        f"({stages_of_processes}), m = {microbatches}: ideal bubble "
        f"{bubble / (microbatches + bubble):.1%} of each step"
    )
    return Pipeline(
        name,
        microbatches,
        accelerator.autocast,
        schedule,
        eval_schedule,
        stage_modules,
        0 in stage_indices,
        num_stages - 1 in stage_indices,
        divisor,
    )


def zbv_eval_schedule(
    stage_modules: nn.ModuleList, stage_indices: list[int], num_stages: int, microbatches: int, device: torch.device
) -> ScheduleZBVZeroBubble:
    """A ZB-V schedule for evaluation only. torch 2.13's ``ScheduleZBVZeroBubble.eval()`` crashes on the process that
    holds the V's two middle stages: its forward-only run still executes the input-gradient actions, and the one
    between two stages of one process asks for a gradient that eval never made (``AssertionError: can't
    steal_bwd_input if this stage doesn't have backward``, from ``stage.get_local_bwd_output`` in schedules.py's
    ``_perform_action``). This schedule runs over its own ``PipelineStage`` objects on the same modules (the training
    schedule's stay untouched) and replaces that action by all it has left to do in eval: drop the (empty) gradient
    receive it is paired with. Delete it once ``schedule.eval()`` works under zbv."""
    stages = [
        PipelineStage(module, stage_index=index, num_stages=num_stages, device=device)
        for index, module in zip(stage_indices, stage_modules)
    ]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=microbatches, loss_fn=causal_lm_loss, scale_grads=False)
    schedule.register_custom_function(
        BACKWARD_INPUT,
        lambda action, ctx: ctx.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None),
    )
    return schedule


def unsharded(dataloaders, device: torch.device, seed: int) -> list:
    """The ``dataloaders`` with Accelerate's seedable sampler and device placement (non-blocking on a GPU: the loaders
    are pinned there), not sharded: every stage works on every batch (``accelerator.prepare`` would shard them)."""
    return [
        prepare_data_loader(
            dataloader,
            device=device,
            num_processes=1,
            process_index=0,
            put_on_device=True,
            use_seedable_sampler=True,
            data_seed=seed,
            non_blocking=device.type == "cuda",
        )
        for dataloader in dataloaders
    ]


def clip_grad_norm_across_stages(parameters, max_norm: float, device: torch.device) -> torch.Tensor:
    """``clip_grad_norm_`` for a model split over stages: clipping each stage's slice by its own norm would scale the
    stages differently, so the global norm is the root of the all-reduced sum of every process's squared norms (each
    over the parameters of all its stages). (``accelerator.clip_grad_norm_`` and torch's clip only see this
    process's parameters.)"""
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


# ----------------------------------------------------------------------------- evaluation
def evaluate_pipeline(accelerator, pipeline: Pipeline, eval_dataloader, batch_size: int) -> dict:
    """Validation loss and perplexity over the whole validation set (``lm_kit.eval.perplexity_results``), through
    the pipeline's ``eval_schedule``.

    Every stage reads the whole (unsharded) validation set. Stages exchange fixed-shape buffers, so a short last batch
    is padded to ``batch_size`` with copies of its first block whose labels are -100 (ignored by the loss and not
    counted). Only the process with the last stage sees the loss; a sum-reduce (the others add zero) gives it to every
    process."""
    holds_first, holds_last = pipeline.holds_first, pipeline.holds_last
    pipeline.stage_modules.eval()
    loss_sum = torch.zeros((), device=accelerator.device)
    num_tokens, num_blocks = 0, 0
    for batch in eval_dataloader:
        input_ids = batch["input_ids"]
        labels, real = input_ids.clone(), input_ids.shape[0]
        if real < batch_size:
            filler = input_ids[:1].expand(batch_size - real, -1)
            input_ids = torch.cat([input_ids, filler])
            labels = torch.cat([labels, torch.full_like(filler, -100)])
        losses = []
        with torch.no_grad(), pipeline.autocast():
            pipeline.eval_schedule.eval(
                *((input_ids,) if holds_first else ()),
                target=labels if holds_last else None,
                losses=losses if holds_last else None,
                loss_kwargs={"divisor": 1.0},
            )
        if holds_last:
            loss_sum += torch.stack(losses).sum().float()
        num_tokens += real * (input_ids.shape[1] - 1)
        num_blocks += real
    loss_sum = accelerator.reduce(loss_sum, reduction="sum")
    return perplexity_results(accelerator, loss_sum.item(), num_tokens, num_blocks)


# ----------------------------------------------------------------------------- saving
def gather_full_state_dict(stage_modules: nn.ModuleList, destination: int = 0) -> dict[str, torch.Tensor] | None:
    """The weights of every process's stages, merged into one full-model state dict on rank ``destination`` (None
    elsewhere): torch's ``gather_object``, so only the destination receives (Accelerate's ``gather_object`` is an
    all-gather: it would put the whole model on every process)."""
    local = [
        {name: tensor.detach().cpu() for name, tensor in module.causal_lm.state_dict().items()}
        for module in stage_modules
    ]
    parts = [None] * dist.get_world_size() if dist.get_rank() == destination else None
    dist.gather_object(local, parts, dst=destination)
    if parts is None:
        return None
    stage_dicts = [stage_dict for part in parts for stage_dict in part]
    merged = {name: tensor for stage_dict in stage_dicts for name, tensor in stage_dict.items()}
    if len(merged) != sum(len(stage_dict) for stage_dict in stage_dicts):
        raise RuntimeError("two stages hold the same weight")
    return merged


class StageCheckpoints:
    """Pipeline stages in the checkpoints of ``accelerator.save_state``/``load_state`` (and so of
    ``shared.checkpoints``' atomic saves): ``save_state`` writes the weights of prepared models from the main process
    only, right for replicas, losing every other stage here, and these stages are not prepared. So its hooks make
    every process write its own parts: ``stage_{i}/model.safetensors`` for each stage i it holds, and its optimizer and
    scheduler (one optimizer over all its stages) in the folder of its first stage, stage_{r} for process r;
    ``save_state`` itself adds every process's RNG states. ``pipeline.json`` holds the split (blocks per stage, the
    stages of every process); a checkpoint of another split is refused."""

    def __init__(
        self,
        process_index: int,
        stage_modules: nn.ModuleList,
        optimizer,
        lr_scheduler,
        blocks_per_stage: list[int],
        stages_of_processes: list[list[int]],
    ):
        self.stage_modules, self.optimizer, self.lr_scheduler = stage_modules, optimizer, lr_scheduler
        self.split = {"blocks_per_stage": blocks_per_stage, "stages_of_processes": stages_of_processes}
        self.stage_indices = stages_of_processes[process_index]

    @classmethod
    def register(cls, accelerator, *args) -> StageCheckpoints:
        """Hook a ``StageCheckpoints(accelerator.process_index, *args)`` into ``save_state`` and ``load_state``."""
        stages = cls(accelerator.process_index, *args)
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: stages.save(Path(folder)))
        accelerator.register_load_state_pre_hook(lambda models, folder: stages.load(Path(folder)))
        return stages

    def save(self, folder: Path) -> None:
        for index, module in zip(self.stage_indices, self.stage_modules):
            (folder / f"stage_{index}").mkdir(parents=True, exist_ok=True)
            save_file(
                {name: tensor.contiguous() for name, tensor in module.state_dict().items()},
                folder / f"stage_{index}" / "model.safetensors",
            )
        first = folder / f"stage_{self.stage_indices[0]}"
        torch.save(self.optimizer.state_dict(), first / "optimizer.bin")
        torch.save(self.lr_scheduler.state_dict(), first / "scheduler.bin")
        # Every process writes the split (the same bytes, atomically): with save_on_each_node each machine needs it.
        (first / PIPELINE_FILE).write_text(
            json.dumps({"num_stages": len(self.split["blocks_per_stage"]), **self.split})
        )
        os.replace(first / PIPELINE_FILE, folder / PIPELINE_FILE)

    def load(self, checkpoint: Path) -> None:
        """Tensors are read to the CPU and copied to wherever the stages' parameters are (``load_state_dict`` of
        modules and optimizers both do that)."""
        saved = self.split_of(checkpoint)
        if saved != self.split:
            raise RecipeError(
                f"{checkpoint} holds stages of {saved and saved['blocks_per_stage']} blocks on processes "
                f"{saved and saved['stages_of_processes']}, but this run splits {self.split['blocks_per_stage']} on "
                f"{self.split['stages_of_processes']}: resume with the same model, --block_size, number of processes, "
                "and stages per process laid out the same way (--pipeline_schedule, --stages_per_process)."
            )
        for index, module in zip(self.stage_indices, self.stage_modules):
            module.load_state_dict(load_file(checkpoint / f"stage_{index}" / "model.safetensors"))
        first = checkpoint / f"stage_{self.stage_indices[0]}"
        self.optimizer.load_state_dict(torch.load(first / "optimizer.bin", map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(first / "scheduler.bin", weights_only=True))

    @staticmethod
    def split_of(checkpoint: Path) -> dict | None:
        """Blocks per stage and the stages of every process of a pipeline checkpoint, or None (not one)."""
        path = Path(checkpoint) / PIPELINE_FILE
        if not path.is_file():
            return None
        saved = json.loads(path.read_text())
        # Checkpoints written before several stages per process existed hold stage i on process i.
        return {
            "blocks_per_stage": saved["blocks_per_stage"],
            "stages_of_processes": saved.get(
                "stages_of_processes", [[i] for i in range(len(saved["blocks_per_stage"]))]
            ),
        }
