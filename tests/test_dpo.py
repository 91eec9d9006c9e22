"""The DPO recipe on a tiny Llama built here: the same steps in 1 process x 8 pairs, 2 x 4 and 1 x 4 x 2 accumulation
(DDP, FSDP2, FSDP2 with offload), an exact resume, a full fine-tune whose reference is computed before training, an
SFT adapter continued against its frozen copy, the reference equalities (the adapter switched off is the base; a
precomputed reference is the live one), log-probs over the completion tokens only, TRL's loss formulas and RPO's NLL
term, the three preference formats, TRL's defaults (dropout off, on GPT-2's shape too; the reference scored without
dropout; token ids as TRL's own preprocessing makes them), and the refusals. CPU processes stand in for GPUs."""

import collections
import json
import math
import shutil
import types
from functools import partial

import numpy as np
import pytest
import torch
from harness.launch import ONE_PROCESS, REPO, Job, launch, launch_all, read_facts, read_results, visible_gpus
from harness.models import save_tiny_llama
from safetensors.torch import load_file, save_file

RECIPE = "dpo.py"
# LoRA without dropout, 4 steps, AdamW's epsilon large enough that the weights read out the gradients compared
# (as tests/test_llm_finetune.py), a high learning rate so that 4 steps move the rewards; with RPO's NLL term.
EXACT = (
    "--max_train_steps",
    "4",
    "--adam_epsilon",
    "1e-4",
    "--learning_rate",
    "1e-2",
    "--logging_steps",
    "2",
    "--rpo_alpha",
    "0.5",
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama, its BPE tokenizer without chat template or pad token, the offline pairs in the three formats
    (explicit conversations, implicit-prompt conversations, strings in CSV), an SFT adapter with random weights (so
    that the SFT policy differs from the base) and LoRA dropout 0.1, and GPT-2's shape with GPT2Config's own dropout
    (0.1 on the embeddings, attention and residuals), with string pairs of which two have a prompt of 64+ tokens."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

    from dpo_kit.preference_data import stdlib_name_pairs

    folder = tmp_path_factory.mktemp("dpo_base")
    save_tiny_llama(folder, num_hidden_layers=2)
    rows = [dict(row) for row in stdlib_name_pairs()["train"].shuffle(seed=0).select(range(40))]
    # A system turn on every third pair, so that prompts differ in length.
    for index, row in enumerate(rows):
        if index % 3 == 0:
            row["prompt"] = [{"role": "system", "content": "Answer in one word."}] + row["prompt"]
    write_jsonl(folder / "pairs.jsonl", rows[:32])
    write_jsonl(folder / "pairs_validation.jsonl", rows[32:])
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    write_jsonl(folder / "implicit.jsonl", implicit[:32])
    strings = [
        {
            "prompt": r["prompt"][-1]["content"],
            "chosen": r["chosen"][0]["content"],
            "rejected": r["rejected"][0]["content"],
        }
        for r in rows
    ]
    datasets.Dataset.from_list(strings).to_csv(str(folder / "strings.csv"))
    torch.manual_seed(1)
    sft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.1),
    )
    sft.peft_config["default"].base_model_name_or_path = str(folder)
    sft.save_pretrained(folder / "sft_adapter")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    special = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "bos_token_id": 0}
    torch.manual_seed(2)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **special))
    assert gpt2.config.resid_pdrop == gpt2.config.attn_pdrop == gpt2.config.embd_pdrop == 0.1
    gpt2.save_pretrained(folder / "gpt2")
    tokenizer.save_pretrained(folder / "gpt2")
    long = [{**row, "prompt": (row["prompt"] + " ") * 8} for row in strings[:2]]  # 64+ tokens: dropped at 64
    write_jsonl(folder / "strings_long.jsonl", long + strings[:32])  # first: the pairs after them move up
    write_jsonl(folder / "strings_validation.jsonl", strings[32:])
    return folder


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def adapter(run) -> dict:
    return load_file(run["dir"] / "adapter_model.safetensors")


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[name] - b[name]).norm() / a[name].norm()).item() for name in a)


def pairs_data(base) -> tuple:
    """The tiny Llama and its explicit-prompt conversations, with their validation file."""
    return (
        "--model_name_or_path",
        base,
        "--train_file",
        base / "pairs.jsonl",
        "--validation_file",
        base / "pairs_validation.jsonl",
    )


def launch_runs(root, jobs: dict[str, Job]) -> dict:
    """A scenario's launches, each into ``root/name``, two at a time, every one on the kind of device the 2-process
    runs get (so that the exact comparisons compare like with like), and each must succeed. Name -> its folder,
    results.json and log."""
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    finished = launch_all(jobs, cpu_only=visible_gpus() < 2)
    out = {}
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
        out[name] = {"dir": root / name, "results": read_results(root / name), "log": run.output}
    return out


# ----------------------------------------------------------------------------- a new adapter: the same steps every way
@pytest.fixture(scope="module")
def lora(base, tmp_path_factory):
    """The same 8 pairs per step three ways, 1 x 8, 2 x 4 and 1 x 4 x 2, and 2 x 4 under FSDP2 and FSDP2 with CPU
    offload (their sharding seen by the observer); the 1 x 8 run also evaluates, scores answers and checkpoints, and is
    resumed from its step-2 checkpoint (in another process count: tests/conformance/test_resume.py). The 2 x 4 run is
    the one DPO launch whose processes the launcher starts, as a user's."""
    root = tmp_path_factory.mktemp("dpo_lora")
    data = pairs_data(base)
    checkpoint = ("--resume_from_checkpoint", root / "1x8" / "checkpoints" / "step_000002")
    jobs = {
        "1x8": Job(
            "single_gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "8", "--checkpointing_steps", "2")
            + ("--exact_match_samples", "4", "--per_device_eval_batch_size", "3"),
        ),
        "2x4": Job(
            "ddp_2gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "3"),
            kwargs={"forked": False},
        ),
        "1x4x2": Job(
            "single_gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--skip_eval"),
        ),
        "fsdp": Job(
            "fsdp_2gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4", "--skip_eval"),
            kwargs={"observe": True},
        ),
        "offload": Job(
            "fsdp_offload_2gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "4", "--skip_eval"),
            kwargs={"observe": True},
        ),
        # Resumed from the 1x8 run's step-2 checkpoint, to the same end.
        "resumed": Job(
            "single_gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "8", "--exact_match_samples", "4")
            + ("--per_device_eval_batch_size", "3", *checkpoint),
            after="1x8",
        ),
        # The 1x8 run requeued once it ended (in a copy of its folder): the same command, resuming latest.
        "requeued": Job(
            "single_gpu.yaml",
            RECIPE,
            (*data, *EXACT, "--per_device_train_batch_size", "8", "--checkpointing_steps", "2")
            + ("--exact_match_samples", "4", "--per_device_eval_batch_size", "3")
            + ("--resume_from_checkpoint", "latest"),
            after="1x8",
            prepare=lambda: shutil.copytree(root / "1x8", root / "requeued"),
        ),
    }
    return launch_runs(root, jobs)


@pytest.mark.slow
def test_one_process_two_processes_and_accumulation_give_the_same_steps(lora):
    """The step loss is the mean over every pair of the global batch, whatever the processes and accumulation."""
    reference = lora["1x8"]["results"]
    assert reference["global_batch_size"] == 8 and reference["completed_steps"] == 4
    # Step 1: the policy is the reference (a new adapter starts at zero), so every margin is 0 and the DPO loss log 2;
    # RPO adds 0.5 x the chosen tokens' NLL (exactly: the full fine-tune's test, which logs every step).
    assert reference["train/loss_curve"][0] > math.log(2) + 0.5
    assert reference["train/log"][-1]["train/nll_loss"] > 0
    for name in ("2x4", "1x4x2", "fsdp", "offload"):
        results = lora[name]["results"]
        assert results["global_batch_size"] == 8, name
        np.testing.assert_allclose(results["train/loss_curve"], reference["train/loss_curve"], rtol=1e-6, err_msg=name)
        for key in ("train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen", "train/nll_loss"):
            assert results[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), (name, key)
        assert max_relative_difference(adapter(lora[name]), adapter(lora["1x8"])) <= 1e-5, name
    assert lora["2x4"]["results"]["parallelism"] == "ddp" and lora["fsdp"]["results"]["parallelism"] == "fsdp"
    for name in ("fsdp", "offload"):  # seen by the observer
        for facts in read_facts(lora[name]["dir"])["fsdp/sharding"].values():
            assert facts["dtensor_parameters"] == facts["parameters"] > 0, name
    offloaded = read_facts(lora["offload"]["dir"])["fsdp/sharding"]
    assert all(facts["offloaded_parameters"] == facts["parameters"] for facts in offloaded.values())


@pytest.mark.slow
def test_trl_metrics_are_logged_per_step_and_on_the_validation_set(lora):
    results, two = lora["1x8"]["results"], lora["2x4"]["results"]
    assert [entry["step"] for entry in results["train/log"]] == [2, 4]
    names = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
    )
    for name in names:
        assert f"train/{name}" in results["train/log"][-1] and np.isfinite(results[f"eval/{name}"]), name
    # 8 validation pairs in batches of 3, over 2 processes too: each counted once, the same numbers.
    assert results["eval/num_pairs"] == two["eval/num_pairs"] == 8
    for name in ("eval/loss", *(f"eval/{name}" for name in names)):
        assert two[name] == pytest.approx(results[name], rel=1e-5, abs=1e-6), name
    assert results["eval/rewards/margins"] == pytest.approx(
        results["eval/rewards/chosen"] - results["eval/rewards/rejected"], abs=1e-6
    )
    assert results["perf/tokens_per_step"] > 0 and results["perf/samples_per_sec"] > 0
    assert results["perf/samples_per_step"] == 8
    assert results["eval/exact_match_num_prompts"] == 4 and "exact match before training" in lora["1x8"]["log"]


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(lora):
    resumed, full = lora["resumed"]["results"], lora["1x8"]["results"]
    assert resumed["resumed_from_step"] == 2
    assert resumed["train/loss_curve"] == full["train/loss_curve"]
    assert resumed["train/log"] == full["train/log"]
    assert all(torch.equal(a, b) for a, b in zip(adapter(lora["resumed"]).values(), adapter(lora["1x8"]).values()))
    assert resumed["eval/loss"] == full["eval/loss"]


# ----------------------------------------------------------------------------- a full fine-tune
@pytest.mark.slow
def test_a_requeued_run_that_had_ended_keeps_its_trl_metrics(lora):
    """A scheduler's requeue of a run that ended: resumed from the checkpoint of its last step, it trains no step and
    logs no window, and its results.json keeps the last window's TRL metrics (train/rewards/..., the rate)."""
    requeued, full = lora["requeued"]["results"], lora["1x8"]["results"]
    assert requeued["resumed_from_step"] == requeued["completed_steps"] == 4
    assert requeued["train/log"] == full["train/log"]
    last = {key: value for key, value in full.items() if key.startswith("train/") and key != "train/log"}
    assert {"train/rewards/accuracies", "train/rewards/margins", "train/learning_rate"} <= last.keys()
    assert {key: requeued.get(key) for key in last} == last


@pytest.fixture(scope="module")
def full(base, tmp_path_factory):
    """A full fine-tune in 2 processes with IPO, on implicit-prompt conversations: one pass of reference log-probs
    before training, then one model."""
    root = tmp_path_factory.mktemp("dpo_full")
    args = ("--model_name_or_path", base, "--train_file", base / "implicit.jsonl", "--full_finetune")
    args += ("--loss_type", "ipo", "--max_train_steps", "3", "--learning_rate", "1e-3")
    args += ("--per_device_train_batch_size", "4", "--logging_steps", "1", "--rpo_alpha", "0.5")
    return launch_runs(root, {"full": Job("ddp_2gpu.yaml", RECIPE, args)})


@pytest.mark.slow
def test_a_full_fine_tune_computes_the_reference_first_and_trains_one_model(full):
    """IPO: at step 1 the policy is the precomputed reference (the same model, before any step), so every margin is
    0 and the IPO loss is (0 - 1 / (2 beta))^2 = 25; the step's loss adds RPO's 0.5 x the logged NLL of the chosen
    tokens. The implicit prompts were found; the whole model is saved."""
    results = full["full"]["results"]
    assert results["method"] == "full" and results["data/format"] == "conversational_implicit"
    first = results["train/log"][0]
    assert results["train/loss_curve"][0] == pytest.approx(25.0 + 0.5 * first["train/nll_loss"], rel=1e-6)
    assert first["train/loss"] == pytest.approx(results["train/loss_curve"][0], rel=1e-6)
    assert first["train/rewards/margins"] == pytest.approx(0, abs=1e-6) and first["train/nll_loss"] > 0
    assert results["train/loss_curve"][-1] < results["train/loss_curve"][0]
    assert "reference: the log-probs of" in full["full"]["log"]
    assert (full["full"]["dir"] / "model.safetensors").is_file()
    assert results["model/trainable_parameters"] == results["model/total_parameters"]


# ----------------------------------------------------------------------------- an SFT adapter continued
def continuing(adapter, base) -> tuple:
    """The flags of a 3-step run continuing ``adapter``, checkpointed at step 2."""
    args = ("--adapter_name_or_path", adapter, "--train_file", base / "strings.csv")
    args += ("--max_train_steps", "3", "--learning_rate", "1e-2", "--label_smoothing", "0.1")
    args += ("--per_device_train_batch_size", "8", "--logging_steps", "1", "--max_length", "24")
    return (*args, "--max_prompt_length", "12", "--checkpointing_steps", "2")


@pytest.fixture(scope="module")
def continued(base, tmp_path_factory):
    """The SFT adapter continued, on strings from a CSV, with label smoothing; its base comes from the adapter. It is
    resumed from its step-2 checkpoint with another --lora_alpha, a flag a continued adapter ignores. It continues a
    copy, in ``root/start``."""
    root = tmp_path_factory.mktemp("dpo_continued")
    shutil.copytree(base / "sft_adapter", root / "start")  # (a test trains it again in place)
    args = continuing(root / "start", base)
    step_2 = ("--resume_from_checkpoint", root / "sft_adapter" / "checkpoints" / "step_000002")
    jobs = {"sft_adapter": Job("single_gpu.yaml", RECIPE, args)}
    jobs["resumed"] = Job("single_gpu.yaml", RECIPE, (*args, *step_2, "--lora_alpha", "64"), after="sft_adapter")
    return launch_runs(root, jobs)


@pytest.mark.slow
def test_an_sft_adapter_is_continued_against_its_frozen_copy(continued, base):
    """The reference is the SFT policy: at step 1 the margins are 0 (loss log 2, label smoothing or not); the saved
    adapter is the continued SFT adapter alone (its rank and targets, no reference copy), moved from where it
    started; prompts longer than --max_prompt_length were cut and counted."""
    results = continued["sft_adapter"]["results"]
    assert results["train/loss_curve"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert results["data/format"] == "standard"
    assert results["config"]["model_name_or_path"] == str(base)
    saved, started = adapter(continued["sft_adapter"]), load_file(base / "sft_adapter" / "adapter_model.safetensors")
    assert saved.keys() == started.keys() and not any("reference" in name for name in saved)
    assert max_relative_difference(started, saved) > 1e-4
    assert json.loads((continued["sft_adapter"]["dir"] / "adapter_config.json").read_text())["r"] == 4
    assert results["data/counts"]["train"]["prompts_cut"] > 0


@pytest.mark.slow
def test_a_continued_adapter_resumes_whatever_the_lora_flags_and_not_from_another_adapter(continued, base, tmp_path):
    """A continued adapter keeps its own rank and targets, so a resume with another --lora_alpha goes on to the same
    end (were the ignored flags recorded, it would be refused). Its frozen copy is the reference, so a resume whose
    --adapter_name_or_path holds other weights (here: the same folder, trained again since) is refused in one
    paragraph before loading (were the flags or the folder's name recorded, it would resume against another
    reference)."""
    resumed, whole = continued["resumed"]["results"], continued["sft_adapter"]["results"]
    assert "at step 2" in continued["resumed"]["log"]
    assert resumed["train/loss_curve"] == pytest.approx(whole["train/loss_curve"], rel=1e-6)
    start = continued["sft_adapter"]["dir"].parent / "start"  # the folder it continued, trained again (a step's worth)
    weights = load_file(start / "adapter_model.safetensors")
    save_file({name: tensor + 1e-3 for name, tensor in weights.items()}, start / "adapter_model.safetensors")
    step_2 = continued["sft_adapter"]["dir"] / "checkpoints" / "step_000002"
    args = (*continuing(start, base), "--resume_from_checkpoint", step_2, "--output_dir", tmp_path / "out")
    run = launch(ONE_PROCESS, RECIPE, *args)
    assert run.returncode != 0
    said = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "trained with --adapter_name_or_path <a folder of files of sha256" in said[0], str(run)
    assert "train/loss" not in run.output


def test_a_continued_adapter_is_known_by_the_weights_peft_loads(tmp_path):
    """What a resume checks of a continued adapter is the file PEFT loads from its folder: adapter_model.safetensors
    when there is one, else adapter_model.bin. A .bin left beside the .safetensors (an adapter converted) changes
    nothing, rewritten or removed; the loaded file's weights do; a folder holding only a .bin is known by it."""
    from peft.utils import load_peft_weights

    from llm_kit.checkpoints import unchanged_by_a_resume

    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({"w": torch.ones(2, 2)}, folder / "adapter_model.safetensors")
    torch.save({"w": torch.zeros(2, 2)}, folder / "adapter_model.bin")
    assert torch.equal(load_peft_weights(str(folder), device="cpu")["w"], torch.ones(2, 2))  # what PEFT reads
    held = lambda: unchanged_by_a_resume(8, True, adapter_name_or_path=str(folder), lora_r=16)
    first = held()
    assert set(first) == {"training_examples", "adapter_name_or_path"}
    torch.save({"w": torch.full((2, 2), 2.0)}, folder / "adapter_model.bin")
    assert held() == first
    (folder / "adapter_model.bin").unlink()
    assert held() == first
    save_file({"w": torch.full((2, 2), 3.0)}, folder / "adapter_model.safetensors")
    assert held() != first
    (folder / "adapter_model.safetensors").unlink()
    torch.save({"w": torch.ones(2, 2)}, folder / "adapter_model.bin")
    only_bin = held()
    torch.save({"w": torch.zeros(2, 2)}, folder / "adapter_model.bin")
    assert held() != only_bin


# ----------------------------------------------------------------------------- GPT-2 with its dropout, the defaults
@pytest.fixture(scope="module")
def gpt2(base, tmp_path_factory):
    """GPT-2 with its dropout, the defaults otherwise (evaluation on): a new LoRA adapter and a full fine-tune, each
    step logged; the two pairs whose prompt fills --max_length are dropped."""
    root = tmp_path_factory.mktemp("dpo_gpt2")
    args = ("--model_name_or_path", base / "gpt2", "--train_file", base / "strings_long.jsonl")
    args += ("--validation_file", base / "strings_validation.jsonl", "--max_length", "64")
    args += ("--max_train_steps", "2", "--logging_steps", "1")
    jobs = {
        "gpt2_lora": Job("single_gpu.yaml", RECIPE, (*args, "--learning_rate", "1e-2")),
        "gpt2_full": Job("single_gpu.yaml", RECIPE, (*args, "--full_finetune")),
    }
    return launch_runs(root, jobs)


@pytest.mark.slow
def test_dropout_is_off_so_that_the_first_step_starts_at_the_reference(gpt2, base):
    """TRL's disable_dropout, the default: GPT-2 keeps its dropout of 0.1 in its config, yet at step 1 the policy is
    the reference, so every margin is 0 and the loss ln 2, with a new LoRA adapter (the reference: the adapter off)
    and with a full fine-tune (the reference: log-probs computed before training). The continued SFT adapter's own
    lora_dropout (0.1) is off too: its first loss is ln 2 (test_an_sft_adapter_is_continued_against_its_frozen_copy).
    Without it, dropout in the policy's forward alone moves step 1 off the reference."""
    for name in ("gpt2_lora", "gpt2_full"):
        results, first = gpt2[name]["results"], gpt2[name]["results"]["train/log"][0]
        assert first["step"] == 1 and results["method"] == name.removeprefix("gpt2_"), name
        assert first["train/rewards/margins"] == pytest.approx(0, abs=1e-7), name
        assert first["train/rewards/chosen"] == pytest.approx(0, abs=1e-7), name
        assert results["train/loss_curve"][0] == pytest.approx(math.log(2), abs=1e-6), name
        assert results["train/loss_curve"][-1] != results["train/loss_curve"][0], name  # and it trains
        assert "dropout: off in the policy and the reference" in gpt2[name]["log"], name
    assert json.loads((base / "gpt2" / "config.json").read_text())["resid_pdrop"] == 0.1


@pytest.mark.slow
def test_pairs_whose_prompt_fills_max_length_are_dropped_and_counted(gpt2):
    """TRL's rule: a pair whose prompt alone fills --max_length has no completion token left, and is dropped; the
    data line and results.json say how many, per split."""
    results, log = gpt2["gpt2_lora"]["results"], gpt2["gpt2_lora"]["log"]
    assert results["data/counts"]["train"]["pairs"] == 32 and results["data/counts"]["train"]["dropped"] == 2
    assert results["data/counts"]["validation"]["dropped"] == 0 and results["eval/num_pairs"] == 8
    data_line = next(line for line in log.splitlines() if "data: format standard" in line)
    assert "train 32 pairs (2 dropped: their prompt alone fills --max_length 64" in data_line
    assert "validation 8 pairs (0 dropped" in data_line


# ----------------------------------------------------------------------------- in process: the reference, the loss
@pytest.fixture(scope="module")
def recipe():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dpo_recipe", REPO / "recipes" / RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_offline_default_sets_only_the_flags_left_unset_and_says_which(recipe, tmp_path, monkeypatch):
    """Offline (no model, no adapter), DPO trains with the settings measured for its default model: with the SFT
    adapter it continues, larger steps and RPO; without, those of a base. A flag the user gives stays theirs and is
    not named; a user's model gets TRL's defaults and no line."""
    monkeypatch.chdir(tmp_path)  # no outputs/llm_finetune here: the base model's settings
    base = recipe.parse_args([])
    assert (base.max_train_steps, base.learning_rate, base.lr_scheduler_type, base.rpo_alpha) == (
        200,
        1e-3,
        "cosine",
        None,
    )
    line = (
        "the offline default model trains with --max_train_steps 200 --learning_rate 0.001 --lr_scheduler_type cosine"
    )
    assert base.offline_default_settings.startswith(line)
    (tmp_path / "outputs" / "llm_finetune").mkdir(parents=True)
    (tmp_path / "outputs" / "llm_finetune" / "adapter_config.json").write_text("{}")
    continued = recipe.parse_args(["--learning_rate", "5e-4"])
    assert (continued.max_train_steps, continued.learning_rate, continued.rpo_alpha) == (200, 5e-4, 5.0)
    assert "--learning_rate" not in continued.offline_default_settings
    assert "--rpo_alpha 5 " in continued.offline_default_settings
    real = recipe.parse_args(["--model_name_or_path", "org/model"])
    assert (real.max_train_steps, real.learning_rate, real.lr_scheduler_type) == (None, 5e-5, "linear")
    assert real.offline_default_settings == ""


class OneProcess:
    """What the recipe's reference helpers ask of the Accelerator, in one process."""

    device = torch.device("cpu")

    @staticmethod
    def unwrap_model(model):
        return model

    @staticmethod
    def gather_for_metrics(values):
        return values

    @staticmethod
    def print(*args):
        pass


def pair_batches(base, fmt_file="pairs.jsonl", batch_size=5, shuffle=False):
    import datasets
    from transformers import AutoTokenizer

    from dpo_kit.preference_data import collate_pairs, preference_format, tokenize_pair
    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token, tokenizer.chat_template = tokenizer.eos_token, DEFAULT_CHAT_TEMPLATE
    rows = datasets.load_dataset("json", data_files=str(base / fmt_file), split="train")
    fmt = preference_format(rows, "test")
    pairs = [{**tokenize_pair(row, fmt, tokenizer, 512), "index": i} for i, row in enumerate(rows)]
    generator = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(
        pairs,
        batch_size,
        shuffle=shuffle,
        generator=generator,
        collate_fn=lambda rows: collate_pairs(rows, tokenizer.pad_token_id),
    )
    return loader, pairs


def plain_logps(model, pairs) -> torch.Tensor:
    """Each pair's chosen and rejected completion log-prob from full logits, one sequence at a time: the log-softmax
    at every position before a completion token, summed (chosen rows first, then rejected)."""
    out = []
    for column in ("chosen_ids", "rejected_ids"):
        for pair in pairs:
            ids = torch.tensor([pair["prompt_ids"] + pair[column]])
            with torch.no_grad():
                logps = model(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
            out.append(logps[len(pair["prompt_ids"]) - 1 :].sum())
    return torch.stack(out)


def test_the_reference_is_the_base_model_with_the_adapter_switched_off(recipe, base):
    """reference_logps with a new adapter (here with random weights, so that it matters) equals a separately loaded
    base model's log-probs of the completions; the policy's differ. And the log-probs are over the completion tokens
    only: the recipe's (logits at the completion positions, chunked cross-entropy) equal the plain sum above."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    loader, pairs = pair_batches(base)
    batch = next(iter(loader))
    separate = AutoModelForCausalLM.from_pretrained(base).eval()
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    ).eval()
    expected = plain_logps(separate, pairs[:5])
    torch.testing.assert_close(recipe.reference_logps(OneProcess, model, batch, None), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        policy = recipe.sequence_logps(model, batch)
    torch.testing.assert_close(policy, plain_logps(model, pairs[:5]), rtol=1e-5, atol=1e-5)
    assert (policy - expected).abs().max() > 1e-2


def test_a_continued_adapter_s_reference_is_the_sft_policy(recipe, base):
    """With --adapter_name_or_path the reference is the SFT adapter as loaded (a separately loaded PeftModel), not
    the base, even after the trained copy moved; and switching to it leaves requires_grad as it was."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llm_kit.adapters import continued_adapter

    loader, pairs = pair_batches(base)
    batch = next(iter(loader))
    accelerator = type(
        "Accelerator",
        (OneProcess,),
        {
            "is_fsdp2": False,  # and no checkpoints: the hook is not run
            "register_save_state_pre_hook": staticmethod(print),
        },
    )
    model = continued_adapter(AutoModelForCausalLM.from_pretrained(base), str(base / "sft_adapter"))
    model.eval()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in name for name in trainable)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".default." in name:
                parameter.add_(0.05)  # training moved the policy
    sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), base / "sft_adapter").eval()
    reference = recipe.reference_logps(accelerator, model, batch, None)
    torch.testing.assert_close(reference, plain_logps(sft, pairs[:5]), rtol=1e-5, atol=1e-5)
    assert (reference - plain_logps(AutoModelForCausalLM.from_pretrained(base), pairs[:5])).abs().max() > 1e-3
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable


def test_the_reference_is_scored_without_dropout_whatever_the_flag(recipe, base):
    """With --no-disable_dropout the policy trains with the model's dropout, but the reference stays one fixed policy,
    as the precomputed one (computed in eval mode) is: in train mode, the continued SFT adapter's frozen copy (its
    lora_dropout is 0.1) and GPT-2's base with a new adapter off (its dropout 0.1) give the log-probs of eval mode, and
    leave the model in train mode."""
    from transformers import AutoModelForCausalLM

    from llm_kit.adapters import continued_adapter
    from shared.lora import lora_model

    batch = next(iter(pair_batches(base)[0]))
    continued = continued_adapter(AutoModelForCausalLM.from_pretrained(base), str(base / "sft_adapter"))
    assert continued.peft_config["reference"].lora_dropout == 0.1
    gpt2 = lora_model(
        AutoModelForCausalLM.from_pretrained(base / "gpt2"),
        str(base / "gpt2"),
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        lora_target_modules=["all-linear"],
        task_type="CAUSAL_LM",
    )
    for name, model in (("continued adapter", continued), ("gpt2", gpt2)):
        torch.manual_seed(0)
        trained = [recipe.reference_logps(OneProcess, model.train(), batch, None) for _ in range(2)]
        assert model.training, name
        evaluated = recipe.reference_logps(OneProcess, model.eval(), batch, None)
        for logps in trained:
            torch.testing.assert_close(logps, evaluated, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["gpt2", "llama_attention_dropout"])
def test_disable_dropout_switches_off_every_dropout_of_the_policy(base, name):
    """--disable_dropout (TRL's default) on users' shapes in train mode, with a LoRA adapter whose lora_dropout is 0.5:
    GPT-2 (nn.Dropout modules, 0.1 from its config) and a Llama with attention_dropout 0.5, a float that the attention
    function reads in train mode (TRL's disable_dropout_in_model sets nn.Dropout modules only, and misses it). Before,
    two forwards differ; after, both give the eval-mode logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpo_kit.reference import disable_dropout

    folder = base / "gpt2" if name == "gpt2" else base
    config = AutoConfig.from_pretrained(folder)
    if name != "gpt2":
        config.attention_dropout = 0.5
    model = AutoModelForCausalLM.from_pretrained(folder, config=config)
    lora = LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.5, init_lora_weights=False)
    model, ids = get_peft_model(model, lora), torch.arange(1, 40)[None]
    torch.manual_seed(0)
    with torch.no_grad():
        model.train()
        assert not torch.equal(model(ids).logits, model(ids).logits)
        switched = disable_dropout(model)
        trained = [model(ids).logits for _ in range(2)]
        evaluated = model.eval()(ids).logits
    assert switched > 0
    for logits in trained:
        torch.testing.assert_close(logits, evaluated, rtol=1e-6, atol=1e-6)


def test_a_precomputed_reference_equals_the_live_one(recipe, base):
    """The one pass before training, looked up by pair index in shuffled batches, gives what a separately loaded
    reference model computes for those batches."""
    from transformers import AutoModelForCausalLM

    ordered, pairs = pair_batches(base, "implicit.jsonl", batch_size=3)
    table = recipe.precompute_reference(OneProcess, AutoModelForCausalLM.from_pretrained(base), ordered)
    assert table.shape == (32, 2) and torch.isfinite(table).all()
    separate = AutoModelForCausalLM.from_pretrained(base).eval()
    shuffled, _ = pair_batches(base, "implicit.jsonl", batch_size=5, shuffle=True)
    for batch in itertools_first(shuffled, 2):
        with torch.no_grad():
            live = recipe.sequence_logps(separate, batch)
        torch.testing.assert_close(recipe.reference_logps(OneProcess, None, batch, table), live, rtol=1e-5, atol=1e-5)


def itertools_first(iterable, count):
    import itertools

    return list(itertools.islice(iterable, count))


def test_the_losses_are_trl_s(recipe):
    """TRL 1.16's formulas (trl/trainer/dpo_trainer.py): sigmoid -log sigmoid(beta m) (with label smoothing e:
    -(1-e) log sigmoid(beta m) - e log sigmoid(-beta m)); IPO on log-ratios averaged per completion token,
    (m - 1/(2 beta))^2; rewards beta * log-ratio."""
    policy, reference = torch.tensor([-3.0, -7.0, -5.0, -4.0]), torch.tensor([-4.0, -6.0, -5.5, -4.0])
    targets = torch.tensor([[1, 2, -100], [1, -100, -100], [1, 2, 3], [1, 2, 3]])
    batch = {"sequences": {"loss_targets": targets}}
    chosen, rejected = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.0])  # policy - reference
    losses, metrics = recipe.dpo_losses(policy, reference, batch, beta=0.1, loss_type="sigmoid", label_smoothing=0)
    torch.testing.assert_close(losses, -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)))
    torch.testing.assert_close(metrics[:, 1], 0.1 * chosen)
    torch.testing.assert_close(metrics[:, 3], torch.tensor([1.0, 0.0]))
    smooth, _ = recipe.dpo_losses(policy, reference, batch, beta=0.1, loss_type="sigmoid", label_smoothing=0.2)
    margin = 0.1 * (chosen - rejected)
    expected = -0.8 * torch.nn.functional.logsigmoid(margin) - 0.2 * torch.nn.functional.logsigmoid(-margin)
    torch.testing.assert_close(smooth, expected)
    ipo, _ = recipe.dpo_losses(policy, reference, batch, beta=0.1, loss_type="ipo", label_smoothing=0)
    per_token = chosen / torch.tensor([2.0, 1.0]) - rejected / torch.tensor([3.0, 3.0])
    torch.testing.assert_close(ipo, (per_token - 5.0) ** 2)


def completion_token_logps(model, pair, column) -> torch.Tensor:
    """The log-prob of each completion token of one sequence, from full logits (the prompt's are not taken)."""
    ids = torch.tensor([pair["prompt_ids"] + pair[column]])
    with torch.no_grad():
        logps = model(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
    return logps[len(pair["prompt_ids"]) - 1 :]


def test_rpo_adds_the_nll_of_the_chosen_completion_tokens(recipe, base):
    """--rpo_alpha: TRL's RPO (1.16: loss_type ["sigmoid", "sft"] with loss_weights [1, alpha]; before 1.0:
    rpo_alpha): the mean sigmoid loss over the pairs plus alpha x the policy's mean NLL over the chosen completion
    tokens (``-chosen_per_token_logps[chosen_mask].mean()``), here from full logits one sequence at a time: no prompt
    token, no rejected row. Two pairs get longer chosen answers, so that the mean per token differs from the mean per
    pair; split into micro-batches of 2 and 4 pairs, the shares sum to the same loss and gradient (the mean over the
    step's tokens, not a mean of the micro-batches' means); ``metric_means`` reports the NLL as nll_loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from dpo_kit.preference_data import collate_pairs

    _, pairs = pair_batches(base)
    pairs = [{**pair, "chosen_ids": pair["chosen_ids"] * (3 if i < 2 else 1)} for i, pair in enumerate(pairs[:6])]
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    ).eval()
    alpha, kw = 0.7, {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0}
    policy = {c: [completion_token_logps(model, p, c) for p in pairs] for c in ("chosen_ids", "rejected_ids")}
    with model.disable_adapter():
        reference = {c: [completion_token_logps(model, p, c).sum() for p in pairs] for c in policy}
    chosen, rejected = ([logps.sum() - ref for logps, ref in zip(policy[c], reference[c])] for c in policy)
    dpo = -torch.nn.functional.logsigmoid(0.1 * (torch.stack(chosen) - torch.stack(rejected))).mean()
    nll = -torch.cat(policy["chosen_ids"]).mean()
    assert abs(nll + torch.stack([logps.mean() for logps in policy["chosen_ids"]]).mean()) > 1e-3  # per token

    def step(micro_batches):
        model.zero_grad()
        counts = sum(recipe.step_counts(batch) for batch in micro_batches)
        total, sums = 0, 0
        for batch in micro_batches:
            ref = recipe.reference_logps(OneProcess, model, batch, None)
            loss, per_pair = recipe.step_loss(model, batch, ref, *counts, rpo_alpha=alpha, **kw)
            loss.backward()
            total, sums = total + loss.detach(), sums + per_pair.sum(dim=0)
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        return total, recipe.metric_means(sums, len(pairs), alpha), grads

    whole, metrics, grads = step([collate_pairs(pairs, 0)])
    torch.testing.assert_close(whole, dpo + alpha * nll, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics[-1], nll, rtol=1e-5, atol=1e-6)  # nll_loss
    torch.testing.assert_close(metrics[0], dpo + alpha * nll, rtol=1e-5, atol=1e-6)  # loss: the objective
    split, split_metrics, split_grads = step([collate_pairs(pairs[:2], 0), collate_pairs(pairs[2:], 0)])
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split_metrics, metrics, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    without, _ = recipe.step_loss(
        model,
        collate_pairs(pairs, 0),
        reference=torch.stack([*reference["chosen_ids"], *reference["rejected_ids"]]),
        step_pairs=6,
        step_tokens=1,
        rpo_alpha=None,
        **kw,
    )
    torch.testing.assert_close(without, dpo, rtol=1e-5, atol=1e-6)  # off by default: DPO alone


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_lora_dpo_trains_a_tied_qwen2_and_gpt2_s_conv1d_layers(recipe, base, tmp_path, name):
    """Users' shapes beside the Llama: a Qwen2 whose LM head is its embedding matrix (tie_word_embeddings, as most
    small LLMs) and a GPT-2 (Conv1D layers, weights stored [in, out]), built tiny from transformers' own configs with
    the base's tokenizer; the recipe's LoRA adapter on every linear layer, 3 steps of its loss with RPO, the reference
    the adapter switched off. At step 1 every margin is 0 (the policy is the reference); the losses stay finite, every
    LoRA B matrix (zero at the start) moved, the head (tied in both: GPT-2 ties it by default) stays tied, frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, Qwen2Config

    from shared.lora import lora_model

    tokenizer = AutoTokenizer.from_pretrained(base)
    special = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        **special,
    )
    if name == "gpt2":
        config = GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=512, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **special
        )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = lora_model(
        AutoModelForCausalLM.from_pretrained(tmp_path),
        str(tmp_path),
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target_modules=["all-linear"],
        task_type="CAUSAL_LM",
    )
    adapted = {module for module, _ in model.named_modules() if module.endswith(".lora_A")}
    expected = ("c_attn", "c_proj", "c_fc") if name == "gpt2" else ("q_proj", "o_proj", "down_proj")
    assert all(any(f".{target}." in module for module in adapted) for target in expected), sorted(adapted)
    assert not any("lm_head" in module or "embed" in module for module in adapted)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader, _ = pair_batches(base, batch_size=4, shuffle=True)
    kw = {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0, "rpo_alpha": 1.0}
    losses = []
    for step, batch in enumerate(itertools_first(loader, 3)):
        reference = recipe.reference_logps(OneProcess, model, batch, None)
        loss, per_pair = recipe.step_loss(model.train(), batch, reference, *recipe.step_counts(batch), **kw)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 0:
            assert per_pair[:, 4].abs().max() < 1e-5  # rewards/margins: the policy is the reference
    assert all(math.isfinite(loss) for loss in losses), losses
    moved = {n: p.abs().max().item() for n, p in model.named_parameters() if "lora_B" in n}
    assert moved and min(moved.values()) > 0, moved
    head = model.get_output_embeddings().weight
    assert head is model.get_input_embeddings().weight and not head.requires_grad


USER, ANSWER = {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}


def chat_tokenizer_of(base, bos: bool = False):
    """The base's tokenizer as the recipe sets it up (pad token, the default chat template); with ``bos``, one that
    starts every text with a beginning-of-sequence token, as Llama's and Gemma's do."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token, tokenizer.chat_template = tokenizer.eos_token, DEFAULT_CHAT_TEMPLATE
    if bos:
        tokenizer.add_special_tokens({"bos_token": "<s>"})
        processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
        tokenizer.backend_tokenizer.post_processor = processor
    return tokenizer


def test_pairs_are_tokenized_and_cut_as_trl_does_by_default(base):
    """TRL 1.16's DPOTrainer by default (its _prepare_dataset and collator): the end-of-sequence token appended to a
    string completion only when it does not end with it already; prompt and prompt + completion tokenized whole, the
    completion starting where their tokens differ (a prompt ending in a space gives the space to the completion's
    first token); keep_start: prompt + completion cut at max_length, the prompt kept whole, and a pair whose prompt
    alone fills max_length dropped. --max_prompt_length (TRL before 1.0) first cuts a prompt from the left."""
    from dpo_kit.preference_data import tokenize_pair

    tokenizer = chat_tokenizer_of(base)
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id

    def whole(text):
        return tokenizer(text)["input_ids"]

    row = {"prompt": "Is os.path a module?", "chosen": " yes", "rejected": " no" + eos}
    pair = tokenize_pair(row, "standard", tokenizer, 1024)
    assert pair["prompt_ids"] + pair["chosen_ids"] == whole(row["prompt"] + " yes" + eos)
    assert pair["prompt_ids"] + pair["rejected_ids"] == whole(row["prompt"] + " no" + eos)  # one EOS, not two
    assert pair["rejected_ids"][-1] == eos_id and pair["rejected_ids"].count(eos_id) == 1
    assert pair["prompt_ids"] == whole(row["prompt"]) and not pair["dropped"]

    row = {"prompt": "Is asyncio.run a class, a function or a method? ", "chosen": "a function", "rejected": "a class"}
    pair, apart = tokenize_pair(row, "standard", tokenizer, 1024), whole(row["prompt"])
    assert pair["prompt_ids"] + pair["chosen_ids"] == whole(row["prompt"] + row["chosen"] + eos)
    assert pair["prompt_ids"] == apart[:-1] and tokenizer.decode(apart[-1:]) == " "  # the space went on
    assert tokenizer.decode(pair["chosen_ids"][:1]) == tokenizer.decode(pair["rejected_ids"][:1]) == " a"
    assert pair["prompt_merged"]

    row = {"prompt": "Is os.path a module?", "chosen": "a function, of course " * 6, "rejected": " no"}
    pair = tokenize_pair(row, "standard", tokenizer, 20)
    assert pair["prompt_ids"] == whole(row["prompt"]) and len(pair["prompt_ids"] + pair["chosen_ids"]) == 20
    assert pair["prompt_ids"] + pair["chosen_ids"] == whole(row["prompt"] + row["chosen"])[:20]
    assert pair["rejected_ids"] == whole(row["prompt"] + " no" + eos)[len(pair["prompt_ids"]) :]
    assert pair["completion_cut"] and not pair["dropped"] and not pair["prompt_cut"]

    row = {"prompt": "Is asyncio.run a class or a function?" * 3, "chosen": " yes", "rejected": " no"}
    prompt = whole(row["prompt"])
    assert len(prompt) > 20
    assert tokenize_pair(row, "standard", tokenizer, 20)["dropped"]
    pair = tokenize_pair(row, "standard", tokenizer, 20, max_prompt_length=8)
    assert pair["prompt_ids"] == prompt[-8:] and pair["prompt_cut"] and not pair["dropped"]
    assert pair["chosen_ids"] == whole(row["prompt"] + " yes" + eos)[len(prompt) :][:4]

    prompt = [{"role": "system", "content": "One word."}, {"role": "user", "content": "Is os.path a module? "}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "yes"}], "rejected": [ANSWER]}
    pair = tokenize_pair(row, "conversational", tokenizer, 1024)
    template = partial(tokenizer.apply_chat_template, tokenize=True, return_dict=True)
    assert pair["prompt_ids"] == template(prompt, add_generation_prompt=True)["input_ids"]
    assert pair["prompt_ids"] + pair["chosen_ids"] == template(prompt + row["chosen"])["input_ids"]
    assert pair["prompt_ids"] + pair["rejected_ids"] == template(prompt + row["rejected"])["input_ids"]
    assert pair["chosen_ids"].count(eos_id) == 1  # the template's own EOS: nothing appended to a conversation


STRINGS = [
    {"prompt": "Is asyncio.run a class, a function or a method? ", "chosen": "a function", "rejected": "a class"},
    {"prompt": "Is os.path a module?", "chosen": " yes<|endoftext|>", "rejected": " no"},
    {"prompt": "Is asyncio.run a class or a function?" * 4, "chosen": " yes", "rejected": " no"},
    {"prompt": "Name a module:", "chosen": " email.utils, of course" * 6, "rejected": " asyncio"},
    {"prompt": "", "chosen": "A plain text.", "rejected": "Another text. "},
]
USER_LONG = {"role": "user", "content": "Is asyncio.run a class, a function or a method? " * 3}
CONVERSATIONS = [
    {"prompt": [USER], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "B"}]},
    {
        "prompt": [{"role": "system", "content": "Answer in one word. "}, {"role": "user", "content": "Q? "}],
        "chosen": [{"role": "assistant", "content": " yes"}],
        "rejected": [{"role": "assistant", "content": "no " * 30}],
    },
    {"prompt": [USER_LONG], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "B"}]},
]


@pytest.mark.parametrize("bos", [False, True], ids=["no_bos", "bos"])
def test_token_ids_equal_trl_s_own_preprocessing(base, tmp_path, bos):
    """Our ids against TRL's own (DPOTrainer._prepare_dataset, the function its trainer calls, then its collator's
    keep_start cut at max_length 64): strings (a prompt ending in a space, a completion already ending in EOS, one cut
    at max_length, a prompt that fills it, an empty prompt), conversations (the same, through the chat template) and
    implicit-prompt conversations; a tokenizer without and with a beginning-of-sequence token. The same pairs are
    kept, and each row's ids and completion mask are equal."""
    pytest.importorskip("trl")
    import datasets
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    from dpo_kit.preference_data import tokenize_pair

    tokenizer, length = chat_tokenizer_of(base, bos), 64
    config = DPOConfig(output_dir=str(tmp_path), max_length=length, bf16=False, report_to=[])
    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=length)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CONVERSATIONS]
    counts = collections.Counter()
    for rows, fmt in ((STRINGS, "standard"), (CONVERSATIONS, "conversational"), (implicit, "conversational_implicit")):
        trainer = types.SimpleNamespace(_tokenizer=tokenizer)  # all that _prepare_dataset reads of its trainer
        theirs = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer, config, "train")
        ours = [tokenize_pair(row, fmt, tokenizer, length) for row in rows]
        kept = [pair for pair in ours if not pair["dropped"]]
        assert len(kept) == len(theirs) == len(rows) - 1, fmt  # one long prompt in each
        for index, (pair, trl_pair) in enumerate(zip(kept, theirs)):
            ours_batch, trl_batch = collate([pair]), collate([trl_pair])
            for key in ("input_ids", "completion_mask"):
                assert torch.equal(ours_batch[key], trl_batch[key]), (fmt, index, key)
        counts.update(key for pair in ours for key in ("completion_cut", "prompt_merged") if pair[key])
    assert counts["completion_cut"] >= 2 and counts["prompt_merged"] >= 1, counts


def test_a_pair_s_tools_are_rendered_as_trl_renders_them(base, tmp_path):
    """TRL's ``tools`` column (a list of tool schemas, or its JSON text) goes to the chat template with the prompt
    and each completion (here a template that writes them in a system turn), so the preference is learned in the
    context the model is asked in, and the exact match asks with them too; the ids equal TRL's own preprocessing. A
    cell that is not JSON is refused by its row. Without them the pair would be judged without the tools in sight."""
    from dpo_kit.preference_data import as_sft_rows, check_pair, tokenize_pair
    from llm_kit.sft_data import prompt_of
    from shared.errors import RecipeError

    tokenizer = chat_tokenizer_of(base)
    tokenizer.chat_template = (
        "{% if tools %}{{ '<|system|>\\n' + (tools | tojson) + '\\n' }}{% endif %}" + tokenizer.chat_template
    )
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find a module", "parameters": {}}}]
    pair = {"prompt": [USER], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "B"}]}
    rows = [{**pair, "tools": given} for given in (tools, json.dumps(tools))]
    template = partial(tokenizer.apply_chat_template, tokenize=True, return_dict=True, tools=tools)
    for row in rows:
        pair = tokenize_pair(row, "conversational", tokenizer, 1024)
        assert '"lookup"' in tokenizer.decode(pair["prompt_ids"])
        assert pair["prompt_ids"] == template([USER], add_generation_prompt=True)["input_ids"]
        assert pair["prompt_ids"] + pair["chosen_ids"] == template([USER, ANSWER])["input_ids"]
    import datasets

    sft_rows, fmt = as_sft_rows(datasets.Dataset.from_list(rows[1:]), "conversational")
    assert '"lookup"' in prompt_of(sft_rows[0], fmt, tokenizer)
    with pytest.raises(RecipeError) as error:
        check_pair({**rows[0], "tools": "[{'name': 'lookup'}]"}, "conversational", "Row 3 of pairs.jsonl")
    assert error.value.message.startswith("Row 3 of pairs.jsonl: its 'tools' cell is not JSON")
    trl = pytest.importorskip("trl")
    config = trl.DPOConfig(output_dir=str(tmp_path), max_length=1024, bf16=False, report_to=[])
    trainer = types.SimpleNamespace(_tokenizer=tokenizer)  # all that _prepare_dataset reads of its trainer
    prepare = trl.trainer.dpo_trainer.DPOTrainer._prepare_dataset
    theirs = prepare(trainer, datasets.Dataset.from_list(rows[1:]), tokenizer, config, "train")[0]
    ours = tokenize_pair(rows[1], "conversational", tokenizer, 1024)
    assert theirs["prompt_ids"] + theirs["chosen_ids"] == ours["prompt_ids"] + ours["chosen_ids"]


def test_the_data_line_counts_what_was_dropped_and_cut_and_refuses_when_nothing_is_left(base):
    """tokenize_pairs: the pairs whose prompt fills --max_length are dropped from each split, counted and said in the
    one data line; the kept pairs are indexed 0.. in their split (what a precomputed reference is looked up by); a
    split left with no pair is refused, naming --max_length and the prompts' lengths."""
    import datasets

    from dpo_kit.preference_data import tokenize_pairs
    from shared.errors import RecipeError

    printed = []
    accelerator = type("Accelerator", (OneProcess,), {"print": staticmethod(printed.append)})
    tokenizer = chat_tokenizer_of(base)
    raw = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(STRINGS),  # the third prompt fills 40 tokens, the fourth answer is cut
            "validation": datasets.Dataset.from_list(STRINGS[2:4]),
        }
    )
    train, validation, counts = tokenize_pairs(accelerator, raw, "standard", tokenizer, 40, None)
    assert counts["train"] == {"pairs": 4, "dropped": 1, "completions_cut": 1, "prompts_cut": 0, "prompts_merged": 1}
    assert counts["validation"] == {
        "pairs": 1,
        "dropped": 1,
        "completions_cut": 1,
        "prompts_cut": 0,
        "prompts_merged": 0,
    }
    assert train["index"] == [0, 1, 2, 3] and validation["index"] == [0]
    assert printed == [
        "data: format standard; train 4 pairs (1 dropped: their prompt alone fills --max_length 40; 1 with a "
        "completion cut at --max_length 40; 1 whose prompt's last token merges into the completion's first, as TRL "
        "tokenizes them together); validation 1 pairs (1 dropped: their prompt alone fills --max_length 40; 1 with a "
        "completion cut at --max_length 40)"
    ]
    raw["train"] = datasets.Dataset.from_list(STRINGS[:4])  # prompts of 8 tokens and more
    with pytest.raises(RecipeError) as error:
        tokenize_pairs(accelerator, raw, "standard", tokenizer, 8, None)
    assert (
        "--max_length 8 leaves no completion token in any train pair: every prompt fills it (the shortest has 8 "
        "tokens" in error.value.message
    )


@pytest.mark.parametrize("fmt", ["standard", "conversational"])
def test_a_tokenizer_that_splits_its_eos_text_is_refused(base, fmt):
    """Each completion ends in the EOS, appended as text (TRL) or written by the chat template: a tokenizer that
    writes that text as other tokens (``split_special_tokens`` in its config) would score pieces of it, never the token
    that stops generation. Refused in one paragraph naming the tokenizer and the pieces, before any pair is tokenized;
    the same tokenizer keeping it whole puts its id in each chosen completion."""
    import datasets

    from dpo_kit.preference_data import tokenize_pairs
    from shared.errors import RecipeError

    rows = STRINGS[:2] if fmt == "standard" else CONVERSATIONS[:2]
    raw = datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split in ("train", "validation")})
    printed = []
    accelerator = type("Accelerator", (OneProcess,), {"print": staticmethod(printed.append)})
    tokenizer = chat_tokenizer_of(base)
    train, _, _ = tokenize_pairs(accelerator, raw, fmt, tokenizer, 512, None)
    assert all(tokenizer.eos_token_id in ids for ids in train["chosen_ids"])
    tokenizer.split_special_tokens = True
    with pytest.raises(RecipeError) as error:
        tokenize_pairs(accelerator, raw, fmt, tokenizer, 512, None)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer(tokenizer.eos_token, add_special_tokens=False)["input_ids"])
    said = error.value.message
    assert f"writes its end-of-sequence text {tokenizer.eos_token!r} as {pieces}, not as its token" in said
    assert len(pieces) > 1 and len(printed) == 1  # the first call's data line only


# ----------------------------------------------------------------------------- refusals
BAD_ROWS = [
    ({"prompt": "Q?", "chosen": "yes", "rejected": None}, "Row 2 of test has no 'rejected'"),
    ({"prompt": "Q?", "chosen": "", "rejected": "no"}, "Row 2 of test has no 'chosen'"),
    ({"prompt": "Q?", "chosen": "same", "rejected": "same"}, "Row 2 of test: 'chosen' and 'rejected' are identical"),
]
BAD_CONVERSATIONS = [
    (
        {"chosen": [USER, ANSWER], "rejected": [{"role": "user", "content": "Other?"}, ANSWER]},
        "Row 2 of test: the 'chosen' and 'rejected' conversations do not share their first turn",
    ),
    ({"chosen": [USER, ANSWER], "rejected": [USER, ANSWER, USER, ANSWER]}, "each must go on with an assistant answer"),
    (
        {"chosen": [{"role": "robot", "content": "x"}, ANSWER], "rejected": [USER]},
        "Row 2 of test (column 'chosen') has the role(s) ['robot']",
    ),
]


@pytest.mark.parametrize("row, message", BAD_ROWS + BAD_CONVERSATIONS)
def test_bad_rows_are_refused_naming_the_row_and_column(row, message):
    import datasets

    from dpo_kit.preference_data import preference_format
    from shared.errors import RecipeError

    good = (
        {"prompt": "Q?", "chosen": "yes", "rejected": "no"}
        if "prompt" in row
        else {"chosen": [USER, ANSWER], "rejected": [USER, {"role": "assistant", "content": "B"}]}
    )
    with pytest.raises(RecipeError) as error:
        preference_format(datasets.Dataset.from_list([good, row]), "test")
    assert message in error.value.message


@pytest.mark.slow
def test_a_real_model_without_data_says_which_bundled_pairs_it_trains_on(base, tmp_path):
    """A user's model launched without --train_file trains on the offline pairs: it runs, and says so in one line,
    with the flag that passes theirs."""
    run = launch(
        ONE_PROCESS,
        RECIPE,
        *("--model_name_or_path", base, "--max_train_steps", "1", "--max_train_samples", "4", "--skip_eval"),
        *("--output_dir", tmp_path / "out"),
    )
    said = [line for line in run.output.splitlines() if "trains on the bundled preference pairs" in line]
    assert run.returncode == 0 and len(said) == 1, str(run)
    assert said[0].startswith("data: no --train_file or --dataset_name") and "pass yours with --train_file" in said[0]


def test_flags_and_inputs_that_cannot_work_are_refused(recipe, base, capsys):
    """In-process: --precompute_reference with LoRA, a negative --rpo_alpha, a --lora_dropout that --disable_dropout
    (on by default) would switch off, an adapter trained on another base, a file without chosen/rejected. And one
    launch: a bad row stops the run with one paragraph naming the file and the row, printed once, and a non-zero
    exit."""
    import datasets

    from dpo_kit.preference_data import preference_format
    from llm_kit.adapters import starting_point
    from llm_kit.loading import causal_lm_config
    from shared.errors import RecipeError

    with pytest.raises(SystemExit):
        recipe.parse_args(["--precompute_reference"])
    assert "with LoRA the reference is the same model with the adapter switched off" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recipe.parse_args(["--rpo_alpha", "-1"])
    assert "--rpo_alpha weighs the chosen answers' NLL: 0 or more, not -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recipe.parse_args(["--lora_dropout", "0.1"])
    assert "--lora_dropout 0.1 would be switched off: --disable_dropout (on by default" in capsys.readouterr().err
    assert recipe.parse_args(["--lora_dropout", "0.1", "--no-disable_dropout"]).disable_dropout is False
    with pytest.raises(RecipeError) as error:
        starting_point(
            OneProcess,
            True,
            base,
            REPO / "recipes",
            adapter_name_or_path=str(base / "sft_adapter"),
            model_name_or_path="Qwen/Qwen2.5-0.5B",
        )
    assert f"was trained on {str(base)!r}, not on --model_name_or_path 'Qwen/Qwen2.5-0.5B'" in error.value.message
    with pytest.raises(RecipeError) as error:
        preference_format(datasets.Dataset.from_list([{"prompt": "q", "completion": "a"}]), "x")
    assert "x has no 'chosen' and no 'rejected' column" in error.value.message
    no_config = base / "no_config"  # the weights, config.json left behind: said so, not transformers' model_type
    no_config.mkdir(exist_ok=True)
    (no_config / "model.safetensors").unlink(missing_ok=True)
    (no_config / "model.safetensors").symlink_to(base / "model.safetensors")
    with pytest.raises(RecipeError) as error:
        causal_lm_config(OneProcess, str(no_config))
    assert f"{str(no_config)!r} holds no config.json (it holds: model.safetensors)" in error.value.message
    bad = base / "bad.jsonl"
    rows = [json.loads(line) for line in (base / "pairs.jsonl").read_text().splitlines()[:4]]
    rows[2]["rejected"] = rows[2]["chosen"]
    write_jsonl(bad, rows)
    run = launch(
        "ddp_2gpu.yaml",
        RECIPE,
        "--model_name_or_path",
        base,
        "--train_file",
        bad,
        "--output_dir",
        base / "bad_run",
        timeout=120,
    )
    assert run.returncode != 0
    assert f"] error: Row 3 of --train_file {str(bad)!r}: 'chosen' and 'rejected' are identical" in run.output
    assert run.output.count("] error: ") == 1, run.output  # 2 processes refuse alike: one paragraph (the box aside)
    assert "[rank0]: Traceback" not in run.output and "[rank1]: Traceback" not in run.output


def test_a_validation_file_in_another_format_than_the_training_file_is_refused_before_any_model(tmp_path):
    """Conversational pairs for training beside string pairs for validation (the same columns, other types): one
    paragraph naming both files, from the data loader the LLM recipes share (grpo's case: test_grpo.py)."""
    from dpo_kit.preference_data import preference_format
    from llm_kit.sft_data import load_raw_datasets
    from shared.errors import RecipeError

    def turn(role, text):
        return [{"role": role, "content": text}]

    rows = [
        {
            "prompt": turn("user", f"{i} + 1?"),
            "chosen": turn("assistant", str(i + 1)),
            "rejected": turn("assistant", "0"),
        }
        for i in range(4)
    ]
    strings = [{key: value[0]["content"] for key, value in row.items()} for row in rows]
    train, validation = tmp_path / "conv.jsonl", tmp_path / "plain.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    validation.write_text("".join(json.dumps(row) + "\n" for row in strings))
    with pytest.raises(RecipeError) as error:
        load_raw_datasets(str(train), str(validation), row_format=preference_format)
    assert (
        f"--train_file '{train}' holds conversational rows but --validation_file '{validation}' holds standard rows"
        in (error.value.message)
    )
