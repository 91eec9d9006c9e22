"""What ``pipeline_lm.py`` alone uses: pipeline parallelism around ``torch.distributed.pipelining``
(``pipeline.py``). Copy it with the recipe, ``lm_kit/`` and ``shared/``."""
