"""The small helper module that the recipes share.

Copy ``shared/`` next to a recipe (or one folder above it) and the recipe runs unchanged. Everything
here is a plain function or a tiny class with explicit arguments; the training steps themselves
stay in the recipes.
"""

from .results import ThroughputMeter, model_state_bytes, model_state_bytes_per_rank, peak_memory_gib, write_results
from .runtime import (
    Placement,
    RecipeError,
    build_accelerator,
    check_process_count,
    choose_placement,
    positive_float,
    positive_int,
    prepare_output_dir,
)

__all__ = [
    "Placement",
    "RecipeError",
    "ThroughputMeter",
    "build_accelerator",
    "check_process_count",
    "choose_placement",
    "model_state_bytes",
    "model_state_bytes_per_rank",
    "peak_memory_gib",
    "positive_float",
    "positive_int",
    "prepare_output_dir",
    "write_results",
]
