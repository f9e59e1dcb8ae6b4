"""The one table from logical axis names to mesh axes.

Model code only *names* axes (``("embed", "mlp")``); this table decides where
each name lands on the mesh (``dp``, ``tp``, ``ep``). Pattern from
jax-llm-examples ``ShardingRules`` and MaxText's ``logical_axis_rules``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Mesh axis names.
DP, TP, EP = "dp", "tp", "ep"


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name (or None for replicated).

    The defaults are the ideal table; ``for_model`` turns off the ``tp`` split
    of any axis whose size ``tp`` does not divide.
    """

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

    @classmethod
    def for_model(cls, mesh_shape: Mapping[str, int], cfg) -> ShardingRules:
        """The rules of one model on one mesh: the one place that decides,
        per logical axis, whether it is split over ``tp`` or replicated.

        * ``mlp`` (SwiGLU width F): always split (column-parallel gate/up,
          row-parallel down; XLA all-reduces the down projection's output).
          ``tp`` must divide F, else tensor parallelism would split almost
          nothing, so it is an error.
        * ``q_heads`` (N): split when ``tp`` divides N (whole heads per
          device; row-parallel ``o_proj``), else replicated: attention then
          runs whole on every device (SmolLM2's 9 heads with tp = 2, 4, 8).
        * ``kv_heads`` (K): split when ``tp`` divides K, else replicated (the
          K/V projections and the KV cache are then full copies on every
          device, as in vLLM when tp > K). ``tp | K`` implies ``tp | N``.
        * ``vocab`` (V): split when ``tp`` divides V (embedding rows and LM
          head rows), else replicated; never padded, so logits keep shape V.
        * ``embed``, ``head_dim``, ``norm``: replicated. ``batch`` (dp) and
          ``experts`` (ep) keep their mesh axes; no dense-model tensor names them.
        * MoE models (``cfg.num_experts`` > 0): ``experts`` (E) is split over
          ``ep`` and each expert's width (``moe_intermediate_size``, logical
          ``mlp``) over ``tp``; both must divide, else it is an error.

        Args:
          mesh_shape: ``{axis: size}``; a missing axis has size 1.
          cfg: a ``ModelConfig`` (read by attribute: ``num_heads``,
            ``num_kv_heads``, ``intermediate_size``, ``vocab_size``, and
            ``num_experts``, ``moe_intermediate_size`` when present).

        Raises:
          ValueError: ``tp`` does not divide ``intermediate_size`` (or an
            MoE model's ``moe_intermediate_size``), or ``ep`` does not divide
            its ``num_experts``.
        """
        tp = mesh_shape.get(TP, 1)
        if cfg.intermediate_size % tp:
            raise ValueError(
                f"tp={tp} does not divide the model's MLP width (intermediate_size="
                f"{cfg.intermediate_size}); pick a tp that divides it")
        num_experts, ep = getattr(cfg, "num_experts", 0), mesh_shape.get(EP, 1)
        if num_experts and num_experts % ep:
            raise ValueError(f"ep={ep} does not divide the model's num_experts={num_experts}; "
                             f"pick an ep that divides it")
        if num_experts and cfg.moe_intermediate_size % tp:
            raise ValueError(
                f"tp={tp} does not divide the model's expert width (moe_intermediate_size="
                f"{cfg.moe_intermediate_size}); pick a tp that divides it")

        def split(n: int) -> str | None:
            return TP if n % tp == 0 else None
        return cls(vocab=split(cfg.vocab_size), q_heads=split(cfg.num_heads),
                   kv_heads=split(cfg.num_kv_heads), mlp=TP)


DEFAULT_RULES = ShardingRules()


def named_sharding(mesh: Mesh, rules: ShardingRules,
                   logical_axes: tuple[str | None, ...]) -> NamedSharding:
    """``NamedSharding`` of a tensor whose dims carry ``logical_axes``."""
    return NamedSharding(mesh, rules.spec(tuple(logical_axes)))


def _logical_axes(variable) -> tuple[str | None, ...] | None:
    """Axis names of an NNX variable: metadata ``out_sharding`` (flax >= 0.12)
    or ``sharding_names`` / ``sharding`` (older names of the same field)."""
    meta = variable.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key) is not None:
            return tuple(meta[key])
    return None


def param_shardings(state: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """The ``NamedSharding`` of every variable of an NNX state, from the
    logical axis names it was created with (``nnx.Param(..., sharding_names=...)``).

    Returns a pytree prefix of ``state`` (one sharding per variable), usable
    as ``jax.device_put``'s target and as ``jit``'s ``in_shardings``.
    Variables without names, and bare arrays, are replicated.

    Raises:
      ValueError: a variable's names do not match its rank, or a split dim is
        not divisible by its mesh axis (the path is in the message).
    """
    def one(path, v):
        is_var = hasattr(v, "get_metadata")
        axes = _logical_axes(v) if is_var else None
        shape = tuple((v.value if is_var else v).shape)
        where = jax.tree_util.keystr(path)
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        if len(axes) != len(shape):
            raise ValueError(f"{where}: logical axes {axes} do not match shape {shape}")
        spec = rules.spec(axes)
        for dim, axis in zip(shape, spec):
            if axis is not None and dim % mesh.shape[axis]:
                raise ValueError(f"{where}: dim {dim} (logical axes {axes}) is not divisible "
                                 f"by mesh axis {axis}={mesh.shape[axis]}")
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: hasattr(x, "get_metadata"))


def hf_shardings(named_params: Mapping[str, tuple[Any, int | None]], mesh: Mesh,
                 rules: ShardingRules) -> dict[str, NamedSharding]:
    """The sharding of every checkpoint tensor, by its HF name, so a
    checkpoint (``checkpoints.orbax_ckpt.restore_orbax``) can be read
    straight into the layout ``param_shardings`` gives the model.

    Args:
      named_params: HF name -> (NNX variable it fills, expert index or None),
        as ``jaxserve.models.llama.hf_params`` / ``moe.hf_params`` return. A
        tensor with an expert index is one slice of a stacked ``[E, ...]``
        variable: it gets that variable's spec without the experts dim
        (replicated over ``ep``; the stacked param is resharded after). A
        ``QuantizedWeight`` (a module with ``q``, ``scale``, ``zero``
        variables) gives one sharding per part present, named
        ``<HF name>:q``, ``:scale``, ``:zero`` (the quantized Orbax layout).
      mesh, rules: as ``param_shardings``.

    Raises:
      ValueError: as ``param_shardings``.
    """
    out = {}
    for name, (var, expert) in named_params.items():
        parts = {name: var} if hasattr(var, "get_metadata") else {
            f"{name}:{p}": getattr(var, p) for p in ("q", "scale", "zero")
            if getattr(var, p, None) is not None}
        for part_name, part in parts.items():
            spec = param_shardings(part, mesh, rules).spec
            if expert is not None:
                spec = PartitionSpec(*tuple(spec)[1:])
            out[part_name] = NamedSharding(mesh, spec)
    return out
