"""The test harness: how the suite launches recipes and what it reads of them, apart from the tests that specify the
recipes. Every test file imports it the same way, ``from harness.launch import ...`` (tests/conftest.py puts tests/ on
sys.path).

- ``launch.py``: ``accelerate launch`` in a subprocess, a hang killed at its timeout, runs two at a time
  (``launch_all``); results.json and the observer's facts read back.
- ``zygote.py`` and ``forked_python``: on a machine without GPUs, each Python process of a launch is a fork of a
  process that imported torch, transformers and PEFT once.
- ``observer/``: loaded into a launch's processes (PYTHONPATH) only where a test reads what they did.
- ``models.py``, ``questions.py``, ``fixed_completions.py``: the tiny models and data the tests build.
- ``test_*.py``: the harness's own tests.
"""
