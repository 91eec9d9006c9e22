"""What ``dpo.py`` alone uses: preference pairs and their reference log-probabilities
(``preference_data.py``). Copy it with the recipe, ``llm_kit/`` and ``shared/``."""
