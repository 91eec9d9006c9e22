"""Preference pairs for DPO (``recipes/dpo.py``): TRL's preference formats read through
``llm_kit.sft_data.load_raw_datasets`` and checked row by row, token ids as TRL 1.16's DPOTrainer makes them by
default (prompt and completion tokenized together, cut at ``max_length`` from the end, a pair whose prompt fills it
dropped), and batches that hold the chosen and the rejected completion of every pair (chosen rows first), so that one
forward scores both. The reference policy's log-probs are ``dpo_kit.reference``'s.

The formats (TRL's): ``standard``, ``prompt``/``chosen``/``rejected`` strings; ``conversational``, the same columns
as lists of ``{role, content}`` messages; ``conversational_implicit``, no ``prompt`` column: ``chosen`` and
``rejected`` are whole conversations that share their first turns (the prompt) and differ after them."""

from __future__ import annotations

import hashlib
from functools import partial

import datasets
import torch

from shared.data import no_value
from shared.errors import RecipeError

from llm_kit.sft_data import (
    chat_tools,
    check_conversation,
    check_eos_token,
    check_tools,
    collate,
    common_prefix_length,
    stdlib_names,
)

FORMATS = ("standard", "conversational", "conversational_implicit")


def preference_format(dataset: datasets.Dataset, source: str) -> str:
    """The format of ``dataset`` (``FORMATS``), every row checked (``check_pair``; rows count from 1, as the lines of
    a JSON Lines file)."""
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
    for number, row in enumerate(dataset, start=1):
        check_pair(row, fmt, f"Row {number} of {source}")
    return fmt


def check_pair(row: dict, fmt: str, where: str) -> None:
    """Refuse a row DPO cannot learn from, in one paragraph that starts with ``where`` and names the column."""
    for column in ("prompt", "chosen", "rejected") if fmt != "conversational_implicit" else ("chosen", "rejected"):
        value = row.get(column)
        if value is None or (column != "prompt" and not (value.strip() if isinstance(value, str) else value)):
            needs = "every pair needs a prompt, a chosen and a rejected completion"
            raise RecipeError(no_value(where, column, value, needs))  # (the words of the other recipes' holes)
        if fmt == "standard" and not isinstance(value, str):
            raise RecipeError(f"{where}: {column!r} must be a string like the other rows'; got {str(value)[:200]}.")
        if fmt != "standard":
            check_conversation(value, f"{where} (column {column!r})", column, answer=column != "prompt")
    if fmt != "standard" and row.get("tools") is not None:  # rendered by the chat template, as TRL does
        check_tools(row["tools"], where)
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


def tokenize_pair(row: dict, fmt: str, tokenizer, max_length: int, max_prompt_length: int | None = None) -> dict:
    """``prompt_ids``, ``chosen_ids``, ``rejected_ids`` of one pair as TRL 1.16's DPOTrainer makes them by default
    (``_prepare_dataset``, then its collator's ``keep_start`` cut). The prompt alone and each prompt + completion
    are tokenized whole: strings with the tokenizer's special tokens, each completion ending in the end-of-sequence
    token (appended only when the text does not end with it); conversations through the chat template, with the
    row's ``tools`` if it has any, the prompt with its generation prompt. The completion starts where the prompt's
    tokens and both wholes' first differ: a prompt that ends in a space gives it to the completion's first word, as
    the whole text is tokenized (``prompt_merged``). Then prompt + completion is cut to ``max_length`` from its
    end; a pair whose prompt alone fills it has no completion token left and is ``dropped`` (TRL drops it). With
    ``max_prompt_length`` (TRL before 1.0), a longer prompt is first cut from the left, keeping its end, next to
    the answer (``prompt_cut``)."""
    prompt, chosen, rejected = split_pair(row, fmt)
    if fmt == "standard":
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(prompt)["input_ids"]
        wholes = [
            tokenizer(prompt + text + ("" if text.endswith(eos) else eos))["input_ids"] for text in (chosen, rejected)
        ]
    else:
        template = partial(tokenizer.apply_chat_template, tokenize=True, return_dict=True, tools=chat_tools(row))
        prompt_ids = template(prompt, add_generation_prompt=True)["input_ids"]
        wholes = [template(prompt + completion)["input_ids"] for completion in (chosen, rejected)]
    shared = min(common_prefix_length(prompt_ids, whole) for whole in wholes)
    prompt_merged, prompt_ids, completions = shared < len(prompt_ids), wholes[0][:shared], [w[shared:] for w in wholes]
    prompt_cut = max_prompt_length is not None and len(prompt_ids) > max_prompt_length
    prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :] if prompt_cut else prompt_ids
    room = max(max_length - len(prompt_ids), 0)
    return {
        "prompt_ids": prompt_ids,
        "chosen_ids": completions[0][:room],
        "rejected_ids": completions[1][:room],
        "dropped": room == 0,
        "prompt_cut": prompt_cut,
        "completion_cut": room > 0 and any(len(ids) > room for ids in completions),
        "prompt_merged": prompt_merged,
    }


def tokenize_pairs(
    accelerator,
    raw_datasets: datasets.DatasetDict,
    fmt: str,
    tokenizer,
    max_length: int,
    max_prompt_length: int | None,
) -> tuple[datasets.Dataset, datasets.Dataset, dict]:
    """The training and validation pairs as token ids (``tokenize_pair``) with their ``index`` in the split (what a
    precomputed reference is looked up by), the pairs whose prompt fills ``max_length`` dropped; per split how many
    pairs are kept, dropped and cut, said in one line. A split left without a pair is refused. Call it under
    ``main_process_first``: ``datasets`` caches the tokens for the other processes."""
    check_eos_token(tokenizer)  # each completion ends in it: as text after a string, or as the template writes it
    tokenized = raw_datasets.map(
        lambda row: tokenize_pair(row, fmt, tokenizer, max_length, max_prompt_length),
        remove_columns=raw_datasets["train"].column_names,
        desc="tokenizing pairs",
    )
    counts, kept = {}, {}
    for split in ("train", "validation"):
        kept[split] = tokenized[split].filter(lambda pair: not pair["dropped"], desc="dropping filled prompts")
        counts[split] = {
            "pairs": len(kept[split]),
            "dropped": len(tokenized[split]) - len(kept[split]),
            "completions_cut": sum(kept[split]["completion_cut"]),
            "prompts_cut": sum(kept[split]["prompt_cut"]),
            "prompts_merged": sum(kept[split]["prompt_merged"]),
        }
        if not len(kept[split]):
            prompts = sorted(len(ids) for ids in tokenized[split]["prompt_ids"])
            raise RecipeError(
                f"--max_length {max_length} leaves no completion token in any {split} pair: every prompt fills it "
                f"(the shortest has {prompts[0]} tokens, the median {prompts[len(prompts) // 2]}). Use a --max_length "
                "above them, or --max_prompt_length to cut prompts from the left."
            )
        columns = ["dropped", "prompt_cut", "completion_cut", "prompt_merged"]
        kept[split] = kept[split].remove_columns(columns).add_column("index", range(len(kept[split])))

    def said(c: dict) -> str:
        parts = [
            f"{c['dropped']} dropped: their prompt alone fills --max_length {max_length}",
            f"{c['completions_cut']} with a completion cut at --max_length {max_length}",
        ]
        if max_prompt_length:
            parts.append(f"{c['prompts_cut']} prompts cut from the left to --max_prompt_length {max_prompt_length}")
        if c["prompts_merged"]:
            parts.append(
                f"{c['prompts_merged']} whose prompt's last token merges into the completion's first, as TRL "
                "tokenizes them together"
            )
        return "; ".join(parts)

    accelerator.print(
        f"data: format {fmt}; " + "; ".join(f"{split} {c['pairs']} pairs ({said(c)})" for split, c in counts.items())
    )
    return kept["train"], kept["validation"], counts


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
        lambda row: {"messages": (lambda p, c, _: p + c)(*split_pair(row, fmt)), "tools": row.get("tools")},
        remove_columns=rows.column_names,
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
