"""Measuring a run (throughput, step time, MFU, peak memory, model-state bytes) and writing ``results.json``.

A recipe makes three calls into this module, so that its ``main()`` tells the training story and not our bookkeeping:
``with RunRecord(...) as record:`` around the loop, evaluation and save; ``record.timed(dataloader)`` for the batches;
``record.step(...)`` after each optimizer step. Its own results go into ``record.results``; leaving the block writes
``results.json``. (The hang dumps start earlier, in ``shared.runtime.build_accelerator``.)

One metric vocabulary everywhere (logs, trackers, results.json, benchmarks): ``perf/samples_per_sec``,
``perf/tokens_per_sec``, ``perf/step_time_s`` (median; ``perf/step_time_p90_s`` beside it; each step timed as the
mean of its window of at most 10, see ``ThroughputMeter``), ``perf/data_wait_fraction``, ``perf/mfu``,
``memory/peak_gib`` (per device).
"""

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

from . import hang_dump
from .flops import peak_bf16_flops
from .fsdp import sharding_facts
from .model_split import execution_devices
from .runtime import run_facts

GIB = 1024**3


def peak_memory_gib(devices: list[torch.device]) -> dict[str, float]:
    """Peak memory of this process per device, GiB. CUDA: ``max_memory_allocated`` (tensors only, what decides
    out-of-memory). CPU: the peak resident set size, with Python, libraries and buffers: compare CPU with CPU only."""
    peaks = {}
    for device in devices:
        if device.type == "cuda":
            peaks[str(device)] = torch.cuda.max_memory_allocated(device) / GIB
        else:
            # ru_maxrss is in KiB on Linux (bytes on macOS).
            scale = 1 if platform.system() == "Darwin" else 1024
            peaks["cpu"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / GIB
    return peaks


def percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile of ``values``, linearly interpolated (numpy's default); None if empty."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


class ThroughputMeter:
    """Times optimizer steps and counts samples/tokens, skipping the first ``warmup_steps``: ``step(samples, tokens)``
    after each optimizer step with the *global* counts, then ``summary()`` on every process (a collective). Batches
    drawn through ``timed(dataloader)`` also measure each step's wait for its data (``perf/data_wait_fraction``).

    CUDA runs behind the host: a step's clock can only stop after a sync, and a sync in every step would keep the host
    from queueing the next step while the GPU finishes this one. So the clock reads in windows: ``sync()`` waits for
    the devices and gives each step of the window since the last one the window's mean time. It syncs at the end of
    the warm-up and whenever asked (``RunRecord`` asks every ``sync_every`` steps, at the last step and when the loss
    curve is read). Token and sample counts may be device tensors: they are read at the sync too."""

    def __init__(self, accelerator: Accelerator, warmup_steps: int = 1, devices: list[torch.device] | None = None):
        self.accelerator, self.warmup_steps, self.devices = accelerator, warmup_steps, devices or [accelerator.device]
        self.step_times: list[float] = []
        self.samples = self.tokens = self.answer_tokens = self.steps_seen = 0
        self.data_wait_times: list[float] = []  # per measured step: seconds spent in next(dataloader)
        self._waiting = 0.0  # data wait since the last step()
        self._data_timed = False  # set by timed(): without it the data wait is unknown, not 0
        self._window: list[tuple] = []  # the steps since the last sync: (samples, tokens, answer tokens, data wait)
        self._last = time.perf_counter()

    def timed(self, dataloader):
        """Yield ``dataloader``'s batches, adding the time each ``next()`` takes (loading, collating, moving to the
        device: what the step waits for its data) to the current step."""
        self._data_timed = True
        iterator = iter(dataloader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self._waiting += time.perf_counter() - start
            yield batch

    def step(self, samples: int, tokens=0, answer_tokens=0, sync: bool = True) -> None:
        """``answer_tokens``: the tokens a fine-tune learns from (its loss is on them), beside all ``tokens``.
        ``sync=False``: leave the clock running (the window goes on) unless the warm-up ends here."""
        self.steps_seen += 1
        self._window.append((samples, tokens, answer_tokens, self._waiting))
        self._waiting = 0.0
        if sync or self.steps_seen == self.warmup_steps:
            self.sync()

    def sync(self) -> None:
        """Close the window: wait for the devices, then share its time out among its steps."""
        if not self._window:
            return
        for device in self.devices:  # Sync point: the clock stops when the GPU has finished the queued steps
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        now = time.perf_counter()
        seconds = (now - self._last) / len(self._window)
        first = self.steps_seen - len(self._window) + 1
        for number, (samples, tokens, answer_tokens, waited) in enumerate(self._window, first):
            if number > self.warmup_steps:
                self.step_times.append(seconds)
                self.data_wait_times.append(waited)
                self.samples, self.tokens = self.samples + int(samples), self.tokens + int(tokens)
                self.answer_tokens += int(answer_tokens)
        self._window, self._last = [], now

    def summary(self, flops_per_token: float | None = None, peaks: dict[str, float] | None = None) -> dict:
        """The perf/* and memory/* entries of results.json. With ``flops_per_token`` (training FLOPs per token, see
        ``shared.flops``) on CUDA also ``perf/mfu``: achieved FLOP/s over the peak of every GPU the run uses."""
        self.sync()
        measured = sum(self.step_times)
        summary = {
            "perf/measured_steps": len(self.step_times),
            "perf/step_time_s": statistics.median(self.step_times) if self.step_times else None,
            "perf/step_time_p90_s": percentile(self.step_times, 90),
            "perf/samples_per_sec": self.samples / measured if measured else None,
            "perf/samples_per_step": self.samples / len(self.step_times) if self.step_times else None,
            # Share of the measured steps' time spent waiting for batches (None without timed()).
            "perf/data_wait_fraction": sum(self.data_wait_times) / measured if measured and self._data_timed else None,
        }
        if self.tokens:
            summary["perf/tokens_per_sec"] = self.tokens / measured if measured else None
            summary["perf/tokens_per_step"] = self.tokens / len(self.step_times) if self.step_times else None
        if self.answer_tokens:
            summary["perf/answer_tokens_per_sec"] = self.answer_tokens / measured if measured else None
        gpus = [device for device in self.devices if device.type == "cuda"]
        if flops_per_token and gpus and summary.get("perf/tokens_per_sec"):
            name, peak = torch.cuda.get_device_name(gpus[0]), peak_bf16_flops(torch.cuda.get_device_name(gpus[0]))
            summary["perf/gpu_name"], summary["perf/peak_flops_per_device"] = name, peak
            if peak:  # every process drives len(gpus) GPUs (2 in a device_map split)
                used = self.accelerator.num_processes * len(gpus)
                summary["perf/mfu"] = summary["perf/tokens_per_sec"] * flops_per_token / (peak * used)
        # gather_object is a collective: every process must call summary().
        per_rank = gather_object([peaks or peak_memory_gib(self.devices)])  # (``peaks``: taken earlier)
        several = self.accelerator.num_processes > 1
        # Host RAM too (peak RSS, per process), on GPUs as well: loading and CPU offload live there.
        host = gather_object([peak_memory_gib([torch.device("cpu")])["cpu"]])
        summary["memory/host_peak_gib"] = {f"rank{rank}": round(gib, 4) for rank, gib in enumerate(host)}
        summary["memory/peak_gib"] = {(f"rank{rank}/" if several else "") + device: round(gib, 4)
                                      for rank, peaks in enumerate(per_rank) for device, gib in peaks.items()}
        return summary


def compiled_modules(model) -> int:
    """How many modules of ``model`` run compiled: ``torch.compile`` wrappers (Accelerate's regional compilation wraps
    each decoder block, the whole-model one the model) and modules compiled in place (``module.compile()``, its
    regional compilation under FSDP2). 0 without ``--compile``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return sum(isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None
               for module in model.modules())


def write_results(accelerator: Accelerator, output_dir: str | os.PathLike, results: dict,
                  filename: str = "results.json") -> Path:
    """Write ``output_dir/results.json`` (or ``filename``) from the main process, atomically (tmp file + rename):
    readers (tests, benchmarks, the compare tool) never see a half-written file."""
    path, tmp = Path(output_dir) / filename, Path(output_dir) / (filename + ".tmp")
    if accelerator.is_main_process:
        tmp.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    return path


def per_rank(value) -> dict[str, object]:
    """``value`` from every process, as ``{"rank0": ..., "rank1": ...}``. A collective: call it on all."""
    return {f"rank{rank}": item for rank, item in enumerate(gather_object([value]))}


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Exact bytes of model state this process holds: parameters, gradients, optimizer state (the ZeRO accounting
    that decides whether a model fits; activations come on top). DDP holds all of it on every process, FSDP 1/N.
    ``gradients``: one per trainable parameter shard, in its dtype, what backward allocates (``zero_grad`` may have
    freed them by now). Tied weights count once."""

    def local(tensor: torch.Tensor) -> torch.Tensor:  # a DTensor (FSDP2) reports its *global* shape: count its shard
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    shards = {local(param).data_ptr(): (local(param), param.requires_grad) for param in model.parameters()}
    parameters = sum(shard.numel() * shard.element_size() for shard, _ in shards.values())
    gradients = sum(shard.numel() * shard.element_size() for shard, trained in shards.values() if trained)
    optimizer_state = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            # Adam's step counter is a 0-d tensor (4 or 8 bytes): counted too, it is state.
            optimizer_state += sum(local(value).numel() * local(value).element_size()
                                   for value in state.values() if isinstance(value, torch.Tensor))
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer_state,
            "total": parameters + gradients + optimizer_state}


class RunRecord:
    """What a run records for its ``results.json``, tests and benchmarks: the loss curve, the throughput meter (MFU
    with ``flops_per_token``), peak memory, model-state bytes, FSDP sharding and device_map hook facts, the resolved
    ``config`` (printed once here), and the run's own ``results``. Enter it after ``prepare``; leaving the block
    normally is a collective (every process gathers its numbers) and writes ``output_dir/results.json``."""

    def __init__(self, accelerator: Accelerator, recipe: str, output_dir: str | os.PathLike, config: dict, model,
                 optimizer=None, max_train_steps: int | None = None, loss_curve: list[float] | None = None,
                 warmup_steps: int = 2, devices: list[torch.device] | None = None,
                 flops_per_token: float | None = None, sync_every: int = 10):
        self.accelerator, self.recipe, self.output_dir = accelerator, recipe, Path(output_dir)
        self.model, self.optimizer, self.max_train_steps = model, optimizer, max_train_steps
        self.flops_per_token, self.config = flops_per_token, config
        # A resumed run starts from the curve its checkpoint saved: results hold the whole run's losses.
        self._curve, self._unread, self.sync_every = list(loss_curve or []), [], sync_every
        self.resumed_from_step = len(self._curve)
        self.meter = ThroughputMeter(accelerator, warmup_steps=warmup_steps, devices=devices)
        # Loading and prepare are done: their peak per device, apart from training's. On CUDA the peak counter starts
        # again here, so memory/peak_gib is training's own; on the CPU (peak RSS) training's can only add to it.
        self.load_peak = peak_memory_gib(self.meter.devices)
        for device in self.meter.devices:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        self.train_peaks: dict | None = None  # set at the last step
        self.results: dict = {}
        accelerator.print("config: " + json.dumps(config, sort_keys=True, default=str))

    def __enter__(self) -> RunRecord:
        return self

    def timed(self, dataloader):
        """The batches of ``dataloader``, each one's wait measured (``perf/data_wait_fraction``)."""
        return self.meter.timed(dataloader)

    def step(self, completed_steps: int, loss, samples: int, tokens=0, answer_tokens=0) -> None:
        """After each optimizer step: its global loss, and the samples/tokens of the whole global batch. The loss and
        the token counts may be tensors still on the device: they are read (a sync point) every ``sync_every`` steps,
        at the last step, and when the recipe reads ``loss_curve`` (to log it), not in every step."""
        if isinstance(loss, numbers.Number) and not self._unread:  # read by the recipe already (its sync is done)
            self._curve.append(float(loss))
        else:  # a tensor, perhaps still on the device
            self._unread.append(loss)
        last = self.max_train_steps is not None and completed_steps >= self.max_train_steps
        self.meter.step(samples, tokens, answer_tokens, sync=False)
        if last or len(self._unread) >= self.sync_every:
            self.read()
        hang_dump.progress(completed_steps)
        if last:
            # Saving and evaluating take their own time; a hang there still ends at --dist_timeout with a dump.
            hang_dump.progress(phase="saving and evaluation")
            # memory/peak_gib is training's: taken now, before the save (a gathered state dict) and the evaluation.
            self.train_peaks = peak_memory_gib(self.meter.devices)

    @property
    def loss_curve(self) -> list[float]:
        """Every optimizer step's global loss so far (reading it is a sync point: the device finishes the steps)."""
        self.read()
        return self._curve

    def read(self) -> None:
        """Sync point: wait for the queued steps (the clock's window closes) and read their losses."""
        self.meter.sync()
        self._curve.extend(float(loss) for loss in self._unread)
        self._unread.clear()

    def __exit__(self, kind, error, trace) -> None:
        # Let go of the model and optimizer on the way out: the recipe's teardown (free_memory, end_training) must
        # leave no reference to a DDP wrapper, whose reducer can deadlock at exit once the process group is gone.
        model, optimizer, self.model, self.optimizer = self.model, self.optimizer, None, None
        if kind is not None:  # an error: no results.json for a run that did not finish
            return
        accelerator = self.accelerator
        if accelerator.is_fsdp2:
            # FSDP2 leaves the root's parameters unsharded after a forward without backward (an evaluation in the
            # block): resharded, the facts below describe the sharded state that training held.
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        perf = self.meter.summary(self.flops_per_token, self.train_peaks)  # a collective
        perf["memory/model_state_bytes"] = per_rank(model_state_bytes(model, optimizer))  # a collective
        if accelerator.is_fsdp2:
            # Proof of sharding, per process: DTensor parameters, elements held vs the whole model's, FSDP modules.
            perf["fsdp/sharding"] = per_rank(sharding_facts(model, optimizer))  # a collective
        several = accelerator.num_processes > 1
        perf["memory/load_peak_gib"] = {(f"rank{rank}/" if several else "") + device: round(gib, 4)  # a collective
                                        for rank, peaks in enumerate(gather_object([self.load_peak]))
                                        for device, gib in peaks.items()}
        unwrapped = accelerator.unwrap_model(model)
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        # The map's names are relative to the model it was set on: the PEFT wrapper when the split came after LoRA.
        base = unwrapped if "hf_device_map" in vars(unwrapped) else base
        device_map = getattr(base, "hf_device_map", None)
        facts = {
            "recipe": self.recipe,
            **run_facts(accelerator),  # num_processes, distributed_type, distributed/backend, device
            "mixed_precision": accelerator.mixed_precision,
            "completed_steps": len(self.loss_curve),
            "resumed_from_step": self.resumed_from_step,
            "train/loss": self.loss_curve[-1] if self.loss_curve else None,
            "train/loss_curve": self.loss_curve,
            "device_map": {name: str(device) for name, device in device_map.items()} if device_map else None,
            # The execution device of the AlignDevicesHook on every planned module: the split really is hooked.
            "device_map/hooks": execution_devices(base, device_map) if device_map else None,
            "compile/compiled_modules": compiled_modules(model),
        }
        results = {**facts, **perf, **self.results, "config": self.config}
        if accelerator.trackers:
            accelerator.log({key: value for key, value in results.items() if isinstance(value, (int, float))},
                            step=len(self.loss_curve))
        write_results(accelerator, self.output_dir, results)
        # Sync point: no process tears down its connections while another is still writing results (a peer that
        # exits early can make gloo abort the main process at exit, seen on 127.0.0.1).
        accelerator.wait_for_everyone()
