"""recipes/grpo.py, unchanged, with completions fixed in advance (``tests/harness/fixed_completions.py``, keyed by
each row's sampling noise, which is the same in any process count) instead of sampled: runs that must score the same
tokens in 1 and 2 processes, with and without accumulation.
``accelerate launch ... tests/scripts/grpo_fixed_completions.py [the recipe's flags]``."""

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes"), str(REPO / "tests"), str(REPO)]
from harness.fixed_completions import patch_recipe_generator

patch_recipe_generator(by_noise=True)
sys.argv = [str(REPO / "recipes" / "grpo.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
