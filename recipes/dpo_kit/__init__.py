"""What ``dpo.py`` alone uses: preference pairs (``preference_data.py``), DPO's loss (``loss.py``), the reference
policy's log-probabilities (``reference.py``) and what a run logs (``metrics.py``). Copy it with the recipe,
``llm_kit/`` and ``shared/``."""
