"""The one place the tests change ``sys.path``, whatever directory pytest starts from: the harness as ``harness``
(tests/harness/: ``from harness.launch import ...``), the helper module as ``shared`` and the tools as ``tools`` (the
repository root), the recipes and their kits as the recipes import them (``from llm_kit.sft_data import ...``: each kit
lies beside its recipes in recipes/), and the benchmarks' library and studies as the benchmarks import them
(``from lib.records import ...``, ``import vs_trl``), for the tests of the benchmarks."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(REPO / "tests"),
    str(REPO),
    str(REPO / "recipes"),
    str(REPO / "benchmarks"),
    str(REPO / "benchmarks" / "studies"),
]
