"""The "dual-GPU training" tutorial example, done right: a linear model learns y = x·w + b + noise.

What the popular version gets wrong, and what this file does instead:
- the model is never wrapped in DDP, so each GPU trains its own copy  -> ``accelerator.prepare(model)``
  wraps it and gradients are averaged across processes after every backward;
- no distributed sampler, so both GPUs see the same samples            -> the prepared data loader
  gives each process its own shard of every global batch;
- shapes: ``nn.Linear(in, 1)`` returns (batch, 1) but targets are (batch,), and MSELoss silently
  broadcasts to (batch, batch)                                          -> targets are built as (batch, 1);
- every process prints and saves                                        -> ``accelerator.print`` and
  ``save_model`` act once, on the main process.

Launch (from the repository root):
    # CPU smoke run, or one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/linear_toy.py
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/linear_toy.py
    # two GPUs, one process (a linear model has nothing to split: it trains on one device):
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml recipes/linear_toy.py

Writes ``output_dir/results.json`` (metrics, learned and true weights, the resolved config) and
``output_dir/model.safetensors``.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

# The helper module: shared/ next to this file (a copied recipe) or one folder up (this repository), first on sys.path
# so that no installed package named "shared" shadows it.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
from shared.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from shared.hang_dump import HangDump  # noqa: E402
from shared.results import ThroughputMeter, write_results  # noqa: E402
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir",
        default="outputs/linear_toy",
        help="Where results.json and the weights go (created if missing).",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="Seed for the data set, the initial weights and the shuffling."
    )
    parser.add_argument("--num_samples", type=positive_int, default=4096, help="Size of the generated training set.")
    parser.add_argument(
        "--in_features", type=positive_int, default=8, help="Inputs per sample (number of true weights)."
    )
    parser.add_argument(
        "--noise_std", type=float, default=0.1, help="Standard deviation of the noise added to the targets."
    )
    parser.add_argument(
        "--per_device_train_batch_size", type=positive_int, default=32, help="Samples per process per forward pass."
    )
    parser.add_argument(
        "--gradient_accumulation_steps",
        type=positive_int,
        default=1,
        help="Forward/backward passes per optimizer step.",
    )
    parser.add_argument(
        "--num_train_epochs",
        type=positive_int,
        default=3,
        help="Passes over the training set (ignored if --max_train_steps is set).",
    )
    parser.add_argument(
        "--max_train_steps", type=positive_int, default=None, help="Stop after this many optimizer steps."
    )
    parser.add_argument("--learning_rate", type=positive_float, default=0.1, help="SGD learning rate.")
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
        help="Save the training state every N optimizer steps, or 'epoch'.",
    )
    parser.add_argument(
        "--checkpoints_total_limit", type=positive_int, default=None, help="Keep only the newest N checkpoints."
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help="A checkpoint folder, or 'latest' (newest complete one under output_dir/checkpoints; starts fresh if "
        "none).",
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
    return parser.parse_args(argv)


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    # (This Accelerator block repeats in every recipe on purpose: each recipe is one file you can
    # copy, and reads top to bottom without a jump into a helper that hides its settings.)
    # build_accelerator passes cpu=True when there is no CUDA, so a 2-process config gives real DDP
    # over gloo instead of two silent independent runs, and checks the process count.
    # Hang dumps: if a collective times out or a rank stops making progress, every rank that can still run writes
    # its stacks, step and collective to output_dir/debug/. Started first: NCCL reads its settings at start-up.
    hang_dump = HangDump(Path(args.output_dir) / "debug", args.dist_timeout)
    accelerator = build_accelerator(
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # A seedable sampler shuffles identically whatever the process count, which is what makes a
        # 2-process run comparable sample-for-sample with a 1-process run of the same global batch.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir)
    # Every process agrees on the checkpoint to resume from (a collective), before any work.
    checkpoints_dir = output_dir / "checkpoints"
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir)
    parallelism = choose_parallelism(accelerator, "auto", "recipes/linear_toy.py")
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")
    if parallelism.name == "device_map":
        accelerator.print(
            "parallelism: a linear model is one layer and has nothing to split, so it trains on one device"
        )
    trained_as = "single" if parallelism.name == "device_map" else parallelism.name

    # tokens per optimizer step would be the same arithmetic with sequence length; here it is samples:
    # global batch = per-device batch x processes x accumulation steps.
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    config = {**vars(args), "num_processes": accelerator.num_processes, "global_batch_size": global_batch_size}
    accelerator.print("config: " + json.dumps(config, sort_keys=True))

    # ------------------------------------------------------------------------------- data
    # Built identically on every process from the seed, so no process needs to send it to another.
    generator = torch.Generator().manual_seed(args.seed)
    true_weight = torch.randn(1, args.in_features, generator=generator)
    true_bias = torch.randn(1, generator=generator)
    inputs = torch.randn(args.num_samples, args.in_features, generator=generator)
    # Targets are (N, 1) to match the model's output: (N,) targets would broadcast to (N, N) in MSELoss.
    targets = (
        inputs @ true_weight.T + true_bias + args.noise_std * torch.randn(args.num_samples, 1, generator=generator)
    )
    # Its own generator: a DataLoader without one draws from the global RNG whenever it starts iterating.
    train_dataloader = DataLoader(
        TensorDataset(inputs, targets),
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    if len(train_dataloader) < accelerator.num_processes * args.gradient_accumulation_steps:
        raise RecipeError(
            f"One optimizer step needs {global_batch_size} samples ({args.per_device_train_batch_size} per device x "
            f"{accelerator.num_processes} processes x {args.gradient_accumulation_steps} accumulation steps) but the "
            f"data set has {args.num_samples}. Lower --per_device_train_batch_size or --gradient_accumulation_steps."
        )

    # ------------------------------------------------------------------------------ model
    model = torch.nn.Linear(args.in_features, 1)

    # ------------------------------------------------------------------ optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)

    # ------------------------------------------------------------------------------ prepare
    # Wraps the model in DDP (when there are several processes), moves it to the device, and shards
    # the data loader so each process gets a different slice of every global batch.
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    loss_function = torch.nn.MSELoss()

    # ---------------------------------------------------------------------- training loop
    # accumulate() also steps on the last, shorter group of an epoch, hence the ceiling division.
    steps_per_epoch = -(-len(train_dataloader) // args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_train_epochs = -(-max_train_steps // steps_per_epoch)
    resume = load_checkpoint(accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps)
    completed_steps, starting_epoch, batches_to_skip = resume.completed_steps, resume.epoch, resume.batches_to_skip
    first_step = completed_steps
    meter = ThroughputMeter(accelerator, warmup_steps=1)
    # The global mean loss of each optimizer step; a resumed run starts from the curve its checkpoint saved.
    loss_curve = list(resume.history.get("train/loss_curve", []))
    step_loss = torch.zeros((), device=accelerator.device)  # mean over this step's micro-batches
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        # Reseeds the shuffling for this epoch: same order on every process and after a resume.
        train_dataloader.set_epoch(epoch)
        active_dataloader = train_dataloader
        if epoch == starting_epoch and batches_to_skip:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, batches_to_skip)
        for inputs_batch, targets_batch in active_dataloader:
            # accumulate() skips the gradient all-reduce on all but the last micro-batch of a step and
            # steps the optimizer only then (no hand-rolled `step % gas == 0`).
            with accelerator.accumulate(model):
                loss = loss_function(model(inputs_batch), targets_batch)
                step_loss += loss.detach() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                # Sync point: reduce() and .item() wait for every process; cheap for a toy, but in a
                # big model you would log every N steps only.
                loss_curve.append(accelerator.reduce(step_loss, reduction="mean").item())
                step_loss.zero_()
                meter.step(samples=global_batch_size)
                hang_dump.step(completed_steps)
                if completed_steps % max(1, max_train_steps // 5) == 0 or completed_steps == max_train_steps:
                    accelerator.print(
                        f"epoch {epoch} step {completed_steps}/{max_train_steps} train/loss {loss_curve[-1]:.5f}"
                    )
                if isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0:
                    save_checkpoint(
                        accelerator,
                        checkpoints_dir,
                        completed_steps,
                        args.checkpoints_total_limit,
                        history={"train/loss_curve": loss_curve},
                    )
            if completed_steps >= max_train_steps:
                break
        if args.checkpointing_steps == "epoch" and completed_steps < max_train_steps:
            save_checkpoint(
                accelerator,
                checkpoints_dir,
                completed_steps,
                args.checkpoints_total_limit,
                history={"train/loss_curve": loss_curve},
            )
        if completed_steps >= max_train_steps:
            break

    # ------------------------------------------------------------------------- evaluation
    hang_dump.phase("evaluation")
    learned = accelerator.unwrap_model(model)
    learned_weight = learned.weight.detach().float().cpu()
    learned_bias = learned.bias.detach().float().cpu()
    weight_error = (learned_weight - true_weight).abs().max().item()
    accelerator.print(f"true    weight: {[round(w, 4) for w in true_weight[0].tolist()]}  bias {true_bias.item():.4f}")
    accelerator.print(
        f"learned weight: {[round(w, 4) for w in learned_weight[0].tolist()]}  bias {learned_bias.item():.4f}"
    )
    accelerator.print(
        f"max |learned - true| weight: {weight_error:.4f}; global batch size {global_batch_size} "
        f"= {args.per_device_train_batch_size} per device x {accelerator.num_processes} processes x "
        f"{args.gradient_accumulation_steps} accumulation steps"
    )

    # ------------------------------------------------------------------------------- save
    hang_dump.phase("saving")
    accelerator.wait_for_everyone()
    accelerator.save_model(model, output_dir)  # model.safetensors, written by the main process only
    results = {
        "recipe": "linear_toy",
        **run_facts(accelerator),  # num_processes, distributed_type, distributed/backend, device
        "parallelism": trained_as,
        "parallelism_requested": parallelism.name,
        "mixed_precision": accelerator.mixed_precision,
        "global_batch_size": global_batch_size,
        "completed_steps": completed_steps,
        "resumed_from_step": first_step,
        "train/loss": loss_curve[-1] if loss_curve else None,
        "train/loss_curve": loss_curve,
        "model/weight": learned_weight[0].tolist(),
        "model/bias": learned_bias.item(),
        "true/weight": true_weight[0].tolist(),
        "true/bias": true_bias.item(),
        "eval/max_abs_weight_error": weight_error,
        **meter.summary(),
        "config": config,
    }
    write_results(accelerator, output_dir, results)
    if accelerator.is_main_process:  # the files exist on machine 0 only in a multi-machine run
        print(f"wrote {output_dir / 'results.json'} and {output_dir / 'model.safetensors'}")
    # Sync point: no process tears down its connections while another is still writing results
    # (a peer that exits early can make gloo abort the main process at exit, seen on 127.0.0.1).
    accelerator.wait_for_everyone()
    # Drop the DDP wrapper while the process group still exists: a gloo group destroyed first can
    # deadlock in the DDP reducer's destructor at interpreter exit (seen with torch 2.13 on CPU).
    model, optimizer, train_dataloader = accelerator.free_memory(model, optimizer, train_dataloader)
    accelerator.end_training()


if __name__ == "__main__":
    main()
