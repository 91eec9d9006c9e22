"""DPO's loss (``recipes/dpo.py``), as TRL 1.16's DPOTrainer computes it: the completions' sequence log-probs
(``sequence_logps``, from ``llm_kit.loss.token_losses``), the per-pair losses and TRL's metrics (``dpo_losses``), a
micro-batch's share of its optimizer step's loss with RPO's NLL term (``step_loss``, over the counts of
``step_counts``), and the logged means (``metric_means``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_kit.loss import token_losses

# TRL's metric names (results.json: train/<name>, eval/<name>), as ``metric_means`` orders them; nll_loss: the
# policy's loss on the chosen completion tokens (what --rpo_alpha weighs; TRL before 1.0 logs it with rpo_alpha).
METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
)


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Summed log-prob of each row's completion tokens (chosen rows, then rejected): minus their summed loss, from
    ``token_losses`` (logits at the completion positions only, fp32 cross-entropy in checkpointed chunks)."""
    return -token_losses(model, batch["sequences"])[1]


def dpo_losses(
    policy: torch.Tensor, reference: torch.Tensor, batch: dict, beta: float, loss_type: str, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss, and ``METRICS`` per pair (pairs x 7, detached), as TRL 1.16's DPOTrainer computes them
    (trl/trainer/dpo_trainer.py, ``_compute_loss``): margin = (policy - reference) of chosen minus that of rejected;
    sigmoid: -log sigmoid(beta * margin), with label smoothing -(1-e) log sigmoid(beta m) - e log sigmoid(-beta m)
    (conservative DPO, TRL's sigmoid before 1.0; 1.16 keeps it for its robust/aot losses); ipo: each log-ratio over its
    completion's token count, then (margin - 1 / (2 beta))^2. Rewards: beta * log-ratio."""
    chosen_logratios, rejected_logratios = (policy - reference).chunk(2)
    chosen_tokens, rejected_tokens = completion_tokens(batch).to(policy.device).chunk(2)
    if loss_type == "ipo":
        margin = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        margin = chosen_logratios - rejected_logratios
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    chosen_logps, rejected_logps = policy.detach().chunk(2)
    per_pair = [
        losses.detach(),
        chosen_rewards,
        rejected_rewards,
        (chosen_rewards > rejected_rewards).float(),
        chosen_rewards - rejected_rewards,
        chosen_logps,
        rejected_logps,
        chosen_tokens,
    ]
    return losses, torch.stack(per_pair, dim=1).float()


def completion_tokens(batch: dict) -> torch.Tensor:
    """The completion tokens of each row (chosen rows, then rejected): the scored positions."""
    return (batch["sequences"]["loss_targets"] != -100).sum(dim=1)


def step_counts(batch: dict) -> torch.Tensor:
    """The batch's pairs and their chosen completion tokens: summed over a step, what its losses are averaged over."""
    return torch.stack([(batch["index"] >= 0).sum(), completion_tokens(batch).chunk(2)[0].sum()])


# The flags ``step_loss`` (and so ``dpo_losses``) takes, by the names the recipe's parser gives them.
LOSS_FLAGS = ("beta", "loss_type", "label_smoothing", "rpo_alpha")


def step_loss(
    model, batch: dict, reference: torch.Tensor, step_pairs, step_tokens, rpo_alpha: float | None, **loss_kw
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's forward on a micro-batch, its share of its optimizer step's loss, and its per-pair columns
    (``dpo_losses``): its DPO losses over the step's pairs plus, with ``rpo_alpha`` (RPO), that times its chosen
    completion tokens' loss over the step's chosen tokens. Summed over the step's micro-batches and processes: the
    mean DPO loss per pair plus rpo_alpha x the mean NLL per chosen completion token, whatever the processes and
    accumulation (TRL: per batch on each process)."""
    policy = sequence_logps(model, batch)
    losses, per_pair = dpo_losses(policy, reference, batch, **loss_kw)
    nll = -policy.chunk(2)[0].sum() / step_tokens  # the chosen rows (the first half): their completion tokens
    return losses.sum() / step_pairs + (rpo_alpha * nll if rpo_alpha else 0), per_pair


def metric_means(sums: torch.Tensor, pairs, rpo_alpha: float | None) -> torch.Tensor:
    """``METRICS`` from the sums over ``pairs`` pairs of ``dpo_losses``' per-pair columns: means per pair, but
    ``nll_loss`` per chosen completion token (minus the summed chosen log-probs over the chosen tokens), and
    ``loss`` the DPO loss plus ``rpo_alpha`` x ``nll_loss`` (the objective trained)."""
    means, nll_loss = sums[:-1] / pairs, -sums[5:6] / sums[-1]
    return torch.cat([means[:1] + (rpo_alpha or 0) * nll_loss, means[1:], nll_loss])
