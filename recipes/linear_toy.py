"""The "dual-GPU training" tutorial example, done right: a linear model learns y = x·w + b + noise.

What the popular version gets wrong, and what this file does instead:
- the model is never wrapped in DDP, so each GPU trains its own copy -> ``accelerator.prepare(model)`` wraps it:
  gradients are averaged across processes after every backward;
- no distributed sampler, so both GPUs see the same samples -> the prepared loader shards every global batch;
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
with ``--checkpointing_steps N`` a resumable checkpoint every N steps and after the last (``--resume_from_checkpoint
latest``). SIGTERM (a preemption notice) or Ctrl-C ends the step, saves a checkpoint and says how to resume.
"""

import argparse
import json
import math
import os
import resource
import shutil
import signal
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, gather_object, set_seed
from torch.utils.data import DataLoader, TensorDataset

RESUME = "resume from the newest checkpoint with the same command and --resume_from_checkpoint latest"


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
    add("--overwrite_output_dir", action="store_true", help="Replace the run the --output_dir holds (else refused).")
    add("--seed", type=int, default=42, help="Seed for the data set, the initial weights and the shuffling.")
    add("--num_samples", type=positive_int, default=4096, help="Size of the generated training set.")
    add("--in_features", type=positive_int, default=8, help="Inputs per sample (number of true weights).")
    add("--per_device_train_batch_size", type=positive_int, default=32, help="Samples per process per forward pass.")
    add("--gradient_accumulation_steps", type=positive_int, default=1, help="Forward/backward passes per step.")
    add("--num_train_epochs", type=positive_int, default=3, help="Passes over the data (unless --max_train_steps).")
    add("--max_train_steps", type=positive_int, default=None, help="Stop after this many optimizer steps.")
    add("--logging_steps", type=positive_int, default=50, help="Print the loss every N optimizer steps.")
    add("--learning_rate", type=positive_float, default=0.1, help="SGD learning rate.")
    add("--checkpointing_steps", type=positive_int, help="Save a checkpoint every N optimizer steps and the last one.")
    add("--resume_from_checkpoint", default=None, help="A checkpoint folder, or 'latest' (the newest one saved).")
    return parser.parse_args(argv)


def refuse(accelerator: Accelerator, message: str) -> None:  # every process stops; the message printed once
    raise SystemExit(f"error: {message}" if accelerator.is_main_process else 1)


def save_atomically(accelerator: Accelerator, folder: Path, save, texts: dict, checkpoints_dir: Path) -> None:
    """``save(tmp)`` on every process, the main process's ``texts`` (name: text) beside, then tmp's files moved into
    ``folder`` (progress.json last): a kill or full disk never leaves a half-written file there, and a failed write
    stops every process with one line."""
    tmp, error = folder / ".saving.tmp", None  # inside: the same disk, and a step_N without progress.json is skipped
    try:
        save(str(tmp))
        for name, text in texts.items() if accelerator.is_main_process else ():
            (tmp / name).write_text(text)
    except Exception as failed:  # a full disk (OSError, or safetensors' and torch.save's errors): the space left
        error = f"{getattr(failed, 'strerror', None) or failed}, {shutil.disk_usage(folder.parent).free:,} bytes free"
    if error := next(filter(None, gather_object([error])), None):
        shutil.rmtree(tmp, ignore_errors=True)
        newest = max(checkpoints_dir.glob("step_*/progress.json"), key=lambda p: int(p.parent.name[5:]), default=None)
        kept = f"the newest checkpoint is {newest.parent}" if newest else "no checkpoint was saved"
        refuse(accelerator, f"saving {folder} failed ({error}); all saved before is kept, {kept}: {RESUME}")
    if accelerator.is_main_process:
        for entry in sorted(tmp.iterdir(), key=lambda entry: entry.name == "progress.json"):
            os.replace(entry, folder / entry.name)
        tmp.rmdir()
    accelerator.wait_for_everyone()


def resume(accelerator: Accelerator, checkpoints_dir: Path, resume_from_checkpoint: str, run: dict) -> list[float]:
    """Load the checkpoint (``latest``: the newest complete one, or none) on every process; return its loss curve. One
    that does not load everywhere, or of another run's flags or process count, is refused in one line."""
    complete = sorted((p.parent for p in checkpoints_dir.glob("step_*/progress.json")), key=lambda f: int(f.name[5:]))
    folder = (complete or [None])[-1] if resume_from_checkpoint == "latest" else Path(resume_from_checkpoint)
    try:
        progress = json.loads((folder / "progress.json").read_text()) if folder else {"run": run, "loss_curve": []}
        why = None if progress["run"] == run else f"it holds a run of {progress['run']}, this one is {run}"
        if folder and not why:
            accelerator.load_state(str(folder))  # the model, optimizer, sampler and RNG states
    except Exception as error:  # a missing, truncated or unreadable file
        why = f"it does not load ({type(error).__name__}: {str(error)[:150]}); pass an earlier one"
    if why := next(filter(None, gather_object([why])), None):
        refuse(accelerator, f"cannot resume from {folder}: {why}.")
    accelerator.print(f"resumed from {folder} at step {len(progress['loss_curve'])}" if folder else "starting fresh")
    return progress["loss_curve"]


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()
    stop = {"signal": 0}  # SIGTERM (a preemption notice), Ctrl-C: the step ends, a checkpoint is saved, then exit
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda number, frame: stop.update(signal=stop["signal"] or number))

    # ------------------------------------------------------------------ Accelerator and seed
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without CUDA: else a 2-process launch starts no DDP, each process alone
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # one shuffle in any process count
    )
    if accelerator.num_processes != (expected := int(os.environ.get("WORLD_SIZE", "1"))):  # any other way to lose one
        raise SystemExit(f"error: {expected} processes launched, {accelerator.num_processes} joined: each alone")
    several = accelerator.num_processes > 1
    accelerator.print(f"parallelism: {'ddp' if several else 'single'} ({accelerator.num_processes} processes)")
    set_seed(args.seed)
    output_dir, checkpoints_dir = Path(args.output_dir), Path(args.output_dir) / "checkpoints"
    held = [name for name in ("model.safetensors", "results.json", "checkpoints") if (output_dir / name).exists()]
    if held and not (args.overwrite_output_dir or args.resume_from_checkpoint):
        used = f"--output_dir {args.output_dir!r} already holds an earlier run's output ({', '.join(held)})"
        refuse(accelerator, f"{used}: --overwrite_output_dir replaces it, --resume_from_checkpoint latest goes on.")
    if "checkpoints" in held and not args.resume_from_checkpoint and accelerator.is_main_process:
        os.replace(checkpoints_dir, output_dir / f".superseded_{time.time_ns()}")  # `latest` must not resume it
    existing = next(folder for folder in [output_dir, *output_dir.absolute().parents] if folder.exists())
    if not (existing.is_dir() and os.access(existing, os.W_OK)):  # (created by the first save: none if refused)
        refuse(accelerator, f"Cannot use --output_dir {args.output_dir!r}: {existing} is no folder you can write to.")
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    # What a resume must keep: the data, its order, the steps, the rate (a checkpoint's optimizer keeps its own).
    run = dict(seed=args.seed, samples=args.num_samples, batch=global_batch_size, processes=accelerator.num_processes)
    run["learning_rate"] = args.learning_rate

    # ------------------------------------------------------------------------------- data
    generator = torch.Generator().manual_seed(args.seed)  # the same data on every process: none sends it
    true_weight, true_bias = torch.randn(1, args.in_features, generator=generator), torch.randn(1, generator=generator)
    inputs = torch.randn(args.num_samples, args.in_features, generator=generator)
    # Targets are (N, 1) to match the model's output: (N,) targets would broadcast to (N, N) in MSELoss.
    targets = inputs @ true_weight.T + true_bias + 0.1 * torch.randn(args.num_samples, 1, generator=generator)
    train_dataset = TensorDataset(inputs, targets)
    shuffling = torch.Generator().manual_seed(args.seed)  # its own: else every epoch's shuffle draws the global RNG
    train_dataloader = DataLoader(train_dataset, args.per_device_train_batch_size, shuffle=True, generator=shuffling)
    if len(train_dataloader) < accelerator.num_processes * args.gradient_accumulation_steps:
        refuse(accelerator, f"One optimizer step needs {global_batch_size} samples; --num_samples is smaller.")

    # ----------------------------------------------------------------- model, optimizer, prepare
    model = torch.nn.Linear(args.in_features, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    # DDP around the model (several processes), on the device; each process gets its own slice of every global batch.
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)

    # ---------------------------------------------------------------------- training loop
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)  # a short last group steps
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    latest, every = args.resume_from_checkpoint, args.checkpointing_steps  # save every N steps and after the last
    loss_curve = resume(accelerator, checkpoints_dir, latest, run) if latest else []  # loss of every step (global)
    step_times, completed_steps = [], len(loss_curve)
    step_loss, started = torch.zeros((), device=accelerator.device), time.perf_counter()
    for epoch in range(completed_steps // steps_per_epoch, math.ceil(max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)  # reseeds the shuffling: same order on every process and after a resume
        skip = (completed_steps % steps_per_epoch) * args.gradient_accumulation_steps  # seen before the resume
        active_dataloader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for inputs_batch, targets_batch in active_dataloader:
            if completed_steps >= max_train_steps:  # done, or resumed from the checkpoint of the last step
                break
            with accelerator.accumulate(model):  # all-reduce, step on a step's last micro-batch only (no `step % gas`)
                loss = torch.nn.functional.mse_loss(model(inputs_batch), targets_batch)
                step_loss += loss.detach() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            # Sync point (cheap here; big models log every N steps). A signal rides along: any process's stops all.
            summed = accelerator.reduce(torch.stack([step_loss, step_loss.new_tensor(stop["signal"])]), "sum").tolist()
            loss_curve.append(summed[0] / accelerator.num_processes)
            step_loss.zero_()
            step_times.append(-started + (started := time.perf_counter()))  # this step's seconds
            if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                accelerator.print(f"epoch {epoch} step {completed_steps}/{max_train_steps}: {loss_curve[-1]:.5f}")
            if summed[1] or every and (completed_steps % every == 0 or completed_steps == max_train_steps):
                texts = {"progress.json": json.dumps({"loss_curve": loss_curve, "run": run})}
                folder = checkpoints_dir / f"step_{completed_steps}"
                save_atomically(accelerator, folder, accelerator.save_state, texts, checkpoints_dir)
            if summed[1]:
                number = signal.Signals(stop["signal"] or signal.SIGTERM)  # a peer's signal stops this one as SIGTERM
                accelerator.print(f"stopped by {number.name} after step {completed_steps}: saved {folder}; {RESUME}")
                raise SystemExit(128 + number)

    # --------------------------------------------------------------------- evaluation
    weight, bias = (p.detach().float().cpu().flatten() for p in accelerator.unwrap_model(model).parameters())
    weight_error = (weight - true_weight[0]).abs().max().item()
    accelerator.print(f"true    weight: {[round(w, 4) for w in true_weight[0].tolist()]}  bias {true_bias.item():.4f}")
    accelerator.print(f"learned weight: {[round(w, 4) for w in weight.tolist()]}  bias {bias.item():.4f}")
    accelerator.print(
        f"max |learned - true| weight: {weight_error:.4f}; global batch size {global_batch_size} = "
        f"{args.per_device_train_batch_size} per device x {accelerator.num_processes} processes x "
        f"{args.gradient_accumulation_steps} accumulation steps"
    )

    # --------------------------------------------------------------------------- save
    cuda = accelerator.device.type == "cuda"  # (2 CPU processes each report "cpu:0": named "cpu" here)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak resident set (Linux: KiB)
    peak = (str(accelerator.device), torch.cuda.max_memory_allocated(accelerator.device)) if cuda else ("cpu", rss)
    gathered = enumerate(gather_object([peak]))  # a collective: every process's peak
    peaks = {(f"rank{r}/" if several else "") + n: round(b / 2**30, 4) for r, (n, b) in gathered}
    measured = step_times[2:]  # the first steps warm up (allocation, the first all-reduce)
    results = {"recipe": "linear_toy", "parallelism": "ddp" if several else "single", "config": vars(args)}
    results |= {"num_processes": accelerator.num_processes, "device": str(accelerator.device)}
    results |= {"distributed_type": accelerator.distributed_type.value, "mixed_precision": accelerator.mixed_precision}
    results |= {"distributed/backend": torch.distributed.get_backend() if several else None, "memory/peak_gib": peaks}
    results |= {"perf/step_time_s": sum(measured) / len(measured) if measured else None, "train/loss": loss_curve[-1]}
    results |= {"perf/samples_per_sec": global_batch_size * len(measured) / sum(measured) if measured else None}
    results |= {"global_batch_size": global_batch_size, "completed_steps": completed_steps, "resumed_from": latest}
    results |= {"eval/max_abs_weight_error": weight_error, "model/weight": weight.tolist(), "model/bias": bias.item()}
    results |= {"true/weight": true_weight[0].tolist(), "true/bias": true_bias.item(), "train/loss_curve": loss_curve}
    texts = {"results.json": json.dumps(results, indent=2, sort_keys=True, default=str) + "\n"}
    save_atomically(accelerator, output_dir, lambda tmp: accelerator.save_model(model, tmp), texts, checkpoints_dir)
    accelerator.print(f"wrote {output_dir / 'results.json'} and {output_dir / 'model.safetensors'}")
    # Drop DDP while the process group lives: gloo can hang in DDP's destructor at exit (docs/troubleshooting.md).
    model, optimizer, train_dataloader = accelerator.free_memory(model, optimizer, train_dataloader)
    accelerator.end_training()


if __name__ == "__main__":
    main()
