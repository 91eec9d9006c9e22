"""Every recipe that saves: nothing is lost when a save fails, and nothing is overwritten unasked. An ``--output_dir``
holding an earlier run is refused once and left as it was; a run refused before training leaves no empty folder; a
disk that fills up during the run (a tmpfs of its own, filled once the first checkpoint is complete) stops the run with
one paragraph saying what failed, the space, the checkpoint that survives and how to resume, and leaves the earlier
output and that checkpoint as they were. Ctrl-C in a 2-process run (SIGINT to the launcher's process group, as a
terminal sends it) ends like SIGTERM: the step, a checkpoint, one line."""

import contextlib
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness.launch import ONE_PROCESS, Job, Launch, launch, launch_all

from .catalogue import RECIPE_NAMES, TWO_PROCESSES, flags, tiny_args, tiny_models, tiny_run

SAVING = [name for name in RECIPE_NAMES if "--output_dir" in flags(name)]
CHECKPOINTING = [name for name in SAVING if "--checkpointing_steps" in flags(name)]
EARLIER = {  # what an earlier run left: its results, weights and config
    "results.json": '{"eval/accuracy": 0.9}\n',
    "model.safetensors": "an earlier run's weights",
    "config.json": '{"model_type": "an earlier run\'s"}\n',
}


def errors(output: str) -> list[str]:
    """The error lines the recipe's processes printed: a line, or a progress bar's last update (\\r) that a line
    followed on the same line (not the launcher's quotes of them, "  traceback : error: ...")."""
    found = [re.match(r"^(?:.*\])?\s*((?:\[rank \d+\] )?error: .*)$", part) for part in re.split(r"[\r\n]", output)]
    return [match.group(1) for match in found if match]


def traced_through_a_recipe(output: str) -> bool:
    return bool(re.search(r'File "[^"]*/recipes/[^"]*", line \d+', output))


def earlier_run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, text in EARLIER.items():
        (folder / name).write_text(text)
    return folder


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "64m"):
    """A tmpfs of ``size`` at ``folder`` (root only: mount), unmounted after."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small disk needs mount -t tmpfs (root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(disk: Path) -> None:
    """Write zeros to ``disk`` until it is full (a run's checkpoints may have filled it already)."""
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:
        while True:
            filler.write(bytes(2**20))
            filler.flush()


def disk_full_run(name: str, models: dict, disk: Path) -> dict:
    """``name`` in 2 processes into ``disk/out``, over an earlier run's output (--overwrite_output_dir), the disk
    filled once the first checkpoint is complete: the next save fails."""
    args, out = tiny_args(name, models), earlier_run(disk / "out")
    steps = "100000" if name == "linear_toy.py" else "1000"  # many steps: a save comes after the disk is full
    args = (*args, "--max_train_steps", steps, "--checkpointing_steps", "1" if name != "linear_toy.py" else "50")
    two = TWO_PROCESSES.get(name, "ddp_2gpu.yaml")
    run = Launch(two, name, *args, "--output_dir", out, "--overwrite_output_dir", forked=True)  # nothing signals it
    deadline = time.monotonic() + 300
    while not list((out / "checkpoints").glob("step_*/progress.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    fill(disk)
    finished = run.finish()
    return {"run": finished, "out": out, "left": sorted(path.name for path in out.rglob("*") if ".tmp" in path.name)}


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("saves")
    models = tiny_models(root)
    with contextlib.ExitStack() as disks:
        mounted = {name: disks.enter_context(small_disk(root / f"disk_{Path(name).stem}")) for name in CHECKPOINTING}
        with ThreadPoolExecutor(max_workers=2) as pool:
            found = pool.map(lambda name: disk_full_run(name, models, mounted[name]), CHECKPOINTING)
            results = dict(zip(CHECKPOINTING, found))
        for result in results.values():  # what is left on disk, read before the disks go
            result["earlier"] = {name: (result["out"] / name).read_text() for name in EARLIER}
            result["checkpoints"] = {
                folder.name: sorted(path.name for path in folder.iterdir())
                for folder in (result["out"] / "checkpoints").glob("step_*")
            }
        return results


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTING)
def test_a_full_disk_stops_the_run_with_one_paragraph_and_loses_nothing(disk_full, name):
    result = disk_full[name]
    run = result["run"]
    assert run.returncode != 0, str(run)
    printed = errors(run.output)
    assert len(printed) == 1, str(run)  # once, by the main process
    assert "No space left on device" in printed[0] and " free" in printed[0], printed[0]
    survivor = re.search(r"newest (?:complete )?checkpoint is (\S+/checkpoints/step_\d+)", printed[0])
    assert survivor and "--resume_from_checkpoint latest" in printed[0], printed[0]
    survivor = Path(survivor.group(1).rstrip(";:."))
    assert "progress.json" in result["checkpoints"][survivor.name], result["checkpoints"]
    assert result["earlier"] == EARLIER  # the earlier run's output, as it was
    assert not result["left"], f"half-written copies left behind: {result['left']}"
    assert not traced_through_a_recipe(run.output), str(run)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Per recipe: a launch into a folder holding an earlier run, and one refused before training (a checkpoint
    that does not exist) into a folder that does not exist yet. One process each (the toy's refusals through its
    launcher), each refusal printed by the main process."""
    root = tmp_path_factory.mktemp("refusals")
    models = tiny_models(root)
    jobs, paths = {}, {}
    for name in SAVING:
        args, config = tiny_args(name, models), TWO_PROCESSES.get(name, ONE_PROCESS)
        used, fresh = earlier_run(root / Path(name).stem / "used"), root / Path(name).stem / "new" / "out"
        jobs[name, "used"] = Job(config, name, (*args, "--output_dir", used))
        refused = (*args, "--output_dir", fresh, "--resume_from_checkpoint", root / "none")
        jobs[name, "fresh"] = Job(config, name, refused)
        paths[name] = (used, fresh)
    runs = launch_all(jobs)  # two at a time: each is mostly a process starting
    return {name: {"used": runs[name, "used"], "fresh": runs[name, "fresh"], "paths": paths[name]} for name in SAVING}


@pytest.mark.slow
@pytest.mark.parametrize("name", SAVING)
def test_an_output_dir_holding_an_earlier_run_is_refused_once_and_left_alone(refusals, name):
    run, (used, _) = refusals[name]["used"], refusals[name]["paths"]
    assert run.returncode != 0, str(run)
    printed = errors(run.output)
    assert len(printed) == 1 and f"--output_dir '{used}' already holds an earlier run's output" in printed[0], str(run)
    assert "--overwrite_output_dir" in printed[0]
    assert {path.name: path.read_text() for path in used.iterdir()} == EARLIER


@pytest.mark.slow
@pytest.mark.parametrize("name", SAVING)
def test_a_run_refused_before_training_leaves_no_folder_behind(refusals, name):
    run, (_, fresh) = refusals[name]["fresh"], refusals[name]["paths"]
    assert run.returncode != 0 and len(errors(run.output)) == 1, str(run)
    assert not fresh.exists() and not fresh.parent.exists(), sorted(fresh.parent.rglob("*"))


@pytest.mark.slow
def test_ctrl_c_in_a_2_process_run_ends_the_step_saves_and_says_so_in_one_line(tmp_path):
    """A terminal's Ctrl-C reaches the launcher's process group; torchrun passes SIGINT on to its workers. Each printed
    a KeyboardInterrupt traceback, and nothing said which checkpoint to resume from."""
    out = tmp_path / "run"  # train_lm.py builds its own tiny model: no saved one to pass
    args = (*tiny_args("train_lm.py", {"llama": "", "bert": ""}), "--max_train_steps", "1000", "--output_dir", out)
    run = Launch("ddp_2gpu.yaml", "train_lm.py", *args)
    deadline = time.monotonic() + 300
    while not list((out / "checkpoints").glob("step_*/progress.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(os.getpgid(run.process.pid), signal.SIGINT)
    finished = run.finish()
    assert finished.returncode == 128 + signal.SIGINT, str(finished)
    stopped = re.findall(
        r"^stopped by SIGINT after step (\d+): saved the checkpoint (\S+)\. Resume with (.*)$",
        finished.output,
        re.MULTILINE,
    )
    assert len(stopped) == 1 and "--resume_from_checkpoint latest" in stopped[0][2], str(finished)
    assert (Path(stopped[0][1]) / "progress.json").is_file()
    assert "KeyboardInterrupt" not in finished.output and not traced_through_a_recipe(finished.output), str(finished)


@pytest.mark.slow
def test_a_full_disk_at_the_final_save_keeps_the_earlier_output(tmp_path):
    """The issue's case: output on a tmpfs that holds the tokenizer train_lm.py saves first but not the model. The
    final save failed with two SafetensorError tracebacks and left config.json alone, the earlier run's model gone;
    it goes to a temporary folder and is refused in one paragraph, the earlier run's files as they were."""
    with small_disk(tmp_path / "disk", size="1m") as disk:
        out = earlier_run(disk / "out")
        args = (*tiny_run("train_lm.py", {"llama": "", "bert": ""}), "--max_train_steps", "12")  # and no checkpoint
        run = launch(ONE_PROCESS, "train_lm.py", *args, "--output_dir", out, "--overwrite_output_dir")
        left = {path.name: path.read_text() for path in out.iterdir() if path.name in EARLIER}
        tmp = [path.name for path in out.rglob("*") if ".tmp" in path.name]
    assert run.returncode != 0, str(run)
    printed = errors(run.output)
    assert len(printed) == 1, str(run)
    assert f"Saving the trained model to {out} failed: No space left on device (it needs about" in printed[0]
    assert "no complete checkpoint holds this run's training" in printed[0], printed[0]
    assert "--resume_from_checkpoint latest" in printed[0] and not traced_through_a_recipe(run.output)
    assert left == EARLIER and not tmp, (left, tmp)
