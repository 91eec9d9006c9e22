"""What the language-model recipes (``train_lm.py``, ``pipeline_lm.py``) alone use: text and tokenizer (``data.py``),
the model (``model.py``; its presets are ``shared/presets.py``), its split over devices or stages (``split.py``) and
evaluation (``eval.py``). Copy it with the recipe and ``shared/``."""
