"""Do the recipes still compute what they computed? Fingerprints of a fixed set of launches, compared.

A change that only moves code (a restructure, a rename) must leave every recipe's results as they were. This
launches each recipe under each config it supports, at tiny sizes with fixed seeds, and keeps what a run
produces: the per-step loss curve, the evaluation metrics and a hash (plus a float64 sum) of every saved tensor.

    python tools/same_results.py record before.json        # on the code before the change
    python tools/same_results.py record after.json         # after it
    python tools/same_results.py compare before.json after.json

``compare`` prints each difference (a loss to the last digit, a tensor by name with both sums) and exits 1 if
there is any. Timings and memory are left out: they differ from run to run. The tiny causal LM that the LLM
launches fine-tune is built here from transformers' own Llama config, so the check needs nothing from the project.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LM_TINY = (
    "--model_size",
    "tiny",
    "--corpus_max_mb",
    "0.5",
    "--vocab_size",
    "512",
    "--block_size",
    "32",
    "--max_train_steps",
    "4",
    "--per_device_train_batch_size",
    "8",
    "--gradient_accumulation_steps",
    "2",
    "--per_device_eval_batch_size",
    "4",
    "--max_eval_samples",
    "13",
    "--sample_tokens",
    "8",
)
ENCODER_TINY = (
    "--max_train_samples",
    "64",
    "--max_eval_samples",
    "37",
    "--max_length",
    "32",
    "--per_device_train_batch_size",
    "8",
    "--per_device_eval_batch_size",
    "8",
    "--max_train_steps",
    "4",
    "--logging_steps",
    "2",
)
LLM_TINY = (
    "--max_train_steps",
    "3",
    "--max_length",
    "96",
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "4",
    "--max_eval_samples",
    "8",
    "--exact_match_samples",
    "2",
    "--learning_rate",
    "1e-3",
)


def launches(base: Path) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Name -> (config, recipe, arguments): each recipe under each config it supports."""
    llm = ("--model_name_or_path", str(base), *LLM_TINY)
    grpo = ("--model_name_or_path", str(base), "--max_train_steps", "4", "--per_device_train_batch_size", "8")
    grpo += ("--num_generations", "4", "--max_completion_length", "6", "--beta", "0.1", "--num_iterations", "2")
    grpo += ("--learning_rate", "1e-3", "--max_eval_samples", "8", "--exact_match_samples", "2")
    return {
        "linear_toy/single": ("single_gpu.yaml", "linear_toy.py", ("--max_train_steps", "5")),
        "linear_toy/ddp": ("ddp_2gpu.yaml", "linear_toy.py", ("--max_train_steps", "5")),
        "linear_toy/model_sharding": ("model_sharding_2gpu.yaml", "linear_toy.py", ("--max_train_steps", "5")),
        "transformer_finetune/single": ("single_gpu.yaml", "transformer_finetune.py", ENCODER_TINY),
        "transformer_finetune/ddp": ("ddp_2gpu.yaml", "transformer_finetune.py", ENCODER_TINY),
        "transformer_finetune/fsdp_lora": (
            "fsdp_2gpu.yaml",
            "transformer_finetune.py",
            (*ENCODER_TINY, "--lora_r", "4"),
        ),
        "transformer_finetune/device_map": (
            "model_sharding_2gpu.yaml",
            "transformer_finetune.py",
            (*ENCODER_TINY, "--parallelism", "device_map"),
        ),
        "train_lm/single": ("single_gpu.yaml", "train_lm.py", LM_TINY),
        "train_lm/ddp": ("ddp_2gpu.yaml", "train_lm.py", LM_TINY),
        "train_lm/fsdp": ("fsdp_2gpu.yaml", "train_lm.py", LM_TINY),
        "train_lm/fsdp_offload": ("fsdp_offload_2gpu.yaml", "train_lm.py", LM_TINY),
        "train_lm/device_map": ("model_sharding_2gpu.yaml", "train_lm.py", (*LM_TINY, "--parallelism", "device_map")),
        "pipeline_lm/1f1b": ("pipeline_2gpu.yaml", "pipeline_lm.py", (*LM_TINY, "--pipeline_schedule", "1f1b")),
        "llm_finetune/single_lora": ("single_gpu.yaml", "llm_finetune.py", llm),
        "llm_finetune/ddp_lora": ("ddp_2gpu.yaml", "llm_finetune.py", (*llm, "--per_device_train_batch_size", "2")),
        "llm_finetune/fsdp_lora": ("fsdp_2gpu.yaml", "llm_finetune.py", (*llm, "--per_device_train_batch_size", "2")),
        "llm_finetune/fsdp_offload_lora": (
            "fsdp_offload_2gpu.yaml",
            "llm_finetune.py",
            (*llm, "--per_device_train_batch_size", "2"),
        ),
        "llm_finetune/device_map_lora": ("model_sharding_2gpu.yaml", "llm_finetune.py", llm),
        "llm_finetune/single_qlora": ("single_gpu.yaml", "llm_finetune.py", (*llm, "--load_in_4bit")),
        "llm_finetune/single_full": (
            "single_gpu.yaml",
            "llm_finetune.py",
            (*llm, "--full_finetune", "--learning_rate", "1e-4"),
        ),
        # DPO on the offline preference pairs; RPO's term on, so that both parts of the loss are fingerprinted.
        "dpo/single_lora": ("single_gpu.yaml", "dpo.py", (*llm, "--rpo_alpha", "0.5")),
        "dpo/ddp_lora": (
            "ddp_2gpu.yaml",
            "dpo.py",
            (*llm, "--rpo_alpha", "0.5", "--per_device_train_batch_size", "2"),
        ),
        "dpo/fsdp_lora": (
            "fsdp_2gpu.yaml",
            "dpo.py",
            (*llm, "--rpo_alpha", "0.5", "--per_device_train_batch_size", "2"),
        ),
        "dpo/fsdp_offload_full": (
            "fsdp_offload_2gpu.yaml",
            "dpo.py",
            (*llm, "--full_finetune", "--learning_rate", "1e-4", "--per_device_train_batch_size", "2"),
        ),
        # GRPO on the offline prompts: sampled completions (its own seeded noise), the KL term and 2 steps per round.
        "grpo/single_lora": ("single_gpu.yaml", "grpo.py", grpo),
        "grpo/ddp_lora": ("ddp_2gpu.yaml", "grpo.py", (*grpo, "--per_device_train_batch_size", "4")),
        "grpo/fsdp_lora": ("fsdp_2gpu.yaml", "grpo.py", (*grpo, "--per_device_train_batch_size", "4")),
        # The split layout: rank 1 generates each round one ahead, rank 0 trains on the last one.
        "grpo/split_lora": ("ddp_2gpu.yaml", "grpo.py", (*grpo, "--generation_mode", "split")),
    }


def build_tiny_llm(folder: Path) -> Path:
    """A 4-block Llama (hidden 64) with a byte-level BPE tokenizer trained on a few sentences, saved to ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    sentences = [f"Question {i}: what is {i} plus {i}? Answer: {2 * i}." for i in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        sentences,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def tensor_fingerprints(output_dir: Path) -> dict[str, list]:
    """Every tensor of every safetensors file the run saved at its top level: name -> [sha256, float64 sum]."""
    import torch
    from safetensors.torch import load_file

    found = {}
    for path in sorted(output_dir.glob("*.safetensors")):
        for name, tensor in sorted(load_file(path).items()):
            data = tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes()
            found[f"{path.name}:{name}"] = [hashlib.sha256(data).hexdigest()[:16], tensor.double().sum().item()]
    return found


def fingerprint(name: str, config: str, recipe: str, args: tuple[str, ...], root: Path) -> dict:
    output_dir = root / name.replace("/", "_")
    command = [
        "accelerate",
        "launch",
        "--config_file",
        str(REPO / "accelerate_configs" / config),
        str(REPO / "recipes" / recipe),
        *args,
        "--output_dir",
        str(output_dir),
        "--seed",
        "0",
    ]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if run.returncode != 0:
        return {"failed": (run.stdout + run.stderr)[-3000:]}
    results = json.loads((output_dir / "results.json").read_text())
    kept = {key: value for key, value in results.items() if key.startswith(("train/loss", "eval/"))}
    return {"results": kept, "tensors": tensor_fingerprints(output_dir)}


def record(path: Path, only: list[str]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        base = build_tiny_llm(root / "tiny_llm")
        found = {}
        for name, (config, recipe, args) in launches(base).items():
            if only and not any(name.startswith(prefix) for prefix in only):
                continue
            found[name] = fingerprint(name, config, recipe, args, root)
            print(f"{name}: {'FAILED' if 'failed' in found[name] else 'ok'}", flush=True)
    path.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


def same(a, b) -> bool:
    """Equal to the last digit; NaN (a metric a run does not compute, e.g. exact match under FSDP) equals NaN."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def compare(before: dict, after: dict) -> list[str]:
    differences = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or new is None:
            differences.append(f"{name}: only in {'after' if old is None else 'before'}")
            continue
        if "failed" in old or "failed" in new:
            if "failed" in new:
                differences.append(f"{name}: failed after:\n{new['failed']}")
            continue
        for key in sorted(set(old["results"]) | set(new["results"])):
            if not same(old["results"].get(key), new["results"].get(key)):
                differences.append(f"{name} {key}: {old['results'].get(key)} -> {new['results'].get(key)}")
        for key in sorted(set(old["tensors"]) | set(new["tensors"])):
            if old["tensors"].get(key) != new["tensors"].get(key):
                differences.append(f"{name} {key}: {old['tensors'].get(key)} -> {new['tensors'].get(key)}")
    return differences


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="launch the fixed set and write the fingerprints to PATH")
    recording.add_argument("path", type=Path)
    recording.add_argument("--only", nargs="*", default=[], help="launch names starting with these (e.g. train_lm)")
    comparing = commands.add_parser("compare", help="print every difference between two records; exit 1 if any")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.path, args.only)
        return
    differences = compare(json.loads(args.before.read_text()), json.loads(args.after.read_text()))
    print("\n".join(differences) if differences else "equal: every loss, metric and saved tensor")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()
