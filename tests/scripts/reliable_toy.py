"""The linear toy as it was before it became one standalone file: a small launched script that exercises shared/'s
reliability helpers (atomic checkpoints, resume, the collective timeout, refusals printed once, a process that dies
with its launcher; and tools/hang_dump.py's dumps, launched in front of it) for tests/test_reliability.py. Not a
recipe: recipes/linear_toy.py is the tutorial's example. ``accelerate launch ... tests/scripts/reliable_toy.py
--output_dir DIR [flags]``."""

import argparse
import math
import sys
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

# The helper module: shared/ next to this file (a copied recipe) or one folder up (this repository), first on sys.path
# so that no installed package named "shared" shadows it. Every recipe opens with these lines, on purpose (copyable).
HERE = Path(__file__).resolve().parent  # shared/ beside it (a copy in a test's project), or the repository's
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parents[1]))
from shared.checkpoints import load_checkpoint, save_checkpoint, set_start_checkpoint
from shared.results import RunRecord
from shared.errors import RecipeError
from shared.flags import add_reliability_flags
from shared.accelerator import build_accelerator, set_gpu_index
from shared.parallelism import choose_parallelism
from shared.flags import positive_float, positive_int, prepare_output_dir
from shared.errors import report_recipe_errors, set_stop_with_launcher
from shared.errors import install_peer_exit_hooks


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--output_dir", default="outputs/linear_toy", help="results.json and the weights go here (created if needed).")
    add("--seed", type=int, default=42, help="Seed for the data set, the initial weights and the shuffling.")
    add("--num_samples", type=positive_int, default=4096, help="Size of the generated training set.")
    add("--in_features", type=positive_int, default=8, help="Inputs per sample (number of true weights).")
    add("--noise_std", type=float, default=0.1, help="Standard deviation of the noise added to the targets.")
    add("--per_device_train_batch_size", type=positive_int, default=32, help="Samples per process per forward pass.")
    add("--gradient_accumulation_steps", type=positive_int, default=1, help="Forward/backward passes per step.")
    add("--num_train_epochs", type=positive_int, default=3, help="Passes over the data (unless --max_train_steps).")
    add("--max_train_steps", type=positive_int, default=None, help="Stop after this many optimizer steps.")
    add("--learning_rate", type=positive_float, default=0.1, help="SGD learning rate.")
    add("--mixed_precision", choices=["no", "fp16", "bf16"], help="Override the config's (bf16 works on CPU too).")
    add_reliability_flags(parser)  # checkpoints, resume, --dist_timeout: one definition for every recipe
    return parser.parse_args(argv)


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    set_stop_with_launcher()  # Linux: dies with its launcher
    install_peer_exit_hooks()  # 2+ processes: a rank another one stopped says so in one line
    set_gpu_index()  # one process on a GPU: cuda:N
    accelerator = build_accelerator(
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # Seedable sampler: one shuffle whatever the process count, so 2 processes match 1 process sample for sample.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    # Every process agrees on the checkpoint to resume from (a collective), before any work.
    checkpoints_dir = output_dir / "checkpoints"
    checkpoint = set_start_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir)
    parallelism = choose_parallelism(accelerator, "auto", "recipes/linear_toy.py")
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")
    if parallelism.name == "device_map":
        accelerator.print("parallelism: a linear model is one layer and has nothing to split: it trains on one device")
    # Samples per optimizer step (with sequences, x sequence length gives the tokens).
    global_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps

    # ------------------------------------------------------------------------------- data
    # Built identically on every process from the seed, so no process needs to send it to another.
    generator = torch.Generator().manual_seed(args.seed)
    true_weight = torch.randn(1, args.in_features, generator=generator)
    true_bias = torch.randn(1, generator=generator)
    inputs = torch.randn(args.num_samples, args.in_features, generator=generator)
    # Targets are (N, 1) to match the model's output: (N,) targets would broadcast to (N, N) in MSELoss.
    noise = args.noise_std * torch.randn(args.num_samples, 1, generator=generator)
    targets = inputs @ true_weight.T + true_bias + noise
    # Its own generator: a DataLoader without one draws from the global RNG whenever it starts iterating.
    loader_generator = torch.Generator().manual_seed(args.seed)
    dataset = TensorDataset(inputs, targets)
    train_dataloader = DataLoader(dataset, args.per_device_train_batch_size, shuffle=True, generator=loader_generator)
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

    # ---------------------------------------------------------------------- training loop
    # accumulate() also steps on the last, shorter group of an epoch, hence the ceiling.
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    resume = load_checkpoint(accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps)
    completed_steps = resume.completed_steps
    config = {**vars(args), "num_processes": accelerator.num_processes, "global_batch_size": global_batch_size}
    record = RunRecord(accelerator, max_train_steps, resume.history.get("train/loss_curve"))
    loss_curve = record.losses()  # the global mean loss of every optimizer step (the list grows as steps are read)
    step_loss = torch.zeros((), device=accelerator.device)  # mean over this step's micro-batches
    for epoch in range(resume.epoch, math.ceil(max_train_steps / steps_per_epoch)):
        model.train()
        # Reseeds the shuffling for this epoch: same order on every process and after a resume.
        train_dataloader.set_epoch(epoch)
        active_dataloader = train_dataloader
        if epoch == resume.epoch and resume.batches_to_skip:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume.batches_to_skip)
        for inputs_batch, targets_batch in record.timed(active_dataloader):
            # accumulate() skips the gradient all-reduce on all but the last micro-batch of a step and
            # steps the optimizer only then (no hand-rolled `step % gas == 0`).
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs_batch), targets_batch)
                step_loss += loss.detach() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1  # (this bookkeeping ends every recipe's step, on purpose: each loop reads whole)
            # Sync point: reduce() and .item() wait for every process (cheap here; big models log every N steps).
            record.step(completed_steps, accelerator.reduce(step_loss, "mean").item(), samples=global_batch_size)
            step_loss.zero_()
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
            limit, history = args.checkpoints_total_limit, {"train/loss_curve": loss_curve}
            save_checkpoint(accelerator, checkpoints_dir, completed_steps, limit, history=history)

    # --------------------------------------------------------------------- evaluation
    learned = accelerator.unwrap_model(model)
    learned_weight, learned_bias = learned.weight.detach().float().cpu()[0], learned.bias.detach().float().cpu()
    weight_error = (learned_weight - true_weight[0]).abs().max().item()
    accelerator.print(
        f"true    weight: {[round(w, 4) for w in true_weight[0].tolist()]}  bias {true_bias.item():.4f}\n"
        f"learned weight: {[round(w, 4) for w in learned_weight.tolist()]}  bias {learned_bias.item():.4f}\n"
        f"max |learned - true| weight: {weight_error:.4f}; global batch size {global_batch_size} "
        f"= {args.per_device_train_batch_size} per device x {accelerator.num_processes} processes x "
        f"{args.gradient_accumulation_steps} accumulation steps"
    )

    # --------------------------------------------------------------------------- save
    accelerator.wait_for_everyone()
    accelerator.save_model(model, output_dir)  # model.safetensors, written by the main process only
    # device_map asked for, one device used: the linear model is a single layer.
    results = {"recipe": "linear_toy", "config": config, "global_batch_size": global_batch_size}
    results["parallelism"] = "single" if parallelism.name == "device_map" else parallelism.name
    results.update({"parallelism_requested": parallelism.name, "eval/max_abs_weight_error": weight_error})
    results.update({"model/weight": learned_weight.tolist(), "model/bias": learned_bias.item()})
    results.update({"true/weight": true_weight[0].tolist(), "true/bias": true_bias.item()})
    record.write(output_dir, results, model)  # a collective: the main process writes results.json
    if accelerator.is_main_process:  # the files exist on machine 0 only in a multi-machine run
        print(f"wrote {output_dir / 'results.json'} and {output_dir / 'model.safetensors'}")
    # Drop the DDP wrapper while the process group still exists: a gloo group destroyed first can
    # deadlock in the DDP reducer's destructor at interpreter exit (seen with torch 2.13 on CPU).
    model, optimizer, train_dataloader = accelerator.free_memory(model, optimizer, train_dataloader)
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():
        main()
