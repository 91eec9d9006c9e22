"""The LoRA adapter: checkpoints that hold it alone (every recipe of the family), and what the preference and RL
recipes (``recipes/dpo.py``, ``recipes/grpo.py``) start from and measure against: the SFT adapter to continue (the
offline default: what ``recipes/llm_finetune.py`` saved), loaded to train and as a frozen reference copy, and the
switch to the reference policy (that copy, or the base with the adapter off)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

from shared.errors import RecipeError
from shared.lora import lora_model

from .loading import default_base_model, load_base_model

SFT_DEFAULT = "outputs/llm_finetune"  # where recipes/llm_finetune.py saves its offline default adapter

# What a run of the offline default model prints of the flags it chose (each recipe's OFFLINE_* settings).
OFFLINE_DEFAULTS_LINE = "the offline default model trains with {} (what makes it learn visibly; each flag changes it)"


def set_offline_defaults(args, settings: dict) -> str:
    """Set on ``args`` each of ``settings`` (what the offline default model trains with) that no flag set (it is
    None), and return the sentence that says so ("" when none is set). Changes ``args``."""
    chosen = {name: value for name, value in settings.items() if getattr(args, name) is None}
    vars(args).update(chosen)
    given = " ".join(f"--{name} {value if isinstance(value, str) else f'{value:g}'}" for name, value in chosen.items())
    return given and OFFLINE_DEFAULTS_LINE.format(given)


# The flags ``load_model`` takes, by the names the recipes' parsers give them.
MODEL_FLAGS = (
    "load_in_4bit",
    "trust_remote_code",
    "gradient_checkpointing",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
)
POLICY_FLAGS = (*MODEL_FLAGS, "adapter_name_or_path")  # the preference and RL recipes': an adapter to continue


def load_model(
    accelerator,
    model_name_or_path: str,
    config,
    *,
    lora: bool,
    load_in_4bit: bool,
    trust_remote_code: bool,
    gradient_checkpointing: bool,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    lora_target_modules: list[str],
    adapter_name_or_path: str | None = None,
    reference: bool = True,
    devices: list | None = None,
    max_length: int = 512,
    merge_and_save: bool = False,
):
    """The model a recipe trains: the base (``loading.load_base_model``: on this process's device or split over
    ``devices``, frozen with ``lora``, 4-bit with ``load_in_4bit``), recomputing activations in backward with
    ``gradient_checkpointing``, and with ``lora`` the adapter it trains: ``adapter_name_or_path`` continued (with a
    frozen ``reference`` copy: ``continued_adapter``) or a new one (``get_peft_model``; its reference, where a recipe
    has one, is the base with the adapter off). Without ``lora``: every weight trained."""
    model = load_base_model(
        accelerator,
        model_name_or_path,
        config,
        lora,
        load_in_4bit,
        devices or [],
        max_length,
        trust_remote_code,
        merge_and_save and lora,
    )
    if gradient_checkpointing:  # non-reentrant: the reentrant one breaks DDP and gets no grad from a frozen base
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if adapter_name_or_path:  # trained "default" (+ a frozen "reference" copy: the SFT policy)
        return continued_adapter(model, adapter_name_or_path, reference=reference)
    if not lora:
        return model
    adapter = dict(
        lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, lora_target_modules=lora_target_modules
    )
    return lora_model(model, model_name_or_path, **adapter, task_type="CAUSAL_LM")


def save_adapter_state(accelerator, folder: Path) -> None:
    """``accelerator.save_state(folder)`` with the trained weights alone (LoRA's adapter), not the frozen base (13.5 GB
    for a 7B model in bf16, at every save, and every rank's share of it under FSDP2). Elsewhere than FSDP2, a
    pre-hook for this one save keeps the weights that require grad. Under FSDP2 ``save_state`` writes the model with
    ``save_fsdp_model``, which takes ``adapter_only=True`` (PEFT's adapter state dict, still sharded: each rank writes
    its shard) but cannot be given it through ``save_state``: its steps are taken here, the model's with that
    argument, in its order (the model, the optimizer, then the scheduler, samplers, RNG states and step)."""
    if not accelerator.is_fsdp2:

        def keep_trained(models, weights, folder):
            for index, model in enumerate(models):
                trained = {n for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}
                weights[index] = {name: tensor for name, tensor in weights[index].items() if name in trained}

        hook = accelerator.register_save_state_pre_hook(keep_trained)
        try:
            accelerator.save_state(str(folder))
        finally:
            hook.remove()
        return
    plugin, models, optimizers = accelerator.state.fsdp_plugin, accelerator._models, accelerator._optimizers
    Path(folder).mkdir(parents=True, exist_ok=True)
    for index, model in enumerate(models):
        save_fsdp_model(plugin, accelerator, model, str(folder), index, adapter_only=True)
    for index, optimizer in enumerate(optimizers):
        save_fsdp_optimizer(plugin, accelerator, optimizer, models[index], str(folder), index)
    save_accelerator_state(
        str(folder),
        [],  # the model and optimizer: written above
        [],
        accelerator._schedulers,
        accelerator._dataloaders,
        accelerator.process_index,
        accelerator.step,
        accelerator.scaler,
        save_on_each_node=accelerator.project_configuration.save_on_each_node,
    )


def adapter_checkpoints(accelerator) -> tuple:
    """The functions that load and write a checkpoint holding the adapter alone (``load_adapter_state``,
    ``save_adapter_state``), for ``shared.checkpoints.load_checkpoint(load_state=...)`` and ``save_checkpoint
    (write_state=...)``."""
    return (lambda folder: load_adapter_state(accelerator, folder)), (
        lambda folder: save_adapter_state(accelerator, folder)
    )


def load_adapter_state(accelerator, folder: Path) -> None:
    """``accelerator.load_state(folder)`` of a ``save_adapter_state`` checkpoint: the adapter into the model built
    with its base (not strict: the base is not in it), then the optimizer, scheduler, samplers, RNG states and step.
    Under FSDP2 ``load_fsdp_model`` with ``adapter_only=True``, as ``save_adapter_state`` wrote it, in
    ``load_state``'s order."""
    if not accelerator.is_fsdp2:
        accelerator.load_state(str(folder), strict=False)
        return
    plugin, models, optimizers = accelerator.state.fsdp_plugin, accelerator._models, accelerator._optimizers
    for index, model in enumerate(models):
        load_fsdp_model(plugin, accelerator, model, str(folder), index, adapter_only=True)
    for index, optimizer in enumerate(optimizers):
        load_fsdp_optimizer(plugin, accelerator, optimizer, models[index], str(folder), index)
    several = accelerator.num_processes > 1 and accelerator.multi_device  # load_state's choice of map_location
    loaded = load_accelerator_state(
        str(folder),
        [],
        [],
        accelerator._schedulers,
        accelerator._dataloaders,
        accelerator.process_index,
        accelerator.scaler,
        map_location="on_device" if several else "cpu",
    )
    accelerator.step = loaded.get("step", accelerator.step)


# The flags ``starting_point`` takes, by the names the recipes' parsers give them.
START_FLAGS = ("adapter_name_or_path", "model_name_or_path", "offline_default_settings")


def starting_point(
    accelerator,
    lora: bool,
    output_dir: Path,
    recipes_dir: Path,
    *,
    adapter_name_or_path: str | None,
    model_name_or_path: str | None,
    offline_default_settings: str = "",
) -> tuple[str | None, str]:
    """The SFT adapter to continue (or None) and the base model. Offline (neither given, LoRA): the adapter that
    ``recipes/llm_finetune.py`` saved by default in ``outputs/llm_finetune``, when there is one (said so), else its
    default base (``llm_kit.loading.default_base_model``, which may pretrain one first: ``recipes/train_lm.py`` in a
    subprocess, into ``output_dir/base_model``). An adapter whose base (its
    adapter_config.json) differs from ``model_name_or_path`` is refused: LoRA weights trained on one base are
    meaningless on another. ``offline_default_settings``: what the offline default trains with, printed when given."""
    adapter = adapter_name_or_path
    if offline_default_settings:
        accelerator.print(offline_default_settings)
    if adapter is None and model_name_or_path is None and lora and Path(SFT_DEFAULT, "adapter_config.json").is_file():
        adapter = SFT_DEFAULT
        accelerator.print(f"offline default: continuing the SFT adapter recipes/llm_finetune.py saved in {adapter}")
    if adapter is None:
        return None, model_name_or_path or default_base_model(accelerator, output_dir, recipes_dir)
    config_file = Path(adapter) / "adapter_config.json"
    if not config_file.is_file():
        raise RecipeError(
            f"--adapter_name_or_path {adapter!r} holds no adapter_config.json: pass the folder a LoRA "
            "run saved (e.g. outputs/llm_finetune)."
        )
    base = json.loads(config_file.read_text())["base_model_name_or_path"]
    same = (
        model_name_or_path is None
        or model_name_or_path == base
        or (
            Path(model_name_or_path).is_dir()
            and Path(base).is_dir()
            and Path(model_name_or_path).resolve() == Path(base).resolve()
        )
    )
    if not same:
        raise RecipeError(
            f"--adapter_name_or_path {adapter!r} was trained on {base!r}, not on --model_name_or_path "
            f"{model_name_or_path!r}: its weights mean nothing on another base. Leave "
            "--model_name_or_path out (the adapter's base is used) or pass that base."
        )
    return adapter, base


def continued_adapter(model, adapter: str, reference: bool = True):
    """``model`` with the SFT ``adapter`` loaded to train (``default``) and, with ``reference``, loaded again as a
    frozen copy (``reference``, a few MB) that ``reference_policy`` switches to, so that the reference is the SFT
    policy (disabling the adapter would give the bare base). TRL does the same (its ``ref`` adapter). Checkpoints hold
    ``default`` only (what requires grad: ``save_adapter_state``)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, adapter, adapter_name="default", is_trainable=True)
    if reference:
        model.load_adapter(adapter, adapter_name="reference", is_trainable=False)
    return model


@contextlib.contextmanager
def reference_policy(model):
    """The reference inside the block: the frozen ``reference`` adapter when there is one, else the base with the
    adapter off (PEFT's ``disable_adapter``), in eval mode: no dropout of the model or of LoRA (also where the
    policy keeps its dropout), so that the reference is one fixed policy, as a precomputed one is. ``set_adapter``
    also sets requires_grad (on for the active adapter unless ``inference_mode``): switching back to ``default``
    leaves every flag as it was, and the mode is restored."""
    training = model.training
    model.eval()
    try:
        if "reference" not in model.peft_config:
            with model.disable_adapter():
                yield
            return
        model.set_adapter("reference", inference_mode=True)
        try:
            yield
        finally:
            model.set_adapter("default")
    finally:
        model.train(training)
