"""The small helper module the recipes share, imported by module (``from shared.errors import RecipeError``): plain
functions and small classes with explicit arguments; the training steps stay in the recipes, and what one recipe family
alone uses lives in its kit (``recipes/llm_kit/``). Imports point one way: recipes, kits, tools and benchmarks import
shared; inside it, ``errors`` first, then ``flags`` and ``parallelism``, ``accelerator``, the rest; never upwards."""
