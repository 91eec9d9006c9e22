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
gathers each block from both GPUs); ddp_2gpu.yaml with ``--generation_mode split``: the last process only generates,
the others only train, one round behind it (grpo_kit/split.py).

Launch (from the repository root):
    # CPU smoke run, or one GPU:
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/grpo.py --max_train_steps 4
    # two GPUs, colocated (on a CPU-only machine: 2 processes over gloo, same command), your prompts and reward:
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/grpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --train_file prompts.jsonl --reward_funcs rewards.py:my_reward
    # a model sharded over two GPUs, its reference the base with the adapter off:
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/grpo.py \\
        --model_name_or_path ... --mixed_precision bf16 --gradient_checkpointing --beta 0.04
    # the split layout: one GPU generates the next round while the other trains on this one:
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/grpo.py --generation_mode split

To use it in your project, copy recipes/grpo.py, recipes/grpo_kit/, recipes/llm_kit/ and shared/ (and
accelerate_configs/, which the launch lines name): the kits beside the recipe, shared/ beside it or one folder up.
Without --model_name_or_path, an SFT adapter or a model in outputs/train_lm, it pretrains one with recipes/train_lm.py,
which it looks for beside itself.

Writes to --output_dir: the adapter (LoRA/QLoRA) or the whole model, the tokenizer, ``results.json`` (TRL's metric
names: ``train/reward``, ``train/rewards/<function>/mean``, ``train/completions/mean_length`` ...; ``train/rewards``,
the mean reward of every optimizer step; ``perf/completions_per_sec``) and ``checkpoints/step_N`` every
--checkpointing_steps (N steps or epoch) and after the last step.
"""

import argparse
import contextlib
import functools
import json
import logging
import sys
from pathlib import Path

from accelerate.utils import ProjectConfiguration, set_seed
from accelerate.utils import disable_fsdp_ram_efficient_loading
from tqdm.auto import tqdm

# PEFT, which transformers imports, imports bitsandbytes, which on a CPU with AVX-512 bf16 warns on every process that
# an optional kernel is not installed (bitsandbytes 0.50; the CPU path works without it): quieted before that import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# shared/ (beside this file in a copy, or one folder up here) and the kits (the LLM recipes', this recipe's) go first
# on sys.path, so that no installed package of those names shadows them (this folder too, for an import that is not a
# run).
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
sys.path.insert(0, str(HERE))
from shared.checkpoints import keep_global_batch, load_checkpoint, save_final, set_start_checkpoint
from shared.signals import install_stop_on_signals
from shared.fsdp import gathered_state_dict, set_keep_gathered_in_one_process
from llm_kit.adapters import OFFLINE_DEFAULTS_LINE, POLICY_FLAGS, START_FLAGS, adapter_checkpoints, load_model
from llm_kit.adapters import starting_point
from llm_kit.checkpoints import ADAPTER_FLAGS, BATCH_FLAGS, CHECKPOINT_FLAGS, checkpoint_saver, unchanged_by_a_resume
from llm_kit.loading import causal_lm_config, parameter_counts, set_fsdp_units
from llm_kit.optimizer import OPTIMIZER_FLAGS, adamw_and_scheduler
from grpo_kit.data import PROMPT_FLAGS, as_sft_rows, check_layout, prompt_loader, read_prompts, rounds
from grpo_kit.data import check_positions, tokenize_prompts
from grpo_kit.loss import LOSS_TYPES, completion_logps, grpo_loss
from grpo_kit.metrics import CompletionsRecord, StepMetrics, TrainLog, round_metrics
from grpo_kit.rewards import FORMAT_PATTERN, trainer_state
from grpo_kit.policy import POLICY_SETUP_FLAGS, reference_and_generator
from grpo_kit.rollout import training_round
from grpo_kit.split import SPLIT_FLAGS, split_layout
from llm_kit.sharded_4bit import load_4bit_sharded
from shared.accelerator import build_accelerator, set_gpu_index, set_quiet_library_logs
from shared.errors import install_peer_exit_hooks, report_recipe_errors, set_stop_with_launcher
from shared.flags import add_reliability_flags, flags, positive_float, positive_int, prepare_output_dir
from shared.fsdp import set_fsdp_on_cpu
from shared.parallelism import choose_parallelism
from llm_kit.sft_data import add_chat_template, chat_tokenizer
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

# The flags each helper below takes as keyword arguments of the same names (``flags``).
LOSS_FLAGS = ("loss_type", "epsilon", "epsilon_high", "beta", "max_completion_length")  # loss.grpo_loss
ROLLOUT_FLAGS = (  # rollout.training_round
    "num_generations",
    "seed",
    "max_completion_length",
    "reward_weights",
    "scale_rewards",
    "per_device_train_batch_size",
    "temperature",
    "num_iterations",
    "beta",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument_group("data").add_argument
    add(
        "--train_file",
        help="Prompts (.jsonl/.json, .csv, .parquet): a 'prompt' column (a string, or a list of {role, content} "
        "messages) and whatever columns the reward functions read (e.g. 'answer').",
    )
    add("--validation_file", help="Held-out prompts, same format (default: held out, --validation_split_percentage).")
    add("--dataset_name", help="A Hugging Face Hub dataset (needs internet), e.g. 'trl-lib/DeepMath-103K'.")
    add("--dataset_config_name", help="The Hub dataset's configuration, if it has several.")
    add("--validation_split_percentage", type=positive_float, default=5, help="Held out when there is no validation.")
    add("--max_prompt_length", type=positive_int, help="Refuse longer prompts, quoting one (default: no limit).")
    add("--max_train_samples", type=positive_int, help="Use only this many (shuffled) training prompts.")
    add("--max_eval_samples", type=positive_int, help="Use only this many (shuffled) validation prompts.")
    add = parser.add_argument_group("model").add_argument
    add(
        "--model_name_or_path",
        help="Local folder or Hub name of a causal LM. Default: the base of --adapter_name_or_path; offline: "
        "outputs/train_lm, pretrained first if missing.",
    )
    add(
        "--adapter_name_or_path",
        help="A LoRA adapter to continue (e.g. outputs/llm_finetune, what llm_finetune.py saved); with --beta, its "
        "frozen copy is the reference. Its own rank and targets are kept (--lora_* apply to a new adapter only).",
    )
    add("--tokenizer_name", help="Folder or Hub name of the tokenizer, when the model's folder holds none.")
    add("--trust_remote_code", action="store_true", help="Allow a Hub model to run its own code.")
    add(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; else single).",
    )
    add("--full_finetune", action="store_true", help="Train every weight (with --beta: a frozen copy, the reference).")
    add("--load_in_4bit", action="store_true", help="QLoRA: the base in 4-bit NF4 (bitsandbytes), LoRA on top.")
    add("--lora_r", type=positive_int, default=8, help="LoRA rank.")
    add("--lora_alpha", type=positive_float, default=16, help="LoRA scaling: updates are scaled by alpha / r.")
    add("--lora_dropout", type=float, default=0.0, help="Dropout on the LoRA path.")
    add("--lora_target_modules", nargs="+", default=["all-linear"], help="Modules to adapt; all-linear: but the head.")
    add("--gradient_checkpointing", action="store_true", help="Recompute activations in backward: less memory.")
    add = parser.add_argument_group("generation").add_argument
    add(
        "--generation_mode",
        choices=["colocate", "split"],
        default="colocate",
        help="colocate: every process generates its share of the completions and trains on them (TRL's default); "
        "split: the last process only generates, the others only train, one round behind it (2+ processes, DDP).",
    )
    add("--num_generations", type=int, default=8, help="Completions per prompt: at least 2, dividing the batch.")
    add("--max_completion_length", type=positive_int, default=512, help="Generate at most this many tokens.")
    add("--temperature", type=positive_float, default=1.0, help="Sampling temperature (also in the log-probs).")
    add("--top_p", type=positive_float, default=1.0, help="Nucleus sampling (1.0: off).")
    add("--top_k", type=int, default=0, help="Sample among the k likeliest tokens (0: off).")
    add = parser.add_argument_group("GRPO").add_argument
    add(
        "--reward_funcs",
        nargs="+",
        default=["accuracy"],
        help="Reward functions: accuracy (the completion equals the 'answer' or 'solution' column, normalised), "
        "format (it matches --format_pattern), or path/to/file.py:function in TRL's signature.",
    )
    add("--reward_weights", type=float, nargs="+", help="One weight per reward function (default: 1).")
    add("--format_pattern", default=FORMAT_PATTERN, help="The regular expression the format reward asks for.")
    add(
        "--loss_type",
        choices=LOSS_TYPES,
        default="dapo",
        help="dapo (TRL's default): over all completion tokens of the step; grpo: each completion's mean, then their "
        "mean; dr_grpo: over completions x --max_completion_length; bnpo: each micro-batch's token mean.",
    )
    add("--beta", type=float, default=0.0, help="KL (k3) coefficient to the reference (0, TRL's default: none).")
    add("--epsilon", type=positive_float, default=0.2, help="Clip the ratio below at 1 - epsilon.")
    add("--epsilon_high", type=positive_float, help="Clip above at 1 + this (default: --epsilon).")
    add(
        "--scale_rewards",
        choices=["group", "batch", "none"],
        default="group",
        help="Divide each advantage by the standard deviation of its group's rewards, of the batch's, or not at all.",
    )
    add("--num_iterations", type=positive_int, default=1, help="Optimizer steps per round of completions.")
    add("--mask_truncated_completions", action="store_true", help="Leave unended completions out of the loss.")
    add = parser.add_argument_group("training").add_argument
    add("--per_device_train_batch_size", type=positive_int, default=8, help="Completions per process per forward.")
    add(
        "--gradient_accumulation_steps",
        type=positive_int,
        help="Forward/backward passes per optimizer step (default: 1; on a resume, what keeps the checkpoint's global "
        "batch in this process count).",
    )
    add("--num_train_epochs", type=positive_int, default=1, help="Passes over the prompts (unless --max_train_steps).")
    add("--max_train_steps", type=positive_int, help="Stop after this many optimizer steps (offline default: 400).")
    add("--learning_rate", type=positive_float, help="Peak AdamW rate (LoRA 5e-5, full TRL's 1e-6; offline 2e-4).")
    add("--weight_decay", type=float, default=0.0, help="AdamW weight decay.")
    add("--adam_epsilon", type=positive_float, default=1e-8, help="AdamW's epsilon.")
    add("--lr_scheduler_type", default="linear", help="transformers.get_scheduler name: linear, cosine, constant, ...")
    add("--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps.")
    add("--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm to this (0 disables).")
    add("--mixed_precision", choices=["no", "fp16", "bf16"], help="Override the config's mixed precision.")
    add("--seed", type=int, default=42, help="Seed for the LoRA initialisation, order and sampling.")
    add = parser.add_argument_group("output").add_argument
    add("--output_dir", default="outputs/grpo", help="Adapter (or model), tokenizer, results.json, checkpoints.")
    add(
        "--exact_match_samples",
        type=int,
        help="Score greedy answers to N (shuffled) validation prompts against their 'answer' (or 'solution'), before "
        "and after training (default: 100 when the answers are short, else none; 0 skips; not under FSDP).",
    )
    add("--report_to", help="Trackers to log to: tensorboard, wandb, all, ... (default: none).")
    add("--logging_steps", type=positive_int, default=10, help="Log the loss and TRL's metrics every N steps.")
    add("--skip_eval", action="store_true", help="Skip the exact match before and after training.")
    add("--perf_warmup_steps", type=int, default=1, help="Optimizer steps left out of the throughput numbers.")
    add_reliability_flags(parser)  # checkpoints, resume, --save_on_each_node, --dist_timeout (shared by the recipes)
    args = parser.parse_args(argv)
    refuse_conflicting_flags(parser, args)
    offline = not (args.model_name_or_path or args.adapter_name_or_path or args.train_file or args.dataset_name)
    chosen, args.offline_default_settings = offline_settings(sys.argv[1:] if argv is None else argv, offline=offline)
    vars(args).update(chosen)
    args.learning_rate = args.learning_rate or (1e-6 if args.full_finetune else 5e-5)
    args.epsilon_high = args.epsilon_high or args.epsilon
    args.reward_weights = args.reward_weights or [1.0] * len(args.reward_funcs)
    return args


def offline_settings(argv: list[str], *, offline: bool) -> tuple[dict, str]:
    """The ``OFFLINE_SETTINGS`` that ``argv`` does not set, when the run is the offline default (no model, adapter or
    data given; else none), and the sentence that says so. The SFT adapter (or a small base) learns visibly only with
    more completions per prompt and larger steps than an LLM's defaults."""
    given = {name for name in OFFLINE_SETTINGS if f"--{name}" in " ".join(argv)}
    chosen = {name: value for name, value in OFFLINE_SETTINGS.items() if offline and name not in given}
    settings = " ".join(f"--{name} {value:g}" for name, value in chosen.items())
    return chosen, settings and OFFLINE_DEFAULTS_LINE.format(settings)


def refuse_conflicting_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that cannot go together, refused with the usage line and exit code 2 (``parser.error``)."""
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
    if args.top_k < 0:
        parser.error(f"--top_k {args.top_k}: 0 samples from every token (vLLM's -1), k > 0 from the k likeliest")
    if args.top_p > 1:
        parser.error(f"--top_p {args.top_p}: a probability mass, at most 1.0 (1.0: every token)")
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


def run_results(run_config: dict, train_log, *, counts: dict, parameters: tuple[int, int], measured: dict) -> dict:
    """What ``results.json`` holds: the resolved configuration, the logged curves, TRL's metrics of the last logging
    window, the data's counts, ``measured`` (each role's times, the exact match before and after) and the model's
    trainable and total parameters."""
    return {
        "recipe": "grpo",
        "config": run_config,
        **train_log.history(),
        "method": run_config["method"],
        "data/counts": counts,
        **{key: value for key, value in train_log.last.items() if key != "train/loss"},  # TRL's, the last window's
        **measured,
        "parallelism": run_config["parallelism"],
        "data/format": run_config["data_format"],
        "global_batch_size": run_config["global_batch_size"],
        "model/trainable_parameters": parameters[0],
        "model/total_parameters": parameters[1],
    }


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
    set_keep_gathered_in_one_process(accelerator)  # FSDP in 1 process: no resharding after forward
    set_seed(args.seed)
    set_quiet_library_logs(accelerator)  # library warnings once, from the main process; no colour codes in log files
    output_dir = prepare_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/grpo.py")
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason}); method: {method}")
    split = split_layout(accelerator, args.generation_mode, parallelism.name, **flags(args, SPLIT_FLAGS))  # collective
    trains = not (split and split.generates)  # split: the last process only generates, the others train
    data_parallel_size = accelerator.num_processes - bool(split) if parallelism.name in ("ddp", "fsdp") else 1
    layout, checkpoints_dir = "fsdp" if parallelism.name == "fsdp" else "replica", output_dir / "checkpoints"
    checkpoint = set_start_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)
    args.gradient_accumulation_steps, batch_shape = keep_global_batch(  # a resume keeps its global batch
        accelerator.num_processes, checkpoint, data_parallel_size=data_parallel_size, **flags(args, BATCH_FLAGS)
    )
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel_size
    # A round: the prompts of one optimizer step's completions; this process generates and trains its share of them.
    prompts_per_round, share = check_layout(accelerator, global_batch_size, args.num_generations, data_parallel_size)

    # ------------------------------------------------------------------------------- data
    with accelerator.main_process_first():  # every row checked before any model is built (or pretrained)
        raw_datasets, fmt, reward_functions = read_prompts(**flags(args, PROMPT_FLAGS))
    args.adapter_name_or_path, args.model_name_or_path = starting_point(  # offline: the SFT adapter, else a base
        accelerator, lora, output_dir, HERE, **flags(args, START_FLAGS)
    )
    config = causal_lm_config(accelerator, args.model_name_or_path, args.load_in_4bit, args.trust_remote_code)
    tokenizer = chat_tokenizer(accelerator, args.model_name_or_path, args.trust_remote_code, args.tokenizer_name)
    add_chat_template(accelerator, tokenizer)
    with accelerator.main_process_first():  # the main process tokenizes first (datasets caches it), the others read
        train_dataset, counts = tokenize_prompts(accelerator, raw_datasets, fmt, tokenizer, args.max_prompt_length)
    check_positions(config, args.model_name_or_path, counts["longest_prompt_tokens"], args.max_completion_length)
    train_dataloader = prompt_loader(train_dataset, prompts_per_round, args.seed)

    # ------------------------------------------------------------------------------ model
    model = load_model(  # a continued adapter (with beta, its frozen copy: the reference), a new one, or none
        accelerator, args.model_name_or_path, config, lora=lora, reference=args.beta > 0, **flags(args, POLICY_FLAGS)
    )
    trainable, total = parameter_counts(accelerator, model, args.model_name_or_path)
    if args.load_in_4bit and parallelism.name == "fsdp":  # built empty: the main process reads a layer at a time
        load_4bit_sharded(accelerator, model, args.model_name_or_path)
        disable_fsdp_ram_efficient_loading()  # env: transformers must not load to meta on rank 1+ again

    # ------------------------------------------------------------------ optimizer and scheduler
    steps_per_epoch = len(train_dataloader) * args.num_iterations  # a round of prompts: --num_iterations steps
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    optimizer, lr_scheduler = adamw_and_scheduler(accelerator, model, max_train_steps, **flags(args, OPTIMIZER_FLAGS))

    # ------------------------------------------------------------------------------ prepare
    if layout == "fsdp":  # one FSDP unit per decoder block; an offload that cannot fit is refused now
        set_fsdp_units(accelerator, model)
    # Split: the trainers' DDP over their own group (the generating process never trains), which gets their weights.
    model, optimizer, lr_scheduler = (split.prepare if split else accelerator.prepare)(model, optimizer, lr_scheduler)
    reference_model, policy_generator = reference_and_generator(  # with beta, a full fine-tune's: a frozen copy
        accelerator, model, tokenizer, config, split, lora, layout == "fsdp", **flags(args, POLICY_SETUP_FLAGS)
    )
    generator = split or policy_generator  # split: the trainers receive the generating process's rounds
    sft_rows, sft_fmt = as_sft_rows(raw_datasets["validation"], fmt)
    exact_samples = 0 if args.skip_eval else args.exact_match_samples  # greedy answers, scored again at the end
    exact_rows, exact_before = exact_match_before(
        accelerator, model, tokenizer, sft_rows, sft_fmt, exact_samples, layout == "fsdp", args.seed
    )
    run_config = {**vars(args), "method": method, "parallelism": parallelism.name, "data_format": fmt}
    run_config |= {"global_batch_size": global_batch_size, "prompts_per_round": prompts_per_round}
    run_config |= {"max_train_steps": max_train_steps}
    accelerator.init_trackers("grpo", {k: v for k, v in run_config.items() if not isinstance(v, list | None)})

    # ---------------------------------------------------------------------- training loop
    load_state, write_state = adapter_checkpoints(accelerator) if lora else (None, None)  # LoRA: the adapter alone
    unchanged = unchanged_by_a_resume(len(train_dataloader.dataset), lora, **flags(args, ADAPTER_FLAGS))
    resume = load_checkpoint(accelerator, checkpoint, steps_per_epoch, 1, lr_scheduler, load_state, unchanged)
    completed_steps, train_log = resume.completed_steps, TrainLog(resume.history, args.logging_steps, max_train_steps)
    curve = resume.history.get("train/loss_curve")  # a resume goes on with it
    record = CompletionsRecord(accelerator, max_train_steps, curve, args.perf_warmup_steps)
    save_at_step_end = checkpoint_saver(  # a checkpoint when due, or on SIGTERM or Ctrl-C (then exit)
        accelerator,
        stop=stop,
        checkpoints_dir=checkpoints_dir,
        steps_per_epoch=steps_per_epoch,
        max_train_steps=max_train_steps,
        write_state=(lambda folder: split.save_state(folder, write_state)) if split else write_state,  # split: +round
        layout=layout,
        history=lambda: {"train/loss_curve": record.losses(), **train_log.history()},  # a resume goes on with them
        batch=batch_shape,
        unchanged=unchanged,
        **flags(args, (*CHECKPOINT_FLAGS, "num_iterations")),
    )
    accelerator.print(f"config: {json.dumps(run_config, sort_keys=True, default=str)}")
    progress_bar = tqdm(total=max_train_steps, initial=completed_steps, disable=not accelerator.is_local_main_process)
    prompt_rounds = rounds(accelerator, train_dataloader, resume, args.num_iterations, max_train_steps)
    if not trains:  # split: this process makes every round, one ahead of the trainers, then stops
        split.serve(policy_generator, model, prompt_rounds, save_at_step_end, checkpoint, resume, max_train_steps)
    loss_of = functools.partial(  # the loss's settings, the same every step (loss.py: TRL's clipped ratio, KL ...)
        grpo_loss, step_completions=global_batch_size, processes=data_parallel_size, **flags(args, LOSS_FLAGS)
    )
    # The rollout's settings, the same every round (rollout.py: generation, rewards, advantages, micro-batches).
    rollout_settings = dict(share=share, global_batch_size=global_batch_size, group=split and split.trainers)
    rollout_settings |= dict(reward_functions=reward_functions, tokenizer=tokenizer, fmt=fmt, model=model)
    rollout_settings |= dict(reference_model=reference_model, mask_truncated=args.mask_truncated_completions)
    rollout_settings |= flags(args, ROLLOUT_FLAGS)
    for prompts in record.timed(prompt_rounds if trains and completed_steps < max_train_steps else []):
        round_index, epoch = completed_steps // args.num_iterations, completed_steps // steps_per_epoch
        state = trainer_state(completed_steps, max_train_steps, epoch)  # what TRL passes reward functions
        batches, gathered, advantages, step_tokens = training_round(  # this process's share, scored, its advantages
            accelerator, generator, prompts, round_index=round_index, trainer_state=state, **rollout_settings
        )

        for iteration in range(min(args.num_iterations, max_train_steps - completed_steps)):  # this round's steps
            metrics = StepMetrics(accelerator.device)
            for index, batch in enumerate(batches):  # all but the last skip DDP's all-reduce / FSDP2's scatter
                with accelerator.no_sync(model) if index < len(batches) - 1 else contextlib.nullcontext():
                    logps, entropy = completion_logps(model, batch, args.temperature)
                    loss, tokens = loss_of(logps, batch, step_tokens=step_tokens, micro_batches=len(batches))
                    accelerator.backward(loss * data_parallel_size)  # DDP/FSDP average N processes' gradients
                metrics.add(loss, batch, {**tokens, "entropy": entropy})
            if args.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            completed_steps += 1
            progress_bar.update(1)
            step = metrics.result(accelerator, args.beta, group=split and split.trainers)
            step |= round_metrics(gathered, reward_functions, advantages)
            record.step(completed_steps, step["loss"], global_batch_size * (iteration == 0), step.pop("num_tokens"))
            train_log.add(accelerator, completed_steps, step, lr_scheduler.get_last_lr()[0])
            lr_scheduler.step()  # after the log, which reports the rate this step used (as the Trainer)
            save_at_step_end(completed_steps)  # a checkpoint when due; SIGTERM or Ctrl-C: one, then exit
        generator.update(model)  # split: the round's weights to the generating process (colocated: nothing)
        if completed_steps >= max_train_steps:
            break
    progress_bar.close()

    # ------------------------------------------------------------------------------- save
    save(accelerator, model, tokenizer, output_dir, trained_only=lora)

    # ------------------------------------------------------------------------- evaluation
    times = split.times() if split else {}  # each role's busy and idle seconds (a collective)
    exact_match = exact_match_results(accelerator, model, tokenizer, exact_rows, sft_fmt, exact_before)
    results = run_results(
        run_config, train_log, counts=counts, parameters=(trainable, total), measured={**times, **exact_match}
    )
    record.write(output_dir, results, model)  # a collective
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)  # DDP gone before gloo
    accelerator.end_training()


if __name__ == "__main__":
    with report_recipe_errors():  # a bad input every process finds: its paragraph printed once, named to the launcher
        main()
