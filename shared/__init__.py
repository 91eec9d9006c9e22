"""The small helper module the recipes share: import from its modules (``from shared.runtime import ...``). Plain
functions and small classes with explicit arguments; the training steps stay in the recipes. Imports point one way:
recipes, tools and benchmarks import shared, shared imports none of them."""
