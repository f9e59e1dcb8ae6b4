"""LoRA adapters: the registry on the host, the slots on the device, the swaps.

Many fine-tunes share one copy of the base weights. Each adapter is a PEFT
folder (``checkpoints.peft``); the model holds ``max_loras`` slots of
low-rank weights beside every targeted projection (``models.lora``: A
``[S, R, in]`` and B ``[S, out, R]`` per projection, rank padded to
``max_lora_rank``), and each token of a step carries its slot
(``AttentionMetadata.lora_slots``; 0 is the base, no adapter). A slot's
contents are array values of the step programs' inputs, so loading,
unloading or mixing adapters compiles nothing (one program writes a slot,
built once).

```
 register(name, path)             host: parse + check the folder, build the
   -> Adapter (values per leaf)   slot values (numpy, one slot's worth)
 Scheduler admits a request  ──▶  AdapterSlots.acquire(adapter) -> slot
   (can_acquire first: a request     in a slot already: pinned again
    whose adapter finds no slot      a free slot, or the least recently used
    waits; others pass it)           unpinned one: SlotWriter.write (swap)
 request finishes / is preempted ─▶ release(slot): one pin less
 unregister(name)                 gone for new requests at once; its slot is
                                  freed when its last request ends
```

Pins: every running sequence of an adapter holds one pin on its slot, so a
slot is swapped only when no running sequence uses it (a step still in
flight that read the old values has them: the write is ordered after it on
the device, as the slot arrays are that step's inputs).

The prefix cache keys pages by adapter: an adapter's sequences hash their
pages from ``Adapter.cache_root`` (``page_table.page_hashes``' root), so the
same prompt under two adapters, or under an adapter and the base, never
shares a page.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
import time

import jax
import numpy as np

from jaxserve.config import LoRAConfig
from jaxserve.models import lora as lora_model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's ``LoRARequest``).

    Attributes:
      lora_name: the adapter's name (the OpenAI API's ``model`` field).
      lora_int_id: vLLM's integer id; kept for compatibility, unused here.
      lora_path: the PEFT folder; registers the adapter under ``lora_name``
        on first use when the engine does not know the name yet.
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


@dataclasses.dataclass
class Adapter:
    """A registered adapter on the host.

    Attributes:
      name: its name (requests name it).
      path: its PEFT folder.
      rank: its largest module rank.
      values: one slot's contents, a numpy array per LoRA leaf of the model
        (``models.lora.slot_values``), in the model's activation dtype.
      cache_root: 32 bytes the prefix cache hashes this adapter's pages from.
      num_requests, num_prompt_tokens, num_generation_tokens: counters.
      removed: unregistered while requests still ran with it.
    """

    name: str
    path: str
    rank: int
    values: dict
    cache_root: bytes
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    removed: bool = False


def _without_slot_axis(leaf):
    """The sharding of one slot's values of a LoRA leaf: the leaf's, less
    its slot axis (unsharded)."""
    k = lora_model.slot_axis(leaf)
    spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
    return jax.sharding.NamedSharding(leaf.sharding.mesh,
                                      jax.sharding.PartitionSpec(*(spec[:k] + spec[k + 1:])))


class SlotWriter:
    """Writes one adapter's values into a slot of the runner's state.

    The LoRA leaves of ``runner.state`` (``models.lora.lora_leaves``) are
    replaced by a jitted ``models.lora.write_slot`` that donates them (an
    in-place update) and keeps their shardings, so the step programs see
    inputs of the same type and compile nothing. The write is compiled once,
    ahead of time (``warmup``); the slot is an i32 input.
    """

    def __init__(self, runner):
        self.runner = runner
        leaves = lora_model.lora_leaves(runner.state)
        self._paths = list(leaves)
        self._shardings = {p: x.sharding for p, x in leaves.items()}
        self._dtypes = {p: x.dtype for p, x in leaves.items()}
        self._value_shardings = {p: _without_slot_axis(x) for p, x in leaves.items()}
        self._write = jax.jit(lora_model.write_slot, donate_argnums=(0,),
                              out_shardings=self._shardings)
        self._compiled = None
        self.num_writes = 0
        self.write_seconds = 0.0

    def warmup(self) -> None:
        """Compile the write ahead of time (nothing is written)."""
        leaves = lora_model.lora_leaves(self.runner.state)
        values = {}
        for p, x in leaves.items():
            k = lora_model.slot_axis(x)
            values[p] = jax.ShapeDtypeStruct(x.shape[:k] + x.shape[k + 1:], x.dtype,
                                             sharding=self._value_shardings[p])
        self._compiled = self._write.lower(leaves, np.int32(1), values).compile()

    def write(self, slot: int, values: dict) -> float:
        """Put ``values`` (``Adapter.values``) into ``slot`` (1..max_loras);
        returns the seconds it took, the device write finished."""
        t0 = time.perf_counter()
        leaves = lora_model.lora_leaves(self.runner.state)
        vals = {p: jax.device_put(np.asarray(values[p], self._dtypes[p]),
                                  self._value_shardings[p]) for p in self._paths}
        new = (self._compiled or self._write)(leaves, np.int32(slot), vals)
        lora_model.set_lora_leaves(self.runner.state, new)
        jax.block_until_ready(new)
        dt = time.perf_counter() - t0
        self.num_writes += 1
        self.write_seconds += dt
        return dt


class AdapterSlots:
    """The adapter registry and the LRU assignment of adapters to slots.

    Args:
      config: ``LoRAConfig`` (``max_loras`` slots, ``max_lora_rank``).
      load: ``load(name, path) -> Adapter`` (parse, check, build the values).
      writer: a ``SlotWriter`` (or anything with ``write(slot, values)``).

    Thread-safety: ``register``/``unregister``/``get``/``names`` may be
    called from any thread (the server's handlers); ``can_acquire`` /
    ``acquire`` / ``release`` only from the engine's thread (the scheduler).
    """

    def __init__(self, config: LoRAConfig, load, writer):
        self.config = config
        self._load = load
        self.writer = writer
        self._lock = threading.Lock()
        self.adapters: dict[str, Adapter] = {}
        self.slot_of: dict[str, int] = {}  # adapter name -> slot (1..max_loras)
        self.in_slot: list[str | None] = [None] * (config.max_loras + 1)  # [0] is the base
        self.pins = [0] * (config.max_loras + 1)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(1, config.max_loras + 1))  # least recent first
        self.num_swaps = 0
        self.last_swap_seconds = 0.0

    # ---- registry (any thread) ---------------------------------------------

    def register(self, name: str, path: str) -> Adapter:
        """Load the PEFT folder ``path`` as adapter ``name``.

        Raises:
          ValueError: a bad name, a name taken, or a folder the model cannot
            take (``checkpoints.peft``: names the file and field).
        """
        if not isinstance(name, str) or not name.strip() or len(name) > 256:
            raise ValueError(f"lora name must be a non-empty string of at most 256 "
                             f"characters, got {name!r}")
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = self._load(name, path)
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            self.adapters[name] = adapter
        log.info("LoRA adapter %r registered from %s (rank %d)", name, path, adapter.rank)
        return adapter

    def unregister(self, name: str) -> None:
        """Forget adapter ``name``: new requests cannot name it; requests
        running with it finish with it; its slot is freed when they end.

        Raises:
          KeyError: no adapter of that name.
        """
        with self._lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise KeyError(name)
            adapter.removed = True
        log.info("LoRA adapter %r unregistered", name)

    def get(self, name: str) -> Adapter:
        """The adapter ``name``.

        Raises:
          KeyError: no adapter of that name.
        """
        with self._lock:
            return self.adapters[name]

    def names(self) -> list[str]:
        with self._lock:
            return list(self.adapters)

    # ---- slots (the engine's thread) -----------------------------------------

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used unpinned one, else None."""
        for s in range(1, len(self.in_slot)):
            if self.in_slot[s] is None:
                return s
        for s in self._lru:
            if not self.pins[s]:
                return s
        return None

    def _resident(self, adapter: Adapter) -> int | None:
        s = self.slot_of.get(adapter.name)
        return s if s is not None and self.in_slot[s] == adapter.name else None

    def can_acquire(self, adapter: Adapter) -> bool:
        """``acquire`` would find ``adapter`` a slot now."""
        return self._resident(adapter) is not None or self._free_slot() is not None

    def acquire(self, adapter: Adapter) -> int:
        """Pin a slot holding ``adapter`` (swapping it in if needed); returns it.

        Raises:
          RuntimeError: every slot is pinned (check ``can_acquire`` first).
        """
        s = self._resident(adapter)
        if s is None:
            s = self._free_slot()
            if s is None:
                raise RuntimeError("every LoRA slot is pinned")
            old = self.in_slot[s]
            if old is not None:
                self.slot_of.pop(old, None)
            self.last_swap_seconds = self.writer.write(s, adapter.values)
            self.num_swaps += 1
            self.in_slot[s] = adapter.name
            self.slot_of[adapter.name] = s
            log.info("LoRA slot %d: %r in (%s out) in %.1f ms", s, adapter.name, old,
                     self.last_swap_seconds * 1e3)
        self.pins[s] += 1
        self._lru.move_to_end(s)
        return s

    def release(self, slot: int) -> None:
        """One pin less on ``slot``; an unregistered adapter's slot empties
        with its last pin."""
        assert self.pins[slot] > 0, slot
        self.pins[slot] -= 1
        name = self.in_slot[slot]
        if not self.pins[slot] and name is not None and name not in self.adapters:
            self.in_slot[slot] = None
            self.slot_of.pop(name, None)

    def stats(self) -> dict:
        """Slots in use, pinned, swaps so far, last swap time (s); each
        registered adapter's token counts (``tokens``: a list of ``(key, name,
        prompt tokens, generation tokens)``, ``key`` telling a re-registered
        name's new adapter from its old one); ``running``: the sorted names
        of the adapters running sequences pin. The slot figures are the
        engine thread's; read them there."""
        with self._lock:
            tokens = [(id(a), a.name, a.num_prompt_tokens, a.num_generation_tokens)
                      for a in self.adapters.values()]
        return dict(slots=len(self.in_slot) - 1,
                    resident=sum(n is not None for n in self.in_slot[1:]),
                    pinned=sum(1 for p in self.pins[1:] if p),
                    swaps=self.num_swaps, last_swap_seconds=self.last_swap_seconds,
                    tokens=tokens,
                    running=tuple(sorted(n for n, p in zip(self.in_slot[1:], self.pins[1:])
                                         if n is not None and p)))


class UnknownAdapterError(ValueError):
    """A request names an adapter the engine does not have (HTTP 404, gRPC
    NOT_FOUND)."""


def build_slots(config, runner, model_config, scheduler) -> AdapterSlots | None:
    """The engine's ``AdapterSlots`` for ``config.lora`` (None: LoRA off),
    its slot write compiled, and handed to ``scheduler``."""
    if config.lora is None:
        return None
    from checkpoints import peft
    from flax import nnx
    shapes = nnx.merge(runner.graphdef, runner.state)  # the layer runs, for slot_values

    def load(name: str, path: str) -> Adapter:
        adapter = peft.load_adapter(path)
        peft.check_adapter(adapter, model_config, config.lora)
        values = lora_model.slot_values(shapes, adapter)
        return Adapter(name, path, adapter.rank, values, cache_root(name, path))

    writer = SlotWriter(runner)
    writer.warmup()
    slots = AdapterSlots(config.lora, load, writer)
    scheduler.adapters = slots
    return slots


class EngineLoRA:
    """The ``Engine``'s LoRA entry points (``self.adapters``: ``AdapterSlots``
    or None when LoRA is off)."""

    adapters: AdapterSlots | None

    def _lora_on(self) -> AdapterSlots:
        if self.adapters is None:
            raise ValueError("LoRA is not enabled: start the engine with LoRA slots "
                             "(--max_loras / --lora_modules; LLM(enable_lora=True))")
        return self.adapters

    def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT folder ``path`` as adapter ``name`` (any thread;
        the swap into a slot happens when a request first needs it).

        Raises:
          ValueError: LoRA off, a bad or taken name, a folder the model
            cannot take (naming the file and field).
        """
        self._lora_on().register(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister adapter ``name``; its running requests finish with it.

        Raises:
          UnknownAdapterError: no adapter of that name (or LoRA off).
        """
        try:
            self._lora_on().unregister(name)
        except KeyError:
            raise UnknownAdapterError(f"LoRA adapter {name!r} not found") from None

    def list_loras(self) -> list[str]:
        """Names of the registered adapters ([] when LoRA is off)."""
        return [] if self.adapters is None else self.adapters.names()

    def lora_paths(self) -> dict[str, str]:
        """Every registered adapter's name -> its PEFT folder ({} when LoRA is
        off; any thread)."""
        out = {}
        for name in self.list_loras():
            try:
                out[name] = self.adapters.get(name).path
            except KeyError:  # unregistered meanwhile
                pass
        return out

    def lora_stats(self) -> dict | None:
        """The adapter slots' figures (``AdapterSlots.stats``: slots, resident,
        pinned, swaps, last_swap_seconds, per-adapter tokens); None when LoRA
        is off."""
        return None if self.adapters is None else self.adapters.stats()

    def resolve_lora(self, lora) -> Adapter | None:
        """The ``Adapter`` of a request's ``lora`` (a name, a ``LoRARequest``,
        or None for the base); a ``LoRARequest`` with a path registers it on
        first use.

        Raises:
          ValueError: LoRA off, or a bad folder.
          UnknownAdapterError: an unknown name (without a path).
        """
        if lora is None:
            return None
        slots = self._lora_on()
        name = lora.lora_name if isinstance(lora, LoRARequest) else lora
        try:
            return slots.get(name)
        except KeyError:
            pass
        if isinstance(lora, LoRARequest) and lora.lora_path:
            try:
                return slots.register(name, lora.lora_path)
            except ValueError:
                if name in slots.names():  # registered meanwhile by another thread
                    return slots.get(name)
                raise
        raise UnknownAdapterError(f"LoRA adapter {name!r} not found; loaded: "
                                  f"{slots.names()}")


def cache_root(name: str, path: str) -> bytes:
    """The prefix-cache root of an adapter: sha256 of its name, path and the
    time it was registered (a re-registered name hashes anew: its weights
    may differ)."""
    return hashlib.sha256(f"lora\0{name}\0{path}\0{time.time_ns()}".encode()).digest()


__all__ = ["Adapter", "AdapterSlots", "EngineLoRA", "LoRARequest", "SlotWriter",
           "UnknownAdapterError", "build_slots", "cache_root"]
