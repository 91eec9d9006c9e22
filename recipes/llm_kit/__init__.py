"""What the LLM fine-tuning recipes alone use: the base model's loading (``loading.py``, ``sharded_4bit.py``), the
model they train with its LoRA adapter, new or continued, and the reference policy (``adapters.py``), chat data
(``sft_data.py``), the loss on the answer tokens (``loss.py``), the optimizer and schedule (``optimizer.py``), when
checkpoints are saved (``checkpoints.py``) and exact-match evaluation (``sft_eval.py``).
Copy it with the recipe and ``shared/``."""
