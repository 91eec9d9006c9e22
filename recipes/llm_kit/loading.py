"""The base model of ``recipes/llm_finetune.py``: the offline default (pretrained by ``recipes/train_lm.py`` when
there is none), its config checked, loading it (16/32-bit or 4-bit NF4, onto one device, split over two, or on the
meta device for FSDP2's low host-RAM loading), the adapter
merged into a fresh copy of it, and what low-RAM loading handed each process. ``load_base_model`` is the one place
that loads the weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from shared.fsdp import available_host_ram, check_offload_fits_host_ram, set_wrap_at_blocks
from shared.model_split import dispatch_on_devices, find_block_list, lm_head_cost_in_blocks, plan_device_map
from shared.checkpoints import save_final
from shared.errors import RecipeError
from shared.accelerator import main_process_alone
from shared.flags import model_problem


# TRL's max_length (SFTConfig's and DPOConfig's): where no --max_length is given, or the model's positions if fewer.
DEFAULT_MAX_LENGTH = 1024
# Encoder-only architectures that AutoModelForCausalLM would load anyway (BertLMHeadModel ...), but are not causal LMs.
ENCODER_ONLY = {
    "bert",
    "roberta",
    "xlm-roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta",
    "deberta-v2",
    "mpnet",
    "camembert",
    "modernbert",
}


def default_base_model(accelerator, output_dir: Path, recipes_dir: Path) -> str:
    """``outputs/train_lm`` (what ``recipes/train_lm.py`` saves by default) if it holds a model; otherwise a small one
    pretrained here first with that recipe, on one process (the others wait), in ``output_dir/base_model``."""
    for candidate in (Path("outputs/train_lm"), output_dir / "base_model"):
        if (candidate / "config.json").is_file() and (candidate / "tokenizer.json").is_file():
            return str(candidate)
    recipe = recipes_dir / "train_lm.py"
    if not recipe.is_file():
        raise RecipeError(
            "No --model_name_or_path given and no pretrained model in outputs/train_lm. Pass a local "
            "folder or Hub name of a causal LM (the pretraining fallback needs recipes/train_lm.py "
            "beside this recipe)."
        )
    target = output_dir / "base_model"
    # Minutes of pretraining on the main process: the others wait untimed (a barrier bounded by --dist_timeout would
    # kill the run while it is only slow).
    with main_process_alone(accelerator):
        if accelerator.is_main_process:
            command = [
                sys.executable,
                str(recipe),
                "--model_size",
                "small",
                "--max_train_steps",
                "150",
                "--corpus_max_mb",
                "3",
                "--per_device_train_batch_size",
                "8",
                "--block_size",
                "256",
                "--sample_tokens",
                "0",
                "--output_dir",
                str(target),
            ]
            accelerator.print(
                "no base model yet: pretraining one first (a 1-process run, a few minutes on a CPU): "
                + " ".join(command)
            )
            # A plain 1-process run: none of this launch's distributed settings may reach it.
            launch = ("RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_", "ACCELERATE_")
            env = {key: value for key, value in os.environ.items() if not key.startswith(launch)}
            done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                raise RecipeError(
                    f"Pretraining the default base model failed: {done.stdout.strip().splitlines()[-1][:300]}"
                )
    return str(target)


def causal_lm_config(accelerator, name_or_path: str, load_in_4bit: bool = False, trust_remote_code: bool = False):
    """The model's config, checked before any data work: a model that is not a causal LM, or ``load_in_4bit`` without
    bitsandbytes or on another device than CUDA or the CPU, is refused."""
    if load_in_4bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise RecipeError(
                "--load_in_4bit needs bitsandbytes: pip install -r requirements.txt (bitsandbytes==0.50.2)."
            ) from None
        if accelerator.device.type not in ("cuda", "cpu"):
            raise RecipeError(f"--load_in_4bit runs on CUDA GPUs and the CPU here, not on {accelerator.device.type}.")
    if problem := model_problem(name_or_path):  # a missing path, a folder without config.json
        raise RecipeError(problem)
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise RecipeError(
            f"Could not load model {name_or_path!r}: {str(error).splitlines()[0][:300]} Pass a local "
            "folder with config.json and weights, or a Hub name when online."
        ) from None
    if config.model_type in ENCODER_ONLY or getattr(config, "is_encoder_decoder", False):
        raise RecipeError(
            f"{name_or_path!r} is a {config.model_type} model, not a causal (decoder-only) LM, so it cannot generate "
            "answers. Use a decoder such as Llama, Qwen, Mistral, Gemma or GPT-2; to classify text, use "
            "recipes/transformer_finetune.py."
        )
    return config


def model_positions(config) -> int | None:
    """How many positions the model has (``n_positions``: GPT-2's name), or None when its config does not say."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def max_length_within_positions(accelerator, config, name_or_path: str, max_length: int | None) -> int:
    """``max_length`` (None: none given, ``DEFAULT_MAX_LENGTH``), cut to the model's positions where it is beyond them
    (said so, in the words of the flag given or of the default)."""
    positions = model_positions(config)
    given, max_length = max_length is not None, max_length or DEFAULT_MAX_LENGTH
    if positions and max_length > positions:
        # Longer rows would index past the position embeddings (an IndexError mid-run) or past what the model learned.
        accelerator.print(
            f"--max_length {max_length} is more than the {positions} positions of {name_or_path}: "
            f"samples are cut to {positions} tokens"
            if given
            else f"samples are cut to the {positions} positions of {name_or_path}: the default --max_length, TRL's "
            f"{max_length}, is more than the model has"
        )
        max_length = positions
    return max_length


def load_base_model(
    accelerator,
    name_or_path: str,
    config,
    frozen: bool = True,
    load_in_4bit: bool = False,
    devices: list[torch.device] | None = None,
    max_length: int = 512,
    trust_remote_code: bool = False,
    merge_and_save: bool = False,
) -> torch.nn.Module:
    """The base model on this process's device, or split over ``devices`` (a device_map, one process) when given.
    ``frozen`` (LoRA): in the compute dtype (a 7B base in bf16 is 13.5 GB instead of 27; the adapter stays float32,
    PEFT upcasts it); with ``load_in_4bit`` in 4-bit NF4 with double quantization (QLoRA, bitsandbytes), prepared for
    training an adapter. Not ``frozen`` (a full fine-tune): float32 master weights, for mixed-precision autocast.

    Low host-RAM loading (FSDP2 with the config's ``fsdp_cpu_ram_efficient_loading``): only the main process reads
    the checkpoint; the others build the model's shape with no memory behind it (parameters on the meta device,
    buffers real), and ``accelerator.prepare()`` hands every process its shard of the main process's weights. Without
    it each of N processes holds the whole model in host RAM at once: 2 x 140 GB for a 70B model in bf16."""
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    dtype = compute_dtype if frozen else torch.float32
    if merge_and_save:
        check_merge_fits_host_ram(accelerator, config, name_or_path, trust_remote_code)
    if low_ram_loading(accelerator) and not accelerator.is_main_process and not load_in_4bit:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        model.tie_weights()  # built empty, a tied LM head has a matrix of its own: tied as the main process's loads
        return model
    quantization = load_device = None
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        # The storage dtype is the compute dtype, so that FSDP2 sees one dtype in every parameter it flattens and
        # shards.
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
        )
        # Quantized where it is loaded. One device: there. A split: on the CPU (a layer at a time, in host RAM), then
        # dispatch_on_devices moves each block to its own device, so that no GPU ever holds more than its share
        # (loaded onto a GPU, the whole 4-bit model would sit there before being split: 35 GB for a 70B model).
        load_device = {"": "cpu"} if devices else {"": str(accelerator.device)}
        if accelerator.is_fsdp2:
            # Under FSDP2 not even one GPU's worth: built empty, its weights come in one decoder layer at a time,
            # each sharded before the next (llm_kit/sharded_4bit.py), once LoRA is in place.
            model = empty_4bit_model(config, quantization, dtype, trust_remote_code)
            keep_4bit_weights_trainable(model)
            return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path,
        config=config,
        dtype=dtype,
        quantization_config=quantization,
        device_map=load_device,
        trust_remote_code=trust_remote_code,
    )
    if devices:
        # One dispatcher for every recipe that splits (shared/model_split.py), before LoRA: the adapter's weights are
        # then created on the device of the layer they adapt, inside its block's hook.
        block_list = find_block_list(model, set(model._no_split_modules))
        plan = plan_device_map(model, len(devices), last_cost=lm_head_cost_in_blocks(model, block_list, max_length))
        model, _ = dispatch_on_devices(model, plan, devices)
    if load_in_4bit:
        # Casts the remaining 16-bit weights (norms, embeddings) to float32 for stable training of the adapter. Not
        # its gradient checkpointing: the recipe turns that on itself, by transformers' current name.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        keep_4bit_weights_trainable(model)  # an evaluation before training must not repack them out of reach
    return model


def empty_4bit_model(config, quantization, dtype: torch.dtype, trust_remote_code: bool = False):
    """The model ``from_pretrained(..., quantization_config=quantization, dtype=dtype)`` would build, with no weights:
    parameters on the meta device (buffers real), every ``Linear4bit`` weight a one-element stand-in of its shape."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=False)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    quantizer.preprocess_model(model=model, dtype=dtype, device_map=None)  # nn.Linear -> Linear4bit, on meta
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # One element stretched to the shape the quantized weight will have (4 bits a weight, packed into the
            # storage dtype; no memory): what PEFT reads (device, 4-bit type, parameter count).
            packed = module.out_features * module.in_features // (2 * torch.empty((), dtype=dtype).element_size())
            stand_in = torch.empty((), dtype=dtype).expand(packed, 1)
            module.weight = bnb.nn.Params4bit(stand_in, requires_grad=False, **module.weight.__dict__)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)  # the quantization config, is_loaded_in_4bit: as after from_pretrained
    return model


def low_ram_loading(accelerator) -> bool:
    """True under FSDP2 when the launch config asks for low host-RAM loading (``fsdp_cpu_ram_efficient_loading``)."""
    return accelerator.is_fsdp2 and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true"


def parameter_counts(accelerator, model: torch.nn.Module, name_or_path: str) -> tuple[int, int]:
    """Trained and total parameters (PEFT counts each 4-bit weight as the parameters it stands for), printed with the
    base weights' dtype."""
    if hasattr(model, "get_nb_trainable_parameters"):  # a PeftModel
        trainable, total = model.get_nb_trainable_parameters()
        base = model.get_base_model()
    else:
        trainable = total = sum(parameter.numel() for parameter in model.parameters())
        base = model
    weights = "4-bit NF4" if getattr(base, "is_loaded_in_4bit", False) else str(base.dtype)
    accelerator.print(
        f"model: {name_or_path}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trained "
        f"({trainable / total:.2%}); weights in {weights}"
    )
    return trainable, total


def check_merge_fits_host_ram(accelerator, config, name_or_path: str, trust_remote_code: bool = False) -> None:
    """``--merge_and_save`` loads the whole base in bf16 (or fp32) on the main process, after training: refuse before
    training when this machine's free host RAM cannot hold it (+10 % for the adapter and saving), with the command
    that merges on a machine that can (a 70B base needs ~140 GB). Every process decides; all raise together."""
    with init_empty_weights():  # the parameter count, from the config: no weights read
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model.tie_weights()  # built empty, a tied LM head has a matrix of its own: counted once, as it is loaded
    count = sum(p.numel() for p in model.parameters())
    dtype_name = "bfloat16" if accelerator.mixed_precision == "bf16" else "float32"
    needed = int(count * (2 if dtype_name == "bfloat16" else 4) * 1.1)
    available, source = available_host_ram()
    if needed > available:
        raise RecipeError(
            f"--merge_and_save loads the whole base ({count / 1e9:.1f}B parameters in {dtype_name}) on the main "
            f"process after training: {needed / 2**30:.1f} GiB of host RAM, but only {available / 2**30:.1f} GiB is "
            f"free ({source}). Train without --merge_and_save (the adapter is saved either way), then merge where the "
            'RAM is (OUTPUT_DIR: your --output_dir): python -c "from peft import AutoPeftModelForCausalLM; '
            f"AutoPeftModelForCausalLM.from_pretrained('OUTPUT_DIR', dtype='{dtype_name}').merge_and_unload()"
            ".save_pretrained('OUTPUT_DIR/merged')\""
        )


def save_merged(accelerator, name_or_path: str, adapter_dir: Path, tokenizer, trust_remote_code: bool = False) -> None:
    """The base with the adapter merged in, to ``adapter_dir/merged`` for ``AutoModelForCausalLM.from_pretrained``:
    into a fresh copy of the base in the compute dtype (bf16, or float32; a 4-bit base cannot take the merged weights
    exactly, and fp16 could overflow). On the main process alone (minutes for a 13B model; the others wait untimed),
    written whole or not at all (``save_final``). Every process calls it."""

    def write(folder: Path) -> None:
        from peft import PeftModel

        dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        base = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code)
        PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(folder / "merged")
        tokenizer.save_pretrained(folder / "merged")

    save_final(accelerator, adapter_dir, write, adapter_dir / "checkpoints")
    accelerator.print(f"merged the adapter into the base model: {adapter_dir / 'merged'}")


def keep_4bit_weights_trainable(model: torch.nn.Module) -> None:
    """Turns off, in every bitsandbytes ``Linear4bit`` of ``model`` (QLoRA; nothing otherwise), the repacking of its
    4-bit weight for CPU inference. On a CPU with AVX512-BF16 the layer repacks its weight in place at its first
    forward in eval mode without gradients (the exact match before training is one) into a layout that only an
    inference kernel reads: every training forward after it would pass no gradient through the frozen base, and a
    layer whose in_features are not a multiple of its 64-weight block crashes instead. Off, evaluating and training
    use one layout on every CPU (CUDA never repacks)."""
    for layer in (module for module in model.modules() if hasattr(module, "support_avx512bf16_for_cpu")):
        layer.support_avx512bf16_for_cpu = False  # (read by Linear4bit.forward, set from the CPU when it was built)


def set_fsdp_units(accelerator, model) -> None:
    """Under FSDP, one unit per decoder block (``shared.fsdp.set_wrap_at_blocks``: the block class, said so), and an
    offload that cannot fit the host's memory refused now. Call before ``prepare``. Changes: the Accelerator's FSDP
    plugin (``transformer_cls_names_to_wrap``)."""
    block_class = set_wrap_at_blocks(accelerator, model, find_block_list(model, set(model._no_split_modules)))
    accelerator.print(f"fsdp: one unit per {block_class or 'configured block'}")
    check_offload_fits_host_ram(accelerator, model)
