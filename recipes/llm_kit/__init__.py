"""What the LLM fine-tuning recipes alone use: the base model's loading (``loading.py``, ``sharded_4bit.py``), chat
data (``sft_data.py``) and exact-match evaluation (``sft_eval.py``). Copy it with the recipe and ``shared/``."""
