"""What ``grpo.py`` alone uses: prompts and micro-batches (``data.py``), generation behind its ``Generator`` interface
(``rollout.py``), the reference and the generator of the prepared policy (``policy.py``), the split layout
(``split.py``), reward functions (``rewards.py``), the advantages and the loss (``loss.py``) and TRL's metrics
(``metrics.py``). Copy it with the recipe, ``llm_kit/`` and ``shared/``."""
