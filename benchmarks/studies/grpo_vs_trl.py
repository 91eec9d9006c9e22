"""recipes/grpo.py against TRL's GRPOTrainer on the same completions: equal per-step losses and LoRA gradients.

    python benchmarks/studies/grpo_vs_trl.py --output_dir benchmarks/results/cpu-grpo-vs-trl     # every case
    python benchmarks/studies/grpo_vs_trl.py --cases dapo --output_dir outputs/grpo_vs_trl_one      # one case
    python benchmarks/studies/grpo_vs_trl.py --dry_run --output_dir outputs/grpo_vs_trl             # the plan
    python benchmarks/studies/grpo_vs_trl.py --speed --output_dir benchmarks/results/cpu-grpo-speed  # completions/s
    python benchmarks/studies/grpo_vs_trl.py --speed --processes 1 --speed_cases lora --output_dir outputs/speed1

Both sides train a tiny Llama (random weights, seed 0, untied, fp32, a byte-level BPE tokenizer with the recipe's
default chat template) with a LoRA adapter on the recipe's offline prompts (standard-library questions as
conversations, with their ``answer``), rewarded by the recipe's own ``accuracy`` function, which TRL calls in its
signature. Neither side samples: both score the completions of ``harness.fixed_completions`` (the tests' own, in
tests/harness/; the recipe through a runpy wrapper that replaces its generator, ``--recipe_side``; TRL through a
subclass whose ``_generate_single_turn`` returns them, ``--trl_worker``), so both train on the same tokens. The
prompts come in the same order: the recipe's epoch 0 is TRL's ``RepeatSampler`` permutation.

Each case sets TRL's loss options on both sides (a loss type, ``beta`` > 0 for the KL term against the adapter
switched off, ``num_iterations`` 2, so that every second step's ratio is against the policy that generated) and runs
``STEPS`` optimizer steps, one process (one case with accumulation, ``CASES``). Compared at
every step: the loss (the recipe's ``train/loss_curve``; TRL's ``compute_loss`` summed over the step, unrounded), and
every LoRA gradient as the optimizer sees it (after clipping: a step pre-hook on both sides, by parameter name). Equal
means within ``TOLERANCE`` (absolute). Aligned, TRL's defaults that differ from the recipe's: ``bf16=False``,
``gradient_checkpointing=False``, the recipe's fused AdamW (with an epsilon of 1e-4, so that an update reads out its
gradient rather than its sign), ``logging_steps=1``, ``set_seed`` before each side builds its adapter.

``--speed`` measures instead: both sides sample (no fixed completions), colocated, ``--processes`` (default 2: DDP
over gloo, ``accelerate_configs/ddp_2gpu.yaml``) of 1 thread each, on a larger Llama (``SPEED``: 3.7M parameters,
completions of up to 32 tokens, which its random weights almost never end early, so both sides generate and train the
same tokens), with a LoRA adapter and with every weight trained (``SPEED_CASES``), rounds A B A B; completions
generated per second after the warm-up steps (the recipe's ``perf/completions_per_sec``; TRL's from a callback's clock
at each step end on the main process, times the processes), the ratio recipe / TRL per round with its 95 % interval.
Equal work is checked and recorded for every round: the same global batch of completions per step, measured steps,
generations per prompt and completion length, and mean completion lengths within 2 %.

Writes ``OUTPUT_DIR/grpo_vs_trl.json`` and ``OUTPUT_DIR/summary.md``; runs and model go to --work_dir (default
``outputs/grpo_vs_trl_work/<OUTPUT_DIR>``). Exits 1 when a case differs beyond the tolerance. Never part of the test
command (tests/test_benchmarks.py runs one case where TRL is installed).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# lib/, shared/, the recipes' kits, and the tests' harness (the completions both sides score: the same tokens)
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "recipes"), str(REPO / "tests")]
from harness.fixed_completions import fixed_completions, patch_recipe_generator
from lib.grpo_inputs import SPEED_MODEL, SPEED_VOCAB_SIZE, build_inputs  # the tiny Llama and the prompts

# a side in its own processes; the recipe unchanged in a wrapper
from lib.launch import accelerate_launch, launch_and_wait, run_as_main
from lib.machine import library_versions, machine_info  # as every record
from lib.stats import bootstrap_interval  # 95 % interval of a median ratio
from lib.trl_side import lora_config, trainer_arguments  # TRL set up as the recipe trains

RECIPE = REPO / "recipes" / "grpo.py"
STEPS = 4
TOLERANCE = 1e-6
SHARED = {
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "lora_target_modules": "all-linear",
    "learning_rate": 1e-2,
    "lr_scheduler_type": "linear",
    "num_warmup_steps": 0,
    "weight_decay": 0.0,
    "adam_epsilon": 1e-4,
    "max_grad_norm": 1.0,
    "seed": 42,
    "logging_steps": 1,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "max_train_steps": STEPS,
    "num_generations": 4,
    "max_completion_length": 6,
    "temperature": 1.0,
    "beta": 0.04,
    "epsilon": 0.2,
    "epsilon_high": 0.2,
    "num_iterations": 2,
    "scale_rewards": "group",
    "loss_type": "dapo",
    "mask_truncated_completions": False,
}
# Each loss type with the KL term and a second iteration; DAPO over 2 accumulated micro-batches (TRL shuffles a step's
# completions before splitting them, the recipe keeps their order: equal for the loss types that normalise over the
# whole step, not for bnpo, which TRL normalises per micro-batch); then DAPO's own clipping with the other options.
CASES = {
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dapo_accumulation": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2},
    "dapo_options": {
        "epsilon_high": 0.28,
        "temperature": 0.7,
        "scale_rewards": "batch",
        "mask_truncated_completions": True,
        "beta": 0.1,
    },
}
# The speed comparison: a model whose step is compute (hidden 256, 4 layers, a 4,096-token vocabulary), completions of
# 32 tokens, 2 prompts x 8 completions a step, no KL term and one step per round (TRL's defaults).
SPEED = {
    "model": SPEED_MODEL,
    "vocab_size": SPEED_VOCAB_SIZE,
    "max_completion_length": 32,
    "num_generations": 8,
    "per_device_train_batch_size": 16,
    "beta": 0.0,
    "num_iterations": 1,
    "max_train_steps": 12,
    "perf_warmup_steps": 2,
    "learning_rate": 1e-4,
}
# Each speed case on both sides: a LoRA adapter (the recipe's default), and every weight trained (``--full_finetune``;
# TRL without a peft_config).
SPEED_CASES = {"lora": {}, "full": {"full_finetune": True}}
TINY = {"model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}}
RECIPE_FLAGS = [
    name for name in SHARED if name not in ("lora_target_modules", "mask_truncated_completions", "logging_steps")
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where grpo_vs_trl.json and summary.md go.")
    parser.add_argument("--work_dir", help="Runs and model (default: outputs/grpo_vs_trl_work/<output_dir>).")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="Which cases to run.")
    parser.add_argument("--dry_run", action="store_true", help="Print the cases and both command lines.")
    parser.add_argument("--speed", action="store_true", help="Measure completions/s instead (SPEED), rounds A B.")
    parser.add_argument("--repeats", type=int, default=3, help="--speed: A B rounds (3 or more give an interval).")
    parser.add_argument("--processes", type=int, default=2, help="--speed: processes per side (DDP, 1 thread each).")
    parser.add_argument(
        "--speed_cases", nargs="+", choices=sorted(SPEED_CASES), default=list(SPEED_CASES), help="--speed: which."
    )
    parser.add_argument("--trl_worker", action="store_true", help=argparse.SUPPRESS)  # TRL's side, launched by main
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------ what both sides capture
def capture_gradients(out: Path, named_parameters) -> None:
    """At every optimizer step (a torch step pre-hook: after clipping), each trainable parameter's gradient by name,
    saved to ``out/gradients.pt`` as the steps go. ``named_parameters()`` is called at the first step."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    steps = []

    def hook(optimizer, args, kwargs):
        names = {id(p): n for n, p in named_parameters() if p.requires_grad}
        steps.append({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]})
        torch.save(steps, out / "gradients.pt")

    register_optimizer_step_pre_hook(hook)


def recipe_side(argv: list[str]) -> None:
    """The recipe, unchanged (runpy), on the fixed completions, its gradients captured: ``--recipe_side RECIPE
    FLAGS``. The model is the one the recipe hands ``Accelerator.prepare``."""
    import accelerate

    patch_recipe_generator()
    out, prepared = Path(argv[argv.index("--output_dir") + 1]), {}
    prepare = accelerate.Accelerator.prepare

    def remember(self, *args, **kwargs):
        prepared.setdefault("model", next(a for a in args if hasattr(a, "named_parameters")))
        return prepare(self, *args, **kwargs)

    accelerate.Accelerator.prepare = remember
    out.mkdir(parents=True, exist_ok=True)
    capture_gradients(out, lambda: prepared["model"].named_parameters())
    run_as_main(argv)


def trl_worker(args) -> None:
    """TRL's side: GRPOTrainer with the case's settings on the same model, prompts, reward and completions."""
    import datasets
    import torch
    from grpo_kit.rewards import accuracy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s, out = json.loads(Path(args.settings).read_text()), Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(s["model_dir"])
    tokenizer.pad_token = tokenizer.eos_token  # what the recipe's chat_tokenizer does when there is none
    losses, clock = [], []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.append(time.perf_counter())

    class FixedCompletions(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            return fixed_completions(prompt_ids, tokenizer, s["max_completion_length"]), None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(loss.item())
            return loss

    config = GRPOConfig(
        **trainer_arguments(s, out, bf16=False, gradient_checkpointing=False),
        num_generations=s["num_generations"],
        max_completion_length=s["max_completion_length"],
        temperature=s["temperature"],
        beta=s["beta"],
        epsilon=s["epsilon"],
        epsilon_high=s["epsilon_high"],
        num_iterations=s["num_iterations"],
        scale_rewards=s["scale_rewards"],
        loss_type=s["loss_type"],
        mask_truncated_completions=s["mask_truncated_completions"],
    )
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=torch.float32)
    trainer = (GRPOTrainer if s.get("speed") else FixedCompletions)(
        model=model,
        reward_funcs=accuracy,
        args=config,
        train_dataset=datasets.load_dataset("json", data_files=s["train_file"], split="train"),
        processing_class=tokenizer,
        peft_config=None if s.get("full_finetune") else lora_config(s),
        callbacks=[StepClock()],
    )
    if not s.get("speed"):
        capture_gradients(out, trainer.model.named_parameters)
    clock.append(time.perf_counter())
    trainer.train()
    per_step = s["gradient_accumulation_steps"]
    steps = [sum(losses[i : i + per_step]) for i in range(0, len(losses), per_step)]
    measured = [b - a for a, b in zip(clock, clock[1:])][s.get("perf_warmup_steps", 0) :]
    lengths = [
        entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry
    ]
    processes = trainer.accelerator.num_processes  # the clock is the main process's; completions every process's
    speed = (
        {
            "perf/completions_per_sec": len(measured) * s["per_device_train_batch_size"] * processes / sum(measured),
            "perf/measured_steps": len(measured),
            "global_batch_size": s["per_device_train_batch_size"] * processes,
            "num_processes": processes,
            "num_generations": trainer.num_generations,
            "max_completion_length": trainer.max_completion_length,
            "train/rewards": [entry["reward"] for entry in trainer.state.log_history if "reward" in entry],
            "model/trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        }
        if measured
        else {}
    )
    if trainer.accelerator.is_main_process:
        (out / "trl_results.json").write_text(
            json.dumps({"train/loss_curve": steps, "completions/mean_length": lengths, **speed}) + "\n"
        )


# ---------------------------------------------------------------------------------------------- comparing
def recipe_command(s: dict, out: Path) -> list[str]:
    """The recipe's own command line; for the equality through ``--recipe_side`` (fixed completions, gradients)."""
    flags = [word for key in RECIPE_FLAGS for word in (f"--{key}", str(s[key]))]
    flags += ["--mask_truncated_completions"] if s["mask_truncated_completions"] else []
    flags += ["--perf_warmup_steps", str(s["perf_warmup_steps"])] if s.get("speed") else []
    flags += ["--full_finetune"] if s.get("full_finetune") else []
    wrapper = [] if s.get("speed") else [sys.executable, str(Path(__file__).resolve()), "--recipe_side"]
    launcher = accelerate_launch("ddp_2gpu.yaml", "--num_processes", str(s["processes"])) if s.get("speed") else []
    return [
        *(launcher or wrapper or [sys.executable]),
        str(RECIPE),
        "--model_name_or_path",
        s["model_dir"],
        "--train_file",
        s["train_file"],
        "--validation_file",
        s["train_file"],
        *flags,
        "--lora_target_modules",
        s["lora_target_modules"],
        "--mixed_precision",
        "no",
        "--skip_eval",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
    ]


def trl_command(settings_file: Path, out: Path, processes: int = 0) -> list[str]:
    """TRL's worker; with ``processes``, under ``accelerate launch`` (DDP over gloo), as the recipe's speed side."""
    script = str(Path(__file__).resolve())
    launcher = accelerate_launch("ddp_2gpu.yaml", "--num_processes", str(processes)) if processes else [sys.executable]
    return [*launcher, script, "--trl_worker", "--settings", str(settings_file), "--output_dir", str(out)]


def compare(recipe_out: Path, trl_out: Path) -> dict:
    """Per step: both losses and their difference, and the largest gradient difference over the LoRA parameters."""
    import torch

    recipe_losses = json.loads((recipe_out / "results.json").read_text())["train/loss_curve"]
    trl_losses = json.loads((trl_out / "trl_results.json").read_text())["train/loss_curve"]
    recipe_grads, trl_grads = torch.load(recipe_out / "gradients.pt"), torch.load(trl_out / "gradients.pt")
    steps = []
    for step, (a, b, ga, gb) in enumerate(zip(recipe_losses, trl_losses, recipe_grads, trl_grads), start=1):
        assert ga.keys() == gb.keys(), (sorted(set(ga) ^ set(gb)))[:5]
        grad_diff = max(float((ga[n] - gb[n]).abs().max()) for n in ga)
        steps.append(
            {
                "step": step,
                "loss_recipe": a,
                "loss_trl": b,
                "loss_abs_diff": abs(a - b),
                "grad_max_abs_diff": grad_diff,
                "grad_max_abs": max(float(ga[n].abs().max()) for n in ga),
                "parameters": len(ga),
            }
        )
    worst = max(max(s["loss_abs_diff"], s["grad_max_abs_diff"]) for s in steps) if steps else float("inf")
    return {
        "steps": steps,
        "complete": len(steps) == STEPS,
        "worst": worst,
        "equal": len(steps) == STEPS and worst <= TOLERANCE,
    }


def markdown(report: dict) -> str:
    lines = [
        "# recipes/grpo.py vs TRL GRPOTrainer: the same completions, the same losses and gradients",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items() if v)}. Tolerance {TOLERANCE:g} "
        f"(absolute), {STEPS} steps per case, 1 process; settings shared by both sides: `{json.dumps(SHARED)}`.",
        "",
        "| case | options | step | loss recipe | loss TRL | loss diff | largest gradient diff (largest gradient) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, case in report["cases"].items():
        for s in case["comparison"]["steps"]:
            lines.append(
                f"| {name} | `{json.dumps(CASES[name])}` | {s['step']} | {s['loss_recipe']:.8f} | {s['loss_trl']:.8f} "
                f"| {s['loss_abs_diff']:.1e} | {s['grad_max_abs_diff']:.1e} ({s['grad_max_abs']:.1e}) |"
            )
    verdicts = [
        f"{name}: {'equal' if c['comparison']['equal'] else 'NOT equal'}" for name, c in report["cases"].items()
    ]
    return "\n".join([*lines, "", "Verdict: " + "; ".join(verdicts) + ".", ""])


def equal_work(a: dict, b: dict) -> dict:
    """What both sides of a speed round did, from their results: equal when the global batch of completions per
    step, the measured steps, the generations per prompt and the completion length agree, and the mean completion
    lengths (what the random weights sampled) are within 2 %."""
    lengths = (
        statistics.mean(e["train/completions/mean_length"] for e in a["train/log"]),
        statistics.mean(b["completions/mean_length"]),
    )
    config = a["config"]
    facts = {
        "global_batch_size": [a["global_batch_size"], b["global_batch_size"]],
        "measured_steps": [a["perf/measured_steps"], b["perf/measured_steps"]],
        "num_generations": [config["num_generations"], b["num_generations"]],
        "max_completion_length": [config["max_completion_length"], b["max_completion_length"]],
        "trainable_parameters": [a["model/trainable_parameters"], b["model/trainable_parameters"]],
    }
    same = all(x == y for x, y in facts.values()) and abs(lengths[0] / lengths[1] - 1) <= 0.02
    return {**facts, "mean_length": list(lengths), "equal": same}


def speed(args, argv: list[str], work: Path, output_dir: Path) -> int:
    """Completions per second of each side, colocated in ``--processes``, for each speed case, rounds A B A B; the
    ratio recipe / TRL per round, with its interval."""
    model_dir, train_file = build_inputs(work, SPEED["model"], SPEED["vocab_size"])
    cases, lines = {}, []
    for name in args.speed_cases:
        s = {
            **SHARED,
            **SPEED,
            **SPEED_CASES[name],
            "speed": True,
            "processes": args.processes,
            "logging_steps": 1,
            "model_dir": str(model_dir),
            "train_file": str(train_file),
        }
        settings_file = work / f"speed_{name}.json"
        settings_file.write_text(json.dumps(s, indent=2) + "\n")
        rounds = []
        for index in range(args.repeats):
            recipe_out, trl_out = work / f"speed_{name}_recipe_r{index}", work / f"speed_{name}_trl_r{index}"
            a = launch_and_wait(recipe_command(s, recipe_out), recipe_out, threads=1)
            b = launch_and_wait(
                trl_command(settings_file, trl_out, args.processes),
                trl_out,
                results_name="trl_results.json",
                threads=1,
            )
            rounds.append(
                {
                    "recipe": a["perf/completions_per_sec"],
                    "trl": b["perf/completions_per_sec"],
                    "ratio": a["perf/completions_per_sec"] / b["perf/completions_per_sec"],
                    "work": equal_work(a, b),
                    "rewards": [a["train/rewards"], b["train/rewards"]],
                    "foreign_share": [a.get("bench/foreign_share"), b.get("bench/foreign_share")],
                }
            )
            print(f"{name} round {index}: {json.dumps(rounds[-1])}", flush=True)
        equal = all(r["work"]["equal"] for r in rounds)
        ratios = [r["ratio"] for r in rounds]
        cases[name] = {
            "settings": {k: v for k, v in s.items() if not k.endswith(("_dir", "_file"))},
            "rounds": rounds,
            "equal_work": equal,
            "ratio": {"median": statistics.median(ratios), "interval": bootstrap_interval(ratios)} if equal else None,
        }
        lines += [
            f"## {name} ({args.processes} processes per side, colocated, 1 thread each)",
            "",
            f"Settings `{json.dumps(cases[name]['settings'])}`.",
            "",
            "| round | recipe completions/s | TRL completions/s | recipe / TRL | mean completion length recipe, TRL "
            "| other processes' CPU share recipe, TRL |",
            "| --- | --- | --- | --- | --- | --- |",
            *(
                f"| {i} | {r['recipe']:.2f} | {r['trl']:.2f} | {r['ratio']:.3f} | {r['work']['mean_length'][0]:.2f}, "
                f"{r['work']['mean_length'][1]:.2f} | {r['foreign_share'][0] or 0:.2f}, "
                f"{r['foreign_share'][1] or 0:.2f} |"
                for i, r in enumerate(rounds)
            ),
            "",
            (
                f"Median ratio {cases[name]['ratio']['median']:.3f}, 95 % interval "
                + (
                    f"[{cases[name]['ratio']['interval'][0]:.3f}, {cases[name]['ratio']['interval'][1]:.3f}]."
                    if cases[name]["ratio"]["interval"]
                    else "- (< 3 rounds)."
                )
                if equal
                else "Unequal work (see `rounds[].work` in grpo_vs_trl.json): no verdict."
            ),
            "",
        ]
    report = {
        "benchmark": "grpo_vs_trl --speed",
        "command": "python benchmarks/studies/grpo_vs_trl.py " + " ".join(argv),
        "processes": args.processes,
        "cases": cases,
        "machine": machine_info(),
        "versions": library_versions(["torch", "transformers", "accelerate", "peft", "trl"]),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "grpo_vs_trl.json").write_text(json.dumps(report, indent=2) + "\n")
    machine = report["machine"]
    lines = [
        "# recipes/grpo.py vs TRL GRPOTrainer: completions generated per second",
        "",
        f"Command: `{report['command']}`. CPU: {machine['cpu_model']}, {machine['cpu_cores']} cores, flags "
        f"{', '.join(machine['cpu_flags']) or '-'}; versions {json.dumps(report['versions'])}.",
        "",
        *lines,
    ]
    (output_dir / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if all(case["equal_work"] for case in cases.values()) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--recipe_side"]:
        recipe_side(argv[1:])
        return 0
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    output_dir = Path(args.output_dir).resolve()
    relative = output_dir.relative_to(REPO) if output_dir.is_relative_to(REPO) else Path(output_dir.name)
    work = Path(args.work_dir).resolve() if args.work_dir else REPO / "outputs" / "grpo_vs_trl_work" / relative
    work.mkdir(parents=True, exist_ok=True)
    if args.speed:
        return speed(args, argv, work, output_dir)
    model_dir, train_file = build_inputs(work, TINY["model"]) if not args.dry_run else (work / "m", work / "p")
    cases = {}
    for name in args.cases:
        s = {**SHARED, **CASES[name], "model_dir": str(model_dir), "train_file": str(train_file)}
        settings_file = work / f"{name}.json"
        settings_file.write_text(json.dumps(s, indent=2) + "\n")
        recipe_out, trl_out = work / f"recipe_{name}", work / f"trl_{name}"
        if args.dry_run:
            commands = " ".join(recipe_command(s, recipe_out)), " ".join(trl_command(settings_file, trl_out))
            print(f"{name}:\n  A: {commands[0]}\n  B: {commands[1]}")
            continue
        launch_and_wait(recipe_command(s, recipe_out), recipe_out, threads=1)
        launch_and_wait(trl_command(settings_file, trl_out), trl_out, results_name="trl_results.json", threads=1)
        cases[name] = {"settings": CASES[name], "comparison": compare(recipe_out, trl_out)}
        print(f"{name}: worst difference {cases[name]['comparison']['worst']:.2e}", flush=True)
    if args.dry_run:
        return 0
    report = {
        "benchmark": "grpo_vs_trl",
        "command": "python benchmarks/studies/grpo_vs_trl.py " + " ".join(argv),
        "shared_settings": SHARED,
        "cases": cases,
        "tolerance": TOLERANCE,
        "machine": machine_info(),
        "versions": library_versions(["torch", "transformers", "accelerate", "peft", "trl"]),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "grpo_vs_trl.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (output_dir / "summary.md").write_text(text)
    print(text)
    return 0 if all(case["comparison"]["equal"] for case in cases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
