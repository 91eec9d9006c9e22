"""FSDP2 on CPU with real sharding: 2 gloo processes under accelerate_configs/fsdp_2gpu.yaml train the
language model exactly like DDP while each holds half of the model state (parameters are sharded
DTensors), a sharded checkpoint resumes to the same end, the whole model is saved in Hugging Face
format, gradient checkpointing changes nothing, and the fine-tune recipe trains and saves under it.

All launches share one module-scoped fixture, run in two lanes at once (start-up, not training, is
most of a tiny run's time, and the machine has 2 cores); the bad-input messages are checked in-process."""

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from harness.launch import (
    Job,
    assert_offloaded_apart_from_plain,
    launch_all,
    observed,
    observer_env,
    read_facts,
    read_results,
)
from safetensors.torch import load_file

# The language model: tiny preset, 5 optimizer steps of 2 accumulated batches, 2 processes x 4 blocks
# of 32 tokens (a global batch of 16, as in test_lm_recipes.py), on the smallest corpus that gives
# 13 validation blocks. Llama has no dropout, so FSDP and DDP see the same numbers up to the order
# of the gradient sums.
LM = (
    "--model_size",
    "tiny",
    "--corpus_max_mb",
    "0.1",
    "--vocab_size",
    "512",
    "--block_size",
    "32",
    "--max_train_steps",
    "5",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--per_device_eval_batch_size",
    "4",
    "--max_eval_samples",
    "13",
    "--sample_tokens",
    "8",
)
# The fine-tune recipe: the real MiniLM, 2 steps of 2 x 8 docstrings.
FINETUNE = (
    "--max_train_samples",
    "32",
    "--max_eval_samples",
    "16",
    "--max_length",
    "32",
    "--per_device_train_batch_size",
    "8",
    "--per_device_eval_batch_size",
    "8",
    "--max_train_steps",
    "2",
    "--logging_steps",
    "1",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")

    def lm(config, *args, **job):
        return Job(config, "train_lm.py", (*LM, *args), **job)

    def stop_after_step_2():
        # What a run stopped after step 2 leaves behind: its tokenizer and checkpoints/step_000002.
        stopped = root / "resumed"
        shutil.copytree(root / "fsdp" / "checkpoints" / "step_000002", stopped / "checkpoints" / "step_000002")
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(root / "fsdp" / tokenizer_file, stopped)

    jobs = {
        # Both observed (tests/harness/observer): the activation bytes autograd saved per backward, with and without
        # gradient checkpointing, on the same micro-batches. This one's processes start as a user's (the others are
        # forks of the suite's zygotes): an FSDP2 launch started for real.
        "fsdp": lm(
            "fsdp_2gpu.yaml",
            "--checkpointing_steps",
            "2",
            env=observer_env(root / "observed" / "fsdp"),
            kwargs={"forked": False},
        ),
        "ddp": lm("ddp_2gpu.yaml"),
        # --gradient_checkpointing here too: recomputing activations must not change a single number,
        # so this one run checks both the sharded resume and gradient checkpointing under FSDP.
        "resumed": lm(
            "fsdp_2gpu.yaml",
            "--resume_from_checkpoint",
            "latest",
            "--gradient_checkpointing",
            after="fsdp",
            prepare=stop_after_step_2,
            env=observer_env(root / "observed" / "resumed"),
        ),
        "finetune": Job("fsdp_2gpu.yaml", "transformer_finetune.py", FINETUNE),
        # FSDP2 with CPU offload: the shards, their gradients and AdamW's state on the host.
        "offload": lm("fsdp_offload_2gpu.yaml"),
    }
    for name, job in jobs.items():
        job.args = (*job.args, "--output_dir", root / name)
    for name in ("ddp", "finetune", "offload"):  # their sharding and model-state bytes, seen by the observer
        jobs[name].kwargs["observe"] = True
    finished = launch_all(jobs)
    out = {}
    for name, run in finished.items():
        assert run.returncode == 0, f"{name}: {run}"
        out[name] = {
            "dir": root / name,
            "results": read_results(root / name),
            "log": run.output,
            "observed": observed(root / "observed" / name, jobs[name].script),
        }
    return out


def max_weight_difference(dir_a, dir_b) -> float:
    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


@pytest.mark.slow
def test_auto_picks_fsdp_under_the_fsdp_config(runs):
    results = runs["fsdp"]["results"]
    assert (results["parallelism"], results["parallelism_requested"]) == ("fsdp", "auto")
    for facts in read_facts(runs["fsdp"]["dir"])["fsdp/sharding"].values():  # really sharded: the observer
        assert (
            facts["dtensor_parameters"] == facts["parameters"] and facts["local_numel"] <= 0.55 * facts["global_numel"]
        )
    assert results["num_processes"] == 2 and results["global_batch_size"] == 16 and results["completed_steps"] == 5
    assert "fsdp: one unit per LlamaDecoderLayer" in runs["fsdp"]["log"]


@pytest.mark.slow
def test_fsdp_trains_like_ddp(runs):
    fsdp, ddp = runs["fsdp"]["results"], runs["ddp"]["results"]
    assert ddp["parallelism"] == "ddp"
    curve, reference = np.array(fsdp["train/loss_curve"]), np.array(ddp["train/loss_curve"])
    assert len(curve) == len(reference) == 5
    assert np.max(np.abs(curve - reference) / np.abs(reference)) <= 1e-5
    assert max_weight_difference(runs["fsdp"]["dir"], runs["ddp"]["dir"]) <= 1e-5
    assert fsdp["eval/perplexity"] == pytest.approx(ddp["eval/perplexity"], rel=1e-5)


@pytest.mark.slow
def test_parameters_are_sharded_dtensors(runs):
    """Every parameter is a DTensor and each process holds half of the model's elements."""
    sharding = read_facts(runs["fsdp"]["dir"])["fsdp/sharding"]  # seen by the observer
    assert set(sharding) == {"rank0", "rank1"}
    num_layers = runs["fsdp"]["results"]["config"]["model_config"]["num_hidden_layers"]
    for facts in sharding.values():
        assert facts["dtensor_parameters"] == facts["parameters"] > 0
        assert facts["global_numel"] == runs["fsdp"]["results"]["model/num_parameters"]
        assert facts["local_numel"] <= 0.55 * facts["global_numel"]
        assert facts["fsdp_modules"] >= num_layers + 1  # one per decoder block, plus the root
    assert sum(facts["local_numel"] for facts in sharding.values()) == sharding["rank0"]["global_numel"]


@pytest.mark.slow
def test_model_state_per_process_is_about_half_of_ddps(runs):
    """Parameters + gradients + AdamW state (exact tensor bytes, seen by the observer): DDP holds all of it on every
    process."""
    fsdp, ddp = (read_facts(runs[name]["dir"])["memory/model_state_bytes"] for name in ("fsdp", "ddp"))
    assert set(fsdp) == set(ddp) == {"rank0", "rank1"}
    for rank in fsdp:
        assert fsdp[rank]["total"] <= 0.55 * ddp[rank]["total"], (rank, fsdp[rank], ddp[rank])
        for part in ("parameters", "gradients", "optimizer"):
            assert 0 < fsdp[rank][part] <= 0.55 * ddp[rank][part], (rank, part)


@pytest.mark.slow
def test_checkpoint_is_sharded_and_resumes_to_the_same_end(runs):
    checkpoint = runs["fsdp"]["dir"] / "checkpoints" / "step_000002"
    # torch.distributed.checkpoint: each process wrote its own shard of the model and of the optimizer.
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {path.name for path in (checkpoint / folder).glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert "at step 2 (epoch 0, skipping 4 batches)" in runs["resumed"]["log"]
    resumed, uninterrupted = runs["resumed"]["results"], runs["fsdp"]["results"]
    assert resumed["parallelism"] == "fsdp" and resumed["completed_steps"] == 5
    # The whole curve (steps 1-2 from the checkpoint, not only the resumed ones), equal to the uninterrupted run's.
    assert resumed["train/loss_curve"] == pytest.approx(uninterrupted["train/loss_curve"], rel=1e-6)
    assert max_weight_difference(runs["resumed"]["dir"], runs["fsdp"]["dir"]) <= 1e-6


@pytest.mark.slow
def test_gradient_checkpointing_saves_fewer_activations_and_gives_the_same_losses(runs):
    """The resumed run recomputed its activations (non-reentrant checkpointing inside FSDP units): in every process,
    autograd kept far fewer bytes for each backward than the uninterrupted run did for the same micro-batches (4 blocks
    of 32 tokens; what the observer's saved-tensor hooks counted), and the losses are the same."""
    resumed, uninterrupted = runs["resumed"]["observed"], runs["fsdp"]["observed"]
    assert set(resumed) == set(uninterrupted) == {"rank0", "rank1"}
    for rank in resumed:
        checkpointed, plain = resumed[rank]["saved_bytes"], uninterrupted[rank]["saved_bytes"]
        # One count per backward: 3 and 5 optimizer steps of 2 accumulated micro-batches.
        assert (len(checkpointed), len(plain)) == (6, 10), rank
        # Without checkpointing each of the 4 blocks keeps its inputs, attention and MLP intermediates (and the
        # gathered weights they multiply); with it, a block keeps only its input: measured about 1/5 here.
        assert max(checkpointed) <= 0.5 * min(plain), (rank, checkpointed, plain)
    resumed, uninterrupted = runs["resumed"]["results"], runs["fsdp"]["results"]
    curve, reference = np.array(resumed["train/loss_curve"][2:]), np.array(uninterrupted["train/loss_curve"][2:])
    assert np.max(np.abs(curve - reference) / np.abs(reference)) <= 1e-5


@pytest.mark.slow
def test_cpu_offload_really_offloads_and_trains_like_fsdp(runs):
    """Every FSDP2 parameter of the offload run is under FSDP2's CPUOffloadPolicy, none of the fsdp_2gpu.yaml run's,
    and the steps are FSDP's (``assert_offloaded_apart_from_plain`` in tests/harness/launch.py: what differs on which
    device)."""
    offload, fsdp = runs["offload"]["results"], runs["fsdp"]["results"]
    offload_sharding = read_facts(runs["offload"]["dir"])["fsdp/sharding"]  # seen by the observer
    for facts in offload_sharding.values():
        assert facts["dtensor_parameters"] == facts["parameters"]
    assert_offloaded_apart_from_plain(offload_sharding, read_facts(runs["fsdp"]["dir"])["fsdp/sharding"])
    np.testing.assert_allclose(offload["train/loss_curve"], fsdp["train/loss_curve"], rtol=1e-5)
    assert max_weight_difference(runs["offload"]["dir"], runs["fsdp"]["dir"]) <= 1e-5


@pytest.mark.slow
def test_saved_model_is_whole_and_loads(runs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, results = runs["fsdp"]["dir"], runs["fsdp"]["results"]
    model, loading = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    config = results["config"]["model_config"]
    assert model.get_input_embeddings().weight.shape == (config["vocab_size"], config["hidden_size"])  # not a shard
    assert sum(parameter.numel() for parameter in model.parameters()) == results["model/num_parameters"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer(results["sample/prompt"], return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(generated[0]) == results["sample/text"]


@pytest.mark.slow
def test_finetune_trains_sharded_and_saves_a_loadable_model(runs):
    from transformers import AutoModelForSequenceClassification

    results = runs["finetune"]["results"]
    assert (results["parallelism"], results["completed_steps"]) == ("fsdp", 2)
    assert "fsdp: one unit per BertLayer" in runs["finetune"]["log"]
    sharding = read_facts(runs["finetune"]["dir"])["fsdp/sharding"]  # seen by the observer
    for facts in sharding.values():
        assert (
            facts["dtensor_parameters"] == facts["parameters"] and facts["local_numel"] <= 0.55 * facts["global_numel"]
        )
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        runs["finetune"]["dir"], output_loading_info=True
    )
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    assert sum(parameter.numel() for parameter in model.parameters()) == sharding["rank0"]["global_numel"]
    assert model.config.id2label[0] == results["label_names"][0]


# ----------------------------------------------------------------------------- bad input
# The recipes call choose_parallelism right after building the Accelerator, before any data or model work, so its
# messages are what a user sees (one line per process). Checked here in-process against a stand-in Accelerator: a
# launch would spend most of the file's time budget importing.
def refusal(monkeypatch, parallelism, num_processes, distributed_type, fsdp_config: bool) -> str:
    from shared.errors import RecipeError
    from shared.parallelism import choose_parallelism

    stand_in(monkeypatch, fsdp_config)
    accelerator = SimpleNamespace(
        num_processes=num_processes, distributed_type=distributed_type, device=torch.device("cpu")
    )
    with pytest.raises(RecipeError) as refused:
        choose_parallelism(accelerator, parallelism, "recipes/train_lm.py")
    assert "\n" not in refused.value.message  # one line
    return refused.value.message


def stand_in(monkeypatch, fsdp_config: bool) -> None:
    if fsdp_config:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch sets for an FSDP config
    else:
        monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)


def test_fsdp_with_one_process_runs_fsdps_code_path_and_says_so(monkeypatch):
    """1 process under the FSDP config (the GPU check runs it on one GPU): FSDP2's code path, nothing to shard."""
    from accelerate.utils import DistributedType
    from shared.parallelism import choose_parallelism

    stand_in(monkeypatch, fsdp_config=True)
    accelerator = SimpleNamespace(num_processes=1, distributed_type=DistributedType.FSDP, device=torch.device("cpu"))
    for requested in ("auto", "fsdp"):
        chosen = choose_parallelism(accelerator, requested, "recipes/train_lm.py")
        assert chosen.name == "fsdp" and "nothing to shard over" in chosen.reason


@pytest.mark.parametrize("parallelism, config", [("pipeline", "pipeline_2gpu.yaml"), ("ddp", "ddp_2gpu.yaml")])
def test_fsdp_config_is_not_combined_with_another_parallelism(monkeypatch, parallelism, config):
    from accelerate.utils import DistributedType

    message = refusal(monkeypatch, parallelism, 2, DistributedType.FSDP, fsdp_config=True)
    assert f"FSDP is not combined with {parallelism}" in message and f"accelerate_configs/{config}" in message


def test_fsdp_needs_the_fsdp_config(monkeypatch):
    from accelerate.utils import DistributedType
    from shared.parallelism import choose_parallelism

    message = refusal(monkeypatch, "fsdp", 2, DistributedType.MULTI_CPU, fsdp_config=False)
    assert (
        "--parallelism fsdp needs the FSDP launch config" in message and "accelerate_configs/fsdp_2gpu.yaml" in message
    )
    accelerator = SimpleNamespace(
        num_processes=2, distributed_type=DistributedType.MULTI_CPU, device=torch.device("cpu")
    )
    assert choose_parallelism(accelerator, "ddp", "recipes/train_lm.py").name == "ddp"


@pytest.mark.parametrize("parallelism", ["single", "device_map"])
def test_a_one_process_parallelism_in_a_2_process_launch_is_refused(monkeypatch, parallelism):
    """--parallelism single under a 2-process launch would train as DDP (Accelerate wraps the model) while the recipe
    counts one process's batches: steps per epoch twice over, the logged loss a sum. Refused, naming the launch."""
    from accelerate.utils import DistributedType

    message = refusal(monkeypatch, parallelism, 2, DistributedType.MULTI_CPU, fsdp_config=False)
    assert f"--parallelism {parallelism}" in message and "this launch has 2 processes" in message
    assert "accelerate_configs/" in message and "--parallelism auto" in message
