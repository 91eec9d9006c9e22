"""Llama-architecture shapes for the LM recipes' ``--model_size`` and the fit planner (which imports no kit)."""


def _shape(hidden: int, blocks: int, heads: int, mlp: int, positions: int) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings")
    return dict(zip(keys, (hidden, blocks, heads, mlp, positions)))


MODEL_PRESETS = {
    "tiny": _shape(64, 4, 4, 176, 256),
    "small": _shape(256, 7, 8, 688, 1024),
    "125m": _shape(768, 12, 12, 2048, 2048),
    "350m": _shape(1024, 24, 16, 2816, 2048),
    "1.3b": _shape(2048, 24, 16, 5504, 2048),
}
