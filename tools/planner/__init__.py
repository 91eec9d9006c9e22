"""The fit planner, run as ``python tools/plan.py``: will a model train on N GPUs of M GiB, and how.

Its modules, from the numbers it takes as given to the command: ``tables`` (units, shapes, bytes per element, setups),
``shapes`` (a model's sizes and parameter counts, no weights), ``memory`` (the formulas: bytes per parameter, per
token, per block, with their sources), ``devices`` (one GPU's bill and the host's), ``setups`` (the six setups and
whether each fits), ``advice`` (what would fit instead), ``launch`` (the recipe's command), ``fits`` (``plan``: the
estimate and the recommendation), ``report`` (the table) and ``cli`` (the flags and ``main``).
"""

from tools.planner.fits import plan
from tools.planner.memory import block_activation_bytes, precision_profile
from tools.planner.shapes import preset_shape, shape_from_config

__all__ = ["block_activation_bytes", "plan", "precision_profile", "preset_shape", "shape_from_config"]
