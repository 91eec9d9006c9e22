"""The "dual-GPU training" tutorial example, done right: a linear model learns y = x·w + b + noise.

What the popular version gets wrong, and what this file does instead:
- the model is never wrapped in DDP, so each GPU trains its own copy -> ``accelerator.prepare(model)`` wraps it, and
  the gradients are averaged across processes after every backward;
- no distributed sampler, so both GPUs see the same samples -> the prepared data loader gives each process its own
  shard of every global batch;
- ``nn.Linear(in, 1)`` returns (batch, 1) but the targets are (batch,), and MSELoss silently broadcasts them to
  (batch, batch) -> the targets are built as (batch, 1);
- every process prints and saves -> ``accelerator.print`` and ``save_model`` act once, on the main process.

One file: copy recipes/linear_toy.py (and accelerate_configs/, which the launch lines name). Launch (from the root):
    # CPU smoke run, or one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/linear_toy.py
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/linear_toy.py
    # two GPUs, one process (a linear model has nothing to split: it trains on one device):
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml recipes/linear_toy.py

Writes ``output_dir/model.safetensors`` and ``output_dir/results.json`` (losses, weights, speed, the config), and
with ``--checkpointing_steps N`` a resumable checkpoint every N steps (``--resume_from_checkpoint latest``).
"""

import argparse
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, gather_object, set_seed
from torch.utils.data import DataLoader, TensorDataset


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return int(text)


def positive_float(text: str) -> float:
    if not float(text) > 0:  # (a ValueError: argparse says "invalid positive_float value")
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return float(text)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--output_dir", default="outputs/linear_toy", help="results.json and the weights go here (created if needed).")
    add("--seed", type=int, default=42, help="Seed for the data set, the initial weights and the shuffling.")
    add("--num_samples", type=positive_int, default=4096, help="Size of the generated training set.")
    add("--in_features", type=positive_int, default=8, help="Inputs per sample (number of true weights).")
    add("--per_device_train_batch_size", type=positive_int, default=32, help="Samples per process per forward pass.")
    add("--gradient_accumulation_steps", type=positive_int, default=1, help="Forward/backward passes per step.")
    add("--num_train_epochs", type=positive_int, default=3, help="Passes over the data (unless --max_train_steps).")
    add("--max_train_steps", type=positive_int, default=None, help="Stop after this many optimizer steps.")
    add("--logging_steps", type=positive_int, default=50, help="Print the loss every N optimizer steps.")
    add("--learning_rate", type=positive_float, default=0.1, help="SGD learning rate.")
    add("--checkpointing_steps", type=positive_int, default=None, help="Save a checkpoint every N optimizer steps.")
    add("--resume_from_checkpoint", default=None, help="A checkpoint folder, or 'latest' (the newest one saved).")
    return parser.parse_args(argv)


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    # Without CUDA a plain Accelerator() under a 2-process config does NOT start DDP: each process would train alone
    # on all the data. cpu=True joins them over gloo; the check below catches any other way to lose a process.
    # Seedable sampler: one shuffle whatever the process count, so 2 processes match 1 process sample for sample.
    seedable = DataLoaderConfiguration(use_seedable_sampler=True)
    cpu = not torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=cpu, gradient_accumulation_steps=args.gradient_accumulation_steps, dataloader_config=seedable
    )
    if accelerator.num_processes != (expected := int(os.environ.get("WORLD_SIZE", "1"))):
        raise SystemExit(f"error: {expected} processes launched, {accelerator.num_processes} joined: each alone")
    set_seed(args.seed)
    output_dir, checkpoints_dir = Path(args.output_dir), Path(args.output_dir) / "checkpoints"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"error: Cannot use --output_dir {args.output_dir!r}: {error.strerror}.") from None
    # Samples per optimizer step (with sequences, x sequence length gives the tokens).
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps

    # ------------------------------------------------------------------------------- data
    # Built identically on every process from the seed, so no process needs to send it to another.
    generator = torch.Generator().manual_seed(args.seed)
    true_weight, true_bias = torch.randn(1, args.in_features, generator=generator), torch.randn(1, generator=generator)
    inputs = torch.randn(args.num_samples, args.in_features, generator=generator)
    # Targets are (N, 1) to match the model's output: (N,) targets would broadcast to (N, N) in MSELoss.
    targets = inputs @ true_weight.T + true_bias + 0.1 * torch.randn(args.num_samples, 1, generator=generator)
    # Its own generator: a DataLoader without one draws from the global RNG whenever it starts iterating.
    shuffling = torch.Generator().manual_seed(args.seed)
    train_dataloader = DataLoader(
        TensorDataset(inputs, targets), args.per_device_train_batch_size, shuffle=True, generator=shuffling
    )
    if len(train_dataloader) < accelerator.num_processes * args.gradient_accumulation_steps:
        raise SystemExit(f"error: One optimizer step needs {global_batch_size} samples; --num_samples is smaller.")

    # ------------------------------------------------------------------------------ model
    model = torch.nn.Linear(args.in_features, 1)

    # ------------------------------------------------------------------ optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)

    # ------------------------------------------------------------------------------ prepare
    # DDP around the model (several processes), on the device; each process gets its own slice of every global batch.
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)

    # ---------------------------------------------------------------------- training loop
    # accumulate() also steps on the last, shorter group of an epoch, hence the ceiling.
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    completed_steps, loss_curve, step_times = 0, [], []  # loss: the global mean loss of every optimizer step
    latest = max(checkpoints_dir.glob("step_*"), default=None, key=lambda path: int(path.name[5:]))  # None: start
    checkpoint = latest if args.resume_from_checkpoint == "latest" else args.resume_from_checkpoint
    if checkpoint:  # the model, optimizer, sampler and RNG states, then how far the run got
        accelerator.load_state(str(checkpoint))
        completed_steps = len(loss_curve := json.loads((Path(checkpoint) / "loss_curve.json").read_text()))
        accelerator.print(f"resumed from {checkpoint} at step {completed_steps}")
    step_loss, started = torch.zeros((), device=accelerator.device), time.perf_counter()
    for epoch in range(completed_steps // steps_per_epoch, math.ceil(max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)  # reseeds the shuffling: same order on every process and after a resume
        skip = (completed_steps % steps_per_epoch) * args.gradient_accumulation_steps  # seen before the resume
        active_dataloader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for inputs_batch, targets_batch in active_dataloader:
            # accumulate(): no all-reduce but on a step's last micro-batch, the only one that steps (no `step % gas`).
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs_batch), targets_batch)
                step_loss += loss.detach() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            # Sync point: reduce() and .item() wait for every process (cheap here; big models log every N steps).
            loss_curve.append(accelerator.reduce(step_loss, "mean").item())
            step_loss.zero_()
            step_times.append(-started + (started := time.perf_counter()))  # this step's seconds
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                accelerator.print(f"epoch {epoch} step {completed_steps}/{max_train_steps}: {loss_curve[-1]:.5f}")
            if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                folder = checkpoints_dir / f"step_{completed_steps}"  # every process saves its RNG state there
                accelerator.save_state(str(folder))
                if accelerator.is_main_process:  # the losses so far: their count is the steps done
                    (folder / "loss_curve.json").write_text(json.dumps(loss_curve))
            if completed_steps >= max_train_steps:
                break

    # --------------------------------------------------------------------- evaluation
    learned = accelerator.unwrap_model(model)
    weight, bias = learned.weight.detach().float().cpu()[0], learned.bias.detach().float().cpu()
    weight_error = (weight - true_weight[0]).abs().max().item()
    accelerator.print(f"true    weight: {[round(w, 4) for w in true_weight[0].tolist()]}  bias {true_bias.item():.4f}")
    accelerator.print(f"learned weight: {[round(w, 4) for w in weight.tolist()]}  bias {bias.item():.4f}")
    accelerator.print(
        f"max |learned - true| weight: {weight_error:.4f}; global batch size {global_batch_size} = "
        f"{args.per_device_train_batch_size} per device x {accelerator.num_processes} processes x "
        f"{args.gradient_accumulation_steps} accumulation steps"
    )

    # --------------------------------------------------------------------------- save
    accelerator.wait_for_everyone()
    accelerator.save_model(model, output_dir)  # model.safetensors, written by the main process only
    # Peak memory per process (a collective): CUDA's allocator, or the CPU process's peak resident set (Linux: KiB).
    cuda, several = accelerator.device.type == "cuda", accelerator.num_processes > 1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = (str(accelerator.device), torch.cuda.max_memory_allocated(accelerator.device)) if cuda else ("cpu", rss)
    gathered = gather_object([peak])
    peaks = {(f"rank{r}/" if several else "") + n: round(b / 2**30, 4) for r, (n, b) in enumerate(gathered)}
    measured = step_times[2:]  # the first steps warm up (allocation, the first all-reduce)
    results = {"recipe": "linear_toy", "parallelism": "ddp" if several else "single", "config": vars(args)}
    results |= {"num_processes": accelerator.num_processes, "device": str(accelerator.device)}
    results |= {"distributed_type": accelerator.distributed_type.value, "mixed_precision": accelerator.mixed_precision}
    results |= {"distributed/backend": torch.distributed.get_backend() if several else None, "memory/peak_gib": peaks}
    results |= {"perf/step_time_s": sum(measured) / len(measured) if measured else None}
    results |= {"perf/samples_per_sec": global_batch_size * len(measured) / sum(measured) if measured else None}
    results |= {"global_batch_size": global_batch_size, "completed_steps": completed_steps}
    results |= {"train/loss": loss_curve[-1], "train/loss_curve": loss_curve}
    results |= {"eval/max_abs_weight_error": weight_error, "model/weight": weight.tolist(), "model/bias": bias.item()}
    results |= {"true/weight": true_weight[0].tolist(), "true/bias": true_bias.item()}
    if accelerator.is_main_process:  # the files exist on machine 0 only in a multi-machine run
        (output_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"wrote {output_dir / 'results.json'} and {output_dir / 'model.safetensors'}")
    # Drop DDP while the process group lives: gloo can deadlock in DDP's destructor at exit (torch 2.13, CPU).
    model, optimizer, train_dataloader = accelerator.free_memory(model, optimizer, train_dataloader)
    accelerator.end_training()


if __name__ == "__main__":
    main()
