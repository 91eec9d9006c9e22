"""Completions fixed in advance, for comparing GRPO runs that must score the same tokens: recipes/grpo.py in 1 and 2
processes (tests/test_grpo.py, through tests/scripts/grpo_fixed_completions.py) and against TRL's GRPOTrainer
(benchmarks/studies/grpo_vs_trl.py imports it from here). A completion is one of four,
chosen by a hash of its prompt's token ids and a key: its copy (the k-th row of the batch with that prompt), or the
sampling noise the recipe gives its row (the same in any process count, also where a group spans processes): the
answers "class", "function" and "method" with the end-of-sequence token, or words that run to ``max_completion_length``
without ending (truncated). So the ``accuracy`` reward of the standard-library questions varies within a group.

``patch_recipe_generator`` replaces ``grpo_kit.rollout.PolicyGenerator.generate`` in this process (a runpy wrapper
calls it before running the recipe, which stays unchanged)."""

from __future__ import annotations

import hashlib

CANDIDATES = ("class", "function", "method", None)  # None: a truncated completion


def fixed_completions(
    prompt_ids: list[list[int]], tokenizer, max_completion_length: int, keys=None
) -> list[list[int]]:
    """One completion's token ids per row of ``prompt_ids`` (a row per completion), cut to ``max_completion_length``.
    ``keys``: one per row (default: the row's copy, its place among the rows with its prompt)."""
    seen: dict[tuple, int] = {}
    completions = []
    for row, ids in enumerate(prompt_ids):
        copy = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
        digest = hashlib.md5(f"{ids}/{copy if keys is None else keys[row]}".encode()).digest()
        answer = CANDIDATES[digest[0] % len(CANDIDATES)]
        if answer is None:
            words = tokenizer(" the name is documented", add_special_tokens=False)["input_ids"]
            completion = (words * max_completion_length)[:max_completion_length]
        else:
            completion = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        completions.append(completion[:max_completion_length])
    return completions


def patch_recipe_generator(by_noise: bool = False) -> None:
    """``PolicyGenerator.generate`` of recipes/grpo.py's kit returns ``fixed_completions`` instead of sampling, keyed
    by each row's copy, or ``by_noise``: by its first sampling uniform (the kit must be importable: ``recipes/`` first
    on sys.path)."""
    from grpo_kit import rollout

    def generate(self, prompt_ids, noise):
        keys = [repr(float(row[0])) for row in noise] if by_noise else None
        completions = fixed_completions(prompt_ids, self.tokenizer, self.config.max_new_tokens, keys)
        rollouts = rollout.cut_at_end(completions, self.eos_token_ids)
        if self.logps:  # the split layout's generating process: its policy's log-probs of them, as sampling gives
            rollouts.logps = policy_logps(self, prompt_ids, rollouts)
        return rollouts

    rollout.PolicyGenerator.generate = generate


def policy_logps(generator, prompt_ids, rollouts) -> list[list[float]]:
    """The log-probs the generator's policy gives each completion token (eval mode, no gradient), as the recipe's
    sampler returns them: the recipe's own training forward (``grpo_kit.loss.completion_logps``)."""
    import torch
    from grpo_kit.data import micro_batches
    from grpo_kit.loss import completion_logps

    model = generator.accelerator.unwrap_model(generator.model)
    rows = [{"prompt_ids": ids} for ids in prompt_ids]
    (batch,) = micro_batches(
        rows, rollouts, torch.zeros(len(rows)), len(rows), generator.tokenizer.pad_token_id, False, model.device
    )
    model.eval()
    with torch.no_grad():
        logps = completion_logps(model, batch, generator.sampling["temperature"])[0].tolist()
    model.train()
    return [row[: len(ids)] for row, ids in zip(logps, rollouts.completion_ids)]
