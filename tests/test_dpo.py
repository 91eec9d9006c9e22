"""The DPO recipe on a tiny Llama built here: the same steps in 1 process x 8 pairs, 2 x 4 and 1 x 4 x 2 accumulation
(DDP, FSDP2, FSDP2 with offload), an exact resume, a full fine-tune whose reference is computed before training, an
SFT adapter continued against its frozen copy, the reference equalities (the adapter switched off is the base; a
precomputed reference is the live one), log-probs over the completion tokens only, TRL's loss formulas and RPO's NLL
term, the three preference formats, and the refusals. CPU processes stand in for GPUs."""

import json
import math
import sys

import numpy as np
import pytest
import torch
from launch import REPO, Job, launch, launch_all, read_facts, read_results, save_tiny_llama, visible_gpus
from safetensors.torch import load_file

sys.path.insert(0, str(REPO))
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
    (explicit conversations, implicit-prompt conversations, strings in CSV), and an SFT adapter with random weights
    (so that the SFT policy differs from the base)."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

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
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    sft.peft_config["default"].base_model_name_or_path = str(folder)
    sft.save_pretrained(folder / "sft_adapter")
    return folder


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    data = (
        "--model_name_or_path",
        base,
        "--train_file",
        base / "pairs.jsonl",
        "--validation_file",
        base / "pairs_validation.jsonl",
    )
    jobs = {
        # The same 8 pairs per step three ways; the 1x8 run also evaluates, scores answers and checkpoints.
        "1x8": (
            "single_gpu.yaml",
            *data,
            *EXACT,
            "--per_device_train_batch_size",
            "8",
            "--checkpointing_steps",
            "2",
            "--exact_match_samples",
            "4",
            "--per_device_eval_batch_size",
            "3",
        ),
        "2x4": (
            "ddp_2gpu.yaml",
            *data,
            *EXACT,
            "--per_device_train_batch_size",
            "4",
            "--per_device_eval_batch_size",
            "3",
        ),
        "1x4x2": (
            "single_gpu.yaml",
            *data,
            *EXACT,
            "--per_device_train_batch_size",
            "4",
            "--gradient_accumulation_steps",
            "2",
            "--skip_eval",
        ),
        "fsdp": ("fsdp_2gpu.yaml", *data, *EXACT, "--per_device_train_batch_size", "4", "--skip_eval"),
        "offload": ("fsdp_offload_2gpu.yaml", *data, *EXACT, "--per_device_train_batch_size", "4", "--skip_eval"),
        # A full fine-tune in 2 processes with IPO, on implicit-prompt conversations: one pass of reference
        # log-probs before training, then one model.
        "full": (
            "ddp_2gpu.yaml",
            "--model_name_or_path",
            base,
            "--train_file",
            base / "implicit.jsonl",
            "--full_finetune",
            "--loss_type",
            "ipo",
            "--max_train_steps",
            "3",
            "--learning_rate",
            "1e-3",
            "--per_device_train_batch_size",
            "4",
            "--logging_steps",
            "1",
            "--rpo_alpha",
            "0.5",
        ),
        # The SFT adapter continued, on strings from a CSV, with label smoothing; its base comes from the adapter.
        "sft_adapter": (
            "single_gpu.yaml",
            "--adapter_name_or_path",
            base / "sft_adapter",
            "--train_file",
            base / "strings.csv",
            "--max_train_steps",
            "3",
            "--learning_rate",
            "1e-2",
            "--label_smoothing",
            "0.1",
            "--per_device_train_batch_size",
            "8",
            "--logging_steps",
            "1",
            "--max_length",
            "24",
            "--max_prompt_length",
            "12",
        ),
        # Resumed from the 1x8 run's step-2 checkpoint, to the same end.
        "resumed": Job(
            "single_gpu.yaml",
            RECIPE,
            (
                *data,
                *EXACT,
                "--per_device_train_batch_size",
                "8",
                "--exact_match_samples",
                "4",
                "--per_device_eval_batch_size",
                "3",
                "--resume_from_checkpoint",
                root / "1x8" / "checkpoints" / "step_000002",
            ),
            after="1x8",
        ),
        # The same checkpoint resumed in 2 processes of 4 pairs: the global batch of 8 kept, the scheduler's count
        # (a prepared scheduler steps once per process) brought to 2 processes.
        "resumed_in_2": Job(
            "ddp_2gpu.yaml",
            RECIPE,
            (
                *data,
                *EXACT,
                "--per_device_train_batch_size",
                "4",
                "--skip_eval",
                "--resume_from_checkpoint",
                root / "1x8" / "checkpoints" / "step_000002",
            ),
            after="1x8",
        ),
    }
    jobs = {name: job if isinstance(job, Job) else Job(job[0], RECIPE, tuple(job[1:])) for name, job in jobs.items()}
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    finished = launch_all(jobs, cpu_only=visible_gpus() < 2)
    out = {}
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
        out[name] = {"dir": root / name, "results": read_results(root / name), "log": run.output}
    return out


def adapter(run) -> dict:
    return load_file(run["dir"] / "adapter_model.safetensors")


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[name] - b[name]).norm() / a[name].norm()).item() for name in a)


@pytest.mark.slow
def test_one_process_two_processes_and_accumulation_give_the_same_steps(runs):
    """The step loss is the mean over every pair of the global batch, whatever the processes and accumulation."""
    reference = runs["1x8"]["results"]
    assert reference["global_batch_size"] == 8 and reference["completed_steps"] == 4
    # Step 1: the policy is the reference (a new adapter starts at zero), so every margin is 0 and the DPO loss log 2;
    # RPO adds 0.5 x the chosen tokens' NLL (exactly: the full fine-tune's test, which logs every step).
    assert reference["train/loss_curve"][0] > math.log(2) + 0.5
    assert reference["train/log"][-1]["train/nll_loss"] > 0
    for name in ("2x4", "1x4x2", "fsdp", "offload"):
        results = runs[name]["results"]
        assert results["global_batch_size"] == 8, name
        np.testing.assert_allclose(results["train/loss_curve"], reference["train/loss_curve"], rtol=1e-6, err_msg=name)
        for key in ("train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen", "train/nll_loss"):
            assert results[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), (name, key)
        assert max_relative_difference(adapter(runs[name]), adapter(runs["1x8"])) <= 1e-5, name
    assert runs["2x4"]["results"]["parallelism"] == "ddp" and runs["fsdp"]["results"]["parallelism"] == "fsdp"
    for name in ("fsdp", "offload"):  # seen by tests/observer
        for facts in read_facts(runs[name]["dir"])["fsdp/sharding"].values():
            assert facts["dtensor_parameters"] == facts["parameters"] > 0, name
    offloaded = read_facts(runs["offload"]["dir"])["fsdp/sharding"]
    assert all(facts["offloaded_parameters"] == facts["parameters"] for facts in offloaded.values())


@pytest.mark.slow
def test_trl_metrics_are_logged_per_step_and_on_the_validation_set(runs):
    results, two = runs["1x8"]["results"], runs["2x4"]["results"]
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
    assert results["eval/exact_match_num_prompts"] == 4 and "exact match before training" in runs["1x8"]["log"]


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(runs):
    resumed, full = runs["resumed"]["results"], runs["1x8"]["results"]
    assert resumed["resumed_from_step"] == 2
    assert resumed["train/loss_curve"] == full["train/loss_curve"]
    assert resumed["train/log"] == full["train/log"]
    assert all(torch.equal(a, b) for a, b in zip(adapter(runs["resumed"]).values(), adapter(runs["1x8"]).values()))
    assert resumed["eval/loss"] == full["eval/loss"]


@pytest.mark.slow
def test_a_resume_in_another_process_count_ends_where_the_run_would(runs):
    """A 1-process checkpoint resumed in 2 processes: same global batch, the learning rate goes on where it was (a
    prepared scheduler counts a step once per process), so it ends as the uninterrupted 1-process run does."""
    resumed, full = runs["resumed_in_2"], runs["1x8"]
    assert resumed["results"]["resumed_from_step"] == 2 and resumed["results"]["num_processes"] == 2
    assert "resuming a 1-process checkpoint in 2 processes" in resumed["log"]
    assert resumed["results"]["train/loss_curve"] == pytest.approx(full["results"]["train/loss_curve"], abs=1e-6)
    for name, tensor in adapter(full).items():
        assert torch.allclose(adapter(resumed)[name], tensor, atol=1e-6), name


@pytest.mark.slow
def test_a_full_fine_tune_computes_the_reference_first_and_trains_one_model(runs):
    """IPO: at step 1 the policy is the precomputed reference (the same model, before any step), so every margin is
    0 and the IPO loss is (0 - 1 / (2 beta))^2 = 25; the step's loss adds RPO's 0.5 x the logged NLL of the chosen
    tokens. The implicit prompts were found; the whole model is saved."""
    results = runs["full"]["results"]
    assert results["method"] == "full" and results["data/format"] == "conversational_implicit"
    first = results["train/log"][0]
    assert results["train/loss_curve"][0] == pytest.approx(25.0 + 0.5 * first["train/nll_loss"], rel=1e-6)
    assert first["train/loss"] == pytest.approx(results["train/loss_curve"][0], rel=1e-6)
    assert first["train/rewards/margins"] == pytest.approx(0, abs=1e-6) and first["train/nll_loss"] > 0
    assert results["train/loss_curve"][-1] < results["train/loss_curve"][0]
    assert "reference: the log-probs of" in runs["full"]["log"]
    assert (runs["full"]["dir"] / "model.safetensors").is_file()
    assert results["model/trainable_parameters"] == results["model/total_parameters"]


@pytest.mark.slow
def test_an_sft_adapter_is_continued_against_its_frozen_copy(runs, base):
    """The reference is the SFT policy: at step 1 the margins are 0 (loss log 2, label smoothing or not); the saved
    adapter is the continued SFT adapter alone (its rank and targets, no reference copy), moved from where it
    started; prompts longer than --max_prompt_length were cut and counted."""
    results = runs["sft_adapter"]["results"]
    assert results["train/loss_curve"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert results["data/format"] == "standard"
    assert results["config"]["model_name_or_path"] == str(base)
    saved, started = adapter(runs["sft_adapter"]), load_file(base / "sft_adapter" / "adapter_model.safetensors")
    assert saved.keys() == started.keys() and not any("reference" in name for name in saved)
    assert max_relative_difference(started, saved) > 1e-4
    assert json.loads((runs["sft_adapter"]["dir"] / "adapter_config.json").read_text())["r"] == 4
    assert results["data/counts"]["train"]["prompts_cut"] > 0


# ----------------------------------------------------------------------------- in process: the reference, the loss
@pytest.fixture(scope="module")
def recipe():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dpo_recipe", REPO / "recipes" / RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    pairs = [{**tokenize_pair(row, fmt, tokenizer, 512, 256), "index": i} for i, row in enumerate(rows)]
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
        r=4,
        alpha=8,
        dropout=0.0,
        target_modules=["all-linear"],
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


def test_long_prompts_are_cut_from_the_left_and_completions_to_what_max_length_leaves(base):
    """The end of a long prompt (next to the answer) is kept; each completion gets what --max_length leaves."""
    from transformers import AutoTokenizer

    from dpo_kit.preference_data import tokenize_pair

    tokenizer = AutoTokenizer.from_pretrained(base)
    row = {
        "prompt": "Is asyncio.run a class, a function or a method? " * 3,
        "chosen": "a function, of course " * 4,
        "rejected": "a class",
    }
    whole = tokenizer(row["prompt"])["input_ids"]
    pair = tokenize_pair(row, "standard", tokenizer, max_length=20, max_prompt_length=8)
    assert pair["prompt_ids"] == whole[-8:] and pair["prompt_cut"] and pair["completion_cut"]
    chosen = tokenizer(row["chosen"], add_special_tokens=False)["input_ids"]
    assert pair["chosen_ids"] == chosen[:12] and pair["rejected_ids"][-1] == tokenizer.eos_token_id


# ----------------------------------------------------------------------------- refusals
BAD_ROWS = [
    ({"prompt": "Q?", "chosen": "yes", "rejected": None}, "Row 2 of test has no 'rejected'"),
    ({"prompt": "Q?", "chosen": "", "rejected": "no"}, "Row 2 of test has no 'chosen'"),
    ({"prompt": "Q?", "chosen": "same", "rejected": "same"}, "Row 2 of test: 'chosen' and 'rejected' are identical"),
]
USER, ANSWER = {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}
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
    from shared.runtime import RecipeError

    good = (
        {"prompt": "Q?", "chosen": "yes", "rejected": "no"}
        if "prompt" in row
        else {"chosen": [USER, ANSWER], "rejected": [USER, {"role": "assistant", "content": "B"}]}
    )
    with pytest.raises(RecipeError) as error:
        preference_format(datasets.Dataset.from_list([good, row]), "test")
    assert message in error.value.message


def test_flags_and_inputs_that_cannot_work_are_refused(recipe, base, capsys):
    """In-process: --precompute_reference with LoRA, a negative --rpo_alpha, an adapter trained on another base, a
    prompt that leaves no completion token, a file without chosen/rejected. And one launch: a bad row stops the run
    with one paragraph naming the file and the row, printed once, and a non-zero exit."""
    import datasets
    from transformers import AutoTokenizer

    from dpo_kit.preference_data import preference_format
    from llm_kit.adapters import starting_point
    from shared.runtime import RecipeError

    with pytest.raises(SystemExit):
        recipe.parse_args(["--precompute_reference"])
    assert "with LoRA the reference is the same model with the adapter switched off" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recipe.parse_args(["--rpo_alpha", "-1"])
    assert "--rpo_alpha weighs the chosen answers' NLL: 0 or more, not -1.0" in capsys.readouterr().err
    with pytest.raises(RecipeError) as error:
        starting_point(OneProcess, str(base / "sft_adapter"), "Qwen/Qwen2.5-0.5B", True, base, REPO / "recipes")
    assert f"was trained on {str(base)!r}, not on --model_name_or_path 'Qwen/Qwen2.5-0.5B'" in error.value.message
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "short", "chosen": "a", "rejected": "b"},
            {"prompt": "a much longer prompt " * 8, "chosen": "a", "rejected": "b"},
        ]
    )
    with pytest.raises(RecipeError) as error:
        preference_format(rows, "--train_file 'x.jsonl'", tokenizer, max_length=16, max_prompt_length=16)
    assert "Row 2 of --train_file 'x.jsonl': its 'prompt' has" in error.value.message
    assert preference_format(rows, "x", tokenizer, max_length=16, max_prompt_length=8) == "standard"
    with pytest.raises(RecipeError) as error:
        preference_format(datasets.Dataset.from_list([{"prompt": "q", "completion": "a"}]), "x")
    assert "x has no 'chosen' and no 'rejected' column" in error.value.message
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
