"""What ``grpo.py`` alone uses: prompts and micro-batches (``data.py``), generation behind its ``Generator`` interface
(``rollout.py``), reward functions (``rewards.py``), the advantages and the loss (``loss.py``) and TRL's metrics
(``metrics.py``). Copy it with the recipe, ``llm_kit/`` and ``shared/``."""
