"""The policy ``recipes/grpo.py`` trains: loaded with a new or continued LoRA adapter (or every weight trained), then
prepared for its layout, with the reference the KL term reads and the generator that makes its completions."""

from __future__ import annotations

from torch.distributed.fsdp import register_fsdp_forward_method

from llm_kit.adapters import continued_adapter
from llm_kit.loading import load_base_model
from shared.fsdp import check_offload_fits_host_ram, set_wrap_at_blocks
from shared.lora import lora_model
from shared.model_split import find_block_list

from .loss import frozen_copy
from .rollout import PolicyGenerator


def load_policy(
    accelerator,
    *,
    model_name_or_path: str,
    config,
    lora: bool,
    load_in_4bit: bool,
    trust_remote_code: bool,
    gradient_checkpointing: bool,
    adapter_name_or_path: str | None,
    beta: float,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    lora_target_modules: list[str],
):
    """The base model with the adapter it trains: a continued one (with a frozen ``reference`` copy when ``beta``),
    a new one (its reference: the adapter switched off), or none (``lora`` False: every weight trained)."""
    model = load_base_model(
        accelerator, model_name_or_path, config, lora, load_in_4bit, trust_remote_code=trust_remote_code
    )
    if gradient_checkpointing:  # non-reentrant: the reentrant one breaks DDP and gets no grad from a frozen base
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if adapter_name_or_path:  # trained "default" (+ a frozen "reference" copy with beta: the SFT policy)
        return continued_adapter(model, adapter_name_or_path, reference=beta > 0)
    if not lora:
        return model
    return lora_model(
        model,
        model_name_or_path,
        r=lora_r,
        alpha=lora_alpha,
        dropout=lora_dropout,
        target_modules=lora_target_modules,
        task_type="CAUSAL_LM",
    )


def prepare_policy(
    accelerator,
    model,
    optimizer,
    lr_scheduler,
    *,
    split,
    fsdp: bool,
    tokenizer,
    model_name_or_path: str,
    config,
    trust_remote_code: bool,
    lora: bool,
    beta: float,
    max_completion_length: int,
    temperature: float,
    top_k: int,
    top_p: float,
) -> tuple:
    """The model, optimizer and scheduler prepared (split: the trainers' DDP), a full fine-tune's reference with
    ``beta`` (``frozen_copy``) and the policy's generator. A collective; under FSDP it also rewrites the plugin's wrap
    policy to one unit per decoder block."""
    if fsdp:  # one FSDP unit per decoder block; an offload that cannot fit the host's memory is refused now
        set_wrap_at_blocks(accelerator, model, find_block_list(model, set(model._no_split_modules)))
        check_offload_fits_host_ram(accelerator, model)
    # Split: the trainers' DDP over their own group (the generating process never trains), which gets their weights.
    model, optimizer, lr_scheduler = (split.prepare if split else accelerator.prepare)(model, optimizer, lr_scheduler)
    # A full fine-tune's reference with beta: a frozen copy of the model as loaded (its weights once more, no grads);
    # none on the split layout's generating process, which never trains.
    trains = not (split and split.generates)
    reference_model = frozen_copy(
        accelerator, model_name_or_path, config, trust_remote_code, lora, beta if trains else 0
    )
    register_fsdp_forward_method(model, "generate")  # FSDP2: generate() gathers the root's weights as forward does
    # Colocated: the policy generates this process's share; split: the generating process's rounds, to the trainers.
    policy_generator = PolicyGenerator(
        accelerator,
        model,
        tokenizer,
        max_completion_length=max_completion_length,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        sharded=fsdp,
        logps=bool(split),
    )
    return model, optimizer, lr_scheduler, reference_model, policy_generator
