"""The GRPO recipe on tiny models built here (an untied Llama, a tied-embedding Qwen2, GPT-2 with its Conv1D layers and
dropout): the same steps in 1 process x 16 completions, 2 x 8 and 1 x 8 x 2 accumulation on completions fixed in
advance (a group of 16 spanning both processes), an exact resume with sampling (and one in 2 processes), QLoRA,
FSDP2, a full fine-tune against its frozen copy, conversational and plain prompts, a user's reward file; in process:
the advantages and every loss type against hand-computed values, the log-probs against a plain forward and against
generation's own logits (GPT-2: absolute positions), the sampler, the reward functions, and the refusals. TRL's side
of the equality is benchmarks/studies/grpo_vs_trl.py (tests/test_benchmarks.py runs a case of it where TRL is
installed). CPU processes stand in for GPUs."""

import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch
from harness.launch import REPO, Job, launch, launch_all, read_facts, read_results, visible_gpus
from harness.models import save_tiny_llama
from safetensors.torch import load_file

RECIPE = "grpo.py"
FIXED = REPO / "tests" / "scripts" / "grpo_fixed_completions.py"
# A user's reward file in TRL's signature: the share of vowels (never constant, so every group has a signal) and one
# that applies to the questions about methods only (None elsewhere: not applicable).
REWARDS = """
def vowels(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in texts]


def about_methods(completions, answer, **kwargs):
    return [float("method" in str(c)) if a == "method" else None for c, a in zip(completions, answer)]


def picky(completions, answer, **kwargs):
    if "method" in answer:
        raise ValueError("no methods here")
    return [0.0] * len(completions)
"""
# LoRA steps large enough that 4 steps move the adapter; AdamW's epsilon large enough that the weights read out the
# gradients compared (as tests/test_dpo.py); tiny completions; the KL term and a second step per round.
SMALL = (
    "--max_train_steps",
    "4",
    "--learning_rate",
    "1e-2",
    "--adam_epsilon",
    "1e-4",
    "--max_completion_length",
    "6",
    "--beta",
    "0.1",
    "--num_iterations",
    "2",
    "--logging_steps",
    "2",
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama with its BPE tokenizer (no chat template, no pad token), a tied Qwen2 and a GPT-2 of the same
    tokenizer, the offline prompts as a conversational JSONL file (a system turn on every third) and as plain strings
    in CSV with a 'solution' column, the reward file, and an SFT adapter with random weights."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, Qwen2Config

    from grpo_kit.data import stdlib_name_prompts

    folder = tmp_path_factory.mktemp("grpo_base")
    save_tiny_llama(folder, num_hidden_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    special = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    shapes = {
        "qwen2": Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            **special,
        ),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **special),  # dropout 0.1, as GPT-2's
    }
    for name, config in shapes.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    rows = [dict(row) for row in stdlib_name_prompts()["train"].shuffle(seed=0).select(range(48))]
    for index, row in enumerate(rows):
        if index % 3 == 0:
            row["prompt"] = [{"role": "system", "content": "Answer in one word."}, *row["prompt"]]
    write_jsonl(folder / "prompts.jsonl", rows)
    plain = [{"prompt": row["prompt"][-1]["content"], "solution": row["answer"]} for row in rows]
    datasets.Dataset.from_list(plain).to_csv(str(folder / "prompts.csv"))
    (folder / "rewards.py").write_text(REWARDS)
    torch.manual_seed(1)
    sft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    sft.peft_config["default"].base_model_name_or_path = str(folder)
    sft.save_pretrained(folder / "sft_adapter")
    return folder


def split_args(base, model: str = "") -> tuple:
    """The split layout (the last process generates, the others train) of the Llama (or ``base / model``): the user's
    vowels reward (its groups always have a signal), the KL term, one step per round and a checkpoint after each
    (each holds the trainers' weights and the round the generating process made for after it), evaluation on."""
    rewards = ("--reward_funcs", f"{base / 'rewards.py'}:vowels", "--num_generations", "4", *SMALL)
    return ("--model_name_or_path", base / model, *rewards, "--generation_mode", "split", "--num_iterations", "1") + (
        "--checkpointing_steps",
        "1",
        "--exact_match_samples",
        "4",
    )


def sampled_args(base) -> tuple:
    """The sampled run (the offline prompts, the accuracy reward and the user's vowels, evaluation on)."""
    rewards = ("--reward_funcs", "accuracy", f"{base / 'rewards.py'}:vowels", "--reward_weights", "1", "2")
    return ("--model_name_or_path", base, *rewards, "--num_generations", "4", *SMALL, "--exact_match_samples", "4")


@pytest.fixture(scope="module")
def sampled(base, tmp_path_factory):
    """The fast lane's one launch: a sampled run in 1 process, 8 completions a step, checkpointed at step 2."""
    out = tmp_path_factory.mktemp("grpo") / "sampled"
    args = (*sampled_args(base), "--per_device_train_batch_size", "8", "--checkpointing_steps", "2")
    run = launch("single_gpu.yaml", RECIPE, *args, "--output_dir", out)
    assert run.returncode == 0, str(run)
    return {"dir": out, "results": read_results(out), "log": run.output}


@pytest.fixture(scope="module")
def requeued(base, sampled, tmp_path_factory):
    """The sampled run requeued once it ended (in a copy of its folder): the same command, resuming latest."""
    out = tmp_path_factory.mktemp("grpo") / "requeued"
    shutil.copytree(sampled["dir"], out)
    args = (*sampled_args(base), "--per_device_train_batch_size", "8", "--checkpointing_steps", "2")
    run = launch("single_gpu.yaml", RECIPE, *args, "--output_dir", out, "--resume_from_checkpoint", "latest")
    assert run.returncode == 0, str(run)
    return {"dir": out, "results": read_results(out), "log": run.output}


@pytest.mark.slow
def test_a_requeued_run_that_had_ended_keeps_its_trl_metrics(requeued, sampled):
    """Resumed from the checkpoint of its last step, a run trains no step and logs no window: results.json keeps the
    last window's TRL metrics (train/reward, train/completions/..., the rate)."""
    again, first = requeued["results"], sampled["results"]
    assert again["resumed_from_step"] == again["completed_steps"] == 4
    assert again["train/log"] == first["train/log"] and again["train/rewards"] == first["train/rewards"]
    last = {key: value for key, value in first.items() if key.startswith("train/") and key != "train/log"}
    assert {"train/reward", "train/completions/mean_length", "train/learning_rate"} <= last.keys()
    assert {key: again.get(key) for key in last} == last


@pytest.fixture(scope="module")
def runs(base, sampled, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_runs")
    checkpoint = sampled["dir"] / "checkpoints" / "step_000002"
    # One group of 16 completions a step (one prompt), fixed in advance: in 2 processes it spans both.
    fixed = ("--model_name_or_path", base, "--num_generations", "16", *SMALL, "--skip_eval")
    jobs = {
        "resumed": ("single_gpu.yaml", RECIPE, *sampled_args(base), "--per_device_train_batch_size", "8"),
        "1x16": ("single_gpu.yaml", FIXED, *fixed, "--per_device_train_batch_size", "16"),
        "2x8": ("ddp_2gpu.yaml", FIXED, *fixed, "--per_device_train_batch_size", "8"),
        "1x8x2": (
            "single_gpu.yaml",
            FIXED,
            *fixed,
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "2",
        ),
        # A tied Qwen2 in 4-bit (QLoRA) on conversational prompts from a file, the user's rewards (one of them None
        # outside the questions about methods) and the format one.
        "qwen2_qlora": (
            "single_gpu.yaml",
            RECIPE,
            "--model_name_or_path",
            base / "qwen2",
            "--load_in_4bit",
            "--train_file",
            base / "prompts.jsonl",
            "--reward_funcs",
            f"{base / 'rewards.py'}:vowels",
            f"{base / 'rewards.py'}:about_methods",
            "format",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            "--max_prompt_length",
            "128",
            *SMALL,
            "--exact_match_samples",
            "2",
        ),
        # GPT-2 (Conv1D, dropout) sharded by FSDP2 on plain prompts with a 'solution' column; the reference is the
        # adapter switched off; grpo's loss, the batch's standard deviation, truncated completions left out.
        "gpt2_fsdp": (
            "fsdp_2gpu.yaml",
            RECIPE,
            "--model_name_or_path",
            base / "gpt2",
            "--train_file",
            base / "prompts.csv",
            "--reward_funcs",
            "accuracy",
            f"{base / 'rewards.py'}:vowels",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
            "--loss_type",
            "grpo",
            "--scale_rewards",
            "batch",
            "--mask_truncated_completions",
            *SMALL,
        ),
        # Every weight trained against a frozen copy of the model (--beta), in 2 processes.
        "full": (
            "ddp_2gpu.yaml",
            RECIPE,
            "--model_name_or_path",
            base,
            "--full_finetune",
            "--reward_funcs",
            f"{base / 'rewards.py'}:vowels",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
            *SMALL,
            "--learning_rate",
            "1e-3",
            "--skip_eval",
        ),
        # The split layout: 1 process generates, 1 trains 8 completions a step; 1 generates, 2 train 4 each.
        "split": ("ddp_2gpu.yaml", RECIPE, *split_args(base), "--per_device_train_batch_size", "8"),
        "split_in_3": ("ddp_2gpu.yaml", RECIPE, *split_args(base), "--per_device_train_batch_size", "4"),
        # Every weight of a tied Qwen2 trained in the split layout (all of them sent to the generating process).
        "split_full": (
            "ddp_2gpu.yaml",
            RECIPE,
            *split_args(base, "qwen2"),
            "--full_finetune",
            "--learning_rate",
            "1e-3",
            "--max_train_steps",
            "3",
            "--per_device_train_batch_size",
            "8",
        ),
        # A reward function that raises on the questions about methods, in 2 processes, colocated and split.
        "split_bad_reward": (
            "ddp_2gpu.yaml",
            RECIPE,
            "--model_name_or_path",
            base,
            "--reward_funcs",
            f"{base / 'rewards.py'}:picky",
            "--generation_mode",
            "split",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            *SMALL,
        ),
        "bad_reward": (
            "ddp_2gpu.yaml",
            RECIPE,
            "--model_name_or_path",
            base,
            "--reward_funcs",
            f"{base / 'rewards.py'}:picky",
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
            *SMALL,
        ),
    }
    jobs = {name: Job(job[0], job[1], tuple(job[2:])) for name, job in jobs.items()}
    jobs["resumed"].args += ("--resume_from_checkpoint", checkpoint)
    # The split run's last checkpoint, where its run ended, resumed with one more step (in a copy of its folder).
    split = jobs["split"]
    jobs["split_extended"] = Job(split.config, split.script, (*split.args, "--max_train_steps", "5"), after="split")
    jobs["split_extended"].args += ("--resume_from_checkpoint", "latest")
    jobs["split_extended"].prepare = lambda: shutil.copytree(root / "split", root / "split_extended")
    jobs["split_in_3"].kwargs["launch_args"] = ("--num_processes", "3")
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    jobs["gpt2_fsdp"].kwargs["observe"] = True  # its sharding, seen by tests/observer
    finished = launch_all(jobs, cpu_only=visible_gpus() < 2)
    out = {}
    for name, run in finished.items():
        assert (run.returncode == 0) == (not name.endswith("bad_reward")), f"{name}: {run}"
        results = read_results(root / name) if run.returncode == 0 else None
        out[name] = {"dir": root / name, "results": results, "log": run.output, "returncode": run.returncode}
    return out


def adapter(run) -> dict:
    return load_file(run["dir"] / "adapter_model.safetensors")


# ----------------------------------------------------------------------------- launched
TRL_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


def test_a_sampled_run_logs_trl_s_metrics_and_its_rewards_per_step(sampled):
    """What a user reads of a run: TRL's metrics per window and in results.json (train/<name>), the mean reward of
    every optimizer step (a round's two steps share its completions, so their rewards), the completions and tokens
    per second after the warm-up, the peak memory, the exact match before and after, the checkpoints."""
    results = sampled["results"]
    assert results["completed_steps"] == 4 and [entry["step"] for entry in results["train/log"]] == [2, 4]
    for name in (*TRL_METRICS, "rewards/accuracy/mean", "rewards/vowels/mean", "rewards/vowels/std"):
        assert math.isfinite(results[f"train/{name}"]), name
        assert f"train/{name}" in results["train/log"][0], name
    rewards = results["train/rewards"]
    assert len(rewards) == 4 and rewards[0] == rewards[1] and rewards[2] == rewards[3] and rewards[0] != rewards[2]
    assert results["train/completions/max_length"] <= 6 and results["train/frac_reward_zero_std"] < 1
    assert results["perf/completions_per_sec"] > 0 and results["perf/tokens_per_sec"] > 0
    # Completions count at their round's first step: steps 2-4 (after the warm-up step) generated round 2's 8.
    assert results["perf/samples_per_step"] * results["perf/measured_steps"] == pytest.approx(8)
    assert all(peak > 0 for peak in results["memory/peak_gib"].values())
    assert results["eval/exact_match_num_prompts"] == 4 and "exact match before training" in sampled["log"]
    assert (sampled["dir"] / "checkpoints" / "step_000002").is_dir()
    assert results["config"]["prompts_per_round"] == 2 and results["data/format"] == "conversational"


@pytest.mark.slow
def test_one_process_two_processes_and_accumulation_give_the_same_steps(runs):
    """The same completions (fixed in advance, by their place in the round) give the same losses, rewards, KL and
    adapter whether a step's 16 are made by 1 process, by 2 processes of 8 (the group spans both: its rewards are
    gathered before they are normalised) or by 1 process in 2 micro-batches of 8."""
    reference = runs["1x16"]["results"]
    assert reference["global_batch_size"] == 16 and reference["train/frac_reward_zero_std"] == 0
    assert reference["train/kl"] > 0 and reference["train/loss_curve"][1] != reference["train/loss_curve"][0]
    for name in ("2x8", "1x8x2"):
        results = runs[name]["results"]
        assert results["global_batch_size"] == 16, name
        np.testing.assert_allclose(results["train/loss_curve"], reference["train/loss_curve"], rtol=1e-6, atol=1e-7)
        assert results["train/rewards"] == pytest.approx(reference["train/rewards"], abs=1e-7), name
        assert results["train/kl"] == pytest.approx(reference["train/kl"], rel=1e-5), name
        ours, theirs = adapter(runs[name]), adapter(runs["1x16"])
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6, name
    assert runs["2x8"]["results"]["parallelism"] == "ddp"


@pytest.mark.slow
def test_a_resumed_run_samples_and_ends_as_the_uninterrupted_one(runs, sampled):
    """Resumed from step 2, the run samples the same completions (the sampling noise is the seed's and the round's)
    and ends bit for bit where the uninterrupted run did (another process count: tests/conformance/test_resume.py)."""
    resumed, full = runs["resumed"]["results"], sampled["results"]
    assert resumed["resumed_from_step"] == 2
    assert (
        resumed["train/loss_curve"] == full["train/loss_curve"] and resumed["train/rewards"] == full["train/rewards"]
    )
    assert resumed["train/log"] == full["train/log"]
    assert all(torch.equal(a, b) for a, b in zip(adapter(runs["resumed"]).values(), adapter(sampled).values()))


@pytest.mark.slow
def test_users_shapes_train_qlora_fsdp2_and_every_weight(runs):
    """A tied Qwen2 in 4-bit on conversational prompts with the user's rewards (one not applicable to most rows: its
    mean is over the rows it applies to); GPT-2 sharded by FSDP2 on plain prompts scored against 'solution', its
    reference the adapter switched off; every weight of the Llama trained against a frozen copy of itself (at step 1
    the policy is its reference: no KL)."""
    qwen = runs["qwen2_qlora"]["results"]
    assert qwen["method"] == "qlora" and "weights in 4-bit NF4" in runs["qwen2_qlora"]["log"]
    assert qwen["data/format"] == "conversational" and qwen["eval/exact_match_num_prompts"] == 2
    for name in ("vowels", "about_methods", "format"):
        assert f"train/rewards/{name}/mean" in qwen["train/log"][0], name
    assert 0 <= qwen["train/rewards/about_methods/mean"] <= 1 and math.isfinite(qwen["train/loss"])
    assert not any("lm_head" in name or "embed" in name for name in adapter(runs["qwen2_qlora"]))
    gpt2 = runs["gpt2_fsdp"]["results"]
    assert gpt2["parallelism"] == "fsdp" and gpt2["data/format"] == "standard"
    assert "train/rewards/accuracy/mean" in gpt2 and math.isfinite(gpt2["train/kl"])
    for facts in read_facts(runs["gpt2_fsdp"]["dir"])["fsdp/sharding"].values():
        assert facts["dtensor_parameters"] == facts["parameters"] > 0
    assert any(name.endswith("c_attn.lora_A.weight") for name in adapter(runs["gpt2_fsdp"]))
    full = runs["full"]["results"]
    assert full["method"] == "full" and (runs["full"]["dir"] / "model.safetensors").is_file()
    assert full["train/log"][0]["train/kl"] >= 0 and full["train/kl"] > 0
    assert full["model/trainable_parameters"] == full["model/total_parameters"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bad_reward", "split_bad_reward"])
def test_a_reward_function_that_raises_stops_the_run_naming_it_and_the_row(runs, name):
    """Colocated, and split (the trainers score their completions; the generating process, waiting for their
    weights, is stopped with them)."""
    run = runs[name]
    assert run["returncode"] != 0 and not (run["dir"] / "results.json").exists()
    message = "] error: The reward function 'picky' raised ValueError: no methods here on the completion "
    assert run["log"].count(message) == 1, run["log"][-3000:]  # printed once (the launcher's box aside)
    assert run["log"].count("] error: ") == 1 and "of the prompt \"[{'role': 'user', 'content': 'Is `" in run["log"]
    assert "[rank0]: Traceback" not in run["log"] and "[rank1]: Traceback" not in run["log"]


@pytest.mark.slow
def test_prompt_and_completion_beyond_the_model_s_positions_are_refused_before_generating(base, tmp_path):
    """GPT-2 numbers 512 positions (as OPT, it learns one embedding per position): the longest prompt plus
    --max_completion_length 500 (each alone within them) needs more. Refused in one paragraph with the length that
    fits, before the model is loaded, where generation would have stopped with an IndexError mid-run (on a GPU, a
    device-side assert)."""
    model = ("--model_name_or_path", base / "gpt2", "--train_file", base / "prompts.jsonl")
    run = launch("single_gpu.yaml", RECIPE, *model, "--max_completion_length", "500", "--output_dir", tmp_path / "out")
    log = " ".join(run.output.split())
    assert run.returncode != 0 and "error: The longest training prompt has " in log, run.output[-3000:]
    longest = int(log.split("error: The longest training prompt has ")[1].split()[0])
    assert 12 < longest and longest + 500 > 512  # (the data: each alone fits, together they do not)
    assert f"--max_completion_length is 500: {longest + 500} positions, more than the 512 that " in log
    assert f"Lower --max_completion_length to {512 - longest} or less" in log
    assert "IndexError" not in log and "model: " not in log  # refused before the model is built


# ----------------------------------------------------------------------------- the split layout
def policy_at(run: dict, step: int, base_folder):
    """The policy a run trained, as its checkpoint after ``step`` steps holds it (0: as it started: a new adapter's
    B is zero, so the base model; a full fine-tune's, the model as saved), in eval mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_folder)
    full = run["results"]["method"] == "full"
    if not full:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if step:
        saved = load_file(run["dir"] / "checkpoints" / f"step_{step:06d}" / "model.safetensors")
        missing, unexpected = model.load_state_dict(saved, strict=False)
        assert not unexpected, unexpected
        if full:  # (a tied output head is the embedding, saved once)
            assert set(missing) <= {"lm_head.weight"}, missing
        else:
            assert saved and not any("lora" in name for name in missing), missing
    return model.eval()


def in_flight(run: dict, step: int) -> dict:
    """The round the generating process had made for after step ``step``, as that step's checkpoint holds it."""
    return torch.load(run["dir"] / "checkpoints" / f"step_{step:06d}" / "round_in_flight.pt", weights_only=True)


def scored(policy, made: dict, pad_token_id: int, advantages=None):
    """The round's one micro-batch (``grpo_kit.data.micro_batches``) and the policy's log-probs of its completions."""
    from grpo_kit.data import micro_batches
    from grpo_kit.loss import completion_logps
    from grpo_kit.rollout import Rollouts

    rows = [{"prompt_ids": ids} for ids in made["prompt_ids"]]
    rollouts = Rollouts(made["completion_ids"], made["truncated"], made["logps"])
    advantages = torch.zeros(len(rows)) if advantages is None else advantages
    (batch,) = micro_batches(rows, rollouts, advantages, len(rows), pad_token_id, False, "cpu")
    with torch.no_grad():
        return batch, completion_logps(policy, batch, 1.0)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["split", "split_full"])
def test_split_rounds_are_made_one_round_behind_and_trained_against_their_generating_policy(runs, base, name):
    """The split layout, LoRA on the Llama and every weight of the tied Qwen2: the round trained at step k + 1 was
    made by the generating process with the weights the trainers sent after step k - 1 (its log-probs, saved in
    step k's checkpoint, are that policy's, not step k's); and the loss of step k + 1 is the clipped loss of those
    completions under step k's policy against those log-probs (the ratio's denominator), with the KL term to the
    base model (the adapter switched off)."""
    from grpo_kit.loss import group_advantages, per_token_loss, reduce_loss

    run, folder = runs[name], base / "qwen2" if name == "split_full" else base
    results, tokenizer = run["results"], tokenizer_of(folder)
    assert results["num_processes"] == 2 and results["parallelism"] == "ddp"
    assert "generation: split (rank 1 generates every round, one ahead; rank 0 trains)" in run["log"]
    assert all(results[f"perf/{role}_{kind}_s"] > 0 for role in ("generator", "trainer") for kind in ("busy", "idle"))
    vowels = {}
    exec(REWARDS, vowels)
    steps = results["completed_steps"]
    for step in range(1, steps):
        made = in_flight(run, step)
        assert made["round"] == step and len(made["completion_ids"]) == 8
        batch, generating = scored(policy_at(run, step - 1, folder), made, tokenizer.pad_token_id)
        mask = batch["mask"]
        torch.testing.assert_close(generating[mask], batch["old_logps"][mask], rtol=0, atol=2e-5)
        texts = tokenizer.batch_decode(made["completion_ids"], skip_special_tokens=True)
        rewards = vowels["vowels"]([[{"role": "assistant", "content": text}] for text in texts])
        advantages = group_advantages(torch.tensor(rewards)[:, None], [1.0], 4, "group")["advantages"]
        policy = policy_at(run, step, folder)
        batch, logps = scored(policy, made, tokenizer.pad_token_id, advantages)
        assert (logps - batch["old_logps"])[mask].abs().max() > 1e-4  # not on-policy: one round behind
        if name == "split":  # the KL term's reference: the base, the adapter switched off
            with policy.disable_adapter(), torch.no_grad():
                _, reference = scored(policy, made, tokenizer.pad_token_id)
        else:
            reference = scored(policy_at(run, 0, folder), made, tokenizer.pad_token_id)[1]
        token_loss, _ = per_token_loss(
            logps, batch["old_logps"], reference, advantages, epsilon=0.2, epsilon_high=0.2, beta=0.1
        )
        expected = reduce_loss(
            token_loss,
            mask,
            "dapo",
            step_tokens=mask.sum(),
            step_completions=8,
            micro_batches=1,
            processes=1,
            max_completion_length=6,
        )
        assert results["train/loss_curve"][step] == pytest.approx(expected.item(), rel=1e-4, abs=1e-6), step
    assert not (run["dir"] / "checkpoints" / f"step_{steps:06d}" / "round_in_flight.pt").exists()


@pytest.mark.slow
def test_a_split_run_extended_from_its_last_checkpoint_says_it_leaves_the_longer_run_s_path(runs):
    """A split checkpoint saved at its run's last step holds no round in flight (none was made for after it): resumed
    with more steps, the generating process makes that round with the trained weights, not the weights a longer
    uninterrupted run would have made it with. It trains on, and says so in one line."""
    run = runs["split_extended"]
    assert run["returncode"] == 0 and len(run["results"]["train/loss_curve"]) == 5, run["log"][-3000:]
    said = [line for line in run["log"].splitlines() if "holds no round in flight" in line]
    assert len(said) == 1 and "(its run ended there): round 4 is made now, with the trained weights" in said[0]
    assert "step_000004" in said[0]


def test_split_in_three_processes_ends_as_the_two_process_run(runs):
    """Two trainers of 4 (DDP over their own group; the generating process takes no part) train as one trainer of
    8, to summation order (a split run resumed, in another process count too: tests/conformance/test_resume.py)."""
    split, in_3 = (runs[name]["results"] for name in ("split", "split_in_3"))
    assert in_3["num_processes"] == 3 and in_3["global_batch_size"] == split["global_batch_size"] == 8
    assert "rank 2 generates every round, one ahead; ranks 0-1 train, data parallel" in runs["split_in_3"]["log"]
    np.testing.assert_allclose(in_3["train/loss_curve"], split["train/loss_curve"], rtol=1e-5, atol=1e-7)
    assert in_3["train/rewards"] == pytest.approx(split["train/rewards"], abs=1e-6)
    ours, theirs = adapter(runs["split_in_3"]), adapter(runs["split"])
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6


# ----------------------------------------------------------------------------- in process: the arithmetic
def test_advantages_are_each_reward_against_its_group_s_by_hand():
    """Two groups of 4; two functions weighted 1 and 0.5, the second not applicable (None: NaN) to some rows, and one
    row that no function applies to (left out of its group's mean and deviation, advantage 0)."""
    from grpo_kit.loss import group_advantages

    nan = math.nan
    scores = torch.tensor(
        [[1.0, 0.0], [0.0, nan], [1.0, 1.0], [0.0, 0.0], [0.5, nan], [nan, nan], [0.5, 1.0], [0.0, 0.0]]
    )
    rewards = [1.0, 0.0, 1.5, 0.0, 0.5, nan, 1.0, 0.0]  # the weighted sums of what applied
    out = group_advantages(scores, [1.0, 0.5], 4, "group")
    for offset in (0, 4):
        group = rewards[offset : offset + 4]
        kept = [r for r in group if not math.isnan(r)]
        mean, std = sum(kept) / len(kept), float(np.std(kept, ddof=1))
        for index, reward in enumerate(group):
            expected = 0.0 if math.isnan(reward) else (reward - mean) / (std + 1e-4)
            assert out["advantages"][offset + index].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    batch = group_advantages(scores, [1.0, 0.5], 4, "batch")["advantages"]
    kept = [r for r in rewards if not math.isnan(r)]
    std = float(np.std(kept, ddof=1))
    assert batch[2].item() == pytest.approx((1.5 - np.mean(rewards[:4])) / (std + 1e-4), rel=1e-6)
    unscaled = group_advantages(scores, [1.0, 0.5], 4, "none")["advantages"]
    assert unscaled[2].item() == pytest.approx(1.5 - np.mean(rewards[:4]), rel=1e-6)
    same = group_advantages(torch.tensor([[1.0]] * 4 + [[0.0], [1.0], [0.0], [1.0]]), [1.0], 4, "group")
    assert same["zero_std"].tolist() == [True] * 4 + [False] * 4 and same["advantages"][:4].abs().max() == 0


def hand_loss(logps, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_len):
    """The step's loss, token by token (TRL 1.16's _compute_loss, one micro-batch, one process), on scalars of
    ``logps`` so that autograd gives its gradient too."""
    rows, total, per_row, tokens = len(logps), 0.0, [], 0
    for i in range(rows):
        row = 0.0
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            ratio = torch.exp(logps[i][t] - old[i][t])
            clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
            value = -torch.minimum(ratio * advantages[i], clipped * advantages[i])
            kl = torch.exp(ref[i][t] - logps[i][t]) - (ref[i][t] - logps[i][t]) - 1
            value = value + beta * kl * ratio
            row, total, tokens = row + value, total + value, tokens + 1
        per_row.append(row / max(sum(mask[i]), 1))
    return {
        "dapo": total / max(tokens, 1),
        "bnpo": total / max(tokens, 1),
        "grpo": sum(per_row) / rows,
        "dr_grpo": total / (rows * max_len),
    }[loss_type]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_every_loss_type_against_the_hand_computed_loss_and_its_gradient(loss_type):
    """Ratios inside and outside the clip range (both signs of advantage), the KL term times the ratio, a masked
    token and a truncated row: the loss equals the hand computation, and its gradient equals autograd's of the hand
    formula written in torch (DAPO's clipping passes no gradient where the ratio is clipped)."""
    from grpo_kit.loss import per_token_loss, reduce_loss

    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0], [-0.7, -0.9, -1.1]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.6, -0.4], [-1.0, -0.2, -3.1], [-0.7, -0.9, -1.1]])
    ref = torch.tensor([[-1.2, -1.9, -0.6], [-1.4, -0.3, -2.9], [-0.8, -1.0, -1.0]])
    advantages = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # row 3: a truncated completion left out
    kw = {"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.05}
    loss, tokens = per_token_loss(logps, old, ref, advantages, **kw)
    total = reduce_loss(
        loss,
        mask,
        loss_type,
        step_tokens=mask.sum(),
        step_completions=3,
        micro_batches=1,
        processes=1,
        max_completion_length=4,
    )
    by_hand = logps.detach().clone().requires_grad_(True)
    expected = hand_loss(by_hand, old, ref, advantages, mask.tolist(), loss_type, 0.2, 0.28, 0.05, 4)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    assert tokens["clip_ratio/high_mean"][0, 1] == 1 and tokens["clip_ratio/low_mean"][1, 0] == 1  # clipped
    assert tokens["kl"][0, 0].item() == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-6)  # ratio 1 there
    total.backward()
    expected.backward()
    torch.testing.assert_close(logps.grad, by_hand.grad, rtol=1e-6, atol=1e-8)
    assert logps.grad[2].abs().max() == 0 and logps.grad[0, 0] != 0  # the masked row passes no gradient


def test_the_loss_of_a_step_does_not_depend_on_how_it_is_split():
    """DAPO and grpo normalise over the whole step: two micro-batches (or processes) of a step add up to the loss of
    the step in one piece; bnpo, TRL's per micro-batch mean, does not (its micro-batches hold unequal tokens)."""
    from grpo_kit.loss import per_token_loss, reduce_loss

    torch.manual_seed(0)
    logps, advantages = -torch.rand(4, 5), torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    loss, _ = per_token_loss(logps, None, None, advantages, epsilon=0.2, epsilon_high=0.2, beta=0.0)
    for loss_type in ("dapo", "grpo", "dr_grpo", "bnpo"):
        kw = {"step_tokens": mask.sum(), "step_completions": 4, "processes": 1, "max_completion_length": 5}
        whole = reduce_loss(loss, mask, loss_type, micro_batches=1, **kw)
        split = sum(
            reduce_loss(loss[s], mask[s], loss_type, micro_batches=2, **kw) for s in (slice(0, 2), slice(2, 4))
        )
        if loss_type == "bnpo":
            assert abs(split - whole) > 1e-3
        else:
            assert split.item() == pytest.approx(whole.item(), rel=1e-6), loss_type


def tokenizer_of(base):
    from transformers import AutoTokenizer

    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token, tokenizer.chat_template = tokenizer.eos_token, DEFAULT_CHAT_TEMPLATE
    return tokenizer


class OneProcess:
    """What the generator asks of the Accelerator, in one process."""

    device = torch.device("cpu")

    @staticmethod
    def unwrap_model(model):
        return model


def test_generation_samples_by_its_noise_and_training_scores_its_tokens(base):
    """GPT-2 (absolute positions, dropout on in training mode): generation runs in eval mode with prompts padded on the
    left, stops each row at its first end-of-sequence token, and samples each row by its own noise (rows generated
    apart or together, the same completions); the training forward of the right-padded prompt + completion rows gives
    each completion token the log-prob generation's own logits gave it (the same positions), at the temperature."""
    from transformers import AutoModelForCausalLM

    from grpo_kit.data import micro_batches, prompt_ids
    from grpo_kit.loss import completion_logps
    from grpo_kit.rollout import PolicyGenerator, sampling_noise

    tokenizer = tokenizer_of(base / "gpt2")
    model = AutoModelForCausalLM.from_pretrained(base / "gpt2").train()
    questions = ["Is `a.b` a class?", "Is `email.utils.unquote` a class, a function or a method? Say it."]
    prompts = [prompt_ids([{"role": "user", "content": q}], "conversational", tokenizer) for q in questions] * 2
    generator = PolicyGenerator(
        OneProcess, model, tokenizer, max_completion_length=8, temperature=0.7, top_k=0, top_p=1.0, sharded=False
    )
    noise = sampling_noise(0, 3, 4, 8)
    together = generator.generate(prompts, noise)
    assert model.training  # back to training
    apart = [generator.generate(prompts[i : i + 1], noise[i : i + 1]) for i in range(4)]
    assert together.completion_ids == [rows.completion_ids[0] for rows in apart]
    assert together.completion_ids[0] != together.completion_ids[2]  # the same prompt, other noise
    assert sampling_noise(0, 3, 4, 8).equal(noise) and not sampling_noise(0, 4, 4, 8).equal(noise)
    for ids, cut in zip(together.completion_ids, together.truncated):
        assert cut == (tokenizer.eos_token_id not in ids) and (
            cut or ids.index(tokenizer.eos_token_id) == len(ids) - 1
        )
    rows = [{"prompt_ids": ids} for ids in prompts]
    (batch,) = micro_batches(rows, together, torch.zeros(4), 4, tokenizer.pad_token_id, False, "cpu")
    model.eval()
    with torch.no_grad():
        logps, _ = completion_logps(model, batch, 0.7)
        length = max(map(len, prompts))
        padded = torch.tensor([[tokenizer.pad_token_id] * (length - len(p)) + p for p in prompts])
        mask = (torch.arange(length)[None] >= torch.tensor([length - len(p) for p in prompts])[:, None]).long()
        output = model.generate(
            input_ids=padded,
            attention_mask=mask,
            generation_config=generator.config,
            logits_processor=[generator_sampler(generator, noise, length)],
            output_logits=True,
            return_dict_in_generate=True,
        )
    for row, ids in enumerate(together.completion_ids):
        for t, token in enumerate(ids):
            expected = torch.log_softmax(output.logits[t][row] / 0.7, dim=-1)[token]
            assert logps[row, t].item() == pytest.approx(expected.item(), abs=1e-5), (row, t)
    # The split layout's generating process returns the log-prob its policy gave each token it sampled (the same
    # samples), which the micro-batch carries as the ratio's denominator at the completion positions.
    generator.logps = True
    sampled = generator.generate(prompts, noise)
    assert sampled.completion_ids == together.completion_ids and together.logps is None
    (batch,) = micro_batches(rows, sampled, torch.zeros(4), 4, tokenizer.pad_token_id, False, "cpu")
    for row, ids in enumerate(sampled.completion_ids):
        assert len(sampled.logps[row]) == len(ids)
        torch.testing.assert_close(batch["old_logps"][row, : len(ids)], logps[row, : len(ids)], rtol=0, atol=1e-5)
        assert (batch["old_logps"][row, len(ids) :] == 0).all()


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_generation_reads_each_group_s_prompt_once_and_samples_as_rows_apart(base, name):
    """A process's rows are groups of one prompt's completions (a group cut where the process's share starts):
    generation reads each run of rows with the same prompt once (the first forward's batch is the distinct prompts;
    then one token per row at a time), and every row samples what it samples generated alone: the left padding of
    the shorter prompts leaves their positions and keys as they were (an untied Llama, a tied Qwen2, GPT-2's
    absolute positions)."""
    from transformers import AutoModelForCausalLM

    from grpo_kit.data import prompt_ids
    from grpo_kit.rollout import PolicyGenerator, sampling_noise

    folder = base if name == "llama" else base / name
    tokenizer = tokenizer_of(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    questions = ["Is `email.utils.unquote` a class, a function or a method? Say it.", "Is `a.b` a class?"]
    distinct = [prompt_ids([{"role": "user", "content": q}], "conversational", tokenizer) for q in questions]
    prompts = [distinct[0]] * 2 + [distinct[1]] * 3  # the first group's last 2 rows, then a whole group of 3
    generator = PolicyGenerator(
        OneProcess, model, tokenizer, max_completion_length=6, temperature=1.0, top_k=0, top_p=1.0, sharded=False
    )
    noise = sampling_noise(1, 0, len(prompts), 6)
    shapes = []
    embeddings = model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(out.shape[:2]))
    together = generator.generate(prompts, noise)
    embeddings.remove()
    assert shapes[0] == (2, max(map(len, distinct)) - 1)  # the distinct prompts, but their last token
    assert all(shape == (len(prompts), 1) for shape in shapes[1:])  # then each row's next token
    apart = [generator.generate(prompts[i : i + 1], noise[i : i + 1]) for i in range(len(prompts))]
    assert together.completion_ids == [rows.completion_ids[0] for rows in apart]
    assert together.truncated == [rows.truncated[0] for rows in apart]
    assert together.completion_ids[2] != together.completion_ids[3]  # the same prompt, other noise


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_the_training_forward_reads_each_group_s_prompt_once_with_the_plain_forward_s_log_probs_and_gradients(
    base, name
):
    """The training forward of a micro-batch whose rows are runs of one prompt's completions (a group cut where the
    micro-batch starts, prompts of two lengths, completions of unequal lengths) reads each distinct prompt once (the
    first forward's batch: the distinct prompts but their last token; then every row's last prompt token and
    completion) and gives every completion token the log-prob, and the LoRA weights the gradient, of one plain forward
    of each row alone (an untied Llama, a tied Qwen2, GPT-2's absolute positions; eval mode: no dropout to draw)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_kit.data import micro_batches, prompt_ids
    from grpo_kit.loss import completion_logps
    from grpo_kit.rollout import Rollouts

    folder = base if name == "llama" else base / name
    tokenizer = tokenizer_of(folder)
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    ).eval()
    questions = ["Is `email.utils.unquote` a class, a function or a method? Say it.", "Is `a.b` a class?"]
    distinct = [prompt_ids([{"role": "user", "content": q}], "conversational", tokenizer) for q in questions]
    prompts = [distinct[0]] * 2 + [distinct[1]] * 3
    completions = [[5, 9, tokenizer.eos_token_id], [7, 8, 9, 10, 11], [12], [13, 14, 15, 16], [17, 18]]
    rows = [{"prompt_ids": ids} for ids in prompts]
    rollouts = Rollouts(completions, [False] * len(completions))
    (batch,) = micro_batches(rows, rollouts, torch.zeros(5), 5, tokenizer.pad_token_id, False, "cpu")
    shapes = []
    embeddings = model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(out.shape[:2]))
    logps, _ = completion_logps(model, batch, 0.7)
    embeddings.remove()
    assert shapes[0] == (2, max(map(len, distinct)) - 1)  # the distinct prompts but their last token, once
    assert shapes[1][0] == len(rows) and shapes[1][1] < batch["input_ids"].shape[1] - len(distinct[1]) + 2
    (logps * batch["mask"]).sum().backward()
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    shared = {n: p.grad.clone() for n, p in lora.items()}
    model.zero_grad()
    total = 0
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        plain = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / 0.7
        expected = plain.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(logps[row, : len(completion)].detach(), expected.detach(), rtol=1e-5, atol=1e-5)
        total = total + expected.sum()
    total.backward()
    for n, p in lora.items():
        torch.testing.assert_close(shared[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


def generator_sampler(generator, noise, length):
    from grpo_kit.rollout import NoiseSampler

    return NoiseSampler(noise, length, **generator.sampling)


def test_the_sampler_draws_from_the_filtered_distribution():
    """Inverse transform sampling: a uniform u picks the first token whose cumulative probability exceeds it; over many
    uniforms the frequencies are the probabilities at the temperature; top-k and top-p leave the others out."""
    from grpo_kit.rollout import NoiseSampler

    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(scores / 0.5, dim=-1)[0]
    uniforms = torch.rand(20000, 1, generator=torch.Generator().manual_seed(0))
    picked = NoiseSampler(uniforms, 0, 0.5, 0, 1.0)(torch.zeros(20000, 0, dtype=torch.long), scores.expand(20000, -1))
    tokens = picked.argmax(dim=-1)
    assert (picked == 0).sum(dim=-1).eq(1).all()  # one token left for greedy search
    np.testing.assert_allclose(torch.bincount(tokens, minlength=4) / 20000, probs, atol=0.01)
    top_k = NoiseSampler(uniforms, 0, 1.0, 2, 1.0)(torch.zeros(20000, 0, dtype=torch.long), scores.expand(20000, -1))
    assert set(top_k.argmax(dim=-1).tolist()) == {0, 1}
    one = NoiseSampler(torch.tensor([[0.0], [0.999]]), 0, 1.0, 0, 0.5)(
        torch.zeros(2, 0, dtype=torch.long), scores.expand(2, -1)
    )
    assert one.argmax(dim=-1).tolist() == [0, 0]  # top-p 0.5 keeps the likeliest token alone


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_the_log_probs_are_the_plain_forward_s_and_a_continued_adapter_s_reference_is_the_sft_policy(base, name):
    """Right-padded prompt + completion rows without a mask (the recipe's training forward) give each completion
    token the log-softmax a plain one-row forward gives it, for the tied Qwen2 and GPT-2; the reference of a new
    adapter is the base, with the adapter switched off."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_kit.data import micro_batches
    from grpo_kit.loss import add_fixed_logps, completion_logps
    from grpo_kit.rollout import Rollouts

    tokenizer = tokenizer_of(base / name)
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base / name),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
    ).eval()
    prompts = [tokenizer(text)["input_ids"] for text in ("Is it a class?", "Say: function or method, please")]
    completions = Rollouts([[5, 9, tokenizer.eos_token_id], [7, 8, 9, 10]], [False, True])
    rows = [{"prompt_ids": ids} for ids in prompts]
    (batch,) = micro_batches(rows, completions, torch.tensor([1.0, -1.0]), 2, tokenizer.pad_token_id, True, "cpu")
    assert batch["mask"].tolist() == [[True, True, True, False], [False] * 4]  # the truncated row left out
    with torch.no_grad():
        logps, entropy = completion_logps(model, batch, 1.0)
        add_fixed_logps([batch], model, None, 1.0, old=True, reference=True)
    base_model = AutoModelForCausalLM.from_pretrained(base / name).eval()
    for row, (prompt, completion) in enumerate(zip(prompts, completions.completion_ids)):
        ids = torch.tensor([prompt + completion])
        for policy, got in ((model, logps), (base_model, batch["reference_logps"])):
            with torch.no_grad():
                plain = policy(input_ids=ids).logits.log_softmax(-1)[0, len(prompt) - 1 : -1]
            expected = plain.gather(1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(got[row, : len(completion)], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch["old_logps"], logps)
    assert (entropy[0, :3] > 0).all() and (batch["reference_logps"] - logps).abs().max() > 1e-3


def test_a_continued_adapter_s_reference_is_its_frozen_copy(base):
    """With --adapter_name_or_path and --beta the reference is the SFT adapter as loaded: at the start the policy's
    log-probs are the reference's (no KL), not the base's."""
    from transformers import AutoModelForCausalLM

    from grpo_kit.data import micro_batches
    from grpo_kit.loss import add_fixed_logps
    from grpo_kit.rollout import Rollouts
    from llm_kit.adapters import continued_adapter

    tokenizer = tokenizer_of(base)
    model = continued_adapter(AutoModelForCausalLM.from_pretrained(base), str(base / "sft_adapter")).eval()
    rows = [{"prompt_ids": tokenizer("Is it a class?")["input_ids"]}]
    (batch,) = micro_batches(rows, Rollouts([[5, 9, 11]], [True]), torch.zeros(1), 1, 0, False, "cpu")
    add_fixed_logps([batch], model, None, 1.0, old=True, reference=True)
    torch.testing.assert_close(batch["reference_logps"], batch["old_logps"])
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    add_fixed_logps([batch], plain, None, 1.0, old=True, reference=False)
    assert (batch["reference_logps"] - batch["old_logps"]).abs().max() > 1e-4


# ----------------------------------------------------------------------------- rewards and refusals
@pytest.fixture(scope="module")
def recipe():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_recipe", REPO / "recipes" / RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_built_in_rewards_and_a_user_s_function(base):
    from grpo_kit.rewards import load_reward_functions, score

    functions = load_reward_functions(
        ["accuracy", "format", f"{base / 'rewards.py'}:about_methods"], r"<a>.*</a>", ["answer"]
    )
    assert [name for name, _ in functions] == ["accuracy", "format", "about_methods"]
    completions = [[{"role": "assistant", "content": " method. "}], [{"role": "assistant", "content": "<a>class</a>"}]]
    values, problem = score(functions, ["q1", "q2"], completions, [[1], [2]], {"answer": ["method", "function"]})
    assert problem is None
    assert values[:, 0].tolist() == [1.0, 0.0] and values[:, 1].tolist() == [0.0, 1.0]
    assert values[0, 2] == 1.0 and math.isnan(values[1, 2])  # None: not applicable


def test_a_reward_file_imports_the_modules_beside_it(tmp_path):
    """As a script Python runs: a reward file's ``from helpers import ...`` finds helpers.py in its folder. The
    folder is on ``sys.path`` while the file is imported only: nothing else the run imports is found there."""
    from grpo_kit.rewards import load_reward_functions

    (tmp_path / "grpo_test_helpers.py").write_text("def length(text):\n    return float(len(text))\n")
    (tmp_path / "r.py").write_text(
        "from grpo_test_helpers import length\n\n"
        "def f(completions, **kw):\n    return [length(c) for c in completions]\n"
    )
    before = list(sys.path)
    [(name, function)] = load_reward_functions([f"{tmp_path / 'r.py'}:f"], "", [])
    assert name == "f" and function(["ab", "c"]) == [2.0, 1.0]
    assert sys.path == before


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f(completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
        ("def f(completions, **kw):\n    return [1.0, float('nan')]\n", "returned nan for the completion 'b'"),
        ("def f(completions, **kw):\n    return [1.0, 'good']\n", "returned 'good' for the completion 'b'"),
        ("def f(completions, **kw):\n    return [1 / len(c) - 1 for c in completions]\n", "raised ZeroDivisionError"),
    ],
)
def test_a_reward_function_s_mistakes_are_named(tmp_path, source, message):
    from grpo_kit.rewards import load_reward_functions, score

    (tmp_path / "r.py").write_text(source)
    functions = load_reward_functions([f"{tmp_path / 'r.py'}:f"], "", [])
    _, problem = score(functions, ["p", "q"], ["a", "b"] if "len" not in source else ["a", ""], [[1], [2]], {})
    assert message in problem and "'f'" in problem
    if "ZeroDivision" in message:
        assert "on the completion '' of the prompt 'q'" in problem  # the row it fails on, found one at a time


def test_flags_and_inputs_that_cannot_work_are_refused(recipe, base, tmp_path, capsys):
    """Each refusal is one paragraph naming the flag, the file or the row."""
    import datasets

    from grpo_kit.data import check_layout, check_prompt_lengths, prompt_format
    from grpo_kit.loss import frozen_copy
    from grpo_kit.rewards import load_reward_functions
    from grpo_kit.split import split_layout
    from shared.errors import RecipeError

    offline, told = recipe.parse_args([]), recipe.parse_args(["--max_train_steps", "5", "--temperature", "1"])
    assert offline.max_train_steps == 400 and offline.temperature == 0.7 and offline.top_k == 20
    assert "--max_train_steps 400" in offline.offline_default_settings and offline.learning_rate == 2e-4
    assert told.max_train_steps == 5 and told.temperature == 1 and told.top_k == 20  # a flag given wins
    given = recipe.parse_args(["--model_name_or_path", str(base)])
    assert given.temperature == 1.0 and given.top_k == 0 and given.learning_rate == 5e-5  # TRL's, and LoRA's rate
    for argv, message in (
        (["--num_generations", "1"], "a group needs at least 2 completions"),
        (["--beta", "-0.1"], "--beta weighs the KL to the reference: 0 (none) or more"),
        (["--reward_funcs", "accuracy", "format", "--reward_weights", "1"], "--reward_weights has 1 weights for 2"),
        (["--num_iterations", "2", "--checkpointing_steps", "3"], "is not a multiple of --num_iterations 2"),
        (["--top_k", "-1"], "--top_k -1: 0 samples from every token (vLLM's -1)"),
        (["--top_p", "1.5"], "--top_p 1.5: a probability mass, at most 1.0"),
    ):
        with pytest.raises(SystemExit):
            recipe.parse_args(argv)
        assert message in capsys.readouterr().err, argv

    class Accelerator:
        num_processes, process_index = 1, 0

    with pytest.raises(RecipeError) as error:
        check_layout(Accelerator, 12, 8, 1)
    assert (
        "global batch of 12 completions" in error.value.message
        and "not a whole number of groups" in error.value.message
    )
    with pytest.raises(RecipeError) as error:
        frozen_copy(type("Sharded", (), {"is_fsdp2": True}), str(base), None, False, lora=False, beta=0.1)
    assert "--full_finetune with --beta needs a frozen copy" in error.value.message
    two = type("Two", (), {"process_index": 1, "num_processes": 2})
    for accelerator, parallelism in ((Accelerator, "single"), (two, "fsdp")):
        with pytest.raises(RecipeError) as error:
            split_layout(accelerator, "split", parallelism)
        assert (
            f"this launch has {accelerator.num_processes} process(es) with parallelism {parallelism}"
            in (error.value.message)
            and "Launch it with 2 or more processes and accelerate_configs/ddp_2gpu.yaml" in error.value.message
        )
    assert split_layout(Accelerator, "colocate", "single") is None
    assert check_layout(two, 16, 8, 2) == (2, slice(8, 16))
    for names, message in (
        (["accuracy"], "which the data lacks (its columns: ['prompt'])"),
        ([f"{tmp_path / 'missing.py'}:f"], "the file"),
        (
            [f"{base / 'rewards.py'}:nothing"],
            "has no function 'nothing' (its functions: ['about_methods', 'picky', 'vowels'])",
        ),
        (["rouge"], "neither a built-in reward"),
    ):
        with pytest.raises(RecipeError) as error:
            load_reward_functions(names, "", ["prompt"])
        assert message in error.value.message, names
    tokenizer = tokenizer_of(base)
    rows = datasets.Dataset.from_list([{"prompt": "short"}, {"prompt": "a much longer prompt " * 8}])
    with pytest.raises(RecipeError) as error:
        check_prompt_lengths(datasets.DatasetDict({"train": rows}), "standard", tokenizer, max_prompt_length=8)
    assert "A train prompt has" in error.value.message and "'a much longer prompt a much" in error.value.message
    check_prompt_lengths(datasets.DatasetDict({"train": rows}), "standard", tokenizer, max_prompt_length=1000)
    assert prompt_format(rows, "x") == "standard"
    for bad, message in (
        ([{"question": "q"}], "has no 'prompt' column"),
        ([{"prompt": "q"}, {"prompt": "  "}], "Row 2 of x has no 'prompt' string"),
        ([{"prompt": [{"role": "robot", "content": "q"}]}], "Row 1 of x (column 'prompt') has the role(s) ['robot']"),
    ):
        with pytest.raises(RecipeError) as error:
            prompt_format(datasets.Dataset.from_list(bad), "x")
        assert message in error.value.message, bad


def test_a_validation_file_in_another_format_than_the_training_file_is_refused_before_any_model(tmp_path):
    """Conversational training prompts beside plain validation prompts (the same columns, other types) were read as
    conversations and ended in a TypeError after the model was loaded; now one paragraph naming both files."""
    from grpo_kit.data import read_prompts
    from shared.errors import RecipeError

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}], "answer": str(i + 1)} for i in range(4)]
    train, validation = tmp_path / "conv.jsonl", tmp_path / "plain.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    validation.write_text("".join(json.dumps({**row, "prompt": row["prompt"][0]["content"]}) + "\n" for row in rows))
    flags = dict(dataset_name=None, dataset_config_name=None, validation_split_percentage=10, seed=0)
    flags |= dict(max_train_samples=None, max_eval_samples=None, reward_funcs=["accuracy"], format_pattern=".*")
    with pytest.raises(RecipeError) as error:
        read_prompts(train_file=str(train), validation_file=str(validation), **flags)
    assert (
        f"--train_file '{train}' holds conversational rows but --validation_file '{validation}' holds standard rows"
        in error.value.message
    )
    raw, fmt, _ = read_prompts(train_file=str(train), validation_file=str(train), **flags)
    assert fmt == "conversational" and len(raw["validation"]) == 4


def test_the_last_steps_checkpoint_falls_on_a_round_end(monkeypatch):
    """A GRPO resume starts a round at its first step: a checkpoint after a last step that ends no round (a
    --max_train_steps that is not a multiple of --num_iterations) would make a longer resumed run generate that round
    again and train its remaining steps on other completions. Every --checkpointing_steps and after the last step,
    but only at a round's end; with one step a round, after the last step whatever it is."""
    from types import SimpleNamespace

    from llm_kit import checkpoints

    saved = []
    monkeypatch.setattr(checkpoints, "save_checkpoint", lambda accelerator, folder, step, *a, **k: saved.append(step))
    fixed = dict(stop=SimpleNamespace(requested=lambda step: False), checkpoints_dir=REPO, checkpointing_steps=2)
    fixed |= dict(checkpoints_total_limit=None, steps_per_epoch=100, write_state=None, layout="replica")
    fixed |= dict(history=dict, batch={}, unchanged={})
    for num_iterations, max_train_steps, expected in ((2, 6, [2, 4, 6]), (2, 5, [2, 4]), (1, 5, [2, 4, 5])):
        saved.clear()
        at_step_end = checkpoints.checkpoint_saver(
            None, max_train_steps=max_train_steps, num_iterations=num_iterations, **fixed
        )
        for step in range(1, max_train_steps + 1):
            at_step_end(step)
        assert saved == expected, (num_iterations, max_train_steps)
