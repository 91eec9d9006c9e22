# New Code (pipeline) #
"""Train a GPT-style (Llama-architecture) language model with pipeline parallelism: GPipe, 1F1B, interleaved, ZB-V.
torch.distributed.pipelining over m micro-batches, one or several stages per process. This is
``recipes/train_lm.py`` plus the lines between ``# New Code (pipeline) #`` and ``# End New Code #``, and comments
marked ``# (pipeline)`` where train_lm.py's comment is not true of a pipeline; every other line is identical to it,
so ``diff recipes/train_lm.py recipes/pipeline_lm.py`` shows exactly what pipelining adds and changes.

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

To use it in your project, copy recipes/pipeline_lm.py, recipes/lm_kit/, recipes/pipeline_kit/ and shared/ (and
accelerate_configs/, which the launch lines name): the kits beside the recipe, shared/ beside it or one folder up.

Writes to ``output_dir``: the model in Hugging Face format (the stages gathered into one), ``results.json`` (as
train_lm.py, plus the schedule, m, the stages each process holds and the ideal bubble fraction) and, with
``--checkpointing_steps``, checkpoints in ``checkpoints/step_N``, every N steps (or epoch) and after the last step, in
which every stage saves its own part.
"""
# End New Code #

import argparse
import json
import logging
import math
import sys
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import ProjectConfiguration, set_seed

# bitsandbytes (PEFT imports it) warns on each CPU process of an optional kernel it lacks: docs/troubleshooting.md
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import get_scheduler

# shared/ (beside this file in a copy, or one folder up here) and this recipe's kits go first on sys.path, so that no
# installed package of those names shadows them; this folder too, for an import that is not a run.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
sys.path.insert(0, str(HERE))
from shared.checkpoints import load_checkpoint, save_checkpoint, save_final, set_start_checkpoint
from lm_kit.data import DATA_FLAGS, lm_datasets
from lm_kit.eval import NOT_EVALUATED, greedy_sample
from lm_kit.training import BATCH_FLAGS, lm_dataloaders, resume_accumulation
from lm_kit.model import MODEL_FLAGS, build_lm, lm_config, optimizer_groups, save_lm, whole_model

# Llama-architecture shapes by name (tiny to try, small for CPU, GPT-3's 125m/350m/1.3b): one table, which the fit
# planner (tools/plan.py) reads too.
from shared.presets import MODEL_PRESETS
from lm_kit.split import plan_lm_split

# New Code (pipeline) #
# The pipeline's machinery around torch.distributed.pipelining (stage modules, schedules, stage checkpoints, the
# cross-stage clip and the gather of the stages' weights).
from pipeline_kit.pipeline import (
    SCHEDULES,
    PIPELINE_FLAGS,
    StageCheckpoints,
    build_pipeline,
    build_stage_modules,
    check_pipeline_model,
    check_pipeline_request,
    clip_grad_norm_across_stages,
    evaluate_pipeline,
    gather_full_state_dict,
    stage_layout,
    unsharded,
)

# End New Code #
from shared.results import RunRecord
from shared.flags import add_reliability_flags, flags, positive_float, positive_int, prepare_output_dir
from shared.accelerator import build_accelerator, fused_adamw, set_gpu_index
from shared.parallelism import choose_parallelism
from shared.errors import report_recipe_errors, install_peer_exit_hooks, set_stop_with_launcher
from shared.signals import install_stop_on_signals


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    # New Code (pipeline) #
    add("--output_dir", default="outputs/pipeline_lm", help="Model, results.json and checkpoints go here.")
    # End New Code #
    add("--seed", type=int, default=42, help="Seed of the initial weights and the data order.")
    add(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each decoder block's activations in backward: less memory, ~1/3 more compute.",
    )
    # New Code (pipeline) #
    add = parser.add_argument_group("pipeline").add_argument
    add(
        "--pipeline_schedule",
        choices=list(SCHEDULES),
        default="1f1b",
        help="gpipe: all forwards, then all backwards (bubble (p-1)/(m+p-1) of the step, m micro-batches' "
        "activations live); 1f1b: one forward, one backward (same bubble, at most p micro-batches' "
        "activations); interleaved1f1b: 1F1B over --stages_per_process v stages per process (bubble "
        "(p-1)/(v*m+p-1), v times the sends, up to p+(p-1)/v micro-batches' activations); zbv: zero-bubble "
        "ZB-V, 2 stages per process in a V, backward split into input and weight gradients that fill the "
        "bubble (ideally none, m >= 2p-1).",
    )
    add(
        "--num_microbatches",
        type=positive_int,
        default=4,
        help="Micro-batches per batch; the batch must divide evenly. More: a smaller bubble, smaller matmuls.",
    )
    add(
        "--stages_per_process",
        type=positive_int,
        help="Pipeline stages (model chunks) each process holds, for interleaved1f1b (default 2) and zbv (exactly "
        "2); gpipe and 1f1b hold 1. The model is cut into processes x this many stages of whole decoder "
        "blocks.",
    )
    # End New Code #
    add = parser.add_argument_group("model").add_argument
    add("--model_size", choices=list(MODEL_PRESETS), default="small", help="Shape to train from scratch.")
    add("--num_layers", type=positive_int, help="Override the preset's number of decoder blocks.")
    add("--model_name_or_path", help="Start from pretrained weights (a Hub id or a folder this recipe saved).")
    add = parser.add_argument_group("data").add_argument
    add("--vocab_size", type=positive_int, default=8192, help="Byte-level BPE trained on the text.")
    add("--dataset_name", help="A Hub dataset with a text column. Default: the offline stdlib corpus.")
    add("--dataset_config_name", help="The Hub dataset's configuration name, if it has several.")
    add("--train_file", help="A text file to train on (one example per line, line breaks kept).")
    add("--validation_file", help="A text file to validate on (default: the end of --train_file).")
    add(
        "--validation_split_percentage",
        type=positive_float,
        default=5,
        help="Share held out for validation when there is no validation split (default corpus: every k-th file).",
    )
    add("--corpus_max_mb", type=positive_float, help="Only the first N MB of the default corpus (~11 MB in all).")
    add("--block_size", type=positive_int, default=256, help="Tokens per (packed) training sequence.")
    add("--max_train_samples", type=positive_int, help="Use only the first N training blocks.")
    add("--max_eval_samples", type=positive_int, help="Use only the first N validation blocks.")
    add = parser.add_argument_group("training").add_argument
    add("--per_device_train_batch_size", type=positive_int, default=16, help="Blocks per forward.")
    add("--per_device_eval_batch_size", type=positive_int, help="Default: the training batch size.")
    add(
        "--gradient_accumulation_steps",
        type=positive_int,
        help="Forward/backward passes per optimizer step (default: 1; on a resume, what keeps the checkpoint's "
        "global batch in this process count).",
    )
    add("--num_train_epochs", type=positive_int, default=1, help="Passes over the training set.")
    add("--max_train_steps", type=positive_int, help="Stop after N steps (overrides the epochs).")
    add("--logging_steps", type=positive_int, default=10, help="Print train/loss every N steps.")
    add("--learning_rate", type=positive_float, default=1e-3, help="Peak AdamW learning rate.")
    add("--weight_decay", type=float, default=0.1, help="AdamW weight decay (matrices only).")
    add("--max_grad_norm", type=float, default=1.0, help="Clip the global gradient norm (0: no).")
    add(
        "--lr_scheduler_type",
        default="cosine",
        choices=["linear", "cosine", "constant", "constant_with_warmup"],
        help="Learning-rate schedule (transformers.get_scheduler).",
    )
    add("--num_warmup_steps", type=int, default=0, help="Linear warm-up, in optimizer steps.")
    add(
        "--mixed_precision",
        choices=["no", "fp16", "bf16"],
        help="Override the config's mixed precision (bf16 also works on CPU; fp16 needs a GPU).",
    )
    add_reliability_flags(parser)  # --checkpointing_steps, --resume_from_checkpoint, --dist_timeout, ...
    add = parser.add_argument_group("evaluation and measurement").add_argument
    add("--eval_before_training", action="store_true", help="Also measure perplexity before step 1.")
    add("--skip_eval", action="store_true", help="No final evaluation (eval/* NaN): speed runs.")
    add("--perf_warmup_steps", type=int, default=2, help="Steps left out of the throughput numbers (start-up costs).")
    add(
        "--cpu_threads_per_process",
        type=int,
        default=1,
        help="On CPU: PyTorch threads per process (1 = one core stands in for one GPU; 0 = PyTorch's default).",
    )
    add("--sample_prompt", default="def ", help="Prompt of the greedy sample printed at the end.")
    add("--sample_tokens", type=int, default=24, help="Tokens the sample generates (0: no sample).")
    return parser.parse_args(argv)


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    set_stop_with_launcher()  # Linux: dies with its launcher (a SIGKILLed launcher cannot stop its workers)
    stop = install_stop_on_signals(Path(args.output_dir) / "checkpoints")  # SIGTERM, Ctrl-C: checkpoint, then exit
    install_peer_exit_hooks()  # 2+ processes: a rank another one stopped says so in one line
    set_gpu_index()  # one process on a GPU: env ACCELERATE_TORCH_DEVICE=cuda:N, so results say cuda:0, not cuda
    # The accumulation, decided before the Accelerator (it takes it): a resume's keeps its global batch and seed.
    # New Code (pipeline) #
    data_parallel_size = 1  # every process reads every batch: a pipeline shards the model, not the data
    # End New Code #
    args.gradient_accumulation_steps, batch_shape = resume_accumulation(
        args.output_dir, args.resume_from_checkpoint, data_parallel_size, **flags(args, BATCH_FLAGS)
    )
    accelerator = build_accelerator(
        dist_timeout=args.dist_timeout,
        gradient_accumulation_steps=args.gradient_accumulation_steps,  # batches per optimizer step
        mixed_precision=args.mixed_precision,
        # Not its checkpoint naming + total_limit: shared/checkpoints.py saves atomically and every process agrees.
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    if accelerator.device.type == "cpu" and args.cpu_threads_per_process > 0:
        torch.set_num_threads(args.cpu_threads_per_process)  # one core per process stands in for one GPU
    eval_batch_size = args.per_device_eval_batch_size or args.per_device_train_batch_size
    # New Code (pipeline) #
    parallelism = choose_parallelism(accelerator, "pipeline", "recipes/pipeline_lm.py")  # refuses 1 process, FSDP
    layout, num_processes = "pipeline", accelerator.num_processes  # checkpoints: each process saves its own stages
    stages_per_process = check_pipeline_request(
        pipeline_schedule=args.pipeline_schedule,
        num_microbatches=args.num_microbatches,
        stages_per_process=args.stages_per_process,
        per_device_train_batch_size=args.per_device_train_batch_size,
        eval_batch_size=eval_batch_size,
        num_processes=num_processes,
        mixed_precision=accelerator.mixed_precision,
    )
    stages_of_processes = stage_layout(args.pipeline_schedule, num_processes, stages_per_process)  # [[0, 2], [1, 3]]
    num_stages, stage_indices = num_processes * stages_per_process, stages_of_processes[accelerator.process_index]
    check = partial(check_pipeline_model, stages_of_processes)  # decoders whose stages build_stage_modules can cut
    model_config = lm_config(num_stages=num_stages, split_by=parallelism.name, check=check, **flags(args, MODEL_FLAGS))
    # End New Code #
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")
    checkpoint = set_start_checkpoint(accelerator, args.resume_from_checkpoint, output_dir / "checkpoints", layout)

    # ------------------------------------------------------------------------------- data
    data = lm_datasets(  # text, tokenizer, blocks
        accelerator, data_parallel_size, output_dir, checkpoint, **flags(args, DATA_FLAGS)
    )
    train_dataloader, eval_dataloader = lm_dataloaders(
        data, args.per_device_train_batch_size, eval_batch_size, accelerator.device
    )

    # ------------------------------------------------------------------------------ model
    model = build_lm(args.model_name_or_path, model_config, data.tokenizer, args.seed)  # pretrained, or new weights
    split = plan_lm_split(model, num_stages, args.block_size)  # whole blocks per part, balanced by compute
    accelerator.print(split.description)
    if args.gradient_checkpointing:  # before the split and prepare(); non-reentrant: the reentrant one breaks DDP
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # New Code (pipeline) #
    model = build_stage_modules(model, split.blocks_per_stage, stage_indices).to(accelerator.device)  # its stages
    # End New Code #

    # ------------------------------------------------------------------ optimizer and scheduler
    groups = optimizer_groups(model, args.weight_decay)  # weight decay on matrices only; fused: one kernel
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=fused_adamw(accelerator))
    steps_per_epoch = math.ceil(len(train_dataloader) // data_parallel_size / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    warmup, total = args.num_warmup_steps * data_parallel_size, max_train_steps * data_parallel_size
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total)

    # ------------------------------------------------------------------------------ prepare
    # New Code (pipeline) #
    # No prepare(): it would wrap stages in DDP, shard loaders (each stage needs each batch), step the scheduler p×.
    train_dataloader, eval_dataloader = unsharded([train_dataloader, eval_dataloader], accelerator.device, args.seed)
    pipeline = build_pipeline(accelerator, model, stages_of_processes, **flags(args, PIPELINE_FLAGS))  # its schedules
    StageCheckpoints.register(accelerator, model, optimizer, lr_scheduler, split.blocks_per_stage, stages_of_processes)
    evaluate = lambda: evaluate_pipeline(accelerator, pipeline, eval_dataloader, eval_batch_size)
    # End New Code #
    # (pipeline) Restores the stages, their optimizer and scheduler (the hooks above) and every process's RNG states.
    unchanged = {"training_examples": len(data.train_dataset)}  # its number orders the shuffle: a resume keeps it
    resume = load_checkpoint(
        accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps, lr_scheduler, unchanged=unchanged
    )

    # ---------------------------------------------------------------------- training loop
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel_size
    tokens_per_step = global_batch_size * args.block_size  # = batch x block x accumulation x data parallel
    cpu_threads = torch.get_num_threads() if accelerator.device.type == "cpu" else None
    config = vars(args) | {"parallelism_resolved": parallelism.name, "max_train_steps_resolved": max_train_steps}
    config |= {"model_config": model_config.to_diff_dict(), "cpu_threads": cpu_threads}
    before = {"eval/perplexity_before_training": evaluate()["eval/perplexity"]} if args.eval_before_training else {}
    results = {"recipe": Path(__file__).stem, "parallelism": parallelism.name, **split.facts(), **data.facts, **before}
    results |= {"global_batch_size": global_batch_size, "tokens_per_step": tokens_per_step, "config": config}
    # New Code (pipeline) #
    results |= pipeline.facts(stages_of_processes, split.stage_costs)  # the schedule, m, the ideal bubble
    curve, devices = resume.history.get("train/loss_curve"), None  # a resume goes on with its curve
    # End New Code #
    record = RunRecord(accelerator, max_train_steps, curve, args.perf_warmup_steps, devices)  # losses, speed, memory
    accelerator.print(f"config: {json.dumps(config, sort_keys=True, default=str)}")
    # Each checkpoint saves the whole loss curve so far (reading it waits for the device): a resume goes on.
    saving = dict(total_limit=args.checkpoints_total_limit, layout=layout, batch=batch_shape, unchanged=unchanged)
    save = partial(save_checkpoint, accelerator, output_dir / "checkpoints", **saving)
    save_checkpoint_at = lambda step: save(step, history={"train/loss_curve": record.losses()})
    every = steps_per_epoch if args.checkpointing_steps == "epoch" else args.checkpointing_steps
    completed_steps, step_loss = resume.completed_steps, torch.zeros((), device=accelerator.device)
    for epoch in range(resume.epoch, math.ceil(max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)  # the shuffling seed is data_seed + epoch, also when skipping below
        skip = resume.batches_to_skip if epoch == resume.epoch else 0  # a resumed epoch: the batches already seen
        active_dataloader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for batch in record.timed(active_dataloader):  # timed: measures the wait for each batch
            if completed_steps >= max_train_steps:  # done, or resumed from the checkpoint of the last step
                break
            # (pipeline) accumulate(): a step every gradient_accumulation_steps batches or at the loader's end
            with accelerator.accumulate(model):
                # New Code (pipeline) #
                step_loss += pipeline.step(batch["input_ids"])  # every micro-batch through every stage, in its order
                # End New Code #
                if accelerator.sync_gradients:
                    if args.max_grad_norm > 0:
                        # New Code (pipeline) #
                        clip_grad_norm_across_stages(model.parameters(), args.max_grad_norm, accelerator.device)
                        # End New Code #
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                # (pipeline) The sum: only the process with the last stage has the loss, the others 0.
                loss = accelerator.reduce(step_loss, reduction="sum") / data_parallel_size
                step_loss.zero_()
                record.step(completed_steps, loss, samples=global_batch_size, tokens=tokens_per_step)
                if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                    loss = record.losses()[-1]  # sync point: reading the losses waits for the device
                    accelerator.print(f"step {completed_steps}/{max_train_steps}: train/loss {loss:.4f}")
                if stop.requested(completed_steps):  # SIGTERM or Ctrl-C to any process: all stop after this step
                    stop.exit(save_checkpoint_at(completed_steps))
                # And after the last step (once): a requeue of the finished run resumes there, retraining nothing.
                if every and (completed_steps % every == 0 or completed_steps == max_train_steps):
                    save_checkpoint_at(completed_steps)

    # ------------------------------------------------------------------------------- save
    # Before the evaluation: nothing that can fail after the last optimizer step may lose the trained weights.
    # New Code (pipeline) #
    state_dict = gather_full_state_dict(model)  # every process's stages, on the main process (a collective)
    final_model = whole_model(model_config, state_dict) if accelerator.is_main_process else None
    # End New Code #
    write = partial(save_lm, final_model, state_dict, data.tokenizer)  # config.json, model.safetensors, tokenizer
    save_final(accelerator, output_dir, write, output_dir / "checkpoints", state_dict)  # into place whole, or said

    # ------------------------------------------------------------------------- evaluation
    results |= NOT_EVALUATED if args.skip_eval else evaluate()  # every block once, in every mode
    results |= greedy_sample(accelerator, final_model, data.tokenizer, args.sample_prompt, args.sample_tokens)
    record.write(output_dir, results, model)  # a collective
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
