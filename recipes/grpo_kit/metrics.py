"""What ``recipes/grpo.py`` logs, by TRL's names (results.json: ``train/<name>``): each round's rewards and
completions (``reward``, ``reward_std``, ``rewards/<function>/mean`` and ``/std``, ``frac_reward_zero_std``,
``completions/mean_length`` ... ``completions/clipped_ratio``), each optimizer step's token means (``entropy``, ``kl``,
``clip_ratio/low_mean`` ...), and the run's completions per second (``perf/completions_per_sec``).

Where TRL averages a token metric over the micro-batches of a step (each micro-batch's own token mean), this takes
the token mean of the whole step: the same number when the micro-batches hold as many tokens, and one that does not
depend on how a step is split over processes and accumulation."""

from __future__ import annotations

import torch

from shared.results import RunRecord

from .loss import nanstd
from .collectives import gather

TOKEN_METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def round_metrics(gathered: torch.Tensor, functions: list, advantages: dict) -> dict[str, torch.Tensor]:
    """TRL's metrics of a round from its global batch: ``gathered`` is one row per completion, a column per reward
    function (``functions``: ``(name, function)``; NaN: not applicable), then the completion's length in tokens and
    whether it was truncated; ``advantages`` is what ``loss.group_advantages`` returned for it."""
    names = [name for name, _ in functions]
    functions, lengths, truncated = gathered[:, : len(names)], gathered[:, -2], gathered[:, -1].bool()
    ended = lengths[~truncated] if (~truncated).any() else torch.zeros(1, device=lengths.device)
    metrics = {"reward": torch.nanmean(advantages["rewards"]), "reward_std": nanstd(advantages["rewards"])}
    for column, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(functions[:, column])
        metrics[f"rewards/{name}/std"] = nanstd(functions[:, column])
    metrics["frac_reward_zero_std"] = advantages["zero_std"].float().mean()
    for prefix, values in (("", lengths), ("terminated_", ended)):
        metrics[f"completions/mean_{prefix}length"] = values.mean()
        metrics[f"completions/min_{prefix}length"] = values.min()
        metrics[f"completions/max_{prefix}length"] = values.max()
    metrics["completions/clipped_ratio"] = truncated.float().mean()
    return metrics


class StepMetrics:
    """One optimizer step's loss, tokens and token metrics, added up over its micro-batches on this process (``add``)
    and over the processes (``result``: one collective)."""

    def __init__(self, device):
        # The loss, the tokens trained (prompts and completions), each token metric's sum, the completion tokens.
        self.sums = torch.zeros(len(TOKEN_METRICS) + 3, device=device)
        self.extremes = torch.tensor([torch.inf, -torch.inf], device=device)  # clip_ratio/low_min, /high_max

    def add(self, loss: torch.Tensor, batch: dict, tokens: dict[str, torch.Tensor]) -> None:
        """A micro-batch's share of the step's loss, and ``tokens``: its per-token values (``entropy`` and what
        ``loss.per_token_loss`` logs)."""
        mask = batch["mask"].float()
        sums = [(tokens[name] * mask).sum() if name in tokens else mask.new_zeros(()) for name in TOKEN_METRICS]
        trained = batch["num_tokens"].sum().to(mask)
        self.sums += torch.stack([loss.detach(), trained, *(value.detach() for value in sums), mask.sum()])
        per_row = lambda name: (tokens[name] * mask).sum(dim=1) / mask.sum(dim=1)  # NaN for a row without tokens
        low, high = per_row("clip_ratio/low_mean"), per_row("clip_ratio/high_mean")
        low, high = torch.where(low.isnan(), torch.inf, low).min(), torch.where(high.isnan(), -torch.inf, high).max()
        self.extremes = torch.stack([torch.minimum(self.extremes[0], low), torch.maximum(self.extremes[1], high)])

    def result(self, accelerator, beta: float, group=None) -> dict[str, torch.Tensor]:
        """The step's loss and tokens trained over every process (``group``: its processes, the split layout's
        trainers), its token means (``kl`` only with ``beta``), and the smallest low-clip and largest high-clip share
        of a completion, by TRL's names (on the device)."""
        mine = torch.cat([self.sums, self.extremes])[None]
        everyone = gather(accelerator, mine, group).view(-1, len(self.sums) + 2)
        sums = everyone[:, : len(self.sums)].sum(dim=0)
        step = {"loss": sums[0], "num_tokens": sums[1]}
        step.update({name: sums[2 + index] / sums[-1].clamp(min=1) for index, name in enumerate(TOKEN_METRICS)})
        if not beta:
            step.pop("kl")
        extremes = torch.stack([everyone[:, -2].min(), everyone[:, -1].max()])
        extremes = torch.where(extremes.isinf(), torch.nan, extremes)  # no completion token in the step
        step["clip_ratio/low_min"], step["clip_ratio/high_max"] = extremes
        return step


class CompletionsRecord(RunRecord):
    """``shared.results.RunRecord`` whose samples are completions: the recipe counts, for each optimizer step, the
    completions generated for it (all of a round's at its first step, none at the others with ``--num_iterations``),
    so ``perf/samples_per_sec`` is completions generated per second, written again under its name,
    ``perf/completions_per_sec``."""

    def _perf(self) -> dict:
        summary = super()._perf()
        return {**summary, "perf/completions_per_sec": summary["perf/samples_per_sec"]}


class TrainLog:
    """What a run logs of its optimizer steps, by TRL's names: every step's metrics (``add``); every
    ``logging_steps`` (and at the last step) the window's means (a metric that is NaN in a step left out, as TRL does)
    sent to the trackers and kept in ``log`` (results.json's ``train/log``), the last window's in ``last``; every
    step's mean reward in ``rewards`` (``train/rewards``). A resumed run goes on from its checkpoint's ``history``."""

    def __init__(self, history: dict, logging_steps: int, max_train_steps: int):
        self.log, self.rewards = history.get("train/log", []), history.get("train/rewards", [])
        self.logging_steps, self.max_train_steps, self.window = logging_steps, max_train_steps, []
        # A resume keeps the last logged window's: one from the checkpoint of the last step logs no window more.
        self.last = {key: value for key, value in self.log[-1].items() if key != "step"} if self.log else {}

    def add(self, accelerator, completed_steps: int, step: dict, learning_rate: float) -> None:
        self.window.append(step)
        self.rewards.append(step["reward"])
        if completed_steps % self.logging_steps == 0 or completed_steps == self.max_train_steps:
            # Sync point: reads the window's metrics.
            logs = {f"train/{k}": torch.stack([s[k] for s in self.window]).nanmean().item() for k in self.window[0]}
            logs["train/learning_rate"], self.window, self.last = learning_rate, [], logs
            self.log.append({"step": completed_steps, **logs})
            accelerator.log(logs, step=completed_steps)

    def history(self) -> dict:
        """``train/log`` and ``train/rewards`` so far (JSON), for a checkpoint and results.json."""
        return {"train/log": self.log, "train/rewards": list(map(float, self.rewards))}
