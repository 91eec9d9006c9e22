"""The small helper module the recipes share: import from its modules (``from shared.runtime import ...``).

Copy ``shared/`` next to a recipe (or one folder above it) and the recipe runs unchanged. Everything here is a plain
function or a small class with explicit arguments; the training steps themselves stay in the recipes. Imports point
one way: recipes, tools and benchmarks import shared; shared imports none of them.
"""
