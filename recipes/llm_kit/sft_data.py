"""Chat data for supervised fine-tuning (``recipes/llm_finetune.py``): the TRL formats (``messages``,
``prompt``/``completion``, ``text``) read from files or the Hub and checked row by row, the tokenizer's pad token and
chat template, token ids with labels on the answers only, and batches (padded, or packed rows flattened into one).

Not TRL's data helpers (TRL is not a dependency): its assistant-only loss needs a chat template with ``{% generation
%}`` markers, which few models' templates have (TRL swaps a known one for its own training template);
``tokenize_sample`` trains the tokens such a template marks, and finds the answer tokens of any other template in the
conversation's one rendering, with one labelling rule for the three formats, and refuses bad rows by their place in
the file."""

from __future__ import annotations

import ast
import bisect
import collections
import hashlib
import json
import platform
import re
from functools import partial
from pathlib import Path

import datasets
import torch
from jinja2 import TemplateError
from transformers import AutoTokenizer, DataCollatorWithFlattening

from shared.data import DOCSTRING_PACKAGES, TEST_FOLDERS, in_validation_split, load_data_files, refuse_empty_cells
from shared.data import no_value, split_by_column, stdlib_root
from shared.errors import RecipeError, stop_if_found
from shared.flags import tokenizer_problem

from llm_kit.loss import scored_positions

ROLES = {"system", "user", "assistant"}
# For tokenizers without a chat template: every message is "<|role|>\n" + content + the end-of-sequence token, and the
# generation prompt is "<|assistant|>\n" (the tags are plain text, not new tokens, so the vocabulary stays as it is).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}{% "
    "endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def chat_tokenizer(accelerator, name_or_path: str, trust_remote_code: bool = False, tokenizer_name: str | None = None):
    """The model's tokenizer (or ``tokenizer_name``'s), with a pad token. A model folder without a tokenizer is
    refused, naming what it holds (a collective)."""
    stop_if_found(tokenizer_problem(name_or_path, tokenizer_name))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of attention and loss; any id will do
        accelerator.print(f"tokenizer: no pad token, using the end-of-sequence token {tokenizer.eos_token!r}")
    return tokenizer


def add_chat_template(accelerator, tokenizer) -> None:
    """Give ``tokenizer`` the recipe's default chat template when it has none (said so). Only for data that holds
    conversations: the template is saved with the model, and one it never trained with would have
    ``apply_chat_template`` format prompts the model has never seen."""
    if tokenizer.chat_template is None:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        accelerator.print(
            "tokenizer: no chat template, using the recipe's default (<|role|> lines ending in the EOS token)"
        )


# The flags ``load_raw_datasets`` takes, by the names the recipes' parsers give them.
DATA_FLAGS = (
    "train_file",
    "validation_file",
    "dataset_name",
    "dataset_config_name",
    "validation_split_percentage",
    "seed",
    "max_train_samples",
    "max_eval_samples",
)


def load_raw_datasets(
    train_file: str | None = None,
    validation_file: str | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    validation_split_percentage: float = 5,
    seed: int = 0,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    row_format=None,
    default_data=None,
) -> tuple[datasets.DatasetDict, str]:
    """``train`` and ``validation`` from the user's files, a Hub dataset, or the offline default (``stdlib_names``),
    every row checked, and their format (``data_format``); ``validation_split_percentage`` of train is held out when
    there is no validation split. At most ``max_train_samples`` / ``max_eval_samples`` of each (shuffled). Call it
    under ``main_process_first``. Another recipe's data (``recipes/dpo.py``'s preference pairs) passes its own
    ``row_format(dataset, source) -> format`` (checks every row, names the format) and ``default_data()``."""
    row_format = row_format or (
        lambda dataset, source: (
            check_rows(dataset, data_format(dataset.column_names), source) or data_format(dataset.column_names)
        )
    )
    if train_file:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        raw = load_data_files(files, needs="at least one sample")
        if "validation" in raw and set(raw["validation"].column_names) != set(raw["train"].column_names):
            raise RecipeError(
                f"--train_file {files['train']!r} has the columns {raw['train'].column_names} but --validation_file "
                f"{files['validation']!r} has {raw['validation'].column_names}: both must be in one format (messages, "
                "prompt + completion, or text)."
            )
    elif dataset_name:
        try:
            raw = datasets.load_dataset(dataset_name, dataset_config_name)
        except Exception as error:  # offline, unknown name, or a bad configuration: all end here
            raise RecipeError(
                f"Could not load the Hub dataset {dataset_name!r} ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:300]}). Without internet, pass --train_file."
            ) from None
        if "validation" not in raw and "test" in raw:
            raw["validation"] = raw["test"]
    else:
        raw = (default_data or stdlib_names)()
    # Every row checked before anything is shuffled or split off, so that a bad row is named by its place in the file.
    formats = {}
    for split in ("train", "validation") if train_file or dataset_name else ():
        if split in raw and len(raw[split]):
            given = train_file if split == "train" else validation_file
            source = f"--{split}_file {given!r}" if given else f"the {split} split of {dataset_name}"
            formats[source] = row_format(raw[split], source)
    if len(set(formats.values())) > 1:  # same columns, other types: a prompt string here, a list of messages there
        (train, train_format), (validation, validation_format) = formats.items()
        raise RecipeError(
            f"{train} holds {train_format} rows but {validation} holds {validation_format} rows: both must be in one "
            "format (every row is read as the training rows are): convert one of them."
        )
    if "validation" not in raw:
        raw = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
        raw["validation"] = raw.pop("test")
    limits = {"train": max_train_samples, "validation": max_eval_samples}
    for split in ("train", "validation"):
        if len(raw[split]) == 0:
            raise RecipeError(f"The {split} split is empty: it needs at least one sample.")
        if limits[split]:
            raw[split] = raw[split].shuffle(seed=seed).select(range(min(limits[split], len(raw[split]))))
    raw = datasets.DatasetDict({"train": raw["train"], "validation": raw["validation"]})
    if holds_conversations_as_prompts(raw["train"]):
        # TRL's conversational prompt + completion: one conversation, trained on the completion's answers only.
        as_messages = lambda row: {"messages": row["prompt"] + row["completion"], "prompt_turns": len(row["prompt"])}
        raw = raw.map(as_messages, remove_columns=["prompt", "completion"])
    return raw, row_format(raw["train"].select(range(0)), "the training data")


def check_rows(dataset: datasets.Dataset, fmt: str, source: str) -> None:
    """Refuse, naming the row, one that tokenize_sample could not learn from (rows count from 1, as lines of a JSON
    Lines file do): a missing or empty cell (a prompt may be ""), or a conversation without an answer."""
    columns = {"messages": ["messages"], "prompt_completion": ["prompt", "completion"], "text": ["text"]}[fmt]
    refuse_empty_cells(dataset, columns, source, may_be_empty=("prompt",))
    if fmt == "messages":
        for number, messages in enumerate(dataset["messages"], start=1):
            check_conversation(messages, f"Row {number} of {source}")
    conversational = fmt == "prompt_completion" and holds_conversations_as_prompts(dataset)
    for number, row in enumerate(dataset if conversational else [], start=1):  # (strings: checked above)
        for column in ("prompt", "completion"):
            where = f"Row {number} of {source} (column {column!r})"
            check_conversation(row[column], where, column, answer=column == "completion")
    rendered = (fmt == "messages" or conversational) and "tools" in dataset.column_names  # by the chat template
    for number, tools in enumerate(dataset["tools"] if rendered else [], start=1):
        check_tools(tools, f"Row {number} of {source}")


def holds_conversations_as_prompts(dataset: datasets.Dataset) -> bool:
    """TRL's conversational prompt + completion: ``prompt`` and ``completion`` hold lists of messages, not strings."""
    return "completion" in dataset.column_names and len(dataset) > 0 and not isinstance(dataset[0]["prompt"], str)


def check_tools(tools, where: str) -> None:
    """Refuse a ``tools`` cell that is not JSON, in one paragraph that starts with ``where``."""
    try:
        chat_tools({"tools": tools})
    except json.JSONDecodeError as error:
        raise RecipeError(
            f"{where}: its 'tools' cell is not JSON ({error.msg}): {str(tools)[:200]}. Give the tool schemas as a "
            "list, or as its JSON text."
        ) from None


def check_conversation(messages, where: str, column: str = "messages", answer: bool = True) -> None:
    """Refuse a ``messages`` value this recipe cannot learn from, in one paragraph that starts with ``where``
    (``column``: its column; ``answer=False``: a prompt, which needs no assistant turn)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages
    ):
        raise RecipeError(
            f"{where}: {column!r} must be a list of {{role, content}} objects; got {str(messages)[:200]}."
        )
    unknown = sorted({m["role"] for m in messages} - ROLES)
    if unknown:
        raise RecipeError(f"{where} has the role(s) {unknown}; the roles are {sorted(ROLES)}: {str(messages)[:200]}")
    unusable = lambda m: not isinstance(m["content"], str) or (m["role"] == "assistant" and not m["content"].strip())
    empty = next((m for m in messages if unusable(m)), None)  # (an empty system or user turn is a turn)
    if empty is not None:
        turn = f"{where}: {'an' if empty['role'] == 'assistant' else 'a'} {empty['role']} turn in {column!r}"
        raise RecipeError(no_value(turn, "content", empty["content"]))
    if answer and not any(m["role"] == "assistant" for m in messages):
        raise RecipeError(
            f"{where} has no assistant turn, so nothing to learn from: {str(messages)[:200]}. Add the "
            "answer as {'role': 'assistant', 'content': ...}, or drop the row."
        )


def check_eos_token(tokenizer) -> None:
    """Refuse a tokenizer that tokenizes its end-of-sequence text into other tokens (``split_special_tokens``, or an
    ``eos_token`` that is not one of its tokens): the EOS appended to an answer (as text, as TRL appends it) and the
    one a chat template writes would never be the token that ends generation, so the model would not learn to stop."""
    eos = tokenizer.eos_token
    pieces = tokenizer(eos, add_special_tokens=False)["input_ids"] if eos else [tokenizer.eos_token_id]
    if pieces != [tokenizer.eos_token_id]:
        raise RecipeError(
            f"The tokenizer of {tokenizer.name_or_path} writes its end-of-sequence text {eos!r} as "
            f"{tokenizer.convert_ids_to_tokens(pieces)}, not as its token {tokenizer.eos_token_id}: where it ends an "
            "answer (appended as text, as TRL appends it, or written by the chat template), it would never teach the "
            "model the token that ends generation. Use a tokenizer that keeps its special tokens whole "
            "(split_special_tokens false in its tokenizer_config.json) and whose eos_token is one of its tokens."
        )


def data_format(columns: list[str]) -> str:
    """``messages``, ``prompt_completion`` or ``text``: the TRL formats, in that order of preference."""
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise RecipeError(
        f"The data has none of the formats this recipe reads: a 'messages' column (a list of {{role, content}}), "
        f"'prompt' and 'completion' columns, or a 'text' column. Columns found: {columns}."
    )


def tokenize_sample(sample: dict, fmt: str, tokenizer, max_length: int, assistant_only_loss: bool = True) -> dict:
    """``input_ids`` and ``labels`` (-100 everywhere but on answer tokens) of one sample, truncated to ``max_length``.

    A prompt and its completion, as TRL's SFTTrainer does: the prompt alone and prompt + completion are tokenized whole
    (with the tokenizer's special tokens, the end-of-sequence token appended only when the text does not end with it),
    and the answer starts where their tokens first differ: a prompt that ends in a space gives it to the answer's first
    word, as the whole text is tokenized (``prompt_merged``). A conversation is rendered by its chat template once and
    tokenized whole (the template writes its own special tokens); without ``assistant_only_loss`` (TRL's default) every
    token is trained, a conversational prompt's completion (its turns after ``prompt_turns``) from where the prompt's
    tokens and the whole's first differ, as TRL's completion mask has it. Else a template with ``{% generation %}``
    markers has the tokens it marks trained, as TRL trains them (``marked_answer_labels``); any other has each answer
    found in the rendering (``answer_spans``) and its characters mapped to tokens by the prompt/completion rule at both
    ends (an end token that merges into the next turn's text, ``answer_merged``, is context, not answer). Tokenizing
    the turns apart would differ where a tokenizer marks a text's start (a SentencePiece ``"▁"`` before every answer).
    A conversational prompt + completion (read as one conversation, its ``prompt_turns`` first) is trained on the
    completion's answers only (with ``assistant_only_loss``). A text is all answer. The first token of a sample never
    has a label: nothing inside the sample predicts it (this also keeps packed samples from predicting each other).
    """
    prompt_merged = answer_merged = False
    if fmt == "messages":
        messages, tools, context_turns = sample["messages"], chat_tools(sample), sample.get("prompt_turns", 0)
        check_conversation(messages, "A conversation")  # (rows of files were checked with their row numbers)
        render = partial(tokenizer.apply_chat_template, tools=tools, tokenize=False)
        # The conversation rendered once, as the model will read it: the template writes its own special tokens (a
        # BOS among them) as text, so the tokenizer adds none.
        try:
            text = render(messages)
        except TemplateError as error:  # the template's own refusal (Gemma's of a system turn), or a template bug
            raise RecipeError(
                f"The chat template of {tokenizer.name_or_path} cannot render this conversation ({error}): "
                f"{str(messages)[:200]}. Give conversations in the shape the template takes (Gemma's, for one, has "
                "no system turn: put the system prompt at the start of the first user turn; and its turns alternate "
                "user, assistant), or pass another template's tokenizer folder as --tokenizer_name."
            ) from None
        whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
        ids, labels = whole["input_ids"], [-100] * len(whole["input_ids"])
        if not assistant_only_loss:  # TRL's default: every token trained (a conversational prompt's: its completion)
            asked = render(messages[:context_turns], add_generation_prompt=True) if context_turns else ""
            # TRL's completion mask: from where the prompt's tokens and the whole's first differ
            start = common_prefix_length(tokenizer(asked, add_special_tokens=False)["input_ids"], ids)
            labels = [-100] * start + ids[start:]
        elif has_generation_markers(tokenizer.chat_template):  # the tokens the template marks, as TRL trains them
            labels = marked_answer_labels(tokenizer, render, messages, ids, context_turns)
        else:
            for start, end in answer_spans(render, messages, text, context_turns):
                # TRL's prompt/completion rule (below) at both ends of an answer: a token that the context merges into
                # the answer's first is trained; one that the answer's end merges into the next turn's text is not.
                start, end, into_answer, into_next = answer_tokens(tokenizer, whole, text, start, end)
                labels[start:end] = ids[start:end]
                prompt_merged, answer_merged = prompt_merged or into_answer, answer_merged or into_next
    else:
        prompt = sample["prompt"] if fmt == "prompt_completion" else ""
        answer = (sample["completion"] if fmt == "prompt_completion" else sample["text"]) or ""
        eos = "" if answer.endswith(tokenizer.eos_token) else tokenizer.eos_token  # TRL: only when missing
        ids = tokenizer(prompt + answer + eos)["input_ids"]
        prompt_ids = tokenizer(prompt)["input_ids"] if prompt else []
        # TRL's rule (dpo_kit's tokenize_pair too): the answer starts where the prompt's and the whole's tokens differ.
        answer_start = common_prefix_length(prompt_ids, ids)
        prompt_merged = answer_start < len(prompt_ids)
        labels = [-100] * answer_start + ids[answer_start:]
    labels[0:1] = [-100]
    truncated = len(ids) > max_length
    prompt_tokens = next((index for index, label in enumerate(labels) if label != -100), len(labels))
    ids, labels = ids[:max_length], labels[:max_length]
    # prompt_tokens: before the first answer token, untruncated (what --max_length must exceed).
    return {
        "input_ids": ids,
        "labels": labels,
        "num_answer_tokens": sum(label != -100 for label in labels),
        "truncated": truncated,
        "prompt_tokens": prompt_tokens,
        "prompt_merged": prompt_merged,
        "answer_merged": answer_merged,
    }


def has_generation_markers(chat_template) -> bool:
    """Whether a chat template marks what the model writes with ``{% generation %}`` (TRL's training templates do;
    a template shipped as named variants: its ``default``)."""
    template = chat_template.get("default", "") if isinstance(chat_template, dict) else chat_template or ""
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def marked_answer_labels(tokenizer, render, messages: list[dict], ids: list[int], first: int = 0) -> list[int]:
    """The labels of a conversation whose template has ``{% generation %}`` markers: the tokens of ``ids`` (its one
    rendering) that the tokenizer's assistant mask marks, as TRL's SFTTrainer trains them; the turns before ``first``
    (a conversational prompt's) are context, up to where the prompt's tokens and the whole's first differ, as TRL's
    completion mask has it. The mask is found from a fast tokenizer's offsets: a slow one is refused, and so is a
    template that marks no token of the conversation."""
    name = tokenizer.name_or_path
    if not tokenizer.is_fast:
        raise RecipeError(
            f"The chat template of {name} marks the answers with {{% generation %}}, and the tokens it marks are "
            f"found from a fast tokenizer's offsets, which {type(tokenizer).__name__} does not give. Use the model's "
            "fast tokenizer (its tokenizer.json), train every token with --no-assistant_only_loss, or use a template "
            "without the markers."
        )
    marked = render(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    labels = [token if mask else -100 for token, mask in zip(ids, marked["assistant_masks"], strict=True)]
    if first:
        asked = render(messages[:first], tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
        labels[: common_prefix_length(asked, ids)] = [-100] * common_prefix_length(asked, ids)
    if all(label == -100 for label in labels):
        raise RecipeError(
            f"The chat template of {name} has {{% generation %}} markers but marks no token of this conversation as "
            f"an answer: {str(messages)[:200]}. Put each assistant turn's text and its end-of-turn token between "
            "{% generation %} and {% endgeneration %}, or train every token with --no-assistant_only_loss."
        )
    return labels


# Rendered in place of an answer's content to read where a template writes it (text no template changes or holds).
PLACEHOLDER = "\ue000"


def answer_spans(render, messages: list[dict], text: str, first: int = 0):
    """The character span of each answer (the turns before ``first`` are context) in ``text``, the conversation's
    one rendering. Where the template renders the conversation up to an answer as a prefix of the rest (most do),
    the answer runs from the end of the rendering up to it with the generation prompt to the end of the rendering
    through it. A template that renders earlier turns otherwise (Qwen3 writes an empty think block only in answers
    after the last question; a DeepSeek-R1 distill's generation prompt opens a think block that no rendered answer
    holds) has each answer found in ``text`` in order, after its context (the turns before it, rendered alone): its
    content as the template writes it followed by the end-of-turn text after it, both read from a rendering with
    ``PLACEHOLDER`` for the content (the content alone could be found in a think block, a role tag or a question);
    from where the generation prompt's own text ends in ``text`` (what the template writes after it, Qwen3's think
    block, is the answer's), else from the content. An answer whose content the rendering does not hold is refused."""
    done = 0  # where the previous answer ended
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < first:
            continue
        if index == 0:  # (transformers renders no empty conversation: no generation prompt to find it by)
            raise RecipeError(
                f"A conversation opens with an assistant turn, {message['content'][:80]!r}, which answers nothing, so "
                f"no prompt before it tells where its trained tokens start: {str(messages)[:200]}. Start it with the "
                "user's (or a system) turn, drop the opening answer, or train every token (--no-assistant_only_loss)."
            )
        prompt, full = render(messages[:index], add_generation_prompt=True), render(messages[: index + 1])
        asked = text.startswith(prompt) and len(prompt) >= done  # the generation prompt opens this answer
        if asked and text.startswith(full) and full.startswith(prompt):
            yield check_reasoning(message, messages, text, len(prompt), len(full))
            done = len(full)
            continue
        pieces = render([*messages[:index], {**message, "content": PLACEHOLDER}]).split(PLACEHOLDER)
        head, turn_end = pieces if len(pieces) == 2 else ("", "")
        # The content as written last (a template may strip it), else as given (Qwen3 moves reasoning before it).
        given = message["content"].strip()
        shaped = len(pieces) == 2 and full.startswith(head) and full.endswith(turn_end)
        content = full[len(head) : len(full) - len(turn_end)] if shaped else given
        before = render(messages[:index])  # the turns before the answer
        opening = prompt[len(before) :] if prompt.startswith(before) else ""  # the generation prompt's own text
        context = max(done, common_prefix_length(before, text))
        at = text.find(content + turn_end, context)
        if at < 0 or given not in content:
            raise RecipeError(
                f"The chat template renders this conversation without its answer {given[:80]!r} as given (a "
                "template may drop an answer's reasoning before '</think>', as Qwen3's does in earlier turns and a "
                "DeepSeek-R1 distill's in every turn), so the answer's tokens cannot be found to train: "
                f"{str(messages)[:200]}. Train every token with --no-assistant_only_loss, or use a chat template that "
                "writes every answer whole between {% generation %} and {% endgeneration %}, as TRL's training "
                "templates do (trl/chat_templates/qwen3_training.jinja, deepseek_r1_distill_training.jinja): saved as "
                "chat_template.jinja in a tokenizer folder passed as --tokenizer_name, its marked tokens are trained."
            )
        done = at + len(content) + len(turn_end)
        # Trained from where the generation prompt ends in the text (what the template writes after it, Qwen3's think
        # block, is the answer's), else from the content (R1's prompt opens a think block that the text does not hold).
        opened = text.rfind(opening, context, at) if opening else -1
        yield check_reasoning(message, messages, text, opened + len(opening) if opened >= 0 else at, done)


def check_reasoning(message: dict, messages: list[dict], text: str, start: int, end: int) -> tuple[int, int]:
    """The answer's span ``start, end`` in ``text``, once its ``reasoning_content`` (a Qwen3-style field) is found in
    it; a span without it is refused: the template dropped reasoning the data gives, which would go untrained."""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip() not in text[start:end]:
        raise RecipeError(
            f"The chat template renders the answer {message['content'].strip()[:80]!r} without its reasoning_content "
            f"{reasoning.strip()[:80]!r} (Qwen3's writes it only in answers after the last question, most templates "
            f"never), so that reasoning would not be trained: {str(messages)[:200]}. Leave the field out to train the "
            "answers without it, or use a chat template that writes it in every answer between {% generation %} and "
            "{% endgeneration %} (trl/chat_templates/qwen3_training.jinja does), saved as chat_template.jinja in a "
            "tokenizer folder passed as --tokenizer_name."
        )
    return start, end


def answer_tokens(tokenizer, whole, text: str, answer_start: int, answer_end: int) -> tuple[int, int, bool, bool]:
    """Where the answer ``text[answer_start:answer_end]`` starts and ends in ``whole``, ``text`` tokenized once, and
    whether a token spans its start (trained: the context merges into its first token) or its end (not trained: it
    merges into the next turn's text). With a fast tokenizer's offsets: from the first token whose text ends past
    ``answer_start`` to the last that ends by ``answer_end``. Without, by TRL's prompt/completion rule: the text up to
    each end tokenized alone, the answer starting and ending where those tokens and the whole's first differ (the
    same tokens, at a cost that grows with the square of the number of answers)."""
    if "offset_mapping" not in whole:
        tokens = lambda upto: tokenizer(text[:upto], add_special_tokens=False)["input_ids"]
        before, through = tokens(answer_start), tokens(answer_end)
        start, end = (
            common_prefix_length(before, whole["input_ids"]),
            common_prefix_length(through, whole["input_ids"]),
        )
        return start, end, start < len(before), end < len(through)
    spans = whole["offset_mapping"]
    start = next((index for index, (_, stop) in enumerate(spans) if stop > answer_start), len(spans))
    end = next((index for index, (_, stop) in enumerate(spans) if stop > answer_end), len(spans))
    merged = lambda index, at: index < len(spans) and spans[index][0] < at
    return start, end, merged(start, answer_start), merged(end, answer_end)


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share."""
    return next((index for index, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))


def tokenize_datasets(
    accelerator, raw_datasets: datasets.DatasetDict, fmt: str, tokenizer, max_length: int, assistant_only_loss=True
) -> tuple[datasets.Dataset, datasets.Dataset, dict, str]:
    """The training and validation sets as ``input_ids`` + ``labels``, per split the samples, how many were truncated,
    how many dropped because ``max_length`` cut off every answer token (refused when that leaves none) and how many
    prompts merge into their completion's first token or answers into the next turn (``tokenize_sample``), and the
    format the user gave (results.json's ``data/format``: ``messages``, ``prompt_completion``,
    ``conversational_prompt_completion`` or ``text``), said in one line. Call it under ``main_process_first``:
    ``datasets`` caches the tokens for the other processes."""
    check_eos_token(tokenizer)  # every format trains the EOS: as text after an answer, or as the template writes it
    tokenized = raw_datasets.map(
        lambda sample: tokenize_sample(sample, fmt, tokenizer, max_length, assistant_only_loss),
        remove_columns=raw_datasets["train"].column_names,
        desc="tokenizing",
    )
    counts, kept = {}, {}
    for split in ("train", "validation"):
        # Samples whose answers were cut off entirely have nothing to learn: dropped, and counted.
        kept[split] = tokenized[split].filter(lambda sample: sample["num_answer_tokens"] > 0)
        counts[split] = {
            "samples": len(tokenized[split]),
            "truncated": sum(tokenized[split]["truncated"]),
            "dropped_without_answer": len(tokenized[split]) - len(kept[split]),
            "prompts_merged": sum(tokenized[split]["prompt_merged"]),
            "answers_merged": sum(tokenized[split]["answer_merged"]),
        }
        if len(kept[split]) == 0:
            prompts = sorted(tokenized[split]["prompt_tokens"])
            median = prompts[len(prompts) // 2]
            raise RecipeError(
                f"--max_length {max_length} is shorter than the prompt of every {split} sample, so no answer token is "
                f"left to learn from. The shortest prompt has {prompts[0]} tokens and the median one {median}: use "
                f"--max_length {median + 64} or more to keep most samples with answers of up to 64 tokens."
            )
        counted = ["truncated", "prompt_tokens", "num_answer_tokens", "prompt_merged", "answer_merged"]
        kept[split] = kept[split].remove_columns(counted)

    def said(c: dict) -> str:
        dropped = c["dropped_without_answer"]
        parts = [f"{c['truncated']} truncated to {max_length} tokens, {dropped} dropped: no answer token left"]
        if c["prompts_merged"]:
            parts.append(
                f"{c['prompts_merged']} whose prompt's last token merges into the completion's first, as TRL "
                "tokenizes them together"
            )
        if c["answers_merged"]:
            parts.append(
                f"{c['answers_merged']} whose answer's last token merges into the next turn's first, not trained, as "
                "the conversation is tokenized whole"
            )
        return "; ".join(parts)

    # TRL's conversational prompt + completion, read as one conversation (``messages``, its ``prompt_turns`` first).
    conversational = "prompt_turns" in raw_datasets["train"].column_names
    given = "conversational_prompt_completion" if conversational else fmt
    said_of_it = " (the prompt's turns are context: the completion's answers are trained)" * conversational
    accelerator.print(
        f"data: format {given}{said_of_it}; "
        + "; ".join(f"{split} {c['samples']} samples ({said(c)})" for split, c in counts.items())
    )
    return kept["train"], kept["validation"], counts, given


def collate(samples: list[dict], pad_token_id: int, packing: bool = False) -> dict:
    """A batch, with ``num_tokens``: the real (not padding) tokens of each sample. Right-padded: input ids with the pad
    token, labels with -100, and no attention mask. A causal model's real tokens attend only to earlier positions,
    and the padding is after them, so a mask would change nothing they compute (the padding's own outputs are never
    scored). Without one, transformers gives SDPA ``is_causal`` (its fastest kernels, no mask tensor) and skips its
    check that the mask holds no padding, which reads the mask back from the GPU: a sync point in every forward.
    (The position ids count from 0 in every row either way.) The test of ``token_losses`` compares with the masked
    loss.

    With ``packing`` (the samples of a step's packed rows): one row without padding, as TRL's padding-free packing
    gives it, by transformers' ``DataCollatorWithFlattening``: position ids restart at 0 with every sample, from which
    transformers builds a block-diagonal causal mask (each sample attends only to itself: the same losses as the padded
    batch; its -100 on each sample's first label is already there, see ``tokenize_sample``). The price: attention
    without flash attention's packed kernels computes the whole row's mask, not each sample's, and transformers finds
    the samples' bounds in the position ids with one read from the device per forward."""
    if packing:
        batch = DataCollatorWithFlattening()(samples, return_tensors="pt")
        batch = {**batch, "num_tokens": torch.tensor([len(sample["input_ids"]) for sample in samples])}
        return {**batch, **scored_positions(batch["labels"])}
    length = max(len(sample["input_ids"]) for sample in samples)
    batch = {
        "input_ids": torch.full((len(samples), length), pad_token_id),
        "labels": torch.full((len(samples), length), -100),
        "num_tokens": torch.tensor([len(sample["input_ids"]) for sample in samples]),
    }
    for row, sample in enumerate(samples):
        size = len(sample["input_ids"])
        batch["input_ids"][row, :size] = torch.tensor(sample["input_ids"])
        batch["labels"][row, :size] = torch.tensor(sample["labels"])
    return {**batch, **scored_positions(batch["labels"])}


def check_packing(model, device, packing: bool) -> None:
    """With ``packing``, refuse a model that lets the samples packed into one row attend to each other: transformers
    keeps them apart only in a model that builds its attention mask from the position ids (``create_causal_mask``;
    OPT does not), and nothing warns. Asked of the model itself, where it already is (split, 4-bit, FSDP2: every
    process runs it): two short samples packed as training packs them, against each alone, in eval mode (no dropout)
    and without a cache (a cache turns the packed mask off). The first is one token repeated: a second sample that
    sees it changes by far more than rounding (tiny models: OPT 0.79 of the logits' mean, Llama, Phi-3, Qwen3, Gemma
    2/3, OLMo 2, GPT-NeoX and GPT-2 under 1e-6; bf16 rounds at 2^-8 = 0.004)."""
    if not packing:
        return
    samples = [{"input_ids": ids, "labels": ids} for ids in ([7] * 16, [20, 21, 22, 23, 24])]
    forward = lambda batch: (
        model(  # (a model split over devices: its hooks move the inputs)
            input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device), use_cache=False
        )
        .logits[0]
        .float()
    )
    was_training = model.training
    model.eval()
    with torch.no_grad():
        packed = forward(collate(samples, pad_token_id=0, packing=True)).split([16, 5])
        alone = [forward(collate([sample], pad_token_id=0, packing=True)) for sample in samples]
    model.train(was_training)
    differences = [float((p - a).abs().mean() / a.abs().mean()) for p, a in zip(packed, alone)]
    if max(differences) > 0.05:
        raise RecipeError(
            f"--packing: this {model.config.model_type} model lets the samples packed into one row attend to each "
            f"other (a check of two short samples, packed and each alone: their logits differ by "
            f"{max(differences):.0%} of their mean), so it would train on a loss that is silently wrong. Transformers "
            "keeps packed samples apart only in models that build their attention mask from the position ids, and "
            f"the {model.config.model_type} model does not. Train without --packing: its samples are padded instead."
        )


def check_batches(train_dataloader, data_parallel_size: int) -> None:
    """Refuse a training set too small to give every data-parallel process a batch."""
    samples, batches, size = len(train_dataloader.dataset), len(train_dataloader), train_dataloader.batch_size
    if batches < data_parallel_size:
        raise RecipeError(
            f"{samples} training samples make {batches} batch(es) of {size}, fewer than the {data_parallel_size} "
            "processes: some would get none. Lower --per_device_train_batch_size or add data."
        )


def prompt_of(sample: dict, fmt: str, tokenizer, last: bool = False) -> str:
    """What the model is asked: the conversation up to its first answer (``last``: its last, the earlier turns
    context), with the generation prompt; the prompt; or the first 64 characters of a text."""
    if fmt == "messages":
        messages = sample["messages"]
        asked = sample.get("prompt_turns", 0)  # (a prompt + completion's turns before the completion: context)
        first = next(index for index, message in enumerate(messages[asked:], asked) if message["role"] == "assistant")
        answer = last_answer(messages) if last else first
        tools = chat_tools(sample)
        return tokenizer.apply_chat_template(
            messages[:answer], tools=tools, tokenize=False, add_generation_prompt=True
        )
    return sample["prompt"] if fmt == "prompt_completion" else sample["text"][:64]


def chat_tools(sample: dict) -> list | None:
    """The tool schemas a conversation is rendered with, as TRL reads them: its ``tools`` cell, a list or its JSON text
    (a row without one: None, no tools)."""
    tools = sample.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def last_answer(messages: list[dict]) -> int:
    """The index of a conversation's last assistant turn."""
    return max(index for index, message in enumerate(messages) if message["role"] == "assistant")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """--packing's rows: the indices of ``lengths`` in bins of at most ``capacity`` tokens, by best fit decreasing (the
    rows of TRL's packing=True): longest first, each into the open bin it leaves the least space in, else into a new
    one. The open bins are kept by their free space (a sorted list of the distinct spaces: at most ``capacity``), so a
    placement is one bisection. Ties keep the data's order: every process makes the same rows. Samples are truncated
    to ``max_length`` when tokenized, so each lands whole in one row; ``collate(..., packing=True)`` flattens a batch
    of rows with the position ids restarting at every sample."""
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    bins: list[list[int]] = []
    spaces: list[int] = []  # the distinct free spaces of the open bins, ascending
    open_bins: dict[int, collections.deque] = {}  # free space -> the bins with that much left, oldest first
    for index in order:
        at = bisect.bisect_left(spaces, lengths[index])  # the tightest space the sample fits in
        if at < len(spaces):
            space = spaces[at]
            number = open_bins[space].popleft()
            if not open_bins[space]:
                del spaces[at], open_bins[space]
        else:
            space, number = capacity, len(bins)
            bins.append([])
        bins[number].append(index)
        space -= lengths[index]
        if space > 0:
            if space not in open_bins:
                bisect.insort(spaces, space)
                open_bins[space] = collections.deque()
            open_bins[space].append(number)
    return bins


def public_definitions(stdlib: str, packages: list[str]):
    """``(module, node)`` for every public top-level function and class of ``packages`` (test folders aside), read
    with ``ast``: what the offline question sets ask about."""
    root = Path(stdlib)
    for package in sorted(packages):
        files = [p for p in (root / package).rglob("*.py") if not TEST_FOLDERS & set(p.relative_to(root).parts)]
        for path in sorted(files):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for top in tree.body:
                if isinstance(top, (ast.FunctionDef, ast.ClassDef)) and not top.name.startswith("_"):
                    yield module, top


def _name_rows(stdlib: str, cache_key: str, packages: list[str], validation_percent: int):
    """Is this dotted name (read with ``ast``) a class, a function or a method? Asked of every public top-level
    function and class, and of one public method per class (picked by md5), so that methods do not outnumber the
    rest 4 to 1. The answer follows from the name by Python's naming conventions, which a model can learn."""
    for module, top in public_definitions(stdlib, packages):
        name = f"{module}.{top.name}"
        names = [(name, "class" if isinstance(top, ast.ClassDef) else "function")]
        methods = [
            node.name
            for node in getattr(top, "body", [])
            if isinstance(top, ast.ClassDef) and isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
        ]
        if methods:
            names.append(
                (f"{name}.{methods[int(hashlib.md5(name.encode()).hexdigest(), 16) % len(methods)]}", "method")
            )
        # Split by top-level definition: a class and its method are on one side.
        split = "validation" if in_validation_split(f"{module}:{top.name}", validation_percent) else "train"
        for asked, kind in names:
            question = f"Is `{asked}` a class, a function or a method?"
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": kind}]
            yield {"messages": messages, "split": split}


def stdlib_names(packages=DOCSTRING_PACKAGES, validation_percent: int = 10) -> datasets.DatasetDict:
    """Is a standard-library name a class, a function or a method: one-word answers, as ``messages`` conversations
    (``train``/``validation``, held out by top-level definition), the offline default of ``recipes/llm_finetune.py``.
    ``datasets`` caches them by ``cache_key``: change its version with the code. Call under ``main_process_first``."""
    rows = datasets.Dataset.from_generator(
        _name_rows,
        gen_kwargs={
            "stdlib": str(stdlib_root()),
            "cache_key": f"{platform.python_version()}-v2",
            "packages": sorted(packages),
            "validation_percent": validation_percent,
        },
    )
    return split_by_column(rows)
