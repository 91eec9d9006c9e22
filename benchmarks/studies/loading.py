"""What loading a model for FSDP2 training costs each process, measured two ways (one subcommand each).

    python benchmarks/studies/loading.py qlora --output_dir benchmarks/results/cpu-qlora-loading   # ~15 min, 2 cores
    python benchmarks/studies/loading.py qlora --preset tiny --output_dir /tmp/qlora-loading   # a 1-minute rehearsal
    # Llama-3.2-1B's shape untied (a 128k vocabulary: the embeddings and head are a third of the model), the loader
    # alone against the planner's load peak:
    python benchmarks/studies/loading.py qlora --preset 1b-128k --loaders layer_by_layer --skip_recipe \\
        --output_dir benchmarks/results/cpu-qlora-loading-128k/after
    python benchmarks/studies/loading.py low_ram --output_dir outputs/low_ram_loading --repeats 3

``qlora``: QLoRA under FSDP2, loaded within each card: the memory that loading adds per process, for the
layer-by-layer loader (``recipes/llm_kit/sharded_4bit.py``, what ``recipes/llm_finetune.py`` uses under an FSDP
config) beside
the whole-model loader it replaced (``from_pretrained`` quantizing the whole model where it loads it), under
``fsdp_2gpu.yaml`` and ``fsdp_offload_2gpu.yaml``, in 2 processes, on a Llama-shaped model made here (1.1B parameters,
TinyLlama's shape, bf16 safetensors, random weights). Then the recipe itself, QLoRA in 1 process and in 2 under each
FSDP config: the losses and the adapters must be equal. Writes ``OUTPUT_DIR/qlora_loading.json`` and ``summary.md``.

What is counted, per process: on CUDA, ``torch.cuda.max_memory_allocated`` from the start of loading to the end of
``accelerator.prepare`` (the device's tensors); on the CPU, where the "device" is host RAM, the growth of the process's
peak resident set size (``ru_maxrss``) over the same span: every tensor (4-bit shards, the layer being read, the
adapter, the embeddings) plus, on the main process, the pages of the safetensors file it maps while reading. Beside
them: the model's size in 4 bits (its 4-bit weights at 0.5 B each, the rest in the load dtype) and in 16 bits, and
the fit planner's load peak for this shape on 2 GPUs (``tools/planner``, without its 1 GiB CUDA overhead): on the CPU
the shards, the quantization constants and the tensor in flight all live in host RAM, as on a GPU they live there.

``low_ram``: peak host RAM of loading a model for FSDP2 training, with and without low-RAM loading, side by side.
Launches ``recipes/llm_finetune.py`` (LoRA, one optimizer step) under ``accelerate_configs/fsdp_2gpu.yaml`` twice per
round: as it is (every process reads the whole checkpoint) and with ``fsdp_cpu_ram_efficient_loading: true`` (the
main process reads it, the others start on the meta device and receive their shards in ``prepare``). Each run's
``memory/host_peak_gib`` is its processes' peak RSS; the sum over the processes is what the machine needs. The
model is a Llama of the ``--model_size`` preset shape (random weights, fp32, saved once in OUTPUT_DIR/model), large
enough that its weights dominate the processes' RSS. Writes ``OUTPUT_DIR/low_ram_loading.json`` and prints a table.
Rounds alternate A B A B.

Both records carry the machine (CPU model and flags, RAM, GPUs) and library versions. Never part of the test command.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "recipes")]  # lib/, shared/ and tools/, the kits
from lib.launch import accelerate_launch, launch_and_wait
from lib.machine import library_versions, machine_info  # CPU model and flags, RAM, GPUs: as every record

# ------------------------------------------------------------------------------ qlora
PRESETS = {
    # TinyLlama-1.1B's shape: 1,100M parameters.
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    # meta-llama/Llama-3.2-1B's shape with an untied head: 1,498M parameters, 526M of them embeddings and head.
    "1b-128k": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}
CONFIGS = ("fsdp_2gpu.yaml", "fsdp_offload_2gpu.yaml")
GIB = 2**30


def make_model(folder: Path, preset: str) -> dict:
    """A Llama-shaped model with random bf16 weights, a small BPE tokenizer and a few texts, saved in ``folder``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: its standard-library questions
    from harness.questions import stdlib_questions
    from lm_kit.data import train_bpe_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    questions = stdlib_questions()["train"].select(range(64))
    texts = [row["messages"][-2]["content"] + " " + row["messages"][-1]["content"] for row in questions]
    tokenizer = train_bpe_tokenizer(iter(texts), vocab_size=400)  # the model's vocabulary may be larger
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        **PRESETS[preset],
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    datasets.Dataset.from_list([{"text": text} for text in texts]).to_parquet(str(folder / "texts.parquet"))
    linear = sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    )
    total = sum(p.numel() for p in model.parameters())
    return {
        "parameters": total,
        "four_bit_weights": linear,
        "bytes_16bit": 2 * total,
        "bytes_4bit": linear // 2 + 2 * (total - linear),
        "planner_load_peak_bytes": planner_load_peak(folder),
    }


def planner_load_peak(folder: Path) -> int:
    """The planner's load peak per GPU for QLoRA under fsdp_2gpu.yaml (bf16, LoRA r 8 on every linear layer as the
    worker's), without the CUDA overhead, which a CPU process does not have."""
    from tools.planner.fits import plan
    from tools.planner.shapes import read_config, shape_from_config

    shape = shape_from_config(read_config(str(folder)), name=str(folder))
    result = plan(shape, 2, 80, 32, 1, "bf16", overhead_gib=0, method="qlora", host_ram_gib=64, advise=False)
    return result["setups"]["fsdp"]["gpu_load_peak"]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if platform.system() == "Darwin" else 1024)


def worker(args) -> None:
    """One process of a launch: load the QLoRA model the way ``--loader`` says, prepare it, write what it took."""
    import torch
    from accelerate.utils import ProjectConfiguration
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from shared.fsdp import set_keep_gathered_in_one_process, set_wrap_at_blocks
    from shared.model_split import find_block_list
    from shared.accelerator import build_accelerator
    from shared.fsdp import set_fsdp_on_cpu
    from llm_kit.loading import empty_4bit_model
    from llm_kit.sharded_4bit import load_4bit_sharded

    accelerator = build_accelerator(
        mixed_precision="bf16", project_config=ProjectConfiguration(project_dir=str(args.output_dir))
    )
    set_fsdp_on_cpu(accelerator)  # CPU + FSDP config: Accelerate's state set back to FSDP2 (cpu=True drops it)
    set_keep_gathered_in_one_process(accelerator)  # FSDP in 1 process: no resharding after forward, as the recipe
    torch.set_num_threads(1)
    dtype = torch.bfloat16
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )
    config = AutoConfig.from_pretrained(args.model)
    cuda = accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    device_before = torch.cuda.memory_allocated(accelerator.device) if cuda else 0
    rss_before, start = peak_rss(), time.perf_counter()
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    if args.loader == "layer_by_layer":
        model = empty_4bit_model(config, quantization, dtype)
        model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False), lora)
        load_4bit_sharded(accelerator, model, str(args.model))
    else:  # what the recipe did before: the whole model quantized on this process's device, then sharded
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, quantization_config=quantization, device_map={"": str(accelerator.device)}
        )
        model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False), lora)
    set_wrap_at_blocks(accelerator, model, find_block_list(model, set(model._no_split_modules)))
    model = accelerator.prepare(model)
    seconds = time.perf_counter() - start
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())
    facts = {
        "rank": accelerator.process_index,
        "loader": args.loader,
        "device": str(accelerator.device),
        "load_seconds": seconds,
        "held_bytes": local,
        "peak_growth_bytes": (torch.cuda.max_memory_allocated(accelerator.device) - device_before)
        if cuda
        else peak_rss() - rss_before,
        "counted": "cuda max_memory_allocated" if cuda else "host peak RSS (ru_maxrss)",
    }
    (args.output_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(facts))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def recipe_run(model: Path, config: str, processes: int, output_dir: Path, batch: int) -> dict:
    """The recipe, QLoRA, fp32 compute (bf16 is 10x slower on CPUs without bf16 instructions), 2 steps."""
    argv = [
        str(REPO / "recipes" / "llm_finetune.py"),
        "--model_name_or_path",
        str(model),
        "--train_file",
        str(model / "texts.parquet"),
        "--load_in_4bit",
        "--max_train_steps",
        "2",
        "--lora_dropout",
        "0",
        "--adam_epsilon",
        "1e-4",
        "--max_length",
        "32",
        "--skip_eval",
        "--per_device_train_batch_size",
        str(batch),
        "--output_dir",
        str(output_dir),
        "--overwrite_output_dir",
    ]  # a rerun replaces its runs
    return launch_and_wait(accelerate_launch(config, "--num_processes", str(processes)) + argv, output_dir)


def qlora(args) -> None:
    """The ``qlora`` subcommand: each loader under each FSDP config, then the recipe in 1 and 2 processes."""
    from safetensors.torch import load_file

    args.output_dir.mkdir(parents=True, exist_ok=True)
    model = args.output_dir / "model"
    sizes = make_model(model, args.preset)
    print(
        f"model: {sizes['parameters'] / 1e9:.2f}B parameters, {sizes['bytes_16bit'] / GIB:.2f} GiB in 16 bits, "
        f"{sizes['bytes_4bit'] / GIB:.2f} GiB in 4 bits",
        flush=True,
    )
    loading = {}
    for config in CONFIGS:
        for loader in args.loaders:
            folder = args.output_dir / "loading" / f"{config.removesuffix('.yaml')}-{loader}"
            folder.mkdir(parents=True, exist_ok=True)
            worker = [__file__, "qlora", "--output_dir", str(folder), "--model", str(model), "--loader", loader]
            command = accelerate_launch(config, "--num_processes", "2") + worker
            launch_and_wait(command, folder, results_name="rank0.json")  # (rank 1's file is read beside it)
            ranks = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]
            loading[f"{config}/{loader}"] = ranks
            shown = [
                f"rank {r['rank']} +{r['peak_growth_bytes'] / GIB:.2f} GiB ({r['load_seconds']:.0f} s)" for r in ranks
            ]
            print(f"{config} {loader}: " + ", ".join(shown), flush=True)
    runs, adapters = {}, {}
    for config, processes in [] if args.skip_recipe else [("single_gpu.yaml", 1), *((c, 2) for c in CONFIGS)]:
        name = "single" if processes == 1 else config.removesuffix(".yaml")
        runs[name] = recipe_run(model, config, processes, args.output_dir / f"recipe-{name}", batch=3 - processes)
        adapters[name] = load_file(args.output_dir / f"recipe-{name}" / "adapter_model.safetensors")
    equal = {}
    for name in runs:
        if name != "single":
            difference = max(
                float((adapters[name][key] - value).abs().max() / value.abs().max().clamp_min(1e-12))
                for key, value in adapters["single"].items()
            )
            losses = [
                abs(a - b) / abs(b) for a, b in zip(runs[name]["train/loss_curve"], runs["single"]["train/loss_curve"])
            ]
            equal[name] = {
                "adapter_max_relative_difference": difference,
                "loss_max_relative_difference": max(losses),
                "losses": runs[name]["train/loss_curve"],
            }
    record = {
        "benchmark": "qlora_loading",
        "preset": args.preset,
        "model": sizes,
        "loading": loading,
        "recipe_losses_single": runs["single"]["train/loss_curve"] if runs else None,
        "recipe_equal_to_one_process": equal,
        "machine": machine_info(),
        "versions": library_versions(),
    }
    (args.output_dir / "qlora_loading.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["| config | loader | rank 0 | rank 1 | held after prepare (rank 0) |", "| --- | --- | --- | --- | --- |"]
    for key, ranks in loading.items():
        config, loader = key.split("/")
        lines.append(
            f"| {config} | {loader} | +{ranks[0]['peak_growth_bytes'] / GIB:.2f} GiB | "
            f"+{ranks[1]['peak_growth_bytes'] / GIB:.2f} GiB | {ranks[0]['held_bytes'] / GIB:.2f} GiB |"
        )
    recipe = (
        "The recipe, 2 processes against 1: "
        + "; ".join(
            f"{name}: losses within {facts['loss_max_relative_difference']:.1e}, adapter within "
            f"{facts['adapter_max_relative_difference']:.1e}"
            for name, facts in equal.items()
        )
        + "\n"
    )
    summary = (
        f"# QLoRA loading under FSDP2: {sizes['parameters'] / 1e9:.2f}B parameters, "
        f"{sizes['bytes_16bit'] / GIB:.2f} GiB in 16 bits, {sizes['bytes_4bit'] / GIB:.2f} GiB in 4 bits\n\n"
        f"Peak memory that loading adds per process ({loading[next(iter(loading))][0]['counted']}), against "
        f"the planner's load peak per GPU, {sizes['planner_load_peak_bytes'] / GIB:.2f} GiB (its CUDA overhead "
        "aside):\n\n" + "\n".join(lines) + "\n\n" + (recipe if equal else "")
    )
    (args.output_dir / "summary.md").write_text(summary)
    print(summary)
    if not args.keep_model:
        for path in model.iterdir():
            path.unlink()
        model.rmdir()


# ------------------------------------------------------------------------------ low_ram
def low_ram_model(folder: Path, model_size: str) -> Path:
    """The preset's Llama with a BPE tokenizer trained on the offline chat data, saved once in fp32."""
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: its standard-library questions
    from harness.questions import stdlib_questions
    from lm_kit.data import train_bpe_tokenizer
    from shared.presets import MODEL_PRESETS

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


def low_ram_run(config: Path, model: Path, out: Path) -> dict:
    """One launch of the recipe, LoRA, one optimizer step: each process's peak RSS and their sum."""
    command = [
        *accelerate_launch(str(config)),
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
    results = launch_and_wait(command, out, threads=1)
    host = results["memory/host_peak_gib"]
    # (Which process read the checkpoint is observed by tests/test_llm_finetune.py's low-RAM test, not recorded here.)
    return {"per_rank_gib": host, "sum_gib": sum(host.values())}


def low_ram(args) -> None:
    """The ``low_ram`` subcommand: the recipe under fsdp_2gpu.yaml as it is and with low-RAM loading, A B rounds."""
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model = low_ram_model(output_dir / "model", args.model_size)
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
                "every_process_loads": low_ram_run(plain, model, output_dir / f"plain_r{index}"),
                "main_process_loads": low_ram_run(efficient, model, output_dir / f"low_ram_r{index}"),
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
        "versions": library_versions(),
    }
    (output_dir / "low_ram_loading.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"checkpoint {checkpoint_gib:.2f} GiB; median peak RSS summed over 2 processes: "
        + ", ".join(f"{kind} {gib:.2f} GiB" for kind, gib in summary["median_sum_gib"].items())
        + "; rank 1 alone: "
        + ", ".join(f"{kind} {gib:.2f} GiB" for kind, gib in summary["median_rank1_gib"].items())
    )


# ------------------------------------------------------------------------------ main
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    measurements = parser.add_subparsers(dest="measurement", required=True)
    qlora_parser = measurements.add_parser("qlora", help="QLoRA under FSDP2: the two loaders, then the recipe.")
    qlora_parser.add_argument("--output_dir", type=Path, required=True, help="Where the record and summary go.")
    qlora_parser.add_argument("--preset", choices=list(PRESETS), default="1b", help="The model's shape.")
    qlora_parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)  # (worker)
    loaders = ["layer_by_layer", "whole_model"]
    qlora_parser.add_argument("--loader", choices=loaders, help=argparse.SUPPRESS)  # (worker)
    qlora_parser.add_argument("--keep_model", action="store_true", help="Keep the model made in output_dir/model.")
    qlora_parser.add_argument(
        "--loaders",
        nargs="+",
        choices=["layer_by_layer", "whole_model"],
        default=["layer_by_layer", "whole_model"],
        help="The loaders to measure.",
    )
    qlora_parser.add_argument(
        "--skip_recipe", action="store_true", help="Measure loading only, without the recipe's 1- and 2-process runs."
    )
    low_ram_parser = measurements.add_parser("low_ram", help="Peak host RAM with and without low-RAM loading.")
    low_ram_parser.add_argument(
        "--output_dir", type=Path, required=True, help="Where the model, the runs and low_ram_loading.json go."
    )
    low_ram_parser.add_argument("--model_size", default="350m", help="A preset of shared/presets.py (random weights).")
    low_ram_parser.add_argument("--repeats", type=int, default=3, help="A B rounds.")
    args = parser.parse_args(argv)
    if args.measurement == "low_ram":
        low_ram(args)
    elif args.loader:  # one process of a qlora launch
        worker(args)
    else:
        qlora(args)


if __name__ == "__main__":
    main()
