"""What ``recipes/grpo.py`` needs of its policy once prepared: the reference the KL term reads and the generator that
makes its completions."""

from __future__ import annotations

from torch.distributed.fsdp import register_fsdp_forward_method

from .loss import frozen_copy
from .rollout import PolicyGenerator

# The flags ``reference_and_generator`` takes, by the names the recipe's parser gives them.
POLICY_SETUP_FLAGS = (
    "model_name_or_path",
    "trust_remote_code",
    "beta",
    "max_completion_length",
    "temperature",
    "top_k",
    "top_p",
)


def reference_and_generator(
    accelerator,
    model,
    tokenizer,
    config,
    split,
    lora: bool,
    fsdp: bool,
    *,
    model_name_or_path: str,
    trust_remote_code: bool,
    beta: float,
    max_completion_length: int,
    temperature: float,
    top_k: int,
    top_p: float,
) -> tuple:
    """For the prepared ``model``: a full fine-tune's reference with ``beta`` (``frozen_copy``: the model as loaded,
    frozen; none on the split layout's generating process, which never trains, and none with LoRA, whose reference
    is the adapter switched off or its frozen copy), and the policy's generator (colocated: this process's share;
    split: the generating process's rounds, sent to the trainers). Changes ``model``: FSDP2's ``generate`` gathers the
    root's weights as ``forward`` does (``register_fsdp_forward_method``)."""
    trains = not (split and split.generates)
    reference_model = frozen_copy(
        accelerator, model_name_or_path, config, trust_remote_code, lora, beta if trains else 0
    )
    register_fsdp_forward_method(model, "generate")
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
    return reference_model, policy_generator
