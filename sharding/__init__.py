"""Meshes and sharding rules: ``mesh.py`` (``--mesh`` specs, the
``(dp, tp, ep)`` mesh) and ``rules.py`` (the one logical-axis -> mesh-axis
table; a stacked model's leading layer axis is never split).

May import: jax only.
"""
