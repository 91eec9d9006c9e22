"""Preference pairs and the reference policy for DPO (``recipes/dpo.py``): TRL's preference formats read through
``llm_kit.sft_data.load_raw_datasets`` and checked row by row, token ids with the prompt cut from the left and the
completions to ``max_length``, and batches that hold the chosen and the rejected completion of every pair (chosen rows
first), so that one forward scores both; the reference's log-probs (``llm_kit.adapters`` holds the adapter to
continue and the switch to the reference), live or computed before training.

The formats (TRL's): ``standard``, ``prompt``/``chosen``/``rejected`` strings; ``conversational``, the same columns
as lists of ``{role, content}`` messages; ``conversational_implicit``, no ``prompt`` column: ``chosen`` and
``rejected`` are whole conversations that share their first turns (the prompt) and differ after them."""

from __future__ import annotations

import hashlib
import math

import datasets
import torch

from shared.runtime import RecipeError

from llm_kit.adapters import reference_policy
from llm_kit.sft_data import check_conversation, collate, stdlib_names, token_losses

FORMATS = ("standard", "conversational", "conversational_implicit")


def preference_format(
    dataset: datasets.Dataset,
    source: str,
    tokenizer=None,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
) -> str:
    """The format of ``dataset`` (``FORMATS``), every row checked (``check_pair``; rows count from 1, as the lines of
    a JSON Lines file). With ``tokenizer``: a prompt that, cut to ``max_prompt_length``, leaves no completion token at
    ``max_length`` is refused too, by its row (only possible when ``max_prompt_length >= max_length``)."""
    columns = dataset.column_names
    missing = [name for name in ("chosen", "rejected") if name not in columns]
    if missing:
        raise RecipeError(
            f"{source} has no {' and no '.join(repr(name) for name in missing)} column, so it holds no preference "
            f"pairs. DPO reads TRL's preference formats: 'prompt', 'chosen' and 'rejected' (strings, or lists of "
            f"{{role, content}} messages), or 'chosen' and 'rejected' conversations that share their first turns. "
            f"Columns found: {columns}."
        )
    conversational = isinstance(dataset.features["chosen"], (datasets.Sequence, datasets.List, list))
    if "prompt" not in columns and not conversational:
        raise RecipeError(
            f"{source} has 'chosen' and 'rejected' strings but no 'prompt' column: with strings the "
            "prompt must be its own column (only conversations may hold it in their first turns)."
        )
    fmt = FORMATS[0] if not conversational else FORMATS[1] if "prompt" in columns else FORMATS[2]
    check_prompts = tokenizer is not None and max_prompt_length >= max_length
    for number, row in enumerate(dataset, start=1):
        where = f"Row {number} of {source}"
        check_pair(row, fmt, where)
        if check_prompts:
            prompt = len(tokenize_pair(row, fmt, tokenizer, 10**9, 10**9)["prompt_ids"])
            if min(prompt, max_prompt_length) >= max_length:
                raise RecipeError(
                    f"{where}: its 'prompt' has {prompt} tokens, which at --max_length {max_length} leaves no "
                    f"completion token to compare (--max_prompt_length {max_prompt_length} cuts prompts only beyond "
                    f"that). Use a --max_prompt_length below --max_length (default: half of it), or drop the row."
                )
    return fmt


def check_pair(row: dict, fmt: str, where: str) -> None:
    """Refuse a row DPO cannot learn from, in one paragraph that starts with ``where`` and names the column."""
    for column in ("prompt", "chosen", "rejected") if fmt != "conversational_implicit" else ("chosen", "rejected"):
        value = row.get(column)
        if value is None or (column != "prompt" and len(value) == 0):
            raise RecipeError(
                f"{where} has no {column!r} (it is {value!r}): every pair needs a prompt, a chosen "
                "and a rejected completion. Fill it in, or drop the row."
            )
        if fmt == "standard" and not isinstance(value, str):
            raise RecipeError(f"{where}: {column!r} must be a string like the other rows'; got {str(value)[:200]}.")
        if fmt != "standard":
            check_conversation(value, f"{where} (column {column!r})", column, answer=column != "prompt")
    prompt, chosen, rejected = split_pair(row, fmt)
    if chosen == rejected:
        raise RecipeError(
            f"{where}: 'chosen' and 'rejected' are identical ({str(chosen)[:200]}), so there is "
            "nothing to prefer. Drop the row, or fix the rejected completion."
        )
    if fmt == "conversational_implicit":
        if not prompt:
            raise RecipeError(
                f"{where}: the 'chosen' and 'rejected' conversations do not share their first turn, so there is no "
                f"prompt both answer (chosen starts {str(row['chosen'][:1])[:150]}, rejected starts "
                f"{str(row['rejected'][:1])[:150]}). Put the same prompt turns first in both, or give a 'prompt' "
                "column."
            )
        if not (chosen and rejected and chosen[0]["role"] == rejected[0]["role"] == "assistant"):
            raise RecipeError(
                f"{where}: after the turns that 'chosen' and 'rejected' share, each must go on with an assistant "
                f"answer (chosen goes on with {str(chosen[:1])[:150]}, rejected with {str(rejected[:1])[:150]}): "
                "one conversation may not simply extend the other."
            )


def split_pair(row: dict, fmt: str) -> tuple:
    """``(prompt, chosen, rejected)``; for implicit prompts, the turns both conversations share, then the rest."""
    if fmt != "conversational_implicit":
        return row["prompt"], row["chosen"], row["rejected"]
    chosen, rejected, shared = row["chosen"], row["rejected"], 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def tokenize_pair(row: dict, fmt: str, tokenizer, max_length: int, max_prompt_length: int) -> dict:
    """``prompt_ids``, ``chosen_ids``, ``rejected_ids`` of one pair: the prompt cut from the left to
    ``max_prompt_length`` tokens (its end, next to the answer, is kept), each completion cut to what ``max_length``
    leaves. Conversations: the chat template renders the prompt with its generation prompt and each whole
    conversation; the completion is the rest of the text, tokenized on its own, so which tokens are the completion is
    exact (as ``llm_kit.sft_data.tokenize_sample``). Strings: the prompt with the tokenizer's special tokens, the
    completion without, plus the end-of-sequence token (TRL adds it too)."""
    prompt, chosen, rejected = split_pair(row, fmt)
    completions = []
    if fmt == "standard":
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        for completion in (chosen, rejected):
            ids = tokenizer(completion, add_special_tokens=not prompt)["input_ids"]
            completions.append(ids + [tokenizer.eos_token_id])
    else:
        prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        for completion in (chosen, rejected):
            full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
            if not full.startswith(prompt_text):
                raise RecipeError(
                    "The chat template does not render a conversation as a prefix of its continuation, "
                    "so the completion tokens cannot be found exactly; use a template that does."
                )
            completions.append(tokenizer(full[len(prompt_text) :], add_special_tokens=False)["input_ids"])
    prompt_cut = len(prompt_ids) > max_prompt_length
    prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :] if prompt_cut else prompt_ids
    room = max_length - len(prompt_ids)
    return {
        "prompt_ids": prompt_ids,
        "chosen_ids": completions[0][:room],
        "rejected_ids": completions[1][:room],
        "prompt_cut": prompt_cut,
        "completion_cut": any(len(ids) > room for ids in completions),
    }


def tokenize_pairs(
    accelerator, raw_datasets: datasets.DatasetDict, fmt: str, tokenizer, max_length: int, max_prompt_length: int
) -> tuple[datasets.Dataset, datasets.Dataset, dict]:
    """The training and validation pairs as token ids with their ``index`` in the split (what a precomputed
    reference is looked up by), and per split how many pairs there are and how many were cut (said in one line).
    Call it under ``main_process_first``: ``datasets`` caches the tokens for the other processes."""
    tokenized = raw_datasets.map(
        lambda row, index: {**tokenize_pair(row, fmt, tokenizer, max_length, max_prompt_length), "index": index},
        with_indices=True,
        remove_columns=raw_datasets["train"].column_names,
        desc="tokenizing pairs",
    )
    counts = {
        split: {
            "pairs": len(tokenized[split]),
            "prompts_cut": sum(tokenized[split]["prompt_cut"]),
            "completions_cut": sum(tokenized[split]["completion_cut"]),
        }
        for split in tokenized
    }
    accelerator.print(
        f"data: format {fmt}; "
        + "; ".join(
            f"{split} {c['pairs']} pairs ({c['prompts_cut']} prompts cut from the left to --max_prompt_length "
            f"{max_prompt_length}, {c['completions_cut']} with a completion cut at --max_length {max_length})"
            for split, c in counts.items()
        )
    )
    tokenized = tokenized.remove_columns(["prompt_cut", "completion_cut"])
    return tokenized["train"], tokenized["validation"], counts


def collate_pairs(pairs: list[dict], pad_token_id: int) -> dict:
    """A batch of ``pairs``: ``sequences``, the padded batch of ``llm_kit.sft_data.collate`` (labels on the completion
    tokens only, the scored positions for ``logits_to_keep``) with the chosen rows first and the rejected rows after,
    so that one forward scores both; ``index``, each pair's place in its split. The first token of a row is never
    scored (nothing in the row predicts it)."""
    rows = []
    for column in ("chosen_ids", "rejected_ids"):
        for pair in pairs:
            ids = pair["prompt_ids"] + pair[column]
            labels = [-100] * len(pair["prompt_ids"]) + pair[column]
            rows.append({"input_ids": ids, "labels": [-100] + labels[1:]})
    return {"sequences": collate(rows, pad_token_id), "index": torch.tensor([pair["index"] for pair in pairs])}


def as_sft_rows(rows: datasets.Dataset, fmt: str) -> tuple[datasets.Dataset, str]:
    """The pairs as ``llm_kit.sft_eval`` reads them (the prompt with its chosen answer: ``messages`` or
    ``prompt_completion``), to score greedy answers by exact match."""
    if fmt == "standard":
        return rows.map(
            lambda row: {"prompt": row["prompt"], "completion": row["chosen"]}, remove_columns=rows.column_names
        ), "prompt_completion"
    return rows.map(
        lambda row: {"messages": (lambda p, c, _: p + c)(*split_pair(row, fmt))}, remove_columns=rows.column_names
    ), "messages"


def stdlib_name_pairs() -> datasets.DatasetDict:
    """The offline default: the questions of ``llm_kit.sft_data.stdlib_names`` (is this standard-library name a class,
    a function or a method?) as conversational pairs, the right answer chosen and one of the two wrong ones (picked by
    md5 of the question) rejected. Held out as there, by top-level definition. Call it under main_process_first."""
    kinds = ("class", "function", "method")

    def pair(row):
        question, answer = row["messages"][0], row["messages"][1]["content"]
        wrong = [kind for kind in kinds if kind != answer]
        rejected = wrong[int(hashlib.md5(question["content"].encode()).hexdigest(), 16) % 2]
        return {
            "prompt": [question],
            "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }

    names = stdlib_names()
    return datasets.DatasetDict({split: names[split].map(pair, remove_columns=["messages"]) for split in names})


# ----------------------------------------------------------------------------- the reference policy
def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Summed log-prob of each row's completion tokens (chosen rows, then rejected): minus their summed loss, from
    ``token_losses`` (logits at the completion positions only, fp32 cross-entropy in checkpointed chunks)."""
    return -token_losses(model, batch["sequences"])[1]


def reference_logps(accelerator, model, batch: dict, precomputed: torch.Tensor | None) -> torch.Tensor:
    """The reference's log-probs of the batch's rows: looked up by pair index when precomputed, else one forward
    without gradients through ``reference_policy`` (the prepared model, unwrapped from DDP: no gradient to sync)."""
    if precomputed is not None:
        return precomputed[batch["index"]].T.flatten()  # (pairs, 2) -> chosen rows, then rejected rows
    unwrapped = accelerator.unwrap_model(model)
    with torch.no_grad(), reference_policy(unwrapped):
        return sequence_logps(unwrapped, batch)


def precompute_reference(accelerator, model, dataloader) -> torch.Tensor:
    """The model's log-probs of every pair's chosen and rejected completion, ``(size, 2)`` on every process, by pair
    index: one pass before training (every process takes its share; ``gather_for_metrics`` drops repeats)."""
    model.eval()
    size = len(dataloader.dataset)
    table = torch.full((size, 2), math.nan, device=accelerator.device)
    for batch in dataloader:
        with torch.no_grad():
            chosen, rejected = sequence_logps(model, batch).chunk(2)
        index, chosen, rejected = accelerator.gather_for_metrics((batch["index"], chosen, rejected))
        table[index] = torch.stack([chosen, rejected], dim=1).float()
    accelerator.print(f"reference: the log-probs of {size} pairs computed before training (training holds one model)")
    return table
