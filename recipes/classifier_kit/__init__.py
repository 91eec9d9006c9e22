"""What ``recipes/transformer_finetune.py`` alone uses: its data and labels (``classification.py``), its device_map
split and what that puts where (``device_map.py``) and the offline evaluate metric modules (``metrics/``). Copy it
with the recipe and ``shared/``."""
