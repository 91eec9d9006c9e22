"""The test harness runs what users run: a forked launch (a copy of the test zygote per process) differs from a
started one in nothing a recipe can see. A training run forked from the zygotes ends with the bytes and losses of its
twin started by the launcher, and a refusal exits and reads alike; each rank has a hash seed of its own, observer/ is
loaded only where a test asks for its facts, and a crash in Python's teardown at exit fails a forked launch as it fails
a started one."""

import json
import re
from pathlib import Path

import pytest
from harness.launch import ONE_PROCESS, Job, launch, launch_all, read_results, visible_gpus
from harness.models import save_tiny_llama

SCRIPT = Path(__file__).parent / "process_facts.py"


def facts(output: str) -> dict[str, tuple[str, str, str]]:
    return {
        rank: tuple(rest)
        for rank, *rest in re.findall(r"rank (\d+): hash (-?\d+), observer (\w+), free_memory from (\S+)", output)
    }


def test_the_ranks_of_a_forked_launch_each_have_their_own_hash_seed():
    """Forked from one zygote, every process of a launch shared its hash seed: a set of strings iterated in a
    rank-dependent order (a real launch's) would never show here."""
    run = launch("ddp_2gpu.yaml", SCRIPT)
    assert run.returncode == 0, str(run)
    seen = facts(run.output)
    assert set(seen) == {"0", "1"} and seen["0"][0] != seen["1"][0], run.output


@pytest.mark.slow
def test_the_observer_is_loaded_only_where_a_test_reads_it():
    plain, observed = launch("single_gpu.yaml", SCRIPT), launch("single_gpu.yaml", SCRIPT, observe=True)
    assert facts(plain.output)["0"][1:] == ("False", "accelerate.accelerator"), plain.output
    assert facts(observed.output)["0"][1] == "True" and facts(observed.output)["0"][2] != "accelerate.accelerator"


@pytest.mark.slow
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "started"])
def test_a_crash_in_python_s_teardown_fails_the_launch(forked):
    """A copy that exited with os._exit after its atexit handlers skipped the interpreter's teardown, where a gloo
    destructor or a finalizer can crash a real process: such a crash passed."""
    run = launch(ONE_PROCESS, SCRIPT, "--crash_at_exit", forked=forked)
    assert "rank 0: hash" in run.output and run.returncode != 0, str(run)


# ----------------------------------------------------------------------------- forked and started twins
@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Three launches, each twice: forked from the zygotes, and started by the launcher. The linear toy with
    accumulation in 1 process (Accelerate's 1-process launcher and its child); a LoRA fine-tune of a tiny Llama in 2
    (torchrun's workers, odd ranks from the second zygote; transformers, PEFT and bitsandbytes imported by the
    zygotes); a refusal through the 1-process launcher. On the kind of device a 2-process run gets."""
    root = tmp_path_factory.mktemp("twins")
    base = root / "tiny_llama"
    questions = save_tiny_llama(base, num_hidden_layers=2)
    chats = [{"messages": row["messages"]} for row in questions["train"].select(range(16))]
    (base / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    launches = {
        "linear_toy": ("single_gpu.yaml", "linear_toy.py", "--max_train_steps", "10")
        + ("--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"),
        "llm_finetune": ("ddp_2gpu.yaml", "llm_finetune.py", "--model_name_or_path", base)
        + ("--train_file", base / "chats.jsonl", "--max_train_steps", "2", "--per_device_train_batch_size", "4")
        + ("--max_length", "128", "--skip_eval"),
        "refusal": ("single_gpu.yaml", "linear_toy.py", "--per_device_train_batch_size", "0"),
    }
    jobs = {
        f"{name}_{way}": Job(config, script, (*args, "--output_dir", root / f"{name}_{way}"))
        for name, (config, script, *args) in launches.items()
        for way in ("forked", "started")
    }
    for name, job in jobs.items():
        job.kwargs["forked"] = name.endswith("_forked")
    return {name: (run, root / name) for name, run in launch_all(jobs, cpu_only=visible_gpus() < 2).items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, saved", [("linear_toy", "model.safetensors"), ("llm_finetune", "adapter_model.safetensors")]
)
def test_a_run_forked_from_the_zygotes_ends_with_the_bytes_and_losses_of_its_started_twin(twins, recipe, saved):
    """Most launches' processes are forks of zygotes that imported the libraries: the same weights, bit for bit, and
    the same losses as processes the launcher starts."""
    (forked, forked_dir), (started, started_dir) = twins[f"{recipe}_forked"], twins[f"{recipe}_started"]
    assert forked.returncode == 0, str(forked)
    assert started.returncode == 0, str(started)
    assert (forked_dir / saved).read_bytes() == (started_dir / saved).read_bytes()
    forked_results, started_results = read_results(forked_dir), read_results(started_dir)
    assert forked_results["train/loss_curve"] == started_results["train/loss_curve"]
    assert forked_results["num_processes"] == started_results["num_processes"]


@pytest.mark.slow
def test_a_refusal_forked_from_the_zygote_exits_and_reads_like_one_the_launcher_started(twins):
    (forked, _), (started, _) = twins["refusal_forked"], twins["refusal_started"]
    assert forked.returncode == started.returncode == 1  # the launcher's, not argparse's 2
    errors = lambda run: [line for line in run.output.splitlines() if "error:" in line]
    assert errors(forked) == errors(started) and len(errors(started)) >= 2, started.output  # the launcher repeats it
