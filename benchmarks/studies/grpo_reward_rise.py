"""recipes/grpo.py against TRL's GRPOTrainer on a model that learns: the reward per step and the held-out exact match
before and after, both sides from the same SFT adapter on the same task.

    python benchmarks/studies/grpo_reward_rise.py --output_dir benchmarks/results/cpu-grpo-reward-rise
    python benchmarks/studies/grpo_reward_rise.py --dry_run --output_dir outputs/grpo_reward_rise     # the plan

The task is the recipe's offline default: the adapter ``recipes/llm_finetune.py`` saved by default
(``--adapter_name_or_path``, default ``outputs/llm_finetune``; where there is none, the study first runs that
recipe's offline default into the work folder, which pretrains its base first: minutes more) continued on the
standard-library questions (``grpo_kit.data.stdlib_name_prompts``: is this name a class, a function or a method?),
rewarded by the recipe's ``accuracy`` (exact match of the answer), which TRL calls in its
signature. Both sides train the same adapter (TRL: PEFT's ``PeftModel.from_pretrained(..., is_trainable=True)``, no
new adapter) with the offline default's settings (``SETTINGS``: the recipe's ``OFFLINE_SETTINGS`` but the steps) and
TRL's defaults otherwise (``beta`` 0, one step per round, DAPO), ``--max_train_steps`` steps each, one process of
``--threads`` threads, the recipe first. Each side samples with its own sampler and visits the prompts in its own
order (the same distribution, other draws), so single steps differ; their means are what is compared.

Recorded per side: ``train/rewards`` (the mean reward of each step's completions; TRL's ``reward`` logged every
step) and its mean by quarter of the run; the exact match of greedy answers to every held-out question (144) before
(the SFT adapter) and after (each side's saved adapter), scored here by the same code (``llm_kit.sft_eval``) on the
same questions. Equal work is checked and recorded: the same steps, completions per step, generations per prompt,
completion length, learning rate and trainable parameters. Exits 1 when the work differs.

Writes ``OUTPUT_DIR/grpo_reward_rise.json`` and ``OUTPUT_DIR/summary.md``; runs go to --work_dir (default
``outputs/grpo_reward_rise_work/<OUTPUT_DIR>``). Never part of the test command.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "recipes")]  # lib/, shared/, the recipes' kits
from lib.launch import launch_and_wait  # a side in its own processes
from lib.machine import library_versions, machine_info  # as every record
from lib.trl_side import trainer_arguments  # TRL set up as the recipe trains

from grpo import OFFLINE_SETTINGS  # the recipe's offline default

RECIPE = REPO / "recipes" / "grpo.py"
# recipes/grpo.py's OFFLINE_SETTINGS (the offline default, imported: what this study measures) but the steps and the
# held-out scoring (done here, by the same code for both sides), and the other flags both sides share.
SETTINGS = {k: v for k, v in OFFLINE_SETTINGS.items() if k not in ("max_train_steps", "exact_match_samples")} | {
    "gradient_accumulation_steps": 1,
    "lr_scheduler_type": "linear",
    "num_warmup_steps": 0,
    "weight_decay": 0.0,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "logging_steps": 1,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where grpo_reward_rise.json and summary.md go.")
    parser.add_argument("--work_dir", help="Runs (default: outputs/grpo_reward_rise_work/<output_dir>).")
    parser.add_argument(
        "--adapter_name_or_path", default="outputs/llm_finetune", help="The SFT adapter both continue."
    )
    parser.add_argument("--max_train_steps", type=int, default=200, help="Optimizer steps of each side.")
    parser.add_argument("--seed", type=int, default=42, help="Both sides' seed.")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of each side's one process.")
    parser.add_argument("--dry_run", action="store_true", help="Print both command lines.")
    parser.add_argument("--trl_worker", action="store_true", help=argparse.SUPPRESS)  # TRL's side, launched by main
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def offline_prompts(split: str):
    """The recipe's offline prompts (conversations with their ``answer``), ``train`` or ``validation``."""
    from grpo_kit.data import stdlib_name_prompts

    return stdlib_name_prompts()[split]


def policy_tokenizer(base: str):
    """The tokenizer as the recipe sets it up (``llm_kit.sft_data.chat_tokenizer``, ``add_chat_template``): the
    base's, its end-of-sequence token as padding when it has none, the recipe's chat template when it has none."""
    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def trl_worker(args) -> None:
    """TRL's side: GRPOTrainer continuing the SFT adapter on the offline prompts, its reward logged every step; the
    adapter saved to ``--output_dir``."""
    import torch
    from grpo_kit.rewards import accuracy
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    s, out = json.loads(Path(args.settings).read_text()), Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = policy_tokenizer(s["base"])
    base = AutoModelForCausalLM.from_pretrained(s["base"], dtype=torch.float32)
    torch.manual_seed(s["seed"])
    model = PeftModel.from_pretrained(base, s["adapter"], is_trainable=True)
    config = GRPOConfig(
        **trainer_arguments(s, out, bf16=False, gradient_checkpointing=False),
        num_generations=s["num_generations"],
        max_completion_length=s["max_completion_length"],
        temperature=s["temperature"],
        top_k=s["top_k"],
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=accuracy,
        args=config,
        train_dataset=offline_prompts("train"),
        processing_class=tokenizer,
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    trainer.model.save_pretrained(out)
    log = trainer.state.log_history
    results = {
        "train/rewards": [entry["reward"] for entry in log if "reward" in entry],
        "global_batch_size": s["per_device_train_batch_size"] * trainer.accelerator.num_processes,
        "num_generations": trainer.num_generations,
        "max_completion_length": trainer.max_completion_length,
        "learning_rate": trainer.args.learning_rate,
        "steps": trainer.state.global_step,
        "model/trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "completions/mean_length": [entry["completions/mean_length"] for entry in log if "reward" in entry],
        "train_wall_s": wall,
    }
    (out / "trl_results.json").write_text(json.dumps(results) + "\n")


def recipe_command(s: dict, out: Path) -> list[str]:
    """The recipe continuing the adapter on its offline prompts (no --train_file) with the shared settings; its own
    exact match skipped (scored here, as TRL's)."""
    flags = [word for key, value in SETTINGS.items() for word in (f"--{key}", str(value))]
    return [
        sys.executable,
        str(RECIPE),
        "--adapter_name_or_path",
        s["adapter"],
        *flags,
        "--max_train_steps",
        str(s["max_train_steps"]),
        "--seed",
        str(s["seed"]),
        "--mixed_precision",
        "no",
        "--skip_eval",
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
    ]


def trl_command(settings_file: Path, out: Path) -> list[str]:
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--trl_worker", "--settings", str(settings_file), "--output_dir", str(out)]


def held_out_exact_match(base: str, adapters: dict[str, str]) -> dict[str, float]:
    """The exact match of greedy answers to every held-out offline question, for each adapter of ``adapters``
    (name: folder) on ``base``, by the SFT recipe's scorer (``llm_kit.sft_eval.exact_match``)."""
    import torch
    from grpo_kit.data import as_sft_rows
    from llm_kit.sft_eval import exact_match
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokenizer = policy_tokenizer(base)
    rows, fmt = as_sft_rows(offline_prompts("validation"), "conversational")
    scores = {}
    for name, folder in adapters.items():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, folder).eval()
        scores[name], _ = exact_match(model, tokenizer, rows, fmt, torch.device("cpu"))
        print(f"held-out exact match, {name}: {scores[name]:.1%} of {len(rows)}", flush=True)
    return scores


def quarters(values: list[float]) -> list[float]:
    """The mean of each quarter of ``values`` (a run's steps in order)."""
    size = len(values) / 4
    return [statistics.mean(values[round(i * size) : round((i + 1) * size)]) for i in range(4)]


def equal_work(a: dict, b: dict, s: dict) -> dict:
    """What both sides did, from their results: equal when the steps, completions per step, generations per prompt,
    completion length, learning rate and trainable parameters agree."""
    config = a["config"]
    facts = {
        "steps": [len(a["train/rewards"]), b["steps"]],
        "global_batch_size": [a["global_batch_size"], b["global_batch_size"]],
        "num_generations": [config["num_generations"], b["num_generations"]],
        "max_completion_length": [config["max_completion_length"], b["max_completion_length"]],
        "learning_rate": [config["learning_rate"], b["learning_rate"]],
        "trainable_parameters": [a["model/trainable_parameters"], b["model/trainable_parameters"]],
    }
    same = all(x == y for x, y in facts.values()) and facts["steps"][0] == s["max_train_steps"]
    return {**facts, "equal": same}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    output_dir = Path(args.output_dir).resolve()
    relative = output_dir.relative_to(REPO) if output_dir.is_relative_to(REPO) else Path(output_dir.name)
    work = Path(args.work_dir).resolve() if args.work_dir else REPO / "outputs" / "grpo_reward_rise_work" / relative
    adapter = Path(args.adapter_name_or_path).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not (adapter / "adapter_config.json").is_file() and not args.dry_run:  # the SFT recipe's offline default
        adapter = work / "sft"
        if not (adapter / "adapter_config.json").is_file():
            sft = [sys.executable, str(REPO / "recipes" / "llm_finetune.py"), "--output_dir", str(adapter)]
            print(f"no SFT adapter in {args.adapter_name_or_path}: making one, {' '.join(sft)}", flush=True)
            launch_and_wait([*sft, "--overwrite_output_dir"], adapter, threads=args.threads)
    config_file = adapter / "adapter_config.json"
    base = json.loads(config_file.read_text())["base_model_name_or_path"] if config_file.is_file() else "<base>"
    s = {**SETTINGS, "max_train_steps": args.max_train_steps, "seed": args.seed, "adapter": str(adapter), "base": base}
    settings_file = work / "settings.json"
    settings_file.write_text(json.dumps(s, indent=2) + "\n")
    recipe_out, trl_out = work / "recipe", work / "trl"
    if args.dry_run:
        print(f"A: {' '.join(recipe_command(s, recipe_out))}\nB: {' '.join(trl_command(settings_file, trl_out))}")
        return 0
    a = launch_and_wait(recipe_command(s, recipe_out), recipe_out, threads=args.threads)
    b = launch_and_wait(trl_command(settings_file, trl_out), trl_out, results_name="trl_results.json", threads=1)
    exact = held_out_exact_match(base, {"before": str(adapter), "recipe": str(recipe_out), "trl": str(trl_out)})
    work_done = equal_work(a, b, s)
    sides = {
        name: {
            "train/rewards": side["train/rewards"],
            "reward_by_quarter": quarters(side["train/rewards"]),
            "reward_mean": statistics.mean(side["train/rewards"]),
            "held_out_exact_match_before": exact["before"],
            "held_out_exact_match_after": exact[name],
            "wall_s": side["bench/wall_s"],
            "foreign_share": side.get("bench/foreign_share"),
        }
        for name, side in (("recipe", a), ("trl", b))
    }
    report = {
        "benchmark": "grpo_reward_rise",
        "command": "python benchmarks/studies/grpo_reward_rise.py " + " ".join(argv),
        "settings": {k: v for k, v in s.items() if k not in ("adapter", "base")},
        "sides": sides,
        "equal_work": work_done,
        "machine": machine_info(),
        "versions": library_versions(["torch", "transformers", "accelerate", "peft", "trl"]),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "grpo_reward_rise.json").write_text(json.dumps(report, indent=2) + "\n")
    machine = report["machine"]
    lines = [
        "# recipes/grpo.py vs TRL GRPOTrainer: the reward rise on the offline task",
        "",
        f"Command: `{report['command']}`. CPU: {machine['cpu_model']}, {machine['cpu_cores']} cores, flags "
        f"{', '.join(machine['cpu_flags']) or '-'}; versions {json.dumps(report['versions'])}. Settings "
        f"`{json.dumps(report['settings'])}`.",
        "",
        "| side | mean reward by quarter of the run | mean reward | held-out exact match before -> after | wall s "
        "| other processes' CPU share |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {name} | {', '.join(f'{q:.3f}' for q in side['reward_by_quarter'])} | {side['reward_mean']:.3f} "
            f"| {side['held_out_exact_match_before']:.1%} -> {side['held_out_exact_match_after']:.1%} "
            f"| {side['wall_s']:.0f} | {side['foreign_share'] or 0:.2f} |"
            for name, side in sides.items()
        ),
        "",
        f"Equal work: {json.dumps(work_done)}.",
        "",
    ]
    (output_dir / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if work_done["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
