"""When ``recipes/grpo.py`` saves a checkpoint: every ``--checkpointing_steps`` (or epoch), and at the end of a round
when SIGTERM or Ctrl-C asked every process to stop (``shared.checkpoints.save_checkpoint`` writes it)."""

from __future__ import annotations

from pathlib import Path

from shared.checkpoints import save_checkpoint


def checkpoint_saver(
    accelerator,
    *,
    stop,
    checkpoints_dir: Path,
    checkpointing_steps: int | str | None,
    checkpoints_total_limit: int | None,
    steps_per_epoch: int,
    max_train_steps: int,
    num_iterations: int,
    write_state,
    layout: str,
    history,
    batch: dict,
):
    """The function every process calls at a step's end (split: the generating process at a round's end): it saves
    ``checkpoints_dir/step_N`` when a checkpoint is due (files written, a collective), and on SIGTERM or Ctrl-C saves
    one at the round's end and exits. ``history()`` gives the run's curves at the moment of saving."""
    every = steps_per_epoch if checkpointing_steps == "epoch" else checkpointing_steps
    last_checkpoint = max_train_steps - (checkpointing_steps == "epoch")  # no epoch checkpoint at the end

    def save_at(step: int) -> Path:
        return save_checkpoint(
            accelerator,
            checkpoints_dir,
            step,
            checkpoints_total_limit,
            write_state=write_state,
            layout=layout,
            history=history(),
            batch=batch,
        )

    def save_at_step_end(completed_steps: int) -> None:
        if completed_steps % num_iterations == 0 and stop.requested(completed_steps):
            stop.exit(save_at(completed_steps))  # SIGTERM or Ctrl-C to any process: all stop
        if every and completed_steps % every == 0 and completed_steps <= last_checkpoint:
            save_at(completed_steps)

    return save_at_step_end
