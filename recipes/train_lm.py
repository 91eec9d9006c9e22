"""Train a GPT-style (Llama-architecture) language model on one device, two GPUs with DDP or FSDP2, or one model split
over two devices with a device_map: one training loop through ``accelerator.prepare()``, the launch config picks.

- ``single``     1 process, 1 device;
- ``ddp``        2 processes, a full replica each, each trains on its shard of every batch, gradients averaged;
- ``fsdp``       2 processes, data parallel like ddp, but each holds 1/2 of every parameter, gradient and optimizer
                 state (FSDP2 ``fully_shard`` per decoder block, through Accelerate): for models whose training state
                 does not fit on one device;
- ``device_map`` 1 process, the decoder blocks split over the devices, balanced by compute (embeddings on the first,
                 LM head + loss on the last, both counted); Accelerate's hooks move the activations. Only one device
                 computes at a time: it lets a model *fit*, it is not faster. ``recipes/pipeline_lm.py`` is this
                 recipe plus true pipeline parallelism, which makes a split pay.

``--parallelism auto`` follows the launch config: an FSDP config -> fsdp, 2 processes -> ddp, 1 process that sees >= 2
GPUs -> device_map, otherwise single. On a CPU-only machine every mode runs: device_map over two CPU "devices" with the
GPU code path (the same hooks), ddp and fsdp as 2 gloo processes (fsdp really sharded), one thread per process so that
one core stands in for one GPU.

Launch (from the repository root):
    # CPU smoke run, or one GPU (single):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/train_lm.py --model_size tiny \\
        --max_train_steps 20 --corpus_max_mb 1
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/train_lm.py --model_size 125m
    # two GPUs, fully sharded (FSDP2), with activation recomputation (on CPU: 2 gloo processes, really sharded):
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/train_lm.py --model_size 1.3b \\
        --gradient_checkpointing
    # two GPUs, one process, naive split (one GPU: split over the GPU and the CPU; no GPU: add --parallelism
    # device_map):
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml recipes/train_lm.py --model_size 1.3b

To use it in your project, copy recipes/train_lm.py, recipes/lm_kit/ and shared/ (and accelerate_configs/, which the
launch lines name): the kit beside the recipe, shared/ beside it or one folder up.

Writes to ``output_dir``: the model in Hugging Face format (``model.safetensors``, config, the tokenizer; FSDP shards
gathered into one), ``results.json`` (losses, ``eval/perplexity``, throughput, peak memory per device, the resolved
config) and, with ``--checkpointing_steps``, resumable checkpoints in ``checkpoints/step_N``, every N steps (or epoch)
and after the last step (under FSDP each process writes its shard).
"""

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
from shared.fsdp import check_offload_fits_host_ram, gathered_state_dict, set_wrap_at_blocks
from lm_kit.data import DATA_FLAGS, lm_datasets
from lm_kit.eval import NOT_EVALUATED, greedy_sample
from lm_kit.eval import perplexity_results
from lm_kit.training import BATCH_FLAGS, lm_dataloaders, resume_accumulation
from lm_kit.training import accelerator_settings, data_parallel_size_of
from lm_kit.model import MODEL_FLAGS, build_lm, lm_config, optimizer_groups, save_lm, whole_model

# Llama-architecture shapes by name (tiny to try, small for CPU, GPT-3's 125m/350m/1.3b): one table, which the fit
# planner (tools/plan.py) reads too.
from shared.presets import MODEL_PRESETS
from lm_kit.split import plan_lm_split
from shared.model_split import dispatch_on_devices, split_devices
from shared.results import RunRecord
from shared.flags import add_reliability_flags, flags, positive_float, positive_int, prepare_output_dir
from shared.accelerator import build_accelerator, fused_adamw, set_gpu_index
from shared.parallelism import choose_parallelism
from shared.errors import report_recipe_errors, install_peer_exit_hooks, set_stop_with_launcher
from shared.errors import RecipeError
from shared.fsdp import set_fsdp_on_cpu
from shared.signals import install_stop_on_signals


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--output_dir", default="outputs/train_lm", help="Model, results.json and checkpoints go here.")
    add("--seed", type=int, default=42, help="Seed of the initial weights and the data order.")
    add(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp", "device_map"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; 1 process seeing >= 2 GPUs: "
        "device_map; else single). device_map needs 1 process, ddp 2 or more, fsdp "
        "accelerate_configs/fsdp_2gpu.yaml.",
    )
    add(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each decoder block's activations in backward: less memory, ~1/3 more compute.",
    )
    add(
        "--compile",
        action="store_true",
        help="torch.compile the model (inductor, via Accelerate's dynamo_backend) in single, ddp and fsdp; "
        "attention already uses PyTorch's SDPA kernels (transformers' default).",
    )
    add = parser.add_argument_group("ddp").add_argument
    add(
        "--ddp_comm_hook",
        choices=["no", "bf16", "fp16"],
        default="no",
        help="Compress gradients to 16 bits for the all-reduce (Accelerate's DDPCommunicationHookType): half the "
        "bytes on the link, summed and averaged in 16-bit.",
    )
    add("--ddp_bucket_cap_mb", type=positive_int, default=25, help="All-reduce gradients in buckets of this many MB.")
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


def evaluate_lm(accelerator, model, eval_dataloader) -> dict:
    """Validation loss and perplexity over the whole validation set, each block once, in every mode.

    Per-block sums go through ``gather_for_metrics``, which drops the samples the sharded loader repeats to give every
    process a full last batch, so each block counts exactly once. (Not ``evaluate``'s perplexity metric: it loads a
    model of its own by name and runs it on one device; this is the trained, prepared model's loss.)"""
    model.eval()
    loss_sum, num_tokens, num_blocks = 0.0, 0, 0
    for batch in eval_dataloader:
        input_ids = batch["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits  # no KV cache: nothing generates here
        # Same loss as the model's own (shifted, float32), kept per block so blocks can be counted.
        per_block = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:].to(logits.device), reduction="none"
        ).sum(dim=1)
        tokens = torch.full_like(per_block, input_ids.shape[1] - 1)
        per_block, tokens = accelerator.gather_for_metrics((per_block, tokens))
        loss_sum += per_block.sum().item()  # sync point: .item() waits for the device
        num_tokens += int(tokens.sum().item())
        num_blocks += per_block.numel()
    return perplexity_results(accelerator, loss_sum, num_tokens, num_blocks)


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    set_stop_with_launcher()  # Linux: dies with its launcher (a SIGKILLed launcher cannot stop its workers)
    stop = install_stop_on_signals(Path(args.output_dir) / "checkpoints")  # SIGTERM, Ctrl-C: checkpoint, then exit
    install_peer_exit_hooks()  # 2+ processes: a rank another one stopped says so in one line
    set_gpu_index()  # one process on a GPU: env ACCELERATE_TORCH_DEVICE=cuda:N, so results say cuda:0, not cuda
    # The accumulation, decided before the Accelerator (it takes it): a resume's keeps its global batch and seed.
    data_parallel_size = data_parallel_size_of(args.parallelism)  # the launch's processes that split each batch
    args.gradient_accumulation_steps, batch_shape = resume_accumulation(
        args.output_dir, args.resume_from_checkpoint, data_parallel_size, **flags(args, BATCH_FLAGS)
    )
    accelerator = build_accelerator(
        dist_timeout=args.dist_timeout,
        gradient_accumulation_steps=args.gradient_accumulation_steps,  # batches per optimizer step
        mixed_precision=args.mixed_precision,
        # Not its checkpoint naming + total_limit: shared/checkpoints.py saves atomically and every process agrees.
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
        **accelerator_settings(args.seed, args.compile, args.ddp_bucket_cap_mb, args.ddp_comm_hook),  # sampler, DDP
    )
    set_fsdp_on_cpu(accelerator)  # CPU + FSDP config: Accelerate's state set back to FSDP2 (cpu=True drops it)
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    if accelerator.device.type == "cpu" and args.cpu_threads_per_process > 0:
        torch.set_num_threads(args.cpu_threads_per_process)  # one core per process stands in for one GPU
    eval_batch_size = args.per_device_eval_batch_size or args.per_device_train_batch_size
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/train_lm.py")
    if args.compile and parallelism.name == "device_map":  # regional compile: of blocks that prepare() wraps whole
        raise RecipeError(
            "--compile works on a model prepare() wraps whole (single, ddp, fsdp), not on a device_map: "
            "leave --compile out, or launch another way."
        )
    layout = "fsdp" if parallelism.name == "fsdp" else "replica"  # of checkpoints: FSDP shards, or whole weights
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")
    split_over = split_devices(accelerator.device) if parallelism.name == "device_map" else []
    num_stages = len(split_over) or 1
    model_config = lm_config(  # bad sizes fail now
        num_stages=num_stages, split_by=parallelism.name, **flags(args, MODEL_FLAGS)
    )
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
    if parallelism.name == "device_map":  # each part on its device; Accelerate's hooks move the activations
        model, _ = dispatch_on_devices(model, split.plan, split_over)

    # ------------------------------------------------------------------ optimizer and scheduler
    groups = optimizer_groups(model, args.weight_decay)  # weight decay on matrices only; fused: one kernel
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=fused_adamw(accelerator))
    # A data-parallel process sees every data_parallel_size-th batch; accumulate() also steps on an epoch's short end.
    steps_per_epoch = math.ceil(len(train_dataloader) // data_parallel_size / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    # A prepared scheduler steps once per data-parallel process per optimizer step: its length counts those steps.
    warmup, total = args.num_warmup_steps * data_parallel_size, max_train_steps * data_parallel_size
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total)

    # ------------------------------------------------------------------------------ prepare
    # ddp: DDP, sharded loaders; fsdp: fully_shard per block, then the rest; device_map: placement kept; single: moved.
    if parallelism.name == "fsdp":
        accelerator.print(f"fsdp: one unit per {set_wrap_at_blocks(accelerator, model, split.block_list) or 'config'}")
        check_offload_fits_host_ram(accelerator, model)  # offload config: refuse now, not at an OOM mid-run
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    evaluate = lambda: evaluate_lm(accelerator, model, eval_dataloader)
    # Restores the model, optimizer, scheduler and every process's RNG states (the scheduler's count in this run's).
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
    results |= {"parallelism_requested": args.parallelism, "device_map_devices": list(map(str, split_over))}
    results |= {"global_batch_size": global_batch_size, "tokens_per_step": tokens_per_step, "config": config}
    curve, devices = resume.history.get("train/loss_curve"), split_over or None  # a resume goes on with its curve
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
            # accumulate(): a step per N batches. use_cache=False: no KV cache (memory; --compile: graph per layer)
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss
                step_loss += loss.detach().float() / args.gradient_accumulation_steps
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                if accelerator.sync_gradients:
                    if args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                # The mean over the data-parallel processes' losses, left on the device: no sync in the step.
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
    state_dict = gathered_state_dict(accelerator, model)  # the whole weights on the main process (fsdp: gathered)
    final_model = accelerator.unwrap_model(model)
    if accelerator.is_main_process and parallelism.name == "fsdp":  # a plain model to sample from
        final_model = whole_model(model_config, state_dict)
    write = partial(save_lm, final_model, state_dict, data.tokenizer)  # config.json, model.safetensors, tokenizer
    save_final(accelerator, output_dir, write, output_dir / "checkpoints", state_dict)  # into place whole, or said

    # ------------------------------------------------------------------------- evaluation
    results |= NOT_EVALUATED if args.skip_eval else evaluate()  # every block once, in every mode
    results |= greedy_sample(accelerator, final_model, data.tokenizer, args.sample_prompt, args.sample_tokens)
    record.write(output_dir, results, model)  # a collective
    # Drop DDP while the process group lives: gloo can hang in DDP's destructor at exit (docs/troubleshooting.md).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
