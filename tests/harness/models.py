"""The tiny models the tests train, built from transformers' own configs and saved like a Hub checkpoint. Callers put
the repository root and ``recipes/`` (the kits) on ``sys.path`` first (tests/conftest.py does).

The tokenizer is trained the way the LM recipe trains its own (``lm_kit.data.train_bpe_tokenizer``): a deliberate
import of a kit (tests/test_layout.py lists it)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(folder: Path, num_hidden_layers: int):
    """A tiny untied Llama (hidden 64) and a byte-level BPE tokenizer trained on the standard-library questions
    (``questions.py``), with no chat template and no pad token (the LLM recipes must add both), saved to ``folder``;
    returns the questions. Seeded: the same weights every time."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lm_kit.data import train_bpe_tokenizer

    from harness.questions import stdlib_questions

    questions = stdlib_questions()
    tokenizer = train_bpe_tokenizer(
        (m["content"] for row in questions["train"] for m in row["messages"]), vocab_size=400
    )
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return questions


def gemma2_9b_config():
    """Gemma-2-9B's shape (a config, no weights): its embedding of 256,000 tokens is its LM head too (tied), so a
    count of the model's parameters that holds the matrix twice is 0.9B over the published 9,241,705,984."""
    from transformers import Gemma2Config

    sizes = dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16)
    return Gemma2Config(**sizes, num_key_value_heads=8, head_dim=256, vocab_size=256000)
