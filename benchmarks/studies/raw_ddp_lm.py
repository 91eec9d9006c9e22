"""The raw baseline: ``recipes/train_lm.py``'s ddp mode written in plain PyTorch, no Accelerate.

Same model (the recipe's presets, Llama architecture, untied head), same data (the offline corpus,
the same BPE tokenizer, packed blocks), same batch per process, same fused AdamW, groups and betas, cosine
schedule, gradient clipping and per-step loss all-reduce (read every step, as most hand-written loops do: a sync
point; the recipe reads its losses every 10 steps), so that
``overhead = recipe step time / raw step time`` measures what Accelerate's wrappers cost per step.
Launched with torchrun (``benchmarks/run.py`` does this):

    torchrun --standalone --nproc_per_node 2 benchmarks/studies/raw_ddp_lm.py --model_size small --max_train_steps 6 \\
        --output_dir outputs/raw_ddp_lm

On CPU the processes join over gloo with one thread each (``--cpu_threads_per_process``); on GPUs
each process takes ``cuda:LOCAL_RANK`` and joins over NCCL. Writes ``OUTPUT_DIR/results.json`` with
the recipe's perf keys (``perf/samples_per_sec``, ``perf/tokens_per_sec``, ``perf/step_time_s``,
``perf/step_time_p90_s``, ``perf/data_wait_fraction``, ``memory/peak_gib``). The only difference
that remains is the data order: ``DistributedSampler`` deals samples to the processes, Accelerate
deals whole batches; every step still trains on ``processes x batch`` blocks of the same length.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, get_scheduler

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes"))  # the LM recipes' kit, lm_kit/
from lm_kit.data import load_text_corpus, tokenize_and_pack, train_bpe_tokenizer
from lm_kit.model import optimizer_groups
from shared.presets import MODEL_PRESETS
from shared.results import peak_memory_gib, percentile


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where results.json (and the tokenizer) go.")
    parser.add_argument("--seed", type=int, default=42, help="Seed for the weights and the data order.")
    parser.add_argument(
        "--model_size", choices=list(MODEL_PRESETS), default="small", help="The recipe's model preset."
    )
    parser.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary trained on the corpus.")
    parser.add_argument(
        "--corpus_max_mb", type=float, default=None, help="Use only the first N MB of the default corpus."
    )
    parser.add_argument("--block_size", type=int, default=256, help="Tokens per sequence.")
    parser.add_argument("--max_train_samples", type=int, default=None, help="Use only the first N training blocks.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=16, help="Blocks per process per step.")
    parser.add_argument("--max_train_steps", type=int, required=True, help="Optimizer steps to run.")
    parser.add_argument("--perf_warmup_steps", type=int, default=2, help="Steps left out of the throughput numbers.")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="Peak AdamW learning rate.")
    parser.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay on matrices.")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="Gradient clipping (0: none).")
    parser.add_argument(
        "--mixed_precision",
        choices=["no", "bf16"],
        default="no",
        help="bf16 autocast, as the recipe's --mixed_precision bf16.",
    )
    parser.add_argument(
        "--cpu_threads_per_process",
        type=int,
        default=1,
        help="On CPU: PyTorch threads per process (0: PyTorch's default).",
    )
    return parser.parse_args(argv)


def main():
    args = parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if args.cpu_threads_per_process > 0:
            torch.set_num_threads(args.cpu_threads_per_process)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    # Data: rank 0 trains the tokenizer and tokenizes first (datasets caches it); the others follow.
    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            raw, corpus, documents = load_text_corpus(
                dataset_name=None,
                dataset_config_name=None,
                train_file=None,
                validation_file=None,
                validation_split_percentage=5,
                corpus_max_mb=args.corpus_max_mb,
            )
            if rank == 0:
                tokenizer = train_bpe_tokenizer((row["text"] for row in raw["train"]), vocab_size=args.vocab_size)
                tokenizer.save_pretrained(output_dir)
            else:
                tokenizer = AutoTokenizer.from_pretrained(output_dir)
            packed, _ = tokenize_and_pack(raw, tokenizer, args.block_size, documents)
        dist.barrier()
    train_dataset = packed["train"]
    if args.max_train_samples:
        train_dataset = train_dataset.select(range(min(args.max_train_samples, len(train_dataset))))
    train_dataset.set_format("torch", columns=["input_ids"])
    sampler = DistributedSampler(
        train_dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    train_dataloader = DataLoader(
        train_dataset, batch_size=args.per_device_train_batch_size, sampler=sampler, drop_last=True
    )

    # Model: the recipe's preset and config, the same seed before building it.
    preset = dict(MODEL_PRESETS[args.model_size])
    model_config = LlamaConfig(
        **preset,
        num_key_value_heads=preset["num_attention_heads"],
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config).to(device)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    groups = optimizer_groups(model, args.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=True)  # as the recipe
    lr_scheduler = get_scheduler(
        "cosine", optimizer=optimizer, num_warmup_steps=0, num_training_steps=args.max_train_steps
    )

    global_batch_size = args.per_device_train_batch_size * world_size
    tokens_per_step = global_batch_size * args.block_size
    step_times, data_waits, loss_curve = [], [], []
    completed_steps, epoch = 0, 0
    model.train()
    last = time.perf_counter()
    while completed_steps < args.max_train_steps:
        sampler.set_epoch(epoch)
        iterator = iter(train_dataloader)
        while completed_steps < args.max_train_steps:
            wait_start = time.perf_counter()
            batch = next(iterator, None)
            if batch is None:
                break
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            waited = time.perf_counter() - wait_start
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16"):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()  # DDP all-reduces the gradients here
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            # The recipe's per-step sync: the mean loss over processes, read on the host.
            reduced = loss.detach().float()
            dist.all_reduce(reduced)
            loss_curve.append(reduced.item() / world_size)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            completed_steps += 1
            if completed_steps > args.perf_warmup_steps:
                step_times.append(now - last)
                data_waits.append(waited)
            last = now
        epoch += 1

    measured = sum(step_times)
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_memory_gib([device]))
    results = {
        "recipe": "raw_ddp_lm",
        "parallelism": "ddp",
        "num_processes": world_size,
        "device": str(device),
        "mixed_precision": args.mixed_precision,
        "model/num_parameters": num_parameters,
        "data/corpus": corpus,
        "global_batch_size": global_batch_size,
        "tokens_per_step": tokens_per_step,
        "completed_steps": completed_steps,
        "train/loss": loss_curve[-1] if loss_curve else None,
        "train/loss_curve": loss_curve,
        "perf/measured_steps": len(step_times),
        "perf/step_time_s": statistics.median(step_times) if step_times else None,
        "perf/step_time_p90_s": percentile(step_times, 90),
        "perf/samples_per_sec": global_batch_size * len(step_times) / measured if measured else None,
        "perf/tokens_per_sec": tokens_per_step * len(step_times) / measured if measured else None,
        # The work of a step, as the recipes' results.json give it: compare.py compares only runs of equal work.
        "perf/samples_per_step": global_batch_size,
        "perf/tokens_per_step": tokens_per_step,
        "perf/data_wait_fraction": sum(data_waits) / measured if measured else None,
        "memory/peak_gib": {
            f"rank{r}/{name}": round(gib, 4) for r, peak in enumerate(peaks) for name, gib in peak.items()
        },
        "config": {
            **vars(args),
            "num_processes": world_size,
            "global_batch_size": global_batch_size,
            "tokens_per_step": tokens_per_step,
            "model_config": model_config.to_dict(),
            "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        },
    }
    if rank == 0:
        (output_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        print(
            f"raw ddp: {results['perf/tokens_per_sec'] or 0:.0f} tokens/s, step "
            f"{results['perf/step_time_s'] or 0:.3f} s; wrote {output_dir / 'results.json'}"
        )
    dist.barrier()
    del model  # drop the DDP reducer while the process group exists (gloo can hang at exit otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
