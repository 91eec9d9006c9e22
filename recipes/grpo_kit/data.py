"""Prompts for ``recipes/grpo.py``: TRL's prompt-only formats read through ``llm_kit.sft_data.load_raw_datasets`` and
checked row by row, their token ids, the loader that hands every process the same prompts of a round (each process
then takes its share of the round's completions), and the micro-batches of prompt + completion rows the loss reads.

The formats (TRL's): ``standard``, a ``prompt`` string (tokenized with the tokenizer's special tokens);
``conversational``, a ``prompt`` list of ``{role, content}`` messages (rendered by the chat template with the
generation prompt). Every other column goes to the reward functions."""

from __future__ import annotations

import math
import datasets
import torch
from torch.utils.data import DataLoader, Sampler

from shared.data import refuse_empty_cells
from shared.errors import RecipeError

from llm_kit.loading import model_positions
from llm_kit.sft_data import DATA_FLAGS, check_conversation, collate, load_raw_datasets, stdlib_names

from .rewards import ANSWER_COLUMNS, load_reward_functions

FORMATS = ("standard", "conversational")
PROMPT_COLUMNS = ("prompt", "prompt_ids", "index")  # what the reward functions are not given as columns


def prompt_ids(prompt, fmt: str, tokenizer) -> list[int]:
    """The token ids of one prompt, as TRL makes them: the chat template with the generation prompt (conversations),
    or the tokenizer with its special tokens (strings)."""
    if fmt == "conversational":
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def prompt_format(dataset: datasets.Dataset, source: str, answers: bool = False) -> str:
    """The format of ``dataset`` (``FORMATS``), every row checked (rows count from 1, as the lines of a JSON Lines
    file): a ``prompt`` that is empty, not a string like the others, or not a list of messages, is refused naming its
    row; with ``answers`` (the accuracy reward reads them), a row with no ``answer`` (or ``solution``): its completions
    would score 0 silently. Needs no tokenizer: bad rows are refused before any model is built."""
    columns = dataset.column_names
    if answers:
        refuse_empty_cells(dataset, [column for column in ANSWER_COLUMNS if column in columns][:1], source)
    if "prompt" not in columns:
        raise RecipeError(
            f"{source} has no 'prompt' column, so there is nothing to generate from. GRPO reads TRL's prompt-only "
            "formats: a 'prompt' string, or a 'prompt' list of {role, content} messages, plus any columns the reward "
            f"functions read (such as 'answer'). Columns found: {columns}."
        )
    fmt = FORMATS[isinstance(dataset.features["prompt"], (datasets.Sequence, datasets.List, list))]
    for number, row in enumerate(dataset, start=1):
        where, prompt = f"Row {number} of {source}", row["prompt"]
        if fmt == "standard" and not (isinstance(prompt, str) and prompt.strip()):
            raise RecipeError(f"{where} has no 'prompt' string (it is {prompt!r}): fill it in, or drop the row.")
        if fmt == "conversational":
            check_conversation(prompt, f"{where} (column 'prompt')", "prompt", answer=False)
            if not prompt:
                raise RecipeError(f"{where} has an empty 'prompt' conversation: fill it in, or drop the row.")
    return fmt


def check_prompt_lengths(raw_datasets: datasets.DatasetDict, fmt: str, tokenizer, max_prompt_length: int) -> None:
    """Refuse a training or validation prompt of more tokens than ``max_prompt_length``, quoting its beginning (the
    rows are shuffled and split by now: its text names it)."""
    for split, rows in raw_datasets.items():
        for row in rows:
            length = len(prompt_ids(row["prompt"], fmt, tokenizer))
            if length > max_prompt_length:
                shown = str(row["prompt"])
                shown = shown[:80] + " ..." if len(shown) > 80 else shown
                raise RecipeError(
                    f"A {split} prompt has {length} tokens, more than --max_prompt_length {max_prompt_length}: "
                    f"{shown!r}. Pass a larger --max_prompt_length, or "
                    "shorten or drop the prompt (prompts are not cut: the model would answer a question it was not "
                    "asked)."
                )


def check_positions(config, name_or_path: str, longest_prompt_tokens: int, max_completion_length: int) -> None:
    """Refuse prompts and completions that together need more positions than the model has: one with learned
    positions (GPT-2, OPT) would stop mid-generation with an index error (on a GPU, a device-side assert), one with
    rotary positions would generate where it never learned to."""
    positions = model_positions(config)
    needed = longest_prompt_tokens + max_completion_length
    if positions and needed > positions:
        fits = positions - longest_prompt_tokens
        raise RecipeError(
            f"The longest training prompt has {longest_prompt_tokens} tokens and --max_completion_length is "
            f"{max_completion_length}: {needed} positions, more than the {positions} that {name_or_path} has. "
            + (f"Lower --max_completion_length to {fits} or less, or " if fits > 0 else "")
            + "shorten or drop the longest prompts (--max_prompt_length refuses them, quoting one)."
        )


def tokenize_prompts(
    accelerator, raw_datasets: datasets.DatasetDict, fmt: str, tokenizer, max_prompt_length: int | None = None
) -> tuple[datasets.Dataset, dict]:
    """The training prompts with each one's ``prompt_ids`` and its ``index`` in the split, and the counts printed in
    one line (prompts, their longest and median token counts); with ``max_prompt_length``, every training and
    validation prompt checked first (``check_prompt_lengths``). Call it under ``main_process_first`` (datasets caches
    it)."""
    if max_prompt_length is not None:
        check_prompt_lengths(raw_datasets, fmt, tokenizer, max_prompt_length)
    dataset = raw_datasets["train"]
    tokenized = dataset.map(
        lambda row, index: {"prompt_ids": prompt_ids(row["prompt"], fmt, tokenizer), "index": index},
        with_indices=True,
        desc="tokenizing prompts",
    )
    lengths, columns = (
        sorted(len(ids) for ids in tokenized["prompt_ids"]),
        [c for c in dataset.column_names if c != "prompt"],
    )
    counts = {
        "prompts": len(lengths),
        "longest_prompt_tokens": lengths[-1],
        "median_prompt_tokens": lengths[len(lengths) // 2],
    }
    accelerator.print(
        f"data: format {fmt}; {counts['prompts']} training prompts (longest {counts['longest_prompt_tokens']} tokens, "
        f"median {counts['median_prompt_tokens']}); the reward functions also get {columns}"
    )
    return tokenized, counts


# The flags ``read_prompts`` takes, by the names the recipe's parser gives them.
PROMPT_FLAGS = (*DATA_FLAGS, "reward_funcs", "format_pattern")


def read_prompts(
    *,
    train_file: str | None,
    validation_file: str | None,
    dataset_name: str | None,
    dataset_config_name: str | None,
    validation_split_percentage: float,
    seed: int,
    max_train_samples: int | None,
    max_eval_samples: int | None,
    reward_funcs: list[str],
    format_pattern: str,
) -> tuple[datasets.DatasetDict, str, list]:
    """The ``train`` and ``validation`` prompts (the user's files, a Hub dataset, or ``stdlib_name_prompts``), every
    row checked (``prompt_format``; a row without an answer where the accuracy reward reads them), their format, and
    the reward functions (``rewards.load_reward_functions``: one that needs a column the data lacks is refused). No
    tokenizer needed: bad data is refused before any model is built. Call it under ``main_process_first`` (datasets
    caches it)."""
    answers = "accuracy" in reward_funcs
    raw_datasets, fmt = load_raw_datasets(
        train_file,
        validation_file,
        dataset_name,
        dataset_config_name,
        validation_split_percentage,
        seed,
        max_train_samples,
        max_eval_samples,
        lambda rows, source: prompt_format(rows, source, answers),
        default_data=stdlib_name_prompts,
    )
    return raw_datasets, fmt, load_reward_functions(reward_funcs, format_pattern, raw_datasets["train"].column_names)


class EpochShuffle(Sampler[int]):
    """A permutation of ``size`` indices drawn from a generator seeded with ``seed + epoch`` (``set_epoch``): the same
    order on every process, and again after a resume, with no state to save. Epoch 0 is TRL's order (its
    ``RepeatSampler`` draws ``torch.randperm`` from a generator seeded with the seed)."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        yield from torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()


def check_layout(
    accelerator, global_batch_size: int, num_generations: int, data_parallel_size: int
) -> tuple[int, slice]:
    """The prompts of a round (the global batch over ``num_generations``) and this process's share of the round's
    completions (its rows of the global batch: a trainer's, in the split layout); or a refusal: a global batch that
    holds no whole number of groups."""
    if global_batch_size % num_generations:
        raise RecipeError(
            f"The global batch of {global_batch_size} completions (--per_device_train_batch_size x processes x "
            f"--gradient_accumulation_steps) is not a whole number of groups of --num_generations {num_generations}: "
            f"pass a --num_generations that divides {global_batch_size}, or a batch that {num_generations} divides."
        )
    rows, rank = global_batch_size // data_parallel_size, accelerator.process_index if data_parallel_size > 1 else 0
    return global_batch_size // num_generations, slice(rank * rows, (rank + 1) * rows)


def rounds(accelerator, train_dataloader: DataLoader, resume, num_iterations: int, max_train_steps: int):
    """The prompts of every round, the same on every process, from where training picks up (``resume``, the
    ``ResumePoint`` of ``load_checkpoint``: its epoch, and the rounds of ``num_iterations`` steps of it already done)
    to the end of the epoch of step ``max_train_steps``: each epoch in its own order (``EpochShuffle.set_epoch``: the
    same on every process and after a resume), the done rounds skipped (``skip_first_batches``)."""
    first_epoch, rounds_to_skip = resume.epoch, resume.batches_to_skip // num_iterations
    for epoch in range(first_epoch, math.ceil(max_train_steps / (len(train_dataloader) * num_iterations))):
        train_dataloader.sampler.set_epoch(epoch)
        skip = rounds_to_skip if epoch == first_epoch else 0
        yield from accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader


def prompt_loader(dataset: datasets.Dataset, prompts_per_round: int, seed: int) -> DataLoader:
    """The training prompts, ``prompts_per_round`` at a time (a round: one generation, for ``--num_iterations``
    optimizer steps), shuffled each epoch, the last incomplete round dropped (as TRL does). Not prepared by
    Accelerate: every process reads every prompt of the round (and generates its share of the completions), so a
    group of completions of one prompt may span processes and a resume in another process count reads the same
    rounds. Refused when the data holds fewer prompts than one round."""
    if len(dataset) < prompts_per_round:
        raise RecipeError(
            f"A round needs {prompts_per_round} prompts (the global batch over --num_generations) but the training "
            f"data has {len(dataset)}: add prompts, or lower --per_device_train_batch_size or "
            "--gradient_accumulation_steps."
        )
    return DataLoader(
        dataset, prompts_per_round, sampler=EpochShuffle(len(dataset), seed), drop_last=True, collate_fn=list
    )


def stdlib_name_prompts() -> datasets.DatasetDict:
    """The offline default: the questions of ``llm_kit.sft_data.stdlib_names`` (is this standard-library name a class,
    a function or a method?) as conversational prompts with their ``answer`` for the ``accuracy`` reward; held out as
    there, by top-level definition. Call it under main_process_first."""
    names = stdlib_names()
    return datasets.DatasetDict(
        {
            split: rows.map(
                lambda row: {"prompt": row["messages"][:1], "answer": row["messages"][1]["content"]},
                remove_columns=["messages"],
            )
            for split, rows in names.items()
        }
    )


def as_sft_rows(rows: datasets.Dataset, fmt: str) -> tuple[datasets.Dataset | None, str | None]:
    """Prompts with their reference answers (the ``answer`` or ``solution`` column) as ``llm_kit.sft_eval`` reads them
    (``messages`` or ``prompt_completion``), to score greedy answers by exact match; ``(None, None)`` without such a
    column."""
    answer_column = next((name for name in ANSWER_COLUMNS if name in rows.column_names), None)
    if answer_column is None:
        return None, None
    if fmt == "standard":
        return rows.map(
            lambda row: {"prompt": row["prompt"], "completion": str(row[answer_column])},
            remove_columns=rows.column_names,
        ), "prompt_completion"
    return rows.map(
        lambda row: {"messages": row["prompt"] + [{"role": "assistant", "content": str(row[answer_column])}]},
        remove_columns=rows.column_names,
    ), "messages"


def micro_batches(
    rows: list[dict],
    completions,
    advantages: torch.Tensor,
    batch_size: int,
    pad_token_id: int,
    mask_truncated: bool,
    device,
) -> list[dict]:
    """The process's completions of a round as micro-batches of ``batch_size`` rows, in order: each row its prompt
    followed by its completion, right-padded (``llm_kit.sft_data.collate``: the completion tokens are the scored
    positions, ``loss_positions``/``loss_targets``), with ``mask`` (the completion tokens the loss counts: all of a
    row's, or none of a truncated row's with ``mask_truncated``, as TRL's ``mask_truncated_completions``) and each
    row's ``advantages``, on ``device``; and ``old_logps`` where the generator sent the log-probs of the policy that
    generated (the split layout: 0 at the fillers)."""
    samples = [
        {"input_ids": row["prompt_ids"] + ids, "labels": [-100] * len(row["prompt_ids"]) + ids}
        for row, ids in zip(rows, completions.completion_ids)
    ]
    kept = torch.tensor([not (mask_truncated and cut) for cut in completions.truncated])
    batches = []
    for start in range(0, len(samples), batch_size):
        batch = collate(samples[start : start + batch_size], pad_token_id)
        batch["mask"] = (batch["loss_targets"] != -100) & kept[start : start + batch_size, None]
        batch["advantages"] = advantages[start : start + batch_size]
        if completions.logps is not None:  # a row's scored positions are its completion tokens, in order
            batch["old_logps"] = torch.zeros(batch["loss_targets"].shape)
            for row, logps in enumerate(completions.logps[start : start + batch_size]):
                batch["old_logps"][row, : len(logps)] = torch.tensor(logps)
        batches.append({key: value.to(device) for key, value in batch.items()})
    return batches
