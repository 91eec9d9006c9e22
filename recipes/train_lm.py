"""Train a GPT-style (Llama-architecture) language model on one device, two GPUs with DDP or FSDP2, or one model split
over two devices with a device_map: one training loop through ``accelerator.prepare()``, the launch config picks.

- ``single``     1 process, 1 device;
- ``ddp``        2 processes, a full replica each, each trains on its shard of every batch, gradients averaged;
- ``fsdp``       2 processes, data parallel like ddp, but each holds 1/2 of every parameter, gradient and optimizer
                 state (FSDP2 ``fully_shard`` per decoder block, through Accelerate): for models whose training state
                 does not fit on one device;
- ``device_map`` 1 process, the decoder blocks split over the devices, balanced by compute (embeddings on the first,
                 LM head + loss on the last, both counted); Accelerate's hooks move the activations. Only one device
                 computes at a time: it lets a model *fit*, it is not faster. ``recipes/pipeline_lm.py`` is this
                 recipe plus true pipeline parallelism, which makes a split pay.

``--parallelism auto`` follows the launch config: an FSDP config -> fsdp, 2 processes -> ddp, 1 process that sees >= 2
GPUs -> device_map, otherwise single. On a CPU-only machine every mode runs: device_map over two CPU "devices" with the
GPU code path (the same hooks), ddp and fsdp as 2 gloo processes (fsdp really sharded), one thread per process so that
one core stands in for one GPU.

Launch (from the repository root):
    # CPU smoke run, or one GPU (single):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/train_lm.py --model_size tiny \\
        --max_train_steps 20 --corpus_max_mb 1
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/train_lm.py --model_size 125m
    # two GPUs, fully sharded (FSDP2), with activation recomputation (on CPU: 2 gloo processes, really sharded):
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/train_lm.py --model_size 1.3b \\
        --gradient_checkpointing
    # two GPUs, one process, naive split (one GPU: split over the GPU and the CPU; no GPU: add --parallelism
    # device_map):
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml recipes/train_lm.py --model_size 1.3b

Writes to ``output_dir``: the model in Hugging Face format (``model.safetensors``, config, the tokenizer; FSDP shards
gathered into one), ``results.json`` (losses, ``eval/perplexity``, throughput, MFU on GPUs, peak memory per device,
model-state bytes per process, the resolved config) and, with ``--checkpointing_steps``, resumable checkpoints in
``checkpoints/step_N`` (under FSDP each process writes its shard).
"""

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch.utils.data import DataLoader

# PEFT, which transformers imports, imports bitsandbytes, which on a CPU with AVX-512 bf16 warns on every process that
# an optional kernel is not installed (bitsandbytes 0.50; the CPU path works without it): quieted before that import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, get_scheduler  # noqa: E402

# The helper module: shared/ next to this file (a copied recipe) or one folder up (this repository), first on sys.path
# so that no installed package named "shared" shadows it.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE if (HERE / "shared").is_dir() else HERE.parent))
from shared.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from shared.flops import lm_flops_per_token  # noqa: E402
from shared.fsdp import check_offload_fits_host_ram, sharding_facts, wrap_at_blocks  # noqa: E402
from shared.hang_dump import HangDump  # noqa: E402
from shared.lm_data import load_text_corpus, tokenize_and_pack, train_bpe_tokenizer  # noqa: E402

# Llama-architecture shapes by name (tiny for tests, small for CPU, GPT-3's 125m/350m/1.3b): one table, which the fit
# planner (tools/plan.py) reads too.
from shared.model_presets import MODEL_PRESETS  # noqa: E402
from shared.model_split import (  # noqa: E402
    block_ranges,
    blocks_per_part,
    dispatch_on_devices,
    execution_devices,
    find_block_list,
    lm_head_cost_in_blocks,
    plan_device_map,
    split_devices,
)
from shared.results import ThroughputMeter, model_state_bytes, per_rank, write_results  # noqa: E402
from shared.runtime import (  # noqa: E402
    RecipeError,
    build_accelerator,
    choose_parallelism,
    positive_float,
    positive_int,
    prepare_output_dir,
    run_facts,
    steps_or_epoch,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir",
        default="outputs/train_lm",
        help="Where the model, results.json and checkpoints go (created if missing).",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=42,
        help="Seed for the initial weights and the data order (the same in every mode).",
    )
    parser.add_argument(
        "--parallelism",
        choices=["auto", "single", "ddp", "fsdp", "device_map"],
        default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; 1 process seeing >= 2 "
        "GPUs: device_map; else single). device_map needs 1 process, ddp 2 or more, fsdp "
        "accelerate_configs/fsdp_2gpu.yaml.",
    )
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute each decoder block's activations in backward: less memory, ~1/3 more compute.",
    )
    parser.add_argument(
        "--ddp_comm_hook",
        choices=["no", "bf16", "fp16"],
        default="no",
        help="DDP: compress gradients to 16 bits for the all-reduce (Accelerate's DDPCommunicationHookType), half the "
        "bytes on the link, summed and averaged in 16-bit.",
    )
    parser.add_argument(
        "--ddp_bucket_cap_mb",
        type=positive_int,
        default=25,
        help="DDP: gradients are all-reduced in buckets of this many MB, overlapped with the rest of backward.",
    )
    parser.add_argument(
        "--model_size",
        choices=list(MODEL_PRESETS),
        default="small",
        help="Model shape when training from scratch (ignored with --model_name_or_path).",
    )
    parser.add_argument(
        "--num_layers", type=positive_int, default=None, help="Override the preset's number of decoder blocks."
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="Start from pretrained weights (a Hub id or a folder this recipe saved); its tokenizer is used.",
    )
    parser.add_argument(
        "--vocab_size",
        type=positive_int,
        default=8192,
        help="Vocabulary of the byte-level BPE tokenizer trained on the training text.",
    )
    parser.add_argument(
        "--dataset_name",
        default=None,
        help="A Hub dataset with a text column (needs internet). Default: the offline standard-library corpus.",
    )
    parser.add_argument(
        "--dataset_config_name", default=None, help="The Hub dataset's configuration name, if it has several."
    )
    parser.add_argument(
        "--train_file", default=None, help="A text file to train on (one example per line, line breaks kept)."
    )
    parser.add_argument(
        "--validation_file",
        default=None,
        help="A text file to validate on (default: the last --validation_split_percentage of --train_file).",
    )
    parser.add_argument(
        "--validation_split_percentage",
        type=positive_float,
        default=5,
        help="Share held out for validation when there is no validation split (default corpus: every k-th file).",
    )
    parser.add_argument(
        "--corpus_max_mb",
        type=positive_float,
        default=None,
        help="Use only the first N MB of the default corpus (files in sorted order). Default: all (~11 MB).",
    )
    parser.add_argument(
        "--block_size",
        type=positive_int,
        default=256,
        help="Tokens per training sequence (texts are packed into blocks of this length).",
    )
    parser.add_argument(
        "--max_train_samples", type=positive_int, default=None, help="Use only the first N training blocks."
    )
    parser.add_argument(
        "--max_eval_samples", type=positive_int, default=None, help="Use only the first N validation blocks."
    )
    parser.add_argument(
        "--per_device_train_batch_size", type=positive_int, default=16, help="Blocks per process per forward pass."
    )
    parser.add_argument(
        "--per_device_eval_batch_size",
        type=positive_int,
        default=None,
        help="Blocks per evaluation batch (default: the training batch size).",
    )
    parser.add_argument(
        "--gradient_accumulation_steps", type=positive_int, default=1, help="Batches per optimizer step."
    )
    parser.add_argument(
        "--num_train_epochs",
        type=positive_int,
        default=1,
        help="Passes over the training set (ignored if --max_train_steps is set).",
    )
    parser.add_argument(
        "--max_train_steps", type=positive_int, default=None, help="Stop after this many optimizer steps."
    )
    parser.add_argument("--learning_rate", type=positive_float, default=1e-3, help="Peak AdamW learning rate.")
    parser.add_argument(
        "--weight_decay",
        type=float,
        default=0.1,
        help="AdamW weight decay (matrices only; norms and biases are not decayed).",
    )
    parser.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="Clip the global gradient norm to this (0: no clipping)."
    )
    parser.add_argument(
        "--lr_scheduler_type",
        default="cosine",
        choices=["linear", "cosine", "constant", "constant_with_warmup"],
        help="Learning-rate schedule (transformers.get_scheduler).",
    )
    parser.add_argument(
        "--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps."
    )
    parser.add_argument(
        "--mixed_precision",
        choices=["no", "fp16", "bf16"],
        default=None,
        help="Override the config's mixed precision (bf16 also works on CPU; fp16 needs a GPU).",
    )
    parser.add_argument(
        "--checkpointing_steps",
        type=steps_or_epoch,
        default=None,
        help="Save a resumable checkpoint to output_dir/checkpoints/step_N every N optimizer steps, or 'epoch'.",
    )
    parser.add_argument(
        "--checkpoints_total_limit", type=positive_int, default=None, help="Keep only the newest N checkpoints."
    )
    parser.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help="A checkpoint folder, or 'latest' (newest complete one under output_dir/checkpoints; starts fresh "
        "if there is none).",
    )
    parser.add_argument(
        "--save_on_each_node",
        action="store_true",
        help="Machines without a shared disk: every machine saves its own copy of each checkpoint.",
    )
    parser.add_argument(
        "--dist_timeout",
        type=float,
        default=600,
        help="Seconds any collective may wait for the other processes before the run fails with an error naming it.",
    )
    parser.add_argument(
        "--eval_before_training", action="store_true", help="Also measure validation perplexity before the first step."
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (inductor, via Accelerate's dynamo_backend) in single, ddp and fsdp; "
        "attention already uses PyTorch's SDPA kernels (transformers' default).",
    )
    parser.add_argument(
        "--skip_eval",
        action="store_true",
        help="Skip the final evaluation (eval/* are NaN): benchmarks that measure training speed only.",
    )
    parser.add_argument(
        "--perf_warmup_steps",
        type=int,
        default=2,
        help="Optimizer steps left out of the throughput numbers (start-up, first-call costs).",
    )
    parser.add_argument(
        "--cpu_threads_per_process",
        type=int,
        default=1,
        help="On CPU: PyTorch threads per process (1 = one core stands in for one GPU; 0 = PyTorch's default).",
    )
    parser.add_argument(
        "--sample_prompt", default="def ", help="Prompt for the short greedy sample printed at the end."
    )
    parser.add_argument(
        "--sample_tokens", type=int, default=24, help="Tokens to generate for the sample (0: no sample)."
    )
    return parser.parse_args(argv)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (linear and embedding weights), none on norms/biases."""
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return [
        {"params": [parameter for parameter in parameters if parameter.ndim >= 2], "weight_decay": weight_decay},
        {"params": [parameter for parameter in parameters if parameter.ndim < 2], "weight_decay": 0.0},
    ]


def evaluate_model(accelerator, model, eval_dataloader) -> tuple[float, int, int]:
    """Summed next-token loss, tokens and blocks over the whole validation set.

    Per-block sums go through ``gather_for_metrics``, which drops the samples the sharded loader repeats to give every
    process a full last batch, so each block counts exactly once.
    """
    model.eval()
    loss_sum, num_tokens, num_blocks = 0.0, 0, 0
    for batch in eval_dataloader:
        input_ids = batch["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
        # Same loss as the model's own (shifted, float32), kept per block so blocks can be counted.
        per_block = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:].to(logits.device), reduction="none"
        ).sum(dim=1)
        tokens = torch.full_like(per_block, input_ids.shape[1] - 1)
        per_block, tokens = accelerator.gather_for_metrics((per_block, tokens))
        loss_sum += per_block.sum().item()  # sync point: .item() waits for the device
        num_tokens += int(tokens.sum().item())
        num_blocks += per_block.numel()
    return loss_sum, num_tokens, num_blocks


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    # (This Accelerator block repeats in every recipe on purpose: each recipe is one file you can copy, and reads top
    # to bottom without a jump into a helper that hides its settings.)
    # Hang dumps: if a collective times out or a rank stops making progress, every rank that can still run writes
    # its stacks, step and collective to output_dir/debug/. Started first: NCCL reads its settings at start-up.
    hang_dump = HangDump(Path(args.output_dir) / "debug", args.dist_timeout)
    # build_accelerator passes cpu=True when there is no CUDA, so a 2-process config joins over gloo instead of
    # starting two silent independent runs, and checks the process count.
    accelerator = build_accelerator(
        # Bounds every collective: a dead or hung process ends the run after this long with an error naming the
        # operation, instead of the backend's 10-30 minutes.
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # --compile: prepare() wraps the model in torch.compile (None keeps ACCELERATE_DYNAMO_BACKEND's choice).
        dynamo_backend="inductor" if args.compile else None,
        # A seedable sampler with a fixed data seed shuffles identically in every mode and process count: what makes
        # the modes comparable batch-for-batch.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
        # ddp: the gradient buckets and their compression (ignored by the other parallelisms).
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                bucket_cap_mb=args.ddp_bucket_cap_mb, comm_hook=DDPCommunicationHookType(args.ddp_comm_hook)
            )
        ],
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir)
    if accelerator.device.type == "cpu" and args.cpu_threads_per_process > 0:
        # One core per process stands in for one GPU: without this, one process of a naive split would use every core
        # while each of two processes shares them, and the comparison would lie.
        torch.set_num_threads(args.cpu_threads_per_process)

    # Refuses combinations that cannot work (device_map with 2 processes, ddp with 1, fsdp without its config).
    parallelism = choose_parallelism(accelerator, args.parallelism, "recipes/train_lm.py")
    num_processes = accelerator.num_processes
    eval_batch_size = args.per_device_eval_batch_size or args.per_device_train_batch_size
    if args.compile and parallelism.name == "device_map":
        raise RecipeError(
            "--compile works on the model that prepare() wraps whole (single, ddp, fsdp), not on a device_map split."
        )
    # ddp and fsdp are both data parallel: each process trains on its shard of every global batch.
    data_parallel = parallelism.name in ("ddp", "fsdp")
    # device_map: [cuda:0, cuda:1] on a 2-GPU box, [cuda:0, cpu] on one GPU, [cpu, cpu] on a CPU-only machine; the
    # split, hooks and activation moves are the same code for all three.
    split_over = split_devices(accelerator.device) if parallelism.name == "device_map" else []
    num_stages = len(split_over) or 1
    accelerator.print(f"parallelism: {parallelism.name} ({parallelism.reason})")

    # Model shape first: bad sizes fail here, before any data work.
    if args.model_name_or_path:
        model_config = AutoConfig.from_pretrained(args.model_name_or_path)
    else:
        preset = dict(MODEL_PRESETS[args.model_size])
        if args.num_layers:
            preset["num_hidden_layers"] = args.num_layers
        # Untied LM head: a split can then put the embeddings on the first part and the head on the last.
        model_config = LlamaConfig(
            **preset,
            num_key_value_heads=preset["num_attention_heads"],
            vocab_size=args.vocab_size,
            tie_word_embeddings=False,
        )
    if args.block_size > model_config.max_position_embeddings:
        raise RecipeError(
            f"--block_size {args.block_size} is longer than the model's {model_config.max_position_embeddings} "
            f"positions (max_position_embeddings). Use --block_size {model_config.max_position_embeddings} or less."
        )
    if model_config.num_hidden_layers < num_stages:
        raise RecipeError(
            f"The model has {model_config.num_hidden_layers} decoder layers but {parallelism.name} needs at least "
            "one per "
            f"stage ({num_stages} stages). Use a model with more layers (--num_layers {num_stages} or more) or fewer "
            "stages."
        )

    # Checkpoints: output_dir/checkpoints/step_N, complete once progress.json is written; every process agrees on the
    # one to resume from ("latest" skips incomplete ones and starts fresh when there is none). FSDP shards and whole
    # models are different layouts: a checkpoint of the other one is refused.
    checkpoints_dir = output_dir / "checkpoints"
    layout = "fsdp" if parallelism.name == "fsdp" else "replica"
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir, layout=layout)

    # ------------------------------------------------------------------------------- data
    # (pipeline_lm.py repeats this section line for line, so that each recipe can be copied alone; a test keeps the
    # two the same.) main_process_first: the main process reads, trains the tokenizer and tokenizes (datasets caches
    # the results); the others then load the tokenizer it saved and hit the cache.
    with accelerator.main_process_first():
        try:
            raw_datasets, corpus, documents = load_text_corpus(
                dataset_name=args.dataset_name,
                dataset_config_name=args.dataset_config_name,
                train_file=args.train_file,
                validation_file=args.validation_file,
                validation_split_percentage=args.validation_split_percentage,
                corpus_max_mb=args.corpus_max_mb,
            )
        except (OSError, ValueError, ConnectionError) as error:
            raise RecipeError(f"Could not load the training text: {error}") from None
        run_folder = checkpoint.parents[1] if checkpoint is not None else None  # run_folder/checkpoints/step_N
        if run_folder is not None and (run_folder / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(run_folder)  # the resumed run's own tokenizer
        elif args.model_name_or_path:
            try:  # a pretrained model comes with the tokenizer its embeddings were trained for
                tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
            except (OSError, ValueError) as error:
                raise RecipeError(
                    f"--model_name_or_path {args.model_name_or_path} has no loadable tokenizer ({error}); "
                    "a pretrained model needs the tokenizer it was trained with."
                ) from None
        elif accelerator.is_main_process:
            tokenizer = train_bpe_tokenizer((row["text"] for row in raw_datasets["train"]), vocab_size=args.vocab_size)
            tokenizer.save_pretrained(output_dir)
        else:
            tokenizer = AutoTokenizer.from_pretrained(output_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        lm_datasets, token_counts = tokenize_and_pack(raw_datasets, tokenizer, args.block_size, documents)
    for split in ("train", "validation"):
        if len(lm_datasets[split]) == 0:
            raise RecipeError(
                f"The {split} text has {token_counts[split]} tokens, fewer than one block of --block_size "
                f"{args.block_size}. Use more text or a smaller --block_size."
            )
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"]
    if args.max_train_samples:
        train_dataset = train_dataset.select(range(min(args.max_train_samples, len(train_dataset))))
    if args.max_eval_samples:
        eval_dataset = eval_dataset.select(range(min(args.max_eval_samples, len(eval_dataset))))
    train_dataset.set_format("torch", columns=["input_ids"])
    eval_dataset.set_format("torch", columns=["input_ids"])
    # drop_last: every batch has the same shape (pipeline stages need it), so both LM recipes see the same batches.
    train_dataloader = DataLoader(
        train_dataset, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True
    )
    eval_dataloader = DataLoader(eval_dataset, batch_size=eval_batch_size)
    batches_needed = (num_processes if data_parallel else 1) * args.gradient_accumulation_steps
    if len(train_dataloader) < batches_needed:
        raise RecipeError(
            f"One optimizer step needs {batches_needed * args.per_device_train_batch_size} blocks of "
            f"{args.block_size} "
            f"tokens but the training set has {len(train_dataset)} ({token_counts['train']} tokens). Use more text, "
            "a smaller --block_size, --per_device_train_batch_size or --gradient_accumulation_steps."
        )
    accelerator.print(
        f"data: {corpus}: {len(train_dataset)} train / {len(eval_dataset)} validation blocks of "
        f"{args.block_size} tokens, vocabulary {len(tokenizer)}"
    )

    # ------------------------------------------------------------------------------ model
    if not args.model_name_or_path:
        # The trained vocabulary can be smaller than --vocab_size on a small corpus; its one special token both starts
        # and ends texts (and is never a pad id, which would freeze its embedding).
        model_config.vocab_size = len(tokenizer)
        model_config.bos_token_id = model_config.eos_token_id = tokenizer.eos_token_id
    # Re-seeded here so every process and every mode starts from identical weights.
    set_seed(args.seed)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=model_config)
    else:
        model = AutoModelForCausalLM.from_config(model_config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    # One plan for every kind of split: whole decoder blocks, balanced by estimated compute, with the embeddings on
    # the first part and the final norm + LM head (+ loss) on the last.
    block_list = find_block_list(model, set(model._no_split_modules))
    head_cost = lm_head_cost_in_blocks(model, block_list, args.block_size)
    plan = plan_device_map(model, num_stages, last_cost=head_cost)
    blocks_per_stage = blocks_per_part(plan, block_list)
    stage_costs = [count + (head_cost if part == num_stages - 1 else 0) for part, count in enumerate(blocks_per_stage)]
    if num_stages > 1:
        split = [f"blocks {r.start}-{r.stop - 1}" for r in block_ranges(blocks_per_stage)]
        split[0] = "embeddings + " + split[0]
        split[-1] += " + norm + LM head"
        accelerator.print(
            f"model: {num_parameters / 1e6:.1f}M parameters; split by estimated compute (the LM head and loss count "
            "as "
            f"{head_cost:.1f} blocks): "
            + "; ".join(
                f"stage {part}: {text} ({cost / sum(stage_costs):.0%})"
                for part, (text, cost) in enumerate(zip(split, stage_costs))
            )
        )
    else:
        accelerator.print(
            f"model: {num_parameters / 1e6:.1f}M parameters, {len(model.get_submodule(block_list))} decoder "
            "blocks, unsplit"
        )

    if args.gradient_checkpointing:
        # Before the split and prepare() (FSDP wraps the blocks): each decoder block then recomputes its activations in
        # backward. use_reentrant=False: the reentrant version runs backward outside autograd's view of the block,
        # which breaks DDP (a parameter "used twice" or "unused" error) and needs an input that requires grad; the
        # non-reentrant one works in every mode and gives the same gradients.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    device_map = None
    if parallelism.name == "device_map":
        model, device_map = dispatch_on_devices(model, plan, split_over)
        if len(set(split_over)) == 1:
            accelerator.print(
                f'device_map: splitting over {len(split_over)} {split_over[0].type} "devices" that are one '
                "device: the same hooks and moves as on 2 GPUs, not faster"
            )

    # ------------------------------------------------------------------ optimizer and scheduler
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.learning_rate, betas=(0.9, 0.95))
    # Batches each process sees per epoch: the prepared data-parallel loader gives each process every num_processes-th
    # batch (drop_last: whole rounds only). accumulate() also steps on the last, shorter group of an epoch, hence the
    # ceiling division.
    batches_per_epoch = len(train_dataloader) // (num_processes if data_parallel else 1)
    steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_train_epochs = math.ceil(max_train_steps / steps_per_epoch)
    # A prepared scheduler steps once per process per optimizer step (it assumes every process saw its own batch), so
    # its length is counted in process-steps.
    scheduler_steps = num_processes
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * scheduler_steps,
        num_training_steps=max_train_steps * scheduler_steps,
    )

    # ------------------------------------------------------------------------------ prepare
    # ddp: wraps the model in DDP and shards the data loaders. fsdp: shards the model instead (fully_shard on every
    # decoder block, then the rest) and points the optimizer at the shards, so each process's AdamW state covers only
    # its 1/N. device_map: the model keeps its placement (prepare reads hf_device_map). single: moves it to the device.
    if parallelism.name == "fsdp":
        accelerator.print(f"fsdp: one unit per {wrap_at_blocks(accelerator, model, block_list) or 'configured block'}")
        check_offload_fits_host_ram(accelerator, model)  # offload config: refuse now, not at an OOM mid-run
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    # tokens per optimizer step = batch x sequence length x accumulation x data-parallel processes.
    global_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * (num_processes if data_parallel else 1)
    )
    tokens_per_step = global_batch_size * args.block_size
    config = {
        **vars(args),
        "parallelism_resolved": parallelism.name,
        "num_processes": num_processes,
        "num_stages": num_stages,
        "global_batch_size": global_batch_size,
        "tokens_per_step": tokens_per_step,
        "max_train_steps_resolved": max_train_steps,
        "blocks_per_stage": blocks_per_stage,
        "model_config": model_config.to_diff_dict(),
        "devices": [str(device) for device in split_over] or [str(accelerator.device)],
        "cpu_threads": torch.get_num_threads() if accelerator.device.type == "cpu" else None,
    }
    accelerator.print("config: " + json.dumps(config, sort_keys=True, default=str))

    # Restores the model, optimizer, scheduler, the sampler's seed and every process's RNG states.
    resume = load_checkpoint(accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps)
    completed_steps, starting_epoch, batches_to_skip = resume.completed_steps, resume.epoch, resume.batches_to_skip

    def evaluate():
        return evaluate_model(accelerator, model, eval_dataloader)

    results = {}
    if args.eval_before_training:
        loss_sum, num_tokens, _ = evaluate()
        results["eval/perplexity_before_training"] = math.exp(loss_sum / num_tokens)
        accelerator.print(f"before training: eval/perplexity {results['eval/perplexity_before_training']:.2f}")

    # ---------------------------------------------------------------------- training loop
    meter = ThroughputMeter(
        accelerator, warmup_steps=args.perf_warmup_steps, devices=sorted(set(split_over), key=str) or None
    )
    # The mean training loss of each optimizer step; a resumed run starts from the curve its checkpoint saved.
    loss_curve = list(resume.history.get("train/loss_curve", []))
    step_loss = torch.zeros((), device=accelerator.device)
    log_every = max(1, max_train_steps // 10)
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        # Explicit epoch: the shuffling seed is data_seed + epoch, also in the skipping loader below.
        train_dataloader.set_epoch(epoch)
        active_dataloader = train_dataloader
        if epoch == starting_epoch and batches_to_skip:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, batches_to_skip)
        for batch in meter.timed(active_dataloader):  # timed: measures the wait for each batch
            input_ids = batch["input_ids"]
            # accumulate() decides when a step ends (every gradient_accumulation_steps batches, or at the end of the
            # data loader) and skips DDP's all-reduce until then.
            with accelerator.accumulate(model):
                loss = model(input_ids=input_ids, labels=input_ids).loss
                step_loss += loss.detach().float() / args.gradient_accumulation_steps
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                if accelerator.sync_gradients:
                    if args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                # Sync point (.item()): the mean over the processes' losses.
                loss_curve.append(accelerator.reduce(step_loss, reduction="mean").item())
                step_loss.zero_()
                meter.step(samples=global_batch_size, tokens=tokens_per_step)
                hang_dump.step(completed_steps)
                if completed_steps % log_every == 0 or completed_steps == max_train_steps:
                    accelerator.print(
                        f"epoch {epoch} step {completed_steps}/{max_train_steps} train/loss {loss_curve[-1]:.4f} "
                        f"lr {lr_scheduler.get_last_lr()[0]:.2e}"
                    )
                if isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0:
                    save_checkpoint(
                        accelerator,
                        checkpoints_dir,
                        completed_steps,
                        args.checkpoints_total_limit,
                        layout=layout,
                        history={"train/loss_curve": loss_curve},
                    )
            if completed_steps >= max_train_steps:
                break
        if args.checkpointing_steps == "epoch" and completed_steps < max_train_steps:
            save_checkpoint(
                accelerator,
                checkpoints_dir,
                completed_steps,
                args.checkpoints_total_limit,
                layout=layout,
                history={"train/loss_curve": loss_curve},
            )
        if completed_steps >= max_train_steps:
            break
    # Collective: every process calls it. With the training FLOPs per token, MFU on CUDA against the GPU's peak.
    perf = meter.summary(
        flops_per_token=lm_flops_per_token(
            model_config.hidden_size,
            model_config.num_hidden_layers,
            model_config.vocab_size,
            num_parameters,
            args.block_size,
        )
    )
    # Exact bytes of parameters + gradients + optimizer state per process.
    perf["memory/model_state_bytes"] = per_rank(model_state_bytes(model, optimizer))  # a collective
    if parallelism.name == "fsdp":
        # Proof of sharding, per process: DTensor parameters, elements held vs the whole model's, FSDP modules.
        perf["fsdp/sharding"] = per_rank(sharding_facts(model, optimizer))

    # ------------------------------------------------------------------------------- save
    # Before the evaluation: nothing that can fail after the last optimizer step may lose the trained weights.
    hang_dump.phase("saving")
    accelerator.wait_for_everyone()
    if parallelism.name == "fsdp":
        # Each process holds 1/N of every weight: gather them into one full model on the main process (a collective).
        full_state_dict = accelerator.get_state_dict(model)
        final_model = None
        if accelerator.is_main_process:
            final_model = AutoModelForCausalLM.from_config(model_config)
            final_model.load_state_dict(full_state_dict, strict=True)  # strict: every weight came from a shard
    else:
        final_model = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        final_model.save_pretrained(output_dir)  # config.json + model.safetensors
        tokenizer.save_pretrained(output_dir)

    # ------------------------------------------------------------------------- evaluation
    hang_dump.phase("evaluation")
    # The whole validation set, each block once, in every mode; perplexity = exp(mean token loss).
    loss_sum, num_tokens, num_blocks = (math.nan, 1, 0) if args.skip_eval else evaluate()
    eval_loss = loss_sum / num_tokens
    accelerator.print(
        f"eval/loss {eval_loss:.4f} eval/perplexity {math.exp(eval_loss):.2f} "
        f"({num_blocks} blocks, {num_tokens} predicted tokens)"
    )
    sample = None
    if accelerator.is_main_process and args.sample_tokens > 0:
        # Greedy, so the test can regenerate the same text from the saved folder.
        final_model.eval()
        prompt_ids = tokenizer(args.sample_prompt, return_tensors="pt").input_ids.to(accelerator.device)
        if parallelism.name == "fsdp":
            final_model.to(accelerator.device)
        with torch.no_grad():
            generated = final_model.generate(
                prompt_ids, max_new_tokens=args.sample_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        sample = tokenizer.decode(generated[0], skip_special_tokens=False)
        accelerator.print(f"sample (greedy, {args.sample_tokens} tokens):\n{sample}")
    results.update(
        {
            "recipe": "train_lm",
            "parallelism": parallelism.name,
            "parallelism_requested": args.parallelism,
            **run_facts(accelerator),  # num_processes, distributed_type, distributed/backend, device
            "num_stages": num_stages,
            "blocks_per_stage": blocks_per_stage,
            "stage_cost_share": [cost / sum(stage_costs) for cost in stage_costs],
            "device_map_devices": [str(device) for device in split_over],
            "device_map": {name: str(device) for name, device in device_map.items()} if device_map else None,
            # The execution device of the AlignDevicesHook on every planned module: the split really is hooked.
            "device_map/hooks": execution_devices(accelerator.unwrap_model(model), device_map) if device_map else None,
            "mixed_precision": accelerator.mixed_precision,
            "model/num_parameters": num_parameters,
            "data/corpus": corpus,
            "data/train_blocks": len(train_dataset),
            "data/validation_blocks": len(eval_dataset),
            "data/tokens": token_counts,
            "global_batch_size": global_batch_size,
            "tokens_per_step": tokens_per_step,
            "completed_steps": completed_steps,
            "resumed_from_step": resume.completed_steps,
            "train/loss": loss_curve[-1] if loss_curve else None,
            "train/loss_curve": loss_curve,
            "eval/loss": eval_loss,
            "eval/perplexity": math.exp(eval_loss),
            "eval/num_blocks": num_blocks,
            "eval/num_tokens": num_tokens,
            "sample/prompt": args.sample_prompt,
            "sample/text": sample,
            **perf,
            "config": config,
        }
    )
    write_results(accelerator, output_dir, results)
    accelerator.print(f"wrote {output_dir / 'results.json'} and the model to {output_dir}")
    # Sync point: no process tears down its connections while another is still writing results (a peer that exits
    # early can make gloo abort the main process at exit, seen on 127.0.0.1).
    accelerator.wait_for_everyone()
    # Drop the DDP wrapper while the process group still exists: a gloo group destroyed first can deadlock in the DDP
    # reducer's destructor at interpreter exit (seen with torch 2.13 on CPU).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()


if __name__ == "__main__":
    main()
