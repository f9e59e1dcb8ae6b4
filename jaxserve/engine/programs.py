"""A runner's programs made ready ahead of time: the warm-up, the table of
compiled programs by name, and the store of serialized executables.

``warmup`` makes ready every program a step of the given buckets can need
(``step_buckets``: ``decode_step`` per row bucket, ``prefill_step`` per token
bucket; each one's sampling, plain and penalised, and a prefill bucket's
prompt logprobs). In a one-process job they are compiled ahead of time
(``jit(...).lower(...).compile()``, nothing runs) into ``_programs``, a dict
from a program's name (``decode-step-8``, ``sampling-8-m0-mp0``,
``prompt-logprobs-64-top0``) to its ``jax.stages.Compiled``, which
``ModelRunner.run`` calls through ``_ready`` (a name missing there falls back
to the jitted function, which compiles on first use); a program is first
looked up in the executable store (``executables.ExecutableStore``, under
the persistent compilation cache folder, keyed by a fingerprint of the
model, shapes, mesh and devices), and one XLA compiled afresh is saved there.
In a multi-host job padding plans of those shapes run instead, so every
process builds the same programs.

A step's sampling tensors always carry the token bitmask ([S, W], W =
``bitmask_width(V)``) and the logit_bias table ([S, ``MAX_LOGIT_BIAS``]),
constrained rows or not, so a sampling program's name (its S and penalty
widths) is all that varies, and steps with constrained rows reach the same
programs as plain ones.

``ProgramsMixin`` is mixed into ``runner.ModelRunner``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import jax
import numpy as np

from jaxserve.engine import compile_cache, shapes
from jaxserve.engine.executables import ExecutableStore, capture_cache_reads, fingerprint
from jaxserve.engine.plan import StepPlan
from jaxserve.engine.sampling import SamplingTensors


class ProgramsMixin:
    """``ModelRunner``'s warm-up and program table (module docstring)."""

    def _init_programs(self) -> None:
        self._warm_rows: set[int] = set()  # S whose penalised sampling a warm-up compiled
        # Programs made ready ahead of time (warmup), by name: run calls them.
        self._programs: dict[str, jax.stages.Compiled] = {}
        self._store: ExecutableStore | None | bool = None  # _executable_store; False: off
        self.num_loaded_programs = 0  # of them, deserialized from the store

    def _ready(self, name: str, fallback):
        """The program ``name`` made ready ahead of time, else ``fallback``
        (the jitted function: it compiles on first use)."""
        return self._programs.get(name) or fallback

    def step_buckets(self) -> list[tuple[bool, int]]:
        """Every step program this runner can reach, as (decode, T):
        ``decode_step`` for each row bucket up to ``max_rows``, then
        ``prefill_step`` for each token bucket up to ``max_tokens``
        (``shapes``)."""
        return ([(True, t) for t in shapes.decode_buckets(self.max_rows)]
                + [(False, t) for t in shapes.prefill_buckets(self.max_tokens)])

    def warmup(self, buckets=None, on_compiled=None, variants: bool = True) -> int:
        """Compile every program a step in ``buckets`` (default
        ``step_buckets()``) can need: its step program; sampling for its S
        rows, plain and penalised (``penalty_width``), each one program with
        and without top-N logprobs; and for a prefill bucket, prompt
        logprobs over its T tokens. In a one-process job the programs are
        compiled ahead of time (``jit(...).lower(...).compile()``: nothing
        runs, and a later call with those shapes finds them); in a
        multi-host job empty plans of those shapes run, so the other
        processes build them too. ``on_compiled(i, T, seconds)`` is called
        after each bucket. ``variants=False``: plain sampling only (no
        penalised sampling, no prompt logprobs). Returns the number of
        programs traced (each compiled, or loaded from the persistent cache).

        Raises:
          MultihostError: a multi-host warm-up step failed.
        """
        before = self.num_compilations + self.num_loaded_programs
        for i, (decode, T) in enumerate(self.step_buckets() if buckets is None else buckets):
            t0 = time.monotonic()
            plans = [self.empty_plan(T, 0, decode)]
            if variants and plans[0].rows not in self._warm_rows:
                self._warm_rows.add(plans[0].rows)
                plans.append(self.empty_plan(T, 0, decode, penalised=True))
            if variants and not decode:
                plans.append(self.empty_plan(T, 0, decode, prompt_logprobs=True))
            if self.channel is None:
                self._compile_plans(plans)
            else:
                for plan in plans:
                    self._execute_plan(plan)
            if on_compiled is not None:
                on_compiled(i, T, time.monotonic() - t0)
        return self.num_compilations + self.num_loaded_programs - before

    def _compile_plans(self, plans: list["StepPlan"]) -> None:
        """Make ready the programs ``run`` would launch for plans of one step
        shape without running them: the step once, then each plan's sampling
        and prompt logprobs (``empty_plan``'s variants). Each is loaded from
        the executable store when it has it, else lowered and compiled
        (``jit(...).lower(...).compile()``, which the persistent cache may
        serve) and saved there. Safe beside running steps (a background
        warm-up): the donated caches enter as their shapes and shardings."""
        md = plans[0].md
        T = md.input_ids.shape[0]
        step = self.decode_step if md.decode_only else self.prefill_step
        args = (self.state, *self._kv_specs, md, plans[0].prev_rows, self._no_prev)
        self._program(self._step_name(md.decode_only, T), lambda: step.lower(*args))
        outs = []  # the step's result shapes, traced only when a program below is missing

        def out_info():
            if not outs:
                outs.append(jax.eval_shape(step, *args))
            return outs[0]
        for plan in plans:
            self._program(self._sampling_name(plan.rows, plan.sampling),
                          lambda p=plan: self._postprocess.lower(
                              out_info()[0], p.sampling, p.rows, np.bool_(p.num_top > 0)))
            if plan.targets.shape[0]:
                self._program(f"prompt-logprobs-{T}-top{plan.num_top}",
                              lambda p=plan: self._prompt_logprobs.lower(
                                  self.state, out_info()[-1], p.targets, p.num_top))

    @staticmethod
    def _step_name(decode: bool, T: int) -> str:
        return f"{'decode' if decode else 'prefill'}-step-{T}"

    @staticmethod
    def _sampling_name(rows: int, st: SamplingTensors) -> str:
        return f"sampling-{rows}-m{st.output_ids.shape[1]}-mp{st.prompt_ids.shape[1]}"

    def _program(self, name: str, lower):
        """The ready program ``name``: made before, loaded from the store, or
        ``lower()``-ed and compiled (then saved to the store)."""
        exe = self._programs.get(name)
        if exe is not None:
            return exe
        store = self._executable_store()
        exe = store.load(name) if store is not None else None
        if exe is not None:
            self.num_loaded_programs += 1
        elif store is None:
            exe = lower().compile()
        else:
            # A program JAX's persistent cache served is saved with the cache
            # entry's bytes (its own re-serialization lacks the kernels on CPU).
            fresh = compile_cache.fresh_compiles_in_thread()
            with capture_cache_reads() as read:
                exe = lower().compile()
            if compile_cache.fresh_compiles_in_thread() > fresh:
                store.save(name, exe)
            elif read.serialized is not None:
                store.save(name, exe, serialized=read.serialized)
        self._programs[name] = exe
        return exe

    def _executable_store(self) -> ExecutableStore | None:
        """This runner's store of serialized programs under the persistent
        cache folder (``executables``), or None: the cache is off, or a
        multi-host job (whose programs every process must build alike)."""
        if self._store is False:
            return None
        if self._store is None:
            folder = compile_cache.active_dir()
            if folder is None or self.channel is not None:
                self._store = False
                return None
            leaves = [(jax.tree_util.keystr(path), a.shape, str(a.dtype),
                       str(getattr(a.sharding, "spec", a.sharding)))
                      for path, a in jax.tree_util.tree_flatten_with_path(
                          (self.state, self._kv_specs))[0]]
            # The graph's static fields (attention path, windows, activations), without
            # the addresses its function reprs carry.
            graph = re.sub(r" at 0x[0-9a-f]+", "", str(self.graphdef))
            key = fingerprint(graph, dataclasses.asdict(self.model_config),
                              leaves, dict(self.mesh.shape),
                              [d.id for d in self.mesh.devices.flat], self.num_pages,
                              self.page_size, self.pages_per_row, self.max_rows,
                              self.max_tokens, self.penalty_width, self.has_expert_load)
            self._store = ExecutableStore(os.path.join(folder, "executables"), key,
                                          self.mesh.devices.flat)
        return self._store
