"""Checkpoints that never lose work: ``save_state`` into a temporary folder, then one rename.

A checkpoint folder ``checkpoints/step_000120`` is complete when it holds ``progress.json``, which is
written last, inside the temporary folder, before the rename. A run killed mid-save leaves only a
``.tmp`` folder behind, which ``latest_checkpoint`` ignores, so resuming picks the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator

from .runtime import RecipeError

PROGRESS_FILE = "progress.json"


def save_checkpoint(accelerator: Accelerator, checkpoints_dir: str | os.PathLike, completed_steps: int,
                    total_limit: int | None = None, write_state=None) -> Path:
    """``accelerator.save_state`` (model, optimizer, scheduler, sampler, RNG states of every process) to
    ``checkpoints_dir/step_{completed_steps:06d}``, atomically. Every process must call it.
    Keeps only the newest ``total_limit`` complete checkpoints when given.

    ``write_state(folder)``, when given, replaces ``save_state``: it is called on every process with
    the temporary folder and writes whatever that process must save (pipeline stages use it to save
    their own weights, which ``save_state`` writes from the main process only)."""
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoints_dir / f"step_{completed_steps:06d}"
    tmp = checkpoints_dir / f".{final.name}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed mid-save
    accelerator.wait_for_everyone()
    if write_state is None:
        accelerator.save_state(str(tmp))
    else:
        write_state(tmp)
    # Sync point: every process must have written its part before the folder is declared complete.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / PROGRESS_FILE).write_text(json.dumps({"completed_steps": completed_steps}) + "\n")
        if final.exists():  # saving the same step again (e.g. after a resume): swap, never delete first
            old = checkpoints_dir / f".{final.name}.old"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        if total_limit:
            for stale in complete_checkpoints(checkpoints_dir)[:-total_limit]:
                shutil.rmtree(stale)
    accelerator.wait_for_everyone()
    return final


def checkpoint_steps(checkpoint: Path) -> int:
    return json.loads((checkpoint / PROGRESS_FILE).read_text())["completed_steps"]


def complete_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``checkpoints_dir``, oldest first."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.glob("step_*") if (p / PROGRESS_FILE).is_file()]
    return sorted(found, key=checkpoint_steps)


def resolve_checkpoint(resume_from_checkpoint: str, checkpoints_dir: str | os.PathLike) -> Path | None:
    """The folder to resume from: a given path, or ``latest`` (the newest complete checkpoint under
    ``checkpoints_dir``; None when there is none yet, so a first run with ``latest`` starts fresh)."""
    if resume_from_checkpoint == "latest":
        found = complete_checkpoints(checkpoints_dir)
        return found[-1] if found else None
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise RecipeError(
            f"--resume_from_checkpoint {resume_from_checkpoint!r} does not exist. Pass a checkpoint folder "
            f"(e.g. {Path(checkpoints_dir) / 'step_000100'}) or 'latest'."
        )
    if not (path / PROGRESS_FILE).is_file():
        raise RecipeError(
            f"--resume_from_checkpoint {resume_from_checkpoint!r} is not a complete checkpoint (no {PROGRESS_FILE}: "
            "its save was interrupted, or it is not a checkpoint folder). Pass an earlier checkpoint or 'latest', "
            "which skips incomplete ones."
        )
    return path


@dataclass(frozen=True)
class ResumePoint:
    """Where training picks up: optimizer steps done, the epoch to continue, batches of it to skip."""

    completed_steps: int = 0
    epoch: int = 0
    batches_to_skip: int = 0


def load_checkpoint(accelerator: Accelerator, resume_from_checkpoint: str | None, checkpoints_dir: str | os.PathLike,
                    steps_per_epoch: int, gradient_accumulation_steps: int) -> ResumePoint:
    """``accelerator.load_state`` the checkpoint that ``--resume_from_checkpoint`` names (a path, or
    ``latest``) and return where training picks up; ``ResumePoint()`` (from the start) when there is
    nothing to resume. load_state restores the model, optimizer, scheduler, the sampler's seed and
    every process's RNG states; the recipe then skips ``batches_to_skip`` batches of ``epoch`` with
    ``accelerator.skip_first_batches``, so the resumed run sees exactly the batches it would have."""
    if not resume_from_checkpoint:
        return ResumePoint()
    checkpoint = resolve_checkpoint(resume_from_checkpoint, checkpoints_dir)
    if checkpoint is None:
        accelerator.print(f"--resume_from_checkpoint latest: no complete checkpoint in {checkpoints_dir} yet, starting fresh")
        return ResumePoint()
    accelerator.load_state(str(checkpoint))
    completed_steps = checkpoint_steps(checkpoint)
    point = ResumePoint(completed_steps, completed_steps // steps_per_epoch,
                        (completed_steps % steps_per_epoch) * gradient_accumulation_steps)
    accelerator.print(f"resumed from {checkpoint} at step {completed_steps} (epoch {point.epoch}, skipping {point.batches_to_skip} batches)")
    return point
