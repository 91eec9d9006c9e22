"""The setup checker under 2 and 1 processes, a link that corrupts data, and its pure parts."""

import importlib.util
import json
import shutil

import pytest
import torch
from harness.launch import REPO, Job, launch_all

SMALL = ("--sizes_mb", "1", "4", "--iterations", "3", "--warmup", "1")
# The one sum all-reduce that the checker verifies; the broken-link test corrupts its result.
CHECKED_CALL = "dist.all_reduce(tensor, op=dist.ReduceOp.SUM)"
CHECKER = REPO / "tools" / "check_setup.py"  # a diagnostic, not a recipe


def load_checker():
    spec = importlib.util.spec_from_file_location("check_setup", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_setup(output_dir) -> dict:
    return json.loads((output_dir / "setup.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three launches, run at once (each one mostly waits for imports): 2 processes, 1 process, and
    2 processes of a copy whose rank 1 corrupts one element of every checked all-reduce."""
    root = tmp_path_factory.mktemp("check_setup")
    broken_project = root / "broken_project"
    broken_project.mkdir()
    shutil.copytree(REPO / "shared", broken_project / "shared", ignore=shutil.ignore_patterns("__pycache__"))
    source = CHECKER.read_text()
    assert source.count(CHECKED_CALL) == 1
    (broken_project / "check_setup.py").write_text(
        source.replace(
            CHECKED_CALL, CHECKED_CALL + "\n    tensor[7] += dist.get_rank()  # rank 1 corrupts one element"
        )
    )
    specs = {
        "ddp": ("ddp_2gpu.yaml", CHECKER),
        "single": ("single_gpu.yaml", CHECKER),
        "broken": ("ddp_2gpu.yaml", broken_project / "check_setup.py"),
    }
    jobs = {
        name: Job(config, script, ("--output_dir", root / name, *SMALL), kwargs={"timeout": 150})
        for name, (config, script) in specs.items()
    }
    return {name: {"run": run, "dir": root / name} for name, run in launch_all(jobs, workers=len(jobs)).items()}


@pytest.mark.slow
def test_two_processes_sweep_and_verify_every_size(runs):
    run = runs["ddp"]["run"]
    assert run.returncode == 0, str(run)
    setup = read_setup(runs["ddp"]["dir"])
    assert setup["num_processes"] == 2 and len(setup["ranks"]) == 2
    sweep = setup["allreduce"]
    assert sweep["skipped"] is False and sweep["all_correct"] is True
    assert [entry["size_mb"] for entry in sweep["sizes"]] == [1, 4]
    for entry in sweep["sizes"]:
        assert entry["correct"] is True and entry["wrong_on_ranks"] == {}
        assert entry["bytes"] == entry["size_mb"] * 2**20
        assert entry["time_s"] > 0
        assert entry["algbw_gb_per_s"] == pytest.approx(entry["bytes"] / entry["time_s"] / 1e9, rel=1e-12)
        # nccl-tests: busbw = algbw x 2(n-1)/n, which for n = 2 is algbw itself.
        assert entry["busbw_gb_per_s"] == pytest.approx(entry["algbw_gb_per_s"] * 2 * (2 - 1) / 2, rel=1e-12)
    assert setup["config"]["iterations"] == 3 and setup["config"]["sizes_mb"] == [1, 4]


@pytest.mark.slow
def test_two_processes_report_backend_devices_and_versions(runs):
    setup = read_setup(runs["ddp"]["dir"])
    versions = setup["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["accelerate"] and versions["python"]
    assert set(setup["rtx40_caveat"]["environment"]) == {"NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"}
    assert "NCCL_P2P_DISABLE=1" in setup["rtx40_caveat"]["note"]
    if torch.cuda.is_available():
        assert setup["backend"] == "nccl" and versions["cuda"] and versions["nccl"]
        assert len(setup["gpus"]) >= 2
        return
    assert setup["backend"] == "gloo" and setup["distributed_type"] == "MULTI_CPU"
    assert setup["cpu"]["logical_cores"] >= 1 and setup["cpu"]["ram_total_gib"] > 0
    link = setup["links"]["believed_link"]
    assert "gloo" in link["name"] and link["nominal_peak_gb_per_s"] is None
    assert all(entry["busbw_vs_peak"] is None for entry in setup["allreduce"]["sizes"])


@pytest.mark.slow
def test_summary_is_printed_once(runs):
    output = runs["ddp"]["run"].output
    assert output.count("all-reduce sweep: 2 processes over") == 1
    assert output.count("RTX 40 caveat:") == 1
    assert "BROKEN" not in output


@pytest.mark.slow
def test_one_process_skips_the_sweep_but_reports_devices(runs):
    run = runs["single"]["run"]
    assert run.returncode == 0, str(run)
    setup = read_setup(runs["single"]["dir"])
    assert setup["num_processes"] == 1 and setup["backend"] is None
    sweep = setup["allreduce"]
    assert sweep["skipped"] is True and sweep["sizes"] == [] and sweep["all_correct"] is None
    assert "needs at least 2 processes" in sweep["reason"]
    assert setup["cpu"]["model"] and setup["versions"]["torch"] == torch.__version__
    assert "all-reduce sweep: skipped, 1 process" in run.output


@pytest.mark.slow
def test_a_link_that_corrupts_data_is_reported_broken(runs):
    """Proof that the verification can fail: rank 1 adds 1 to element 7 of every checked result."""
    run = runs["broken"]["run"]
    assert run.returncode != 0, str(run)
    assert "BROKEN: all-reduce of 1 MB gave wrong sums on rank 1: 1 of 262144 elements, first at index 7" in run.output
    assert "error: BROKEN link: the all-reduce gave wrong sums for 1 MB, 4 MB" in run.output
    setup = read_setup(runs["broken"]["dir"])  # written before the non-zero exit
    assert setup["allreduce"]["all_correct"] is False
    for entry in setup["allreduce"]["sizes"]:
        assert entry["correct"] is False
        assert set(entry["wrong_on_ranks"]) == {"1"}
        failed = entry["wrong_on_ranks"]["1"]
        assert failed["wrong_elements"] == 1 and failed["first_wrong_index"] == 7
        assert failed["first_wrong_value"] == 4.0 and failed["expected"] == 3.0


# ------------------------------------------------------------------- pure functions, no launch


@pytest.fixture(scope="module")
def checker():
    return load_checker()


def test_verify_allreduce_accepts_the_exact_sum(checker):
    for world_size in (1, 2, 3, 8):
        report = checker.verify_allreduce(torch.full((1000,), world_size * (world_size + 1) / 2), world_size)
        assert report["correct"] is True and report["wrong_elements"] == 0


def test_verify_allreduce_reports_a_wrong_value_as_broken(checker):
    tensor = torch.full((1000,), 3.0)
    tensor[123] = 3.0 + 2**-20  # off by far less than any tolerance would catch
    report = checker.verify_allreduce(tensor, world_size=2)
    assert report["correct"] is False and report["wrong_elements"] == 1
    assert report["first_wrong_index"] == 123
    # A stale buffer (only this rank's own contribution), and NaN, are broken too.
    assert checker.verify_allreduce(torch.full((10,), 1.0), world_size=2)["wrong_elements"] == 10
    tensor = torch.full((10,), 3.0)
    tensor[4] = float("nan")
    assert checker.verify_allreduce(tensor, world_size=2)["first_wrong_index"] == 4


def test_bus_bandwidth_follows_nccl_tests(checker):
    assert checker.bus_bandwidth(10.0, 2) == 10.0
    assert checker.bus_bandwidth(10.0, 4) == 15.0
    assert checker.bus_bandwidth(10.0, 8) == 17.5


def test_nominal_peaks(checker):
    peaks = checker.NOMINAL_PEAK_GB_PER_S
    assert peaks["PCIe 4.0 x16"] == 31.5 and peaks["PCIe 4.0 x8"] == 15.8
    assert peaks["NVLink (RTX 3090 bridge)"] == pytest.approx(56, abs=0.5)


# Written from nvidia-smi's documented layout (tab-separated, header underlined with ANSI codes).
TOPOLOGY_NVLINK = (
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X "
    "\tNV4\t0-31\t0\t\tN/A\nGPU1\tNV4\t X \t0-31\t0\t\tN/A\n\nLegend:\n\n  X    = Self\n  NV#  = Connection "
    "traversing a bonded set of # NVLinks\n"
)
TOPOLOGY_PCIE = (
    "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tPHB\tSYS\t0-15\nGPU1\tPHB\t X \tSYS\t0-15\n"
    "GPU2\tSYS\tSYS\t X \t16-31\n"
)
NVLINK_STATUS = (
    "GPU 0: NVIDIA GeForce RTX 3090 (UUID: GPU-aaaa)\n\t Link 0: 14.062 GB/s\n\t Link 1: 14.062 GB/s\n"
    "\t Link 2: 14.062 GB/s\n\t Link 3: 14.062 GB/s\n"
    "GPU 1: NVIDIA GeForce RTX 3090 (UUID: GPU-bbbb)\n\t Link 0: 14.062 GB/s\n\t Link 1: <inactive>\n"
)


def test_parse_topology(checker):
    assert checker.parse_topology(TOPOLOGY_NVLINK) == {"0-1": "NV4"}
    assert checker.parse_topology(TOPOLOGY_PCIE) == {"0-1": "PHB", "0-2": "SYS", "1-2": "SYS"}
    assert checker.parse_topology("") == {}


def test_parse_nvlink_status(checker):
    status = checker.parse_nvlink_status(NVLINK_STATUS)
    assert status["0"] == {"uuid": "aaaa", "active_links": 4, "gb_per_s": 56.248}
    assert status["1"]["active_links"] == 1


def test_believed_link(checker):
    def gpu(index, name="NVIDIA GeForce RTX 4090", gen=4, width=16):
        return {"index": index, "name": name, "pcie.link.gen.max": gen, "pcie.link.width.max": width}

    pcie = checker.believed_link(2, "cuda", {"host"}, [gpu(0), gpu(1, width=8)], {"0-1": "PHB"}, {}, {"0->1": False})
    assert pcie["name"] == "PCIe 4.0 x8" and pcie["nominal_peak_gb_per_s"] == 15.8
    assert "host memory" in pcie["reason"]
    pair = [gpu(0, "NVIDIA GeForce RTX 3090"), gpu(1, "NVIDIA GeForce RTX 3090")]
    nvlink = checker.believed_link(2, "cuda", {"host"}, pair, {"0-1": "NV4"}, {}, {"0->1": True})
    assert nvlink["name"] == "NVLink (RTX 3090 bridge)" and nvlink["nominal_peak_gb_per_s"] == 56.25
    cpu = checker.believed_link(2, "cpu", {"host"}, [], {}, {}, {})
    assert "gloo" in cpu["name"] and cpu["nominal_peak_gb_per_s"] is None
    assert checker.believed_link(1, "cpu", {"host"}, [], {}, {}, {})["name"] == "none"
