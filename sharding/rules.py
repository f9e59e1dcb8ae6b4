"""The one table from logical axis names to mesh axes.

Model code only *names* axes (``("embed", "mlp")``); this table decides where
each name lands on the mesh (``dp``, ``tp``, ``ep``). Pattern from
jax-llm-examples ``ShardingRules`` and MaxText's ``logical_axis_rules``.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

# Mesh axis names.
DP, TP, EP = "dp", "tp", "ep"


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name (or None for replicated)."""

    batch: str | None = DP
    vocab: str | None = TP
    embed: str | None = None
    q_heads: str | None = TP
    kv_heads: str | None = TP
    head_dim: str | None = None
    mlp: str | None = TP
    experts: str | None = EP
    norm: str | None = None

    def spec(self, logical_axes: tuple[str | None, ...]) -> PartitionSpec:
        """PartitionSpec for a tensor whose dims carry ``logical_axes``.

        Raises:
          ValueError: a name is not in the table, or two names map to one mesh axis.
        """
        mesh_axes = []
        for name in logical_axes:
            if name is None:
                mesh_axes.append(None)
                continue
            if not hasattr(self, name):
                raise ValueError(f"unknown logical axis {name!r}")
            mesh_axes.append(getattr(self, name))
        used = [a for a in mesh_axes if a is not None]
        if len(used) != len(set(used)):
            raise ValueError(
                f"logical axes {logical_axes} map two dims onto one mesh axis: {mesh_axes}")
        return PartitionSpec(*mesh_axes)


DEFAULT_RULES = ShardingRules()
