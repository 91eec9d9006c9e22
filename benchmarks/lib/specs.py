"""Run specs: what one launch of a recipe is (recipe, launcher, config, script, flags), and its command line.

The runner's matrices and the GPU check's plan are lists of these. A spec is a dict: ``setup``, ``recipe``, ``size``,
``launcher`` (``accelerate`` or ``torchrun``), ``config`` (a file in accelerate_configs/), ``script``, ``args``,
optionally ``launch_args`` (before the script), ``processes`` (torchrun), ``seeds`` (one per round).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lib.launch import REPO, accelerate_launch


def lm_args(
    size: str, *, steps: int, warmup: int, batch: int, block: int, vocab: int, corpus_mb: float, threads: int | None
) -> list[str]:
    """Flags that the LM recipes and benchmarks/studies/raw_ddp_lm.py share: same model, data, batch, steps."""
    args = [
        "--model_size",
        size,
        "--vocab_size",
        vocab,
        "--block_size",
        block,
        "--per_device_train_batch_size",
        batch,
        "--max_train_steps",
        steps,
        "--perf_warmup_steps",
        warmup,
        "--corpus_max_mb",
        corpus_mb,
    ]
    if threads is not None:
        args += ["--cpu_threads_per_process", threads]
    return [str(arg) for arg in args]


def lm_runs(size: str, setups: list[str], **shape) -> list[dict]:
    """Run specs for recipes/train_lm.py, recipes/pipeline_lm.py and the raw baseline at one size.

    Setup names: single, ddp, fsdp, device_map (train_lm.py), pipeline-<schedule>-m<M> (pipeline_lm.py), raw_ddp
    (torchrun, no Accelerate), and any of them + "+compile" / "+bf16" (e.g. single+bf16+compile).
    """
    common = lm_args(size, **shape)
    recipe_only = ["--sample_tokens", "0", "--skip_eval"]
    runs = []
    for setup in setups:
        base, *options = setup.split("+")
        extra = []
        for option in options:
            extra += {
                "compile": ["--compile"],
                "bf16": ["--mixed_precision", "bf16"],
                "bf16hook": ["--ddp_comm_hook", "bf16"],
                "fp16hook": ["--ddp_comm_hook", "fp16"],
            }[option]
        if base == "raw_ddp":
            runs.append(
                {
                    "setup": setup,
                    "recipe": "raw_ddp_lm",
                    "size": size,
                    "launcher": "torchrun",
                    "processes": 2,
                    "script": "benchmarks/studies/raw_ddp_lm.py",
                    "args": common + extra,
                }
            )
        elif base.startswith("pipeline-"):
            _, schedule, m = base.split("-")  # pipeline-gpipe-m4
            runs.append(
                {
                    "setup": setup,
                    "recipe": "pipeline_lm",
                    "size": size,
                    "launcher": "accelerate",
                    "config": "pipeline_2gpu.yaml",
                    "script": "recipes/pipeline_lm.py",
                    "args": common
                    + recipe_only
                    + ["--pipeline_schedule", schedule, "--num_microbatches", m.lstrip("m")]
                    + extra,
                }
            )
        else:
            config = {
                "single": "single_gpu.yaml",
                "ddp": "ddp_2gpu.yaml",
                "fsdp": "fsdp_2gpu.yaml",
                "device_map": "model_sharding_2gpu.yaml",
            }[base]
            runs.append(
                {
                    "setup": setup,
                    "recipe": "train_lm",
                    "size": size,
                    "launcher": "accelerate",
                    "config": config,
                    "script": "recipes/train_lm.py",
                    "args": common + recipe_only + ["--parallelism", base] + extra,
                }
            )
    return runs


def finetune_runs(
    setups: list[str],
    *,
    steps: int | None,
    warmup: int,
    max_train_samples: int | None = None,
    evaluate: bool = False,
    seeds: list[int] | None = None,
) -> list[dict]:
    """Run specs for recipes/transformer_finetune.py (the default MiniLM and docstring data).

    ``steps=None`` trains one whole epoch, so both sides of the group_by_length pair see the same samples. Setup
    options: ``fixed`` (every batch padded to --max_length: the plain loop of most examples), ``group_by_length``.
    ``seeds``: one per round (the runner adds ``--seed``), so rounds are independent trainings, for accuracy.
    """
    common = ["--perf_warmup_steps", str(warmup)] + ([] if evaluate else ["--skip_eval"])
    common += ["--max_train_steps", str(steps)] if steps else ["--num_train_epochs", "1"]
    common += ["--max_train_samples", str(max_train_samples)] if max_train_samples else []
    runs = []
    for setup in setups:
        base, *options = setup.split("+")
        config = {"single": "single_gpu.yaml", "ddp": "ddp_2gpu.yaml", "fsdp": "fsdp_2gpu.yaml"}[base]
        extra = ["--group_by_length"] if "group_by_length" in options else []
        extra += ["--pad_to_max_length"] if "fixed" in options else []
        runs.append(
            {
                "setup": setup,
                "recipe": "transformer_finetune",
                "size": "minilm-l6",
                "launcher": "accelerate",
                "config": config,
                "script": "recipes/transformer_finetune.py",
                "args": common + extra,
                **({"seeds": seeds} if seeds else {}),
            }
        )
    return runs


def llm_runs(setups: list[str], *, steps: int, warmup: int, base: str) -> list[dict]:
    """Run specs for recipes/llm_finetune.py on the model the ``llm-base`` group trains and keeps (``base``: its run
    folder, with ``{output_dir}`` for the runner's output folder). Setups: ``<method>-<N>p``, method full, lora or
    qlora, N processes (1: single_gpu.yaml, 2: ddp_2gpu.yaml)."""
    runs = []
    for setup in setups:
        method, processes = setup.split("-")
        args = [
            "--model_name_or_path",
            base,
            "--max_train_steps",
            str(steps),
            "--perf_warmup_steps",
            str(warmup),
            "--per_device_train_batch_size",
            "4",
            "--max_length",
            "256",
            "--skip_eval",
            "--lora_dropout",
            "0",
        ]
        args += {"full": ["--full_finetune", "--learning_rate", "1e-4"], "lora": [], "qlora": ["--load_in_4bit"]}[
            method
        ]
        config = {"1p": "single_gpu.yaml", "2p": "ddp_2gpu.yaml"}[processes]
        runs.append(
            {
                "setup": setup,
                "recipe": "llm_finetune",
                "size": "small",
                "launcher": "accelerate",
                "config": config,
                "script": "recipes/llm_finetune.py",
                "args": args,
            }
        )
    return runs


def command_for(spec: dict, run_dir: Path) -> list[str]:
    """The command line of one run spec, its output going to ``run_dir`` (``OUTPUT_DIR/work/<run_id>``). A recipe runs
    inside ``benchmarks/with_model_state.py``, which writes the bytes of model state each process holds beside its
    results.json (for the record's ``memory/model_state_bytes``); torchrun's raw baseline runs as it is."""
    if spec["launcher"] == "torchrun":
        prefix = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(spec["processes"]),
        ]
    else:
        prefix = accelerate_launch(spec["config"], *spec.get("launch_args", []))
        prefix.append(str(REPO / "benchmarks" / "with_model_state.py"))
    # "{output_dir}" in an argument: this runner's output folder (a later group reading an earlier group's run).
    output_dir = run_dir.parents[2]
    args = [str(arg).replace("{output_dir}", str(output_dir)) for arg in spec["args"]]
    return prefix + [str(REPO / spec["script"]), *args, "--output_dir", str(run_dir)]
