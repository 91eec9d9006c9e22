"""When the LLM recipes (``llm_finetune.py``, ``dpo.py``, ``grpo.py``) save a checkpoint: every
``--checkpointing_steps`` (or epoch) and after the run's last step, and at a step's end (GRPO: a round's end) when
SIGTERM or Ctrl-C asked every process to stop (``shared.checkpoints.save_checkpoint`` writes it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from shared.checkpoints import save_checkpoint
from shared.lora import LORA_FLAGS

# The flags ``checkpoint_saver`` takes, and those ``shared.checkpoints.keep_global_batch`` takes, by the names the
# recipes' parsers give them.
CHECKPOINT_FLAGS = ("checkpointing_steps", "checkpoints_total_limit")
BATCH_FLAGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")
# The flags ``unchanged_by_a_resume`` takes: a new adapter's, or the one continued.
ADAPTER_FLAGS = (*LORA_FLAGS, "adapter_name_or_path")


def checkpoint_saver(
    accelerator,
    *,
    stop,
    checkpoints_dir: Path,
    checkpointing_steps: int | str | None,
    checkpoints_total_limit: int | None,
    steps_per_epoch: int,
    max_train_steps: int,
    write_state,
    layout: str,
    history,
    batch: dict,
    unchanged: dict,
    num_iterations: int = 1,
):
    """The function every process calls at a step's end (GRPO's split layout: the generating process at a round's
    end): it saves ``checkpoints_dir/step_N`` when a checkpoint is due (files written, a collective), and on SIGTERM
    or Ctrl-C saves one (GRPO: at the end of a round of ``num_iterations`` steps) and exits. ``history()`` gives the
    run's curves at the moment of saving: a resume goes on with them."""
    every = steps_per_epoch if checkpointing_steps == "epoch" else checkpointing_steps

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
            unchanged=unchanged,
        )

    def save_at_step_end(completed_steps: int) -> None:
        if completed_steps % num_iterations == 0 and stop.requested(completed_steps):
            stop.exit(save_at(completed_steps))  # SIGTERM or Ctrl-C to any process: all stop
        # And after the last step (once): a requeue of the finished run resumes there, retraining nothing. GRPO: at
        # a round's end only, where a resume picks up (mid-round, a longer run would redo the round's generation).
        last_round_end = completed_steps == max_train_steps and completed_steps % num_iterations == 0
        if every and (completed_steps % every == 0 or last_round_end):  # (every N: a multiple of num_iterations)
            save_at(completed_steps)

    return save_at_step_end


def unchanged_by_a_resume(
    training_examples: int,
    lora: bool,
    adapter_name_or_path: str | None = None,
    assistant_only_loss: bool | None = None,
    **lora_flags,
):
    """What a resume must find as the checkpoint recorded it (``shared.checkpoints.load_checkpoint`` compares them
    before loading): the number of training examples, which orders their shuffle, which tokens are trained (SFT's
    ``assistant_only_loss``; None: a recipe without the flag) and the adapter trained. A new adapter is its LoRA
    flags; a continued one (``adapter_name_or_path``: its own rank and targets, the flags ignored) is a digest of the
    weights PEFT loads from it, wherever the folder is now: its frozen copy is the reference, so another adapter, or
    the same folder trained again since, would change what the resumed steps are measured against."""
    kept = {"training_examples": training_examples}
    if assistant_only_loss is not None:  # another choice mid-run would change the loss from the next step on
        kept["assistant_only_loss"] = assistant_only_loss
    if not lora:
        return kept
    if adapter_name_or_path is None:
        return {**kept, **lora_flags}
    # PEFT's load_peft_weights reads the .safetensors when there is one: a .bin left beside it is never loaded.
    folder = Path(adapter_name_or_path)
    weights = next(
        (file for file in (folder / "adapter_model.safetensors", folder / "adapter_model.bin") if file.is_file()), None
    )
    digest = hashlib.sha256()  # (no weights: PEFT refuses the folder when it loads it)
    if weights is not None:
        with weights.open("rb") as opened:
            digest = hashlib.file_digest(opened, "sha256")
    held = f"<a folder of files of sha256 {digest.hexdigest()[:12]}>"
    return {**kept, "adapter_name_or_path": held}
