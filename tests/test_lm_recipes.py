"""The two language-model recipes: recipes/train_lm.py (single, ddp, device_map; fsdp in test_fsdp.py) and
recipes/pipeline_lm.py (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-V), which is train_lm.py plus marked additions. A
naive device_map split and every pipeline schedule train exactly like one unsplit device, evaluation counts every
block once, the saved model loads and generates, and a resumed run ends where an uninterrupted one does."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from harness.launch import (
    ONE_PROCESS,
    REPO,
    Job,
    devices_for,
    launch,
    launch_all,
    read_facts,
    read_results,
    visible_gpus,
)
from safetensors.torch import load_file

# Tiny preset, 5 optimizer steps of 2 accumulated batches of 8 blocks x 32 tokens. 13 validation
# blocks with evaluation batches of 4: the last batch is short (pipeline pads it, ddp's sharded
# loader repeats samples), which is what the "each block exactly once" check needs.
TINY = (
    "--model_size",
    "tiny",
    "--corpus_max_mb",
    "0.5",
    "--vocab_size",
    "512",
    "--block_size",
    "32",
    "--max_train_steps",
    "5",
    "--per_device_train_batch_size",
    "8",
    "--gradient_accumulation_steps",
    "2",
    "--per_device_eval_batch_size",
    "4",
    "--max_eval_samples",
    "13",
    "--sample_tokens",
    "8",
)
EVAL_BLOCKS, BLOCK = 13, 32
C_COMPILER = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
# interleaved1f1b and zbv: 2 stages per process, 4 stages of 1 block each (the tiny preset's 4 blocks).
MODES = ("single", "device_map", "gpipe", "1f1b", "ddp", "interleaved1f1b", "zbv")
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")
TRAIN, PIPELINE = "train_lm.py", "pipeline_lm.py"


def launch_two_at_a_time(jobs: dict[str, tuple]) -> dict:
    """``jobs``: name -> (config, recipe, *args). Every run on the kind of device the 2-process runs get (CPU
    processes where there are fewer than 2 GPUs), so the runs compare exactly; each seen by the observer (its model
    state bytes, device_map hooks, compiled modules)."""
    jobs = {
        name: Job(config, recipe, tuple(args), kwargs={"observe": True})
        for name, (config, recipe, *args) in jobs.items()
    }
    return launch_all(jobs, cpu_only=visible_gpus() < 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per mode, same seed, data and global batch (16 blocks per optimizer step), shared by the tests."""
    root = tmp_path_factory.mktemp("pipeline_lm")
    specs = {
        # Listed so that a 1-process run starts beside each 2-process one.
        "gpipe": ("pipeline_2gpu.yaml", PIPELINE, "--pipeline_schedule", "gpipe", "--num_microbatches", "2"),
        "single": ("single_gpu.yaml", TRAIN),
        "1f1b": (
            "pipeline_2gpu.yaml",
            PIPELINE,
            "--pipeline_schedule",
            "1f1b",
            "--num_microbatches",
            "4",
            "--checkpointing_steps",
            "2",
        ),
        # --checkpointing_steps: the resume tests below start from these runs' step-2 checkpoints.
        "device_map": ("model_sharding_2gpu.yaml", TRAIN, "--parallelism", "device_map", "--checkpointing_steps", "2"),
        # 2 processes x 4 blocks = the same 16-block global batch, in the same order (seedable sampler).
        "ddp": ("ddp_2gpu.yaml", TRAIN, "--per_device_train_batch_size", "4"),
        # DDP with its gradients compressed to fp16 for the all-reduce (Accelerate's communication hook).
        "ddp_fp16_hook": (
            "ddp_2gpu.yaml",
            TRAIN,
            "--per_device_train_batch_size",
            "4",
            "--ddp_comm_hook",
            "fp16",
            "--ddp_bucket_cap_mb",
            "1",
        ),
        # Several stages per process: stages 0, 2 | 1, 3 (loop) and 0, 3 | 1, 2 (V), one block each.
        "interleaved1f1b": (
            "pipeline_2gpu.yaml",
            PIPELINE,
            "--pipeline_schedule",
            "interleaved1f1b",
            "--num_microbatches",
            "4",
            "--checkpointing_steps",
            "2",
        ),
        # --eval_before_training: evaluation, then training, through the zbv schedules (see zbv_eval_schedule).
        "zbv": (
            "pipeline_2gpu.yaml",
            PIPELINE,
            "--pipeline_schedule",
            "zbv",
            "--num_microbatches",
            "4",
            "--eval_before_training",
        ),
    }
    if C_COMPILER:
        # --compile: Accelerate's regional compilation (inductor, which builds its CPU kernels with a C compiler). No
        # evaluation or sample: their other shapes would compile again, and the curve is what this run is compared on.
        specs["compile"] = ("single_gpu.yaml", TRAIN, "--compile", "--skip_eval", "--sample_tokens", "0")
    finished = launch_two_at_a_time(
        {
            name: (config, recipe, *TINY, *args, "--output_dir", root / name)
            for name, (config, recipe, *args) in specs.items()
        }
    )
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
    return {
        name: {"dir": root / name, "results": read_results(root / name), "log": run.output}
        for name, run in finished.items()
    }


def relative_difference(curve, reference) -> float:
    assert len(curve) == len(reference) == 5
    return float(np.max(np.abs(np.array(curve) - reference) / np.abs(reference)))


def max_weight_difference(dir_a, dir_b) -> float:
    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


@pytest.mark.slow
def test_every_mode_ran_as_asked(runs):
    expected = {
        "single": ("single", 1, 1),
        "device_map": ("device_map", 1, 2),
        "gpipe": ("pipeline", 2, 2),
        "1f1b": ("pipeline", 2, 2),
        "ddp": ("ddp", 2, 1),
        "interleaved1f1b": ("pipeline", 2, 4),
        "zbv": ("pipeline", 2, 4),
    }
    for name, (parallelism, processes, stages) in expected.items():
        results = runs[name]["results"]
        assert (results["parallelism"], results["num_processes"], results["num_stages"]) == (
            parallelism,
            processes,
            stages,
        ), name
        assert results["global_batch_size"] == 16 and results["completed_steps"] == 5, name
        assert results["config"]["gradient_accumulation_steps"] == 2, name
    # Two GPUs, or two CPU "devices": the same split, hooks and moves.
    split = runs["device_map"]["results"]
    assert split["device_map_devices"] == (["cuda:0", "cuda:1"] if visible_gpus() >= 2 else ["cpu", "cpu"])
    assert read_facts(runs["device_map"]["dir"])["device_map/hooks"]["rank0"] == split["device_map"]  # the observer
    assert runs["device_map"]["results"]["blocks_per_stage"] == runs["1f1b"]["results"]["blocks_per_stage"]
    assert len(runs["device_map"]["results"]["blocks_per_stage"]) == 2


@pytest.mark.slow
def test_device_map_split_trains_exactly_like_one_device(runs):
    single, split = runs["single"]["results"], runs["device_map"]["results"]
    assert relative_difference(split["train/loss_curve"], single["train/loss_curve"]) <= 1e-6
    assert max_weight_difference(runs["single"]["dir"], runs["device_map"]["dir"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_trains_like_one_process_with_gradient_accumulation(runs, schedule):
    single, pipeline = runs["single"]["results"], runs[schedule]["results"]
    assert pipeline["pipeline_schedule"] == schedule
    assert relative_difference(pipeline["train/loss_curve"], single["train/loss_curve"]) <= 1e-4
    # The stages' weights, gathered into one model, are the 1-process model's weights.
    assert max_weight_difference(runs["single"]["dir"], runs[schedule]["dir"]) <= 1e-4


@pytest.mark.slow
def test_several_stages_per_process_are_laid_out_as_the_schedule_needs(runs):
    """interleaved1f1b: process r holds stages r and r + 2 (a loop); zbv: r and 3 - r (a V, so process 1 holds the two
    middle stages and process 0 both ends). Every stage gets one whole block (the split's plan over 4 parts)."""
    for schedule, layout in (("interleaved1f1b", [[0, 2], [1, 3]]), ("zbv", [[0, 3], [1, 2]])):
        results = runs[schedule]["results"]
        assert results["stages_per_process"] == 2, schedule
        assert results["pipeline/stages_of_processes"] == layout, schedule
        assert results["blocks_per_stage"] == [1, 1, 1, 1], schedule
        assert sum(results["pipeline/process_cost_share"]) == pytest.approx(1.0), schedule
    for schedule in ("gpipe", "1f1b"):
        assert runs[schedule]["results"]["pipeline/stages_of_processes"] == [[0], [1]], schedule


@pytest.mark.slow
@pytest.mark.skipif(not C_COMPILER, reason="torch.compile's CPU backend (inductor) needs a C compiler: none found")
def test_compile_compiles_each_block_and_trains_like_eager(runs):
    """--compile (regional: each decoder block wrapped by torch.compile, the first block's graph reused by the others)
    trains the same model: the loss curve of the eager run within fp32 rounding of inductor's fused kernels. Without
    it (or with the flag ignored) no module runs compiled; with a KV cache in the step each block would compile its
    own graph and past 8 fall back to eager (hence use_cache=False in the recipe's forward)."""
    compiled, eager = runs["compile"]["results"], runs["single"]["results"]
    modules = {
        name: read_facts(runs[name]["dir"])["compile/compiled_modules"]["rank0"]  # seen by the observer
        for name in ("compile", "single")
    }
    assert modules["compile"] >= 4 and modules["single"] == 0  # the tiny's 4 blocks
    assert relative_difference(compiled["train/loss_curve"], eager["train/loss_curve"]) < 1e-5
    assert "recompile_limit" not in runs["compile"]["log"]


@pytest.mark.slow
def test_ddp_trains_like_one_process_with_the_same_global_batch(runs):
    single, ddp = runs["single"]["results"], runs["ddp"]["results"]
    assert relative_difference(ddp["train/loss_curve"], single["train/loss_curve"]) <= 1e-4


@pytest.mark.slow
def test_the_fp16_communication_hook_compresses_the_gradients_and_still_trains(runs):
    """The all-reduce in fp16 rounds every gradient to 11 significant bits: the losses move (the hook is in effect;
    without it they would equal plain DDP's to ~1e-7) but stay within 1e-3 of plain DDP's over 5 steps."""
    ddp, hooked = runs["ddp"]["results"], runs["ddp_fp16_hook"]["results"]
    assert hooked["config"]["ddp_comm_hook"] == "fp16" and hooked["config"]["ddp_bucket_cap_mb"] == 1
    difference = relative_difference(hooked["train/loss_curve"], ddp["train/loss_curve"])
    assert 0 < difference <= 1e-3


@pytest.mark.slow
def test_loss_goes_down(runs):
    results = runs["single"]["results"]
    curve = results["train/loss_curve"]
    assert curve[-1] < curve[0]
    vocabulary = results["config"]["model_config"]["vocab_size"]
    assert results["eval/perplexity"] < vocabulary  # below the uniform guess's perplexity


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_validation_perplexity_counts_every_block_exactly_once(runs, mode):
    results, reference = runs[mode]["results"], runs["single"]["results"]
    assert results["data/validation_blocks"] == EVAL_BLOCKS
    assert results["eval/num_blocks"] == EVAL_BLOCKS
    assert results["eval/num_tokens"] == EVAL_BLOCKS * (BLOCK - 1)  # next-token targets per block
    assert results["eval/perplexity"] == pytest.approx(math.exp(results["eval/loss"]), rel=1e-12)
    assert results["eval/perplexity"] == pytest.approx(reference["eval/perplexity"], rel=1e-4)


@pytest.mark.slow
def test_results_json_holds_what_users_compare(runs):
    for name in MODES:
        results = runs[name]["results"]
        for key in (
            "parallelism",
            "perf/tokens_per_sec",
            "perf/step_time_s",
            "memory/peak_gib",
            "eval/perplexity",
            "num_processes",
            "distributed/backend",
            "config",
        ):
            assert key in results, (name, key)
        if results["parallelism"] == "pipeline":
            assert {"pipeline_schedule", "num_microbatches", "pipeline/ideal_bubble_fraction"} <= set(results), name
        assert results["perf/tokens_per_sec"] > 0 and results["perf/step_time_s"] > 0, name
        assert results["config"]["parallelism_resolved"] == results["parallelism"], name
    # (p - 1) / (m + p - 1): GPipe m=2 -> 1/3, 1F1B m=4 -> 1/5; the naive split is m = 1 -> 1/2.
    assert runs["gpipe"]["results"]["pipeline/ideal_bubble_fraction"] == pytest.approx(1 / 3)
    assert runs["1f1b"]["results"]["pipeline/ideal_bubble_fraction"] == pytest.approx(1 / 5)
    assert runs["1f1b"]["results"]["num_microbatches"] == 4
    # Interleaved, v = 2 stages per process: (p - 1) / (v m + p - 1) = 1/9 of the step, (p - 1) / (v m) = 1/8 of the
    # ideal compute time (Narayanan et al.'s form); ZB-V's ideal is no bubble.
    interleaved = runs["interleaved1f1b"]["results"]
    assert interleaved["pipeline/ideal_bubble_fraction"] == pytest.approx(1 / 9)
    assert interleaved["pipeline/ideal_bubble_over_compute"] == pytest.approx(1 / 8)
    assert runs["1f1b"]["results"]["pipeline/ideal_bubble_over_compute"] == pytest.approx(1 / 4)
    assert runs["zbv"]["results"]["pipeline/ideal_bubble_fraction"] == 0.0
    # zbv evaluated before training too, and trained on from there.
    assert runs["zbv"]["results"]["eval/perplexity_before_training"] > runs["zbv"]["results"]["eval/perplexity"]
    # Peak memory per stage (one process each) for the pipeline.
    assert set(runs["1f1b"]["results"]["memory/peak_gib"]) == {
        f"rank{rank}/{device}" for rank, device in enumerate(devices_for(2))
    }


@pytest.mark.slow
def test_fit_planner_model_state_matches_the_measured_bytes(runs):
    """The fit planner (tools/plan.py) against exact tensor bytes of these runs: its model-state
    estimate for fp32 AdamW (4 + 4 + 8 bytes per parameter), on the split the recipe makes, is within
    15 % of the model-state bytes the observer saw per setup and per rank (pipeline: per stage). The device_map run
    is one process: its total is checked, and each device's parameters against the saved weights of
    the modules the run put on it."""

    from tools.planner import plan, preset_shape

    single = runs["single"]["results"]
    shape = preset_shape("tiny", vocab_size=single["config"]["model_config"]["vocab_size"])
    assert shape.num_parameters == single["model/num_parameters"]
    setups = plan(shape, gpus=2, gpu_memory_gib=1, seq_len=BLOCK, micro_batch=4, mixed_precision="no")["setups"]

    def assert_close(estimated: float, measured: float, what: str) -> None:
        assert abs(estimated / measured - 1) <= 0.15, (
            f"{what}: estimated {estimated:,.0f} B, measured {measured:,.0f} B"
        )

    per_rank = {
        "single": setups["single"]["devices"],
        "ddp": setups["ddp"]["devices"],
        "gpipe": setups["pipeline"]["devices"],
        "1f1b": setups["pipeline"]["devices"],
    }
    if "fsdp" in runs:  # full shard: 1/N of every parameter, gradient and optimizer state per rank
        per_rank["fsdp"] = setups["fsdp"]["devices"]
    for mode, devices in per_rank.items():
        measured = read_facts(runs[mode]["dir"])["memory/model_state_bytes"]
        assert len(measured) == len(devices), mode
        for rank, device in enumerate(devices):
            for part in ("parameters", "gradients", "optimizer"):
                assert_close(device[part], measured[f"rank{rank}"][part], f"{mode} rank {rank} {part}")
            assert_close(device["model_state"], measured[f"rank{rank}"]["total"], f"{mode} rank {rank}")
    for mode in ("gpipe", "1f1b", "device_map"):
        assert setups["pipeline"]["blocks_per_device"] == runs[mode]["results"]["blocks_per_stage"], mode
    split = runs["device_map"]
    assert_close(
        sum(device["model_state"] for device in setups["device_map"]["devices"]),
        read_facts(split["dir"])["memory/model_state_bytes"]["rank0"]["total"],
        "device_map (one process)",
    )
    first_blocks = split["results"]["blocks_per_stage"][0]
    held = [0, 0]
    for name, tensor in load_file(split["dir"] / "model.safetensors").items():
        on_first = name.startswith("model.embed_tokens.") or (
            name.startswith("model.layers.") and int(name.split(".")[2]) < first_blocks
        )
        held[0 if on_first else 1] += tensor.numel() * tensor.element_size()
    for index, device in enumerate(setups["device_map"]["devices"]):
        assert_close(device["parameters"], held[index], f"device_map device {index} parameters")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["1f1b", "device_map"])
def test_saved_model_loads_and_generates_the_recipes_sample(runs, mode):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, results = runs[mode]["dir"], runs[mode]["results"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer(results["sample/prompt"], return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == prompt.shape[1] + 8
    # Greedy: the saved weights are the ones the recipe generated its sample with.
    assert tokenizer.decode(generated[0]) == results["sample/text"]


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory):
    """Runs that start from the first runs' outputs: what a run stopped after step 2 leaves behind
    (its tokenizer and checkpoints/step_000002, from the 1f1b, interleaved1f1b and device_map runs), resumed with
    --resume_from_checkpoint latest and trained to the end; and a run that starts from a saved model."""
    root = tmp_path_factory.mktemp("resumed")
    jobs = {}
    for name, config, recipe, *args in (
        ("1f1b", "pipeline_2gpu.yaml", PIPELINE, "--num_microbatches", "4"),
        (
            "interleaved1f1b",
            "pipeline_2gpu.yaml",
            PIPELINE,
            "--pipeline_schedule",
            "interleaved1f1b",
            "--num_microbatches",
            "4",
        ),
        ("device_map", "model_sharding_2gpu.yaml", TRAIN, "--parallelism", "device_map"),
    ):
        stopped = root / name
        shutil.copytree(runs[name]["dir"] / "checkpoints" / "step_000002", stopped / "checkpoints" / "step_000002")
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(runs[name]["dir"] / tokenizer_file, stopped)
        jobs[name] = (config, recipe, *TINY, *args, "--resume_from_checkpoint", "latest", "--output_dir", stopped)
    # Also in this batch: a run that starts from the 1f1b run's saved (gathered) model and tokenizer.
    jobs["pretrained"] = (
        "model_sharding_2gpu.yaml",
        TRAIN,
        *TINY,
        "--parallelism",
        "device_map",
        "--model_name_or_path",
        runs["1f1b"]["dir"],
        "--eval_before_training",
        "--max_train_steps",
        "1",
        "--output_dir",
        root / "pretrained",
    )
    finished = launch_two_at_a_time(jobs)
    outputs = {}
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
        if name != "pretrained":
            assert "at step 2 (epoch 0, skipping 4 batches)" in run.output  # 2 steps x 2 accumulated batches
        outputs[name] = {"dir": root / name, "results": read_results(root / name)}
    return outputs


@pytest.mark.slow
def test_resumed_pipeline_ends_like_the_uninterrupted_run(runs, resumed):
    """Pipeline stages save and load their own state (weights, optimizer, scheduler) through the hooks of
    accelerator.save_state/load_state, which add every process's RNG states."""
    uninterrupted = runs["1f1b"]
    checkpoint = uninterrupted["dir"] / "checkpoints" / "step_000002"
    stage_files = {"stage_0", "stage_1", "progress.json", "pipeline.json"}
    assert {path.name for path in checkpoint.iterdir()} >= stage_files | {"random_states_0.pkl", "random_states_1.pkl"}
    assert resumed["1f1b"]["results"]["train/loss_curve"] == pytest.approx(
        uninterrupted["results"]["train/loss_curve"],
        rel=1e-6,  # the whole curve: steps 1-2 from the checkpoint
    )
    assert max_weight_difference(resumed["1f1b"]["dir"], uninterrupted["dir"]) <= 1e-6


@pytest.mark.slow
def test_resumed_interleaved_pipeline_ends_like_the_uninterrupted_run(runs, resumed):
    """Two stages per process: each stage's weights in its own folder, each process's optimizer, scheduler and RNG
    state in the folder of its first stage, and the layout in pipeline.json."""
    uninterrupted = runs["interleaved1f1b"]
    checkpoint = uninterrupted["dir"] / "checkpoints" / "step_000002"
    assert {path.name for path in checkpoint.iterdir()} >= {f"stage_{index}" for index in range(4)}
    # Process 1's optimizer state sits with its first stage, stage 1; none with its second, stage 3.
    assert (checkpoint / "stage_1" / "optimizer.bin").exists()
    assert not (checkpoint / "stage_3" / "optimizer.bin").exists()
    assert json.loads((checkpoint / "pipeline.json").read_text())["stages_of_processes"] == [[0, 2], [1, 3]]
    assert resumed["interleaved1f1b"]["results"]["train/loss_curve"] == pytest.approx(
        uninterrupted["results"]["train/loss_curve"],
        rel=1e-6,  # the whole curve: steps 1-2 from the checkpoint
    )
    assert max_weight_difference(resumed["interleaved1f1b"]["dir"], uninterrupted["dir"]) <= 1e-6


@pytest.mark.slow
def test_resumed_device_map_run_ends_like_the_uninterrupted_run(runs, resumed):
    """The other modes use accelerator.save_state/load_state and skip_first_batches."""
    uninterrupted = runs["device_map"]
    assert (uninterrupted["dir"] / "checkpoints" / "step_000002" / "optimizer.bin").exists()
    assert resumed["device_map"]["results"]["train/loss_curve"] == pytest.approx(
        uninterrupted["results"]["train/loss_curve"],
        rel=1e-6,  # the whole curve: steps 1-2 from the checkpoint
    )
    assert max_weight_difference(resumed["device_map"]["dir"], uninterrupted["dir"]) <= 1e-6


@pytest.mark.slow
def test_training_starts_from_a_saved_model_and_its_tokenizer(runs, resumed):
    """--model_name_or_path with the pipeline run's output folder: the gathered weights load (perplexity
    before training = the pipeline run's final perplexity) with the model's own tokenizer."""
    saved, pretrained = runs["1f1b"], resumed["pretrained"]
    assert pretrained["results"]["eval/perplexity_before_training"] == pytest.approx(
        saved["results"]["eval/perplexity"], rel=1e-5
    )
    assert (pretrained["dir"] / "tokenizer.json").read_text() == (saved["dir"] / "tokenizer.json").read_text()
    assert pretrained["results"]["completed_steps"] == 1


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory):
    """A tiny GPT-2 with its default dropout (0.1 on embeddings, attention and residuals), trained 3 steps by
    train_lm.py with and without --eval_before_training."""

    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from lm_kit.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("dropout")
    tokenizer = train_bpe_tokenizer((f"def f{i}(x):\n    return x * {i}\n" for i in range(200)), vocab_size=300)
    tokenizer.save_pretrained(root / "gpt2")
    eos = tokenizer.eos_token_id
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "gpt2")
    common = ("--model_name_or_path", root / "gpt2", "--corpus_max_mb", "0.5", "--block_size", "32")
    common = (*common, "--max_train_steps", "3", "--per_device_train_batch_size", "4", "--max_eval_samples", "4")
    common = (*common, "--sample_tokens", "0")
    jobs = {
        name: ("single_gpu.yaml", TRAIN, *common, *extra, "--output_dir", root / name)
        for name, extra in (("evaluated_first", ("--eval_before_training",)), ("trained_first", ()))
    }
    finished = launch_two_at_a_time(jobs)
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
    return {name: {"dir": root / name, "results": read_results(root / name)} for name in finished}


def test_evaluating_before_training_leaves_the_training_alone(dropout_runs):
    """An evaluation before training must not change the training: here its dropout masks, drawn from the global RNG,
    which a loader without a generator of its own draws a seed from at every pass (the evaluation loader has one)."""
    first, plain = dropout_runs["evaluated_first"], dropout_runs["trained_first"]
    assert first["results"]["eval/perplexity_before_training"] > 0
    assert "eval/perplexity_before_training" not in plain["results"]
    assert first["results"]["train/loss_curve"] == pytest.approx(plain["results"]["train/loss_curve"], rel=1e-6)
    assert max_weight_difference(first["dir"], plain["dir"]) <= 1e-6


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Each bad input run once (two at a time): in one process (``python recipe.py``, no launcher) where one process
    refuses it; the tests below read the messages."""
    root = tmp_path_factory.mktemp("refused")
    tiny_text = root / "tiny.txt"
    tiny_text.write_text("x = 1\n")
    (root / "without_config").mkdir()  # a folder of weights whose config.json was left behind
    (root / "without_config" / "model.safetensors").write_bytes(b"")
    cases = {
        "layers": ("model_sharding_2gpu.yaml", TRAIN, "--parallelism", "device_map", "--num_layers", "1"),
        "microbatches": (
            "pipeline_2gpu.yaml",
            PIPELINE,
            "--per_device_train_batch_size",
            "6",
            "--num_microbatches",
            "4",
        ),
        "interleaved_blocks": (
            "pipeline_2gpu.yaml",
            PIPELINE,
            "--pipeline_schedule",
            "interleaved1f1b",
            "--num_layers",
            "3",
        ),
        "block_size": (ONE_PROCESS, TRAIN, "--block_size", "512"),
        "device_map_two_processes": ("ddp_2gpu.yaml", TRAIN, "--parallelism", "device_map"),
        "compile_device_map": (ONE_PROCESS, TRAIN, "--parallelism", "device_map", "--compile"),
        "small_corpus": (ONE_PROCESS, TRAIN, "--train_file", tiny_text, "--validation_file", tiny_text),
        "no_config": (ONE_PROCESS, TRAIN, "--model_name_or_path", root / "without_config"),  # (a traceback before)
    }
    finished = launch_two_at_a_time(
        {
            name: (config, recipe, *TINY, *args, "--output_dir", root / name)
            for name, (config, recipe, *args) in cases.items()
        }
    )
    messages = {}
    for name, run in finished.items():
        assert run.returncode != 0, f"{name}: {run}"
        assert "error: " in run.output, f"{name}: {run}"  # RecipeError's paragraph, not a bare traceback
        messages[name] = " ".join(run.output.split())  # messages are wrapped at 100 columns
    return messages


@pytest.mark.slow
def test_fewer_decoder_layers_than_stages_is_refused(refusals):
    assert (
        "The model has 1 decoder layers but device_map needs at least one per stage (2 stages)" in refusals["layers"]
    )


@pytest.mark.slow
def test_batch_not_divisible_by_microbatches_is_refused(refusals):
    assert "--per_device_train_batch_size 6 does not divide into --num_microbatches 4" in refusals["microbatches"]


@pytest.mark.slow
def test_fewer_blocks_than_stages_is_refused(refusals):
    assert (
        "the model has 3 decoder blocks, fewer than the 4 stages of 2 processes x --stages_per_process 2"
        in refusals["interleaved_blocks"]
    )


@pytest.mark.slow
def test_block_size_beyond_the_models_positions_is_refused(refusals):
    assert "--block_size 512 is longer than the model's 256 positions" in refusals["block_size"]


def test_pipeline_with_one_process_is_refused(tmp_path):
    """pipeline_lm.py launched in 1 process, as a user might: its launch in the fast lane (``-m "not slow"``)."""
    run = launch("single_gpu.yaml", PIPELINE, *TINY, "--output_dir", tmp_path)
    assert run.returncode != 0 and "error: " in run.output, str(run)
    message = " ".join(run.output.split())
    assert "this launch has 1 process" in message and "accelerate_configs/pipeline_2gpu.yaml" in message


@pytest.mark.slow
def test_device_map_with_two_processes_is_refused(refusals):
    message = refusals["device_map_two_processes"]
    assert "Accelerate refuses to train a device_map model in a distributed mode" in message
    assert "accelerate_configs/model_sharding_2gpu.yaml" in message


@pytest.mark.slow
def test_compile_of_a_device_map_split_is_refused(refusals):
    message = refusals["compile_device_map"]
    assert "--compile works on a model prepare() wraps whole (single, ddp, fsdp), not on a device_map" in message


@pytest.mark.slow
def test_corpus_too_small_for_one_block_is_refused(refusals):
    assert "fewer than one block of --block_size 32" in refusals["small_corpus"]


@pytest.mark.slow
def test_a_model_folder_without_config_json_is_refused_saying_so(refusals):
    message = refusals["no_config"]
    assert "without_config' holds no config.json (it holds: model.safetensors), so transformers cannot tell" in message
    assert "Traceback" not in message and "model_type" not in message


def test_the_batch_split_decided_before_the_accelerator_is_the_one_the_chosen_parallelism_makes(monkeypatch):
    """train_lm.py decides how many processes split each batch (and with it the accumulation a resume keeps) from
    --parallelism and the launch's WORLD_SIZE, before the Accelerator exists; choose_parallelism names the parallelism
    after it is built. For every launch choose_parallelism accepts, the two agree: ddp and fsdp split each batch over
    every process, single and device_map over one."""
    import importlib.util
    import itertools
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType

    spec = importlib.util.spec_from_file_location("train_lm_under_test", REPO / "recipes" / TRAIN)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    from shared.errors import RecipeError

    accepted = []
    for requested, processes, fsdp, gpus in itertools.product(
        ("auto", "single", "ddp", "fsdp", "device_map"), (1, 2), (False, True), (0, 2)
    ):
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        monkeypatch.setenv("ACCELERATE_USE_FSDP", str(fsdp).lower())
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        kind = DistributedType.FSDP if fsdp else DistributedType.MULTI_GPU if processes > 1 else DistributedType.NO
        accelerator = SimpleNamespace(
            num_processes=processes, distributed_type=kind, device=torch.device("cuda" if gpus else "cpu")
        )
        try:
            chosen = recipe.choose_parallelism(accelerator, requested, "recipes/train_lm.py").name
        except RecipeError:
            continue
        accepted.append(chosen)
        expected = processes if chosen in ("ddp", "fsdp") else 1
        assert recipe.data_parallel_size_of(requested) == expected, (requested, processes, fsdp, gpus, chosen)
    assert set(accepted) == {"single", "ddp", "fsdp", "device_map"}


@pytest.fixture(scope="module")
def pipeline_recipe():
    """pipeline_lm.py imported as a module: its request checks are plain functions (the "microbatches" launch above
    shows the recipe calls them before any model work)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_lm_under_test", REPO / "recipes" / PIPELINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "request_args, message",
    [
        # batch 10 = 5 micro-batches of 2, but interleaved runs them in 5 // 2 = 2 rounds of equal size.
        (
            {"pipeline_schedule": "interleaved1f1b", "per_device_train_batch_size": 10, "num_microbatches": 5},
            "--pipeline_schedule interleaved1f1b runs the micro-batches in max(1, m // processes) = 2 rounds of equal "
            "size, and --num_microbatches 5 does not divide into 2",
        ),
        (
            {"pipeline_schedule": "interleaved1f1b", "num_microbatches": 1, "per_device_train_batch_size": 4},
            "--pipeline_schedule interleaved1f1b needs --num_microbatches >= the number of processes (2); got 1",
        ),
        ({"pipeline_schedule": "zbv", "stages_per_process": 3}, "--pipeline_schedule zbv holds exactly 2 stages"),
        ({"pipeline_schedule": "zbv", "num_microbatches": 2}, "zbv needs --num_microbatches >= 2 x processes - 1 = 3"),
        ({"pipeline_schedule": "1f1b", "num_microbatches": 1, "per_device_train_batch_size": 4}, "1f1b needs"),
        ({"pipeline_schedule": "gpipe", "stages_per_process": 2}, "runs one stage per process"),
    ],
    ids=["interleaved_rounds", "interleaved_few", "zbv_stages", "zbv_few", "1f1b_few", "gpipe_stages"],
)
def test_pipeline_requests_that_cannot_run_are_refused(pipeline_recipe, request_args, message):
    from argparse import Namespace

    from shared.errors import RecipeError

    args = Namespace(
        **{
            "pipeline_schedule": "1f1b",
            "per_device_train_batch_size": 8,
            "num_microbatches": 4,
            "stages_per_process": None,
            **request_args,
        }
    )
    with pytest.raises(RecipeError) as refused:
        pipeline_recipe.check_pipeline_request(
            **vars(args), eval_batch_size=args.num_microbatches, num_processes=2, mixed_precision="no"
        )
    assert message in " ".join(refused.value.message.split())


def test_pipeline_requests_that_can_run_get_their_stages_per_process(pipeline_recipe):
    from argparse import Namespace

    def stages(schedule, microbatches=4, stages_per_process=None):
        args = Namespace(
            pipeline_schedule=schedule,
            per_device_train_batch_size=8,
            num_microbatches=microbatches,
            stages_per_process=stages_per_process,
        )
        return pipeline_recipe.check_pipeline_request(
            **vars(args), eval_batch_size=8, num_processes=2, mixed_precision="no"
        )

    assert (stages("gpipe", 2), stages("1f1b"), stages("interleaved1f1b"), stages("zbv")) == (1, 1, 2, 2)
    assert stages("interleaved1f1b", 8, 4) == 4
