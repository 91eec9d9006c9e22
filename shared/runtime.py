"""The Accelerator for the hardware found, the parallelism the launch asks for, and errors users can read.

The trap this module exists for: without CUDA, a plain ``Accelerator()`` under a 2-process MULTI_GPU config does *not*
start DDP: each process trains alone on the whole data set, two runs that look fine in the logs. ``cpu=True`` joins
them over gloo; ``build_accelerator`` always passes the right value, then checks the process count."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import re
import signal
import sys
import time
import traceback
from collections import namedtuple
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, gather_object
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.optim.optimizer import register_optimizer_step_post_hook

CONFIG_FOR = {
    "single": "single_gpu.yaml",
    "ddp": "ddp_2gpu.yaml",
    "fsdp": "fsdp_2gpu.yaml",
    "device_map": "model_sharding_2gpu.yaml",
    "pipeline": "pipeline_2gpu.yaml",
}
# What an earlier run leaves in its output_dir (the Hub scripts' check): a new run into it is refused unless asked.
RUN_OUTPUTS = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "results.json",
)
# Any of these in a model folder is a tokenizer transformers can load (one file names the rest).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)


# The rank whose RecipeError ended the run first, in the process group's store (read by install_peer_exit_hooks).
FAILED_RANK_KEY = "two_gpu_recipes/failed_rank"
# What gloo says when the process at the other end exited (NCCL: the watchdog reports a timeout instead).
PEER_ENDED = ("connection closed by peer", "connection reset by peer")


class RecipeError(SystemExit):
    """Bad input or setup, reported as one readable paragraph and a non-zero exit (no traceback). A ``SystemExit``:
    ``raise RecipeError("...")`` anywhere prints it to stderr and exits with status 1. ``printed=False`` exits with
    status 1 silently (``stop_if_found``: the main process prints it for all). Under several processes each rank's
    paragraph is one line of its own; ``report_recipe_errors`` around ``main()`` prints a paragraph every rank hits
    once."""

    def __init__(self, message: str, printed: bool = True):
        self.message = " ".join(message.split())
        rank, world_size = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
        # One line: terminals wrap it, and it stays greppable in logs. Python writes a SystemExit's message and its
        # newline in two writes, so the ranks' lines would run together: with several processes the newline is part
        # of the message (stderr is line-buffered, so each rank's line is written whole).
        prefix, end = ("[rank " + rank + "] ", "\n") if world_size > 1 else ("", "")
        super().__init__(prefix + "error: " + self.message + end if printed else 1)


@contextlib.contextmanager
def report_recipe_errors():
    """Around ``main()``: a RecipeError that several processes hit alike (they check the same input) is printed by the
    first of them on this machine, the others exit with status 1 silently (a marker file in the folder torchrun gives
    this attempt's error files). Its paragraph also goes to torchrun's error file, so the launcher's closing box
    names it as the root cause (instead of "To enable traceback see: ..."), and its rank to the process group's
    store, which torchrun's agent holds: the other ranks, stopped by this one's exit, name it
    (``install_peer_exit_hooks``)."""
    try:
        yield
    except RecipeError as error:
        if error.code == 1 or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            raise
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            with contextlib.suppress(OSError):
                Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(
                    json.dumps({"message": "error: " + error.message, "timestamp": int(time.time())})
                )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.distributed_c10d._get_default_store().set(FAILED_RANK_KEY, os.environ["RANK"])
        if not first_to_report(error.message):
            raise SystemExit(1) from None
        raise


def install_peer_exit_hooks() -> None:
    """Under 2+ processes, a rank whose collective broke because another process ended first (its paragraph, if it
    had one, is above) prints one line naming that rank and exits with status 1, instead of gloo's "Connection closed
    by peer" traceback. Process-wide: sets ``sys.excepthook`` (around the one before) and counts optimizer steps
    through torch's global optimizer step hook, for the line. Call it once, at the top of ``main()``."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    rank, steps, previous_hook = os.environ.get("RANK", "0"), 0, sys.excepthook

    def count_step(optimizer, args, kwargs):
        nonlocal steps
        steps += 1

    def hook(kind, error, trace):
        # A collective's error (raised in torch.distributed, or in backward under DDP/FSDP), not any lost connection
        # (a download's "Connection reset by peer" is this rank's own error, and gets its traceback).
        files = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(trace)]
        collective = isinstance(error, torch.distributed.DistError) or any(
            "torch/distributed/" in file or "torch/autograd/" in file for file in files
        )
        if not collective or not any(words in f"{kind.__name__}: {error}".lower() for words in PEER_ENDED):
            return previous_hook(kind, error, trace)
        failed = "another process"
        with contextlib.suppress(Exception):  # no group, no store, or the store went with the failed process
            store = torch.distributed.distributed_c10d._get_default_store()
            failed = "rank " + store.get(FAILED_RANK_KEY).decode() if store.check([FAILED_RANK_KEY]) else failed
        # sys.__stderr__: torch's own excepthook (around this one) collects sys.stderr to prefix it, and prints
        # nothing of it when this one exits the process.
        print(
            f"[rank {rank}] stopped: {failed} ended first, at step {steps} "
            f"({'training' if steps else 'start-up'}); its error, if it had one, is above.",
            file=sys.__stderr__,
            flush=True,
        )
        sys.stdout.flush()
        # The failed process exits first (its exit is what the launcher reports as the root cause, with its
        # paragraph) and the launcher reads this line before it stops reading our output.
        time.sleep(2)
        os._exit(1)  # (no traceback, and no wait for threads of a run that is over)

    register_optimizer_step_post_hook(count_step)
    sys.excepthook = hook


def first_to_report(message: str) -> bool:
    """True for the first process of this machine's launch to report ``message`` (an exclusive create of a marker
    file in the folder torchrun gives this attempt's error files); True when there is no such folder."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return True
    marker = Path(error_file).parent.parent / f"recipe_error_{hashlib.sha256(message.encode()).hexdigest()[:16]}"
    try:
        descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # this process's own earlier report of it (an error caught and raised again) counts
        with contextlib.suppress(OSError, ValueError):
            return int(marker.read_text() or 0) == os.getpid()
        return False
    except OSError:
        return True
    with os.fdopen(descriptor, "w") as file:
        file.write(str(os.getpid()))
    return True


def set_quiet_library_logs(accelerator: Accelerator) -> None:
    """transformers' and datasets' warnings from the main process only (every process loads the same model and data:
    one LOAD REPORT per process otherwise), without terminal colour codes when stderr is not a terminal (a log
    file), and without the FutureWarning PEFT 0.21 triggers by reading transformers' deprecated
    ``is_gradient_checkpointing`` (nothing a user can act on). Process-wide: call it once, in ``main()``."""
    import warnings

    import datasets
    import transformers

    if not accelerator.is_local_main_process:
        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity_error()
    if not sys.stderr.isatty():
        for handler in transformers.utils.logging.get_logger().handlers:
            handler.addFilter(_strip_colours)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def _strip_colours(record) -> bool:
    """A logging filter: the record's message without ANSI colour codes (transformers' LOAD REPORT has them)."""
    record.msg = re.sub(r"\x1b\[[0-9;]*m", "", str(record.msg))
    return True


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (batch sizes, steps), with a message naming the value."""
    return _positive(text, int, "a whole number >= 1")


def positive_float(text: str) -> float:
    """argparse type for amounts that must be > 0 (learning rates, sizes), with a message naming the value."""
    return _positive(text, float, "a number > 0")


def _positive(text: str, kind, words: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be {words}, got {value}")
    return value


def steps_or_epoch(text: str) -> int | str:
    """argparse type for ``--checkpointing_steps``: a number of optimizer steps, or ``epoch``."""
    return "epoch" if text == "epoch" else positive_int(text)


def add_reliability_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every recipe shares for surviving a long run: checkpoints, resume, the collective timeout, and saving
    on machines without a shared disk (one definition, so their names, defaults and help agree everywhere)."""
    group = parser.add_argument_group("checkpoints and reliability")
    group.add_argument(
        "--checkpointing_steps",
        type=steps_or_epoch,
        default=None,
        help="Save a resumable checkpoint to output_dir/checkpoints/step_N every N optimizer steps, or 'epoch'.",
    )
    group.add_argument(
        "--checkpoints_total_limit",
        type=positive_int,
        default=None,
        help="Keep only the newest N complete checkpoints (default: all; each save prints its size).",
    )
    group.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help="A checkpoint folder, or 'latest' (newest complete one under output_dir/checkpoints; "
        "starts fresh if there is none).",
    )
    group.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="Write into an --output_dir that holds an earlier run's model, results or checkpoints "
        "(refused otherwise, unless resuming).",
    )
    group.add_argument(
        "--save_on_each_node",
        action="store_true",
        help="Machines without a shared disk: every machine saves its own copy of each checkpoint.",
    )
    group.add_argument(
        "--dist_timeout",
        type=positive_float,
        default=600,
        help="Seconds any collective may wait for the other processes before the run fails with an "
        "error naming it (tools/hang_dump.py, put before the recipe, writes stacks to output_dir/debug/).",
    )


def check_process_count(accelerator: Accelerator) -> None:
    """Fail loudly if the launcher started N processes (``WORLD_SIZE``) but the Accelerator joined fewer: each would
    train alone on the full data set (the trap above). Stop before any work is wasted."""
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:
        raise RecipeError(
            f"The launcher started {expected} processes (WORLD_SIZE={expected}) but the Accelerator sees "
            f"{accelerator.num_processes} (distributed_type={accelerator.distributed_type.value}), so every process "
            "would train alone on the full data set and the results would be silently wrong. On a machine without "
            "CUDA build the Accelerator with cpu=True (shared.runtime.build_accelerator does) or export "
            "ACCELERATE_USE_CPU=1; on a GPU machine check that the GPUs are visible (CUDA_VISIBLE_DEVICES, "
            "nvidia-smi)."
        )


def stop_if_found(problem: str | None, cleanup=None) -> None:
    """Stop every process if any of them found ``problem`` (a paragraph; None: nothing wrong), printed once, by the
    main process, after ``cleanup()`` if given. A collective, after the Accelerator is built: a problem one machine
    alone sees (on its own disk) stops the others too."""
    state = PartialState()
    problems = gather_object([problem]) if state.num_processes > 1 else [problem]
    found = next((found for found in problems if found), None)
    if found:
        if cleanup is not None:
            cleanup()
        raise RecipeError(found, printed=state.is_main_process)


def set_stop_with_launcher() -> None:
    """Have Linux kill this process (SIGKILL) when its launcher dies, however it died. A launcher killed with SIGKILL
    (the OOM killer, a job's time limit, ``kill -9``) cannot stop its workers: they would train on as orphans, holding
    the GPUs and writing checkpoints. Only under torchrun (``accelerate launch`` with 2+ processes runs it inside) or
    Accelerate's 1-process launcher, known by the variables they set; a no-op elsewhere (``python recipe.py`` belongs
    to its shell; macOS and Windows have no such call)."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ
    if launched and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)


def distributed_backend(cpu: bool) -> str:
    """The one backend rule of every recipe: NCCL between GPUs, gloo between CPU processes (Accelerate would take MPI
    on CPU when torch has it; gloo is in every torch build), and gloo beside NCCL for an FSDP config that keeps tensors
    on the CPU (offload, full state dict), as Accelerate's PartialState does; results.json: ``distributed/backend``."""
    offload, state_dict = os.environ.get("FSDP_OFFLOAD_PARAMS", "false"), os.environ.get("FSDP_STATE_DICT_TYPE")
    cpu_tensors = offload.lower() == "true" or state_dict == "FULL_STATE_DICT"
    return "gloo" if cpu else "cuda:nccl,cpu:gloo" if fsdp_launch_config() and cpu_tensors else "nccl"


def init_group_after_restart(cpu: bool, dist_timeout: float | None = None) -> None:
    """After ``accelerate launch --max_restarts N`` restarted the workers, join them under fresh store keys: torchrun's
    static rendezvous hands them the *same* TCPStore as the crashed attempt, with no per-attempt prefix (torch 2.13):
    a worker can read a dead peer's address (gloo: ``connectFullMesh ... Connection refused``; NCCL can hang). A group
    created here under a ``restart_<n>`` prefix gives every attempt its own keys; Accelerate then uses it."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    timeout = {"timeout": timedelta(seconds=dist_timeout)} if dist_timeout is not None else {}
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = torch.distributed.TCPStore(address, port, is_master=False, **timeout)
    store = torch.distributed.PrefixStore(f"two_gpu_recipes/restart_{restart}", agent_store)
    torch.distributed.init_process_group(
        backend=distributed_backend(cpu),
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        **timeout,
    )


def set_gpu_index() -> None:
    """One process on a GPU: Accelerate's device would be ``torch.device("cuda")``, with no index (several processes
    get cuda:<local rank>); torch.cuda.set_device refuses it, and results would name the GPU "cuda" here and "cuda:0"
    there. Sets ``ACCELERATE_TORCH_DEVICE`` (Accelerate's own override of the device it picks) to cuda:<current>,
    before the Accelerator is built. A no-op without CUDA or with several processes."""
    if torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if os.environ.get("ACCELERATE_TORCH_DEVICE", "cuda") == "cuda" and not os.environ.get("ACCELERATE_USE_CPU"):
            os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{torch.cuda.current_device()}"


def build_accelerator(dist_timeout: float | None = None, **accelerator_kwargs) -> Accelerator:
    """An Accelerator on CUDA when present and on the CPU over gloo otherwise, checked for size. Keyword arguments go
    to ``Accelerator``; ``cpu`` defaults to "no CUDA here" (a 2-process MULTI_GPU config then runs real DDP over gloo).
    ``dist_timeout`` (seconds) bounds every collective: a hung or dead peer fails the others after that long, with an
    error naming the collective, instead of the backend's default (10 minutes for NCCL, 30 for gloo). Building it
    starts the process group (a collective) under a multi-process launch, and on a GPU makes the Accelerator's device
    the current CUDA device (``torch.cuda.set_device``)."""
    cpu = accelerator_kwargs.setdefault("cpu", not torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (a backend given to 1 process makes Accelerate start a group)
        timeout = {"timeout": timedelta(seconds=dist_timeout)} if dist_timeout is not None else {}
        handlers = list(accelerator_kwargs.pop("kwargs_handlers", None) or [])
        handlers.append(InitProcessGroupKwargs(backend=distributed_backend(cpu), **timeout))
        accelerator_kwargs["kwargs_handlers"] = handlers
    init_group_after_restart(cpu=cpu, dist_timeout=dist_timeout)
    if not cpu and accelerator_kwargs.get("dataloader_config") is not None:
        # A prepared loader then copies each batch to the GPU with non_blocking=True. From the pinned memory the
        # recipes' loaders use on a GPU, the copy is queued behind the running step; from pageable memory CUDA would
        # first wait for the GPU to finish everything queued: a sync point in every step. (A copy: the caller's
        # configuration stays as it was.)
        accelerator_kwargs["dataloader_config"] = dataclasses.replace(
            accelerator_kwargs["dataloader_config"], non_blocking=True
        )
    accelerator = Accelerator(**accelerator_kwargs)
    check_process_count(accelerator)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # Accelerate has no fp16 autocast on the CPU: the run would be fp32 throughout, recorded as fp16.
        stop_if_found(
            "Mixed precision fp16 (--mixed_precision fp16, or the launch config's "
            "mixed_precision) does nothing on the CPU this run uses: Accelerate has no fp16 autocast there, "
            "so it would train in fp32 and record fp16. Pass --mixed_precision bf16 (autocast on the CPU "
            "too) or --mixed_precision no, or run fp16 on a CUDA GPU."
        )
    if accelerator.device.type == "cuda" and accelerator.device.index is not None:
        # Object collectives under NCCL (gather_object, the pipeline's state-dict gather) go through the *current* CUDA
        # device: unset, every rank uses cuda:0, or hangs. Accelerate sets it when it starts the group; this line also
        # covers a group started by init_group_after_restart.
        torch.cuda.set_device(accelerator.device)
    return accelerator


@contextlib.contextmanager
def main_process_alone(accelerator: Accelerator):
    """The main process works alone inside the ``with`` block (merging a 13B model, pretraining a base model:
    minutes), and the other processes wait for it at the end, with no time limit. ``wait_for_everyone`` would bound
    that wait by ``--dist_timeout`` (600 s by default: long enough for any collective, too short for a merge) and kill
    a run that was only slow. The wait is a barrier of a gloo group made for it with a week's timeout (gloo needs no
    GPU memory). If the main process fails instead, it exits, and the launcher stops the others."""
    several = accelerator.num_processes > 1 and torch.distributed.is_initialized()
    # Sync point: making a group is a collective, before the main process goes off on its own.
    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(days=7)) if several else None
    yield  # (no finally: a main process that failed must not release the others into its missing output)
    if group is not None:
        torch.distributed.barrier(group=group)  # sync point: the others wait here, untimed, for the main one
        torch.distributed.destroy_process_group(group)


def fsdp_launch_config() -> bool:
    """True when the launch config asks for FSDP (``accelerate launch`` sets ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def set_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Make a ``cpu=True`` Accelerator launched with an FSDP config run FSDP2, as on GPUs. With ``cpu=True``
    Accelerate (1.16) sets MULTI_CPU and drops the FSDP config: plain DDP, while the run looked like FSDP. torch's
    ``fully_shard`` and Accelerate's FSDP2 code work over gloo, so this sets the state a GPU launch gets (FSDP, with
    the config's plugin): the CPU tests then run Accelerate's own FSDP2 preparation, clipping, sharded checkpoints and
    state-dict gathering, the code a GPU run uses. The price: two attributes of Accelerate's state, checked after.
    A no-op unless the Accelerator runs on the CPU under an FSDP launch config."""
    if accelerator.device.type != "cpu" or not fsdp_launch_config():
        return
    plugin = FullyShardedDataParallelPlugin()  # read from the launch config's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise RecipeError(
            f"On CPU only FSDP version 2 runs (torch's fully_shard over gloo); the launch config has "
            f"fsdp_version {plugin.fsdp_version}. Use accelerate_configs/fsdp_2gpu.yaml."
        )
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)  # what AcceleratorState does on GPUs
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # the offload config, unpinned (pinned memory needs a GPU)
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # collectives read it from here
    if not accelerator.is_fsdp2:
        raise RecipeError(
            "Could not switch Accelerate to FSDP2 on CPU (this Accelerate version keeps its state "
            "differently); run the FSDP config on GPUs, or use accelerate==1.16.0 from "
            "requirements.txt."
        )


# How the model is trained (``single``, ``ddp``, ``fsdp``, ``device_map``, ``pipeline``), and why.
Parallelism = namedtuple("Parallelism", "name reason")


def fused_adamw(accelerator: Accelerator) -> bool:
    """AdamW fused (one kernel updates a device's parameters; transformers' and TRL's default) except with fp16's
    GradScaler: there torch's fused step copies the scale to CPU parameters without waiting (a split over cuda:0 +
    CPU, offload), and Accelerate cannot tell a skipped step (the schedule would advance on it)."""
    return accelerator.mixed_precision != "fp16"


def choose_parallelism(accelerator: Accelerator, requested: str, recipe: str, compile: bool = False) -> Parallelism:
    """The parallelism ``--parallelism`` (``auto``: what the launch config implies) and the launch give, or a
    one-paragraph error for a combination that cannot work. ``auto``: an FSDP config gives ``fsdp``; 2+ processes
    ``ddp``; one process that sees 2+ GPUs ``device_map`` (Accelerate refuses to train a device_map model in a
    distributed mode: ``model_sharding_2gpu.yaml`` is a 1-process ``'NO'`` config); otherwise ``single``.
    ``compile``: --compile was asked for, which needs a model that ``prepare()`` wraps whole (not a device_map)."""
    processes = accelerator.num_processes
    fsdp = accelerator.distributed_type == DistributedType.FSDP or fsdp_launch_config()
    gpus = torch.cuda.device_count() if accelerator.device.type == "cuda" else 0
    why = "the launch config" if requested == "auto" else f"--parallelism {requested}"
    if requested == "auto":
        requested = "fsdp" if fsdp else "ddp" if processes > 1 else "device_map" if gpus >= 2 else "single"
    config = CONFIG_FOR.get(requested, CONFIG_FOR["single"])
    launch = f"accelerate launch --config_file accelerate_configs/{config} {recipe}"
    if requested == "fsdp" and not fsdp:
        raise RecipeError(
            f"--parallelism fsdp needs the FSDP launch config, which says how to shard (this launch is "
            f"{accelerator.distributed_type.value}): {launch}"
        )
    if requested != "fsdp" and fsdp:
        raise RecipeError(
            f"The launch config is FSDP but --parallelism is {requested}: FSDP is not combined with {requested} here "
            f"(Accelerate would shard the model anyway). Use --parallelism fsdp (or auto), or launch {requested} "
            f"with its own config: {launch}"
        )
    if requested == "device_map" and processes > 1:
        raise RecipeError(
            f"--parallelism device_map splits the model inside one process, but this launch has {processes} "
            "processes: Accelerate refuses to train a device_map model in a distributed mode (and each process "
            f"would hold its own split copy). Launch it with 1 process: {launch} (on a CPU-only machine too)."
        )
    if compile and requested == "device_map":
        raise RecipeError(
            "--compile works on a model prepare() wraps whole (single, ddp, fsdp), not on a device_map: "
            "leave --compile out, or launch another way."
        )
    if requested in ("ddp", "pipeline") and processes < 2:
        what = (
            "A pipeline runs one stage per process"
            if requested == "pipeline"
            else "--parallelism ddp needs 2 or more processes"
        )
        raise RecipeError(
            f"{what}, but this launch has {processes} process. Launch it with 2: {launch} (on a "
            "CPU-only machine too: 2 gloo processes)."
        )
    on_cpu = 'two CPU "devices" (the GPU code path: same hooks, not faster)'
    devices = f"{gpus} GPUs" if gpus >= 2 else "1 GPU and the CPU" if gpus == 1 else on_cpu
    one_process = " (1 process: FSDP2's full code path, nothing to shard over)" if processes == 1 else ""
    reason = {
        "fsdp": f"{processes} process(es), each holding 1/{processes} of every parameter, gradient and optimizer "
        f"state{one_process}",
        "ddp": f"{processes} processes ({accelerator.distributed_type.value}), each a full replica, gradients "
        "averaged",
        "device_map": f"1 process, the model split over {devices}",
        "pipeline": f"{processes} processes, one pipeline stage each",
        "single": f"1 process on {accelerator.device}",
    }[requested]
    return Parallelism(requested, f"{reason} ({why})")


def prepare_output_dir(path: str | os.PathLike, overwrite: bool, resuming: str | None) -> Path:
    """``path`` as a Path, checked: a folder that holds an earlier run's model, results or checkpoints is refused
    unless ``overwrite`` (--overwrite_output_dir) or ``resuming`` (the Hub scripts' rule), and one that cannot be
    created or written to is refused. It is created by the first save into it (a run that fails before that leaves
    no empty folder behind). A collective; a problem is one paragraph, printed once."""
    output_dir, problem = Path(path), None
    found = [name for name in RUN_OUTPUTS if (output_dir / name).is_file()]
    found += ["checkpoints/"] if any((output_dir / "checkpoints").glob("step_*")) else []
    if found and not (overwrite or resuming):
        problem = (
            f"--output_dir {str(path)!r} already holds an earlier run's output ({', '.join(found)}), which "
            "this run would overwrite. Pass --overwrite_output_dir to replace it, --resume_from_checkpoint "
            "latest to continue that run, or another --output_dir."
        )
    existing = next(folder for folder in [output_dir, *output_dir.absolute().parents] if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "is not a folder" if not existing.is_dir() else "is not writable"
        problem = (
            f"Cannot use --output_dir {str(path)!r}: {existing} {why}. Pass a folder you can write to; it is "
            "created if missing."
        )
    stop_if_found(problem)
    return output_dir


def model_problem(model_name_or_path: str) -> str | None:
    """What is wrong with ``--model_name_or_path`` as a local folder, or None (a folder with config.json, or a Hub
    name): a path that does not exist, or a folder without config.json (transformers would say only that it "should
    have a `model_type` key in its config.json"), named with what the folder holds."""
    name, folder = model_name_or_path, Path(model_name_or_path).expanduser()
    windows = os.sep == "\\" and "\\" in name
    if (folder.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1 or windows) and not folder.exists():
        return (
            f"--model_name_or_path {name!r} does not exist. Pass a folder with config.json and weights, or a Hub name."
        )
    if not folder.is_dir() or (folder / "config.json").is_file():
        return None
    held = sorted(path.name for path in folder.iterdir())
    adapter = ": this one holds a LoRA adapter; its base is adapter_config.json's base_model_name_or_path"
    return (
        f"--model_name_or_path {name!r} holds no config.json (it holds: {', '.join(held[:8]) or 'nothing'}), so "
        "transformers cannot tell which model to build. Pass the folder save_pretrained wrote (config.json beside the "
        f"weights), or a Hub name{adapter if 'adapter_config.json' in held else ''}."
    )


def tokenizer_problem(model_name_or_path: str, tokenizer_name: str | None) -> str | None:
    """What is wrong with the tokenizer a run would load (``tokenizer_name``, else the model's own), or None: a local
    folder without tokenizer files. transformers would load some tokenizer anyway (a 5-token one that reads every
    word as [UNK], or a traceback about sentencepiece)."""
    source = tokenizer_name or model_name_or_path
    folder = Path(source).expanduser()
    if not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    flag = "--tokenizer_name" if tokenizer_name else "--model_name_or_path"
    held = ", ".join(sorted(path.name for path in folder.iterdir())[:8]) or "nothing"
    return (
        f"{flag} {source!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...; it holds: "
        f"{held}), so the text cannot be turned into the tokens the model was trained on. Pass --tokenizer_name "
        "with the folder or Hub name of the model's tokenizer (e.g. the model it was fine-tuned from), or save "
        f"the tokenizer into {source!r} (tokenizer.save_pretrained)."
    )
