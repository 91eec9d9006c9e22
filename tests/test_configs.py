"""Every file in accelerate_configs/ loads with Accelerate's own loader and documents itself."""

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from harness.launch import CONFIGS

CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))


def test_the_two_gpu_configs_exist():
    names = {path.name for path in CONFIG_FILES}
    assert {"ddp_2gpu.yaml", "model_sharding_2gpu.yaml", "single_gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_loads_with_accelerate(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    text = path.read_text()
    assert text.startswith("#"), "each config starts with a comment saying what it is for"
    assert "accelerate launch --config_file accelerate_configs/" in text, "the header gives the launch line"
    if config.num_processes > 1 and config.num_machines == 1:
        # 0 lets the OS pick a free port: two runs started at once never collide.
        assert config.main_process_port == 0


def test_ddp_and_sharding_configs_mean_what_they_say():
    ddp = load_config_from_file(str(CONFIGS / "ddp_2gpu.yaml"))
    assert ddp.distributed_type == DistributedType.MULTI_GPU and ddp.num_processes == 2
    sharding = load_config_from_file(str(CONFIGS / "model_sharding_2gpu.yaml"))
    # Accelerate refuses to train a device_map model in a distributed mode: 1 process, 'NO'.
    assert sharding.distributed_type == DistributedType.NO and sharding.num_processes == 1
    assert sharding.gpu_ids == "all"


def test_our_configs_pass_the_config_checker():
    from tools.config_check import config_problems

    assert [problem for path in CONFIG_FILES for problem in config_problems(path)] == []


def test_config_checker_catches_what_launches_silently_wrong(tmp_path):
    """`distributed_type: NO` unquoted with 2 processes launches without error but runs ONE process."""
    import subprocess
    import sys

    from harness.launch import REPO

    unquoted = tmp_path / "unquoted_no.yaml"
    unquoted.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nnum_machines: 1\nnum_processes: 2\n"
    )
    single_multi = tmp_path / "multi_gpu_one_process.yaml"
    single_multi.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 1\n"
    )
    run = subprocess.run(
        [sys.executable, "tools/config_check.py", str(unquoted), str(single_multi), str(CONFIGS / "ddp_2gpu.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert "distributed_type: NO is unquoted, so YAML reads it as False; write distributed_type: 'NO'" in run.stdout
    assert "Accelerate starts ONE process" in run.stdout
    assert "MULTI_GPU with num_processes: 1 trains on one process only" in run.stdout
    assert "ddp_2gpu.yaml" not in run.stdout


def test_fsdp_headers_describe_the_qlora_loader_the_recipe_uses():
    """Under an FSDP config llm_finetune.py loads a QLoRA base one decoder layer at a time, each sharded before the
    next is read (recipes/llm_kit/sharded_4bit.py): a header that speaks of QLoRA says so and names the module."""
    for path in CONFIG_FILES:
        header = path.read_text().split("\ncompute_environment:")[0]
        if "QLoRA" in header and load_config_from_file(str(path)).distributed_type == DistributedType.FSDP:
            qlora = header[header.index("QLoRA") :]
            assert "recipes/llm_kit/sharded_4bit.py" in qlora and "one decoder layer at a time" in qlora, path.name
