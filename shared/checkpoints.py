"""Checkpoints that never lose work, and one resume path: set_start_checkpoint, keep_global_batch, load_checkpoint."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import gather_object
from torch.optim.lr_scheduler import LambdaLR
from safetensors import SafetensorError

from .errors import RecipeError, stop_if_found
from .accelerator import main_process_alone

PROGRESS_FILE = "progress.json"
# What a failed write raises: the OS's error, safetensors' (no errno), torch.save's ("unexpected pos", "basic_ios").
WRITE_ERRORS = (OSError, SafetensorError, RuntimeError)
FINGERPRINT_BYTES = 2**20  # hashed at each end of every file
# Optimizer settings a checkpoint restores over this run's (torch's load_state_dict keeps the saved ones), by flag.
RESTORED_SETTINGS = {"initial_lr": "--learning_rate", "weight_decay": "--weight_decay", "eps": "--adam_epsilon"}
# What a resume keeps (``unchanged``) that checkpoints saved before it was recorded lack, with the value every one of
# them was trained with; compared only where this run records it.
RECORDED_SINCE = {"assistant_only_loss": True}
LAYOUTS = {
    "replica": "whole model (single, ddp or device_map)",
    "fsdp": "model in FSDP shards (fsdp)",
    "pipeline": "model in pipeline stages (recipes/pipeline_lm.py)",
}


def save_checkpoint(
    accelerator: Accelerator,
    checkpoints_dir: str | os.PathLike,
    completed_steps: int,
    total_limit: int | None = None,
    write_state=None,
    layout: str = "replica",
    history: dict | None = None,
    batch: dict | None = None,
    unchanged: dict | None = None,
) -> Path:
    """``accelerator.save_state`` (or ``write_state(folder)``) to ``checkpoints_dir/step_N``, atomically, keeping the
    newest ``total_limit``; progress.json keeps ``layout``, ``history``, ``batch`` and ``unchanged`` (what a resume
    must keep: see ``load_checkpoint``) for a resume. A collective."""
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoints_dir / f"step_{completed_steps:06d}"
    tmp = checkpoints_dir / f".{final.name}.tmp"
    on_each_node = accelerator.project_configuration.save_on_each_node
    writes = accelerator.is_local_main_process if on_each_node else accelerator.is_main_process
    if writes:  # left by a run killed mid-save or mid-prune
        for leftover in [tmp, *checkpoints_dir.glob(".step_*.deleted")]:
            shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()
    problem = None
    try:
        accelerator.save_state(str(tmp)) if write_state is None else write_state(tmp)
    except WRITE_ERRORS as error:  # a full disk, a lost mount: said once, the checkpoints before it kept
        problem = failed_save(f"the checkpoint {final}", error, checkpoints_dir, checkpoints_dir, needed=None)
    # Sync point: every process must have written its part before the folder is declared complete.
    remove_tmp = lambda: writes and shutil.rmtree(tmp, ignore_errors=True)  # (a failed save's half-written copy)
    stop_if_found(problem, cleanup=remove_tmp)
    if writes:
        try:
            progress = dict(completed_steps=completed_steps, layout=layout, history=history or {}, batch=batch)
            progress |= dict(unchanged=unchanged, manifest=manifest(tmp))  # (unchanged None: nothing checked)
            (tmp / PROGRESS_FILE).write_text(json.dumps(progress) + "\n")
        except WRITE_ERRORS as error:
            problem = failed_save(f"the checkpoint {final}", error, checkpoints_dir, checkpoints_dir, needed=None)
        else:
            size = sum(entry[0] for entry in progress["manifest"].values())
            kept = f"the newest {total_limit} kept" if total_limit else "all kept: --checkpoints_total_limit N keeps N"
            accelerator.print(f"saved checkpoint {final} ({size / 2**20:,.1f} MiB; {kept})")
            old = checkpoints_dir / f".{final.name}.old"
            if final.exists():  # saving the same step again (e.g. after a resume): swap, never delete first
                os.replace(final, old)
            os.replace(tmp, final)
            if old.exists():  # (also one a kill left mid-swap)
                shutil.rmtree(old)
            if total_limit:  # a kill before this leaves total_limit + 1 complete ones: none is lost
                for stale in complete_checkpoints(checkpoints_dir)[:-total_limit]:
                    # Renamed (atomic) before deleted: a kill mid-delete never leaves a half-deleted step_N.
                    doomed = stale.with_name(f".{stale.name}.deleted")
                    os.replace(stale, doomed)
                    shutil.rmtree(doomed)
    stop_if_found(problem, cleanup=remove_tmp)
    return final


def resume_command() -> str:
    """The command that continues this run: the same launch, this script and its arguments, resuming ``latest``."""
    args, kept = sys.argv[1:], []
    for index, arg in enumerate(args):
        resume = arg == "--resume_from_checkpoint" or (index and args[index - 1] == "--resume_from_checkpoint")
        if not (resume or arg.startswith("--resume_from_checkpoint=") or arg == "--overwrite_output_dir"):
            kept.append(arg)
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ
    start = "accelerate launch ... " if launched else "python "  # (the launch options are not visible from here)
    return start + shlex.join([sys.argv[0], *kept, "--resume_from_checkpoint", "latest"])


def where_to_resume(checkpoints_dir: str | os.PathLike) -> str:
    """One sentence: the newest complete checkpoint and the command that resumes from it, or that there is none."""
    complete = complete_checkpoints(checkpoints_dir)
    if not complete:
        return (
            f"no complete checkpoint holds this run's training (in {checkpoints_dir}; --checkpointing_steps N saves "
            f"one every N steps): it starts over with {resume_command()}"
        )
    return (
        f"the newest complete checkpoint is {complete[-1]} (step {checkpoint_steps(complete[-1])}): resume from it "
        f"with {resume_command()}"
    )


def failed_save(
    what: str, error: Exception, folder: Path, checkpoints_dir: str | os.PathLike, needed: int | None
) -> str:
    """The paragraph for a failed write (any other ``error`` is raised again): what, why, what is kept, the resume."""
    frames = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(error.__traceback__)]
    if isinstance(error, RuntimeError) and not any("torch/serialization" in frame for frame in frames):
        raise error  # (a RuntimeError not raised writing a file by torch.save)
    existing = next(parent for parent in [Path(folder), *Path(folder).parents] if parent.exists())
    free, newest = shutil.disk_usage(existing).free, complete_checkpoints(checkpoints_dir)[-1:]
    # torch.save says only "unexpected pos ..." when the disk is full; safetensors' error has no errno.
    full = getattr(error, "errno", None) == errno.ENOSPC or "No space left" in str(error) or free < 2**20
    reason = getattr(error, "strerror", None) or str(error).splitlines()[0][:200]
    if full:
        needed = needed or (sum(size for size, _ in manifest(newest[0]).values()) if newest else None)
        reason = f"No space left on device ({f'it needs about {needed / 2**20:,.1f} MiB, ' if needed else ''}"
        reason += f"{free / 2**20:,.1f} MiB free)"
    return (
        f"Saving {what} failed: {reason}. What was there before is as it was: the half-written copy is removed, "
        f"earlier checkpoints and output are kept. Free space (or fix the disk); then, "
        + where_to_resume(checkpoints_dir)
    )


def save_final(
    accelerator: Accelerator,
    output_dir: str | os.PathLike,
    write,
    checkpoints_dir: str | os.PathLike,
    state_dict: dict | None = None,
) -> None:
    """The trained model saved by ``write(folder)`` on the main process, atomically; a collective."""
    output_dir, problem = Path(output_dir), None
    tmp = output_dir / ".final.tmp"
    # Counted first: save_pretrained empties the dict as it writes its shards.
    needed = sum(t.numel() * t.element_size() for t in (state_dict or {}).values() if hasattr(t, "numel")) or None
    with main_process_alone(accelerator):
        if accelerator.is_main_process:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
                tmp.mkdir(parents=True)
                write(tmp)
                for entry in sorted(tmp.iterdir()):
                    target = output_dir / entry.name
                    if entry.is_dir() and target.exists():  # a folder (adapter/, merged/): the old one goes after
                        os.replace(target, tmp / f".{entry.name}.old")
                    os.replace(entry, target)
                shutil.rmtree(tmp)
            except WRITE_ERRORS as error:
                problem = failed_save(f"the trained model to {output_dir}", error, tmp, checkpoints_dir, needed)
                shutil.rmtree(tmp, ignore_errors=True)
    stop_if_found(problem)


def fingerprint(path: Path) -> str:
    """A hash of a file's size and of its first and last ``FINGERPRINT_BYTES``."""
    digest, size = hashlib.sha256(), path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as file:
        digest.update(file.read(FINGERPRINT_BYTES))
        if size > FINGERPRINT_BYTES:
            file.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
            digest.update(file.read())
    return digest.hexdigest()


def manifest(folder: Path) -> dict:
    """``{relative path: [size, fingerprint]}`` for every file under ``folder``."""
    files = (path for path in sorted(folder.rglob("*")) if path.is_file())
    return {str(path.relative_to(folder)): [path.stat().st_size, fingerprint(path)] for path in files}


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a complete checkpoint's files against its manifest, or None."""
    expected = json.loads((checkpoint / PROGRESS_FILE).read_text()).get("manifest")
    for name, (size, print_) in (expected or {}).items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size:,} bytes, the save wrote {size:,}"
        if fingerprint(path) != print_:
            return f"{path} differs from what the save wrote (its fingerprint changed)"


def checkpoint_steps(checkpoint: Path) -> int:  # the optimizer steps a complete checkpoint was saved after
    return json.loads((checkpoint / PROGRESS_FILE).read_text())["completed_steps"]


def complete_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``checkpoints_dir`` (none where it does not exist), oldest first."""
    complete = (p for p in Path(checkpoints_dir).glob("step_*") if (p / PROGRESS_FILE).is_file())
    return sorted(complete, key=checkpoint_steps)


def resolve_checkpoint(
    resume_from_checkpoint: str, checkpoints_dir: str | os.PathLike, skipped: list | None = None
) -> Path | None:
    """The folder this process would resume from, a path or ``latest`` (damaged ones passed over go to ``skipped``)."""
    if resume_from_checkpoint == "latest":
        for candidate in reversed(complete_checkpoints(checkpoints_dir)):
            problem = damage(candidate)
            if problem is None:
                return candidate
            if skipped is not None:
                skipped.append(f"{candidate.name}: {problem}")
        return None
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise RecipeError(
            f"--resume_from_checkpoint {resume_from_checkpoint!r} does not exist. Pass a checkpoint folder (e.g. "
            f"{Path(checkpoints_dir) / 'step_000100'}) or 'latest'."
        )
    if not (path / PROGRESS_FILE).is_file():
        raise RecipeError(
            f"--resume_from_checkpoint {resume_from_checkpoint!r} is not a complete checkpoint (no {PROGRESS_FILE}: "
            "its save was interrupted, or it is not a checkpoint folder). Pass an earlier checkpoint or 'latest', "
            "which skips incomplete ones."
        )
    if problem := damage(path):
        raise RecipeError(
            f"--resume_from_checkpoint {resume_from_checkpoint!r} is damaged: {problem}, so loading it would fail or "
            "resume from wrong weights. Nothing was loaded. Pass an earlier checkpoint, or 'latest', which skips "
            "damaged ones."
        )
    return path


def set_start_checkpoint(
    accelerator: Accelerator,
    resume_from_checkpoint: str | None,
    checkpoints_dir: str | os.PathLike,
    layout: str = "replica",
) -> Path | None:
    """Set the start: the checkpoint all processes agree on, or None; the later ones set aside (renamed, uncounted)."""
    if not resume_from_checkpoint:
        return set_aside_later_checkpoints(accelerator, checkpoints_dir, None)
    skipped = []
    try:
        found, problem = resolve_checkpoint(resume_from_checkpoint, checkpoints_dir, skipped), None
    except RecipeError as error:
        found, problem = None, error.message
    for reason in skipped:
        accelerator.print(f"--resume_from_checkpoint latest: skipping the damaged checkpoint {reason}")
    steps, here = (checkpoint_steps(found) if found else None), Path(checkpoints_dir).resolve()
    seen = problem or (f"step {steps} in {found}" if found else f"no complete checkpoint in {here}")
    who = f"machine {os.environ.get('GROUP_RANK', '0')} (rank {accelerator.process_index}"
    everyone = gather_object([dict(problem=problem, steps=steps, seen=f"{who}, host {socket.gethostname()}): {seen}")])
    if len({entry["problem"] for entry in everyone}) == 1 and problem:  # every process sees the same bad input
        raise RecipeError(problem)
    if any(entry["problem"] for entry in everyone) or len({entry["steps"] for entry in everyone}) > 1:
        raise RecipeError(
            "The processes disagree on the checkpoint to resume from (--resume_from_checkpoint "
            f"{resume_from_checkpoint}): {'; '.join(entry['seen'] for entry in everyone)}. Nothing was loaded: "
            "training on would mix different states. Each machine reads its own disk; put --output_dir on a disk all "
            "machines share, or pass --save_on_each_node so that every machine keeps its own copy of each checkpoint "
            "(then resume), or copy the newest checkpoint folder to the same path on every machine."
        )
    theirs = json.loads((found / PROGRESS_FILE).read_text()).get("layout", layout) if found else layout
    if found is None:
        accelerator.print(
            f"--resume_from_checkpoint latest: no complete checkpoint in {checkpoints_dir} yet, starting fresh"
        )
    elif theirs != layout:
        raise RecipeError(
            f"{found} holds a {LAYOUTS[theirs]} and cannot be resumed by this run, which trains with a "
            f"{LAYOUTS[layout]}. Resume it with the recipe and parallelism that wrote it, or start a "
            "new run from that run's saved model (--model_name_or_path)."
        )
    return set_aside_later_checkpoints(accelerator, checkpoints_dir, found)


def set_aside_later_checkpoints(accelerator: Accelerator, checkpoints_dir, start: Path | None) -> Path | None:
    """Rename the checkpoints after ``start`` (all, starting fresh) to ``.step_N.superseded_T``: another run's, which
    ``latest`` and ``--checkpoints_total_limit`` must not count with this run's. Changes files; returns ``start``."""
    after = checkpoint_steps(start) if start else 0
    later = sorted(p for p in Path(checkpoints_dir).glob("step_*") if p.name[5:].isdigit() and int(p.name[5:]) > after)
    on_each_node = accelerator.project_configuration.save_on_each_node
    if later and (accelerator.is_local_main_process if on_each_node else accelerator.is_main_process):
        for folder in later:
            os.replace(folder, folder.with_name(f".{folder.name}.superseded_{time.time_ns()}"))
        names = ", ".join(p.name for p in later)
        accelerator.print(
            f"set aside {names} (after step {after}, not this run's) as .step_N.superseded_* in {checkpoints_dir}"
        )
    accelerator.wait_for_everyone()
    return start


def keep_global_batch(
    num_processes: int,
    checkpoint: Path | None,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int | None,
    data_parallel_size: int,
    seed: int,
) -> tuple[int, dict]:
    """The accumulation to train with (a resume's keeps its global batch in this process count; refused where none
    does, or with another ``seed``) and the batch's shape for ``save_checkpoint(batch=...)``."""
    processes, per_step = num_processes, per_device_train_batch_size * data_parallel_size
    count = lambda k: f"{k} process{'es' * (k > 1)}"
    saved = json.loads((checkpoint / PROGRESS_FILE).read_text()).get("batch") if checkpoint else None
    accumulation = saved["global_batch_size"] // per_step if saved else gradient_accumulation_steps or 1
    if saved and saved.get("seed", seed) != seed:
        raise RecipeError(
            f"{checkpoint} was trained with --seed {saved['seed']}, which orders the data (and picks held-out "
            f"samples); this run has --seed {seed}, so it would go on over other samples than the run it resumes, "
            f"some twice and some never. Pass --seed {saved['seed']} to resume it, or start a new run (another "
            "--output_dir) with this seed."
        )
    if saved:
        wanted, was, n = saved["global_batch_size"], saved["gradient_accumulation_steps"], saved["num_processes"]
        said = (
            f"{checkpoint} was trained with a global batch of {wanted} samples per optimizer step "
            f"({saved['per_device_train_batch_size']} per device x {count(n)} x {was} accumulation steps)"
        )
        fits = [b for b in range(per_device_train_batch_size, 0, -1) if wanted % (b * data_parallel_size) == 0]
        if wanted % per_step:
            raise RecipeError(
                f"{said}; in this run's {count(processes)} no --gradient_accumulation_steps keeps it with "
                f"{per_device_train_batch_size} per device ({wanted} is not a multiple of {per_step}). "
                + (f"Pass --per_device_train_batch_size {fits[0]}" if fits else f"Resume it in {count(n)}")
                + " to keep it, or start a new run (another --output_dir) to train with another global batch."
            )
        if gradient_accumulation_steps not in (None, accumulation):  # the user's value is not overridden silently
            raise RecipeError(
                f"{said}; --gradient_accumulation_steps {gradient_accumulation_steps} would make it "
                f"{per_step * gradient_accumulation_steps} in this run's {count(processes)}. Pass "
                f"--gradient_accumulation_steps {accumulation} or leave it out to keep it, or start a "
                "new run (another --output_dir) to train with another global batch."
            )
        if (n, was) != (processes, accumulation) and os.environ.get("RANK", "0") == "0":  # said once
            print(
                f"resuming a {n}-process checkpoint in {count(processes)}: "
                f"gradient accumulation {was} → {accumulation} keeps the global batch of {wanted}"
            )
    return accumulation, {
        "num_processes": processes,
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": accumulation,
        "global_batch_size": per_step * accumulation,
        "seed": seed,
    }


@dataclass(frozen=True)
class ResumePoint:
    """Where training picks up: steps done, the epoch, its batches to skip, the saved ``history``."""

    completed_steps: int = 0
    epoch: int = 0
    batches_to_skip: int = 0
    history: dict = field(default_factory=dict)


def load_checkpoint(
    accelerator: Accelerator,
    checkpoint: Path | None,
    steps_per_epoch: int,
    gradient_accumulation_steps: int,
    lr_scheduler=None,
    load_state=None,
    unchanged: dict | None = None,
) -> ResumePoint:
    """Load ``checkpoint`` (``accelerator.load_state`` or ``load_state(folder)``; a prepared ``lr_scheduler`` brought
    to this process count and to this run's schedule; refused if it restores other ``RESTORED_SETTINGS`` than the
    flags set, or saved another ``unchanged``: ``{"training_examples": n, flag: value}``) and return where training
    picks up, for ``accelerator.skip_first_batches``."""
    if checkpoint is None:
        return ResumePoint()
    completed_steps, progress = checkpoint_steps(checkpoint), json.loads((checkpoint / PROGRESS_FILE).read_text())
    recorded, unchanged = progress.get("unchanged"), unchanged or {}  # (a checkpoint of an older version: None)
    recorded = recorded and {**{k: v for k, v in RECORDED_SINCE.items() if k in unchanged}, **recorded}
    show = lambda value: " ".join(value) if isinstance(value, list) else value  # (None: no LoRA adapter)
    given = lambda n, v: f"--{'no-' * (not v)}{n}" if isinstance(v, bool) else f"--{n} {show(v)}"  # as typed
    for name in [*recorded, *(name for name in unchanged if name not in recorded)] if recorded else []:
        if (was := recorded.get(name)) != (now := unchanged.get(name)):  # refused before loading: nothing changed
            raise RecipeError(
                f"{checkpoint} was trained on {was} training examples, this run has {now} (the data, or the flags "
                "that pick it, changed): their order follows their number, so a resume would train some twice and "
                "others never. Resume it with the data it was trained on, or start a new run (another --output_dir)."
                if name == "training_examples"
                else f"{checkpoint} was trained with {given(name, was)}, this run has {given(name, now)}: a resume "
                "goes on with the model that run built, trained as that run trained it; with another setting it would "
                "change mid-run, and results.json would record the new one. Resume it with the flags it was trained "
                "with, or start a new run (another --output_dir)."
            )
    prepared = isinstance(lr_scheduler, AcceleratedScheduler)  # (one not prepared steps once per step)
    inner = lr_scheduler.scheduler if prepared else lr_scheduler
    optimizer = inner.optimizer if inner is not None else None
    from_flags = [dict(group) for group in optimizer.param_groups] if optimizer else []  # as this run's flags set them
    try:
        (load_state or (lambda folder: accelerator.load_state(str(folder))))(checkpoint)
    except RuntimeError as error:  # torch's load_state_dict: "size mismatch for classifier.weight: copying a param..."
        shapes = re.search(r"size mismatch for (\S+): .*?torch.Size\((.*?)\).*?torch.Size\((.*?)\)", str(error))
        if shapes is None:
            raise
        name, saved, built = shapes.groups()
        raise RecipeError(
            f"Cannot resume from {checkpoint}: its {name} has the shape {saved} and this run's model {built}, so "
            "it is a checkpoint of another model or task (a classifier's: another number of labels). Resume it with "
            "the model and data it was trained on, or start this run afresh (no --resume_from_checkpoint, and another "
            "--output_dir or --overwrite_output_dir)."
        ) from None
    saved_processes = (progress.get("batch") or {}).get("num_processes", accelerator.num_processes)
    if prepared and not accelerator.split_batches and saved_processes != accelerator.num_processes:
        # A prepared scheduler steps once per process per optimizer step: its count, in this run's processes.
        ratio = accelerator.num_processes / saved_processes
        inner.last_epoch = round(inner.last_epoch * ratio)
        inner._step_count = 1 + round((inner._step_count - 1) * ratio)  # 1 after the constructor's own step
    for group, saved in zip(from_flags, optimizer.param_groups if optimizer else []):
        for key, flag in RESTORED_SETTINGS.items():
            if (was := saved.get(key, group.get(key))) != (now := group.get(key)):
                raise RecipeError(
                    f"{checkpoint} was trained with {flag} {was:g}, this run has {now:g}: a resume goes on with the "
                    f"checkpoint's optimizer and schedule, so it would train with {was:g} and record {now:g}. Pass "
                    f"{flag} {was:g} to resume it, or start a new run (another --output_dir)."
                )
    if isinstance(inner, LambdaLR):  # the saved rate is the saved schedule's: this run's (length, warm-up) rules
        rates = [base * rate(inner.last_epoch) for base, rate in zip(inner.base_lrs, inner.lr_lambdas)]
        if abs(rates[0] - (was := optimizer.param_groups[0]["lr"])) > 1e-6 * inner.base_lrs[0]:
            accelerator.print(
                f"step {completed_steps}'s learning rate: {rates[0]:g} by this run's schedule ({was:g} saved)"
            )
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate
            inner._last_lr = rates  # what get_last_lr() reports
    epoch, into_epoch = divmod(completed_steps, steps_per_epoch)
    point = ResumePoint(completed_steps, epoch, into_epoch * gradient_accumulation_steps, progress.get("history", {}))
    # accumulate() syncs when accelerator.step (load_state set the saver's) is a multiple of this run's accumulation.
    accelerator.step = point.batches_to_skip
    accelerator.print(
        f"resumed from {checkpoint} at step {completed_steps} (epoch {point.epoch}, skipping "
        f"{point.batches_to_skip} batches)"
    )
    return point
