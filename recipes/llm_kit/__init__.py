"""What the LLM fine-tuning recipes alone use: the base model's loading and its LoRA adapter (``loading.py``,
``sharded_4bit.py``), the adapter continued and the reference policy (``adapters.py``), chat data (``sft_data.py``),
the loss on the answer tokens (``loss.py``) and exact-match evaluation (``sft_eval.py``).
Copy it with the recipe and ``shared/``."""
