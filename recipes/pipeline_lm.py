"""A GPT-style language model split across two devices: naive device_map split vs true pipeline parallelism.

The usual tutorial says model parallelism "makes full use of both GPUs' parallel compute". A naive
split does not: blocks 0..k run on GPU 0 while GPU 1 waits, then GPU 1 runs the rest while GPU 0
waits, so at any moment one device works. Pipelining cuts each batch into m micro-batches and lets
stage 0 start micro-batch 2 while stage 1 runs micro-batch 1; the idle share per device falls from
(p-1)/p to (p-1)/(m+p-1). This recipe trains the same model on the same data four ways and measures:

- ``ddp``        2 processes, a full replica each, each trains on its shard of every batch;
- ``device_map`` 1 process, decoder blocks split over the devices, balanced by compute (embeddings
                 on the first, LM head + loss on the last, both counted), Accelerate's hooks move
                 the activations: the naive split;
- ``pipeline``   2 processes, one stage each, ``torch.distributed.pipelining`` (GPipe or 1F1B) over
                 m micro-batches; both stages read the same batches (the data loader is not sharded);
- ``single``     1 process, 1 device, unsplit: what ``auto`` picks for a 1-process, 1-device config;
- ``fsdp``       2 processes, data parallel like ddp, but each holds 1/2 of every parameter, gradient
                 and optimizer state (FSDP2 ``fully_shard`` per decoder block, through Accelerate):
                 for models whose training state does not fit on one device.

``--parallelism auto`` follows the launch config: an FSDP config -> fsdp, 2 processes -> ddp, 1
process that sees >= 2 GPUs -> device_map, otherwise single. On a CPU-only machine every mode runs:
device_map splits over two CPU "devices" with the same code, pipeline and fsdp use 2 gloo processes
(fsdp really sharded, see shared/fsdp.py), and each process uses one thread (one core stands in for
one GPU), so the speed comparison is fair.

Launch (from the repository root):
    # CPU smoke run, or one GPU (single):
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/pipeline_lm.py --model_size tiny --max_train_steps 20 --corpus_max_mb 1
    # two GPUs, data parallel (on a CPU-only machine: 2 processes over gloo, same command):
    accelerate launch --config_file accelerate_configs/ddp_2gpu.yaml recipes/pipeline_lm.py --model_size 125m
    # two GPUs, one process, naive split (on CPU add --parallelism device_map: two CPU "devices"):
    accelerate launch --config_file accelerate_configs/model_sharding_2gpu.yaml recipes/pipeline_lm.py --model_size 1.3b
    # two GPUs, pipeline with 8 micro-batches (on CPU: 2 gloo processes, same command):
    accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml recipes/pipeline_lm.py --parallelism pipeline --model_size 1.3b --num_microbatches 8
    # two GPUs, fully sharded (FSDP2), with activation recomputation (on CPU: 2 gloo processes, really sharded):
    accelerate launch --config_file accelerate_configs/fsdp_2gpu.yaml recipes/pipeline_lm.py --model_size 1.3b --gradient_checkpointing

Writes to ``output_dir``: the model in Hugging Face format (``model.safetensors``, config, the
tokenizer; pipeline stages and FSDP shards are gathered into one), ``results.json`` (losses,
``eval/perplexity``, throughput, peak memory per device or stage, model-state bytes per process, the
ideal bubble fraction, the resolved config) and, with ``--checkpointing_steps``, resumable checkpoints
in ``checkpoints/step_N`` (pipeline stages save their own; FSDP processes each write their shard).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, get_scheduler

# The helper module lives in ../shared in this repository; in your own project put shared/ next to
# this file (found first) or one folder up.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from shared import (  # noqa: E402
    RecipeError,
    ThroughputMeter,
    build_accelerator,
    choose_placement,
    model_state_bytes_per_rank,
    positive_float,
    positive_int,
    prepare_output_dir,
    write_results,
)
from shared.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from shared.fsdp import check_fsdp_request, sharding_per_rank, wrap_at_blocks  # noqa: E402
from shared.lm_data import load_text_corpus, tokenize_and_pack, train_bpe_tokenizer  # noqa: E402
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
from shared.pipelining import (  # noqa: E402
    build_stage_module,
    causal_lm_loss,
    check_pipeline_model,
    clip_grad_norm_across_stages,
    gather_full_state_dict,
    ideal_bubble_fraction,
    load_stage_checkpoint,
    pipeline_split_of,
    save_stage_checkpoint,
)

# Llama-architecture shapes by name (tiny for tests, small for CPU, GPT-3's 125m/350m/1.3b): one
# table in shared/model_presets.py, which the fit planner (python -m shared.plan) reads too.
from shared.model_presets import MODEL_PRESETS  # noqa: E402
from shared.flops import lm_flops_per_token  # noqa: E402
from shared.hang_dump import HangDump  # noqa: E402
from shared.runtime import run_facts  # noqa: E402

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default="outputs/pipeline_lm", help="Where the model, results.json and checkpoints go (created if missing).")
    parser.add_argument("--seed", type=int, default=42, help="Seed for the initial weights and the data order (the same in every mode).")
    parser.add_argument(
        "--parallelism", choices=["auto", "ddp", "device_map", "pipeline", "fsdp"], default="auto",
        help="auto follows the launch config (FSDP config: fsdp; 2 processes: ddp; 1 process seeing >= 2 GPUs: device_map; "
             "else single). device_map needs 1 process, ddp and pipeline need 2 or more, fsdp needs accelerate_configs/fsdp_2gpu.yaml.",
    )
    parser.add_argument("--gradient_checkpointing", action="store_true",
                        help="Recompute each decoder block's activations in backward instead of keeping them: less memory, ~1/3 more compute.")
    parser.add_argument("--pipeline_schedule", choices=sorted(SCHEDULES), default="1f1b",
                        help="Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (same bubble, fewer live activations).")
    parser.add_argument("--num_microbatches", type=positive_int, default=4,
                        help="Pipeline mode: micro-batches per batch; the batch must divide evenly. More means a smaller bubble but smaller matmuls.")
    parser.add_argument("--model_size", choices=list(MODEL_PRESETS), default="small", help="Model shape when training from scratch (ignored with --model_name_or_path).")
    parser.add_argument("--num_layers", type=positive_int, default=None, help="Override the preset's number of decoder blocks.")
    parser.add_argument("--model_name_or_path", default=None,
                        help="Start from pretrained weights (a Hub id or a folder this recipe saved); its tokenizer is used if it has one.")
    parser.add_argument("--vocab_size", type=positive_int, default=8192, help="Vocabulary of the byte-level BPE tokenizer trained on the training text.")
    parser.add_argument("--dataset_name", default=None, help="A Hub dataset with a text column (needs internet). Default: the offline standard-library corpus.")
    parser.add_argument("--dataset_config_name", default=None, help="The Hub dataset's configuration name, if it has several.")
    parser.add_argument("--train_file", default=None, help="A text file to train on (one example per line, line breaks kept).")
    parser.add_argument("--validation_file", default=None, help="A text file to validate on (default: the last --validation_split_percentage of --train_file).")
    parser.add_argument("--validation_split_percentage", type=positive_float, default=5,
                        help="Share held out for validation when there is no validation split (default corpus: every k-th file).")
    parser.add_argument("--corpus_max_mb", type=positive_float, default=None,
                        help="Use only the first N MB of the default corpus (files in sorted order), for quick runs. Default: all of it (~11 MB).")
    parser.add_argument("--block_size", type=positive_int, default=256, help="Tokens per training sequence (texts are packed into blocks of this length).")
    parser.add_argument("--max_train_samples", type=positive_int, default=None, help="Use only the first N training blocks.")
    parser.add_argument("--max_eval_samples", type=positive_int, default=None, help="Use only the first N validation blocks.")
    parser.add_argument("--per_device_train_batch_size", type=positive_int, default=16,
                        help="Blocks per process per forward pass (pipeline: per batch, split into --num_microbatches).")
    parser.add_argument("--per_device_eval_batch_size", type=positive_int, default=None, help="Blocks per evaluation batch (default: the training batch size).")
    parser.add_argument("--gradient_accumulation_steps", type=positive_int, default=1, help="Batches per optimizer step.")
    parser.add_argument("--num_epochs", type=positive_int, default=1, help="Passes over the training set (ignored if --max_train_steps is set).")
    parser.add_argument("--max_train_steps", type=positive_int, default=None, help="Stop after this many optimizer steps.")
    parser.add_argument("--learning_rate", type=positive_float, default=1e-3, help="Peak AdamW learning rate.")
    parser.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay (matrices only; norms and biases are not decayed).")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="Clip the global gradient norm to this (0: no clipping).")
    parser.add_argument("--lr_scheduler_type", default="cosine", choices=["linear", "cosine", "constant", "constant_with_warmup"], help="Learning-rate schedule.")
    parser.add_argument("--num_warmup_steps", type=int, default=0, help="Linear learning-rate warm-up, in optimizer steps.")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="Override the config's mixed precision (bf16 also works on CPU; fp16 needs a GPU and is not supported in pipeline mode).")
    parser.add_argument("--checkpointing_steps", type=positive_int, default=None, help="Save a resumable checkpoint to output_dir/step_N every N optimizer steps.")
    parser.add_argument("--resume_from_checkpoint", default=None,
                        help="A step_N folder to resume from, or 'latest' for the newest one in --output_dir (starts fresh if there is none).")
    parser.add_argument("--save_on_each_node", action="store_true",
                        help="Machines without a shared disk: every machine saves its own copy of each checkpoint.")
    parser.add_argument("--dist_timeout", type=float, default=600,
                        help="Seconds a collective or pipeline send/recv may wait for another process before the run fails.")
    parser.add_argument("--eval_before_training", action="store_true", help="Also measure validation perplexity before the first step.")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (inductor, via Accelerate's dynamo_backend) in single, ddp and fsdp modes; "
                             "attention already uses PyTorch's SDPA kernels (transformers' default).")
    parser.add_argument("--skip_eval", action="store_true", help="Skip the final evaluation (eval/* are NaN): benchmarks that measure training speed only.")
    parser.add_argument("--perf_warmup_steps", type=int, default=2, help="Optimizer steps left out of the throughput numbers (start-up, first-call costs).")
    parser.add_argument("--cpu_threads_per_process", type=int, default=1,
                        help="On CPU: PyTorch threads per process (1 = one core stands in for one GPU, fair comparisons; 0 = PyTorch's default).")
    parser.add_argument("--sample_prompt", default="def ", help="Prompt for the short greedy sample printed at the end.")
    parser.add_argument("--sample_tokens", type=int, default=24, help="Tokens to generate for the sample (0: no sample).")
    return parser.parse_args(argv)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (linear and embedding weights), none on norms/biases."""
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return [
        {"params": [parameter for parameter in parameters if parameter.ndim >= 2], "weight_decay": weight_decay},
        {"params": [parameter for parameter in parameters if parameter.ndim < 2], "weight_decay": 0.0},
    ]


def check_parallelism(args, parallelism: str, num_processes: int, eval_batch_size: int, mixed_precision: str) -> None:
    """Refuse flag combinations that cannot work, before any data or model work.

    Flags that contradict each other fail first, then flags that contradict the launch config.
    """
    microbatches = args.num_microbatches
    if parallelism == "pipeline":
        for flag, size in (("--per_device_train_batch_size", args.per_device_train_batch_size),
                           ("--per_device_eval_batch_size", eval_batch_size)):
            if size % microbatches:
                raise RecipeError(
                    f"{flag} {size} does not divide into --num_microbatches {microbatches}: every micro-batch must "
                    f"have the same shape (pipeline stages exchange fixed-size buffers). Use a batch size that is a "
                    f"multiple of {microbatches}, e.g. {microbatches * max(1, round(size / microbatches))}."
                )
        if mixed_precision == "fp16":
            raise RecipeError("fp16 needs a gradient scaler shared by all stages, which pipeline mode does not set up; "
                              "use --mixed_precision bf16.")
    if parallelism == "pipeline" and num_processes < 2:
        raise RecipeError(
            f"--parallelism pipeline runs one stage per process, but this launch has {num_processes} process. "
            "Launch it with 2 processes: accelerate launch --config_file accelerate_configs/pipeline_2gpu.yaml "
            "recipes/pipeline_lm.py --parallelism pipeline (on a CPU-only machine too: 2 gloo processes)."
        )
    if parallelism == "device_map" and num_processes > 1:
        raise RecipeError(
            f"--parallelism device_map splits the model inside one process, but this launch has {num_processes} "
            "processes, and Accelerate refuses to train a device_map model in a distributed mode (each process would "
            "also hold its own split copy). Launch it with 1 process: accelerate launch --config_file "
            "accelerate_configs/model_sharding_2gpu.yaml recipes/pipeline_lm.py (on a CPU-only machine add "
            "--parallelism device_map). For 2 processes use --parallelism pipeline or ddp."
        )
    if parallelism == "ddp" and num_processes < 2:
        raise RecipeError("--parallelism ddp needs 2 or more processes: launch with accelerate_configs/ddp_2gpu.yaml.")
    if parallelism == "pipeline" and args.pipeline_schedule == "1f1b" and microbatches < num_processes:
        raise RecipeError(f"--pipeline_schedule 1f1b needs --num_microbatches >= the number of stages ({num_processes}); "
                          f"got {microbatches}.")


def evaluate_replica(accelerator, model, eval_dataloader) -> tuple[float, int, int]:
    """Summed next-token loss, tokens and blocks over the whole validation set (single/ddp/device_map).

    Per-block sums go through ``gather_for_metrics``, which drops the samples the sharded loader
    repeats to give every process a full last batch, so each block counts exactly once.
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


def evaluate_pipeline(accelerator, schedule, stage, eval_dataloader, batch_size: int) -> tuple[float, int, int]:
    """The same sums in pipeline mode: every stage reads the whole (unsharded) validation set.

    Stages exchange fixed-shape buffers, so a short last batch is padded to ``batch_size`` with
    copies of its first block whose labels are -100 (ignored by the loss and not counted). Only the
    last stage sees the loss; a sum-reduce (the other stages add zero) gives it to every process.
    """
    stage.submod.eval()
    loss_sum = torch.zeros((), device=accelerator.device)
    num_tokens, num_blocks = 0, 0
    for batch in eval_dataloader:
        input_ids = batch["input_ids"]
        labels = input_ids.clone()
        real = input_ids.shape[0]
        if real < batch_size:
            filler = input_ids[:1].expand(batch_size - real, -1)
            input_ids = torch.cat([input_ids, filler])
            labels = torch.cat([labels, torch.full_like(filler, -100)])
        losses = []
        with torch.no_grad(), accelerator.autocast():
            schedule.eval(*((input_ids,) if stage.is_first else ()), target=labels if stage.is_last else None,
                          losses=losses if stage.is_last else None, loss_kwargs={"divisor": 1.0})
        if stage.is_last:
            loss_sum += torch.stack(losses).sum().float()
        num_tokens += real * (input_ids.shape[1] - 1)
        num_blocks += real
    loss_sum = accelerator.reduce(loss_sum, reduction="sum")
    return loss_sum.item(), num_tokens, num_blocks


def main():
    # ----------------------------------------------------------------------------- arguments
    args = parse_args()

    # ------------------------------------------------------------------ Accelerator and seed
    # (This Accelerator block repeats in every recipe on purpose: each recipe is one file you can
    # copy, and reads top to bottom without a jump into a helper that hides its settings.)
    # build_accelerator passes cpu=True when there is no CUDA, so a 2-process config joins over gloo
    # instead of starting two silent independent runs, and checks the process count.
    # Hang dumps: if a collective times out or a rank stops making progress, every rank that can still run writes
    # its stacks, step and collective to output_dir/debug/. Started first: NCCL reads its settings at start-up.
    hang_dump = HangDump(Path(args.output_dir) / "debug", args.dist_timeout)
    accelerator = build_accelerator(
        # Bounds every collective and pipeline send/recv: a dead or hung stage ends the run after
        # this long with an error naming the operation, instead of the backend's 10-30 minutes.
        dist_timeout=args.dist_timeout,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # --compile: prepare() wraps the model in torch.compile (None keeps ACCELERATE_DYNAMO_BACKEND's choice).
        dynamo_backend="inductor" if args.compile else None,
        # A seedable sampler with a fixed data seed shuffles identically in every mode and process
        # count: what makes the modes comparable batch-for-batch.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        project_config=ProjectConfiguration(project_dir=args.output_dir, save_on_each_node=args.save_on_each_node),
    )
    set_seed(args.seed)
    output_dir = prepare_output_dir(args.output_dir)
    if accelerator.device.type == "cpu" and args.cpu_threads_per_process > 0:
        # One core per process stands in for one GPU: without this, one process of a naive split
        # would use every core while each pipeline stage shares them, and the comparison would lie.
        torch.set_num_threads(args.cpu_threads_per_process)

    placement = choose_placement(accelerator)
    parallelism = placement.name if args.parallelism == "auto" else args.parallelism
    num_processes = accelerator.num_processes
    microbatches = args.num_microbatches if parallelism == "pipeline" else 1
    eval_batch_size = args.per_device_eval_batch_size or args.per_device_train_batch_size
    check_parallelism(args, parallelism, num_processes, eval_batch_size, accelerator.mixed_precision)
    if args.compile and parallelism in ("pipeline", "device_map"):
        raise RecipeError(f"--compile works on the model that prepare() wraps whole (single, ddp, fsdp), not on {parallelism}'s split model.")
    # fsdp needs the FSDP launch config and 2+ processes; that config is not combined with other modes.
    check_fsdp_request(accelerator, parallelism, "recipes/pipeline_lm.py")
    # ddp and fsdp are both data parallel: each process trains on its shard of every global batch.
    data_parallel = parallelism in ("ddp", "fsdp")
    # device_map: a device list that is [cuda:0, cuda:1] on a 2-GPU box and [cpu, cpu] on a CPU-only
    # machine; the split and activation moves below are the same code for both.
    split_over = split_devices(accelerator.device) if parallelism == "device_map" else []
    num_stages = {"pipeline": num_processes, "device_map": len(split_over)}.get(parallelism, 1)
    accelerator.print(f"placement: {parallelism} (launch config: {placement.reason})")
    if parallelism == "device_map" and len(set(split_over)) == 1:
        accelerator.print(f"placement: splitting over {len(split_over)} {split_over[0].type} \"devices\" that are one device: "
                          "the same code as on 2 GPUs, not faster")

    # Model shape first: bad sizes fail here, before any data work.
    if args.model_name_or_path:
        model_config = AutoConfig.from_pretrained(args.model_name_or_path)
    else:
        preset = dict(MODEL_PRESETS[args.model_size])
        if args.num_layers:
            preset["num_hidden_layers"] = args.num_layers
        # Untied LM head: the embeddings live on the first stage and the head on the last.
        model_config = LlamaConfig(**preset, num_key_value_heads=preset["num_attention_heads"],
                                   vocab_size=args.vocab_size, tie_word_embeddings=False)
    if args.block_size > model_config.max_position_embeddings:
        raise RecipeError(
            f"--block_size {args.block_size} is longer than the model's {model_config.max_position_embeddings} "
            "positions (max_position_embeddings). Use --block_size "
            f"{model_config.max_position_embeddings} or less."
        )
    if parallelism == "pipeline" and check_pipeline_model(model_config):
        raise RecipeError(f"Cannot split this model into pipeline stages: {check_pipeline_model(model_config)}.")
    if model_config.num_hidden_layers < num_stages:
        raise RecipeError(
            f"The model has {model_config.num_hidden_layers} decoder layers but {parallelism} needs at least one per "
            f"stage ({num_stages} stages). Use a model with more layers (--num_layers {num_stages} or more) or fewer stages."
        )

    # Checkpoints as in the other recipes: output_dir/checkpoints/step_N, complete once progress.json
    # is written; "latest" skips incomplete ones and starts fresh when there is none yet.
    checkpoints_dir = output_dir / "checkpoints"
    checkpoint = find_checkpoint(accelerator, args.resume_from_checkpoint, checkpoints_dir)  # every process agrees on it
    # Three checkpoint layouts: pipeline stages' own files, FSDP shards (save_state writes the model as a
    # torch.distributed.checkpoint folder, pytorch_model_fsdp_0), and whole-model files (the other modes).
    checkpoint_kind = None if checkpoint is None else (
        "pipeline" if pipeline_split_of(checkpoint) is not None else "fsdp" if (checkpoint / "pytorch_model_fsdp_0").is_dir() else "replica")
    if checkpoint is not None and checkpoint_kind != (parallelism if parallelism in ("pipeline", "fsdp") else "replica"):
        written_by = {"pipeline": "pipeline stages", "fsdp": "FSDP shards (accelerator.save_state under fsdp)",
                      "replica": "accelerator.save_state (ddp, device_map or single)"}[checkpoint_kind]
        raise RecipeError(
            f"{checkpoint} was written by {written_by} and cannot be resumed with --parallelism {parallelism}. Resume "
            "it in the mode that wrote it, or start a new run from its run's saved model (--model_name_or_path)."
        )

    # ------------------------------------------------------------------------------- data
    # main_process_first: the main process downloads/reads, trains the tokenizer and tokenizes
    # (datasets caches the results); the others then load the tokenizer it saved and hit the cache.
    with accelerator.main_process_first():
        try:
            raw_datasets, corpus, documents = load_text_corpus(
                dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
                train_file=args.train_file, validation_file=args.validation_file,
                validation_split_percentage=args.validation_split_percentage, corpus_max_mb=args.corpus_max_mb,
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
                raise RecipeError(f"--model_name_or_path {args.model_name_or_path} has no loadable tokenizer ({error}); "
                                  "a pretrained model needs the tokenizer it was trained with.") from None
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
    # drop_last: every batch has the same shape, which pipeline stages need; the same in all modes
    # so that the modes see the same batches.
    train_dataloader = DataLoader(train_dataset, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True)
    eval_dataloader = DataLoader(eval_dataset, batch_size=eval_batch_size)
    batches_needed = (num_processes if data_parallel else 1) * args.gradient_accumulation_steps
    if len(train_dataloader) < batches_needed:
        raise RecipeError(
            f"One optimizer step needs {batches_needed * args.per_device_train_batch_size} blocks of {args.block_size} "
            f"tokens but the training set has {len(train_dataset)} ({token_counts['train']} tokens). Use more text, "
            "a smaller --block_size, --per_device_train_batch_size or --gradient_accumulation_steps."
        )
    accelerator.print(f"data: {corpus}: {len(train_dataset)} train / {len(eval_dataset)} validation blocks of "
                      f"{args.block_size} tokens, vocabulary {len(tokenizer)}")

    # ------------------------------------------------------------------------------ model
    if not args.model_name_or_path:
        # The trained vocabulary can be smaller than --vocab_size on a small corpus; its one special
        # token both starts and ends texts (and is never a pad id, which would freeze its embedding).
        model_config.vocab_size = len(tokenizer)
        model_config.bos_token_id = model_config.eos_token_id = tokenizer.eos_token_id
    # Re-seeded here so every process and every mode starts from identical weights.
    set_seed(args.seed)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=model_config)
    else:
        model = AutoModelForCausalLM.from_config(model_config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    # One plan for both kinds of split: whole decoder blocks, balanced by estimated compute, with the
    # embeddings on the first part and the final norm + LM head (+ loss) on the last.
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
            f"as {head_cost:.1f} blocks): " + "; ".join(
                f"stage {part}: {text} ({cost / sum(stage_costs):.0%})" for part, (text, cost) in enumerate(zip(split, stage_costs)))
        )
    else:
        accelerator.print(f"model: {num_parameters / 1e6:.1f}M parameters, {len(model.get_submodule(block_list))} decoder blocks, unsplit")

    if args.gradient_checkpointing:
        # Before the split, the stage build and prepare() (FSDP wraps the blocks): each decoder block
        # then recomputes its activations in backward. use_reentrant=False: the reentrant version
        # runs backward outside autograd's view of the block, which breaks DDP (a parameter "used
        # twice" or "unused" error) and needs an input that requires grad; the non-reentrant one works
        # in every mode here (single, ddp, device_map, pipeline, fsdp) and gives the same gradients.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    stage = None
    device_map = None
    if parallelism == "device_map":
        model, device_map = dispatch_on_devices(model, plan, split_over)
    elif parallelism == "pipeline":
        stage_index = accelerator.process_index
        # Keep this stage's blocks (plus embeddings on the first, norm + head on the last), drop the rest.
        model = build_stage_module(model, block_ranges(blocks_per_stage)[stage_index], stage_index, num_stages)
        model.to(accelerator.device)

    # ------------------------------------------------------------------ optimizer and scheduler
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.learning_rate, betas=(0.9, 0.95))
    # Batches each process sees per epoch: ddp's prepared loader gives each process every
    # num_processes-th batch (drop_last: whole rounds only). accumulate() also steps on the last,
    # shorter group of an epoch, hence the ceiling division.
    batches_per_epoch = len(train_dataloader) // (num_processes if data_parallel else 1)
    steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    # A prepared scheduler steps once per process per optimizer step (it assumes every process saw
    # its own batch), so its length is counted in process-steps; in pipeline mode it is not prepared.
    scheduler_steps = 1 if parallelism == "pipeline" else num_processes
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps * scheduler_steps,
                                 num_training_steps=max_train_steps * scheduler_steps)

    # ------------------------------------------------------------------------------ prepare
    if parallelism != "pipeline":
        # ddp: wraps the model in DDP and shards the data loaders. fsdp: shards the model instead
        # (fully_shard on every decoder block, then the rest) and points the optimizer at the shards,
        # so each process's AdamW state covers only its 1/N. device_map: the model keeps its
        # placement (prepare reads hf_device_map). single: moves it to the device.
        if parallelism == "fsdp":
            accelerator.print(f"fsdp: one unit per {wrap_at_blocks(accelerator, model, block_list) or 'configured block'}")
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
    else:
        # Pipeline mode drives torch.distributed.pipelining itself, because prepare() would do three
        # wrong things here: wrap the stage in DDP (all-reducing gradients between *different*
        # halves of the model), shard the data loader (both stages must see the same batches: the
        # first reads the tokens, the last the labels) and step the scheduler once per process.
        # The data loaders still get Accelerate's seedable sampler and device placement, unsharded.
        train_dataloader, eval_dataloader = (
            prepare_data_loader(loader, device=accelerator.device, num_processes=1, process_index=0, put_on_device=True,
                                use_seedable_sampler=True, data_seed=args.seed)
            for loader in (train_dataloader, eval_dataloader)
        )
        # The stage's input/output shapes are inferred on the first step (that needs numpy), and
        # gradients are scaled by the loss below rather than by the schedule: scale_grads=True would
        # divide *all* accumulated gradients by m after every step(), so with gradient accumulation
        # the earlier batches would be divided again.
        stage = PipelineStage(model, stage_index=accelerator.process_index, num_stages=num_stages, device=accelerator.device)
        schedule = SCHEDULES[args.pipeline_schedule](stage, n_microbatches=microbatches, loss_fn=causal_lm_loss, scale_grads=False)

    # tokens per optimizer step = batch x sequence length x accumulation x data-parallel processes
    # (pipeline stages share their batch, so they count once).
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * (num_processes if data_parallel else 1)
    tokens_per_step = global_batch_size * args.block_size
    config = {
        **vars(args), "parallelism_resolved": parallelism, "num_processes": num_processes, "num_stages": num_stages,
        "global_batch_size": global_batch_size, "tokens_per_step": tokens_per_step, "max_train_steps_resolved": max_train_steps,
        "blocks_per_stage": blocks_per_stage, "model_config": model_config.to_diff_dict(),
        "devices": [str(device) for device in split_over] or [str(accelerator.device)],
        "cpu_threads": torch.get_num_threads() if accelerator.device.type == "cpu" else None,
    }
    accelerator.print("config: " + json.dumps(config, sort_keys=True, default=str))

    load_state = None
    if checkpoint is not None and parallelism == "pipeline":
        if pipeline_split_of(checkpoint) != blocks_per_stage:
            raise RecipeError(f"{checkpoint} holds stages of {pipeline_split_of(checkpoint)} blocks but this run splits "
                              f"{blocks_per_stage}: resume with the same model, --block_size and number of processes.")
        # Each stage loads its own weights, optimizer, scheduler and RNG state.
        load_state = lambda folder: load_stage_checkpoint(folder, accelerator.process_index, model, optimizer, lr_scheduler)  # noqa: E731
    # Restores the model, optimizer, scheduler, the sampler's seed and every process's RNG states.
    resume = load_checkpoint(accelerator, checkpoint, steps_per_epoch, args.gradient_accumulation_steps, load_state=load_state)
    completed_steps, starting_epoch, resume_batches = resume.completed_steps, resume.epoch, resume.batches_to_skip

    def evaluate():
        if parallelism == "pipeline":
            return evaluate_pipeline(accelerator, schedule, stage, eval_dataloader, eval_batch_size)
        return evaluate_replica(accelerator, model, eval_dataloader)

    results = {}
    if args.eval_before_training:
        loss_sum, num_tokens, _ = evaluate()
        results["eval/perplexity_before_training"] = math.exp(loss_sum / num_tokens)
        accelerator.print(f"before training: eval/perplexity {results['eval/perplexity_before_training']:.2f}")

    # ---------------------------------------------------------------------- training loop
    meter = ThroughputMeter(accelerator, warmup_steps=args.perf_warmup_steps,
                            devices=sorted(set(split_over), key=str) or [accelerator.device])
    loss_curve = []  # mean training loss of each optimizer step
    step_loss = torch.zeros((), device=accelerator.device)
    log_every = max(1, max_train_steps // 10)
    # Pipeline loss normalisation: each micro-batch returns its summed token losses divided by the
    # predicted tokens of the whole optimizer step, (batch / m) x (block - 1) x m x accumulation, so
    # the micro-batch losses of a step add up to its mean, as accelerator.backward's 1/accumulation does.
    pipeline_divisor = args.per_device_train_batch_size * (args.block_size - 1) * args.gradient_accumulation_steps
    for epoch in range(starting_epoch, num_epochs):
        model.train()
        # Explicit epoch: the shuffling seed is data_seed + epoch, also in the skipping loader below.
        train_dataloader.set_epoch(epoch)
        active_dataloader = train_dataloader
        if epoch == starting_epoch and resume_batches:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_batches)
        for batch in meter.timed(active_dataloader):  # timed: measures the wait for each batch
            input_ids = batch["input_ids"]
            # accumulate() decides when a step ends (every gradient_accumulation_steps batches, or at the
            # end of the data loader) and skips DDP's all-reduce until then; it also serves pipeline mode,
            # where there is nothing to all-reduce and the stage's optimizer steps on the same batches.
            with accelerator.accumulate(model):
                if parallelism == "pipeline":
                    losses = []
                    with accelerator.autocast():
                        # One call runs all micro-batches through both stages (forward and backward) in
                        # the schedule's order; the first stage feeds tokens, the last computes the loss.
                        schedule.step(*((input_ids,) if stage.is_first else ()), target=input_ids if stage.is_last else None,
                                      losses=losses if stage.is_last else None, loss_kwargs={"divisor": pipeline_divisor})
                    if stage.is_last:
                        step_loss += torch.stack(losses).sum().detach().float()
                else:
                    loss = model(input_ids=input_ids, labels=input_ids).loss
                    step_loss += loss.detach().float() / args.gradient_accumulation_steps
                    accelerator.backward(loss)  # divides by gradient_accumulation_steps
                if accelerator.sync_gradients:
                    if args.max_grad_norm > 0:
                        if parallelism == "pipeline":
                            clip_grad_norm_across_stages(model.parameters(), args.max_grad_norm, accelerator.device)
                        else:
                            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                # Sync point (.item()): ddp averages the processes' losses; in pipeline mode only the
                # last stage has it and the others add zero.
                loss_curve.append(accelerator.reduce(step_loss, reduction="sum" if parallelism == "pipeline" else "mean").item())
                step_loss.zero_()
                meter.step(samples=global_batch_size, tokens=tokens_per_step)
                hang_dump.step(completed_steps)
                if completed_steps % log_every == 0 or completed_steps == max_train_steps:
                    accelerator.print(f"epoch {epoch} step {completed_steps}/{max_train_steps} train/loss {loss_curve[-1]:.4f} "
                                      f"lr {lr_scheduler.get_last_lr()[0]:.2e}")
                if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                    if parallelism == "pipeline":
                        save_stage_checkpoint(accelerator, checkpoints_dir, completed_steps, model, optimizer, lr_scheduler, blocks_per_stage)
                    else:
                        save_checkpoint(accelerator, checkpoints_dir, completed_steps)
            if completed_steps >= max_train_steps:
                break
        if completed_steps >= max_train_steps:
            break
    # Collective: every process calls it. With the training FLOPs per token, MFU on CUDA against the GPU's peak.
    perf = meter.summary(flops_per_token=lm_flops_per_token(model_config.hidden_size, model_config.num_hidden_layers,
                                                            model_config.vocab_size, num_parameters, args.block_size))
    # Exact bytes of parameters + gradients + optimizer state per process (a stage's own in pipeline mode).
    perf["memory/model_state_bytes"] = model_state_bytes_per_rank(accelerator, model, optimizer)
    if parallelism == "fsdp":
        # Proof of sharding, per process: DTensor parameters, elements held vs the whole model's, FSDP modules.
        perf["fsdp/sharding"] = sharding_per_rank(accelerator, model)

    # ------------------------------------------------------------------------- evaluation
    hang_dump.phase("evaluation")
    # The whole validation set, each block once, in every mode; perplexity = exp(mean token loss).
    loss_sum, num_tokens, num_blocks = (math.nan, 1, 0) if args.skip_eval else evaluate()
    eval_loss = loss_sum / num_tokens
    accelerator.print(f"eval/loss {eval_loss:.4f} eval/perplexity {math.exp(eval_loss):.2f} "
                      f"({num_blocks} blocks, {num_tokens} predicted tokens)")

    # ------------------------------------------------------------------------------- save
    hang_dump.phase("saving")
    accelerator.wait_for_everyone()
    if parallelism in ("pipeline", "fsdp"):
        # Each stage holds different weights (pipeline), each process 1/N of every weight (fsdp): gather
        # them into one full model on the main process. Both are collectives: every process calls them.
        full_state_dict = gather_full_state_dict(model) if parallelism == "pipeline" else accelerator.get_state_dict(model)
        final_model = None
        if accelerator.is_main_process:
            final_model = AutoModelForCausalLM.from_config(model_config)
            final_model.load_state_dict(full_state_dict, strict=True)  # strict: every weight came from a stage or shard
    else:
        final_model = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        final_model.save_pretrained(output_dir)  # config.json + model.safetensors
        tokenizer.save_pretrained(output_dir)
    sample = None
    if accelerator.is_main_process and args.sample_tokens > 0:
        # Greedy, so the test can regenerate the same text from the saved folder.
        final_model.eval()
        prompt_ids = tokenizer(args.sample_prompt, return_tensors="pt").input_ids.to(accelerator.device)
        if parallelism in ("pipeline", "fsdp"):
            final_model.to(accelerator.device)
        with torch.no_grad():
            generated = final_model.generate(prompt_ids, max_new_tokens=args.sample_tokens, do_sample=False,
                                             pad_token_id=tokenizer.pad_token_id)
        sample = tokenizer.decode(generated[0], skip_special_tokens=False)
        accelerator.print(f"sample (greedy, {args.sample_tokens} tokens):\n{sample}")
    results.update({
        "recipe": "pipeline_lm",
        "parallelism": parallelism,
        "parallelism_requested": args.parallelism,
        "pipeline_schedule": args.pipeline_schedule if parallelism == "pipeline" else None,
        "num_microbatches": microbatches,
        # (p-1)/(m+p-1): m = 1 for the naive split (one device works at a time), 0 without a split.
        "pipeline/ideal_bubble_fraction": ideal_bubble_fraction(num_stages, microbatches),
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
    })
    write_results(accelerator, output_dir, results)
    accelerator.print(f"wrote {output_dir / 'results.json'} and the model to {output_dir}")
    # Sync point: no process tears down its connections while another is still writing results
    # (a peer that exits early can make gloo abort the main process at exit, seen on 127.0.0.1).
    accelerator.wait_for_everyone()
    # Drop the DDP wrapper while the process group still exists: a gloo group destroyed first can
    # deadlock in the DDP reducer's destructor at interpreter exit (as in transformer_finetune.py).
    model, optimizer, lr_scheduler = accelerator.free_memory(model, optimizer, lr_scheduler)
    accelerator.end_training()


if __name__ == "__main__":
    main()
