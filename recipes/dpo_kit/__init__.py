"""What ``dpo.py`` alone uses: preference pairs (``preference_data.py``), DPO's loss (``loss.py``) and the reference
policy's log-probabilities (``reference.py``). Copy it with the recipe, ``llm_kit/`` and ``shared/``."""
