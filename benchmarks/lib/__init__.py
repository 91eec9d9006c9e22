"""The benchmarks' small library: what the tools (``run.py``, ``compare.py``, ``gpu_check.py``, ``profile_recipe.py``,
``with_model_state.py``) and the studies (``studies/``) share, so that none of them imports another.

- ``records``: the per-run record's schema and fields, each side's work per optimizer step, the equal-work check;
- ``specs``: run specs (what one launch of a recipe is) and the command line of one;
- ``launch``: launching a recipe and waiting for its results.json, or running one unchanged inside a wrapper;
- ``machine``: the CPU model and flags, RAM, GPUs and library versions of every record; the CPU time other
  processes used during a launch;
- ``flops``: the two halves of MFU, training FLOPs per token and the GPUs' peak FLOP/s (the recipes report no MFU);
- ``model_state``: the bytes of model state a process holds (the runner's wrapper ``with_model_state.py`` and the
  tests' observer count with it);
- ``stats``: the 95 % interval of a ratio from side-by-side repeats.

Dependencies point one way: tools and studies import ``lib``; ``lib`` imports only ``lib`` and ``shared``. The data
and completions the studies share with the tests are the tests' own (``tests/harness/questions.py``,
``fixed_completions.py``). Callers put ``benchmarks/`` and the repository root on ``sys.path`` first.
"""
