"""What the GRPO studies train on: the recipe's offline prompts (standard-library questions as conversations, with
their ``answer``) and a Llama with random weights and a byte-level BPE tokenizer trained on them, made once per
folder; ``SPEED_MODEL``, the shape the speed comparisons use (4.2M parameters: its step is compute). Callers put the
repository root and ``recipes/`` (the kits) on ``sys.path`` first."""

from __future__ import annotations

import json
from pathlib import Path

SPEED_MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8}
SPEED_VOCAB_SIZE = 4096


def build_inputs(work: Path, shape: dict, vocab_size: int = 400) -> tuple[Path, Path]:
    """The prompt file (200 of the recipe's offline prompts, with answers) and the model folder (a Llama of
    ``shape``)."""
    import torch
    from grpo_kit.data import stdlib_name_prompts
    from llm_kit.sft_data import DEFAULT_CHAT_TEMPLATE
    from lm_kit.data import train_bpe_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    prompts = work / "prompts.jsonl"
    if not prompts.is_file():
        rows = stdlib_name_prompts()["train"].select(range(200))
        prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    model_dir = work / ("model-" + "-".join(map(str, [*shape.values(), vocab_size])))
    if not (model_dir / "config.json").is_file():
        texts = (m["content"] for line in prompts.read_text().splitlines() for m in json.loads(line)["prompt"])
        tokenizer = train_bpe_tokenizer([*texts, "class", "function", "method", "the name is documented"], vocab_size)
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        tokenizer.save_pretrained(model_dir)
        config = LlamaConfig(
            **shape,
            num_key_value_heads=shape["num_attention_heads"],
            vocab_size=len(tokenizer),
            tie_word_embeddings=False,
            max_position_embeddings=512,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return model_dir, prompts
