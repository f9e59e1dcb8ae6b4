"""Putting host arrays onto a sharding, one process's slices at a time in a
multi-process job (``jax.distributed``)."""

from __future__ import annotations

import jax
import numpy as np


def place(tree, shardings):
    """``jax.device_put(tree, shardings)``, except that in a multi-process job
    each process builds only its own devices' slices of a host array
    (``jax.make_array_from_callback``): ``device_put`` of a host array onto a
    sharding spanning processes first all-gathers it to check that every
    process holds the same value, moving every weight over the network.
    Arrays already spread over the job (restored from Orbax) are kept, or
    resharded on device when their sharding differs.

    Args:
      tree: a pytree of host (numpy) or ``jax.Array`` leaves, any shape and dtype.
      shardings: the same tree's ``jax.sharding.Sharding`` per leaf.

    Returns:
      the tree of ``jax.Array``s, each on its sharding.

    Raises:
      ValueError: ``tree`` and ``shardings`` hold different numbers of leaves.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == sharding else jax.device_put(x, sharding)  # a reshard
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    leaves, treedef = jax.tree.flatten(tree)
    targets = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(targets) != len(leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(targets)} shardings")
    return jax.tree.unflatten(treedef, [put(x, s) for x, s in zip(leaves, targets)])
