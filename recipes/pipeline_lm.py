# New Code (pipeline) #
"""Train a GPT-style (Llama-architecture) language model with pipeline parallelism: GPipe, 1F1B, interleaved, ZB-V.
torch.distributed.pipelining over m micro-batches, one or several stages per process. This is
``recipes/train_lm.py`` plus the lines between ``# New Code (pipeline) #`` and ``# End New Code #``, and comments
marked ``# (pipeline)`` where train_lm.py's comment is not true of a pipeline; a test keeps every other line identical
to it, so ``diff recipes/train_lm.py recipes/pipeline_lm.py`` shows exactly what pipelining adds and changes.

The usual tutorial says model parallelism "makes full use of both GPUs' parallel compute". A naive split (train_lm.py's
device_map) does not: blocks 0..k run on GPU 0 while GPU 1 waits, then GPU 1 runs the rest while GPU 0 waits.
Pipelining cuts each batch into m micro-batches and lets stage 0 start micro-batch 2 while stage 1 runs micro-batch 1.
Each process builds the full model from the same seed and keeps its stages (whole decoder blocks balanced by estimated
compute, the same plan as the device_map: embeddings with the first stage, the LM head + loss with the last), and every
process reads the same batches (the data loader is not sharded). The losses and weights equal one unsplit process's
(tests: every schedule, with gradient accumulation). ``--pipeline_schedule``, with p processes:

- ``gpipe``: one stage per process; all m forwards, then all backwards. Idle share of each device (the bubble)
  (p-1)/(m+p-1); holds the activations of all m micro-batches.
- ``1f1b`` (default): one stage per process; after a warm-up each stage alternates one forward and one backward. Same
  bubble as GPipe, but a stage holds at most p micro-batches' activations instead of m.
- ``interleaved1f1b``: ``--stages_per_process`` v (default 2) non-contiguous stages per process (process r holds
  stages r, r+p, r+2p, ...: p*v stages in all), 1F1B over them (Narayanan et al. 2021, Megatron-LM). The warm-up and
  cool-down shrink v-fold: bubble (p-1)/(v*m+p-1) of the step, i.e. (p-1)/(v*m) of the ideal compute time. Costs: v
  times as many sends per micro-batch, and the first process holds the activations of p + (p-1)/v micro-batches
  instead of 1F1B's p (Korthikanti et al. 2022).
- ``zbv``: zero-bubble ZB-V (Qi et al. 2024, section 6): 2 stages per process in a V (process r holds stages r and
  2p-1-r, so the two middle stages share a process and pass activations without a send); each backward is split into
  the input gradient (on the critical path, sent at once) and the weight gradient (deferred to fill the idle slots).
  Zero bubble in the ideal it is built for (a stage's forward, input-gradient and weight-gradient take equal time,
  m >= 2p-1), with 1F1B's peak activation memory by design; a deferred weight gradient keeps its stage's activations
  alive until it runs.

Launch (from the repository root; on a CPU-only machine the same commands run 2 gloo processes):
    accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml recipes/pipeline_lm.py --model_size tiny \\
        --max_train_steps 20 --corpus_max_mb 1
    accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml recipes/pipeline_lm.py --model_size 1.3b \\
        --num_microbatches 8 --pipeline_schedule 1f1b
    accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml recipes/pipeline_lm.py --model_size 1.3b \\
        --num_microbatches 8 --pipeline_schedule interleaved1f1b --stages_per_process 2
    accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml recipes/pipeline_lm.py --model_size 1.3b \\
        --num_microbatches 8 --pipeline_schedule zbv

Writes to ``output_dir``: the model in Hugging Face format (the stages gathered into one), ``results.json`` (as
train_lm.py, plus the schedule, m, the stages each process holds and the ideal bubble fraction) and, with
``--checkpointing_steps``, checkpoints in ``checkpoints/step_N`` in which every stage saves its own part.
"""
# End New Code #

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import torch

# New Code (pipeline) #
import copy
import os

import torch.distributed as dist
import torch.nn.functional as F
from accelerate.data_loader import prepare_data_loader
from safetensors.torch import load_file, save_file
from torch import nn

# End New Code #
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

# New Code (pipeline) #
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import BACKWARD_INPUT

# End New Code #
from torch.utils.data import DataLoader

# PEFT, which transformers imports, imports bitsandbytes, which on a CPU with AVX-512 bf16 warns on every process that
# an optional kernel is not installed (bitsandbytes 0.50; the CPU path works without it): quieted before that import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, get_scheduler  # noqa: E402

# The helper module: shared/ next to this file (a copied recipe) or one folder up (this repository), first on sys.path
# so that no installed package named "shared" shadows it.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
from shared.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from shared.flops import lm_flops_per_token  # noqa: E402
from shared.hang_dump import HangDump  # noqa: E402
from shared.lm_data import load_text_corpus, tokenize_and_pack, train_bpe_tokenizer  # noqa: E402

# Llama-architecture shapes by name (tiny for tests, small for CPU, GPT-3's 125m/350m/1.3b): one table, which the fit
# planner (tools/plan.py) reads too.
from shared.model_presets import MODEL_PRESETS  # noqa: E402
from shared.model_split import (  # noqa: E402
    block_ranges,
    blocks_per_part,
    find_block_list,
    lm_head_cost_in_blocks,
    plan_device_map,
)
from shared.results import ThroughputMeter, model_state_bytes, per_rank, write_results  # noqa: E402
from shared.runtime import (  # noqa: E402
    RecipeError,
    build_accelerator,
    choose_parallelism,
    positive_float,
    positive_int,
    prepare_output_dir,
    run_facts,
    steps_or_epoch,
)

# New Code (pipeline) #
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
# The schedules that run several stages per process, and how they lay the stages out over the processes: in a loop
# (process r: stages r, r + p, r + 2p, ...) or in a V (process r: stages r and 2p - 1 - r).
STAGE_LAYOUTS = {"interleaved1f1b": "loop", "zbv": "v"}


# The pipeline's own pieces around torch.distributed.pipelining's PipelineStage. Each process builds the full model
# from the same seed (weights equal a 1-process run's), then keeps its stages: each its blocks, plus the embeddings on
# the first stage and the final norm and LM head on the last. A stage runs the model's own forward (masks, rotary
# tables) with the other stages' blocks replaced by a pass-through, so parameter names stay the full model's and the
# stages' state dicts merge back into one checkpoint.
# Decoders whose base model adds nothing to ``inputs_embeds`` (rotary positions, applied inside attention), so a stage
# can call the base model's forward with hidden states. GPT-2 adds position embeddings there, Gemma scales: not listed.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def stages_of_process(rank: int, num_processes: int, stages_per_process: int, layout: str = "loop") -> list[int]:
    """The pipeline stages process ``rank`` holds, first to last. ``loop``: r, r + p, r + 2p, ... (one stage per
    process: just r); ``v``: down the processes and back up, r, 2p - 1 - r, 2p + r, ... The same mappings as torch's
    schedules (``generate_stage_to_rank_mapping`` in torch/distributed/pipelining/_utils.py). Either way a process's
    first stage is stage r."""
    p = num_processes
    if layout == "v":
        return [k * p + (rank if k % 2 == 0 else p - 1 - rank) for k in range(stages_per_process)]
    return [k * p + rank for k in range(stages_per_process)]


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


def check_pipeline_model(config, num_processes: int, stages_per_process: int) -> str | None:
    """Why a model with this transformers ``config`` cannot be split by ``build_stage_module`` into ``num_processes`` x
    ``stages_per_process`` stages, or None."""
    if config.model_type not in PIPELINE_MODEL_TYPES:
        return (
            f"pipeline mode supports decoders of type {', '.join(PIPELINE_MODEL_TYPES)}, got {config.model_type!r} "
            "(its base model may change inputs_embeds, e.g. GPT-2 adds position embeddings there)"
        )
    if config.tie_word_embeddings:
        return (
            "the model ties its LM head to its input embeddings, but those live on different stages; "
            "save it untied (config.tie_word_embeddings=False) or use ddp/device_map"
        )
    num_stages = num_processes * stages_per_process
    if stages_per_process > 1 and config.num_hidden_layers < num_stages:
        return (
            f"the model has {config.num_hidden_layers} decoder blocks, fewer than the {num_stages} stages of "
            f"{num_processes} processes x --stages_per_process {stages_per_process}, and every stage needs at least "
            f"one whole block. Use --num_layers {num_stages} or more, or a smaller --stages_per_process"
        )
    return None


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


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """Sum of next-token cross-entropies (labels of -100 ignored) divided by ``divisor``: transformers' causal-LM loss
    (shift by one, float32 logits) as a sum, so the caller normalises: by the step's tokens in training (each
    micro-batch adds its share of the step's mean), by 1 in evaluation (sums add up)."""
    # Shift the labels, not the logits: slicing (batch, seq, vocab) logits would copy the step's largest tensor.
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    return (
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum") / divisor
    )


def clip_grad_norm_across_stages(parameters, max_norm: float, device: torch.device) -> torch.Tensor:
    """``clip_grad_norm_`` for a model split over stages: clipping each stage's slice by its own norm would scale the
    stages differently, so the global norm is the root of the all-reduced sum of every process's squared norms (each
    over the parameters of all its stages)."""
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


def gather_full_state_dict(stage_modules: nn.ModuleList, destination: int = 0) -> dict[str, torch.Tensor] | None:
    """The weights of every process's stages, merged into one full-model state dict on rank ``destination`` (None
    elsewhere): ``gather_object``, so only the destination receives (an all-gather would put the model everywhere)."""
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


PIPELINE_FILE = "pipeline.json"


def save_stage_checkpoint(
    accelerator,
    checkpoints_dir: str | os.PathLike,
    completed_steps: int,
    stage_modules: nn.ModuleList,
    optimizer,
    lr_scheduler,
    pipeline_split: dict,
    total_limit: int | None = None,
    history: dict | None = None,
) -> Path:
    """``shared.checkpoints.save_checkpoint`` for pipeline stages (same folder, atomic rename, ``progress.json`` last),
    but every process writes its own parts: ``stage_{i}/model.safetensors`` for each stage i it holds, and its
    optimizer, scheduler and RNG state (one optimizer over all its stages) in the folder of its first stage, stage_{r}
    for process r. ``save_state`` writes weights from the main process only, right for replicas, losing every other
    stage here. ``pipeline_split``: blocks per stage and the stages of every process. Every process calls it."""

    def write_stage(tmp: Path) -> None:
        indices = pipeline_split["stages_of_processes"][accelerator.process_index]
        for index, module in zip(indices, stage_modules):
            (tmp / f"stage_{index}").mkdir(parents=True, exist_ok=True)
            save_file(
                {name: tensor.contiguous() for name, tensor in module.state_dict().items()},
                tmp / f"stage_{index}" / "model.safetensors",
            )
        folder = tmp / f"stage_{indices[0]}"
        torch.save(optimizer.state_dict(), folder / "optimizer.bin")
        torch.save(lr_scheduler.state_dict(), folder / "scheduler.bin")
        torch.save(
            {
                "torch": torch.get_rng_state(),
                **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
            },
            folder / "rng_state.pth",
        )
        # Every process writes the split (the same bytes, atomically): with save_on_each_node each machine needs it.
        (folder / PIPELINE_FILE).write_text(
            json.dumps({"num_stages": len(pipeline_split["blocks_per_stage"]), **pipeline_split})
        )
        os.replace(folder / PIPELINE_FILE, tmp / PIPELINE_FILE)

    return save_checkpoint(
        accelerator,
        checkpoints_dir,
        completed_steps,
        total_limit,
        write_state=write_stage,
        layout="pipeline",
        history=history,
    )


def pipeline_split_of(checkpoint: Path) -> dict | None:
    """Blocks per stage and the stages of every process of a pipeline checkpoint, or None for a checkpoint written by
    ``save_state``."""
    path = Path(checkpoint) / PIPELINE_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    # Checkpoints written before several stages per process existed hold stage i on process i.
    return {
        "blocks_per_stage": saved["blocks_per_stage"],
        "stages_of_processes": saved.get("stages_of_processes", [[i] for i in range(len(saved["blocks_per_stage"]))]),
    }


def load_stage_checkpoint(
    checkpoint: Path, stage_indices: list[int], stage_modules: nn.ModuleList, optimizer, lr_scheduler
) -> None:
    """Inverse of ``save_stage_checkpoint`` for one process's stages, same split; tensors are read to the CPU and
    copied to wherever the stages' parameters are (``load_state_dict`` of modules and optimizers both do that)."""
    for index, module in zip(stage_indices, stage_modules):
        module.load_state_dict(load_file(Path(checkpoint) / f"stage_{index}" / "model.safetensors"))
    folder = Path(checkpoint) / f"stage_{stage_indices[0]}"
    optimizer.load_state_dict(torch.load(folder / "optimizer.bin", map_location="cpu", weights_only=True))
    lr_scheduler.load_state_dict(torch.load(folder / "scheduler.bin", weights_only=True))
    rng = torch.load(folder / "rng_state.pth", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


# End New Code #


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # New Code (pipeline) #
    parser.add_argument(
        "--output_dir",
        default="outputs/pipeline_lm",
        # End New Code #
        help="Where the model, results.json and checkpoints go (created if missing).",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=42,
        help="Seed for the initial weights and the data order (the same in every mode).",
    )
    # New Code (pipeline) #
    parser.add_argument(
        "--pipeline_schedule",
        choices=list(SCHEDULES),
        default="1f1b",
        help="gpipe: all forwards, then all backwards (bubble (p-1)/(m+p-1) of the step, m micro-batches' "
        "activations live); 1f1b: one forward, one backward (same bubble, at most p micro-batches' activations); "
        "interleaved1f1b: 1F1B over --stages_per_process v stages per process (bubble (p-1)/(v*m+p-1), v times the "
        "sends, up to p+(p-1)/v micro-batches' activations); zbv: zero-bubble ZB-V, 2 stages per process in a V, "
        "backward split into input and weight gradients that fill the bubble (ideally none, m >= 2p-1).",
    )
    parser.add_argument(
        "--num_microbatches",
        type=positive_int,
        default=4,
        help="Micro-batches per batch; the batch must divide evenly. More: a smaller bubble, smaller matmuls.",
    )
    parser.add_argument(
        "--stages_per_process",
        type=positive_int,
        default=None,
        help="Pipeline stages (model chunks) each process holds, for interleaved1f1b (default 2) and zbv (exactly "
        "2); gpipe and 1f1b hold 1. The model is cut into processes x this many stages of whole decoder blocks.",
    )
    # End New Code #
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each decoder block's activations in backward: less memory, ~1/3 more compute.",
    )
    parser.add_argument(
        "--model_size",
        choices=list(MODEL_PRESETS),
        default="small",
        help="Model shape when training from scratch (ignored with --model_name_or_path).",
    )
    parser.add_argument(
        "--num_layers", type=positive_int, default=None, help="Override the preset's number of decoder blocks."
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="Start from pretrained weights (a Hub id or a folder this recipe saved); its tokenizer is used.",
    )
    parser.add_argument(
        "--vocab_size",
        type=positive_int,
        default=8192,
        help="Vocabulary of the byte-level BPE tokenizer trained on the training text.",
    )
    parser.add_argument(
        "--dataset_name",
        default=None,
        help="A Hub dataset with a text column (needs internet). Default: the offline standard-library corpus.",
    )
    parser.add_argument(
        "--dataset_config_name", default=None, help="The Hub dataset's configuration name, if it has several."
    )
    parser.add_argument(
        "--train_file", default=None, help="A text file to train on (one example per line, line breaks kept)."
    )
    parser.add_argument(
        "--validation_file",
        default=None,
        help="A text file to validate on (default: the last --validation_split_percentage of --train_file).",
    )
    parser.add_argument(
        "--validation_split_percentage",
        type=positive_float,
        default=5,
        help="Share held out for validation when there is no validation split (default corpus: every k-th file).",
    )
    parser.add_argument(
        "--corpus_max_mb",
        type=positive_float,
        default=None,
        help="Use only the first N MB of the default corpus (files in sorted order). Default: all (~11 MB).",
    )
    parser.add_argument(
        "--block_size",
        type=positive_int,
        default=256,
        help="Tokens per training sequence (texts are packed into blocks of this length).",
    )
    parser.add_argument(
        "--max_train_samples", type=positive_int, default=None, help="Use only the first N training blocks."
    )
    parser.add_argument(
        "--max_eval_samples", type=positive_int, default=None, help="Use only the first N validation blocks."
    )
    parser.add_argument(
        "--per_device_train_batch_size", type=positive_int, default=16, help="Blocks per process per forward pass."
    )
    parser.add_argument(
        "--per_device_eval_batch_size",
        type=positive_int,
        default=None,
        help="Blocks per evaluation batch (default: the training batch size).",
    )
    parser.add_argument(
        "--gradient_accumulation_steps", type=positive_int, default=1, help="Batches per optimizer step."
    )
    parser.add_argument(
        "--num_train_epochs",
        type=positive_int,
        default=1,
        help="Passes over the training set (ignored if --max_train_steps is set).",
    )
    parser.add_argument(
        "--max_train_steps", type=positive_int, default=None, help="Stop after this many optimizer steps."
    )
    parser.add_argument("--learning_rate", type=positive_float, default=1e-3, help="Peak AdamW learning rate.")
    parser.add_argument(
        "--weight_decay",
        type=float,
        default=0.1,
        help="AdamW weight decay (matrices only; norms and biases are not decayed).",
    )
    parser.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="Clip the global gradient norm to this (0: no clipping)."
    )
    parser.add_argument(
        "--lr_scheduler_type",
        default="cosine",
        choices=["linear", "cosine", "constant", "constant_with_warmup"],
        help="Learning-rate schedule (transformers.get_scheduler).",
    )
    parser.add_argument(
        "--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps."
    )
    parser.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16"],
        default=None,
        help="Override the config's mixed precision (bf16 also works on CPU; fp16 needs a GPU).",
    )
    parser.add_argument(
        "--checkpointing_steps",
        type=steps_or_epoch,
        default=None,
        help="Save a resumable checkpoint to output_dir/checkpoints/step_N every N optimizer steps, or 'epoch'.",
    )
    parser.add_argument(
        "--checkpoints_total_limit", type=positive_int, default=None, help="Keep only the newest N checkpoints."
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help="A checkpoint folder, or 'latest' (newest complete one under output_dir/checkpoints; starts fresh "
        "if there is none).",
    )
    parser.add_argument(
        "--save_on_each_node",
        action="store_true",
        help="Machines without a shared disk: every machine saves its own copy of each checkpoint.",
    )
    parser.add_argument(
        "--dist_timeout",
        type=float,
        default=600,
        help="Seconds any collective may wait for the other processes before the run fails with an error naming it.",
    )
    parser.add_argument(
        "--eval_before_training", action="store_true", help="Also measure validation perplexity before the first step."
    )
    parser.add_argument(
        "--skip_eval",
        action="store_true",
        help="Skip the final evaluation (eval/* are NaN): benchmarks that measure training speed only.",
    )
    parser.add_argument(
        "--perf_warmup_steps",
        type=int,
        default=2,
        help="Optimizer steps left out of the throughput numbers (start-up, first-call costs).",
    )
    parser.add_argument(
        "--cpu_threads_per_process",
        type=int,
        default=1,
        help="On CPU: PyTorch threads per process (1 = one core stands in for one GPU; 0 = PyTorch's default).",
    )
    parser.add_argument(
        "--sample_prompt", default="def ", help="Prompt for the short greedy sample printed at the end."
    )
    parser.add_argument(
        "--sample_tokens", type=int, default=24, help="Tokens to generate for the sample (0: no sample)."
    )
    return parser.parse_args(argv)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (linear and embedding weights), none on norms/biases."""
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return [
        {"params": [parameter for parameter in parameters if parameter.ndim >= 2], "weight_decay": weight_decay},
        {"params": [parameter for parameter in parameters if parameter.ndim < 2], "weight_decay": 0.0},
    ]


# New Code (pipeline) #
def check_pipeline_request(args, num_processes: int, eval_batch_size: int, mixed_precision: str) -> int:
    """Refuse pipeline settings that cannot work, before any data or model work; return the stages per process."""
    microbatches, schedule = args.num_microbatches, args.pipeline_schedule
    for flag, size in (
        ("--per_device_train_batch_size", args.per_device_train_batch_size),
        ("--per_device_eval_batch_size", eval_batch_size),
    ):
        if size % microbatches:
            raise RecipeError(
                f"{flag} {size} does not divide into --num_microbatches {microbatches}: every micro-batch must have "
                "the "
                f"same shape (pipeline stages exchange fixed-size buffers). Use a batch size that is a multiple of "
                f"{microbatches}, e.g. {microbatches * max(1, round(size / microbatches))}."
            )
    if mixed_precision == "fp16":
        raise RecipeError(
            "fp16 needs a gradient scaler shared by all stages, which this recipe does not set up; "
            "use --mixed_precision bf16."
        )
    if schedule == "1f1b" and microbatches < num_processes:
        raise RecipeError(
            f"--pipeline_schedule 1f1b needs --num_microbatches >= the number of stages ({num_processes}); "
            f"got {microbatches}."
        )
    if schedule not in STAGE_LAYOUTS:
        if args.stages_per_process not in (None, 1):
            raise RecipeError(
                f"--pipeline_schedule {schedule} runs one stage per process, but --stages_per_process is "
                f"{args.stages_per_process}: use --pipeline_schedule interleaved1f1b (or zbv, 2 stages) for several."
            )
        return 1
    stages_per_process = args.stages_per_process or 2
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


def evaluate_pipeline(accelerator, schedule, stages, eval_dataloader, batch_size: int) -> tuple[float, int, int]:
    """Summed next-token loss, tokens and blocks over the whole validation set, through the pipeline.

    Every stage reads the whole (unsharded) validation set. Stages exchange fixed-shape buffers, so a short last batch
    is padded to ``batch_size`` with copies of its first block whose labels are -100 (ignored by the loss and not
    counted). Only the process with the last stage sees the loss; a sum-reduce (the others add zero) gives it to every
    process. ``stages``: this process's ``PipelineStage``s.
    """
    holds_first, holds_last = any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)
    for stage in stages:
        stage.submod.eval()
    loss_sum = torch.zeros((), device=accelerator.device)
    num_tokens, num_blocks = 0, 0
    for batch in eval_dataloader:
        input_ids = batch["input_ids"]
        labels = input_ids.clone()
        real = input_ids.shape[0]
        if real < batch_size:
            filler = input_ids[:1].expand(batch_size - real, -1)
            input_ids = torch.cat([input_ids, filler])
            labels = torch.cat([labels, torch.full_like(filler, -100)])
        losses = []
        with torch.no_grad(), accelerator.autocast():
            schedule.eval(
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
    return loss_sum.item(), num_tokens, num_blocks


# End New Code #


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    # (This Accelerator block repeats in every recipe on purpose: each recipe is one file you can copy, and reads top
    # to bottom without a jump into a helper that hides its settings.)
    # Hang dumps: if a collective times out or a rank stops making progress, every rank that can still run writes
    # its stacks, step and collective to output_dir/debug/. Started first: NCCL reads its settings at start-up.
    hang_dump = HangDump(Path(args.output_dir) / "debug", args.dist_timeout)
    # build_accelerator passes cpu=True when there is no CUDA, so a 2-process config joins over gloo instead of
    # starting two silent independent runs, and checks the process count.
    accelerator = build_accelerator(
        # Bounds every collective: a dead or hung process ends the run after this long with an error naming the
        # operation, instead of the backend's 10-30 minutes.
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # A seedable sampler with a fixed data seed shuffles identically in every mode and process count: what makes
        # the modes comparable batch-for-batch.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir)
    if accelerator.device.type == "cpu" and args.cpu_threads_per_process > 0:
        # One core per process stands in for one GPU: without this, one process of a naive split would use every core
        # while each of two processes shares them, and the comparison would lie.
        torch.set_num_threads(args.cpu_threads_per_process)

    # New Code (pipeline) #
    # One stage per process: refuses 1 process, and an FSDP launch config.
    parallelism = choose_parallelism(accelerator, "pipeline", "recipes/pipeline_lm.py")
    # End New Code #
    num_processes = accelerator.num_processes
    eval_batch_size = args.per_device_eval_batch_size or args.per_device_train_batch_size
    # New Code (pipeline) #
    # Every process reads the same batches: the first stage feeds the tokens, the last computes the loss on them.
    data_parallel = False
    # p processes x v stages each (v = 1 for gpipe and 1f1b) = the pipeline's stages.
    stages_per_process = check_pipeline_request(args, num_processes, eval_batch_size, accelerator.mixed_precision)
    num_stages, microbatches = num_processes * stages_per_process, args.num_microbatches
    stages_of_processes = [
        stages_of_process(rank, num_processes, stages_per_process, STAGE_LAYOUTS.get(args.pipeline_schedule, "loop"))
        for rank in range(num_processes)
    ]
    stage_indices = stages_of_processes[accelerator.process_index]  # this process's stages
    # End New Code #
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")

    # Model shape first: bad sizes fail here, before any data work.
    if args.model_name_or_path:
        model_config = AutoConfig.from_pretrained(args.model_name_or_path)
    else:
        preset = dict(MODEL_PRESETS[args.model_size])
        if args.num_layers:
            preset["num_hidden_layers"] = args.num_layers
        # Untied LM head: a split can then put the embeddings on the first part and the head on the last.
        model_config = LlamaConfig(
            **preset,
            num_key_value_heads=preset["num_attention_heads"],
            vocab_size=args.vocab_size,
            tie_word_embeddings=False,
        )
    if args.block_size > model_config.max_position_embeddings:
        raise RecipeError(
            f"--block_size {args.block_size} is longer than the model's {model_config.max_position_embeddings} "
            f"positions (max_position_embeddings). Use --block_size {model_config.max_position_embeddings} or less."
        )
    # New Code (pipeline) #
    problem = check_pipeline_model(model_config, num_processes, stages_per_process)
    if problem:
        raise RecipeError(f"Cannot split this model into pipeline stages: {problem}.")
    # End New Code #
    if model_config.num_hidden_layers < num_stages:
        raise RecipeError(
            f"The model has {model_config.num_hidden_layers} decoder layers but {parallelism.name} needs at least "
            "one per "
            f"stage ({num_stages} stages). Use a model with more layers (--num_layers {num_stages} or more) or fewer "
            "stages."
        )

    # Checkpoints: output_dir/checkpoints/step_N, complete once progress.json is written; every process agrees on the
    # (pipeline) one to resume from ("latest" skips incomplete ones and starts fresh when there is none). Each process
    # (pipeline) saves its own stages: a checkpoint of another layout (a whole model, FSDP shards) is refused.
    checkpoints_dir = output_dir / "checkpoints"
    # New Code (pipeline) #
    layout = "pipeline"
    # End New Code #
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)

    # ------------------------------------------------------------------------------- data
    # (pipeline) This section is train_lm.py's, line for line (so that each recipe can be copied alone; a test keeps
    # (pipeline) the two the same). main_process_first: the main process reads, trains the tokenizer and tokenizes
    # (pipeline) (datasets caches the results); the others then load the tokenizer it saved and hit the cache.
    with accelerator.main_process_first():
        try:
            raw_datasets, corpus, documents = load_text_corpus(
                dataset_name=args.dataset_name,
                dataset_config_name=args.dataset_config_name,
                train_file=args.train_file,
                validation_file=args.validation_file,
                validation_split_percentage=args.validation_split_percentage,
                corpus_max_mb=args.corpus_max_mb,
            )
        except (OSError, ValueError, ConnectionError) as error:
            raise RecipeError(f"Could not load the training text: {error}") from None
        run_folder = checkpoint.parents[1] if checkpoint is not None else None  # run_folder/checkpoints/step_N
        if run_folder is not None and (run_folder / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(run_folder)  # the resumed run's own tokenizer
        elif args.model_name_or_path:
            try:  # a pretrained model comes with the tokenizer its embeddings were trained for
                tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
            except (OSError, ValueError) as error:
                raise RecipeError(
                    f"--model_name_or_path {args.model_name_or_path} has no loadable tokenizer ({error}); "
                    "a pretrained model needs the tokenizer it was trained with."
                ) from None
        elif accelerator.is_main_process:
            tokenizer = train_bpe_tokenizer((row["text"] for row in raw_datasets["train"]), vocab_size=args.vocab_size)
            tokenizer.save_pretrained(output_dir)
        else:
            tokenizer = AutoTokenizer.from_pretrained(output_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        lm_datasets, token_counts = tokenize_and_pack(raw_datasets, tokenizer, args.block_size, documents)
    for split in ("train", "validation"):
        if len(lm_datasets[split]) == 0:
            raise RecipeError(
                f"The {split} text has {token_counts[split]} tokens, fewer than one block of --block_size "
                f"{args.block_size}. Use more text or a smaller --block_size."
            )
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"]
    if args.max_train_samples:
        train_dataset = train_dataset.select(range(min(args.max_train_samples, len(train_dataset))))
    if args.max_eval_samples:
        eval_dataset = eval_dataset.select(range(min(args.max_eval_samples, len(eval_dataset))))
    train_dataset.set_format("torch", columns=["input_ids"])
    eval_dataset.set_format("torch", columns=["input_ids"])
    # drop_last: every batch has the same shape (pipeline stages need it), so both LM recipes see the same batches.
    train_dataloader = DataLoader(
        train_dataset, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True
    )
    eval_dataloader = DataLoader(eval_dataset, batch_size=eval_batch_size)
    batches_needed = (num_processes if data_parallel else 1) * args.gradient_accumulation_steps
    if len(train_dataloader) < batches_needed:
        raise RecipeError(
            f"One optimizer step needs {batches_needed * args.per_device_train_batch_size} blocks of "
            f"{args.block_size} "
            f"tokens but the training set has {len(train_dataset)} ({token_counts['train']} tokens). Use more text, "
            "a smaller --block_size, --per_device_train_batch_size or --gradient_accumulation_steps."
        )
    accelerator.print(
        f"data: {corpus}: {len(train_dataset)} train / {len(eval_dataset)} validation blocks of "
        f"{args.block_size} tokens, vocabulary {len(tokenizer)}"
    )

    # ------------------------------------------------------------------------------ model
    if not args.model_name_or_path:
        # The trained vocabulary can be smaller than --vocab_size on a small corpus; its one special token both starts
        # and ends texts (and is never a pad id, which would freeze its embedding).
        model_config.vocab_size = len(tokenizer)
        model_config.bos_token_id = model_config.eos_token_id = tokenizer.eos_token_id
    # Re-seeded here so every process and every mode starts from identical weights.
    set_seed(args.seed)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=model_config)
    else:
        model = AutoModelForCausalLM.from_config(model_config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    # One plan for every kind of split: whole decoder blocks, balanced by estimated compute, with the embeddings on
    # the first part and the final norm + LM head (+ loss) on the last.
    block_list = find_block_list(model, set(model._no_split_modules))
    head_cost = lm_head_cost_in_blocks(model, block_list, args.block_size)
    plan = plan_device_map(model, num_stages, last_cost=head_cost)
    blocks_per_stage = blocks_per_part(plan, block_list)
    stage_costs = [count + (head_cost if part == num_stages - 1 else 0) for part, count in enumerate(blocks_per_stage)]
    if num_stages > 1:
        split = [f"blocks {r.start}-{r.stop - 1}" for r in block_ranges(blocks_per_stage)]
        split[0] = "embeddings + " + split[0]
        split[-1] += " + norm + LM head"
        accelerator.print(
            f"model: {num_parameters / 1e6:.1f}M parameters; split by estimated compute (the LM head and loss count "
            "as "
            f"{head_cost:.1f} blocks): "
            + "; ".join(
                f"stage {part}: {text} ({cost / sum(stage_costs):.0%})"
                for part, (text, cost) in enumerate(zip(split, stage_costs))
            )
        )
    else:
        accelerator.print(
            f"model: {num_parameters / 1e6:.1f}M parameters, {len(model.get_submodule(block_list))} decoder "
            "blocks, unsplit"
        )

    if args.gradient_checkpointing:
        # (pipeline) Before the split into stages (each stage keeps its blocks as they are): each decoder block then
        # (pipeline) recomputes its activations in
        # backward. use_reentrant=False: the reentrant version runs backward outside autograd's view of the block,
        # which breaks DDP (a parameter "used twice" or "unused" error) and needs an input that requires grad; the
        # non-reentrant one works in every mode and gives the same gradients.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # New Code (pipeline) #
    # Keep this process's stages, one module each (its blocks, plus the embeddings on the first stage and the norm +
    # head on the last); the blocks of the other processes' stages go with the full model. "model" is from here on
    # the list of this process's stages: train(), parameters() and the optimizer cover all of them.
    if stages_per_process > 1:
        accelerator.print(
            f"{args.pipeline_schedule}: {stages_per_process} stages per process ("
            + "; ".join(f"process {rank}: stages {indices}" for rank, indices in enumerate(stages_of_processes))
            + ")"
        )
    pipeline_split = {"blocks_per_stage": blocks_per_stage, "stages_of_processes": stages_of_processes}
    model = nn.ModuleList(
        build_stage_module(model, block_ranges(blocks_per_stage)[index], index, num_stages) for index in stage_indices
    )
    model.to(accelerator.device)
    # End New Code #

    # ------------------------------------------------------------------ optimizer and scheduler
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.learning_rate, betas=(0.9, 0.95))
    # (pipeline) Batches each process sees per epoch: all of them (every stage works on every batch: the loader is
    # (pipeline) not sharded; drop_last: whole batches only). accumulate() also steps on the last, shorter group of an
    # (pipeline) epoch, hence the ceiling division.
    batches_per_epoch = len(train_dataloader) // (num_processes if data_parallel else 1)
    steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_train_epochs = math.ceil(max_train_steps / steps_per_epoch)
    # A prepared scheduler steps once per process per optimizer step (it assumes every process saw its own batch), so
    # its length is counted in process-steps.
    # New Code (pipeline) #
    # Here it is not prepared (see below): one scheduler step per optimizer step.
    scheduler_steps = 1
    # End New Code #
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * scheduler_steps,
        num_training_steps=max_train_steps * scheduler_steps,
    )

    # ------------------------------------------------------------------------------ prepare
    # New Code (pipeline) #
    # The pipeline drives torch.distributed.pipelining itself, because prepare() would do three wrong things here: wrap
    # the stage in DDP (all-reducing gradients between *different* halves of the model), shard the data loader (both
    # stages must see the same batches) and step the scheduler once per process. The data loaders still get
    # Accelerate's seedable sampler and device placement, unsharded.
    train_dataloader, eval_dataloader = (
        prepare_data_loader(
            loader,
            device=accelerator.device,
            num_processes=1,
            process_index=0,
            put_on_device=True,
            use_seedable_sampler=True,
            data_seed=args.seed,
        )
        for loader in (train_dataloader, eval_dataloader)
    )
    # The stage's input/output shapes are inferred on the first step, and gradients are scaled by the loss below
    # rather than by the schedule: scale_grads=True would divide *all* accumulated gradients by m after every step(),
    # so with gradient accumulation the earlier batches would be divided again.
    stages = [
        PipelineStage(module, stage_index=index, num_stages=num_stages, device=accelerator.device)
        for index, module in zip(stage_indices, model)
    ]
    # gpipe and 1f1b take the process's one stage, the other schedules the list of its stages.
    schedule = SCHEDULES[args.pipeline_schedule](
        stages if args.pipeline_schedule in STAGE_LAYOUTS else stages[0],
        n_microbatches=microbatches,
        loss_fn=causal_lm_loss,
        scale_grads=False,
    )
    # The first stage takes the tokens, the last the targets (under zbv both are on process 0).
    holds_first, holds_last = any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)
    # Evaluation runs the same schedule forward only (under zbv a second one: see zbv_eval_schedule).
    eval_schedule = schedule
    if args.pipeline_schedule == "zbv":
        eval_schedule = zbv_eval_schedule(model, stage_indices, num_stages, microbatches, accelerator.device)
    bubble_slots = ideal_bubble_slots(args.pipeline_schedule, num_processes, stages_per_process)
    accelerator.print(
        f"pipeline: {args.pipeline_schedule}, {num_stages} stages on {num_processes} processes, m = {microbatches}: "
        f"ideal bubble {bubble_slots / (microbatches + bubble_slots):.1%} of each step"
    )
    # End New Code #

    # (pipeline) tokens per optimizer step = batch x sequence length x accumulation (every process works on the same
    # (pipeline) batches).
    global_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * (num_processes if data_parallel else 1)
    )
    tokens_per_step = global_batch_size * args.block_size
    config = {
        **vars(args),
        "parallelism_resolved": parallelism.name,
        "num_processes": num_processes,
        "num_stages": num_stages,
        "global_batch_size": global_batch_size,
        "tokens_per_step": tokens_per_step,
        "max_train_steps_resolved": max_train_steps,
        "blocks_per_stage": blocks_per_stage,
        "model_config": model_config.to_diff_dict(),
        # New Code (pipeline) #
        "devices": [str(accelerator.device)],
        # End New Code #
        "cpu_threads": torch.get_num_threads() if accelerator.device.type == "cpu" else None,
    }
    accelerator.print("config: " + json.dumps(config, sort_keys=True, default=str))

    # Restores the model, optimizer, scheduler, the sampler's seed and every process's RNG states.
    # New Code (pipeline) #
    # Each stage loads its own weights, optimizer, scheduler and RNG state, with the split it was saved with.
    if checkpoint is not None and pipeline_split_of(checkpoint) != pipeline_split:
        saved = pipeline_split_of(checkpoint)
        raise RecipeError(
            f"{checkpoint} holds stages of {saved['blocks_per_stage']} blocks on processes "
            f"{saved['stages_of_processes']}, but this run splits {blocks_per_stage} on {stages_of_processes}: "
            "resume with the same model, --block_size, number of processes, and stages per process laid out the same "
            "way (--pipeline_schedule, --stages_per_process)."
        )
    resume = load_checkpoint(
        accelerator,
        checkpoint,
        steps_per_epoch,
        args.gradient_accumulation_steps,
        load_state=lambda folder: load_stage_checkpoint(folder, stage_indices, model, optimizer, lr_scheduler),
    )
    # End New Code #
    completed_steps, starting_epoch, batches_to_skip = resume.completed_steps, resume.epoch, resume.batches_to_skip

    def evaluate():
        # New Code (pipeline) #
        return evaluate_pipeline(accelerator, eval_schedule, stages, eval_dataloader, eval_batch_size)
        # End New Code #

    results = {}
    if args.eval_before_training:
        loss_sum, num_tokens, _ = evaluate()
        results["eval/perplexity_before_training"] = math.exp(loss_sum / num_tokens)
        accelerator.print(f"before training: eval/perplexity {results['eval/perplexity_before_training']:.2f}")

    # ---------------------------------------------------------------------- training loop
    # New Code (pipeline) #
    meter = ThroughputMeter(accelerator, warmup_steps=args.perf_warmup_steps)
    # End New Code #
    # The mean training loss of each optimizer step; a resumed run starts from the curve its checkpoint saved.
    loss_curve = list(resume.history.get("train/loss_curve", []))
    step_loss = torch.zeros((), device=accelerator.device)
    log_every = max(1, max_train_steps // 10)
    # New Code (pipeline) #
    # Loss normalisation: each micro-batch returns its summed token losses divided by the predicted tokens of the
    # whole optimizer step, (batch / m) x (block - 1) x m x accumulation, so the micro-batch losses of a step add up to
    # its mean, as accelerator.backward's 1/accumulation does.
    pipeline_divisor = args.per_device_train_batch_size * (args.block_size - 1) * args.gradient_accumulation_steps
    # End New Code #
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        # Explicit epoch: the shuffling seed is data_seed + epoch, also in the skipping loader below.
        train_dataloader.set_epoch(epoch)
        active_dataloader = train_dataloader
        if epoch == starting_epoch and batches_to_skip:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, batches_to_skip)
        for batch in meter.timed(active_dataloader):  # timed: measures the wait for each batch
            input_ids = batch["input_ids"]
            # accumulate() decides when a step ends (every gradient_accumulation_steps batches, or at the end of the
            # (pipeline) data loader); the stages are not wrapped in DDP, so there is no all-reduce for it to skip.
            with accelerator.accumulate(model):
                # New Code (pipeline) #
                # Each process's optimizer steps on the same batches (nothing to all-reduce). One call runs all
                # micro-batches through every stage, forward and backward, in the schedule's order.
                losses = []
                with accelerator.autocast():
                    schedule.step(
                        *((input_ids,) if holds_first else ()),
                        target=input_ids if holds_last else None,
                        losses=losses if holds_last else None,
                        loss_kwargs={"divisor": pipeline_divisor},
                    )
                if holds_last:
                    step_loss += torch.stack(losses).sum().detach().float()
                # End New Code #
                if accelerator.sync_gradients:
                    if args.max_grad_norm > 0:
                        # New Code (pipeline) #
                        # One global norm over every stage's gradients, so all scale by the same factor.
                        clip_grad_norm_across_stages(model.parameters(), args.max_grad_norm, accelerator.device)
                        # End New Code #
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                # New Code (pipeline) #
                # Sync point (.item()): only the process with the last stage has the loss; the others add zero.
                loss_curve.append(accelerator.reduce(step_loss, reduction="sum").item())
                # End New Code #
                step_loss.zero_()
                meter.step(samples=global_batch_size, tokens=tokens_per_step)
                hang_dump.step(completed_steps)
                if completed_steps % log_every == 0 or completed_steps == max_train_steps:
                    accelerator.print(
                        f"epoch {epoch} step {completed_steps}/{max_train_steps} train/loss {loss_curve[-1]:.4f} "
                        f"lr {lr_scheduler.get_last_lr()[0]:.2e}"
                    )
                if isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0:
                    # New Code (pipeline) #
                    save_stage_checkpoint(
                        accelerator,
                        checkpoints_dir,
                        completed_steps,
                        model,
                        optimizer,
                        lr_scheduler,
                        pipeline_split,
                        args.checkpoints_total_limit,
                        history={"train/loss_curve": loss_curve},
                    )
                    # End New Code #
            if completed_steps >= max_train_steps:
                break
        if args.checkpointing_steps == "epoch" and completed_steps < max_train_steps:
            # New Code (pipeline) #
            save_stage_checkpoint(
                accelerator,
                checkpoints_dir,
                completed_steps,
                model,
                optimizer,
                lr_scheduler,
                pipeline_split,
                args.checkpoints_total_limit,
                history={"train/loss_curve": loss_curve},
            )
            # End New Code #
        if completed_steps >= max_train_steps:
            break
    # Collective: every process calls it. With the training FLOPs per token, MFU on CUDA against the GPU's peak.
    perf = meter.summary(
        flops_per_token=lm_flops_per_token(
            model_config.hidden_size,
            model_config.num_hidden_layers,
            model_config.vocab_size,
            num_parameters,
            args.block_size,
        )
    )
    # Exact bytes of parameters + gradients + optimizer state per process.
    # New Code (pipeline) #
    # (Here: each stage's own.)
    # End New Code #
    perf["memory/model_state_bytes"] = per_rank(model_state_bytes(model, optimizer))  # a collective

    # ------------------------------------------------------------------------------- save
    # Before the evaluation: nothing that can fail after the last optimizer step may lose the trained weights.
    hang_dump.phase("saving")
    accelerator.wait_for_everyone()
    # New Code (pipeline) #
    # Each process holds different stages: gather their weights into one full model on the main process (a collective).
    full_state_dict = gather_full_state_dict(model)
    final_model = None
    if accelerator.is_main_process:
        final_model = AutoModelForCausalLM.from_config(model_config)
        final_model.load_state_dict(full_state_dict, strict=True)  # strict: every weight came from a stage
    # End New Code #
    if accelerator.is_main_process:
        final_model.save_pretrained(output_dir)  # config.json + model.safetensors
        tokenizer.save_pretrained(output_dir)

    # ------------------------------------------------------------------------- evaluation
    hang_dump.phase("evaluation")
    # The whole validation set, each block once, in every mode; perplexity = exp(mean token loss).
    loss_sum, num_tokens, num_blocks = (math.nan, 1, 0) if args.skip_eval else evaluate()
    eval_loss = loss_sum / num_tokens
    accelerator.print(
        f"eval/loss {eval_loss:.4f} eval/perplexity {math.exp(eval_loss):.2f} "
        f"({num_blocks} blocks, {num_tokens} predicted tokens)"
    )
    sample = None
    if accelerator.is_main_process and args.sample_tokens > 0:
        # Greedy, so the test can regenerate the same text from the saved folder.
        final_model.eval()
        prompt_ids = tokenizer(args.sample_prompt, return_tensors="pt").input_ids.to(accelerator.device)
        # New Code (pipeline) #
        final_model.to(accelerator.device)
        # End New Code #
        with torch.no_grad():
            generated = final_model.generate(
                prompt_ids, max_new_tokens=args.sample_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        sample = tokenizer.decode(generated[0], skip_special_tokens=False)
        accelerator.print(f"sample (greedy, {args.sample_tokens} tokens):\n{sample}")
    results.update(
        {
            # New Code (pipeline) #
            "recipe": "pipeline_lm",
            "pipeline_schedule": args.pipeline_schedule,
            "num_microbatches": microbatches,
            "stages_per_process": stages_per_process,
            "pipeline/stages_of_processes": stages_of_processes,
            # Estimated compute of each process: the sum over its stages (a multi-stage schedule runs as fast as its
            # busiest process).
            "pipeline/process_cost_share": [
                sum(stage_costs[index] for index in indices) / sum(stage_costs) for indices in stages_of_processes
            ],
            # The share of each device's step time the schedule leaves idle with balanced stages, b / (m + b) for b
            # idle slots (ideal_bubble_slots): gpipe and 1f1b (p-1)/(m+p-1), interleaved1f1b (p-1)/(v*m+p-1), zbv 0.
            "pipeline/ideal_bubble_fraction": bubble_slots / (microbatches + bubble_slots),
            # The same bubble relative to the ideal compute time, b / m: Narayanan et al.'s (p-1)/(v*m).
            "pipeline/ideal_bubble_over_compute": bubble_slots / microbatches,
            # End New Code #
            "parallelism": parallelism.name,
            **run_facts(accelerator),  # num_processes, distributed_type, distributed/backend, device
            "num_stages": num_stages,
            "blocks_per_stage": blocks_per_stage,
            "stage_cost_share": [cost / sum(stage_costs) for cost in stage_costs],
            "mixed_precision": accelerator.mixed_precision,
            "model/num_parameters": num_parameters,
            "data/corpus": corpus,
            "data/train_blocks": len(train_dataset),
            "data/validation_blocks": len(eval_dataset),
            "data/tokens": token_counts,
            "global_batch_size": global_batch_size,
            "tokens_per_step": tokens_per_step,
            "completed_steps": completed_steps,
            "resumed_from_step": resume.completed_steps,
            "train/loss": loss_curve[-1] if loss_curve else None,
            "train/loss_curve": loss_curve,
            "eval/loss": eval_loss,
            "eval/perplexity": math.exp(eval_loss),
            "eval/num_blocks": num_blocks,
            "eval/num_tokens": num_tokens,
            "sample/prompt": args.sample_prompt,
            "sample/text": sample,
            **perf,
            "config": config,
        }
    )
    write_results(accelerator, output_dir, results)
    accelerator.print(f"wrote {output_dir / 'results.json'} and the model to {output_dir}")
    # Sync point: no process tears down its connections while another is still writing results (a peer that exits
    # early can make gloo abort the main process at exit, seen on 127.0.0.1).
    accelerator.wait_for_everyone()
    # (pipeline) No DDP wrapper to drop here (train_lm.py drops its own while the process group still exists: gloo
    # (pipeline) can deadlock in the DDP reducer's destructor at exit); this only lets go of our names for the stages,
    # (pipeline) optimizer and scheduler and empties the device cache (the schedule still holds the stages).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()


if __name__ == "__main__":
    main()
