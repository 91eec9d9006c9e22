"""recipes/dpo.py against TRL's DPOTrainer, side by side: equal per-step losses and adapters, and the speed of each.

    python benchmarks/studies/dpo_vs_trl.py --output_dir benchmarks/results/cpu-dpo-vs-trl     # CPU record, 3 rounds
    python benchmarks/studies/dpo_vs_trl.py --preset cpu-tiny --repeats 1 --output_dir outputs/dpo_vs_trl_tiny
    python benchmarks/studies/dpo_vs_trl.py --dry_run --output_dir outputs/dpo_vs_trl           # the plan, nothing run

The method is benchmarks/vs_trl.py's (the SFT comparison): one ``settings`` dict feeds both sides; every round launches
A, the recipe through its own command line, then B, DPOTrainer (``--trl_worker``, below), both under ``accelerate
launch --config_file accelerate_configs/single_gpu.yaml``, ``--repeats`` rounds A B A B.
- Model: a Llama of the preset's shape, random weights (seed 0), untied, fp32, and a byte-level BPE tokenizer trained
  on the data, with the recipe's default chat template (``llm_kit.sft_data.DEFAULT_CHAT_TEMPLATE``).
- Data: ``harness.questions.stdlib_questions()`` (the tests', tests/harness/) as conversational pairs: the
  question; chosen, its docstring; rejected, the next different docstring. The ``cpu`` preset lengthens both answers
  with the docstrings that follow (``answer_chars``), so that rows are ~seq 256 and a step is compute, not overhead.
  Written to JSONL, read by both.
- Aligned (TRL's defaults that differ from the recipe's, or that the recipe has no twin of): ``bf16=False``
  (DPOConfig's default is True), ``gradient_checkpointing=False`` (default True), ``lr_scheduler_type``, no warm-up,
  ``optim="adamw_torch_fused"`` (the recipe's fused AdamW), ``logging_steps=1`` on both (per-step losses),
  ``set_seed`` before the trainer is built (the LoRA A matrices drawn from the same RNG state as the recipe's).
  Left at TRL's defaults because they equal the recipe's: ``truncation_mode="keep_start"`` (prompt + completion cut
  at ``max_length`` from the end, a pair whose prompt fills it dropped: the recipe without ``--max_prompt_length``),
  ``loss_type=["sigmoid"]``, ``label_smoothing=0``, no ``ld_alpha``, no ``use_weighting``,
  ``precompute_ref_log_probs=False``, ``disable_dropout`` (on in both; the model has none, LoRA dropout 0),
  reference = the base with the adapter disabled, padding on the right, and the loss of a step the mean over its
  pairs (TRL: each micro-batch's mean, divided by the accumulation steps; equal micro-batches give the same mean).
- Order: both samplers are Accelerate's seedable sampler, ``torch.randperm`` seeded with ``seed``.
- Checks: every training pair's token ids (prompt + chosen, prompt + rejected, and which are completion) from TRL's
  prepared dataset after its collator's truncation, against the recipe's ``tokenize_pair`` (``ids_check``); each
  step's loss and TRL's ``rewards/*``/``logps/*`` against the recipe's ``train/log``; the saved adapters tensor by
  tensor; real tokens and pairs per optimizer step (``records.equal_work``: refused beyond 1 %).
- Speed: pairs per second of the process's own CPU time (``time.process_time``, which other processes on a shared
  machine do not inflate) over the same steps, the first ``perf_warmup_steps`` left out; wall-clock pairs/s beside
  it. The recipe runs unchanged through ``--clocked_recipe`` (runpy, plus that clock at each optimizer step); TRL's
  clock is a TrainerCallback. Peak memory: each process's peak RSS (``shared.results.peak_memory_gib``).
- Where the time goes: ``torch.profiler`` around one warm-up step of round 0 on each side (``--profile_step``).

Ratios are recipe / TRL per round: the median and its 95 % bootstrap interval over the rounds. Writes
``OUTPUT_DIR/dpo_vs_trl.json`` and ``OUTPUT_DIR/summary.md``; runs, model and data go to --work_dir (default
``outputs/dpo_vs_trl_work/<OUTPUT_DIR>``, git-ignored). Never part of the test command.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "recipes")]  # lib/, shared/, the recipes' kits
# The benchmarks' library, in one place (benchmarks/lib once merged: lib.records, lib.stats, lib.machine).
from lib.machine import LIBRARIES, library_versions, machine_info  # CPU model and flags, versions: as every record
from lib.launch import run_as_main_after_each_step  # the recipe unchanged, a clock after each step
from lib.sides import adapter_difference, value_of  # the two sides compared
from lib.trl_side import lora_config, trainer_arguments  # TRL set up as the recipe trains
from lib.records import equal_work, unequal_work_text  # work per step, the equal-work check
from lib.stats import bootstrap_interval  # 95 % interval of a median ratio

RECIPE = REPO / "recipes" / "dpo.py"
SHARED_DEFAULTS = {
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "lora_target_modules": "all-linear",
    "beta": 0.1,
    "loss_type": "sigmoid",
    "learning_rate": 1e-3,
    "lr_scheduler_type": "linear",
    "num_warmup_steps": 0,
    "weight_decay": 0.0,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "seed": 42,
    "logging_steps": 1,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "threads_per_process": 1,
}
PRESETS = {
    # Hidden 256, 4 layers, a 4096-token vocabulary (4.2M parameters), rows of ~256 tokens: a step is compute.
    "cpu": {
        "model": {
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "intermediate_size": 688,
            "vocab_size": 4096,
        },
        "max_length": 256,
        "answer_chars": 700,
        "gradient_accumulation_steps": 1,  # 4 pairs (8 rows of ~220 tokens) a step: ~1.4 s of CPU here
        "max_train_steps": 12,
        "perf_warmup_steps": 3,
    },
    # The tests' tiny Llama on the natural (short) pairs: the equality, and a step that is mostly the loop's overhead.
    "cpu-tiny": {
        "model": {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 400,
        },
        "max_length": 256,  # the longest prompt has 115 tokens: no pair dropped
        "answer_chars": 0,
        "max_train_steps": 16,
        "perf_warmup_steps": 3,
    },
}
METRICS = "loss rewards/chosen rewards/rejected rewards/accuracies rewards/margins logps/chosen logps/rejected".split()
LOSS_TOLERANCE = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where dpo_vs_trl.json and summary.md go.")
    parser.add_argument("--work_dir", help="Runs, model, data (default: outputs/dpo_vs_trl_work/<output_dir>).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="Model shape and data (PRESETS).")
    parser.add_argument("--repeats", type=int, default=3, help="A B rounds (3 or more give an interval).")
    parser.add_argument("--max_train_steps", type=int, help="Optimizer steps per run (default: the preset's).")
    parser.add_argument(
        "--profile_step",
        type=int,
        default=2,
        help="The step of round 0 profiled on both sides: a warm-up step, left out of the speed (-1: none).",
    )
    parser.add_argument("--dry_run", action="store_true", help="Print the settings and both launch lines.")
    parser.add_argument("--trl_worker", action="store_true", help=argparse.SUPPRESS)  # B, launched by main()
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--check_ids", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", type=int, default=-1, help=argparse.SUPPRESS)  # the worker's step to profile
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------- model and data, made once
def pair_rows(rows: list[dict], answer_chars: int) -> list[dict]:
    """Conversational pairs: row i's question; chosen, its answer; rejected, the next different answer. With
    ``answer_chars``, each answer goes on with the answers of every second row after it to that many characters."""
    answers = [row["messages"][1]["content"] for row in rows]

    def answer(start: int) -> str:
        text, index = answers[start], start
        while len(text) < answer_chars:
            index = (index + 2) % len(answers)
            text += "\n" + answers[index]
        return text

    def other(start: int) -> int:  # the next row with a different answer (some functions share a docstring)
        return next(
            j % len(rows) for j in range(start + 1, start + len(rows)) if answers[j % len(rows)] != answers[start]
        )

    return [
        {
            "prompt": [row["messages"][0]],
            "chosen": [{"role": "assistant", "content": answer(i)}],
            "rejected": [{"role": "assistant", "content": answer(other(i))}],
        }
        for i, row in enumerate(rows)
    ]


def build_inputs(work: Path, s: dict) -> tuple[Path, Path, Path]:
    """The pair files and the model folder (random Llama + BPE tokenizer with the recipe's chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "tests"))  # the tests' harness: its standard-library questions
    from harness.questions import stdlib_questions
    from lm_kit.data import train_bpe_tokenizer
    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE

    questions = stdlib_questions()
    files = {split: work / f"pairs-{s['answer_chars']}-{split}.jsonl" for split in ("train", "validation")}
    for split, path in files.items():
        if not path.is_file():
            path.write_text("".join(json.dumps(row) + "\n" for row in pair_rows(questions[split], s["answer_chars"])))
    model_dir = work / ("model-" + "-".join(map(str, s["model"].values())))
    if not (model_dir / "config.json").is_file():
        texts = (m["content"] for row in questions["train"] for m in row["messages"])
        tokenizer = train_bpe_tokenizer(texts, s["model"]["vocab_size"])
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        tokenizer.save_pretrained(model_dir)
        config = LlamaConfig(
            **s["model"],
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(model_dir)
    return model_dir, files["train"], files["validation"]


# ------------------------------------------------------------------------------------------ A: the recipe
RECIPE_FLAGS = (
    "max_length lora_r lora_alpha lora_dropout lora_target_modules beta loss_type "
    "per_device_train_batch_size gradient_accumulation_steps max_train_steps learning_rate "
    "lr_scheduler_type num_warmup_steps weight_decay adam_epsilon max_grad_norm seed logging_steps "
    "perf_warmup_steps"
).split()


def launcher() -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "single_gpu.yaml"),
    ]


def recipe_command(s: dict, out: Path, profile: int = -1) -> list[str]:
    """A: the recipe's own command line (through --clocked_recipe: plus a CPU clock per step, and the profile)."""
    return [
        *launcher(),
        str(Path(__file__).resolve()),
        "--clocked_recipe",
        str(profile),
        str(RECIPE),
        "--model_name_or_path",
        s["model_dir"],
        "--train_file",
        s["train_file"],
        "--validation_file",
        s["validation_file"],
        *[word for key in RECIPE_FLAGS for word in (f"--{key}", str(s[key]))],
        "--mixed_precision",
        "no",
        "--skip_eval",
        "--exact_match_samples",
        "0",  # no TRL twin; after the steps
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
    ]


def profile_summary(profiler) -> dict:
    """Self CPU time of one step by kind of operation, and the top operations."""
    kinds = {
        "matmul": "mm addmm bmm matmul linear".split(),
        "attention": "scaled_dot_product".split(),
        "log-softmax / cross-entropy / gather": (
            "log_softmax logsumexp nll cross_entropy gather _softmax exp topk max argmax entropy".split()
        ),
        "optimizer": "adam".split(),
        "autograd / copies": "copy_ clone contiguous to cat index masked where zeros fill empty item".split(),
    }
    events = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in profiler.key_averages()]
    total = sum(seconds for _, seconds, _ in events)
    grouped = dict.fromkeys([*kinds, "other"], 0.0)
    for name, seconds, _ in events:
        base = name.removeprefix("aten::").lower()
        kind = next(
            (
                k
                for k, words in kinds.items()
                if any(base == w or base.startswith(w + "_") or w in base for w in words)
            ),
            "other",
        )
        grouped[kind] += seconds
    top = sorted(events, key=lambda e: -e[1])[:12]
    return {
        "self_cpu_s": total,
        "by_kind_s": grouped,
        "top": [{"op": name, "self_cpu_s": round(sec, 5), "calls": n} for name, sec, n in top],
    }


class StepClock:
    """Each optimizer step's CPU time of this process, and a torch.profiler around step ``profile`` (from the end of
    the step before to the end of this one: its data, forward, backward, optimizer and logging)."""

    def __init__(self, profile: int):
        self.steps, self.last, self.profile, self.profiler, self.summary = [], time.process_time(), profile, None, None

    def tick(self, samples, tokens) -> None:
        import torch

        now = time.process_time()
        self.steps.append({"cpu_s": now - self.last, "samples": int(samples), "tokens": int(tokens)})
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.summary, self.profiler = profile_summary(self.profiler), None
        if len(self.steps) == self.profile - 1:  # the next step is the profiled one
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        self.last = time.process_time()


def clocked_recipe(argv: list[str]) -> None:
    """A: the recipe, unchanged, with its own command line (runpy), plus StepClock at each optimizer step
    (``RunRecord.step``, which the recipe calls once per step); written to OUTPUT_DIR/cpu_clock.json."""
    clock = StepClock(int(argv[0]))
    run_as_main_after_each_step(argv[1:], clock.tick)  # a CPU run: reading the counts waits for nothing
    out = Path(argv[1:][argv[1:].index("--output_dir") + 1])
    (out / "cpu_clock.json").write_text(json.dumps({"steps": clock.steps, "profile": clock.summary}) + "\n")


# ------------------------------------------------------------------------------------------ B: the TRL worker
def trl_worker(args) -> None:
    """DPOTrainer as a user would write it, told what the recipe is told; writes trl_results.json."""
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback, set_seed
    from trl import DPOConfig, DPOTrainer

    from shared.results import peak_memory_gib

    s, out = json.loads(Path(args.settings).read_text()), Path(args.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(s["model_dir"])
    train = datasets.load_dataset("json", data_files=s["train_file"], split="train")
    config = DPOConfig(
        **trainer_arguments(s, out, bf16=False, gradient_checkpointing=False),  # fp32: --mixed_precision no
        model_init_kwargs={"dtype": torch.float32},
        max_length=s["max_length"],
        truncation_mode="keep_start",
        loss_type=[s["loss_type"]],
        beta=s["beta"],
    )
    peft_config = lora_config(s)

    class StepMeter(TrainerCallback):
        """Per optimizer step: CPU and wall time end to end, pairs and real tokens; the logs; the profile."""

        def __init__(self, profile: int):
            self.clock, self.wall, self.logs, self.pairs, self.tokens = StepClock(profile), [], [], 0, 0

        def count(self, inputs: dict) -> None:  # per micro-batch: chosen rows, then rejected rows
            self.pairs += len(inputs["input_ids"]) // 2
            self.tokens += int(inputs["attention_mask"].sum())

        def on_train_begin(self, *_, **__):
            self.clock.last, self.last_wall = time.process_time(), time.perf_counter()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            self.wall.append(now - self.last_wall)
            self.clock.tick(self.pairs, self.tokens)
            self.pairs = self.tokens = 0
            self.last_wall = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "loss" in logs:
                self.logs.append({"step": state.global_step, **{f"train/{k}": logs[k] for k in METRICS}})

    meter = StepMeter(args.profile)

    class CountingDPOTrainer(DPOTrainer):
        # The only addition to DPOTrainer: hand each micro-batch to the meter (a callback never sees the batches).
        def training_step(self, model, inputs, num_items_in_batch=None):
            meter.count(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    set_seed(s["seed"])  # the recipe's set_seed before its model and LoRA: the same A matrices
    trainer = CountingDPOTrainer(
        model=s["model_dir"],
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[meter],
    )
    ids_check = check_ids(trainer, tokenizer, train, s) if args.check_ids else None
    trainer.train()
    peak = peak_memory_gib([trainer.accelerator.device])  # before the save, as the recipe's
    trainer.save_model(str(out))
    steps = meter.clock.steps
    results = {
        "steps": steps,
        "wall_step_s": meter.wall,
        "train/log": meter.logs,
        "memory/peak_gib": peak,
        "ids_check": ids_check,
        "profile": meter.clock.summary,
        "completed_steps": trainer.state.global_step,
        "trl/padding_free": config.padding_free,
        "trl/precompute_ref_log_probs": config.precompute_ref_log_probs,
        "torch_threads": torch.get_num_threads(),
    }
    (out / "trl_results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def check_ids(trainer, tokenizer, raw, s: dict) -> dict:
    """Every training pair: TRL's rows (prepared dataset, then its collator's keep_start cut) against the recipe's
    ``tokenize_pair``: the pairs both keep, the ids of prompt + chosen and prompt + rejected, and where the completion
    starts."""
    from dpo_kit.preference_data import tokenize_pair  # what the recipe tokenizes with

    length = s["max_length"]
    kept = [pair for row in raw if not (pair := tokenize_pair(row, "conversational", tokenizer, length))["dropped"]]
    differing = [] if len(kept) == len(trainer.train_dataset) else ["the pairs kept"]
    for index, (ours, theirs) in enumerate(zip(kept, trainer.train_dataset)):
        for column in ("chosen_ids", "rejected_ids"):
            if ours["prompt_ids"] + ours[column] != (theirs["prompt_ids"] + theirs[column])[:length] or len(
                ours["prompt_ids"]
            ) != min(len(theirs["prompt_ids"]), length):
                differing.append(f"train[{index}].{column}")
    return {
        "pairs_checked": len(raw),
        "pairs_prepared_by_trl": len(trainer.train_dataset),
        "differing": differing[:20],
        "num_differing": len(differing),
        "pairs_dropped_by_recipe": len(raw) - len(kept),
    }


# ------------------------------------------------------------------------------------------ the runs
def launch(command: list[str], out: Path, s: dict) -> float:
    """One launch; its wall time. Its output goes to OUT/launch.log."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": str(s["threads_per_process"]),
    }
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / "launch.log").write_text(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({' '.join(command)}):\n{done.stdout[-4000:]}")
    return time.perf_counter() - started


def side(steps: list[dict], warmup: int, wall: list[float], peak: dict, train_log: list[dict]) -> dict:
    """One side's numbers over its measured steps (the first ``warmup`` left out)."""
    measured = steps[warmup:]
    cpu = sum(step["cpu_s"] for step in measured)
    pairs, tokens = sum(step["samples"] for step in measured), sum(step["tokens"] for step in measured)
    return {
        "perf/samples_per_cpu_s": pairs / cpu,
        "perf/tokens_per_cpu_s": tokens / cpu,
        "perf/samples_per_sec": pairs / sum(wall[warmup:]),
        "perf/cpu_step_s": statistics.median(step["cpu_s"] for step in measured),
        "perf/samples_per_step": pairs / len(measured),
        "perf/tokens_per_step": tokens / len(measured),
        "perf/tokens_per_step_each": [s["tokens"] for s in steps],
        "memory/peak_gib": peak,
        "train/log": train_log,
    }


def recipe_side(out: Path, warmup: int) -> dict:
    clock, results = json.loads((out / "cpu_clock.json").read_text()), json.loads((out / "results.json").read_text())
    # The recipe's own wall-clock pairs/s over its measured steps; per-step wall times are its RunRecord's.
    wall = [0.0] * warmup + [results["perf/samples_per_step"] / results["perf/samples_per_sec"]] * (
        len(clock["steps"]) - warmup
    )
    return side(clock["steps"], warmup, wall, results["memory/peak_gib"], results["train/log"]) | {
        "train/loss_curve": results["train/loss_curve"],
        "profile": clock["profile"],
    }


def trl_side(out: Path, warmup: int) -> dict:
    results = json.loads((out / "trl_results.json").read_text())
    return side(results["steps"], warmup, results["wall_step_s"], results["memory/peak_gib"], results["train/log"]) | {
        "ids_check": results["ids_check"],
        "profile": results["profile"],
    }


def equality(recipe: dict, trl: dict) -> dict:
    """Per step: the loss of both and each metric's largest difference (both logged every step)."""
    by_step = {row["step"]: row for row in trl["train/log"]}
    rows = [(row, by_step[row["step"]]) for row in recipe["train/log"] if row["step"] in by_step]
    loss_diffs = [abs(a["train/loss"] - b["train/loss"]) for a, b in rows]
    return {
        "steps": len(rows),
        "loss_recipe": [a["train/loss"] for a, _ in rows],
        "loss_trl": [b["train/loss"] for _, b in rows],
        "loss_abs_diff": loss_diffs,
        "max_loss_abs_diff": max(loss_diffs),
        "within_tolerance": max(loss_diffs) <= LOSS_TOLERANCE,
        "tolerance": LOSS_TOLERANCE,
        "metrics_max_abs_diff": {
            name: max(abs(a[f"train/{name}"] - b[f"train/{name}"]) for a, b in rows) for name in METRICS
        },
        "last_step": {
            "recipe": {k: v for k, v in rows[-1][0].items() if k.removeprefix("train/") in METRICS},
            "trl": {k: v for k, v in rows[-1][1].items() if k.removeprefix("train/") in METRICS},
        },
    }


def ratio_rows(rounds: list[dict]) -> list[dict]:
    rows = []
    for label, key in (
        ("pairs per CPU-second", "perf/samples_per_cpu_s"),
        ("pairs/s (wall)", "perf/samples_per_sec"),
        ("peak RSS", "memory/peak_gib"),
    ):
        paired = [value_of(r["recipe"], key) / value_of(r["trl"], key) for r in rounds]
        rows.append(
            {
                "ratio": f"{label}, recipe / TRL",
                "key": key,
                "median": statistics.median(paired),
                "interval": bootstrap_interval(paired),
                "rounds": paired,
            }
        )
    return rows


def markdown(report: dict) -> str:
    s, m, eq, ad = report["settings"], report["machine"], report["equality"], report["adapters_recipe_vs_trl"]
    work, ids = report["equal_work"], report["ids_check"]
    lines = [
        "# recipes/dpo.py vs TRL DPOTrainer",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_cores']} cores (flags: {', '.join(m['cpu_flags'])}), {m['memory_gib']} "
        "GiB, shared with other jobs (times are process CPU time); "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        "",
        f"Settings (both sides): preset `{s['preset']}`, model {s['model']}, fp32, 1 process, "
        f"{s['threads_per_process']} thread; LoRA r {s['lora_r']} alpha {s['lora_alpha']} dropout {s['lora_dropout']} "
        f"on {s['lora_target_modules']}; DPO {s['loss_type']}, beta {s['beta']}; {s['per_device_train_batch_size']} "
        f"pairs x {s['gradient_accumulation_steps']} accumulation; max_length {s['max_length']} (keep_start); "
        f"{s['max_train_steps']} steps ({s['perf_warmup_steps']} warm-up left out of the "
        f"speed); lr {s['learning_rate']} {s['lr_scheduler_type']}, no warm-up, AdamW eps {s['adam_epsilon']}, clip "
        f"{s['max_grad_norm']}, seed {s['seed']}.",
        "",
        "## Equal to TRL",
        "",
        f"Token ids: {ids['pairs_checked']} training pairs, {ids['num_differing']} rows differ (TRL prepared "
        f"{ids['pairs_prepared_by_trl']}; the recipe dropped {ids['pairs_dropped_by_recipe']}).",
        "Work per optimizer step: "
        + ", ".join(
            f"{k.replace('_', ' ')} recipe {v['recipe']:,.1f}, TRL {v['trl']:,.1f}"
            for k, v in work.items()
            if isinstance(v, dict)
        )
        + f" ({'equal' if work['equal'] else 'NOT equal'} within {work['tolerance']:.0%}; every step: "
        f"{'identical' if report['tokens_every_step_equal'] else 'different'} token counts).",
        f"Per-step loss, round 0: largest |recipe - TRL| {eq['max_loss_abs_diff']:.2e} over {eq['steps']} steps "
        f"({'within' if eq['within_tolerance'] else 'BEYOND'} {eq['tolerance']:g}).",
        "Largest difference of TRL's metrics over the steps: "
        + ", ".join(f"{k} {v:.2e}" for k, v in eq["metrics_max_abs_diff"].items())
        + ".",
        f"Adapters (saved LoRA weights, {ad.get('tensors')} tensors): largest absolute difference "
        f"{ad.get('max_abs_diff', float('nan')):.2e} (largest weight {ad.get('max_abs_value', float('nan')):.3f}), "
        f"norm of the difference / norm {ad.get('relative_diff', float('nan')):.2e}.",
        "",
        "| step | loss recipe | loss TRL | abs diff |",
        "| --- | --- | --- | --- |",
        *(
            f"| {i + 1} | {a:.6f} | {b:.6f} | {d:.1e} |"
            for i, (a, b, d) in enumerate(zip(eq["loss_recipe"], eq["loss_trl"], eq["loss_abs_diff"]))
        ),
        "",
        "| last step | " + " | ".join(METRICS) + " |",
        "| --- |" + " --- |" * len(METRICS),
        *(
            f"| {name} | " + " | ".join(f"{eq['last_step'][name]['train/' + k]:.5f}" for k in METRICS) + " |"
            for name in ("recipe", "trl")
        ),
        "",
        "## Faster than TRL",
        "",
    ]
    if report.get("refused"):
        return "\n".join([*lines, f"**{report['refused']}**", ""])
    lines += ["| ratio | median of rounds | 95 % interval | per round |", "| --- | --- | --- | --- |"]
    for row in report["summary"]:
        interval = f"[{row['interval'][0]:.3f}, {row['interval'][1]:.3f}]" if row["interval"] else "- (< 3 rounds)"
        lines.append(
            f"| {row['ratio']} | **{row['median']:.3f}** | {interval} | "
            + ", ".join(f"{v:.3f}" for v in row["rounds"])
            + " |"
        )
    lines += [
        "",
        "| round | side | pairs per CPU-s | tokens per CPU-s | step CPU s (median) | pairs/s wall | peak RSS GiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rounds"]:
        for name in ("recipe", "trl"):
            v = r[name]
            lines.append(
                f"| {r['round']} | {name} | {v['perf/samples_per_cpu_s']:.2f} | {v['perf/tokens_per_cpu_s']:.0f}"
                f" | {v['perf/cpu_step_s']:.3f} | {v['perf/samples_per_sec']:.2f} | "
                + ", ".join(f"{d} {g:.3f}" for d, g in v["memory/peak_gib"].items())
                + " |"
            )
    profiles = report.get("profile") or {}
    if all(profiles.get(name) for name in ("recipe", "trl")):
        kinds = list(profiles["recipe"]["by_kind_s"])
        # The profiler's clock is each operation's wall time, which a shared machine inflates unevenly between
        # launches: its shares within a side, times that side's measured CPU time per step, compare the sides.
        step = {name: statistics.median(r[name]["perf/cpu_step_s"] for r in report["rounds"]) for name in profiles}
        lines += [
            "",
            f"Where a step goes: torch.profiler around step {report['profile_step']} of round 0 (a warm-up step), "
            "each kind of operation's share of the self time, and that share of the side's median CPU time per "
            "measured step (the profiler's own seconds are wall time, inflated by the other jobs on this machine).",
            "",
            "| side | CPU s per step | " + " | ".join(kinds) + " |",
            "| --- |" + " --- |" * (len(kinds) + 1),
        ]
        lines += [
            f"| {name} | {step[name]:.3f} | "
            + " | ".join(
                f"{p['by_kind_s'][k] / p['self_cpu_s']:.0%} ({p['by_kind_s'][k] / p['self_cpu_s'] * step[name]:.3f})"
                for k in kinds
            )
            + " |"
            for name, p in profiles.items()
        ]
        for name, p in profiles.items():
            lines += [
                "",
                f"Top operations, {name}: "
                + "; ".join(
                    f"{op['op']} {op['self_cpu_s'] / p['self_cpu_s']:.0%} x{op['calls']}" for op in p["top"][:10]
                )
                + ".",
            ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--clocked_recipe"]:  # A's wrapper: then the profiled step, then the recipe's command line
        clocked_recipe(argv[1:])
        return 0
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    s = {**SHARED_DEFAULTS, **PRESETS[args.preset], "preset": args.preset}
    if args.profile_step > s["perf_warmup_steps"]:
        raise SystemExit(f"--profile_step {args.profile_step} would be timed: profile a warm-up step")
    if args.max_train_steps:
        s["max_train_steps"] = args.max_train_steps
    output_dir = Path(args.output_dir).resolve()
    relative = output_dir.relative_to(REPO) if output_dir.is_relative_to(REPO) else Path(output_dir.name)
    work = Path(args.work_dir).resolve() if args.work_dir else REPO / "outputs" / "dpo_vs_trl_work" / relative
    work.mkdir(parents=True, exist_ok=True)
    paths = build_inputs(work, s) if not args.dry_run else (work / "model", work / "train", work / "validation")
    s.update(model_dir=str(paths[0]), train_file=str(paths[1]), validation_file=str(paths[2]))
    settings_file = work / "settings.json"
    settings_file.write_text(json.dumps(s, indent=2) + "\n")

    def trl_command(out: Path, first: bool, profile: int = -1) -> list[str]:
        return [
            *launcher(),
            str(Path(__file__).resolve()),
            "--trl_worker",
            "--settings",
            str(settings_file),
            "--output_dir",
            str(out),
            "--profile",
            str(profile),
            *(["--check_ids"] if first else []),
        ]

    if args.dry_run:
        print(
            json.dumps(s, indent=2),
            "\nA:",
            " ".join(recipe_command(s, work / "recipe_r0")),
            "\nB:",
            " ".join(trl_command(work / "trl_r0", True)),
        )
        return 0
    rounds, warmup = [], s["perf_warmup_steps"]
    for index in range(args.repeats):
        recipe_out, trl_out = work / f"recipe_r{index}", work / f"trl_r{index}"
        profile = args.profile_step if index == 0 else -1  # a warm-up step of round 0: outside the timing
        launch(recipe_command(s, recipe_out, profile), recipe_out, s)
        launch(trl_command(trl_out, index == 0, profile), trl_out, s)
        rounds.append({"round": index, "recipe": recipe_side(recipe_out, warmup), "trl": trl_side(trl_out, warmup)})
        a, b = rounds[-1]["recipe"], rounds[-1]["trl"]
        print(
            f"round {index}: pairs per CPU-s recipe {a['perf/samples_per_cpu_s']:.3f}, TRL "
            f"{b['perf/samples_per_cpu_s']:.3f}; loss diff {equality(a, b)['max_loss_abs_diff']:.2e}",
            flush=True,
        )
    first = rounds[0]
    work_check = equal_work(
        {
            name: {
                "tokens_per_step": first[name]["perf/tokens_per_step"],
                "samples_per_step": first[name]["perf/samples_per_step"],
            }
            for name in ("recipe", "trl")
        }
    )
    ids = first["trl"].pop("ids_check")
    refused = None
    if not work_check["equal"]:
        refused = f"Unequal work per optimizer step ({unequal_work_text(work_check)}): no speed verdict."
    elif ids["num_differing"]:
        refused = f"{ids['num_differing']} rows tokenized differently: the sides train on different pairs."
    profile = {name: rounds[0][name]["profile"] for name in ("recipe", "trl")}
    report = {
        "benchmark": "dpo_vs_trl",
        "command": "python benchmarks/studies/dpo_vs_trl.py " + " ".join(argv),
        "settings": {k: v for k, v in s.items() if not k.endswith(("_dir", "_file"))},
        "rounds": rounds,
        "ids_check": ids,
        "equal_work": work_check,
        "tokens_every_step_equal": first["recipe"]["perf/tokens_per_step_each"]
        == first["trl"]["perf/tokens_per_step_each"],
        "equality": equality(first["recipe"], first["trl"]),
        "adapters_recipe_vs_trl": adapter_difference(work / "recipe_r0", work / "trl_r0"),
        "refused": refused,
        "summary": [] if refused else ratio_rows(rounds),
        "profile_step": args.profile_step,
        "profile": profile,
        "machine": machine_info(),
        "versions": library_versions([*LIBRARIES, "trl", "peft"]),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "dpo_vs_trl.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (output_dir / "summary.md").write_text(text)
    print(text)
    return 1 if refused or not report["equality"]["within_tolerance"] else 0


if __name__ == "__main__":
    sys.exit(main())
