"""GRPO's arithmetic, as TRL 1.16's GRPOTrainer does it (trl/trainer/grpo_trainer.py:
``_generate_and_score_completions`` for the advantages, ``_compute_loss`` for the loss), written for this recipe's
batches: the group-normalised advantages, the per-token log-probabilities of the completions, and the clipped surrogate
loss with its KL term, each loss type normalised so that the step's loss is the same whatever the processes and
accumulation (``bnpo`` aside: TRL normalises it per micro-batch, and so does this).

The step's loss (DAPO, TRL's default), over the completion tokens t of every completion i of the optimizer step:

    ratio = exp(logp - logp_old)        (logp_old: the policy that generated, before this round's first step)
    per_token = -min(ratio * A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A_i) + beta * KL_t * ratio
    KL_t = exp(logp_ref - logp) - (logp_ref - logp) - 1        (k3, an unbiased estimate of KL(policy || reference))
    loss = sum over tokens of per_token / (completion tokens of the step)

``grpo`` averages each completion's tokens first, then the completions; ``dr_grpo`` divides the token sum by
completions x ``max_completion_length``; ``bnpo`` by the tokens of each micro-batch (then averages the
micro-batches)."""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from llm_kit.adapters import reference_policy
from llm_kit.loading import load_base_model
from shared.errors import RecipeError

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the values that are not NaN (Bessel's correction, as ``torch.std``; NaN with fewer
    than two)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    variance = torch.where(count > 1, variance, math.nan)
    return variance.sqrt() if dim is None else variance.sqrt().squeeze(dim)


def group_advantages(
    rewards_per_function: torch.Tensor, weights: list[float], num_generations: int, scale_rewards: str
) -> dict[str, torch.Tensor]:
    """The advantage of every completion of the global batch, rows in groups of ``num_generations`` (one prompt's
    completions, consecutive), from ``rewards_per_function`` (rows x functions; NaN where a function returned None,
    "not applicable"): the weighted sum of the functions that applied (a row none applied to is NaN, left out of its
    group's mean and standard deviation, and gets advantage 0), minus its group's mean, divided by the standard
    deviation + 1e-4 of its group (``scale_rewards`` group), of the whole batch (batch), or not at all (none).
    Also ``rewards`` (the weighted sums) and ``zero_std`` (rows whose group's rewards are all equal: no signal)."""
    unscorable = rewards_per_function.isnan().all(dim=1)
    rewards = (rewards_per_function * torch.tensor(weights, device=rewards_per_function.device)).nansum(dim=1)
    rewards = torch.where(unscorable, math.nan, rewards)
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # group, and none (whose standard deviation only tells which groups had no signal)
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return {
        "advantages": torch.nan_to_num(advantages, nan=0.0),
        "rewards": rewards,
        "zero_std": torch.isclose(std, torch.zeros_like(std)),
    }


def completion_logps(model, batch: dict, temperature: float, chunk_tokens: int = 1024) -> tuple[torch.Tensor, ...]:
    """The log-probability of every completion token under the model's next-token distribution at ``temperature``
    (the logits divided by it, as in sampling) and that distribution's entropy, ``(rows, K)`` each (K: the most
    completion tokens a row of the batch has; 0 at the fillers). The batch is right-padded prompt + completion rows
    without an attention mask (``llm_kit.sft_data.collate``): the positions count from 0 as they did in generation, and
    padding after a row's tokens changes nothing they compute. Logits only at the completion positions
    (``logits_to_keep``), the log-softmax in fp32 over ``chunk_tokens`` positions at a time, each chunk recomputed in
    backward (checkpointed): the softmax over the vocabulary exists for one chunk at a time."""
    positions = batch["loss_positions"]
    logits = shared_prompt_logits(model, batch)
    if logits is None:  # no two consecutive rows with the same prompt: one plain forward
        logits = model(input_ids=batch["input_ids"], use_cache=False, logits_to_keep=positions).logits
    if logits.shape[:2] != positions.shape:  # a model that ignores logits_to_keep: pick the completion positions
        logits = torch.take_along_dim(logits, positions.to(logits.device)[..., None], dim=1)
    targets = batch["loss_targets"].to(logits.device).flatten()
    pieces = [
        checkpoint(token_logps_and_entropy, chunk, target, temperature, use_reentrant=False)
        for chunk, target in zip(logits.flatten(0, 1).split(chunk_tokens), targets.split(chunk_tokens))
    ]
    logps, entropy = (torch.cat(columns).view(positions.shape) for columns in zip(*pieces))
    return logps, entropy


def shared_prompt_logits(model, batch: dict) -> torch.Tensor | None:
    """The logits ``completion_logps`` takes (rows x K x vocabulary, at each row's completion positions) with each
    prompt read once for its run of consecutive rows (a group's completions; with gradients): one forward over the
    distinct prompts but their last token gives their keys and values (a cache), copied to each of their rows, then one
    forward over every row's last prompt token and completion at the positions they have in the row, attending to its
    prompt's keys and values (a mask leaves out the columns beyond a shorter prompt). Equal to the plain forward of the
    rows within float rounding, in the logits and the gradients (a prompt's gradient is its rows' sum); the prompts'
    part of the forward and backward costs distinct prompts, not rows. None where nothing would be shared (no two
    consecutive rows with the same prompt), under gradient checkpointing (which forbids the cache) and under FSDP2
    (two forwards before one backward): the caller runs the plain forward."""
    input_ids, positions = batch["input_ids"], batch["loss_positions"]
    inner = getattr(model, "module", model)  # DDP: the prompts' forward outside its wrapper (one wrapped forward)
    if getattr(inner, "is_gradient_checkpointing", False) or any(
        type(p).__name__ == "DTensor" for p in inner.parameters()
    ):
        return None
    # Each row's prompt but its last token (its first scored position), and which rows repeat the prompt before them:
    # read from the device (on a GPU, a sync point per micro-batch).
    lengths = positions[:, 0].tolist()
    starts = [
        row == 0
        or lengths[row] != lengths[row - 1]
        or not input_ids[row, : lengths[row]].equal(input_ids[row - 1, : lengths[row]])
        for row in range(len(lengths))
    ]
    if all(starts) or min(lengths) < 1:
        return None
    firsts = [row for row, start in enumerate(starts) if start]
    run_of_row = torch.tensor(starts).cumsum(0).sub(1).to(input_ids.device)
    cached = max(lengths)
    cache = DynamicCache(config=inner.config)
    # Columns past a shorter prompt hold its row's completion or padding: computed, never attended to (the mask).
    inner(input_ids=input_ids[firsts, :cached], cache=cache, use_cache=True, logits_to_keep=1)
    cache.batch_select_indices(run_of_row)  # each row gets its prompt's keys and values (a gather: gradients add up)
    first = torch.tensor(lengths, device=input_ids.device)[:, None]
    tail = first + torch.arange(input_ids.shape[1] - min(lengths), device=input_ids.device)  # each row's positions
    tail_ids = input_ids.gather(1, tail.clamp(max=input_ids.shape[1] - 1))  # past a row's end: its padding, unread
    columns = torch.arange(cached, device=input_ids.device)
    mask = torch.cat([(columns < first).long(), torch.ones_like(tail)], dim=1)
    keep = torch.where(batch["loss_targets"] != -100, torch.arange(positions.shape[1], device=positions.device), 0)
    logits = model(
        input_ids=tail_ids, attention_mask=mask, position_ids=tail, cache=cache, use_cache=True, logits_to_keep=keep
    ).logits
    if logits.shape[:2] != keep.shape:  # a model that ignores logits_to_keep: pick the completion positions
        logits = torch.take_along_dim(logits, keep[..., None], dim=1)
    return logits


def completion_tokens(gathered: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The completion tokens a step's loss counts, every process's: the round's gathered lengths (``score_round``'s
    second-to-last column), those of truncated completions left out with ``mask_truncated`` (the micro-batches'
    ``mask``, summed over every process, with no collective of its own)."""
    lengths, truncated = gathered[:, -2], gathered[:, -1].bool()
    return torch.where(truncated & mask_truncated, 0.0, lengths).sum()


def add_fixed_logps(batches: list[dict], model, reference_model, temperature: float, old: bool, reference: bool):
    """Adds to each batch the log-probs that stay fixed over a round (no gradient; the model unwrapped from DDP):
    with ``old``, ``old_logps``, the policy's before the round's first step (the one that generated); with
    ``reference``, ``reference_logps``: ``reference_model`` (a full fine-tune's frozen copy) or the adapter's
    reference policy (``llm_kit.adapters.reference_policy``: the base, or a continued adapter's frozen copy)."""
    model = getattr(model, "module", model)  # DDP's wrapper: no gradient to sync (FSDP2 shards the module in place)
    with torch.no_grad():
        for batch in batches:
            if old:
                batch["old_logps"] = completion_logps(model, batch, temperature)[0]
            if reference and reference_model is not None:
                batch["reference_logps"] = completion_logps(reference_model, batch, temperature)[0]
            elif reference:
                with reference_policy(model):
                    batch["reference_logps"] = completion_logps(model, batch, temperature)[0]


def frozen_copy(accelerator, name_or_path: str, config, trust_remote_code: bool, lora: bool, beta: float):
    """A full fine-tune's reference with ``beta``: the model as loaded, once more, frozen and in eval mode (TRL's
    ``ref_model``), on the device and never wrapped for gradients: its weights beside the trained ones, with no
    gradients nor optimizer state; refused under FSDP2, which would not shard it. None otherwise (LoRA's reference is
    the adapter switched off, or its frozen copy)."""
    if lora or not beta:
        return None
    if accelerator.is_fsdp2:
        raise RecipeError(
            "--full_finetune with --beta needs a frozen copy of the model as the reference, which this recipe does "
            "not shard under FSDP2 yet (each GPU would hold all of it, and Accelerate leaves it off the GPU). Train "
            "with ddp_2gpu.yaml, with a LoRA adapter (its reference is the adapter switched off), or with --beta 0 "
            "(TRL's default)."
        )
    reference = load_base_model(accelerator, name_or_path, config, trust_remote_code=trust_remote_code)
    return accelerator.prepare_model(reference.requires_grad_(False).eval(), evaluation_mode=True)


def token_logps_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, ...]:
    """Per position: the fp32 log-softmax of ``logits / temperature`` at ``targets`` (0 where the target is -100), and
    the entropy of that distribution."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logps.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(logps.exp() * logps).sum(dim=-1)
    return torch.where(targets != -100, picked, 0.0), entropy


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    reference_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate per completion token (PPO's, with the advantage of its completion), plus ``beta`` x the
    k3 estimate of the KL to the reference times the ratio (DeepSeek-V3.2's unbiased reverse-KL gradient, TRL's
    default); and, detached, the token values TRL logs (``kl``, ``clip_ratio/*``).
    ``old_logps`` None: the policy that generated is this one (one step per round), so the ratio is exactly 1 and
    only its gradient acts."""
    old_logps = logps.detach() if old_logps is None else old_logps
    advantages = advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    tokens = {
        "clip_ratio/low_mean": ((ratio < 1 - epsilon) & (advantages < 0)).float(),
        "clip_ratio/high_mean": ((ratio > 1 + epsilon_high) & (advantages > 0)).float(),
    }
    tokens["clip_ratio/region_mean"] = torch.maximum(tokens["clip_ratio/low_mean"], tokens["clip_ratio/high_mean"])
    if beta:
        # x the ratio (TRL's use_bias_correction_kl, on by default): its value is 1 on-policy, its gradient is not.
        kl = (torch.exp(reference_logps - logps) - (reference_logps - logps) - 1) * ratio
        loss = loss + beta * kl
        tokens["kl"] = kl.detach()
    return loss, tokens


def reduce_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    step_tokens: torch.Tensor,
    step_completions: int,
    micro_batches: int,
    processes: int,
    max_completion_length: int,
) -> torch.Tensor:
    """This micro-batch's share of its optimizer step's loss, so that the shares of every micro-batch of every
    process add up to the step's loss (the recipe multiplies each by the process count: DDP averages gradients).
    ``dapo``: its token sum over ``step_tokens``, the completion tokens of the whole step (TRL: the generation batch's,
    which is the step's when generation happens once per step, its default); ``grpo``: its per-completion token means
    over ``step_completions``; ``dr_grpo``: its token sum over ``step_completions`` x ``max_completion_length``;
    ``bnpo``: its own token mean, divided by the micro-batches and processes of the step (TRL: per micro-batch, so the
    result depends on how the step is split)."""
    summed = (loss * mask).sum()
    if loss_type == "grpo":
        return ((loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / step_completions
    if loss_type == "dr_grpo":
        return summed / (step_completions * max_completion_length)
    if loss_type == "bnpo":
        return summed / mask.sum().clamp(min=1) / (micro_batches * processes)
    return summed / step_tokens.clamp(min=1)


def grpo_loss(
    logps: torch.Tensor,
    batch: dict,
    *,
    step_tokens: torch.Tensor,
    micro_batches: int,
    loss_type: str,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    step_completions: int,
    processes: int,
    max_completion_length: int,
) -> tuple[torch.Tensor, dict]:
    """A micro-batch's share of the step's loss: its per-token loss (``per_token_loss``: the clipped ratio against
    the round's ``old_logps``, or 1 on-policy, and the KL term with ``beta``) reduced as ``loss_type`` says
    (``reduce_loss``), and the token statistics TRL logs."""
    token_loss, tokens = per_token_loss(
        logps,
        batch.get("old_logps"),
        batch.get("reference_logps"),
        batch["advantages"],
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
    )
    loss = reduce_loss(
        token_loss,
        batch["mask"],
        loss_type,
        step_tokens=step_tokens,
        step_completions=step_completions,
        micro_batches=micro_batches,
        processes=processes,
        max_completion_length=max_completion_length,
    )
    return loss, tokens
