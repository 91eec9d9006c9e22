"""recipes/llm_finetune.py against TRL's SFTTrainer, measured side by side: same model, data, LoRA, schedule and loss.

    python benchmarks/studies/vs_trl.py --output_dir benchmarks/results/cpu-vs-trl   # CPU, ~10 min on 2 cores
    python benchmarks/studies/vs_trl.py --preset cpu-tiny --output_dir outputs/vs_trl_tiny   # the tests' tiny Llama
    python benchmarks/studies/vs_trl.py --config_file ddp_2gpu.yaml --output_dir outputs/vs_trl_ddp   # 2 processes
    python benchmarks/studies/vs_trl.py --preset gpu-1b --output_dir outputs/vs_trl_gpu   # one GPU (needs CUDA)
    python benchmarks/studies/vs_trl.py --dry_run --output_dir outputs/vs_trl   # print the plan, run nothing

Every round launches A, the recipe through its own command line, then B, TRL (``--trl_worker``, a few lines of
``SFTTrainer`` below), both with ``accelerate launch --config_file accelerate_configs/single_gpu.yaml`` (or
``--config_file ddp_2gpu.yaml``), ``--repeats`` rounds A B A B. One ``settings`` dict gives both sides everything
they are told: the recipe's flags and the ``SFTConfig``/``LoraConfig`` are both derived from it.
- Model: a Llama of the preset's shape with random weights (seed 0), saved once, and a byte-level BPE tokenizer trained
  on the data (``lm_kit.data.train_bpe_tokenizer``) whose chat template is the recipe's default one plus TRL's
  ``{% generation %}`` markers (both render the same text; the markers tell TRL which tokens are the answer).
- Data: ``harness.questions.stdlib_questions()`` (the tests', tests/harness/): what does this standard-library
  function do? -> its docstring, written to JSONL files in the ``messages`` format, read by both.
- Loss: assistant tokens only. The recipe's labels; TRL ``assistant_only_loss=True`` (``completion_only_loss`` is for
  prompt/completion data). Both normalise a step's loss by all answer tokens of the global batch (TRL through
  Trainer's ``num_items_in_batch``). The worker checks that TRL's tokens and labels equal the recipe's
  ``tokenize_sample`` for every sample (``labels_check`` in the JSON).
- Throughput: real tokens (padding excluded) and samples per second over the same optimizer steps, the first
  ``--perf_warmup_steps`` left out: the recipe's ``perf/*`` from its results.json; TRL's from a TrainerCallback that
  times each optimizer step end to end (``on_step_end`` to ``on_step_end``) and the batches each step trained on.
- Work: each side's real tokens and samples per optimizer step (``equal_work`` in the JSON). Where they differ by more
  than 1 % (``lib.records.WORK_TOLERANCE``), the ratios would measure the batches, not the loops: the benchmark stops
  with that message and no verdict. With ``packing`` both sides fill rows of ``max_length`` tokens by best fit
  decreasing (the recipe's ``--packing``, TRL's ``packing=True``), ``per_device_train_batch_size`` rows a batch.
  On a CPU also per second of the process's own CPU time (``time.process_time``, rank 0), which other processes on a
  shared machine do not inflate: TRL's callback reads that clock too, and the recipe runs through
  ``clocked_recipe()``, unchanged and with its own command line, plus that clock at each optimizer step.
- Validation loss over the answer tokens of the same file, summed over tokens and divided by their count (the recipe's
  ``eval/loss``; for TRL the same sum through its own fused LM head). TRL's own ``eval_loss`` (a mean of per-batch
  means) is recorded beside it.
- Adapters: the saved LoRA weights of both, compared tensor by tensor.
- Where a step goes: the runs' first step taken apart in this process (``step_breakdown``).

Ratios are recipe / TRL per round, reported as the median with a 95 % bootstrap interval over the rounds
(``lib.stats.paired_ratio``). Writes ``OUTPUT_DIR/vs_trl.json`` and ``OUTPUT_DIR/summary.md``; the runs' folders go
to ``--work_dir`` (default ``outputs/vs_trl_work/<OUTPUT_DIR>``, git-ignored), with the model and data files, reused
by the next run of the same shape. Never part of the test command.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "recipes")]  # lib/, shared/, the recipes' kits
from lib.launch import accelerate_launch, launch_and_wait, run_as_main_after_each_step
from lib.machine import (
    LIBRARIES,
    library_versions,
    machine_info,
)  # CPU model and flags, GPUs, versions: as every record
from lib.sides import adapter_difference, value_of  # the two sides compared
from lib.trl_side import lora_config, trainer_arguments  # TRL set up as the recipe trains
from lib.records import equal_work, unequal_work_text  # the work-per-step check of every comparison
from lib.stats import paired_ratio  # the median of the paired ratios, its 95 % interval, the pooled ratio

RECIPE = REPO / "recipes" / "llm_finetune.py"
# The recipe's DEFAULT_CHAT_TEMPLATE with TRL's generation markers around each answer (content + EOS + newline, which
# is exactly what the recipe labels as the answer: the text after the "<|assistant|>\n" generation prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token + '\n' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + eos_token + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# The run of both CPU presets: the same batches, schedule and clock; only the model's shape differs.
CPU_RUN = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "max_length": 256,
    "packing": False,
    "max_train_steps": 24,
    "perf_warmup_steps": 4,
    "learning_rate": 1e-3,
    "num_warmup_steps": 2,
    "mixed_precision": "no",
    "threads_per_process": 1,
    "cpu_clock": True,
}
PRESETS = {
    # Big enough that a step is mostly compute (4.2M parameters, a 4096-token vocabulary), small enough for 3 pairs
    # in ~10 minutes on one core per run. fp32, as every CPU record here (bf16 is emulated without avx512_bf16/AMX).
    "cpu": {
        "model": {
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "intermediate_size": 688,
            "vocab_size": 4096,
        },
        "tokenizer_vocab_size": 4096,
        **CPU_RUN,
    },
    # The tests' tiny Llama (0.1M parameters, a 400-token vocabulary): a step is mostly the loop's own cost, which is
    # what this shape measures.
    "cpu-tiny": {
        "model": {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 400,
        },
        "tokenizer_vocab_size": 400,
        **CPU_RUN,
    },
    # Llama-3.2-1B's shape (1.24B parameters, 128,256-row embedding and LM head; the tokenizer uses the first 8,192
    # rows), bf16, rows of 2,048 packed tokens. The chat data hold ~60k tokens, so the 30 steps run several epochs.
    "gpu-1b": {
        "model": {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "vocab_size": 128256,
        },
        "tokenizer_vocab_size": 8192,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_length": 2048,
        "packing": True,
        "max_train_steps": 30,
        "perf_warmup_steps": 5,
        "learning_rate": 2e-4,
        "num_warmup_steps": 3,
        "mixed_precision": "bf16",
        "threads_per_process": None,
        "cpu_clock": False,  # a GPU step's time is the GPU's: wall clock only
    },
}
SHARED_DEFAULTS = {
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "lora_target_modules": "all-linear",
    "lr_scheduler_type": "cosine",
    "weight_decay": 0.0,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "logging_steps": 10,
    "seed": 42,
    "gradient_checkpointing": False,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where vs_trl.json and summary.md go.")
    parser.add_argument(
        "--work_dir", help="The runs' folders, the model and the data (default: outputs/vs_trl_work/<output_dir>)."
    )
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="cpu", help="Model shape and batch (see PRESETS)."
    )
    parser.add_argument("--config_file", default="single_gpu.yaml", help="accelerate_configs/ file for both sides.")
    parser.add_argument("--repeats", type=int, default=3, help="A B rounds (3 or more give an interval).")
    parser.add_argument("--max_train_steps", type=int, help="Optimizer steps per run (default: the preset's).")
    parser.add_argument("--perf_warmup_steps", type=int, help="Steps left out of the throughput (preset's).")
    parser.add_argument("--per_device_train_batch_size", type=int, help="Samples per process per forward pass.")
    parser.add_argument("--gradient_accumulation_steps", type=int, help="Forward/backward passes per step.")
    parser.add_argument("--max_length", type=int, help="Truncation length, or the packed row length.")
    parser.add_argument("--packing", action=argparse.BooleanOptionalAction, help="Pack samples into rows.")
    parser.add_argument("--threads_per_process", type=int, help="CPU threads per process (preset's; CPU: 1).")
    parser.add_argument(
        "--dry_run", action="store_true", help="Print the settings and both launch lines, run nothing."
    )
    parser.add_argument("--trl_worker", action="store_true", help=argparse.SUPPRESS)  # B's side, launched by main()
    parser.add_argument("--settings", help=argparse.SUPPRESS)  # the worker's settings.json
    parser.add_argument("--check_labels", action="store_true", help=argparse.SUPPRESS)  # the worker, first round
    parser.add_argument(
        "--breakdown_repeats", type=int, default=3, help="Passes of the in-process step breakdown (0 skips it)."
    )
    parser.add_argument(
        "--breakdown_steps", type=int, default=4, help="Measured steps the breakdown takes apart (the first ones)."
    )
    return parser.parse_args(argv)


def resolve_settings(args) -> dict:
    preset = PRESETS[args.preset]
    settings = {**SHARED_DEFAULTS, **preset, "preset": args.preset, "config_file": args.config_file}
    for key in (
        "max_train_steps",
        "perf_warmup_steps",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_length",
        "packing",
        "threads_per_process",
    ):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings


# ----------------------------------------------------------------------------------- model and data, made once
def build_inputs(work: Path, settings: dict) -> tuple[Path, Path, Path]:
    """The chat files and the model folder (random Llama + tokenizer with CHAT_TEMPLATE), made once per shape."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: its standard-library questions
    from harness.questions import stdlib_questions
    from lm_kit.data import train_bpe_tokenizer

    shape = settings["model"]
    model_dir = work / ("model-" + "-".join(map(str, shape.values())) + f"-tok{settings['tokenizer_vocab_size']}")
    train_file, validation_file = work / "chats.jsonl", work / "chats_validation.jsonl"
    questions = stdlib_questions()
    if not train_file.is_file():
        for split, path in (("train", train_file), ("validation", validation_file)):
            rows = [{"messages": row["messages"]} for row in questions[split]]
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if not (model_dir / "config.json").is_file():
        texts = (m["content"] for row in questions["train"] for m in row["messages"])
        tokenizer = train_bpe_tokenizer(texts, settings["tokenizer_vocab_size"])
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(model_dir)
        config = LlamaConfig(
            **shape,
            max_position_embeddings=max(1024, settings["max_length"]),
            tie_word_embeddings=False,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        # Saved in the dtype both sides load a LoRA base in (bf16 under bf16 mixed precision: the recipe's rule).
        model.to(torch.bfloat16 if settings["mixed_precision"] == "bf16" else torch.float32).save_pretrained(model_dir)
    return model_dir, train_file, validation_file


# The settings passed to the recipe as flags of the same name (the booleans are added only when on).
RECIPE_FLAGS = (
    "max_length",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_train_steps",
    "learning_rate",
    "weight_decay",
    "adam_epsilon",
    "lr_scheduler_type",
    "num_warmup_steps",
    "max_grad_norm",
    "mixed_precision",
    "seed",
    "logging_steps",
    "perf_warmup_steps",
)


def recipe_command(settings: dict, model_dir: Path, train_file: Path, validation_file: Path, out: Path) -> list[str]:
    """A: the recipe's own command line, every setting that TRL also gets."""
    s = settings
    return [
        *launcher(s),
        # On a CPU, through clocked_recipe(): the same recipe and flags, plus a CPU clock per step.
        *([str(Path(__file__).resolve()), "--clocked_recipe"] if s["cpu_clock"] else []),
        str(RECIPE),
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(train_file),
        "--validation_file",
        str(validation_file),
        # Every setting TRL also gets, under the recipe's flag of the same name.
        *[word for key in RECIPE_FLAGS for word in (f"--{key}", str(s[key]))],
        *(["--packing"] if s["packing"] else []),
        *(["--gradient_checkpointing"] if s["gradient_checkpointing"] else []),
        # Generation-based scoring has no TRL counterpart: off (it runs after training, outside the timing anyway).
        "--exact_match_samples",
        "0",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",  # repeats and reruns reuse the runs' folders
    ]


def clocked_recipe(argv: list[str]) -> None:
    """A on a CPU: the recipe, run unchanged with its own command line (``lib.launch.run_as_main``, as
    ``profile_recipe.py`` runs it), with one addition: each optimizer step's CPU time of this process
    (``time.process_time``) is recorded beside the wall clock of its ``RunRecord``, in
    ``OUTPUT_DIR/cpu_clock_rank{R}.json``. On a machine that other processes share, a step's wall time counts the time
    they held the core; its CPU time does not."""
    steps, last = [], [time.process_time()]

    def after_step(samples: int, tokens) -> None:
        now = time.process_time()  # (a CPU run: reading the token count here waits for nothing)
        steps.append({"cpu_s": now - last[0], "samples": int(samples), "tokens": int(tokens)})
        last[0] = now

    run_as_main_after_each_step(argv, after_step)
    out = Path(argv[argv.index("--output_dir") + 1])
    (out / f"cpu_clock_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(steps) + "\n")


def trl_command(settings_file: Path, settings: dict, out: Path, check_labels: bool) -> list[str]:
    """B: this file's worker under the same launcher (checking the labels against the recipe's in the first round)."""
    return [
        *launcher(settings),
        str(Path(__file__).resolve()),
        "--trl_worker",
        "--settings",
        str(settings_file),
        "--output_dir",
        str(out),
        *(["--check_labels"] if check_labels else []),
    ]


def launcher(settings: dict) -> list[str]:
    return accelerate_launch(settings["config_file"])


def launch(command: list[str], out: Path, settings: dict, results_name: str) -> dict:
    """One launch (``lib.launch``): its results file, with its wall time and the CPU share other processes used."""
    return launch_and_wait(command, out, results_name=results_name, threads=settings["threads_per_process"])


# ------------------------------------------------------------------------------------------ B: the TRL worker
def trl_worker(args) -> None:
    """SFTTrainer as a user would write it, told what the recipe is told; writes trl_results.json."""
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from shared.results import peak_memory_gib, percentile

    s = json.loads(Path(args.settings).read_text())
    out = Path(args.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(s["model_dir"])
    raw = {
        split: datasets.load_dataset("json", data_files=s[f"{split}_file"], split="train")
        for split in ("train", "validation")
    }
    bf16 = s["mixed_precision"] == "bf16"
    config = SFTConfig(
        **trainer_arguments(s, out, bf16=bf16, gradient_checkpointing=s["gradient_checkpointing"]),
        model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32},
        max_length=s["max_length"],
        packing=s["packing"],
        eval_packing=False,  # the recipe evaluates unpacked
        assistant_only_loss=True,
        per_device_eval_batch_size=s["per_device_train_batch_size"],
    )
    peft_config = lora_config(s)

    class StepMeter(TrainerCallback):
        """Times optimizer steps end to end (the previous step's end to this one's) and adds up the batches each
        trained on, skipping the first ``warmup`` steps: the recipe's RunRecord clock, as a callback."""

        def __init__(self, warmup: int):
            self.warmup, self.seen, self.step_times, self.cpu_times, self.logs = warmup, 0, [], [], []
            self.every_step_cpu = []  # warm-up steps too: the step breakdown compares single steps
            self.samples = self.tokens = 0
            self.pending_samples, self.pending_tokens = 0, torch.zeros((), dtype=torch.long)

        def count(self, inputs: dict) -> None:
            """Called per micro-batch: its samples and real tokens (attention mask; padding-free: every position)."""
            if "attention_mask" in inputs:
                self.pending_samples += len(inputs["input_ids"])
                tokens = inputs["attention_mask"].sum()
            else:  # padding-free packed rows flattened into one: count the samples by their position 0
                self.pending_samples += int((inputs["position_ids"] == 0).sum())
                tokens = torch.tensor(inputs["input_ids"].numel())
            self.pending_tokens = self.pending_tokens.to(tokens.device) + tokens  # no sync until the step ends

        def on_train_begin(self, *_, **__):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the clock stops when the GPU has finished the step
            now, now_cpu = time.perf_counter(), time.process_time()
            self.seen += 1
            self.every_step_cpu.append(now_cpu - self.last_cpu)
            if self.seen > self.warmup:
                self.step_times.append(now - self.last)
                self.cpu_times.append(now_cpu - self.last_cpu)
                self.samples += self.pending_samples
                self.tokens += int(self.pending_tokens.item())
            self.pending_samples, self.pending_tokens = 0, torch.zeros((), dtype=torch.long)
            self.last, self.last_cpu = now, now_cpu

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "loss" in logs:
                self.logs.append((state.global_step, logs["loss"]))

    meter = StepMeter(s["perf_warmup_steps"])

    class CountingSFTTrainer(SFTTrainer):
        # The only addition to SFTTrainer: hand each micro-batch to the meter (a callback never sees the batches).
        def training_step(self, model, inputs, num_items_in_batch=None):
            meter.count(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = CountingSFTTrainer(
        model=s["model_dir"],
        args=config,
        train_dataset=raw["train"],
        eval_dataset=raw["validation"],
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[meter],
    )
    labels_check = check_labels(trainer, tokenizer, raw, s) if args.check_labels else None
    trainer.train()
    measured = sum(meter.step_times)
    samples, tokens = meter.samples, meter.tokens
    accelerator = trainer.accelerator
    if accelerator.num_processes > 1:  # global counts; the clock is each process's own (the recipe's rule)
        totals = accelerator.reduce(torch.tensor([samples, tokens], device=accelerator.device), reduction="sum")
        samples, tokens = (int(value) for value in totals.tolist())
    trainer.save_model(str(out))  # adapter_model.safetensors + adapter_config.json, as the recipe saves
    eval_loss, eval_tokens = token_weighted_eval_loss(trainer)
    trl_eval = trainer.evaluate()
    from accelerate.utils import gather_object

    peaks = gather_object([peak_memory_gib([accelerator.device])])
    several = accelerator.num_processes > 1
    results = {
        "perf/measured_steps": len(meter.step_times),
        "perf/step_time_s": statistics.median(meter.step_times),
        "perf/step_time_p90_s": percentile(meter.step_times, 90),
        "perf/samples_per_sec": samples / measured,
        "perf/tokens_per_sec": tokens / measured,
        "perf/samples_per_step": samples / len(meter.step_times),  # global, as the recipe's results.json has them
        "perf/tokens_per_step": tokens / len(meter.step_times),
        # This process's CPU time over the same steps (rank 0's, like the clock): see clocked_recipe().
        "perf/cpu_s": sum(meter.cpu_times),
        "perf/cpu_step_s": meter.every_step_cpu,
        "perf/samples_per_cpu_s": samples / sum(meter.cpu_times),
        "perf/tokens_per_cpu_s": tokens / sum(meter.cpu_times),
        "memory/peak_gib": {
            (f"rank{rank}/" if several else "") + device: round(gib, 4)
            for rank, peak in enumerate(peaks)
            for device, gib in peak.items()
        },
        "eval/loss": eval_loss,
        "eval/num_tokens": eval_tokens,
        "eval/trl_eval_loss": trl_eval["eval_loss"],
        "train/loss_log": meter.logs,
        "completed_steps": trainer.state.global_step,
        "labels_check": labels_check,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "torch_threads": torch.get_num_threads(),
        "model/trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "trl/optim": str(config.optim),
        "trl/padding_free": trainer.padding_free,
    }
    if accelerator.is_main_process:
        (out / "trl_results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def check_labels(trainer, tokenizer, raw: dict, s: dict) -> dict:
    """Whether TRL's tokens and labels equal the recipe's ``tokenize_sample`` for every sample (the validation set
    always; the training set when it is not packed, since packing regroups it)."""
    from llm_kit.sft_data import tokenize_sample  # what the recipe tokenizes with

    checked, differing = 0, []
    pairs = [("validation", trainer.eval_dataset)] + ([] if s["packing"] else [("train", trainer.train_dataset)])
    for split, prepared in pairs:
        for index, (row, ours) in enumerate(zip(raw[split], prepared)):
            theirs = tokenize_sample(row, "messages", tokenizer, s["max_length"])
            checked += 1
            if theirs["input_ids"] != ours["input_ids"] or theirs["labels"] != ours["labels"]:
                differing.append(f"{split}[{index}]")
    return {"samples_checked": checked, "differing": differing[:20], "num_differing": len(differing)}


def token_weighted_eval_loss(trainer) -> tuple[float, int]:
    """The recipe's eval/loss through TRL's own forward (its fused LM head): summed token losses of every answer token
    of the validation set over their count (gather_for_metrics drops the samples repeated for even batches)."""
    import torch

    model, total, count = trainer.model, 0.0, 0
    model.eval()
    for batch in trainer.get_eval_dataloader():
        batch = trainer._prepare_inputs(batch)
        with torch.no_grad():
            outputs = model(**batch, fused_lm_head=True, use_cache=False)
        per_sample, tokens = -outputs.log_probs.float().sum(dim=1), outputs.label_mask.sum(dim=1)
        per_sample, tokens = trainer.accelerator.gather_for_metrics((per_sample, tokens))
        total, count = total + per_sample.sum().item(), count + int(tokens.sum().item())
    return total / count, count


# ------------------------------------------------------------------------------------------ where a step goes
def step_breakdown(settings: dict, steps: list[int], repeats: int) -> dict:
    """Optimizer steps ``steps`` (0-based) of the runs taken apart in this process, on the batches the runs trained on
    (the sampler's permutation of the training file; unpacked), one device, the runs' thread count, each part timed
    ``repeats`` times per step, the parts alternating: collating (the recipe's ``collate`` vs TRL's
    ``DataCollatorForLanguageModeling``); forward + backward with the loss on the answer tokens (the recipe's
    ``token_losses``: logits at the answer positions only, chunked fp32 cross-entropy; TRL's fused LM head, with the
    entropy and top-1 outputs SFTTrainer asks for, and with the log-probabilities alone); the decoder alone (no LM
    head, no loss), which both share; clipping + the AdamW step, which both share. Per part: the mean over the steps
    of its median. What a run's step costs beyond these is its loop's own work (summarize_breakdown)."""
    import importlib.util

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    from trl.trainer.utils import add_fused_lm_head

    from llm_kit.sft_data import tokenize_sample  # what the recipe tokenizes with

    spec = importlib.util.spec_from_file_location("llm_finetune", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if settings["threads_per_process"]:
        torch.set_num_threads(settings["threads_per_process"])
    tokenizer = AutoTokenizer.from_pretrained(settings["model_dir"])
    pad = tokenizer.pad_token_id
    rows = [json.loads(line) for line in Path(settings["train_file"]).read_text().splitlines()]
    # The recipe's and Trainer's sampler (Accelerate's seedable sampler): torch.randperm seeded with the seed.
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(settings["seed"])).tolist()
    size, micro = settings["per_device_train_batch_size"], settings["gradient_accumulation_steps"]
    if (max(steps) + 1) * size * micro > len(rows):
        raise SystemExit(f"--breakdown_steps reach past the first epoch ({len(rows)} samples): use fewer")
    trl_collator = DataCollatorForLanguageModeling(pad_token_id=pad)
    work = []  # per step: its micro-batches, both ways, and its answer-token count
    for step in steps:
        first = step * size * micro
        groups = [
            [tokenize_sample(rows[i], "messages", tokenizer, settings["max_length"]) for i in order[j : j + size]]
            for j in range(first, first + size * micro, size)
        ]
        trl_groups = [[{"input_ids": s["input_ids"], "labels": s["labels"]} for s in group] for group in groups]
        batches = [{k: v.to(device) for k, v in recipe.collate(group, pad).items()} for group in groups]
        trl_batches = [{k: v.to(device) for k, v in trl_collator(group).items()} for group in trl_groups]
        answers = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in batches)
        work.append(
            {
                "groups": groups,
                "trl_groups": trl_groups,
                "batches": batches,
                "trl_batches": trl_batches,
                "answers": answers,
            }
        )
    dtype = torch.bfloat16 if settings["mixed_precision"] == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(settings["model_dir"], dtype=dtype).to(device)
    lora = LoraConfig(
        r=settings["lora_r"],
        lora_alpha=settings["lora_alpha"],
        lora_dropout=settings["lora_dropout"],
        target_modules=settings["lora_target_modules"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=settings["learning_rate"], fused=True)  # TRL: adamw_torch_fused
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def recipe_step(w):
        for batch in w["batches"]:
            with autocast:
                loss_sum, _ = recipe.token_losses(model, batch)
            (loss_sum / w["answers"]).backward()

    def trl_step(outputs: tuple[str, ...]):
        def step(w):
            add_fused_lm_head(model.get_base_model(), outputs=outputs)
            for batch in w["trl_batches"]:
                with autocast:
                    result = model(**batch, fused_lm_head=True, use_cache=False)
                (-result.log_probs.sum() / w["answers"]).backward()

        return step

    def decoder_only(w):
        for batch in w["batches"]:
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_tokens")}
            with autocast:
                hidden = model.get_base_model().model(**inputs, use_cache=False).last_hidden_state
            hidden.float().sum().backward()

    def optimizer_step(_):
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad()

    parts = {
        "collate: recipe": lambda w: [recipe.collate(group, pad) for group in w["groups"]],
        "collate: TRL": lambda w: [trl_collator(group) for group in w["trl_groups"]],
        "forward+backward: recipe (answer logits + chunked cross-entropy)": recipe_step,
        "forward+backward: TRL (fused LM head + entropy, top-1)": trl_step(("log_probs", "entropy", "is_top1")),
        "forward+backward: TRL (fused LM head, log-probs only)": trl_step(("log_probs",)),
        "forward+backward: decoder alone (no LM head, no loss)": decoder_only,
        "clip + AdamW step (both)": optimizer_step,
    }
    # CPU: this process's CPU time (other processes' use of the cores does not count); a GPU: the wall clock.
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    times = {name: [[] for _ in steps] for name in parts}
    for _ in range(repeats + 1):  # the first pass warms up
        for index, w in enumerate(work):
            for name, part in parts.items():
                if name != "clip + AdamW step (both)":  # it steps on the gradients the part before left
                    model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = clock()
                part(w)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name][index].append(clock() - start)
    batches = [batch for w in work for batch in w["batches"]]
    real = sum(int(batch["num_tokens"].sum()) for batch in batches)
    return {
        "steps": [step + 1 for step in steps],  # 1-based, as the runs count them
        "micro_batch_shapes": [list(batch["input_ids"].shape) for batch in batches],
        "real_tokens_per_step": real / len(steps),
        "padding_fraction": 1 - real / sum(batch["input_ids"].numel() for batch in batches),
        "answer_tokens_per_step": sum(w["answers"] for w in work) / len(steps),
        "per_step_s": {
            name: statistics.fmean(statistics.median(values[1:]) for values in per_step)
            for name, per_step in times.items()
        },
        "clock": "process CPU time" if device.type == "cpu" else "wall clock",
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }


def summarize_breakdown(breakdown: dict, rounds: list[dict], settings: dict) -> dict | None:
    """Each side's step as the runs measured it (the median over rounds of its CPU time on the breakdown's steps,
    averaged over them) against the sum of its parts in the breakdown; the rest is the loop's own work (Trainer's
    bookkeeping and metrics, or the recipe's). Only where both are on one clock and the same batches: CPU, unpacked,
    one process."""
    if not settings["cpu_clock"] or settings["packing"] or any(r["recipe"]["num_processes"] > 1 for r in rounds):
        return None  # (with several processes each holds part of a step's batches)
    parts = breakdown["per_step_s"]
    shared = parts["clip + AdamW step (both)"]
    computed = {
        "recipe": parts["collate: recipe"]
        + parts["forward+backward: recipe (answer logits + chunked cross-entropy)"]
        + shared,
        "trl": parts["collate: TRL"] + parts["forward+backward: TRL (fused LM head + entropy, top-1)"] + shared,
    }
    steps = [step - 1 for step in breakdown["steps"]]
    sides = {}
    for side, parts_sum in computed.items():
        measured = statistics.fmean(
            statistics.median(r[side]["perf/cpu_step_s"][step] for r in rounds) for step in steps
        )
        sides[side] = {"measured_step_cpu_s": measured, "parts_s": parts_sum, "loop_s": measured - parts_sum}
    return sides


# ------------------------------------------------------------------------------------------ the comparison


# (label, key): what is compared, recipe / TRL, in every round. Per CPU-second: only where cpu_clock is on. A sample
# is a conversation on both sides, packed or not.
COMPARED = (
    ("tokens/s", "perf/tokens_per_sec"),
    ("samples/s", "perf/samples_per_sec"),
    ("tokens per CPU-second", "perf/tokens_per_cpu_s"),
    ("samples per CPU-second", "perf/samples_per_cpu_s"),
    ("validation loss", "eval/loss"),
    ("peak memory", "memory/peak_gib"),
)


def compared(settings: dict) -> list[tuple[str, str]]:
    return [(label, key) for label, key in COMPARED if settings["cpu_clock"] or "cpu_s" not in key]


def work_check(rounds: list[dict]) -> dict:
    """Whether both sides did the same work per optimizer step (real tokens and samples; ``lib.records.equal_work``) in
    every round: the numbers of the first round that differs, else of round 0."""
    checks = [
        equal_work(
            {
                side: {key: r[side].get(f"perf/{key}") for key in ("tokens_per_step", "samples_per_step")}
                for side in ("recipe", "trl")
            }
        )
        for r in rounds
    ]
    return next((check for check in checks if check["equal"] is False), checks[0])


def refusal(work: dict) -> str:
    """The message of a comparison of unequal work (``work_check``), or "" when the work is equal."""
    if work["equal"] is not False:
        return ""
    return (
        f"Not judged: the two sides did different work per optimizer step ({unequal_work_text(work)}; more than "
        f"{work['tolerance']:.0%} apart), so their ratios would measure the batches, not the training loops. Give "
        "both the same batches: with packing, rows of max_length tokens on both sides (the recipe's --packing packs "
        "them as TRL's packing=True does); without, the same per_device_train_batch_size and max_length."
    )


def work_text(work: dict) -> str:
    """The work-per-step line of the summary."""
    measures = [measure for measure in ("tokens_per_step", "samples_per_step") if measure in work]
    text = ", ".join(
        f"{measure.replace('_', ' ')}: recipe {work[measure]['recipe']:,.0f}, TRL {work[measure]['trl']:,.0f}"
        for measure in measures
    )
    equal = f" (equal within {work['tolerance']:.0%})" if work["equal"] else ""
    return f"Work per optimizer step (real tokens, conversations): {text or 'not recorded'}{equal}."


def summarize(rounds: list[dict], settings: dict) -> list[dict]:
    """Each ratio, recipe / TRL: the median over rounds of the paired ratios, its 95 % bootstrap interval, and the
    ratio of the two sides' medians over all their runs ("pooled")."""
    rows = []
    for label, key in compared(settings):
        ratio = paired_ratio([value_of(r["recipe"], key) for r in rounds], [value_of(r["trl"], key) for r in rounds])
        rows.append({"ratio": f"{label}, recipe / TRL", "key": key, **ratio})
    return rows


def window_means(curve: list[float], every: int) -> list[float]:
    """The recipe's per-step losses as TRL logs them: the mean over each window of ``every`` steps."""
    return [statistics.fmean(curve[start : start + every]) for start in range(0, len(curve) - every + 1, every)]


def recipe_cpu_clock(out: Path, warmup: int) -> dict:
    """The recipe's throughput per CPU-second over its measured steps, from clocked_recipe()'s record."""
    every = json.loads((out / "cpu_clock_rank0.json").read_text())
    steps = every[warmup:]
    cpu = sum(step["cpu_s"] for step in steps)
    return {
        "perf/cpu_s": cpu,
        "perf/cpu_step_s": [step["cpu_s"] for step in every],
        "perf/samples_per_cpu_s": sum(step["samples"] for step in steps) / cpu,
        "perf/tokens_per_cpu_s": sum(step["tokens"] for step in steps) / cpu,
    }


def side_summary(results: dict, kind: str) -> dict:
    keys = (
        "perf/tokens_per_sec",
        "perf/samples_per_sec",
        "perf/tokens_per_step",
        "perf/samples_per_step",
        "perf/tokens_per_cpu_s",
        "perf/samples_per_cpu_s",
        "perf/cpu_s",
        "perf/cpu_step_s",
        "num_processes",
        "perf/step_time_s",
        "perf/step_time_p90_s",
        "perf/measured_steps",
        "memory/peak_gib",
        "eval/loss",
        "eval/num_tokens",
        "completed_steps",
        "bench/wall_s",
        "bench/foreign_share",
    )
    side = {key: results.get(key) for key in keys}
    if kind == "recipe":
        side["train/loss_curve"] = results["train/loss_curve"]
        side["perf/data_wait_fraction"] = results.get("perf/data_wait_fraction")
        side["perf/answer_tokens_per_sec"] = results.get("perf/answer_tokens_per_sec")
    else:
        for key in (
            "eval/trl_eval_loss",
            "train/loss_log",
            "labels_check",
            "torch_threads",
            "trl/optim",
            "trl/padding_free",
            "model/trainable_parameters",
        ):
            side[key] = results[key]
    return side


def adapter_text(difference: dict) -> str:
    if not difference["same_tensors"]:
        return f"different tensors ({difference})"
    return f"{difference['max_abs_diff']:.2g}, {difference['relative_diff']:.2g}"


def markdown(report: dict) -> str:
    s, rounds = report["settings"], report["rounds"]

    def fmt_interval(row):
        return f"[{row['interval'][0]:.3f}, {row['interval'][1]:.3f}]" if row["interval"] else "- (< 3 rounds)"

    machine = report["machine"]
    lines = [
        "# recipes/llm_finetune.py vs TRL SFTTrainer",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpu_cores']} cores (flags: {', '.join(machine['cpu_flags'])}), "
        f"{machine['memory_gib']} GiB; "
        + (", ".join(gpu["name"] for gpu in machine["gpus"]) or "no GPU")
        + "; "
        + ", ".join(f"{name} {version}" for name, version in report["versions"].items() if version),
        "",
        f"Settings (both sides): preset `{s['preset']}`, {s['config_file']}, model {s['model']}, LoRA r {s['lora_r']} "
        f"alpha {s['lora_alpha']} dropout {s['lora_dropout']} on {s['lora_target_modules']}, batch "
        f"{s['per_device_train_batch_size']} x {s['gradient_accumulation_steps']} accumulation, max_length "
        f"{s['max_length']}, packing {s['packing']}, {s['max_train_steps']} steps ({s['perf_warmup_steps']} warm-up "
        f"left out), lr {s['learning_rate']} {s['lr_scheduler_type']} with {s['num_warmup_steps']} warm-up steps, "
        f"mixed precision {s['mixed_precision']}, threads per process {s['threads_per_process']}, seed {s['seed']}.",
        "",
        work_text(report["equal_work"]),
        "",
        *(
            [f"**{report['refused']}**"]  # and no ratio
            if report.get("refused")
            else [
                "| ratio | median of rounds | 95 % interval | per round | pooled medians |",
                "| --- | --- | --- | --- | --- |",
            ]
        ),
    ]
    for row in report["summary"]:
        lines.append(
            f"| {row['ratio']} | **{row['median']:.3f}** | {fmt_interval(row)} | "
            f"{', '.join(f'{value:.3f}' for value in row['rounds'])} | {row['pooled']:.3f} |"
        )
    lines += [
        "",
        "Per second: the wall clock (the recipe's own `perf/*`, TRL's callback). Per CPU-second: the process's own "
        "CPU time over the same steps (rank 0). Other CPU load: the share of all cores that other processes used "
        "during a launch; where it is high, the wall-clock ratios say how the cores were shared out, and the "
        "per-CPU-second ratios compare the two loops.",
        "",
        "| round | side | tokens/s | samples/s | tokens per CPU-s | step p50 (s) | eval loss | peak memory (GiB) "
        "| wall (s) | other CPU load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rounds:
        for side in ("recipe", "trl"):
            v = r[side]
            cpu = f"{v['perf/tokens_per_cpu_s']:.0f}" if v.get("perf/tokens_per_cpu_s") else "-"
            lines.append(
                f"| {r['round']} | {side} | {v['perf/tokens_per_sec']:.0f} | {v['perf/samples_per_sec']:.2f} | "
                f"{cpu} | {v['perf/step_time_s']:.3f} | {v['eval/loss']:.5f} | "
                f"{', '.join(f'{d} {g:.2f}' for d, g in v['memory/peak_gib'].items())} | {v['bench/wall_s']:.0f} | "
                f"{v.get('bench/foreign_share', 0):.0%} |"
            )
    checks = report["checks"]
    lines += [
        "",
        f"Labels: TRL's tokens and labels equal the recipe's on {checks['labels']['samples_checked']} samples, "
        f"{checks['labels']['num_differing']} differ.",
        "Adapters, saved LoRA weights (largest absolute difference; norm of the difference / norm): "
        + "; ".join(
            f"{name} {adapter_text(checks[key])}"
            for name, key in (
                ("recipe vs TRL (round 0)", "adapters_recipe_vs_trl"),
                ("recipe round 0 vs 1", "adapters_recipe_repeat"),
                ("TRL round 0 vs 1", "adapters_trl_repeat"),
            )
            if checks.get(key)
        )
        + ".",
        f"Training loss, 10-step means (round 0): recipe {checks['loss_windows']['recipe']}, TRL "
        f"{checks['loss_windows']['trl']}.",
        f"TRL's own eval_loss (a mean of per-batch means): {rounds[0]['trl']['eval/trl_eval_loss']:.5f}.",
    ]
    breakdown = report["step_breakdown"]
    if breakdown:
        shapes = ", ".join(" x ".join(map(str, shape)) for shape in breakdown["micro_batch_shapes"])
        lines += [
            "",
            f"Steps {breakdown['steps'][0]}-{breakdown['steps'][-1]} of the runs taken apart (in one process, "
            f"{breakdown['threads']} thread(s), {breakdown['clock']}, median of {breakdown['repeats']} alternating "
            f"passes, mean per step): micro-batches {shapes} tokens; per step {breakdown['real_tokens_per_step']:.0f} "
            f"real tokens ({breakdown['padding_fraction']:.0%} of the computed positions are padding), "
            f"{breakdown['answer_tokens_per_step']:.0f} answer tokens.",
            "",
            "| part | seconds per step |",
            "| --- | --- |",
            *(f"| {name} | {seconds:.4f} |" for name, seconds in breakdown["per_step_s"].items()),
        ]
        if breakdown["sides"]:
            lines += [
                "",
                "| side | step in the runs (CPU s) | its parts above | the loop's own work |",
                "| --- | --- | --- | --- |",
            ]
            for side, v in breakdown["sides"].items():
                lines.append(f"| {side} | {v['measured_step_cpu_s']:.4f} | {v['parts_s']:.4f} | {v['loop_s']:+.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--clocked_recipe"]:  # A's wrapper: the rest is the recipe's own command line
        clocked_recipe(argv[1:])
        return 0
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    settings = resolve_settings(args)
    output_dir = Path(args.output_dir).resolve()
    # Outside the results folder (committed records hold only vs_trl.json and summary.md); outputs/ is git-ignored.
    relative = output_dir.relative_to(REPO) if output_dir.is_relative_to(REPO) else Path(output_dir.name)
    work = Path(args.work_dir).resolve() if args.work_dir else REPO / "outputs" / "vs_trl_work" / relative
    if settings["mixed_precision"] == "bf16" and not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--preset {args.preset} is a GPU shape in bf16; this machine has no CUDA GPU.")
    output_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"  # placeholder for the dry run
    train_file, validation_file = work / "chats.jsonl", work / "chats_validation.jsonl"
    if not args.dry_run:
        model_dir, train_file, validation_file = build_inputs(work, settings)
    settings.update(model_dir=str(model_dir), train_file=str(train_file), validation_file=str(validation_file))
    settings_file = work / "settings.json"
    settings_file.write_text(json.dumps(settings, indent=2) + "\n")
    if args.dry_run:
        print(json.dumps(settings, indent=2))
        print("A:", " ".join(recipe_command(settings, model_dir, train_file, validation_file, work / "recipe_r0")))
        print("B:", " ".join(trl_command(settings_file, settings, work / "trl_r0", True)))
        return 0
    rounds = []
    for index in range(args.repeats):
        recipe_out, trl_out = work / f"recipe_r{index}", work / f"trl_r{index}"
        a = launch(
            recipe_command(settings, model_dir, train_file, validation_file, recipe_out),
            recipe_out,
            settings,
            "results.json",
        )
        b = launch(trl_command(settings_file, settings, trl_out, index == 0), trl_out, settings, "trl_results.json")
        if settings["cpu_clock"]:
            a.update(recipe_cpu_clock(recipe_out, settings["perf_warmup_steps"]))
        rounds.append({"round": index, "recipe": side_summary(a, "recipe"), "trl": side_summary(b, "trl")})
        print(
            f"round {index}: "
            + "; ".join(
                f"{label} {value_of(a, key):.4g} vs {value_of(b, key):.4g}" for label, key in compared(settings)
            ),
            flush=True,
        )
        if work_check(rounds)["equal"] is False:  # no more rounds: the batches differ, not the weather
            break
    equal = work_check(rounds)
    refused = refusal(equal)
    every = settings["logging_steps"]
    checks = {
        "labels": rounds[0]["trl"]["labels_check"],
        "adapters_recipe_vs_trl": adapter_difference(work / "recipe_r0", work / "trl_r0"),
        "adapters_recipe_repeat": adapter_difference(work / "recipe_r0", work / "recipe_r1")
        if len(rounds) > 1
        else None,
        "adapters_trl_repeat": adapter_difference(work / "trl_r0", work / "trl_r1") if len(rounds) > 1 else None,
        "loss_windows": {
            "recipe": [round(value, 5) for value in window_means(rounds[0]["recipe"]["train/loss_curve"], every)],
            "trl": [round(loss, 5) for _, loss in rounds[0]["trl"]["train/loss_log"]],
        },
    }
    breakdown = None
    if args.breakdown_repeats > 0 and not refused:
        first = settings["perf_warmup_steps"]
        steps = list(range(first, min(first + args.breakdown_steps, settings["max_train_steps"])))
        breakdown = step_breakdown(settings, steps, args.breakdown_repeats)
        breakdown["sides"] = summarize_breakdown(breakdown, rounds, settings)
    report = {
        "benchmark": "vs_trl",
        "command": "python benchmarks/studies/vs_trl.py " + " ".join(argv),
        "settings": {key: value for key, value in settings.items() if not key.endswith(("_dir", "_file"))}
        | {"config_file": settings["config_file"]},
        "rounds": rounds,
        "equal_work": equal,
        "refused": refused or None,
        "summary": [] if refused else summarize(rounds, settings),
        "checks": checks,
        "step_breakdown": breakdown,
        "machine": machine_info(),
        "versions": library_versions([*LIBRARIES, "trl", "peft"]),
    }
    (output_dir / "vs_trl.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (output_dir / "summary.md").write_text(text)
    print(text)
    if refused:
        print(refused, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
