"""The Pallas attention under ``jax.shard_map`` over the kv-head mesh axis
(issue 32: with tensor parallelism XLA gathered the kv-head-sharded cache
around the kernel call). On 8 fake CPU devices (conftest) in the Pallas
interpreter: the sharded call equals the unsharded one and the reference,
and the compiled program moves no cache between devices (no all-gather).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.ragged_paged_attention import kernel as rpa_kernel
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention
from test_rpa_kernel_gpu import make_batch, quantize_pages

Q_LENS, KV_LENS = [1, 9, 1, 0, 4], [70, 40, 130, 3, 20]


# Any cross-device data movement in compiled HLO.
_COLLECTIVES = r"all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter"


def _mesh(dp, tp):
    return Mesh(np.array(jax.devices()[:dp * tp]).reshape(dp, tp), ("dp", "tp"))


def _batch(K, G, kv_dtype=None):
    args, owned = make_batch(np.random.default_rng(0), Q_LENS, KV_LENS, page_size=8, K=K, G=G,
                             H=64, dtype=jnp.float32, extra_rows=2)
    scales = {}
    if kv_dtype is not None:
        args, ks, vs = quantize_pages(args, kv_dtype)
        scales = dict(k_scales_PLK=ks, v_scales_PLK=vs)
    return args, scales, owned


def _place(mesh, args, scales):
    """q split on N, pages and scales on K, metadata replicated."""
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    rep = P()
    specs = (P(None, "tp", None), P(None, None, "tp", None), P(None, None, "tp", None),
             rep, rep, rep, rep)
    return (tuple(put(a, s) for a, s in zip(args, specs)),
            {k: put(v, P(None, None, "tp")) for k, v in scales.items()})


def _call(mesh=None, axis=None, **kw):
    return jax.jit(functools.partial(rpa_kernel.ragged_paged_attention, sm_scale=0.125,
                                     interpret=True, mesh=mesh, kv_heads_axis=axis, **kw))


@pytest.mark.parametrize("dp,tp,K,G,kv_dtype", [
    (2, 4, 4, 2, None),           # a (dp, tp) mesh: replicated over dp
    (1, 2, 2, 3, jnp.int8),       # quantized pages: scales split beside them
])
def test_sharded_equals_unsharded_without_gathering_the_cache(dp, tp, K, G, kv_dtype):
    mesh = _mesh(dp, tp)
    args, scales, owned = _batch(K, G, kv_dtype)
    want = np.asarray(_call(sliding_window=50)(*args, **scales))
    ref = np.asarray(ref_ragged_paged_attention(*args, sm_scale=0.125, sliding_window=50,
                                                **scales))
    np.testing.assert_allclose(want[:owned], ref[:owned], atol=1e-5, rtol=1e-5)

    s_args, s_scales = _place(mesh, args, scales)
    f = _call(mesh, "tp", sliding_window=50)
    got = f(*s_args, **s_scales)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp", None)), 3)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-6)

    hlo = f.lower(*s_args, **s_scales).compile().as_text()
    assert not re.search(_COLLECTIVES, hlo)
    # Per device the kernel sees its own kv heads: K / tp of them.
    assert re.search(rf"\[\d+,8,{K // tp},64\]", hlo)


def test_unsharded_call_on_sharded_cache_gathers_it():
    """The check above can fail: without the mesh, the same sharded inputs
    make XLA move cache data between devices. (Here, with the kernel
    interpreted as plain HLO, the partitioner turns each gathered K/V block
    into a masked local gather and an all-reduce; with the real Triton
    custom call, which XLA cannot partition, it all-gathers the cache.)"""
    mesh = _mesh(1, 4)
    args, scales, _ = _batch(4, 2)
    s_args, s_scales = _place(mesh, args, scales)
    hlo = _call().lower(*s_args, **s_scales).compile().as_text()
    assert re.search(_COLLECTIVES, hlo)


def test_axis_must_divide_heads():
    mesh = _mesh(1, 4)
    args, scales, _ = _batch(2, 2)       # K = 2 kv heads, tp = 4
    with pytest.raises(ValueError, match=r"'tp' of size 4 must divide .*K=2"):
        _call(mesh, "tp")(*args)
    with pytest.raises(ValueError, match="kv_heads_axis 'mp' is not an axis"):
        _call(mesh, "mp")(*args)


@pytest.mark.slow
def test_tiny_engine_tp2_pallas_equals_xla(tiny_parts, monkeypatch):
    """The engine at tp = 2 (tiny: N = 4, K = 2) runs the Pallas attention
    under shard_map (the model passes the mesh it is traced under) and gives
    the XLA path's greedy tokens of one device."""
    from conftest import XLA_CACHE
    from jaxserve import LLM, SamplingParams

    calls = []
    real = rpa_kernel._shard_over_kv_heads
    monkeypatch.setattr(rpa_kernel, "_shard_over_kv_heads",
                        lambda args, kw, interp, mesh, axis, *rest: calls.append(
                            (dict(mesh.shape), axis)) or real(args, kw, interp, mesh, axis,
                                                              *rest))
    prompts = [[5, 17, 99, 3, 250, 7, 7, 31], [200], list(range(10, 40))]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for impl, tp in (("xla", 1), ("pallas", 2)):
        llm = LLM(mesh=f"tp={tp}", devices=jax.devices()[:tp], attention_impl=impl,
                  attention_interpret=impl == "pallas", page_size=8, num_pages=64,
                  compilation_cache_dir=XLA_CACHE, **tiny_parts)
        outs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert calls and all(c == (dict(dp=1, tp=2, ep=1), "tp") for c in calls)
    assert outs["pallas"] == outs["xla"]
