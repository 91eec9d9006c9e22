"""Evaluating the language-model recipes: validation perplexity with every block counted exactly once, and the short
greedy sample results.json keeps (the tests regenerate it from the saved model)."""

from __future__ import annotations

import math

import torch

# The eval/* entries of a run with --skip_eval.
NOT_EVALUATED = {"eval/loss": math.nan, "eval/perplexity": math.nan, "eval/num_blocks": 0, "eval/num_tokens": 0}


def perplexity_results(accelerator, loss_sum: float, num_tokens: int, num_blocks: int) -> dict:
    """The eval/* entries of results.json from the summed next-token loss; perplexity = exp(mean token loss)."""
    loss = loss_sum / num_tokens
    accelerator.print(
        f"eval/loss {loss:.4f} eval/perplexity {math.exp(loss):.2f} ({num_blocks} blocks, {num_tokens} "
        "predicted tokens)"
    )
    return {
        "eval/loss": loss,
        "eval/perplexity": math.exp(loss),
        "eval/num_blocks": num_blocks,
        "eval/num_tokens": num_tokens,
    }


def greedy_sample(accelerator, model, tokenizer, prompt: str, max_new_tokens: int) -> dict:
    """On the main process, ``prompt`` and the ``max_new_tokens`` tokens ``model`` generates greedily after it (so
    that a test can regenerate the same text from the saved model), printed, as results.json's ``sample/prompt`` and
    ``sample/text``; nothing elsewhere, or for 0 tokens. A model split by a device_map stays where its hooks put it;
    any other is moved to the accelerator's device."""
    if not accelerator.is_main_process or max_new_tokens <= 0:
        return {}
    device = accelerator.device
    model.eval()
    if not getattr(model, "hf_device_map", None):
        model.to(device)
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        generated = model.generate(
            prompt_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    sample = tokenizer.decode(generated[0], skip_special_tokens=False)
    print(f"sample (greedy, {max_new_tokens} tokens):\n{sample}")
    return {"sample/prompt": prompt, "sample/text": sample}
