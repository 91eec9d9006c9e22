import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Make tests/launch.py importable as `launch` whatever directory pytest starts from; the helper module as `shared`; and
# the recipes' own helpers as their recipes import them (`from llm_kit.sft_data import ...`: each kit lies beside its
# recipes in recipes/).
sys.path.insert(0, str(TESTS.parent / "recipes"))
sys.path.insert(0, str(TESTS.parent))
sys.path.insert(0, str(TESTS))
