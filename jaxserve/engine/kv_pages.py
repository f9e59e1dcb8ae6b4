"""KV pages in and out of a runner's cache, for a disaggregated KV handoff
(``jaxserve.engine.kv_handoff``, ``jaxserve.disagg``).

A prefill worker reads a finished prompt's pages (``read_pages``), a decode
worker writes them into pages of its own cache (``write_pages``). n pages
move as the powers of two of n's binary form (``page_pieces``: 57 -> 32, 16,
8, 1), each piece one contiguous buffer per K/V over every layer,
``[num_layers, m, L, K, H]`` in the cache dtype (and f32 ``[num_layers, m, L,
K]`` scales for an int8 / fp8 cache), replicated on the mesh and handed out
on its first device: the transfer layout, independent of either side's tp.
The gather and scatter of each piece size are compiled once
(``warmup_pages``), so a handoff meets no compilation.

``KVPagesMixin`` is mixed into ``runner.ModelRunner``, whose stacked caches
(``k_stack``, ``v_stack``: ``KVPages`` of [layers, P, L, K, H]) it reads and
replaces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.scheduler import next_pow2
from pallas_kernels.ragged_paged_attention.quant import KVPages


class KVPagesMixin:
    """``ModelRunner``'s page import/export (see the module docstring).
    Needs ``k_stack``, ``v_stack``, ``num_pages`` and ``max_pages_per_seq``;
    ``_init_kv_pages`` makes the two jitted programs."""

    def _init_kv_pages(self, caches, replicated) -> None:
        """Jit the gather and scatter over the caches' shardings ``caches``
        (a ``KVPages`` of shardings); page buffers are ``replicated``."""
        self._replicated = replicated
        self._gather_pages = jax.jit(self._gather_pages_fn, out_shardings=replicated)
        self._scatter_pages = jax.jit(
            self._scatter_pages_fn, donate_argnums=(0, 1),
            in_shardings=(caches, caches, replicated, replicated, replicated),
            out_shardings=(caches, caches))

    @staticmethod
    def page_pieces(n: int) -> list[int]:
        """How ``read_pages`` splits n pages: the powers of two of n's binary
        form, largest first (57 -> [32, 16, 8, 1]); each piece's gather and
        scatter is compiled once (``warmup_pages``) and the bytes moved are
        exactly the pages'."""
        return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]

    def read_pages(self, page_ids) -> list[tuple[KVPages, KVPages]]:
        """A copy of some pages' K and V, for a KV handoff (``jaxserve.disagg``).

        Args:
          page_ids: n page ids, in the sequence's order.

        Returns:
          one (k, v) pair of ``KVPages`` per piece of ``page_pieces(n)``, in
          order; their leaves are contiguous buffers over every layer,
          ``[num_layers, m, L, K, H]`` in the cache dtype (and f32
          ``[num_layers, m, L, K]`` scales when quantized) for a piece of m
          pages, each on one device (the mesh's first): the transfer layout,
          independent of this mesh's tp.
        """
        out, lo = [], 0
        for m in self.page_pieces(len(page_ids)):
            idx = jnp.asarray(np.asarray(page_ids[lo:lo + m], np.int32), device=self._replicated)
            out.append(jax.tree.map(lambda a: a.addressable_shards[0].data,
                                    self._gather_pages(self.k_stack, self.v_stack, idx)))
            lo += m
        return out

    def write_pages(self, page_ids, pieces: list[tuple[KVPages, KVPages]]) -> None:
        """Write pages read by ``read_pages`` (possibly by another worker,
        whose mesh may differ) into ``page_ids`` of this cache.

        Raises:
          ValueError: pieces whose shapes or dtypes do not match this cache
            for ``len(page_ids)`` pages (a mismatched model or cache dtype).
        """
        want = self.page_spec(len(page_ids))
        if jax.tree.structure(want) != jax.tree.structure(pieces) or any(
                a.shape != b.shape or a.dtype != b.dtype
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(pieces))):
            raise ValueError(f"KV pages of shapes {[(x.shape, str(x.dtype)) for x in jax.tree.leaves(pieces)]} "
                             f"do not fit this cache, which needs "
                             f"{[(x.shape, str(x.dtype)) for x in jax.tree.leaves(want)]}")
        lo = 0
        for k, v in pieces:
            m = jax.tree.leaves(k)[0].shape[1]
            idx = jnp.asarray(np.asarray(page_ids[lo:lo + m], np.int32), device=self._replicated)
            k, v = jax.device_put((k, v), self._replicated)
            self.k_stack, self.v_stack = self._scatter_pages(self.k_stack, self.v_stack, idx,
                                                             k, v)
            lo += m

    def warmup_pages(self) -> int:
        """Compile ``read_pages``' gather and ``write_pages``' scatter for
        every power-of-two piece up to a whole sequence's pages, so a KV
        handoff meets no compilation (the scatter writes nothing: every
        index is out of range). Returns the piece sizes compiled."""
        sizes = self.page_pieces(2 * next_pow2(self.max_pages_per_seq) - 1)
        for m in sizes:
            idx = jnp.asarray(np.zeros(m, np.int32), device=self._replicated)
            k, v = self._gather_pages(self.k_stack, self.v_stack, idx)
            drop = jnp.asarray(np.full(m, self.num_pages, np.int32), device=self._replicated)
            self.k_stack, self.v_stack = self._scatter_pages(self.k_stack, self.v_stack, drop,
                                                             k, v)
        jax.block_until_ready(self.k_stack)
        return len(sizes)

    def page_spec(self, num_pages: int) -> list[tuple[KVPages, KVPages]]:
        """``jax.ShapeDtypeStruct``s of ``read_pages`` for ``num_pages`` pages
        (no sharding): what a puller asks for."""
        return [jax.eval_shape(self._gather_pages_fn, self.k_stack, self.v_stack,
                               jax.ShapeDtypeStruct((m,), jnp.int32))
                for m in self.page_pieces(num_pages)]

    @staticmethod
    def _gather_pages_fn(k_cache, v_cache, idx):
        """Pages ``idx`` of every layer: [layers, m, L, K, H] (scales [layers, m, L, K])."""
        def take(c: KVPages) -> KVPages:
            return KVPages(c.pages_PLKH[:, idx],
                           None if c.scales_PLK is None else c.scales_PLK[:, idx])
        return take(k_cache), take(v_cache)

    @staticmethod
    def _scatter_pages_fn(k_cache, v_cache, idx, k, v):
        def put(c: KVPages, buf: KVPages) -> KVPages:
            return KVPages(c.pages_PLKH.at[:, idx].set(buf.pages_PLKH, mode="drop"),
                           None if c.scales_PLK is None else
                           c.scales_PLK.at[:, idx].set(buf.scales_PLK, mode="drop"))
        return put(k_cache, k), put(v_cache, v)
