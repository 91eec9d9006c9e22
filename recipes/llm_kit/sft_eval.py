"""Greedy answers of a fine-tuned causal LM (``recipes/llm_finetune.py``): their exact match with the reference
answers of held-out prompts, before and after training, and a few sample answers to print. Generation runs on the
main process alone with the unwrapped model (the others wait untimed); not under FSDP2, where every forward pass
needs every process."""

from __future__ import annotations

import math

import datasets
import torch

from shared.accelerator import main_process_alone

from .sft_data import PLACEHOLDER, chat_tools, last_answer, prompt_of


def exact_match(model, tokenizer, rows: datasets.Dataset, fmt: str, device) -> tuple[float, list[dict]]:
    """The share of ``rows`` whose greedy answer, stripped, equals the reference answer stripped, and each answer.
    A reasoning model's answer is what it writes after its reasoning (its last ``</think>``, as Qwen3 and the
    DeepSeek-R1 distills write it). Generates 2 tokens more than the longest reference and what the chat template
    writes before it (Qwen3's empty think block) have: a longer answer could not match anyway."""
    scored, lengths = [], []
    for row in rows:
        question, reference = last_prompt_and_answer(row, fmt)
        # The reference's answer after its reasoning too, where the data give it inline, as the model's is scored.
        scored.append({"question": question, "reference": reference.split("</think>")[-1].strip()})
        written = written_before_answer(row, fmt, tokenizer) + reference.strip()
        lengths.append(len(tokenizer(written, add_special_tokens=False).input_ids))
    max_new_tokens = max(lengths) + 2
    for row, sample in zip(rows, scored):
        prompt = prompt_of(row, fmt, tokenizer, last=True)  # a few-shot conversation: its earlier turns as context
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=fmt != "messages")
        ids = ids.input_ids.to(device)
        with torch.no_grad():
            generated = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
        sample["answer"] = answer.split("</think>")[-1].strip()
    return sum(sample["answer"] == sample["reference"] for sample in scored) / len(scored), scored


def last_prompt_and_answer(row: dict, fmt: str) -> tuple[str, str]:
    """The turn before a conversation's last answer, and that answer (or a row's prompt and completion): a GRPO or DPO
    prompt that holds few-shot turns is answered after them, not in place of their first answer."""
    if fmt == "messages":
        last = last_answer(row["messages"])
        return (row["messages"][last - 1]["content"] if last else ""), row["messages"][last]["content"]
    return row["prompt"], row["completion"]


def written_before_answer(row: dict, fmt: str, tokenizer) -> str:
    """What the chat template writes between the generation prompt and a conversation's last answer, where the
    rendering through that answer starts with the prompt: Qwen3's think block after the last question (its
    ``reasoning_content``, or empty); most templates write nothing there. Read from a rendering with ``PLACEHOLDER``
    for the answer's content (the content itself may be in the think block: "hi" in "<think>")."""
    if fmt != "messages":
        return ""
    messages, prompt = row["messages"], prompt_of(row, fmt, tokenizer, last=True)
    last = last_answer(messages)
    answer = {**messages[last], "content": PLACEHOLDER}
    written = tokenizer.apply_chat_template([*messages[:last], answer], tools=chat_tools(row), tokenize=False)
    at = written.find(PLACEHOLDER, len(prompt))
    return written[len(prompt) : at] if written.startswith(prompt) and at >= 0 else ""


# Exact match means something for answers a model can give word for word: a label, a number, a name.
SHORT_ANSWER_TOKENS = 8


def exact_match_rows(
    accelerator, validation: datasets.Dataset, count: int | None, fmt: str, fsdp: bool, seed: int = 0, tokenizer=None
) -> datasets.Dataset | None:
    """``count`` shuffled validation prompts to score (not the first ones: the offline data's first ones ask about one
    package; empty prompts left out), or None: ``count`` 0, plain text (no prompt to answer), or FSDP2 (said so).
    ``count`` None: 100 when the answers are short (a median of at most ``SHORT_ANSWER_TOKENS`` tokens, e.g. the
    offline default's one-word answers), else none, said either way (greedy answers to free-form prompts almost never
    match word for word, and generating them costs minutes)."""
    if count == 0 or fmt == "text":
        return None
    if fmt == "prompt_completion":  # an empty prompt asks nothing (and without a BOS token gives generate no token)
        validation = validation.select([i for i, prompt in enumerate(validation["prompt"]) if prompt.strip()])
        if len(validation) == 0:
            accelerator.print("eval: no exact match: every validation prompt is empty, so there is nothing to answer")
            return None
    if count is None:
        rows = validation.select(range(min(200, len(validation))))
        lengths = [
            len(tokenizer(last_prompt_and_answer(row, fmt)[1].strip(), add_special_tokens=False).input_ids)
            for row in rows
        ]
        median = sorted(lengths)[len(lengths) // 2] if lengths else 0
        if median > SHORT_ANSWER_TOKENS:
            accelerator.print(
                f"eval: no exact match: the answers have a median of {median} tokens, and exact match "
                f"means something for short answers only (at most {SHORT_ANSWER_TOKENS}); "
                "--exact_match_samples N scores N prompts anyway"
            )
            return None
        count = 100
        accelerator.print(
            f"eval: exact match on up to {count} held-out prompts: the answers are short (a median of "
            f"{median} tokens; --exact_match_samples N changes the count, 0 skips it)"
        )
    if fsdp:
        accelerator.print("eval: no exact match under FSDP2 (generating needs every process in step); run it with ddp")
        return None
    return validation.shuffle(seed=seed).select(range(min(count, len(validation))))


def main_process_exact_match(accelerator, model, tokenizer, rows, fmt: str) -> tuple[float, list[dict]]:
    """``exact_match`` of ``rows`` on the main process alone (NaN and no answers elsewhere, or without rows), in eval
    mode; the model is left in the mode it was in."""
    score, answers = math.nan, []
    if rows is not None:
        with main_process_alone(accelerator):
            if accelerator.is_main_process:
                training = model.training
                model.eval()
                score, answers = exact_match(accelerator.unwrap_model(model), tokenizer, rows, fmt, accelerator.device)
                model.train(training)
    return score, answers


def exact_match_before(
    accelerator, model, tokenizer, validation: datasets.Dataset, fmt: str, count: int, fsdp: bool, seed: int = 0
) -> tuple[datasets.Dataset | None, float]:
    """The prompts ``exact_match_results`` scores after training (``exact_match_rows``), and the exact match before
    training (printed; NaN without prompts)."""
    rows = exact_match_rows(accelerator, validation, count, fmt, fsdp, seed, tokenizer)
    score, _ = main_process_exact_match(accelerator, model, tokenizer, rows, fmt)
    if rows is not None:
        accelerator.print(f"eval: exact match before training {score:.1%}")
    return rows, score


def exact_match_results(accelerator, model, tokenizer, rows, fmt: str, before: float) -> dict:
    """The ``eval/exact_match*`` entries of results.json after training, with the chance level (always giving the
    most common reference answer) and the answers; printed with a few examples."""
    score, answers = main_process_exact_match(accelerator, model, tokenizer, rows, fmt)
    chance = math.nan
    if answers:
        references = [sample["reference"] for sample in answers]
        chance = max(map(references.count, references)) / len(references)
        accelerator.print(
            f"eval: exact match {before:.1%} before training, {score:.1%} after, on {len(answers)} "
            f"held-out prompts (always the most common answer: {chance:.1%}); e.g."
        )
        for sample in answers[:3]:
            accelerator.print(f"  {sample['question']} -> {sample['answer']!r} (expected {sample['reference']!r})")
    return {
        "eval/exact_match_before": before,
        "eval/exact_match": score,
        "eval/exact_match_chance": chance,
        "eval/exact_match_num_prompts": len(answers),
        "eval/exact_match_answers": answers,
    }


def generate_samples(
    accelerator, model, tokenizer, rows: datasets.Dataset, fmt: str, count: int, max_new_tokens: int
) -> list[dict]:
    """Greedy answers to the first ``count`` of ``rows`` on the main process (printed; none elsewhere)."""
    samples = []
    if count and accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        for row in rows.select(range(min(count, len(rows)))):
            prompt = prompt_of(row, fmt, tokenizer)
            if not prompt.strip():  # nothing asked (and without a BOS token, no token to start from)
                continue
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=fmt != "messages").input_ids
            with torch.no_grad():
                answer = unwrapped.generate(
                    ids.to(accelerator.device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            samples.append(
                {"prompt": prompt, "answer": tokenizer.decode(answer[0, ids.shape[1] :], skip_special_tokens=True)}
            )
            accelerator.print(f"--- prompt:\n{prompt}\n--- answer (greedy):\n{samples[-1]['answer']}")
    return samples
