"""Host-side page allocator for the paged KV cache.

Pages are integers in ``[0, num_pages)``; a sequence's page table is the list
of its page ids in order (token at position ``p`` lives in page
``page_ids[p // page_size]`` at offset ``p % page_size``). Reference counts are
kept so that prefix caching can share full pages between sequences later
(vLLM's ``BlockPool``; nano-vllm ``block_manager.py``).
"""

from __future__ import annotations

import collections


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Free list plus reference counts over ``num_pages`` pages.

    Raises:
      ValueError: on a bad page count, or freeing a page that is not allocated.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = collections.deque(range(num_pages))
        self._ref = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def occupancy(self) -> float:
        """Fraction of pages in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_pages

    def pages_needed(self, page_ids: list[int], num_tokens: int) -> int:
        """Extra pages a sequence holding ``page_ids`` needs for ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.page_size) - len(page_ids))

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages. Raises ``ValueError`` if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} pages, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for p in out:
            self._ref[p] = 1
        return out

    def free(self, page_ids: list[int]) -> None:
        """Drop one reference to each page; pages reaching 0 return to the free list."""
        for p in page_ids:
            if self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
