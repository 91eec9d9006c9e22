"""The small helper module the recipes share: import from its modules (``from shared.errors import RecipeError``).
Plain functions and small classes with explicit arguments; the training steps stay in the recipes, and what one recipe
(or one family of recipes) alone uses lives beside it, in its kit (``recipes/llm_kit/``). Imports point one way:
recipes, their kits, tools and benchmarks import shared, shared imports none of them. Inside, from the bottom up:
``errors``; ``flags``, ``parallelism``; ``accelerator``; ``fsdp``, ``checkpoints``, ``signals`` and the rest."""
