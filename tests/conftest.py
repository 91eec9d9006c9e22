import sys
from pathlib import Path

# Make tests/launch.py importable as `launch` whatever directory pytest starts from.
sys.path.insert(0, str(Path(__file__).resolve().parent))
