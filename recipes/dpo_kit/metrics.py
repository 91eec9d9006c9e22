"""What ``recipes/dpo.py`` logs of its optimizer steps, by TRL's names (``loss.METRICS``: ``train/loss``,
``train/rewards/accuracies`` ...): the means of each logging window, sent to the trackers and kept for results.json."""

from __future__ import annotations

import torch

from .loss import METRICS


class TrainLog:
    """Every step's metric means (``add``: ``loss.metric_means``, on the device); every ``logging_steps`` (and at the
    last step) the window's means, with the learning rate, sent to the trackers and kept in ``log`` (results.json's
    ``train/log``), the last window's in ``last``. A resumed run goes on with its checkpoint's ``history``'s log."""

    def __init__(self, history: dict, logging_steps: int, max_train_steps: int):
        log = history.get("train/log", [])
        self.log, self.logging_steps, self.max_train_steps, self.window = log, logging_steps, max_train_steps, []
        # A resume keeps the last logged window's: one from the checkpoint of the last step logs no window more.
        self.last = {key: value for key, value in log[-1].items() if key != "step"} if log else {}

    def add(self, accelerator, completed_steps: int, means: torch.Tensor, learning_rate: float) -> None:
        self.window.append(means)
        if completed_steps % self.logging_steps == 0 or completed_steps == self.max_train_steps:
            means = torch.stack(self.window).mean(dim=0).tolist()  # sync point: reads the window's metrics
            logs = {f"train/{name}": value for name, value in zip(METRICS, means)}
            logs["train/learning_rate"], self.window, self.last = learning_rate, [], logs
            self.log.append({"step": completed_steps, **logs})
            accelerator.log(logs, step=completed_steps)
