"""Reward functions for ``recipes/grpo.py``, in TRL's signature: ``reward(prompts=..., completions=...,
completion_ids=..., **columns) -> list[float | None]``, one value per completion (None: the function does not apply
to it). ``completions`` are strings for plain prompts, ``[{"role": "assistant", "content": text}]`` for conversational
ones (as TRL passes them); every other column of the data comes as a list, one value per completion. A TRL user's
reward file works unchanged: ``--reward_funcs path/to/rewards.py:my_reward``.

Built in: ``accuracy`` (the completion, normalised, equals the ``answer`` or ``solution`` column, normalised: 1.0, else
0.0) and ``format`` (the completion matches ``--format_pattern``: 1.0, else 0.0)."""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import re
import sys
import types
from pathlib import Path

import torch

from shared.errors import RecipeError

from .collectives import gather, stop_if_any

ANSWER_COLUMNS = ("answer", "solution")
# What a reasoning model's completion looks like (open-r1's format reward): its reasoning, then its answer.
FORMAT_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"


def completion_text(completion) -> str:
    """The text of a completion: the string, or the content of a conversational completion's last message."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def normalise(text) -> str:
    """Case, surrounding whitespace, quotes, backticks and a final full stop removed; inner whitespace one space."""
    text = " ".join(str(text).split()).casefold()
    return text.strip("`'\" ").removesuffix(".").strip("`'\" ")


def accuracy(completions, **columns) -> list[float]:
    """1.0 where the completion equals the row's ``answer`` (or ``solution``) once both are normalised (case,
    surrounding whitespace, quotes and a final full stop aside), else 0.0."""
    column = next(name for name in ANSWER_COLUMNS if name in columns)
    return [float(normalise(completion_text(c)) == normalise(a)) for c, a in zip(completions, columns[column])]


def format_reward(completions, pattern: str, **columns) -> list[float]:
    """1.0 where the whole completion matches the regular expression ``pattern`` (``.`` matching newlines too)."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]


def load_reward_functions(names: list[str], format_pattern: str, columns: list[str]) -> list[tuple[str, object]]:
    """``(name, function)`` for each of ``--reward_funcs``: ``accuracy``, ``format``, or ``path/to/file.py:function``
    (imported from that file; named by the function's ``__name__``, as TRL names it in ``rewards/<name>/mean``).
    Refused in one paragraph: a file or function that is not there, a built-in whose column the data lacks
    (``columns``), a pattern that does not compile, the same name twice."""
    loaded = []
    for name in names:
        if name == "accuracy":
            if not set(ANSWER_COLUMNS) & set(columns):
                raise RecipeError(
                    f"--reward_funcs accuracy compares each completion with the row's 'answer' (or 'solution') "
                    f"column, which the data lacks (its columns: {columns}). Add the column, or use another reward."
                )
            loaded.append(("accuracy", accuracy))
        elif name == "format":
            try:
                re.compile(format_pattern)
            except re.error as error:
                raise RecipeError(
                    f"--format_pattern {format_pattern!r} is not a regular expression: {error}."
                ) from None
            loaded.append(("format", functools.partial(format_reward, pattern=format_pattern)))
        else:
            loaded.append(user_function(name))
    seen = [found for found, _ in loaded]
    twice = sorted({found for found in seen if seen.count(found) > 1})
    if twice:
        raise RecipeError(f"--reward_funcs names {twice} more than once: each reward is logged by its name.")
    return loaded


def user_function(spec: str) -> tuple[str, object]:
    """The function ``name`` of ``path/to/file.py:name``, imported from that file; its imports find the modules
    beside it, as when Python runs it (its folder is first on ``sys.path`` while it is imported, not after)."""
    path, _, function = spec.rpartition(":")
    if not path or not function or not path.endswith(".py"):
        raise RecipeError(
            f"--reward_funcs {spec!r} is neither a built-in reward (accuracy, format) nor a function of a file, "
            "written path/to/rewards.py:function_name."
        )
    if not Path(path).is_file():
        raise RecipeError(f"--reward_funcs {spec!r}: the file {path!r} does not exist (looked in {Path.cwd()}).")
    spec_ = importlib.util.spec_from_file_location(f"user_rewards_{Path(path).stem}", path)
    module, folder = importlib.util.module_from_spec(spec_), str(Path(path).resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec_.loader.exec_module(module)
    except Exception as error:  # the user's file: any error in it is theirs to see, in one line
        raise RecipeError(
            f"--reward_funcs {spec!r}: importing {path!r} failed: {type(error).__name__}: {error}"
        ) from None
    finally:
        sys.path.remove(folder)
    found = getattr(module, function, None)
    if not callable(found):
        defined = sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_"))
        raise RecipeError(
            f"--reward_funcs {spec!r}: {path!r} has no function {function!r} (its functions: {defined})."
        )
    return getattr(found, "__name__", function), found


def trainer_state(global_step: int, max_steps: int, epoch: float):
    """What TRL passes its reward functions as ``trainer_state`` (for rewards that change over training), with the
    fields of transformers' ``TrainerState`` they read."""
    return types.SimpleNamespace(global_step=global_step, max_steps=max_steps, epoch=epoch)


def score(functions, prompts: list, completions: list, completion_ids: list, columns: dict, **extra) -> tuple:
    """Every function's reward for every completion: a tensor ``(completions, functions)``, NaN where a function
    returned None, and None; or a paragraph naming the function and the row when one raised, returned the wrong
    number of values, or a value that is not a finite number (the row named by its completion and prompt). A function
    that raises on the batch is called again one completion at a time, to name the first it fails on. ``extra``: the
    keyword arguments TRL adds (``trainer_state``; ``log_extra`` and ``log_metric``, which this recipe passes as
    functions that do nothing: it logs no completions table nor a reward's own metrics)."""
    values = torch.full((len(completions), len(functions)), math.nan)
    extra = {"log_extra": lambda column, values: None, "log_metric": lambda name, value: None, **extra}
    where = lambda i: (
        f"the completion {str(completion_text(completions[i]))[:200]!r} of the prompt {str(prompts[i])[:200]!r}"
    )

    def call(function, rows):
        chosen = {column: [value[i] for i in rows] for column, value in columns.items()}
        return function(
            prompts=[prompts[i] for i in rows],
            completions=[completions[i] for i in rows],
            completion_ids=[completion_ids[i] for i in rows],
            **chosen,
            **extra,
        )

    for index, (name, function) in enumerate(functions):
        try:
            returned = list(call(function, range(len(completions))))
        except Exception as raised:  # the user's function: whatever it raises is reported, naming the row
            error, failed = raised, None
            for row in range(len(completions)):
                try:
                    call(function, [row])
                except Exception as single:
                    error, failed = single, row
                    break
            row = f" on {where(failed)}" if failed is not None else f" on a batch of {len(completions)} completions"
            return values, f"The reward function {name!r} raised {type(error).__name__}: {error}{row}."
        if len(returned) != len(completions):
            return values, (
                f"The reward function {name!r} returned {len(returned)} values for {len(completions)} completions: it "
                "must return one per completion (a number, or None where it does not apply)."
            )
        for row, value in enumerate(returned):
            scalar = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
            number = float(value) if scalar else None
            if value is not None and (number is None or not math.isfinite(number)):
                return values, (
                    f"The reward function {name!r} returned {value!r} for {where(row)}: a reward is a finite number, "
                    "or None where the function does not apply."
                )
            values[row, index] = math.nan if value is None else number
    return values, None


def score_round(accelerator, functions, rows: list[dict], completions, tokenizer, fmt: str, group=None, **extra):
    """This process's completions of a round scored by every reward function (``score``, their text decoded as TRL
    passes it: a string, or an assistant message for conversational prompts), gathered from every process (a
    collective; ``group``: from its processes alone, the split layout's trainers): one row per completion of the
    round, a column per function (NaN: not applicable), then its length in tokens and whether it was truncated. A
    reward function that failed on any process stops every process, its paragraph printed once."""
    texts = tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)
    texts = [[{"role": "assistant", "content": text}] for text in texts] if fmt == "conversational" else texts
    columns = [name for name in rows[0] if name not in ("prompt", "prompt_ids", "index")]  # the data's other columns
    prompts, values = [row["prompt"] for row in rows], {name: [row[name] for row in rows] for name in columns}
    scores, problem = score(functions, prompts, texts, completions.completion_ids, values, **extra)
    lengths = [
        [len(ids), cut, problem is not None] for ids, cut in zip(completions.completion_ids, completions.truncated)
    ]
    mine = torch.cat([scores, torch.tensor(lengths, dtype=torch.float)], dim=1).to(accelerator.device)
    gathered = gather(accelerator, mine, group)
    if gathered[:, -1].any():  # (every process sees it: all of them take part in the collective that prints it)
        stop_if_any(accelerator, problem, group)
    return gathered[:, :-1]
