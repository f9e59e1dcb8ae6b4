"""Greedy sampling's per-row statistics on CPU: one C++ FFI kernel
(``kernel.cc``, built into the ``quant_matmul_cpu`` extension) reads each row
of logits once for its argmax and the log-prob of that token, where XLA:CPU
runs a variadic argmax reduce, a materialised ``log_softmax`` and a rank count
as separate passes.

``jaxserve.engine.sampling.sample`` calls ``greedy`` for a step whose rows
are all plain greedy ones (temperature 0; no token mask, logit bias, bans,
penalties or top log-probs), where ``serves`` says the kernel applies.

Math per row x = logits[s] (V values): ``id`` = the first index of the largest
value (a NaN counts as larger than any number, the first NaN wins, as
``jnp.argmax``); ``logprob`` = (x[id] - max) - log(sum exp(x - max)), the value
of ``jax.nn.log_softmax`` at id (the kernel's exp: a degree-6 polynomial,
relative error ~1e-7; ``reference.py`` is the numpy form).

Design: rows are shared over XLA's intra-op pool; with AVX-512 a row is two
passes, the max (and the first index holding it) and the sum of exps, 16
lanes at a time; without it, a scalar loop.

Measured (the 2-core Xeon with AVX-512 and AMX of the README's tables; V =
49,152, one process, the whole jitted ``sample`` of greedy rows): 32 rows
12.1 -> 0.74 ms, one row 0.50 -> 0.21 ms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant_matmul_cpu


def serves(logits_SV) -> bool:
    """True where ``greedy`` may run: the CPU backend, the library loaded (and
    ``JAXSERVE_CPU_KERNELS`` not ``0``), 2-D logits, and no mesh of several
    devices (a custom call does not split over a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return (jax.default_backend() == "cpu" and jnp.ndim(logits_SV) == 2
            and (mesh.empty or mesh.size == 1) and quant_matmul_cpu.available())


def greedy(logits_SV, isa: int = -1, threads: int = 0):
    """Argmax and its log-prob per row.

    Args:
      logits_SV: [S, V] logits (cast to f32).
      isa: -1 the best the CPU has, 0 scalar, 2 AVX-512F.
      threads: 0 XLA's intra-op pool size, n at most n threads.

    Returns:
      (ids i32[S], logprobs f32[S]).

    Raises:
      RuntimeError: the kernel library is not available.
    """
    if not quant_matmul_cpu.available():
        raise RuntimeError("sampling_cpu: the kernel library is not available")
    x = jnp.asarray(logits_SV, jnp.float32)
    S = x.shape[0]
    return jax.ffi.ffi_call("jaxserve_greedy_f32",
                            (jax.ShapeDtypeStruct((S,), jnp.int32),
                             jax.ShapeDtypeStruct((S,), jnp.float32)))(
        x, isa=np.int32(isa), threads=np.int32(threads))
