"""Online reinforcement learning with verifiable rewards (GRPO) of a causal language model with LoRA (default), QLoRA
(``--load_in_4bit``) or every weight trained, on one GPU or two with DDP or FSDP2: each round the policy generates
``--num_generations`` completions of every prompt, reward functions score them, and each completion is pushed up or
down by its advantage, its reward against its group's (the completions of the same prompt). TRL 1.16's GRPOTrainer
arithmetic (its defaults, loss types, metric names and the signature of its reward functions; docs/grpo.md lists
what differs).

What it teaches: the step in the open. Generation (eval mode, KV cache, left-padded prompts, until every completion has
ended), rewards, advantages over the whole global batch (each process generates its share of the round's completions,
rewards are gathered, so a group may span processes), then forward, loss, backward, clip and step, with
accumulation. The loss of an optimizer step is normalised over *all* its completion tokens (every process, every
micro-batch), so 1 process x 16 completions, 2 x 8 and 1 x 8 x 2 accumulation give the same steps; the sampling of a
completion depends on the seed, the round and its place in it, so a resumed run samples what the uninterrupted one
did. The reference for ``--beta`` costs no second model with LoRA (the adapter switched off, or the frozen SFT adapter
when one is continued).

With no arguments it runs offline: it continues the adapter llm_finetune.py saved in ``outputs/llm_finetune`` (else a
new one on its base model) on that recipe's questions about standard-library names, rewarded by the exact match of the
answer; the exact match of greedy answers to held-out questions before and after is in the log (docs/grpo.md has the
numbers).

Which config fits what: single_gpu.yaml: one GPU (or the CPU); ddp_2gpu.yaml: two GPUs, each generating and training
its share (TRL's colocated layout); fsdp_2gpu.yaml: a model that does not fit one GPU, sharded (every generated token
gathers each block from both GPUs). ``--generation_mode split`` (one process only generates, the others only train) is
designed in grpo_kit/rollout.py and refused for now.

Launch (from the repository root):
    # CPU smoke run, or one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/grpo.py --max_train_steps 4
    # two GPUs, colocated (on a CPU-only machine: 2 processes over gloo, same command), your prompts and reward:
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/grpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --train_file prompts.jsonl --reward_funcs rewards.py:my_reward
    # a model sharded over two GPUs, its reference the base with the adapter off:
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/grpo.py \\
        --model_name_or_path ... --mixed_precision bf16 --gradient_checkpointing --beta 0.04
    # the split layout (refused for now: docs/grpo.md):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/grpo.py --generation_mode split

To use it in your project, copy recipes/grpo.py, recipes/grpo_kit/, recipes/llm_kit/ and shared/ (and
accelerate_configs/, which the launch lines name): the kits beside the recipe, shared/ beside it or one folder up.
Without --model_name_or_path, an SFT adapter or a model in outputs/train_lm, it pretrains one with recipes/train_lm.py,
which it looks for beside itself.

Writes to --output_dir: the adapter (LoRA/QLoRA) or the whole model, the tokenizer, ``results.json`` (TRL's metric
names: ``train/reward``, ``train/rewards/<function>/mean``, ``train/completions/mean_length`` ...; ``train/rewards``,
the mean reward of every optimizer step; ``perf/completions_per_sec``) and ``checkpoints/step_N``.
"""

import argparse
import contextlib
import json
import logging
import math
import sys
from pathlib import Path

import torch
from accelerate.utils import ProjectConfiguration, set_seed
from accelerate.utils import disable_fsdp_ram_efficient_loading
from torch.distributed.fsdp import register_fsdp_forward_method
from tqdm.auto import tqdm

# PEFT, which transformers imports, imports bitsandbytes, which on a CPU with AVX-512 bf16 warns on every process that
# an optional kernel is not installed (bitsandbytes 0.50; the CPU path works without it): quieted before that import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import get_scheduler

# shared/ (beside this file in a copy, or one folder up here) and the kits (the LLM recipes', this recipe's) go first
# on sys.path, so that no installed package of those names shadows them (this folder too, for an import that is not a
# run).
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
sys.path.insert(0, str(HERE))
from shared.checkpoints import find_checkpoint, keep_global_batch, load_checkpoint, save_checkpoint, save_final
from shared.signals import install_stop_on_signals
from shared.fsdp import check_offload_fits_host_ram, gathered_state_dict, set_keep_gathered_in_one_process
from shared.fsdp import set_wrap_at_blocks
from shared.lora import lora_model
from llm_kit.adapters import continued_adapter, load_adapter_state, save_adapter_state, starting_point
from llm_kit.loading import causal_lm_config, load_base_model
from llm_kit.loading import parameter_counts
from shared.model_split import find_block_list
from grpo_kit.data import as_sft_rows, micro_batches, prompt_format, prompt_loader
from grpo_kit.data import stdlib_name_prompts, tokenize_prompts
from grpo_kit.loss import LOSS_TYPES, add_fixed_logps, completion_logps, group_advantages, per_token_loss, reduce_loss
from grpo_kit.metrics import CompletionsRecord, StepMetrics, round_metrics
from grpo_kit.rewards import FORMAT_PATTERN, load_reward_functions, score_round, trainer_state
from grpo_kit.rollout import PolicyGenerator, sampling_noise
from llm_kit.sharded_4bit import load_4bit_sharded
from shared.errors import RecipeError, report_recipe_errors, install_peer_exit_hooks, set_stop_with_launcher
from shared.flags import add_reliability_flags, positive_float, positive_int, prepare_output_dir
from shared.accelerator import build_accelerator, fused_adamw, set_gpu_index, set_quiet_library_logs
from shared.parallelism import choose_parallelism
from shared.fsdp import set_fsdp_on_cpu
from llm_kit.sft_data import add_chat_template, chat_tokenizer, load_raw_datasets
from llm_kit.sft_eval import exact_match_before, exact_match_results

# What the offline default (no model, adapter or data given) trains with unless a flag says otherwise (docs/grpo.md:
# measured over two seeds on a 2-core CPU): the SFT adapter's answers sampled at 0.7 among its 20 likeliest tokens
# (at 1.0 most completions of this small model are noise and no group has a signal), every held-out question scored.
OFFLINE_SETTINGS = {
    "max_train_steps": 400,
    "learning_rate": 2e-4,
    "num_generations": 8,
    "per_device_train_batch_size": 16,
    "max_completion_length": 8,
    "temperature": 0.7,
    "top_k": 20,
    "exact_match_samples": 1000,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--train_file",
        help="Prompts (.jsonl/.json, .csv, .parquet): a 'prompt' column (a string, or a list of "
        "{role, content} messages) and whatever columns the reward functions read (e.g. 'answer').",
    )
    data.add_argument(
        "--validation_file",
        help="Held-out prompts, same format, for the exact match of greedy answers (default: held out from the "
        "training data, --validation_split_percentage).",
    )
    data.add_argument(
        "--dataset_name", help="A Hugging Face Hub dataset (needs internet), e.g. 'trl-lib/DeepMath-103K'."
    )
    data.add_argument("--dataset_config_name", help="The Hub dataset's configuration, if it has several.")
    data.add_argument(
        "--validation_split_percentage",
        type=positive_float,
        default=5,
        help="Share of the training data held out for validation when there is no validation split.",
    )
    data.add_argument(
        "--max_prompt_length",
        type=positive_int,
        help="Refuse prompts of more tokens than this, naming the row (default: no limit, as TRL).",
    )
    data.add_argument("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training prompts.")
    data.add_argument(
        "--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation prompts."
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name_or_path",
        help="Local folder or Hub name of a causal LM. Default: the base of "
        "--adapter_name_or_path; offline: outputs/train_lm, pretrained first if missing.",
    )
    model.add_argument(
        "--adapter_name_or_path",
        help="A LoRA adapter to continue (e.g. outputs/llm_finetune, what llm_finetune.py saved); with --beta, its "
        "frozen copy is the reference. Its own rank and targets are kept (--lora_* apply to a new adapter only).",
    )
    model.add_argument(
        "--tokenizer_name", help="Folder or Hub name of the tokenizer, when the model's folder holds none."
    )
    model.add_argument("--trust_remote_code", action="store_true", help="Allow a Hub model to run its own code.")
    model.add_argument(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; else single).",
    )
    model.add_argument(
        "--full_finetune",
        action="store_true",
        help="Train every weight instead of a LoRA adapter (with --beta, a frozen copy of the model is the reference)",
    )
    model.add_argument(
        "--load_in_4bit",
        action="store_true",
        help="QLoRA: the base model in 4-bit NF4 with double quantization (bitsandbytes), a LoRA adapter on top.",
    )
    model.add_argument("--lora_r", type=positive_int, default=8, help="LoRA rank.")
    model.add_argument(
        "--lora_alpha", type=positive_float, default=16, help="LoRA scaling: updates are scaled by alpha / r."
    )
    model.add_argument("--lora_dropout", type=float, default=0.0, help="Dropout on the LoRA path.")
    model.add_argument(
        "--lora_target_modules",
        nargs="+",
        default=["all-linear"],
        help="Module names (or suffixes) to adapt; 'all-linear': every linear layer but the output head.",
    )
    model.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each decoder block's activations in backward: less memory, ~1/3 more compute.",
    )
    generation = parser.add_argument_group("generation")
    generation.add_argument(
        "--generation_mode",
        choices=["colocate", "split"],
        default="colocate",
        help="colocate: every process generates its share of the completions and trains on them (TRL's default); "
        "split: one process only generates, the others only train (designed, refused for now).",
    )
    generation.add_argument(
        "--num_generations",
        type=int,
        default=8,
        help="Completions per prompt (a group): at least 2, dividing the global batch.",
    )
    generation.add_argument(
        "--max_completion_length", type=positive_int, default=512, help="Generate at most this many tokens."
    )
    generation.add_argument(
        "--temperature", type=positive_float, default=1.0, help="Sampling temperature (also in the log-probs)."
    )
    generation.add_argument("--top_p", type=positive_float, default=1.0, help="Nucleus sampling (1.0: off).")
    generation.add_argument("--top_k", type=int, default=0, help="Sample among the k likeliest tokens (0: off).")
    grpo = parser.add_argument_group("GRPO")
    grpo.add_argument(
        "--reward_funcs",
        nargs="+",
        default=["accuracy"],
        help="Reward functions: accuracy (the completion equals the 'answer' or 'solution' column, normalised), "
        "format (it matches --format_pattern), or path/to/file.py:function in TRL's signature.",
    )
    grpo.add_argument("--reward_weights", type=float, nargs="+", help="One weight per reward function (default: 1).")
    grpo.add_argument(
        "--format_pattern", default=FORMAT_PATTERN, help="The regular expression the format reward asks for."
    )
    grpo.add_argument(
        "--loss_type",
        choices=LOSS_TYPES,
        default="dapo",
        help="How token losses make the step's loss: dapo (TRL's default): over all completion tokens of the step; "
        "grpo: each completion's mean, then their mean; dr_grpo: over completions x --max_completion_length; bnpo: "
        "each micro-batch's token mean.",
    )
    grpo.add_argument(
        "--beta",
        type=float,
        default=0.0,
        help="KL (k3) coefficient to the reference: 0 (TRL's default) uses none; DeepSeek-R1 used 0.001.",
    )
    grpo.add_argument("--epsilon", type=positive_float, default=0.2, help="Clip the ratio below at 1 - epsilon.")
    grpo.add_argument("--epsilon_high", type=positive_float, help="Clip above at 1 + this (default: --epsilon).")
    grpo.add_argument(
        "--scale_rewards",
        choices=["group", "batch", "none"],
        default="group",
        help="Divide each advantage by the standard deviation of its group's rewards, of the batch's, or not at all.",
    )
    grpo.add_argument(
        "--num_iterations",
        type=positive_int,
        default=1,
        help="Optimizer steps per round of completions; after the first, the ratio is against the policy that "
        "generated them.",
    )
    grpo.add_argument(
        "--mask_truncated_completions",
        action="store_true",
        help="Leave completions that reached --max_completion_length without ending out of the loss.",
    )
    training = parser.add_argument_group("training")
    training.add_argument(
        "--per_device_train_batch_size",
        type=positive_int,
        default=8,
        help="Completions per process per forward pass (TRL's meaning).",
    )
    training.add_argument(
        "--gradient_accumulation_steps",
        type=positive_int,
        help="Forward/backward passes per optimizer step (default: 1; on a resume, what keeps the checkpoint's global "
        "batch in this process count). A round generates every completion of an optimizer step at once.",
    )
    training.add_argument(
        "--num_train_epochs",
        type=positive_int,
        default=1,
        help="Passes over the prompts (ignored with --max_train_steps).",
    )
    training.add_argument(
        "--max_train_steps",
        type=positive_int,
        help="Stop after this many optimizer steps (default: --num_train_epochs; offline default: 400).",
    )
    training.add_argument(
        "--learning_rate",
        type=positive_float,
        help="Peak AdamW learning rate (default: 5e-5 with LoRA, TRL's 1e-6 for a full fine-tune; offline: 2e-4).",
    )
    training.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay.")
    training.add_argument("--adam_epsilon", type=positive_float, default=1e-8, help="AdamW's epsilon.")
    training.add_argument(
        "--lr_scheduler_type", default="linear", help="transformers.get_scheduler name: linear, cosine, constant, ..."
    )
    training.add_argument(
        "--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps."
    )
    training.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm to this (0 disables)."
    )
    training.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], help="Override the config's mixed precision."
    )
    training.add_argument("--seed", type=int, default=42, help="Seed for the LoRA initialisation, order and sampling.")
    output = parser.add_argument_group("output")
    output.add_argument(
        "--output_dir", default="outputs/grpo", help="Adapter (or model), tokenizer, results.json, checkpoints."
    )
    output.add_argument(
        "--exact_match_samples",
        type=int,
        help="Score greedy answers to N (shuffled) validation prompts against their 'answer' (or 'solution'), before "
        "and after training (default: 100 when the answers are short, else none; 0 skips; not under FSDP).",
    )
    output.add_argument("--report_to", help="Trackers to log to: tensorboard, wandb, all, ... (default: none).")
    output.add_argument(
        "--logging_steps",
        type=positive_int,
        default=10,
        help="Log the loss and TRL's metrics every N optimizer steps.",
    )
    output.add_argument("--skip_eval", action="store_true", help="Skip the exact match before and after training.")
    output.add_argument(
        "--perf_warmup_steps", type=int, default=1, help="Optimizer steps left out of the throughput numbers."
    )
    add_reliability_flags(parser)  # checkpoints, resume, --save_on_each_node, --dist_timeout (shared by the recipes)
    args = parser.parse_args(argv)
    if args.full_finetune and (args.load_in_4bit or args.adapter_name_or_path):
        parser.error(
            "--full_finetune trains every weight of the model; --load_in_4bit and --adapter_name_or_path "
            "train a LoRA adapter: choose one"
        )
    if args.num_generations < 2:
        parser.error(
            f"--num_generations {args.num_generations}: an advantage compares a completion with the others of its "
            "group, so a group needs at least 2 completions"
        )
    if not args.beta >= 0:
        parser.error(f"--beta weighs the KL to the reference: 0 (none) or more, not {args.beta}")
    if args.reward_weights and len(args.reward_weights) != len(args.reward_funcs):
        parser.error(
            f"--reward_weights has {len(args.reward_weights)} weights for {len(args.reward_funcs)} --reward_funcs: "
            "give one per function"
        )
    if isinstance(args.checkpointing_steps, int) and args.checkpointing_steps % args.num_iterations:
        parser.error(
            f"--checkpointing_steps {args.checkpointing_steps} is not a multiple of --num_iterations "
            f"{args.num_iterations}: a checkpoint is saved at the end of a round of completions"
        )
    if args.validation_file and not args.train_file:
        parser.error("--validation_file needs --train_file")
    # The offline default: the SFT adapter (or a small base) learns visibly only with more completions per prompt and
    # larger steps than an LLM's defaults.
    offline = not (args.model_name_or_path or args.adapter_name_or_path or args.train_file or args.dataset_name)
    given = {name for name in OFFLINE_SETTINGS if f"--{name}" in " ".join(sys.argv[1:] if argv is None else argv)}
    chosen = {name: value for name, value in OFFLINE_SETTINGS.items() if offline and name not in given}
    for name, value in chosen.items():
        setattr(args, name, value)
    settings = " ".join(f"--{name} {value:g}" for name, value in chosen.items())
    args.offline_default_settings = settings and f"the offline default trains with {settings} (flags change it)"
    args.learning_rate = args.learning_rate or (1e-6 if args.full_finetune else 5e-5)
    args.epsilon_high = args.epsilon_high or args.epsilon
    args.reward_weights = args.reward_weights or [1.0] * len(args.reward_funcs)
    return args


def check_layout(
    accelerator, generation_mode: str, global_batch_size: int, num_generations: int, data_parallel_size: int
) -> tuple[int, slice]:
    """The prompts of a round (the global batch over ``num_generations``) and this process's share of the round's
    completions (its rows of the global batch); or a refusal: ``split``, not built yet (and impossible in one
    process); a global batch that holds no whole number of groups."""
    if generation_mode == "split":
        alone = accelerator.num_processes == 1
        raise RecipeError(
            "--generation_mode split (one process only generates with the current policy while the others train, one "
            "step off-policy) is designed but not built yet"
            + (" (and it needs 2 or more processes: one generates, the others train)" if alone else "")
            + ": grpo_kit/rollout.py's Generator is its interface and docs/grpo.md says what is left. Use "
            "--generation_mode colocate (the default): every process generates its share and trains on it."
        )
    if global_batch_size % num_generations:
        raise RecipeError(
            f"The global batch of {global_batch_size} completions (--per_device_train_batch_size x processes x "
            f"--gradient_accumulation_steps) is not a whole number of groups of --num_generations {num_generations}: "
            f"pass a --num_generations that divides {global_batch_size}, or a batch that {num_generations} divides."
        )
    rows, rank = global_batch_size // data_parallel_size, accelerator.process_index if data_parallel_size > 1 else 0
    return global_batch_size // num_generations, slice(rank * rows, (rank + 1) * rows)


def frozen_copy(accelerator, name_or_path: str, config, trust_remote_code: bool, lora: bool, beta: float):
    """A full fine-tune's reference with ``beta``: the model as loaded, once more, frozen and in eval mode (TRL's
    ``ref_model``), on the device and never wrapped for gradients: its weights beside the trained ones, with no
    gradients nor optimizer state; refused under FSDP2, which would not shard it. None otherwise (LoRA's reference is
    the adapter switched off, or its frozen copy)."""
    if lora or not beta:
        return None
    if accelerator.is_fsdp2:
        raise RecipeError(
            "--full_finetune with --beta needs a frozen copy of the model as the reference, which this recipe does "
            "not shard under FSDP2 yet (each GPU would hold all of it, and Accelerate leaves it off the GPU). Train "
            "with ddp_2gpu.yaml, with a LoRA adapter (its reference is the adapter switched off), or with --beta 0 "
            "(TRL's default)."
        )
    reference = load_base_model(accelerator, name_or_path, config, trust_remote_code=trust_remote_code)
    return accelerator.prepare_model(reference.requires_grad_(False).eval(), evaluation_mode=True)


def save(accelerator, model, tokenizer, output_dir: Path, trained_only: bool) -> None:
    """The model, or the trained ``default`` adapter alone, and the tokenizer, for ``from_pretrained``, written whole
    or not at all (a collective). The same as dpo.py's ``save``: kept in each recipe so that each copies alone."""
    accelerator.wait_for_everyone()
    state_dict = gathered_state_dict(accelerator, model, trained_only=trained_only)
    kwargs = {"selected_adapters": ["default"]} if trained_only else {}

    def write(folder: Path) -> None:
        accelerator.unwrap_model(model).save_pretrained(folder, state_dict=state_dict, **kwargs)
        tokenizer.save_pretrained(folder)

    save_final(accelerator, output_dir, write, output_dir / "checkpoints", state_dict)
    accelerator.print(f"saved the {'adapter' if trained_only else 'model'} and the tokenizer to {output_dir}")


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()
    lora, method = not args.full_finetune, "qlora" if args.load_in_4bit else "full" if args.full_finetune else "lora"

    # ------------------------------------------------------------------ Accelerator and seed
    set_stop_with_launcher()  # Linux: dies with its launcher (a SIGKILLed launcher cannot stop its workers)
    stop = install_stop_on_signals(Path(args.output_dir) / "checkpoints")  # SIGTERM, Ctrl-C: checkpoint, then exit
    install_peer_exit_hooks()  # 2+ processes: a rank another one stopped says so in one line
    set_gpu_index()  # one process on a GPU: env ACCELERATE_TORCH_DEVICE=cuda:N, so results say cuda:0, not cuda
    accelerator = build_accelerator(  # no gradient_accumulation_steps: the loop counts a step's tokens, then syncs
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        log_with=args.report_to,
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_fsdp_on_cpu(accelerator)  # CPU + FSDP config: Accelerate's state set back to FSDP2 (cpu=True drops it)
    set_keep_gathered_in_one_process(
        accelerator
    )  # FSDP in 1 process: no resharding after forward (nothing to shard over)
    set_seed(args.seed)
    set_quiet_library_logs(accelerator)  # library warnings once, from the main process; no colour codes in log files
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/grpo.py")
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason}); method: {method}")
    data_parallel_size = accelerator.num_processes if parallelism.name in ("ddp", "fsdp") else 1
    layout, checkpoints_dir = "fsdp" if parallelism.name == "fsdp" else "replica", output_dir / "checkpoints"
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)
    args.gradient_accumulation_steps, batch_shape = keep_global_batch(
        accelerator.num_processes,
        checkpoint,
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        data_parallel_size,
        args.seed,
    )
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel_size
    # A round: the prompts of one optimizer step's completions; this process generates and trains its share of them.
    prompts_per_round, share = check_layout(
        accelerator, args.generation_mode, global_batch_size, args.num_generations, data_parallel_size
    )
    args.adapter_name_or_path, args.model_name_or_path = starting_point(
        accelerator,
        args.adapter_name_or_path,
        args.model_name_or_path,
        lora,
        output_dir,
        HERE,
        args.offline_default_settings,
    )
    config, _ = causal_lm_config(
        accelerator, args.model_name_or_path, args.max_completion_length, args.load_in_4bit, args.trust_remote_code
    )
    tokenizer = chat_tokenizer(accelerator, args.model_name_or_path, args.trust_remote_code, args.tokenizer_name)
    add_chat_template(accelerator, tokenizer)

    # ------------------------------------------------------------------------------- data
    with accelerator.main_process_first():
        raw_datasets, fmt = load_raw_datasets(
            args.train_file,
            args.validation_file,
            args.dataset_name,
            args.dataset_config_name,
            args.validation_split_percentage,
            args.seed,
            args.max_train_samples,
            args.max_eval_samples,
            lambda rows, source: prompt_format(
                rows, source, tokenizer, args.max_prompt_length, "accuracy" in args.reward_funcs
            ),
            default_data=stdlib_name_prompts,
        )
        train_dataset, counts = tokenize_prompts(accelerator, raw_datasets["train"], fmt, tokenizer)
    reward_functions = load_reward_functions(args.reward_funcs, args.format_pattern, train_dataset.column_names)
    train_dataloader = prompt_loader(train_dataset, prompts_per_round, args.seed)

    # ------------------------------------------------------------------------------ model
    model = load_base_model(
        accelerator, args.model_name_or_path, config, lora, args.load_in_4bit, trust_remote_code=args.trust_remote_code
    )
    if args.gradient_checkpointing:  # non-reentrant: the reentrant one breaks DDP and gets no grad from a frozen base
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.adapter_name_or_path:  # trained "default" (+ a frozen "reference" copy with --beta: the SFT policy)
        model = continued_adapter(model, args.adapter_name_or_path, reference=args.beta > 0)
    elif lora:  # a new adapter (get_peft_model): the reference is the base, the adapter switched off
        model = lora_model(
            model,
            args.model_name_or_path,
            r=args.lora_r,
            alpha=args.lora_alpha,
            dropout=args.lora_dropout,
            target_modules=args.lora_target_modules,
            task_type="CAUSAL_LM",
        )
    trainable, total = parameter_counts(accelerator, model, args.model_name_or_path)
    if args.load_in_4bit and parallelism.name == "fsdp":  # built empty: the main process reads a layer at a time
        load_4bit_sharded(accelerator, model, args.model_name_or_path)
        disable_fsdp_ram_efficient_loading()  # env: transformers must not load to meta on rank 1+ again

    # ------------------------------------------------------------------ optimizer and scheduler
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        fused=fused_adamw(accelerator),
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        eps=args.adam_epsilon,
    )
    steps_per_epoch = len(train_dataloader) * args.num_iterations  # a round of prompts: --num_iterations steps
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    # Warm-up and training steps times the processes: the prepared scheduler steps once per process per step.
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        args.num_warmup_steps * accelerator.num_processes,
        max_train_steps * accelerator.num_processes,
    )

    # ------------------------------------------------------------------------------ prepare
    if parallelism.name == "fsdp":  # one FSDP unit per decoder block; an offload that cannot fit is refused now
        set_wrap_at_blocks(accelerator, model, find_block_list(model, set(model._no_split_modules)))
        check_offload_fits_host_ram(accelerator, model)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    # A full fine-tune's reference with --beta: a frozen copy of the model as loaded (its weights once more, no grads).
    reference_model = frozen_copy(
        accelerator, args.model_name_or_path, config, args.trust_remote_code, lora, args.beta
    )
    register_fsdp_forward_method(model, "generate")  # FSDP2: generate() gathers the root's weights as forward does
    generator = PolicyGenerator(  # colocated: the policy being trained generates this process's share
        accelerator,
        model,
        tokenizer,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        sharded=layout == "fsdp",
    )
    sft_rows, sft_fmt = as_sft_rows(raw_datasets["validation"], fmt)
    exact_rows, exact_before = exact_match_before(  # greedy answers to held-out prompts, scored again at the end
        accelerator,
        model,
        tokenizer,
        sft_rows,
        sft_fmt,
        0 if args.skip_eval else args.exact_match_samples,
        layout == "fsdp",
        args.seed,
    )
    run_config = {
        **vars(args),
        "method": method,
        "parallelism": parallelism.name,
        "data_format": fmt,
        "global_batch_size": global_batch_size,
        "prompts_per_round": prompts_per_round,
        "max_train_steps": max_train_steps,
    }
    accelerator.init_trackers("grpo", {k: v for k, v in run_config.items() if not isinstance(v, list | None)})

    # ---------------------------------------------------------------------- training loop
    resume = load_checkpoint(
        accelerator,
        checkpoint,
        steps_per_epoch,
        1,  # the rounds to skip: the steps done in the epoch, over --num_iterations
        lr_scheduler,
        load_state=(lambda folder: load_adapter_state(accelerator, folder)) if lora else None,  # LoRA: the adapter
    )
    completed_steps, history, window, logs = resume.completed_steps, resume.history, [], {}
    log, rewards = history.get("train/log", []), history.get("train/rewards", [])
    every = steps_per_epoch if args.checkpointing_steps == "epoch" else args.checkpointing_steps
    last_checkpoint = max_train_steps - (args.checkpointing_steps == "epoch")  # no epoch checkpoint at the end
    save_checkpoint_at = lambda step: save_checkpoint(
        accelerator,
        checkpoints_dir,
        step,
        args.checkpoints_total_limit,
        write_state=(lambda folder: save_adapter_state(accelerator, folder)) if lora else None,  # LoRA: the adapter
        layout=layout,
        history={"train/loss_curve": record.losses(), "train/log": log, "train/rewards": list(map(float, rewards))},
        batch=batch_shape,
    )
    record = CompletionsRecord(accelerator, max_train_steps, history.get("train/loss_curve"), args.perf_warmup_steps)
    accelerator.print(f"config: {json.dumps(run_config, sort_keys=True, default=str)}")
    progress_bar = tqdm(total=max_train_steps, initial=completed_steps, disable=not accelerator.is_local_main_process)
    for epoch in range(resume.epoch, math.ceil(max_train_steps / steps_per_epoch)):
        train_dataloader.sampler.set_epoch(epoch)  # reseeds the order: the same on every process and after a resume
        skip = resume.batches_to_skip // args.num_iterations if epoch == resume.epoch else 0  # rounds already done
        active_dataloader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for prompts in record.timed(active_dataloader):
            # Generate: this process's share of the round, with its share of the noise (the same in any process count).
            rows = [row for row in prompts for _ in range(args.num_generations)][share]
            completions = generator.generate(
                [row["prompt_ids"] for row in rows],
                sampling_noise(
                    args.seed, completed_steps // args.num_iterations, global_batch_size, args.max_completion_length
                )[share],
            )
            # Reward: each function scores this process's completions; every process gathers them all (a collective).
            gathered = score_round(
                accelerator,
                reward_functions,
                rows,
                completions,
                tokenizer,
                fmt,
                trainer_state=trainer_state(completed_steps, max_train_steps, epoch),
            )
            # Advantages: each reward against its group's, over the global batch; this process keeps its rows'.
            advantages = group_advantages(
                gathered[:, : len(reward_functions)], args.reward_weights, args.num_generations, args.scale_rewards
            )
            batches = micro_batches(
                rows,
                completions,
                advantages["advantages"][share].cpu(),
                args.per_device_train_batch_size,
                tokenizer.pad_token_id,
                args.mask_truncated_completions,
                accelerator.device,
            )
            # The generating policy's log-probs (the ratio of a round's later steps is against it) and the reference's.
            add_fixed_logps(batches, model, reference_model, args.temperature, args.num_iterations > 1, args.beta > 0)

            for iteration in range(min(args.num_iterations, max_train_steps - completed_steps)):  # this round's steps
                # Sync point: the step's completion tokens (an all-reduce), counted before the first backward.
                step_tokens = accelerator.reduce(sum(batch["mask"].sum() for batch in batches), "sum")
                metrics = StepMetrics(accelerator.device)
                for index, batch in enumerate(batches):  # all but the last skip DDP's all-reduce / FSDP2's scatter
                    with accelerator.no_sync(model) if index < len(batches) - 1 else contextlib.nullcontext():
                        logps, entropy = completion_logps(model, batch, args.temperature)
                        token_loss, tokens = per_token_loss(
                            logps,
                            batch.get("old_logps"),
                            batch.get("reference_logps"),
                            batch["advantages"],
                            epsilon=args.epsilon,
                            epsilon_high=args.epsilon_high,
                            beta=args.beta,
                        )
                        loss = reduce_loss(
                            token_loss,
                            batch["mask"],
                            args.loss_type,
                            step_tokens=step_tokens,
                            step_completions=global_batch_size,
                            micro_batches=len(batches),
                            processes=data_parallel_size,
                            max_completion_length=args.max_completion_length,
                        )
                        accelerator.backward(loss * data_parallel_size)  # DDP/FSDP average N processes' gradients
                    metrics.add(loss, batch, {**tokens, "entropy": entropy})
                if args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                progress_bar.update(1)
                step = {
                    **metrics.result(accelerator, args.beta),
                    **round_metrics(gathered, reward_functions, advantages),
                }
                window.append(step)
                rewards.append(step["reward"])
                record.step(
                    completed_steps, step["loss"], global_batch_size * (iteration == 0), step.pop("num_tokens")
                )
                if completed_steps % args.logging_steps == 0 or completed_steps == max_train_steps:
                    # Sync point: reads the window's metrics (TRL's: a metric that is NaN in a step is left out).
                    logs = {f"train/{k}": torch.stack([s[k] for s in window]).nanmean().item() for k in window[0]}
                    logs["train/learning_rate"], window = lr_scheduler.get_last_lr()[0], []
                    log.append({"step": completed_steps, **logs})
                    accelerator.log(logs, step=completed_steps)
                if completed_steps % args.num_iterations == 0 and stop.requested(completed_steps):  # at a round's end
                    stop.exit(save_checkpoint_at(completed_steps))  # SIGTERM or Ctrl-C to any process: all stop
                if every and completed_steps % every == 0 and completed_steps <= last_checkpoint:
                    save_checkpoint_at(completed_steps)
            if completed_steps >= max_train_steps:
                break
    progress_bar.close()

    # ------------------------------------------------------------------------------- save
    save(accelerator, model, tokenizer, output_dir, trained_only=lora)

    # ------------------------------------------------------------------------- evaluation
    results = {
        "recipe": "grpo",
        "config": run_config,
        "train/log": log,
        "train/rewards": list(map(float, rewards)),
        "method": method,
        "data/counts": counts,
        **{key: value for key, value in logs.items() if key != "train/loss"},  # the last logged window's TRL metrics
        **exact_match_results(accelerator, model, tokenizer, exact_rows, sft_fmt, exact_before),
        "parallelism": parallelism.name,
        "data/format": fmt,
        "global_batch_size": global_batch_size,
        "model/trainable_parameters": trainable,
        "model/total_parameters": total,
    }
    record.write(output_dir, results, model)  # a collective
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)  # DDP gone before gloo
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
