"""The test harness runs what users run: a forked launch (a copy of the test zygote per process) differs from a
started one in nothing a recipe can see. Each rank has a hash seed of its own, observer/ is loaded only where a
test asks for its facts, and a crash in Python's teardown at exit fails a forked launch as it fails a started one."""

import re
from pathlib import Path

import pytest
from harness.launch import ONE_PROCESS, launch

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
