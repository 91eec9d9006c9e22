"""Every recipe that resumes (``--resume_from_checkpoint``): SIGTERM sent to the launcher of a 2-process run (what
SLURM, Kubernetes and spot machines do before they kill; the workers get it through the launcher) ends the step,
saves a checkpoint, says which and how to resume, exits 143; resumed with ``latest`` in another process count, past a
damaged newer checkpoint that it skips and names, the run ends where the uninterrupted run ends (every loss and saved
weight within 1e-6), and resumed once more from the checkpoint of its last step it trains no step more; resumed with
another ``--seed`` (another data order, other held-out samples), another ``--learning_rate`` (which the
checkpoint's optimizer would override, while results.json recorded it), another number of training examples (another
shuffle), another LoRA adapter or other trained tokens (``--no-assistant_only_loss``; also over a checkpoint saved
before that was recorded, which trained the default) it is refused. A run checkpoints its last step too, once, also
where ``--checkpointing_steps`` N (or ``epoch``) does not end there, so that a requeue (the same command, resuming
``latest``) of a finished run trains nothing again, and keeps what the run measured in its own process count (in
another it writes null)."""

import json
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
from harness.launch import ONE_PROCESS, Launch, Run, launch, read_results
from safetensors.numpy import load_file

from .catalogue import LAYOUTS, OPT_OUTS, RECIPE_NAMES, TWO_PROCESSES, flags, max_train_steps, offering, tiny_args
from .catalogue import checkpoints_by_epoch, one_epoch_args, tiny_models

RESUMING = [name for name in RECIPE_NAMES if "--resume_from_checkpoint" in flags(name)] + list(LAYOUTS)
BY_EPOCH = [name for name in RECIPE_NAMES if "--resume_from_checkpoint" in flags(name) and checkpoints_by_epoch(name)]
STARTED_FOR_SIGTERM = "train_lm.py"
RERATED = "0.123"  # a --learning_rate no recipe trains with by default
# A training set a few examples smaller than the tiny run's, and what the refusal names. Its batches per epoch stay
# as many (the LM corpus aside): a check of the steps per epoch alone would let it through.
RESIZED = {"linear_toy.py": ("--num_samples", "4000"), "train_lm.py": ("--corpus_max_mb", "0.49")}
RESIZED |= {"pipeline_lm.py": RESIZED["train_lm.py"], "transformer_finetune.py": ("--max_train_samples", "62")}
RESIZED |= {"llm_finetune.py": ("--max_train_samples", "47"), "dpo.py": ("--max_train_samples", "47")}
RESIZED |= {"grpo.py": ("--max_train_samples", "31")}
# Another adapter over a LoRA checkpoint (the fine-tune's tiny run trains every weight: there, a new one).
READAPTED = {"transformer_finetune.py": ("--lora_r", "4")}
# A checkpoint's record (progress.json's "unchanged") before it held this key: an earlier version's checkpoint.
ADDED_TO_THE_RECORD = "assistant_only_loss"
STOPPED = re.compile(r"^stopped by SIGTERM after step (\d+): .*?(/\S+/checkpoints/step_\d+)(.*)$", re.MULTILINE)


def ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stopped_by(signal_number: int, config: str, script: str, *args, output_dir: Path, launch_args=(), forked=False):
    """A 2-process launch, sent ``signal_number`` (to the launcher alone, as SLURM does) once its first checkpoint is
    complete. ``forked``: the launcher and its workers are forks of the zygotes (the launcher passes the signal on to
    its workers' forked_python, which passes it to the worker), else started."""
    run = Launch(config, script, *args, "--output_dir", output_dir, launch_args=launch_args, forked=forked)
    launcher = psutil.Process(run.forked.pid if run.forked else run.process.pid)
    for _ in range(3000):  # up to 5 minutes
        if list((output_dir / "checkpoints").glob("step_*/progress.json")):
            launcher.send_signal(signal_number)
            break
        if ended(launcher):
            break
        __import__("time").sleep(0.1)
    return run.finish()


def damage_a_newer_copy(checkpoints: Path) -> Path:
    """A copy of the newest complete checkpoint as the next step's, its largest file truncated: what a full disk or a
    bad copy leaves, newer than the good one."""
    newest = max(checkpoints.glob("step_*/progress.json"), key=lambda path: int(path.parent.name[5:])).parent
    number = re.search(r"\d+$", newest.name).group()
    damaged = newest.with_name(newest.name[: -len(number)] + str(int(number) + 1).zfill(len(number)))
    shutil.copytree(newest, damaged)
    progress = json.loads((damaged / "progress.json").read_text())
    if "completed_steps" in progress:
        progress["completed_steps"] += 1
    else:  # the toy counts its steps by its loss curve
        progress["loss_curve"].append(progress["loss_curve"][-1])
    (damaged / "progress.json").write_text(json.dumps(progress))
    # Not the random states: Accelerate's load_state loads them or warns and goes on (its own fallback).
    files = [path for path in damaged.rglob("*") if path.is_file() and not path.name.startswith(("random_", "prog"))]
    largest = max(files, key=lambda path: path.stat().st_size)
    with open(largest, "r+b") as file:
        file.truncate(largest.stat().st_size // 2)
    return damaged


def forget_in_the_record(output_dir: Path, key: str) -> None:
    """Every checkpoint of ``output_dir`` as a version that did not record ``key`` saved it (no manifest lists
    progress.json, which holds the record)."""
    for progress in (output_dir / "checkpoints").glob("step_*/progress.json"):
        saved = json.loads(progress.read_text())
        saved["unchanged"].pop(key, None)
        progress.write_text(json.dumps(saved))


def scenario(name: str, models: dict, root: Path) -> dict:
    """The launches of one recipe (or one of its ``LAYOUTS``), in order: uninterrupted, stopped, damaged and resumed,
    refused."""
    folder, layout = root / re.sub(r"\W+", "_", name), LAYOUTS.get(name)
    (name, *_), (flags_of_layout, count, other_count) = name.split(), layout or ((), (), ())
    args, two = (*tiny_args(name, models), *flags_of_layout), TWO_PROCESSES.get(name, "ddp_2gpu.yaml")
    other = two if ("resume_in_another_process_count", name) in OPT_OUTS or layout else "single_gpu.yaml"
    skips = ("damaged_checkpoint_skipped", name) not in OPT_OUTS
    runs = {"uninterrupted": launch(two, name, *args, "--output_dir", folder / "uninterrupted", launch_args=count)}
    # One recipe's launcher and workers are started, as a user's are; the others' are forks (no imports to wait for).
    stopped = dict(output_dir=folder / "stopped", launch_args=count, forked=name != STARTED_FOR_SIGTERM)
    runs["stopped"] = stopped_by(signal.SIGTERM, two, name, *args, **stopped)
    resume = (*args, "--output_dir", folder / "stopped", "--resume_from_checkpoint", "latest")
    runs["damaged"] = damage_a_newer_copy(folder / "stopped" / "checkpoints") if skips else None
    runs["resumed"] = launch(other, name, *resume, launch_args=other_count)
    # The uninterrupted run requeued: resumed again, from the checkpoint of its last step.
    shutil.copytree(folder / "uninterrupted", folder / "finished")
    older = f"--{ADDED_TO_THE_RECORD}" in flags(name)
    if older:  # requeued as an earlier version's checkpoint: resumed with the default it was trained with
        forget_in_the_record(folder / "finished", ADDED_TO_THE_RECORD)
    again = (*args, "--output_dir", folder / "finished", "--resume_from_checkpoint", "latest")
    runs["resumed_again"] = launch(other, name, *again, launch_args=other_count)
    reseeded = (ONE_PROCESS if other == "single_gpu.yaml" else other, name, *resume, "--seed", "7")
    runs["reseeded"] = launch(*reseeded, launch_args=other_count)
    runs["rerated"] = launch(*reseeded[:-2], "--learning_rate", RERATED, launch_args=other_count)
    runs["resized"] = launch(*reseeded[:-2], *RESIZED[name], launch_args=other_count)
    if "--lora_alpha" in flags(name):
        readapted = READAPTED.get(name, ("--lora_alpha", "32"))
        runs["readapted"] = launch(*reseeded[:-2], *readapted, launch_args=other_count)
    if older:  # the other choice of the trained tokens, over this version's checkpoint and an earlier one's
        runs["relabelled"] = launch(*reseeded[:-2], f"--no-{ADDED_TO_THE_RECORD}", launch_args=other_count)
        relabelled_older = (*reseeded[:2], *again, f"--no-{ADDED_TO_THE_RECORD}")
        runs["relabelled_older"] = launch(*relabelled_older, launch_args=other_count)
    if not skips:  # refused in one line instead: a damaged newest checkpoint, another process count
        runs["damaged"] = damage_a_newer_copy(folder / "stopped" / "checkpoints")
        runs["damaged_refused"] = launch(two, name, *resume)
    if other == two and name == "linear_toy.py":
        runs["other_count_refused"] = launch(ONE_PROCESS, name, *resume)
    # A shorter run over a longer one's folder, of a step count --checkpointing_steps does not divide, keeping 2.
    short = ("--max_train_steps", short_steps(name))
    short += ("--checkpoints_total_limit", 2) if "--checkpoints_total_limit" in flags(name) else ()
    shutil.copytree(folder / "uninterrupted", folder / "replaced")
    replacing = (*args, *map(str, short), "--output_dir", folder / "replaced")
    config, processes = (two, count) if layout else (other, other_count)  # (a fresh split run: its 3 processes)
    runs["replacing"] = launch(config, name, *replacing, "--overwrite_output_dir", launch_args=processes)
    runs["replacing_results"] = read_results(folder / "replaced") if runs["replacing"].returncode == 0 else None
    runs["requeued"] = launch(config, name, *replacing, "--resume_from_checkpoint", "latest", launch_args=processes)
    if checkpoints_by_epoch(name) and not layout:  # one epoch checkpointed by epoch, then requeued
        alone, one_epoch = ONE_PROCESS if name not in TWO_PROCESSES else two, one_epoch_args(name, models)  # (stages)
        one_epoch += ("--output_dir", folder / "one_epoch")
        runs["one_epoch"] = launch(alone, name, *one_epoch)
        runs["one_epoch_results"] = read_results(folder / "one_epoch") if runs["one_epoch"].returncode == 0 else None
        runs["one_epoch_requeued"] = launch(alone, name, *one_epoch, "--resume_from_checkpoint", "latest")
    runs["folder"] = folder
    print({key: round(run.seconds, 1) for key, run in runs.items() if isinstance(run, Run)})
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    models = tiny_models(root)
    with ThreadPoolExecutor(max_workers=2) as pool:  # two recipes at a time: a 2-core machine kept busy
        return dict(zip(RESUMING, pool.map(lambda name: scenario(name, models, root), RESUMING)))


def short_steps(name: str) -> int:
    """The steps of the run that replaces the uninterrupted one: not a multiple of its --checkpointing_steps."""
    return 130 if name == "linear_toy.py" else 5


def checkpointed_steps(output_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in ``output_dir/checkpoints``, in order."""
    return sorted(int(path.parent.name[5:]) for path in (output_dir / "checkpoints").glob("step_*/progress.json"))


def saves_of(step: int, output: str) -> int:
    """How many times the run printed that it saved the checkpoint of ``step`` (the toy saves without a line)."""
    return len(re.findall(rf"saved checkpoint \S+/step_0*{step} \(", output))


def errors(output: str) -> list[str]:
    """The error lines the recipe's processes printed: a line, or a progress bar's last update (\\r) that a line
    followed on the same line (not the launcher's quotes of them, "  traceback : error: ...")."""
    found = [re.match(r"^(?:.*\])?\s*((?:\[rank \d+\] )?error: .*)$", part) for part in re.split(r"[\r\n]", output)]
    return [match.group(1) for match in found if match]


def traced_through_a_recipe(output: str) -> bool:
    """A Python traceback through recipe code (the launcher's own, around a worker's exit, is Accelerate's)."""
    return bool(re.search(r'File "[^"]*/recipes/[^"]*", line \d+', output))


def saved_tensors(output_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of every safetensors file the run saved (checkpoints aside), by file and name."""
    return {
        f"{path.relative_to(output_dir)}:{key}": value
        for path in sorted(output_dir.rglob("*.safetensors"))
        if "checkpoints" not in path.relative_to(output_dir).parts
        for key, value in load_file(path).items()
    }


def ends_as_the_uninterrupted_run(folder: Path, output_dir: str) -> None:
    """``folder / output_dir``'s loss curve (its length too) and saved weights are the uninterrupted run's, to 1e-6."""
    expected, got = read_results(folder / "uninterrupted"), read_results(folder / output_dir)
    assert len(got["train/loss_curve"]) == len(expected["train/loss_curve"])
    np.testing.assert_allclose(got["train/loss_curve"], expected["train/loss_curve"], rtol=0, atol=1e-6)
    expected, got = saved_tensors(folder / "uninterrupted"), saved_tensors(folder / output_dir)
    assert expected and got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-6, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_sigterm_ends_the_step_saves_a_checkpoint_and_says_how_to_resume(runs, name):
    run = runs[name]["stopped"]
    assert run.returncode == 128 + signal.SIGTERM, str(run)
    stopped = STOPPED.findall(run.output)
    assert len(stopped) == 1, str(run)  # said once, by the main process
    step, checkpoint = int(stopped[0][0]), Path(stopped[0][1].rstrip(";."))
    assert (checkpoint / "progress.json").is_file() and step < max_train_steps(name)
    assert "--resume_from_checkpoint latest" in stopped[0][2]
    assert not traced_through_a_recipe(run.output) and "KeyboardInterrupt" not in run.output, str(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_resumed_in_another_process_count_it_ends_as_the_uninterrupted_run(runs, name):
    uninterrupted, resumed = runs[name]["uninterrupted"], runs[name]["resumed"]
    assert uninterrupted.returncode == 0, str(uninterrupted)
    assert resumed.returncode == 0, str(resumed)
    step = int(STOPPED.findall(runs[name]["stopped"].output)[0][0])
    assert re.search(rf"resumed from \S+step_0*{step} at step {step}\b", resumed.output), str(resumed)
    ends_as_the_uninterrupted_run(runs[name]["folder"], "stopped")


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_resumed_from_the_checkpoint_of_its_last_step_it_trains_no_step_more(runs, name):
    """What a job scheduler's requeue does to a run that ended (or was stopped in its evaluation or final save): the
    same command, resuming ``latest``. The run must end as it ended, not take one more step."""
    again = runs[name]["resumed_again"]
    assert again.returncode == 0, str(again)
    last = max_train_steps(name)
    assert re.search(rf"resumed from \S+step_0*{last} at step {last}\b", again.output), str(again)
    ends_as_the_uninterrupted_run(runs[name]["folder"], "finished")


def measurements(results: dict) -> dict:
    """What a run measured of its speed and training's peak memory (perf/*, memory/peak_gib)."""
    return {key: value for key, value in results.items() if key.startswith("perf/") or key == "memory/peak_gib"}


@pytest.mark.slow
@pytest.mark.parametrize("name", offering("--resume_from_checkpoint", "requeue_keeps_measurements") + list(LAYOUTS))
def test_a_requeue_of_a_finished_run_keeps_what_the_run_measured_in_its_own_setup_only(runs, name):
    """The requeue trains no step, so it measures no speed: in the run's process count (the shorter run, requeued)
    results.json keeps the run's perf/* and training's peak memory instead of writing null (or the load's peak) over
    them. In another count (the uninterrupted 2-process run requeued in 1; the split layout's 3 in 2) it writes null:
    beside the requeue's num_processes, the run's numbers would say that this count trained at that speed."""
    folder = runs[name]["folder"]
    measured, requeued = measurements(runs[name]["replacing_results"]), read_results(folder / "replaced")
    assert measured["perf/step_time_s"] is not None and measured["memory/peak_gib"], measured
    assert measurements(requeued) == measured
    run, elsewhere = read_results(folder / "uninterrupted"), read_results(folder / "finished")
    if elsewhere["num_processes"] != run["num_processes"]:
        assert measurements(run)["perf/samples_per_sec"] is not None and measurements(run)["memory/peak_gib"]
        assert elsewhere["memory/peak_gib"] is None and elsewhere["perf/measured_steps"] == 0, measurements(elsewhere)
        assert all(
            elsewhere.get(key) is None for key in ("perf/samples_per_sec", "perf/tokens_per_sec", "perf/step_time_s")
        )
    else:  # (a pipeline's: another count would be another split, refused)
        assert measurements(elsewhere) == measurements(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_a_requeue_after_overwrite_output_dir_resumes_the_new_run_not_the_replaced_one(runs, name):
    """A shorter run into a longer run's folder (--overwrite_output_dir), requeued with ``latest``: it goes on from
    its own checkpoints, never from the replaced run's later ones (which would also outlive its own under
    --checkpoints_total_limit)."""
    replacing, requeued = runs[name]["replacing"], runs[name]["requeued"]
    assert replacing.returncode == 0 and requeued.returncode == 0, str(replacing) + str(requeued)
    short = short_steps(name)
    assert not re.search(rf"resumed from \S+ at step (?!{short}\b)\d+", requeued.output), str(requeued)
    assert read_results(runs[name]["folder"] / "replaced")["completed_steps"] == short


@pytest.mark.slow
@pytest.mark.parametrize("name", offering("--resume_from_checkpoint", "damaged_checkpoint_skipped") + list(LAYOUTS))
def test_latest_skips_a_damaged_newer_checkpoint_and_says_so(runs, name):
    damaged, resumed = runs[name]["damaged"], runs[name]["resumed"]
    assert f"skipping the damaged checkpoint {damaged.name}" in resumed.output, str(resumed)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_a_resume_with_another_seed_is_refused_once(runs, name):
    run = runs[name]["reseeded"]
    assert run.returncode != 0, str(run)
    printed = errors(run.output)
    assert len(printed) == 1 and "seed" in printed[0] and "42" in printed[0] and "7" in printed[0], str(run)
    assert not traced_through_a_recipe(run.output), str(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_a_resume_with_another_learning_rate_is_refused_once(runs, name):
    """Resumed, a run trains with the rate its checkpoint's optimizer and scheduler hold: a new --learning_rate would
    be recorded in results.json and not used."""
    run, trained = runs[name]["rerated"], read_results(runs[name]["folder"] / "uninterrupted")["config"]
    assert run.returncode != 0, str(run)
    printed = errors(run.output)
    assert len(printed) == 1 and "learning_rate" in printed[0], str(run)
    assert f"{trained['learning_rate']:g}" in printed[0] and RERATED in printed[0], printed[0]
    assert not traced_through_a_recipe(run.output), str(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_a_resume_over_another_training_set_is_refused_once(runs, name):
    """The number of training examples orders their shuffle: resumed over a data file edited since, or another
    --max_train_samples, a run would skip examples it never trained and train others twice."""
    run = runs[name]["resized"]
    assert run.returncode != 0, str(run)
    printed, expected = errors(run.output), "'samples': 4000" if name == "linear_toy.py" else "training examples"
    assert len(printed) == 1 and expected in printed[0], str(run)
    assert not traced_through_a_recipe(run.output), str(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in RESUMING if "--lora_alpha" in flags(name.split()[0])])
def test_a_resume_with_another_adapter_is_refused_once(runs, name):
    """A LoRA checkpoint's weights are its adapter's: another --lora_alpha would rescale them silently (a jump in the
    loss, and results.json recording the new one), another --lora_r or a new adapter would not load."""
    run, (flag, value) = runs[name]["readapted"], READAPTED.get(name.split()[0], ("--lora_alpha", "32"))
    assert run.returncode != 0, str(run)
    printed = errors(run.output)
    assert len(printed) == 1 and f"this run has {flag} {value}" in printed[0], str(run)
    assert not traced_through_a_recipe(run.output), str(run)


@pytest.mark.slow
@pytest.mark.parametrize("name", offering(f"--{ADDED_TO_THE_RECORD}", "relabelled_refused"))
def test_a_resume_that_trains_other_tokens_is_refused_once_also_over_a_checkpoint_that_did_not_record_them(runs, name):
    """Trained on the answers only (the default), resumed with --no-assistant_only_loss (every token, TRL's default),
    a run's loss would change from the next step on, silently. A checkpoint saved before the choice was recorded
    trained the default: requeued with it, it resumes (``test_resumed_from_the_checkpoint_of_its_last_step_...``
    runs it, as ``finished``), and with the other choice it is refused as this version's checkpoint is."""
    assert runs[name]["resumed_again"].returncode == 0, str(runs[name]["resumed_again"])
    for case in ("relabelled", "relabelled_older"):
        run = runs[name][case]
        assert run.returncode != 0, f"{case}: {run}"
        printed = errors(run.output)
        said = f"was trained with --{ADDED_TO_THE_RECORD}, this run has --no-{ADDED_TO_THE_RECORD}:"
        assert len(printed) == 1 and said in printed[0], f"{case}: {run}"
        assert not traced_through_a_recipe(run.output), f"{case}: {run}"


@pytest.mark.slow
def test_the_toy_refuses_a_damaged_checkpoint_and_another_process_count_in_one_line(runs):
    toy = runs["linear_toy.py"]
    damaged, other = toy["damaged_refused"], toy["other_count_refused"]
    assert damaged.returncode != 0 and other.returncode != 0
    assert (
        errors(damaged.output)
        == [
            line for line in errors(damaged.output) if f"cannot resume from {toy['damaged']}: it does not load" in line
        ]
        and len(errors(damaged.output)) == 1
    ), str(damaged)
    assert len(errors(other.output)) == 1 and "'processes': 2" in errors(other.output)[0], str(other)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_every_recipe_prints_the_parallelism_it_chose(runs, name):
    assert re.search(r"^parallelism: \w+ \(", runs[name]["uninterrupted"].output, re.MULTILINE), name


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMING)
def test_a_run_ends_with_a_checkpoint_of_its_last_step_so_a_requeue_retrains_nothing(runs, name):
    """With --checkpointing_steps, a run's last step is checkpointed too, once (as the Trainer saves at the end when
    it saves by steps): a run of 5 steps saving every 2 (the toy: 130, every 50) ends with the checkpoint of step 5,
    which --checkpoints_total_limit 2 keeps with step 4's, and one of 12 saves step 12 once. Requeued (the same
    command, resuming ``latest``), it resumes at step 5, trains and saves nothing, and its results.json keeps the
    run's losses; without that checkpoint it resumed at step 4 and trained step 5 again."""
    folder, short = runs[name]["folder"], short_steps(name)
    replacing, requeued = runs[name]["replacing"], runs[name]["requeued"]
    assert replacing.returncode == 0 and requeued.returncode == 0, str(replacing) + str(requeued)
    every = 50 if name == "linear_toy.py" else 2
    kept = [short - short % every, short] if name != "linear_toy.py" else [50, 100, short]
    assert checkpointed_steps(folder / "replaced") == kept, str(replacing)
    assert re.search(rf"resumed from \S+step_0*{short} at step {short}\b", requeued.output), str(requeued)
    assert "saved checkpoint" not in requeued.output, str(requeued)
    assert read_results(folder / "replaced")["train/loss_curve"] == runs[name]["replacing_results"]["train/loss_curve"]
    if name != "linear_toy.py":  # a step count --checkpointing_steps divides: its last step saved once
        last, uninterrupted = max_train_steps(name), runs[name]["uninterrupted"]
        assert saves_of(last, uninterrupted.output) == 1 and saves_of(short, replacing.output) == 1, str(replacing)


@pytest.mark.slow
@pytest.mark.parametrize("name", BY_EPOCH)
def test_a_one_epoch_run_checkpointed_by_epoch_ends_with_its_checkpoint_and_its_requeue_retrains_nothing(runs, name):
    """--checkpointing_steps epoch over a run of one epoch: the epoch's end is the run's, and its checkpoint is saved
    there, once. Requeued, the run resumes at its last step and trains nothing (without it: 'no complete checkpoint
    ... yet, starting fresh', and the whole run again)."""
    run, requeued, results = (runs[name][key] for key in ("one_epoch", "one_epoch_requeued", "one_epoch_results"))
    assert run.returncode == 0 and requeued.returncode == 0, str(run) + str(requeued)
    last = results["completed_steps"]
    assert checkpointed_steps(runs[name]["folder"] / "one_epoch") == [last], str(run)
    assert saves_of(last, run.output) == 1, str(run)
    assert re.search(rf"resumed from \S+step_0*{last} at step {last}\b", requeued.output), str(requeued)
    assert "saved checkpoint" not in requeued.output, str(requeued)
    assert read_results(runs[name]["folder"] / "one_epoch")["train/loss_curve"] == results["train/loss_curve"]
