"""What ``dpo.py`` alone uses: preference pairs, their reference log-probabilities and the starting adapter
(``preference_data.py``). Copy it with the recipe, ``llm_kit/`` and ``shared/``."""
