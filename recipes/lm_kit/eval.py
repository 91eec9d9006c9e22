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
    accelerator.print(f"eval/loss {loss:.4f} eval/perplexity {math.exp(loss):.2f} ({num_blocks} blocks, {num_tokens} "
                      "predicted tokens)")
    return {"eval/loss": loss, "eval/perplexity": math.exp(loss), "eval/num_blocks": num_blocks,
            "eval/num_tokens": num_tokens}


def evaluate_lm(accelerator, model, eval_dataloader) -> dict:
    """Validation loss and perplexity over the whole validation set, each block once, in every mode.

    Per-block sums go through ``gather_for_metrics``, which drops the samples the sharded loader repeats to give every
    process a full last batch, so each block counts exactly once. (Not ``evaluate``'s perplexity metric: it loads a
    model of its own by name and runs it on one device; this is the trained, prepared model's loss.)"""
    model.eval()
    loss_sum, num_tokens, num_blocks = 0.0, 0, 0
    for batch in eval_dataloader:
        input_ids = batch["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits  # no KV cache: nothing generates here
        # Same loss as the model's own (shifted, float32), kept per block so blocks can be counted.
        per_block = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:].to(logits.device), reduction="none").sum(dim=1)
        tokens = torch.full_like(per_block, input_ids.shape[1] - 1)
        per_block, tokens = accelerator.gather_for_metrics((per_block, tokens))
        loss_sum += per_block.sum().item()  # sync point: .item() waits for the device
        num_tokens += int(tokens.sum().item())
        num_blocks += per_block.numel()
    return perplexity_results(accelerator, loss_sum, num_tokens, num_blocks)


def greedy_sample(model, tokenizer, prompt: str, max_new_tokens: int, device: torch.device) -> dict:
    """``prompt`` and the ``max_new_tokens`` tokens ``model`` generates greedily after it (so that a test can
    regenerate the same text from the saved model), printed, as results.json's ``sample/prompt`` and ``sample/text``.
    A model split by a device_map stays where its hooks put it; any other is moved to ``device``."""
    model.eval()
    if not getattr(model, "hf_device_map", None):
        model.to(device)
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        generated = model.generate(prompt_ids, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
    sample = tokenizer.decode(generated[0], skip_special_tokens=False)
    print(f"sample (greedy, {max_new_tokens} tokens):\n{sample}")
    return {"sample/prompt": prompt, "sample/text": sample}
