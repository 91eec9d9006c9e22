"""What a user sees of a run: the loss curve, tokens/s, step time, peak memory, in ``results.json`` (``RunRecord``)."""

from __future__ import annotations

import json
import numbers
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

GIB = 1024**3
# What a run's speed and peak memory describe: a requeue that trained no step under other ones keeps neither (null).
MEASURED_UNDER = ("num_processes", "parallelism", "device", "mixed_precision")


def peak_memory_gib(devices: list[torch.device]) -> dict[str, float]:
    """Peak memory of this process per device, GiB: CUDA's allocated tensors; the CPU's resident set (all of it)."""
    scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss is in KiB on Linux (bytes on macOS)
    resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / GIB
    cuda = {str(device): torch.cuda.max_memory_allocated(device) / GIB for device in devices if device.type == "cuda"}
    return cuda | ({"cpu": resident} if any(device.type != "cuda" for device in devices) else {})


def percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile of ``values``, linearly interpolated (numpy's default); None if empty."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def write_results(
    accelerator: Accelerator, output_dir: str | os.PathLike, results: dict, filename: str = "results.json"
) -> Path:
    """Write ``output_dir/results.json`` from the main process, atomically: no reader sees half a file."""
    path, tmp = Path(output_dir) / filename, Path(output_dir) / (filename + ".tmp")
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    return path


class RunRecord:
    """The loss curve, the clock (synced every ``sync_every`` steps, not in each) and peak memory of a run."""

    def __init__(
        self,
        accelerator: Accelerator,
        max_train_steps: int,
        loss_curve: list[float] | None = None,
        warmup_steps: int = 2,
        devices: list[torch.device] | None = None,
        sync_every: int = 10,
    ):
        self.accelerator, self.max_train_steps, self.sync_every = accelerator, max_train_steps, sync_every
        self.warmup_steps, self.devices = warmup_steps, devices or [accelerator.device]
        self.curve, self.unread = list(loss_curve or []), []
        self.resumed_from_step = len(self.curve)
        self.step_times, self.data_wait_times = [], []  # per measured step: seconds, and seconds in next(dataloader)
        self.samples = self.tokens = self.answer_tokens = self.steps_seen = 0
        self._waiting, self._data_timed, self._window, self._last = 0.0, False, [], time.perf_counter()
        # Loading and prepare are done: their peak per device, apart from training's (on CUDA the counter restarts).
        self.load_peak, self.train_peak = peak_memory_gib(self.devices), None
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

    def timed(self, dataloader):
        """``dataloader``'s batches, each ``next()``'s time added to the step's data wait."""
        self._data_timed, iterator = True, iter(dataloader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self._waiting += time.perf_counter() - start
            yield batch

    def step(self, completed_steps: int, loss, samples: int, tokens=0, answer_tokens=0) -> None:
        """After each optimizer step: its global loss, samples and tokens (``answer_tokens``: those of the loss)."""
        if isinstance(loss, numbers.Number) and not self.unread:  # read by the recipe already (its sync is done)
            self.curve.append(float(loss))
        else:
            self.unread.append(loss)
        self.steps_seen += 1
        self._window.append((samples, tokens, answer_tokens, self._waiting))
        self._waiting = 0.0
        if self.steps_seen == self.warmup_steps:  # the clock starts after the warm-up steps
            self._sync()
        if completed_steps >= self.max_train_steps or len(self.unread) >= self.sync_every:
            self.losses()
        if completed_steps >= self.max_train_steps:  # training's peak, before the save and the evaluation
            self.train_peak = peak_memory_gib(self.devices)

    def losses(self) -> list[float]:
        """Every optimizer step's global loss so far. Sync point: the device finishes the queued steps."""
        self._sync()
        self.curve.extend(float(loss) for loss in self.unread)
        self.unread.clear()
        return self.curve

    def _sync(self) -> None:
        """Sync point: wait for the devices, then share the window's time out among its steps."""
        if not self._window:
            return
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        now = time.perf_counter()
        seconds, first = (now - self._last) / len(self._window), self.steps_seen - len(self._window) + 1
        for number, (samples, tokens, answer_tokens, waited) in enumerate(self._window, first):
            if number > self.warmup_steps:
                self.step_times.append(seconds)
                self.data_wait_times.append(waited)
                self.samples, self.tokens = self.samples + int(samples), self.tokens + int(tokens)
                self.answer_tokens += int(answer_tokens)
        self._window, self._last = [], now

    def _perf(self) -> dict:
        """The perf/* entries."""
        measured, steps = sum(self.step_times), len(self.step_times)
        summary = {
            "perf/measured_steps": steps,
            "perf/step_time_p90_s": percentile(self.step_times, 90),
            "perf/step_time_s": statistics.median(self.step_times) if steps else None,
            "perf/samples_per_sec": self.samples / measured if measured else None,
            "perf/samples_per_step": self.samples / steps if steps else None,
            "perf/data_wait_fraction": sum(self.data_wait_times) / measured if measured and self._data_timed else None,
        }
        if self.tokens:
            summary["perf/tokens_per_sec"] = self.tokens / measured if measured else None
            summary["perf/tokens_per_step"] = self.tokens / steps if steps else None
        if self.answer_tokens:
            summary["perf/answer_tokens_per_sec"] = self.answer_tokens / measured if measured else None
        return summary

    def write(self, output_dir: str | os.PathLike, results: dict, model) -> Path:
        """``results`` with the curve, perf/* and memory/*, to results.json and the trackers; a collective."""
        accelerator, several = self.accelerator, self.accelerator.num_processes > 1
        per_rank = lambda value: {f"rank{r}": item for r, item in enumerate(gather_object([value]))}
        per_device = lambda peaks: {
            f"{r}/" * several + d: round(gib, 4)
            for r, of_rank in per_rank(peaks).items()
            for d, gib in of_rank.items()
        }
        curve = self.losses()
        unwrapped = accelerator.unwrap_model(model)  # a device_map split's map, on the PEFT wrapper or its base model
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        device_map = vars(unwrapped).get("hf_device_map") or getattr(base, "hf_device_map", None)
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        results = {
            "num_processes": accelerator.num_processes,
            "distributed_type": accelerator.distributed_type.value,
            "device": str(accelerator.device),
            "mixed_precision": accelerator.mixed_precision,
            "distributed/backend": torch.distributed.get_backend() if initialized else None,
            "device_map": {name: str(device) for name, device in device_map.items()} if device_map else None,
            "completed_steps": len(curve),
            "resumed_from_step": self.resumed_from_step,
            "train/loss": curve[-1] if curve else None,
            "train/loss_curve": curve,
            **self._perf(),
            "memory/peak_gib": per_device(self.train_peak or peak_memory_gib(self.devices)),
            "memory/load_peak_gib": per_device(self.load_peak),  # host RAM too: loading and offload live there
            "memory/host_peak_gib": {
                rank: round(gib["cpu"], 4) for rank, gib in per_rank(peak_memory_gib([torch.device("cpu")])).items()
            },
            **results,
        }
        earlier = Path(output_dir) / "results.json"  # a requeue that trained no step keeps what its run measured
        kept = json.loads(earlier.read_text()) if not self.steps_seen and earlier.is_file() else {}
        if kept.get("train/loss_curve") == curve:  # (the same run's: its loss curve, every step of it)
            measured = {key: value for key, value in kept.items() if key.startswith(("perf/", "memory/peak_gib"))}
            alike = all(kept.get(key) == results.get(key) for key in MEASURED_UNDER)  # else: filed under this setup
            results |= measured if alike else {"memory/peak_gib": None}  # (and perf/*: none measured, as this run)
        summary = {k: v for k, v in results.items() if isinstance(v, int | float) and not k.startswith("train/")}
        accelerator.log(summary, step=len(curve))  # train/* not again: the loop logged each window at its own step
        path = write_results(accelerator, output_dir, results)
        # Sync point: no process tears down its connections while another still writes (gloo can abort at exit).
        accelerator.wait_for_everyone()
        return path
