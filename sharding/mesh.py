"""Device mesh construction: ``"dp=1,tp=4,ep=2"`` -> ``jax.sharding.Mesh``.

The mesh always has the three axes ``(dp, tp, ep)`` in that order (a missing
axis has size 1), so one rule table (``sharding.rules``) serves every shape.
What each axis holds today:

* ``tp``: tensor parallelism; the weights' head / MLP / vocab dims and the KV
  cache's kv-head dim are split over it (``ShardingRules.for_model``).
* ``ep``: an MoE model's experts are split over it (``jaxserve.models.moe``);
  everything else is replicated along it.
* ``dp``: accepted, but nothing is split over it yet (no data parallel
  scheduler): params, caches and the step's metadata are replicated along
  it, so each dp slice computes the same thing.

Every check here runs before any weights are read, so a bad ``--mesh`` fails
in milliseconds.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import jax
import numpy as np

from sharding.rules import DP, EP, TP, ShardingRules

MESH_AXES = (DP, TP, EP)


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """Parse ``"dp=1,tp=4,ep=2"`` into ``{"dp": 1, "tp": 4, "ep": 2}``.

    Axes may come in any order; missing ones are 1; spaces are ignored.

    Raises:
      ValueError: empty spec, an entry that is not ``name=size``, an unknown
        axis name, a duplicate axis, or a size that is not a positive integer.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh spec must be a non-empty string like 'tp=2,ep=2', got {spec!r}")
    sizes: dict[str, int] = {}
    for entry in spec.split(","):
        name, sep, value = (s.strip() for s in entry.partition("="))
        if not sep or not name:
            raise ValueError(f"mesh spec {spec!r}: entry {entry.strip()!r} is not 'axis=size'")
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; "
                             f"axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if not re.fullmatch(r"[+-]?\d+", value):
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be an integer, "
                             f"got {value!r}")
        if int(value) < 1:
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be >= 1, got {value}")
        sizes[name] = int(value)
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def mesh_spec_str(shape: Mapping[str, int]) -> str:
    """``{"dp": 1, "tp": 2, "ep": 1}`` -> ``"dp=1,tp=2,ep=1"``."""
    return ",".join(f"{a}={shape.get(a, 1)}" for a in MESH_AXES)


def make_mesh(spec: str | Mapping[str, int],
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A ``(dp, tp, ep)`` mesh over ``devices`` (default: all of ``jax.devices()``).

    Devices are laid out in the given order, ``ep`` fastest (a plain reshape;
    on TPU slices pass ``devices`` in the order the interconnect prefers).

    Args:
      spec: a spec string (``parse_mesh_spec``) or a ``{axis: size}`` dict.
      devices: the devices to use; their number must equal the mesh size.

    Raises:
      ValueError: a bad spec, or the mesh size differs from the number of devices
        (both numbers are in the message).
    """
    if not isinstance(spec, str):  # a dict: check it exactly as a string would be
        spec = ",".join(f"{k}={v}" for k, v in spec.items())
    shape = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(shape.values())
    if size != len(devices):
        raise ValueError(f"mesh {mesh_spec_str(shape)} has {size} devices, but {len(devices)} "
                         f"devices are available; the product of the axis sizes must equal "
                         f"the number of devices (to use a subset: --num_devices N on the "
                         f"command line, devices=... in Python)")
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return jax.sharding.Mesh(grid.reshape(tuple(shape[a] for a in MESH_AXES)), MESH_AXES)


def validate_mesh_for_model(mesh_shape: Mapping[str, int], model_config) -> ShardingRules:
    """Check that a mesh can run a model; return the sharding rules it gets.

    The per-axis decisions (what is split over ``tp``, what falls back to
    replication) are made in ``ShardingRules.for_model``; see there.

    Args:
      mesh_shape: ``{axis: size}`` (``Mesh.shape`` or ``parse_mesh_spec``'s dict).
      model_config: a ``jaxserve.config.ModelConfig`` (read by attribute).

    Raises:
      ValueError: an unknown axis, or ``tp`` does not divide the MLP width.
    """
    unknown = set(mesh_shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh has unknown axes {sorted(unknown)}; axes are {MESH_AXES}")
    return ShardingRules.for_model(mesh_shape, model_config)
