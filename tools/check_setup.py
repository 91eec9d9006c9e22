"""Setup checker: what this machine gives two-GPU training, and whether the link between processes works.

Run it first on a new machine, under the config you will train with. It prints, and saves to
``output_dir/setup.json``:
- devices and memory (each GPU's name, memory and compute capability; on CPU the processor, cores, RAM);
- torch, CUDA, NCCL, accelerate and python versions;
- peer access between each GPU pair, NVLink presence, the PCIe link of each GPU;
- the RTX 40-series peer-to-peer caveat and the NCCL variables Accelerate sets for it;
- an all-reduce bandwidth sweep between the processes (1 MB ... 256 MB of float32): algbw and busbw,
  compared with the nominal peak of the link it believes is present;
- whether every all-reduce gave exactly the right sum. A link that silently corrupts data (seen on
  early RTX 4090 drivers, which reported peer access the cards do not have) is reported BROKEN, and
  the run exits non-zero after writing setup.json.

Bandwidth follows the nccl-tests convention (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
algbw = bytes / time; busbw = algbw x 2(n-1)/n for an all-reduce of n processes, because a ring
all-reduce moves 2(n-1)/n of the buffer over each link in each direction. busbw is the number to
compare with a link's one-direction peak. 1 MB = 2**20 bytes; 1 GB/s = 1e9 bytes/s.

Launch (from the repository root):
    # two GPUs, or on a CPU-only machine 2 processes over gloo (same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml tools/check_setup.py
    # quick CPU smoke run:
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml tools/check_setup.py --sizes_mb 1 4 \\
        --iterations 3
    # one process (devices, versions and links only: an all-reduce needs two processes):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml tools/check_setup.py
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml tools/check_setup.py

Writes ``output_dir/setup.json`` (everything printed, and the resolved config).
"""

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import accelerate
import psutil
import torch
import torch.distributed as dist
from accelerate.utils import check_cuda_p2p_ib_support

# The helper module: shared/ next to this file (a copy of it) or one folder up (this repository: tools/ beside
# shared/), first on sys.path so that no installed package named "shared" shadows it.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
from shared.results import write_results
from shared.errors import RecipeError, report_recipe_errors, set_stop_with_launcher
from shared.accelerator import build_accelerator, set_gpu_index
from shared.flags import positive_float, positive_int, prepare_output_dir

MB = 2**20  # nccl-tests labels sizes in powers of two ...
GB = 1e9  # ... and bandwidth in powers of ten.
GIB = 2**30

# Nominal one-direction peak of each link, GB/s. busbw of a healthy link ends somewhat below it
# (NCCL reaches roughly 80-90 % of PCIe on large buffers).
# PCIe: transfer rate x 128/130 encoding / 8 bits per lane (gen 3: 8 GT/s -> 0.985 GB/s per lane,
# gen 4: 16 GT/s -> 1.969, gen 5: 32 GT/s -> 3.938), times the lanes.
# NVLink on the RTX 3090 bridge: 4 links x 14.0625 GB/s per direction (112.5 GB/s both ways).
# Other NVLink GPUs: the sum of the active link speeds that `nvidia-smi nvlink --status` reports.
NOMINAL_PEAK_GB_PER_S = {
    "PCIe 3.0 x4": 3.9,
    "PCIe 3.0 x8": 7.9,
    "PCIe 3.0 x16": 15.8,
    "PCIe 4.0 x4": 7.9,
    "PCIe 4.0 x8": 15.8,
    "PCIe 4.0 x16": 31.5,
    "PCIe 5.0 x4": 15.8,
    "PCIe 5.0 x8": 31.5,
    "PCIe 5.0 x16": 63.0,
    "NVLink (RTX 3090 bridge)": 56.25,
}

# The name fragment Accelerate looks for (accelerate.utils.environment.check_cuda_p2p_ib_support).
RTX40 = "RTX 40"
# What `accelerate launch` sets for such GPUs (accelerate/commands/launch.py, multi_gpu_launcher).
RTX40_NCCL_VARIABLES = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir", default="outputs/check_setup", help="Where setup.json goes (created if missing)."
    )
    parser.add_argument(
        "--sizes_mb",
        type=positive_int,
        nargs="+",
        default=[1, 4, 16, 64, 256],
        help="All-reduce buffer sizes to sweep, in MB (2**20 bytes) of float32.",
    )
    parser.add_argument(
        "--iterations", type=positive_int, default=20, help="Timed all-reduces per size (nccl-tests uses 20)."
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=5,
        help="Untimed all-reduces per size before timing (nccl-tests uses 5).",
    )
    parser.add_argument(
        "--dist_timeout",
        type=positive_float,
        default=300,
        help="Seconds any collective may wait for the other processes before the run fails: a hung link ends with an "
        "error.",
    )
    parser.add_argument(
        "--p2p_copy_mb",
        type=positive_int,
        default=64,
        help="Buffer copied directly between every pair of visible GPUs (and checked element by element).",
    )
    return parser.parse_args(argv)


def run_command(command: list[str], timeout_s: float = 15) -> tuple[str | None, str | None]:
    """Run a diagnostic command: (its output, None) or (None, why there is none)."""
    if shutil.which(command[0]) is None:
        return None, f"{command[0]} not found"
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(command)}` did not answer within {timeout_s} s"
    if completed.returncode != 0:
        message = (completed.stderr or completed.stdout).strip().splitlines()
        return (
            None,
            f"`{' '.join(command)}` failed (exit {completed.returncode}): {message[-1] if message else 'no output'}",
        )
    return completed.stdout, None


def cpu_info() -> dict:
    """The processor, its cores and the RAM."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = psutil.virtual_memory()
    return {
        "model": model or platform.processor() or platform.machine(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        # What this process may run on (a container or taskset can give fewer cores than the machine has).
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_total_gib": round(memory.total / GIB, 2),
        "ram_available_gib": round(memory.available / GIB, 2),
        "torch_threads_per_process": torch.get_num_threads(),
    }


def normalize_uuid(uuid: str) -> str:
    """torch prints a GPU's UUID without nvidia-smi's ``GPU-`` prefix; compare them without it."""
    return str(uuid).lower().removeprefix("gpu-")


def cuda_devices() -> list[dict]:
    """Every GPU this process sees, in CUDA's numbering."""
    devices = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "name": properties.name,
                "memory_total_gib": round(properties.total_memory / GIB, 2),
                "compute_capability": f"{properties.major}.{properties.minor}",
                "multiprocessors": properties.multi_processor_count,
                "uuid": normalize_uuid(properties.uuid),
            }
        )
    return devices


def versions() -> dict:
    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def na_to_none(value: str):
    """nvidia-smi writes ``[N/A]`` or ``N/A`` for a field it cannot read."""
    value = value.strip()
    if not value or "N/A" in value:
        return None
    return int(value) if value.isdigit() else value


def nvidia_smi_gpus() -> tuple[list[dict] | None, str | None]:
    """Driver, PCIe link and memory use of each GPU, from nvidia-smi (in nvidia-smi's numbering)."""
    fields = [
        "index",
        "uuid",
        "name",
        "driver_version",
        "pcie.link.gen.max",
        "pcie.link.width.max",
        "pcie.link.gen.current",
        "pcie.link.width.current",
        "memory.used",
        "memory.total",
    ]
    output, reason = run_command(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if output is None:
        return None, reason
    gpus = []
    for line in output.strip().splitlines():
        values = [na_to_none(value) for value in line.split(",")]
        if len(values) == len(fields):
            gpu = dict(zip(fields, values))
            gpu["uuid"] = normalize_uuid(gpu["uuid"])
            gpus.append(gpu)
    return gpus, None


def parse_topology(text: str) -> dict[str, str]:
    """The connection between each GPU pair from ``nvidia-smi topo -m``, keyed ``"i-j"`` (nvidia-smi numbering).

    NV# = NVLink with # links; PIX/PXB = through PCIe switches; PHB = through the CPU's PCIe host
    bridge; NODE/SYS = across PCIe host bridges or CPU sockets.
    """
    rows = [ANSI_ESCAPE.sub("", line) for line in text.splitlines()]
    header = next((row.split("\t") for row in rows if row.strip().startswith("GPU0")), None)
    if header is None:
        return {}
    columns = [cell.strip() for cell in header]
    links = {}
    for row in rows:
        cells = [cell.strip() for cell in row.split("\t")]
        if not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        first = int(cells[0][3:])
        for column, value in zip(columns, cells):
            if re.fullmatch(r"GPU\d+", column) and int(column[3:]) > first:
                links[f"{first}-{column[3:]}"] = value
    return links


def parse_nvlink_status(text: str) -> dict[str, dict]:
    """Active NVLink links of each GPU from ``nvidia-smi nvlink --status``, keyed by nvidia-smi index."""
    gpus, current = {}, None
    for line in text.splitlines():
        gpu = re.match(r"GPU (\d+): .*\(UUID: ([^)]+)\)", line.strip())
        if gpu:
            current = {"uuid": normalize_uuid(gpu.group(2)), "active_links": 0, "gb_per_s": 0.0}
            gpus[gpu.group(1)] = current
            continue
        link = re.match(r"Link \d+: ([\d.]+) GB/s", line.strip())
        if link and current is not None:  # an unused link reads "Link 3: <inactive>"
            current["active_links"] += 1
            current["gb_per_s"] = round(current["gb_per_s"] + float(link.group(1)), 3)
    return gpus


def p2p_copy_check(devices: list[dict], megabytes: int) -> dict[str, dict]:
    """Copy a float32 buffer from each GPU straight to every other (``tensor.to``: peer-to-peer DMA where peer access
    is on, through host memory otherwise) and compare every element with the source: the transfer NCCL's P2P transport
    depends on, tested on this machine rather than assumed from its GPU names."""
    results = {}
    for a in devices:
        for b in devices:
            if a["index"] == b["index"]:
                continue
            source = torch.arange(megabytes * MB // 4, dtype=torch.float32, device=f"cuda:{a['index']}")
            source.to(f"cuda:{b['index']}")  # warm-up: peer mappings and allocations
            torch.cuda.synchronize(a["index"]), torch.cuda.synchronize(b["index"])
            start = time.perf_counter()
            copied = source.to(f"cuda:{b['index']}")
            torch.cuda.synchronize(a["index"]), torch.cuda.synchronize(b["index"])
            elapsed = time.perf_counter() - start
            results[f"{a['index']}->{b['index']}"] = {
                "peer_access": torch.cuda.can_device_access_peer(a["index"], b["index"]),
                "correct": bool(torch.equal(copied.cpu(), source.cpu())),
                "gb_per_s": megabytes * MB / elapsed / GB,
            }
    return results


def peer_access(devices: list[dict]) -> dict[str, bool]:
    """Whether each GPU can read the other's memory directly (CUDA numbering): NCCL's P2P transport needs it."""
    return {
        f"{a['index']}->{b['index']}": torch.cuda.can_device_access_peer(a["index"], b["index"])
        for a in devices
        for b in devices
        if a["index"] != b["index"]
    }


def rtx40_caveat(gpu_names: list[str], driver_version: str | None) -> dict:
    """The RTX 40-series peer-to-peer caveat, and what Accelerate does about it on this machine."""
    affected = sorted({name for name in gpu_names if RTX40 in name})
    return {
        "applies": bool(affected),
        "gpus": affected,
        "note": (
            "Consumer Ada cards (RTX 4090, 4080, ...) have no NVLink and no supported peer-to-peer over PCIe: "
            "NCCL must copy through host memory. Drivers older than 550.40.07 still reported peer access, and "
            "NCCL's P2P transport then returned wrong data or hung. Only then, with more than one GPU whose name "
            "holds 'RTX 40' and a driver older than 550.40.07, `accelerate launch` sets NCCL_P2P_DISABLE=1 and "
            "NCCL_IB_DISABLE=1 (unless already set) and AcceleratorState refuses to start without them; with driver "
            "550.40.07 or newer, or any other GPU, it sets nothing. Whether P2P works here: see p2p_copy."
        ),
        "driver_version": driver_version,
        # Accelerate's own check (it reads nvidia-smi; False means it disables P2P and IB).
        "accelerate_disables_p2p_and_ib": not check_cuda_p2p_ib_support(),
        "environment": {name: os.environ.get(name) for name in RTX40_NCCL_VARIABLES},
    }


def believed_link(
    participants: int,
    device_type: str,
    hosts: set[str],
    used_gpus: list[dict],
    topology: dict[str, str],
    nvlink: dict[str, dict],
    peers: dict[str, bool],
) -> dict:
    """The link the all-reduce runs over, as far as this machine says, with its nominal peak.

    ``participants``: processes, or the GPUs one process drives; ``used_gpus``: the GPUs in use, as
    nvidia-smi rows (nvidia-smi numbering).
    """
    if participants < 2:
        return {"name": "none", "nominal_peak_gb_per_s": None, "reason": "one process on one device: nothing to link"}
    if len(hosts) > 1:
        return {
            "name": f"network between {len(hosts)} hosts",
            "nominal_peak_gb_per_s": None,
            "reason": "processes on several hosts: the network sets the pace; this checker knows no nominal peak for "
            "it",
        }
    if device_type != "cuda":
        return {
            "name": "gloo over loopback (one host, CPU)",
            "nominal_peak_gb_per_s": None,
            "reason": "CPU processes exchange data through gloo's TCP loopback and memory copies: no nominal link "
            "peak",
        }
    if len(used_gpus) < 2:
        return {
            "name": "unknown",
            "nominal_peak_gb_per_s": None,
            "reason": "the processes' GPUs were not found in nvidia-smi's list (or share one GPU)",
        }
    indices = sorted(int(gpu["index"]) for gpu in used_gpus)
    pairs = [f"{a}-{b}" for i, a in enumerate(indices) for b in indices[i + 1 :]]
    on_nvlink = all(topology.get(pair, "").startswith("NV") for pair in pairs) or (
        not topology and all(nvlink.get(str(index), {}).get("active_links", 0) > 0 for index in indices)
    )
    p2p_disabled = os.environ.get("NCCL_P2P_DISABLE") == "1"
    if on_nvlink and not p2p_disabled:
        if all("3090" in str(gpu["name"]) for gpu in used_gpus):
            name = "NVLink (RTX 3090 bridge)"
            return {
                "name": name,
                "nominal_peak_gb_per_s": NOMINAL_PEAK_GB_PER_S[name],
                "reason": "nvidia-smi shows NVLink",
            }
        speeds = [nvlink.get(str(index), {}).get("gb_per_s", 0.0) for index in indices]
        peak = min(speeds) if min(speeds) > 0 else None
        return {
            "name": "NVLink",
            "nominal_peak_gb_per_s": peak,
            "reason": "nvidia-smi shows NVLink; peak = sum of the active link speeds of the slowest GPU",
        }
    # PCIe: the slowest GPU's link bounds the ring.
    generations = [gpu.get("pcie.link.gen.max") for gpu in used_gpus]
    widths = [gpu.get("pcie.link.width.max") for gpu in used_gpus]
    if not all(isinstance(value, int) for value in generations + widths):
        return {
            "name": "PCIe (generation or width unknown)",
            "nominal_peak_gb_per_s": None,
            "reason": "nvidia-smi did not report the PCIe link",
        }
    name = f"PCIe {min(generations)}.0 x{min(widths)}"
    reason = "nvidia-smi's pcie.link.gen.max / pcie.link.width.max of the slowest GPU"
    if on_nvlink:
        reason += "; NVLink is present but NCCL_P2P_DISABLE=1 keeps NCCL off it"
    elif not all(peers.values()):
        reason += "; no peer access, so NCCL copies through host memory (expect well under the peak)"
    return {"name": name, "nominal_peak_gb_per_s": NOMINAL_PEAK_GB_PER_S.get(name), "reason": reason}


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: each link carries 2(n-1)/n of the buffer each way."""
    return algbw * 2 * (world_size - 1) / world_size


def verify_allreduce(tensor: torch.Tensor, world_size: int) -> dict:
    """Check, exactly, a sum all-reduce of buffers that each rank filled with ``rank + 1``.

    Every element must equal 1 + 2 + ... + n = n(n+1)/2, an integer that float32 holds exactly (for
    fewer than about 5,000 processes), so any difference, NaN or Inf is corruption, not rounding.
    """
    expected = world_size * (world_size + 1) / 2
    wrong = tensor != expected
    wrong_elements = int(wrong.sum().item())  # .item() waits for the device
    report = {
        "correct": wrong_elements == 0,
        "expected": expected,
        "elements": tensor.numel(),
        "wrong_elements": wrong_elements,
    }
    if wrong_elements:
        first = int(wrong.nonzero()[0, 0].item())
        report.update(first_wrong_index=first, first_wrong_value=float(tensor[first].item()))
    return report


def checked_allreduce(tensor: torch.Tensor, rank: int, world_size: int) -> dict:
    """Fill with rank + 1, sum over all processes, verify."""
    tensor.fill_(rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return verify_allreduce(tensor, world_size)


def synchronize(device: torch.device) -> None:
    # Sync point: NCCL collectives are queued on a CUDA stream and return at once, so the clock must
    # wait for the GPU before it stops (gloo on CPU is already synchronous).
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ----------------------------------------------------------------------------- Accelerator
    set_stop_with_launcher()  # Linux: dies with its launcher (a SIGKILLed launcher cannot stop its workers)
    set_gpu_index()  # one process on a GPU: env ACCELERATE_TORCH_DEVICE=cuda:N, so the report says cuda:0, not cuda
    # build_accelerator passes cpu=True when there is no CUDA, so a 2-process config joins the
    # processes over gloo, and checks the process count. The timeout turns a hung link into an error.
    accelerator = build_accelerator(dist_timeout=args.dist_timeout)
    output_dir = prepare_output_dir(args.output_dir, overwrite=True, resuming=None)  # setup.json: rerun freely
    world_size, rank = accelerator.num_processes, accelerator.process_index
    device = accelerator.device
    backend = dist.get_backend() if dist.is_initialized() else None
    config = {**vars(args), "num_processes": world_size}
    accelerator.print("config: " + json.dumps(config, sort_keys=True))

    # Reports between processes (timings, verification results, which GPU each rank drives) travel
    # over a gloo group, through host memory and TCP, never over the GPU link under test: a link that
    # corrupts data must not also corrupt the report that says so. On CPU the default group is gloo.
    report_group = None
    if backend is not None and backend != "gloo":
        report_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.dist_timeout))

    def gather(value):
        """Every rank's ``value``, on every rank (a collective: all ranks call it)."""
        if world_size == 1:
            return [value]
        values = [None] * world_size
        dist.all_gather_object(values, value, group=report_group)
        return values

    # ----------------------------------------------------------------------- devices and versions
    cuda_seen = device.type == "cuda"
    gpus = cuda_devices() if cuda_seen else []
    smi_gpus, smi_reason = (
        nvidia_smi_gpus() if cuda_seen or shutil.which("nvidia-smi") else (None, "no CUDA device in use")
    )
    ranks = gather(
        {
            "rank": rank,
            "host": socket.gethostname(),
            "device": str(device),
            "gpu_uuid": gpus[device.index or 0]["uuid"] if cuda_seen else None,
        }
    )
    setup = {
        "num_processes": world_size,
        "distributed_type": accelerator.distributed_type.value,
        "backend": backend,
        "device_type": device.type,
        "ranks": ranks,
        "cpu": cpu_info(),
        "gpus": gpus,
        "versions": versions(),
    }
    warnings = []
    used_uuids = [entry["gpu_uuid"] for entry in ranks if entry["gpu_uuid"] is not None]
    if len(set(used_uuids)) < len(used_uuids) and len({entry["host"] for entry in ranks}) == 1:
        warnings.append("two processes drive the same GPU: check gpu_ids in the config and CUDA_VISIBLE_DEVICES")

    # ----------------------------------------------------------------------- links between GPUs
    no_smi = (None, smi_reason or "nvidia-smi lists no GPU")
    topology_text, topology_reason = run_command(["nvidia-smi", "topo", "-m"]) if smi_gpus else no_smi
    nvlink_text, nvlink_reason = run_command(["nvidia-smi", "nvlink", "--status"]) if smi_gpus else no_smi
    topology = parse_topology(topology_text) if topology_text else {}
    nvlink = parse_nvlink_status(nvlink_text) if nvlink_text else {}
    peers = peer_access(gpus) if len(gpus) > 1 else {}
    # Test peer-to-peer copies instead of guessing: every ordered GPU pair, checked element by element.
    p2p = p2p_copy_check(gpus, args.p2p_copy_mb) if len(gpus) > 1 and accelerator.is_main_process else {}
    nvlink_present = None
    if topology or nvlink:
        nvlink_present = any(link.startswith("NV") for link in topology.values()) or any(
            gpu["active_links"] > 0 for gpu in nvlink.values()
        )
    used_smi_gpus = [gpu for gpu in smi_gpus or [] if gpu["uuid"] in set(used_uuids)]
    if cuda_seen and world_size == 1 and len(gpus) > 1:
        # One process that sees several GPUs (the device_map config): describe the link between them.
        used_smi_gpus = [gpu for gpu in smi_gpus or [] if gpu["uuid"] in {entry["uuid"] for entry in gpus}]
    participants = world_size if world_size > 1 else len(gpus)
    link = believed_link(
        participants, device.type, {entry["host"] for entry in ranks}, used_smi_gpus, topology, nvlink, peers
    )
    setup["links"] = {
        "nvidia_smi": smi_gpus if smi_gpus is not None else {"unavailable": smi_reason},
        "peer_access": peers if len(gpus) > 1 else {"unavailable": f"{len(gpus)} GPU(s) visible: no pair to check"},
        "p2p_copy": p2p
        if p2p
        else {
            "unavailable": f"{len(gpus)} GPU(s) visible: no pair to copy between"
            if len(gpus) < 2
            else "tested by the main process only"
        },
        "topology": topology if topology_text else {"unavailable": topology_reason},
        "nvlink_status": nvlink if nvlink_text else {"unavailable": nvlink_reason},
        "nvlink_present": nvlink_present,
        "believed_link": link,
    }
    if peers and not all(peers.values()):
        missing = ", ".join(pair for pair, ok in peers.items() if not ok)
        warnings.append(f"no peer access for GPU pair(s) {missing}: NCCL copies through host memory")
    if any(not entry["correct"] for entry in p2p.values()):
        warnings.append(
            "a direct GPU-to-GPU copy returned WRONG data (links.p2p_copy): NCCL's P2P transport would corrupt "
            "gradients; update the driver, and until then NCCL_P2P_DISABLE=1 routes NCCL through host memory"
        )
    if nvlink_present and os.environ.get("NCCL_P2P_DISABLE") == "1":
        warnings.append("NVLink is present but NCCL_P2P_DISABLE=1 is set, so NCCL will not use it")
    driver = next((gpu["driver_version"] for gpu in smi_gpus or []), None)
    setup["rtx40_caveat"] = rtx40_caveat([gpu["name"] for gpu in gpus], driver)
    setup["nccl_environment"] = {name: value for name, value in sorted(os.environ.items()) if name.startswith("NCCL_")}

    # ----------------------------------------------------------------------- all-reduce sweep
    # torch.distributed directly, not accelerator.reduce: reduce() clones the tensor before the
    # all-reduce (and divides for "mean"), so timing it would add a copy of the whole buffer to every
    # measurement. A bandwidth test must time the bare, in-place collective.
    sweep = {"sizes": [], "iterations": args.iterations, "warmup": args.warmup, "dtype": "float32"}
    if world_size == 1:
        sweep.update(
            skipped=True,
            reason="1 process: an all-reduce needs at least 2 processes, so there is no link to "
            "measure (launch with accelerate_configs/ddp_2gpu.yaml)",
        )
    else:
        sweep["skipped"] = False
        for size_mb in args.sizes_mb:
            size_bytes = size_mb * MB
            tensor = torch.empty(size_bytes // 4, dtype=torch.float32, device=device)
            # Checked before the timing and again after it: a link can break only under sustained load.
            # The timed all-reduces sum in place again and again (values grow as n**k), so they are
            # not checked themselves; the check needs a fresh rank + 1 fill.
            checks = [checked_allreduce(tensor, rank, world_size)]
            for _ in range(args.warmup):
                dist.all_reduce(tensor)
            synchronize(device)
            accelerator.wait_for_everyone()  # all ranks start the clock together
            start = time.perf_counter()
            for _ in range(args.iterations):
                dist.all_reduce(tensor)
            synchronize(device)
            elapsed = (time.perf_counter() - start) / args.iterations
            checks.append(checked_allreduce(tensor, rank, world_size))
            del tensor
            failed = next((check for check in checks if not check["correct"]), None)
            per_rank = gather({"time_s": elapsed, "failed_check": failed})
            # The collective is done when the slowest rank is: time it by the slowest.
            time_s = max(entry["time_s"] for entry in per_rank)
            algbw = size_bytes / time_s / GB
            busbw = bus_bandwidth(algbw, world_size)
            peak = link["nominal_peak_gb_per_s"]
            broken = {str(r): entry["failed_check"] for r, entry in enumerate(per_rank) if entry["failed_check"]}
            sweep["sizes"].append(
                {
                    "size_mb": size_mb,
                    "bytes": size_bytes,
                    "time_s": time_s,
                    "algbw_gb_per_s": algbw,
                    "busbw_gb_per_s": busbw,
                    "busbw_vs_peak": busbw / peak if peak else None,
                    "correct": not broken,
                    "wrong_on_ranks": broken,
                }
            )
    broken_sizes = [entry for entry in sweep["sizes"] if not entry["correct"]]
    sweep["all_correct"] = None if sweep["skipped"] else not broken_sizes
    setup["allreduce"] = sweep
    setup["warnings"] = warnings
    setup["config"] = config

    # ----------------------------------------------------------------------- summary
    cpu = setup["cpu"]
    lines = [
        f"processes: {world_size} ({setup['distributed_type']}, backend {backend or 'none'}) on "
        f"{', '.join(sorted({entry['host'] for entry in ranks}))}"
    ]
    for gpu in gpus:
        lines.append(
            f"GPU {gpu['index']}: {gpu['name']}, {gpu['memory_total_gib']} GiB, compute capability "
            f"{gpu['compute_capability']}"
        )
    if not gpus:
        lines.append("GPUs: none visible to torch (CUDA not available)")
    lines.append(
        f"CPU: {cpu['model']}, {cpu['usable_cores']} usable of {cpu['logical_cores']} logical cores "
        f"({cpu['physical_cores']} physical), RAM {cpu['ram_total_gib']} GiB ({cpu['ram_available_gib']} GiB "
        f"available), {cpu['torch_threads_per_process']} torch thread(s) per process"
    )
    lines.append("versions: " + ", ".join(f"{name} {value}" for name, value in setup["versions"].items()))
    lines.append(
        "peer access: "
        + (
            ", ".join(f"{pair} {'yes' if ok else 'NO'}" for pair, ok in peers.items())
            if peers
            else setup["links"]["peer_access"]["unavailable"]
        )
    )
    if p2p:
        lines.append(
            "P2P copy: "
            + ", ".join(
                f"{pair} {'ok' if entry['correct'] else 'WRONG DATA'} {entry['gb_per_s']:.1f} GB/s"
                f"{'' if entry['peer_access'] else ' (no peer access: via host memory)'}"
                for pair, entry in p2p.items()
            )
        )
    lines.append(
        "NVLink: "
        + ({True: "present", False: "absent"}.get(nvlink_present) or f"unknown ({nvlink_reason or topology_reason})")
    )
    if topology:
        lines.append(
            "topology: " + ", ".join(f"GPU{pair.replace('-', '-GPU')} {kind}" for pair, kind in topology.items())
        )
    caveat = setup["rtx40_caveat"]
    environment = ", ".join(
        f"{name}={value if value is not None else 'unset'}" for name, value in caveat["environment"].items()
    )
    if caveat["applies"]:
        lines.append(
            f"RTX 40 caveat: APPLIES to {', '.join(caveat['gpus'])}. {caveat['note']} Here: Accelerate "
            f"{'disables' if caveat['accelerate_disables_p2p_and_ib'] else 'does not disable'} P2P/IB "
            f"(driver {driver}); {environment}"
        )
    else:
        lines.append(f"RTX 40 caveat: does not apply (no GPU named '{RTX40}...'); {environment}")
    peak_words = (
        f"nominal peak {link['nominal_peak_gb_per_s']} GB/s" if link["nominal_peak_gb_per_s"] else "no nominal peak"
    )
    lines.append(f"link: {link['name']}, {peak_words} ({link['reason']})")
    if sweep["skipped"]:
        lines.append(f"all-reduce sweep: skipped, {sweep['reason']}")
    else:
        lines.append(
            f"all-reduce sweep: {world_size} processes over {backend}, float32 sum, {args.iterations} timed "
            f"after {args.warmup} warm-up per size; every element checked == {world_size * (world_size + 1) // 2}"
        )
        lines.append(f"  {'size':>8} {'time':>11} {'algbw':>12} {'busbw':>12} {'busbw/peak':>10}  result")
        for entry in sweep["sizes"]:
            ratio = f"{entry['busbw_vs_peak']:.0%}" if entry["busbw_vs_peak"] is not None else "-"
            lines.append(
                f"  {entry['size_mb']:>5} MB {entry['time_s'] * 1e3:>8.3f} ms {entry['algbw_gb_per_s']:>7.2f} GB/s "
                f"{entry['busbw_gb_per_s']:>7.2f} GB/s {ratio:>10}  {'ok' if entry['correct'] else 'BROKEN'}"
            )
    for entry in broken_sizes:
        for broken_rank, check in entry["wrong_on_ranks"].items():
            lines.append(
                f"BROKEN: all-reduce of {entry['size_mb']} MB gave wrong sums on rank {broken_rank}: "
                f"{check['wrong_elements']} of {check['elements']} elements, first at index "
                f"{check['first_wrong_index']} "
                f"= {check['first_wrong_value']} (expected {check['expected']}). The link corrupts data silently; "
                "links.p2p_copy in setup.json says whether direct GPU-to-GPU copies are at fault."
            )
    for warning in warnings:
        lines.append(f"warning: {warning}")
    accelerator.print("\n".join(lines))

    # ----------------------------------------------------------------------- save
    path = write_results(accelerator, output_dir, setup, filename="setup.json")  # atomic: tmp file, then rename
    accelerator.wait_for_everyone()  # nobody exits (and a failing exit stops the others) before the file exists
    accelerator.print(f"wrote {path}")
    accelerator.end_training()
    if broken_sizes:
        sizes = ", ".join(f"{entry['size_mb']} MB" for entry in broken_sizes)
        raise RecipeError(f"BROKEN link: the all-reduce gave wrong sums for {sizes} (details in {path}).")


if __name__ == "__main__":
    with report_recipe_errors():  # a problem every process finds: its paragraph printed once, named to the launcher
        main()
