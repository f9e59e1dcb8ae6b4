"""Host-side page pool of the paged KV cache, with prefix caching.

Pages are integers in ``[0, num_pages)``; a sequence's page table is the list
of its page ids in order (token at position ``p`` lives in page
``page_ids[p // page_size]`` at offset ``p % page_size``).

Prefix caching (vLLM v1 ``BlockPool`` / ``KVCacheManager``; SGLang's radix
cache does the same at token granularity): every *full* page whose K/V is
computed gets a chained hash ``h_i = sha256(h_{i-1} || token ids of page i)``,
so a hash names the whole prefix up to the end of its page. A new request
looks its page hashes up in ``cached`` and reuses the longest run of hits.
Pages are reference-counted; a page whose count drops to 0 goes to the back of
the free queue but keeps its hash, so it can still be hit until it is handed
out again. Allocation takes pages from the front, so eviction is least
recently freed first (LRU).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_page(parent: bytes | None, token_ids) -> bytes:
    """Chained hash of one full page: sha256(parent hash || i32 token ids).

    Args:
      parent: the previous page's hash, or None for the first page.
      token_ids: the page's ``page_size`` token ids.

    Returns:
      32 bytes. SHA-256 rather than Python's ``hash`` so that a collision
      (which would silently serve another prompt's K/V) is not a practical risk
      (vLLM switched to SHA-256 for the same reason).
    """
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(token_ids, np.int32).tobytes())
    return h.digest()


def page_hashes(token_ids, page_size: int, known: list[bytes] | None = None,
                root: bytes | None = None) -> list[bytes]:
    """Hashes of every full page of ``token_ids``, extending ``known`` (which
    holds the hashes of the first pages, computed earlier). ``root``: the
    first page's parent (a LoRA adapter's ``cache_root``, so its pages never
    match the base's or another adapter's); None for the base model."""
    out = list(known or [])
    for i in range(len(out), len(token_ids) // page_size):
        out.append(hash_page(out[-1] if out else root,
                             token_ids[i * page_size:(i + 1) * page_size]))
    return out


class PageAllocator:
    """Free queue, reference counts and the prefix-cache map over ``num_pages`` pages.

    Args:
      num_pages: pages P of the cache.
      page_size: tokens L per page.
      enable_prefix_caching: keep full pages findable by hash after they are freed.

    Counters (tokens): ``prefix_queries`` prompt tokens looked up,
    ``prefix_hits`` of them served from the cache.

    Raises:
      ValueError: on a bad page count, taking more pages than are free, or
        freeing a page that is not allocated.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        # page id -> None, oldest-freed first (an ordered set with O(1) removal).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_pages))
        self._ref = [0] * num_pages
        self._hash: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}  # page hash -> page id
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_pages(self) -> int:
        """Pages with no reference (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self.cached)

    @property
    def occupancy(self) -> float:
        """Fraction of pages referenced by some sequence, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_pages

    @property
    def prefix_hit_rate(self) -> float:
        """Cached fraction of looked-up prompt tokens (0 before any lookup)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def pages_needed(self, page_ids: list[int], num_tokens: int) -> int:
        """Extra pages a sequence holding ``page_ids`` needs for ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.page_size) - len(page_ids))

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` unreferenced pages, evicting the least recently freed
        cached ones. Raises ``ValueError`` if fewer than ``n`` are free."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} pages, {len(self._free)} free")
        out = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            h = self._hash[p]
            if h is not None:
                if self.cached.get(h) == p:
                    del self.cached[h]
                self._hash[p] = None
            self._ref[p] = 1
            out.append(p)
        return out

    def share(self, page_ids: list[int]) -> None:
        """Add one reference to each page (a cache hit, or a fork of n choices)."""
        for p in page_ids:
            if self._ref[p] == 0:
                del self._free[p]
            self._ref[p] += 1

    def free(self, page_ids: list[int]) -> None:
        """Drop one reference to each page. Pages reaching 0 join the back of
        the free queue (keeping their hash); ``page_ids`` is walked backwards
        so a sequence's tail pages are evicted before its head (vLLM)."""
        for p in reversed(page_ids):
            if self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if self._hash[p] is None or not self.enable_prefix_caching:
                    self._hash[p] = None
                    self._free[p] = None
                    self._free.move_to_end(p, last=False)  # no content worth keeping: reuse first
                else:
                    self._free[p] = None

    def lookup(self, hashes: list[bytes], max_pages: int) -> list[int]:
        """Pages of the longest cached run of ``hashes[:max_pages]`` (not yet
        referenced: pass them to ``share``)."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for h in hashes[:max_pages]:
            p = self.cached.get(h)
            if p is None:
                break
            out.append(p)
        return out

    def count_free_among(self, page_ids: list[int]) -> int:
        """How many of ``page_ids`` are unreferenced (sharing them uses free pages)."""
        return sum(1 for p in page_ids if self._ref[p] == 0)

    def register(self, page_ids: list[int], hashes: list[bytes]) -> None:
        """Record the hash of each full, computed page. A hash already cached
        under another page keeps its first page (the duplicate stays unnamed)."""
        if not self.enable_prefix_caching:
            return
        for p, h in zip(page_ids, hashes):
            if self._hash[p] is not None:
                continue
            if h not in self.cached:
                self.cached[h] = p
                self._hash[p] = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (pages in use keep their contents)."""
        self.cached.clear()
        self._hash = [None] * self.num_pages
