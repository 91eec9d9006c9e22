"""The fit planner: will a model train on N GPUs of M GiB, how (full, LoRA, QLoRA), under which setup, and which one.

The command behind ``python tools/plan.py``: its flags, the model they name, and the table or JSON it prints. Bad
input stops with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from shared.flags import positive_float, positive_int
from tools.planner.fits import plan
from tools.planner.report import format_table
from tools.planner.shapes import ModelShape, needed_fields, preset_shape, read_config, shape_from_config
from tools.planner.tables import (
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_VOCAB_SIZE,
    METHODS,
    MIXED_PRECISION,
    MODEL_SIZES,
    OBJECTIVES,
)

# What the planner assumes when a flag is not given: said on its first line, since each changes the answer.
ASSUMED = {
    "--gpus": "gpus",
    "--gpu_memory_gib": "gpu_memory_gib",
    "--seq_len": "seq_len",
    "--micro_batch": "micro_batch",
    "--mixed_precision": "mixed_precision",
    "--method": "method",
    "--host_ram_gib": "host_ram_gib",
    "--attention": "attention",
}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        shape = load_shape(args)
        result = plan(
            shape,
            args.gpus,
            args.gpu_memory_gib,
            args.seq_len,
            args.micro_batch,
            args.mixed_precision,
            args.num_microbatches,
            args.pipeline_schedule,
            args.attention or shape.attention,
            args.overhead_gib,
            method=args.method,
            objective=args.objective,
            precompute_reference=args.precompute_reference,
            num_generations=args.num_generations,
            beta=args.beta,
            lora_r=args.lora_r,
            lora_dropout=args.lora_dropout,
            gradient_checkpointing=args.gradient_checkpointing,
            cpu_offload=args.cpu_offload,
            host_ram_gib=args.host_ram_gib,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result["assumed"] = assumptions(sys.argv[1:] if argv is None else list(argv), result)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def assumptions(argv: list[str], result: dict) -> dict:
    """The inputs of ``ASSUMED`` this command line did not give, with the values the estimate used."""
    given = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    assumed = {flag: result["inputs"][key] for flag, key in ASSUMED.items() if flag not in given}
    reference = result["inputs"]["precompute_reference"]  # DPO with full fine-tuning: a copy, or precomputed
    if reference is not None and not given & {"--precompute_reference", "--no-precompute_reference"}:
        assumed["--precompute_reference"] = "(reference log-probabilities computed before training, no copy)"
    return assumed


def load_shape(args: argparse.Namespace) -> ModelShape:
    """The model shape the command line asks for; ValueError with a one-line reason if it cannot."""
    if not args.model_name_or_path:
        return preset_shape(args.model_size or "1.3b", args.vocab_size)
    location = args.model_name_or_path
    config = read_config(location)
    try:
        return shape_from_config(config, name=location)
    except (ValueError, KeyError, AttributeError, TypeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--model_name_or_path {location}: cannot build its shape on the meta device ({first_line}); "
            f"{needed_fields()}"
        ) from None


# ------------------------------------------------------------------------------- the flags
class _OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr and exit code 2, without the usage block. ``--help`` shows every default."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=_HelpWithDefaults, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message}\n")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help, unless its help names its default already or it has none."""

    def _get_help_string(self, action):
        text = action.help or ""
        named = "default" in text.lower()
        if action.default in (None, False, argparse.SUPPRESS) or named or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = _OneLineParser(prog="python tools/plan.py", description=__doc__.split("\n")[0])
    _add_model_flags(parser)
    _add_method_flags(parser)
    _add_hardware_flags(parser)
    _add_training_flags(parser)
    _add_pipeline_and_overhead_flags(parser)
    parser.add_argument("--json", action="store_true", help="Print the full estimate as JSON instead of the table.")
    return parser.parse_args(argv)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model_size",
        choices=list(MODEL_SIZES),
        default=None,
        help="A named shape: the recipes' presets (recipes/train_lm.py --model_size) or 7b, 13b, 70b (Llama-2) and "
        "34b (CodeLlama). Default: 1.3b.",
    )
    model.add_argument(
        "--model_name_or_path",
        default=None,
        help="A model folder or its config.json (or a Hub id, when online): only the config is read, the model is "
        "built on the meta device, no weights needed.",
    )
    parser.add_argument(
        "--vocab_size",
        type=positive_int,
        default=DEFAULT_VOCAB_SIZE,
        help="Vocabulary of a --model_size model (default 32000, Llama-2's; the LM recipes' default is 8192).",
    )


def _add_method_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method",
        choices=list(METHODS),
        default="full",
        help="full fine-tuning, lora (frozen base in the compute dtype + fp32 adapter) or qlora (4-bit NF4 base, "
        "double quantization): recipes/llm_finetune.py's --full_finetune, default and --load_in_4bit.",
    )
    parser.add_argument(
        "--objective",
        choices=list(OBJECTIVES),
        default="sft",
        help="sft (recipes/llm_finetune.py; the presets' full fine-tuning: train_lm.py, pipeline_lm.py), dpo "
        "(recipes/dpo.py: each sample a chosen and a rejected sequence in one forward, --micro_batch counts pairs) or "
        "grpo (recipes/grpo.py: --micro_batch completions per forward, --seq_len prompt + completion tokens, the KV "
        "cache of --num_generations of them while generating; colocated and the generation split); --method still "
        "says what trains, as the recipes' --full_finetune, default, --load_in_4bit do.",
    )
    parser.add_argument(
        "--num_generations",
        type=int,  # the recipe's type; a group of fewer than 2 is refused by fits.plan
        default=8,
        help="GRPO: completions per prompt (a group), generated together: the KV cache a generating GPU holds.",
    )
    parser.add_argument(
        "--beta",
        type=float,
        default=0.0,
        help="GRPO: the KL coefficient (recipes/grpo.py's, TRL's default 0); > 0 adds a reference forward every step "
        "and, with --method full, a frozen copy of the model in the compute dtype.",
    )
    parser.add_argument(
        "--precompute_reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DPO with --method full: the reference log-probabilities computed in one pass before training "
        "(default, as recipes/dpo.py) or, with --no-precompute_reference, a frozen reference copy in the compute "
        "dtype beside the model. Not for LoRA/QLoRA: their reference is the base with the adapter disabled.",
    )
    parser.add_argument(
        "--lora_r", type=positive_int, default=8, help="LoRA rank, on every linear layer of the blocks (default 8)."
    )
    parser.add_argument(
        "--lora_dropout",
        type=float,
        default=0.0,
        help="Dropout on the LoRA path (default 0, the recipe's): > 0 keeps a 1-byte mask per adapted input.",
    )


def _add_hardware_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=positive_int, default=2, help="Number of GPUs.")
    parser.add_argument("--gpu_memory_gib", type=positive_float, default=24.0, help="Memory of one GPU, in GiB.")
    parser.add_argument(
        "--host_ram_gib",
        type=positive_float,
        default=None,
        help="The target machine's RAM, in GiB, for the loading copy and offloaded state (default: what such a "
        "machine usually has, twice the GPUs' memory and at least 64 GiB; said on the first line).",
    )


def _add_training_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seq_len",
        type=positive_int,
        default=1024,
        help="Tokens per sequence (the recipes' --block_size, --max_length).",
    )
    parser.add_argument(
        "--micro_batch",
        type=positive_int,
        default=4,
        help="Sequences per forward pass per GPU (the recipes' --per_device_train_batch_size; pipeline: per "
        "micro-batch).",
    )
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Assume activation checkpointing (both are always estimated; without this flag the recommendation "
        "weighs the best setup without it against the best with it, and says which it chose).",
    )
    parser.add_argument(
        "--cpu_offload",
        action="store_true",
        help="Prefer FSDP2 with CPU offload of parameters, gradients and optimizer state (fsdp_offload_2gpu.yaml); "
        "without it, offload is recommended only when nothing else fits.",
    )
    parser.add_argument(
        "--mixed_precision",
        choices=list(MIXED_PRECISION),
        default="bf16",
        help="bf16/fp16: autocast (full fine-tuning keeps fp32 weights, 4+4+8 B/parameter; LoRA's frozen base is "
        "16-bit); no: everything fp32.",
    )


def _add_pipeline_and_overhead_flags(parser: argparse.ArgumentParser) -> None:
    """The pipeline's schedule, the attention kernel and the fixed memory per GPU."""
    parser.add_argument(
        "--num_microbatches", type=positive_int, default=8, help="Pipeline: micro-batches per batch (m)."
    )
    parser.add_argument(
        "--pipeline_schedule",
        choices=["1f1b", "gpipe"],
        default="1f1b",
        help="Pipeline: 1f1b holds at most p micro-batches' activations per stage, gpipe all m.",
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        help="sdpa (flash/memory-efficient: no score matrix stored) or eager (stores a x s x s scores); default: "
        "the one transformers runs the model with (eager for a model without sdpa, e.g. Gemma 2).",
    )
    parser.add_argument(
        "--overhead_gib",
        type=float,
        default=DEFAULT_OVERHEAD_GIB,
        help="Fixed memory per GPU outside tensors: CUDA context, NCCL, fragmentation (default 1.0).",
    )
