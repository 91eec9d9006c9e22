"""The launch line the recommendation ends with: the recipe, its accelerate config and its flags."""

from __future__ import annotations

from pathlib import Path

from shared.presets import MODEL_PRESETS
from tools.planner.shapes import ModelShape
from tools.planner.tables import HUB_NAMES

# In a launch line, for a config.json with no weights beside it: the one word the user must replace (a bare word, so
# that the shell does not read it as a redirection); the text output says so under the line.
WEIGHTS_PLACEHOLDER = "FOLDER_WITH_THE_WEIGHTS"
# The fine-tunes' data flag, always in their lines: without it they train the model on their bundled questions.
DATA_PLACEHOLDER = "YOUR_DATA.jsonl"


def loadable_location(location: str) -> str:
    """What ``recipes/llm_finetune.py --model_name_or_path`` can load for the planner's ``--model_name_or_path``: a Hub
    name as it is; a config.json or a folder by the folder, when the weights lie there; otherwise the placeholder."""
    path = Path(location)
    if not path.exists():
        return location  # a Hub name
    folder = path.parent if path.is_file() else path
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")) or any(folder.glob("*.safetensors.index.json")):
        return str(folder)
    return WEIGHTS_PLACEHOLDER


def launch_line(shape: ModelShape, name: str, checkpointing: bool, config: str | None, request: dict) -> str | None:
    """The recipe command for this setup: train_lm.py / pipeline_lm.py for full fine-tuning of a preset the
    recipes build, llm_finetune.py (DPO: dpo.py, the same flags) for a model it can load by name or path; None when
    there is neither."""
    if config is None:
        return None
    dpo = request["objective"] in ("dpo", "grpo")  # the preference and RL recipes take a model by name or path
    if request["method"] == "full" and shape.name in MODEL_PRESETS and not dpo:
        recipe, flags = _preset_recipe(shape, name, request)
    elif name == "pipeline":
        return None
    else:
        preset = shape.name in MODEL_PRESETS
        location = HUB_NAMES.get(shape.name) or (None if preset else loadable_location(shape.name))
        if location is None:
            return None
        recipe = {"dpo": "dpo.py", "grpo": "grpo.py"}.get(request["objective"], "llm_finetune.py")
        flags = _grpo_flags(location, request) if recipe == "grpo.py" else _finetune_flags(location, request)
    if name == "generation_split":
        flags.append("--generation_mode split")
    if name == "device_map":
        # Explicit: on a 2-GPU box the 1-process config would pick it anyway, on one GPU or none it would not.
        flags.append("--parallelism device_map")
    if request["mixed_precision"] != "no":
        flags.append(f"--mixed_precision {request['mixed_precision']}")
    if checkpointing:
        flags.append("--gradient_checkpointing")
    return f"accelerate launch --config_file accelerate_configs/{config} recipes/{recipe} " + " ".join(flags)


def _preset_recipe(shape: ModelShape, name: str, request: dict) -> tuple[str, list[str]]:
    """train_lm.py (or pipeline_lm.py) building the preset; a pipeline's batch is its micro-batches together."""
    recipe = "pipeline_lm.py" if name == "pipeline" else "train_lm.py"
    batch = request["micro_batch"] * (request["num_microbatches"] if name == "pipeline" else 1)
    flags = [
        f"--model_size {shape.name}",
        f"--vocab_size {shape.vocab_size}",
        f"--block_size {request['seq_len']}",
        f"--per_device_train_batch_size {batch}",
    ]
    if name == "pipeline":
        schedule, microbatches = request["pipeline_schedule"], request["num_microbatches"]
        flags.append(f"--pipeline_schedule {schedule} --num_microbatches {microbatches}")
    return recipe, flags


def _finetune_flags(location: str, request: dict) -> list[str]:
    """llm_finetune.py's flags for the data, the method (full, LoRA: its default, QLoRA), the rank and the sizes;
    dpo.py has the same, and ``--no-precompute_reference`` for a reference copy (precomputing is its default)."""
    method = request["method"]
    flags = [f"--model_name_or_path {location}", f"--train_file {DATA_PLACEHOLDER}"]
    flags += {"full": ["--full_finetune"], "lora": [], "qlora": ["--load_in_4bit"]}[method]
    if request["precompute_reference"] is False:
        flags.append("--no-precompute_reference")
    if method != "full" and request["lora_r"] != 8:
        flags.append(f"--lora_r {request['lora_r']}")
    flags += [f"--max_length {request['seq_len']}", f"--per_device_train_batch_size {request['micro_batch']}"]
    return flags


def _grpo_flags(location: str, request: dict) -> list[str]:
    """grpo.py's flags: the data, the method, the rank, completions per forward, the group and ``--beta``; the
    prompt and completion lengths are the user's (``--seq_len`` is their sum), so the line leaves them out."""
    method = request["method"]
    flags = [f"--model_name_or_path {location}", f"--train_file {DATA_PLACEHOLDER}"]
    flags += {"full": ["--full_finetune"], "lora": [], "qlora": ["--load_in_4bit"]}[method]
    if method != "full" and request["lora_r"] != 8:
        flags.append(f"--lora_r {request['lora_r']}")
    flags.append(f"--per_device_train_batch_size {request['micro_batch']}")
    flags.append(f"--num_generations {request['num_generations']}")
    if request["beta"]:
        flags.append(f"--beta {request['beta']:g}")
    return flags
