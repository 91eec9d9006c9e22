"""Model shapes by name, for ``--model_size`` of the LM recipes and for the fit planner (``tools/plan.py``).

Llama-architecture (RMSNorm, rotary positions, SwiGLU, no biases). 125m/350m/1.3b: GPT-3's Small/Medium/XL shapes (the
count depends on the vocabulary: 125m is ~134M with 32k, untied). tiny: tests; small: trains visibly on one CPU core
in minutes, its 7 blocks split evenly over two stages (5, and 2 + the LM head and loss, worth ~3 blocks)."""

MODEL_PRESETS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=176, max_position_embeddings=256),
    "small": dict(hidden_size=256, num_hidden_layers=7, num_attention_heads=8, intermediate_size=688, max_position_embeddings=1024),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048, max_position_embeddings=2048),
    "350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=2816, max_position_embeddings=2048),
    "1.3b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=5504, max_position_embeddings=2048),
}

# Llama-2-7B's shape (meta-llama/Llama-2-7b-hf config.json; vocabulary 32000, untied LM head:
# 6,738,415,616 parameters). Only the planner offers it: the recipe would not train it on CPU.
LLAMA_2_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008,
                  max_position_embeddings=4096)
