"""Rank 0 refuses its input (a RecipeError) while rank 1 waits for it in a barrier, as when only the main process
reads the data first (main_process_first). ``python rank0_refuses.py [--plain] [--output_dir DIR]``: ``--plain``
leaves out ``install_peer_exit_hooks`` (a script of the user's own, e.g. under tools/hang_dump.py, which reads
``--output_dir``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.errors import RecipeError, report_recipe_errors, install_peer_exit_hooks
from shared.accelerator import build_accelerator

if "--plain" not in sys.argv:
    install_peer_exit_hooks()
accelerator = build_accelerator(dist_timeout=60)
with report_recipe_errors(), accelerator.main_process_first():
    if accelerator.is_main_process:
        raise RecipeError("--train_file 'nope.jsonl' does not exist (the input only rank 0 reads first).")
accelerator.end_training()
