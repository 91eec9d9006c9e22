"""Model shapes by name, for ``--model_size`` of the LM recipes (``train_lm.py``, ``pipeline_lm.py``) and for the fit
planner (``tools/plan.py``), which imports no recipe's kit: one table for both.

Llama-architecture (RMSNorm, rotary positions, SwiGLU, no biases). 125m/350m/1.3b: GPT-3's Small/Medium/XL shapes (the
count depends on the vocabulary: 125m is ~134M with 32k, untied). tiny: tests; small: trains visibly on one CPU core
in minutes, its 7 blocks split evenly over two stages (5, and 2 + the LM head and loss, worth ~3 blocks)."""


def _shape(hidden: int, blocks: int, heads: int, mlp: int, positions: int) -> dict:
    return dict(
        hidden_size=hidden,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        intermediate_size=mlp,
        max_position_embeddings=positions,
    )


MODEL_PRESETS = {
    "tiny": _shape(64, 4, 4, 176, 256),
    "small": _shape(256, 7, 8, 688, 1024),
    "125m": _shape(768, 12, 12, 2048, 2048),
    "350m": _shape(1024, 24, 16, 2816, 2048),
    "1.3b": _shape(2048, 24, 16, 5504, 2048),
}
