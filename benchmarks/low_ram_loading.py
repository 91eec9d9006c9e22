"""Peak host RAM of loading a model for FSDP2 training, with and without low-RAM loading, measured side by side.

    python benchmarks/low_ram_loading.py --output_dir outputs/low_ram_loading

Launches ``recipes/llm_finetune.py`` (LoRA, one optimizer step) under ``accelerate_configs/fsdp_2gpu.yaml`` twice per
round: as it is (every process reads the whole checkpoint) and with ``fsdp_cpu_ram_efficient_loading: true`` (the
main process reads it, the others start on the meta device and receive their shards in ``prepare``). Each run's
``memory/host_peak_gib`` is its processes' peak RSS; the sum over the processes is what the machine needs. The
model is a Llama of the ``--model_size`` preset shape (random weights, fp32, saved once in OUTPUT_DIR/model), large
enough that its weights dominate the processes' RSS. Writes ``OUTPUT_DIR/low_ram_loading.json`` and prints a table.
Rounds alternate A B A B; the machine's CPU model is recorded. Never part of the test command.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "recipes"))  # the recipes' kits (llm_kit/, lm_kit/)
sys.path.insert(0, str(REPO / "benchmarks"))
from run import machine_info  # noqa: E402  (CPU model and flags, RAM, GPUs: the same record as the runner's)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where the model, the runs and low_ram_loading.json go.")
    parser.add_argument("--model_size", default="350m", help="A preset of recipes/lm_kit/presets.py (random weights).")
    parser.add_argument("--repeats", type=int, default=3, help="A B rounds.")
    return parser.parse_args(argv)


def build_model(folder: Path, model_size: str) -> Path:
    """The preset's Llama with a BPE tokenizer trained on the offline chat data, saved once in fp32."""
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llm_kit.sft_data import stdlib_questions
    from lm_kit.data import train_bpe_tokenizer
    from lm_kit.presets import MODEL_PRESETS

    questions = stdlib_questions()
    tokenizer = train_bpe_tokenizer((m["content"] for row in questions["train"] for m in row["messages"]), 8192)
    tokenizer.save_pretrained(folder)
    preset = MODEL_PRESETS[model_size]
    config = LlamaConfig(
        **preset,
        num_key_value_heads=preset["num_attention_heads"],
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def run(config: Path, model: Path, out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        str(REPO / "recipes" / "llm_finetune.py"),
        "--model_name_or_path",
        str(model),
        "--max_train_steps",
        "1",
        "--per_device_train_batch_size",
        "1",
        "--max_length",
        "64",
        "--max_train_samples",
        "16",
        "--max_eval_samples",
        "2",
        "--skip_eval",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",  # a rerun of this benchmark replaces its runs
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(command)}):\n{done.stdout[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    host = results["memory/host_peak_gib"]
    # (Which process read the checkpoint is observed by tests/test_llm_finetune.py's low-RAM test, not recorded here.)
    return {"per_rank_gib": host, "sum_gib": sum(host.values())}


def main(argv=None) -> int:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(output_dir / "model", args.model_size)
    plain = REPO / "accelerate_configs" / "fsdp_2gpu.yaml"
    efficient = output_dir / "fsdp_2gpu_low_ram.yaml"
    efficient.write_text(
        plain.read_text().replace("fsdp_cpu_ram_efficient_loading: false", "fsdp_cpu_ram_efficient_loading: true")
    )
    if efficient.read_text() == plain.read_text():
        raise SystemExit(f"{plain} no longer says fsdp_cpu_ram_efficient_loading: false; update this benchmark")
    rounds = []
    for index in range(args.repeats):
        rounds.append(
            {
                "every_process_loads": run(plain, model, output_dir / f"plain_r{index}"),
                "main_process_loads": run(efficient, model, output_dir / f"low_ram_r{index}"),
            }
        )
        print(
            f"round {index}: every process loads {rounds[-1]['every_process_loads']['sum_gib']:.2f} GiB, "
            f"main process loads {rounds[-1]['main_process_loads']['sum_gib']:.2f} GiB (sum over the processes)"
        )
    checkpoint_gib = (model / "model.safetensors").stat().st_size / 2**30
    summary = {
        "model_size": args.model_size,
        "checkpoint_gib": checkpoint_gib,
        "rounds": rounds,
        "median_sum_gib": {kind: statistics.median(r[kind]["sum_gib"] for r in rounds) for kind in rounds[0]},
        "median_rank1_gib": {
            kind: statistics.median(r[kind]["per_rank_gib"]["rank1"] for r in rounds) for kind in rounds[0]
        },
        "machine": machine_info(),
        "python": platform.python_version(),
    }
    (output_dir / "low_ram_loading.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"checkpoint {checkpoint_gib:.2f} GiB; median peak RSS summed over 2 processes: "
        + ", ".join(f"{kind} {gib:.2f} GiB" for kind, gib in summary["median_sum_gib"].items())
        + "; rank 1 alone: "
        + ", ".join(f"{kind} {gib:.2f} GiB" for kind, gib in summary["median_rank1_gib"].items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
