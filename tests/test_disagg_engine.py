"""The engine side of the KV handoff, in one process: a prefill engine's
held pages exported and written into a decode engine (``hold_kv``,
``export_kv``, ``add_prefilled``), against the same engine run colocated."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.engine.kv_handoff import KVHandoffError

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prefill(engine, prompts):
    """Run each prompt for one token with ``hold_kv``; {id: first token}."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0,
                                                      ignore_eos=True), hold_kv=True)
    first = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                first[out.request_id] = out.outputs[0].token_ids[0]
    return first


def _drain(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_handoff_equals_colocated_and_frees_every_page(make_tiny_llm, kv_cache_dtype):
    """Prompts of 1..15 pages (several power-of-two pieces each) prefilled
    by one engine, their pages exported and written into another (int8 pages
    carry their scales): the same greedy tokens as the colocated engine,
    and every page free on both afterwards."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(2, 250, size=n)] for n in (3, 29, 60, 117)]
    want = [o.outputs[0].token_ids for o in
            make_tiny_llm(kv_cache_dtype=kv_cache_dtype).generate(prompts, GREEDY)]
    pre = make_tiny_llm(kv_cache_dtype=kv_cache_dtype).engine
    dec = make_tiny_llm(kv_cache_dtype=kv_cache_dtype).engine
    first = _prefill(pre, prompts)
    assert pre.num_held_kv == 4 and pre.num_free_pages < pre.num_pages
    for i, p in enumerate(prompts):
        kv = pre.export_kv(f"p{i}")
        assert [k.pages_PLKH.shape[1] for k, _ in kv] == \
            pre.runner.page_pieces(-(-len(p) // 8))
        if kv_cache_dtype == "int8":
            assert kv[0][0].scales_PLK is not None
        dec.add_prefilled(f"d{i}", p, GREEDY, first[f"p{i}"], kv, transfer_ms=1.0,
                          transfer_bytes=123)
    assert pre.num_held_kv == 0
    assert pre.num_free_pages == pre.num_pages
    done = _drain(dec)
    assert [done[f"d{i}"].outputs[0].token_ids for i in range(4)] == want
    m = done["d2"].metrics
    assert (m.disagg_route, m.kv_transfer_ms, m.kv_transfer_bytes) == ("handoff", 1.0, 123)
    assert m.ttft_ms is not None and m.num_output_tokens == 10
    assert dec.num_free_pages == dec.num_pages


def test_cached_prefix_pages_are_skipped_and_refusals_change_nothing(make_tiny_llm):
    """The decode engine's cached prefix pages are not sent: only the rest
    is exported and written beside them. A handoff that cannot be taken
    (pages evicted, wrong page count, no room) raises ``KVHandoffError``
    with its reason and leaves both engines' pages as they were."""
    rng = np.random.default_rng(1)
    system = [int(t) for t in rng.integers(2, 250, size=48)]  # 6 full pages of 8
    prompt = system + [int(t) for t in rng.integers(2, 250, size=13)]
    want = make_tiny_llm().generate([prompt], GREEDY)[0].outputs[0].token_ids
    pre, dec = make_tiny_llm().engine, make_tiny_llm().engine
    dec.add_request("warm", system + [7], SamplingParams(max_tokens=1))
    _drain(dec)
    skip = dec.cached_prefix_pages(prompt)
    assert skip == 6
    first = _prefill(pre, [prompt])
    kv = pre.export_kv("p0", skip)
    assert sum(k.pages_PLKH.shape[1] for k, _ in kv) == 8 - 6

    free = dec.num_free_pages
    with pytest.raises(KVHandoffError, match="bad_kv") as e:
        dec.add_prefilled("bad", prompt, GREEDY, first["p0"], kv, skip_pages=0)
    assert e.value.reason == "bad_kv"
    with pytest.raises(KVHandoffError) as e:  # a prefix this engine never cached
        dec.add_prefilled("evicted", [9] * 48 + prompt[48:], GREEDY, first["p0"], kv, skip)
    assert e.value.reason == "evicted"
    assert dec.num_free_pages == free and not dec.get_sequences("bad")

    dec.add_prefilled("d", prompt, GREEDY, first["p0"], kv, skip)
    out = _drain(dec)["d"]
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 48

    small = make_tiny_llm(num_pages=8).engine  # a running sequence holds 6 of its 8 pages
    small.add_request("busy", [3] * 41, SamplingParams(max_tokens=5, ignore_eos=True))
    small.step()
    free = small.num_free_pages
    assert free == 2
    pre2 = make_tiny_llm().engine
    first = _prefill(pre2, [prompt[:30]])
    with pytest.raises(KVHandoffError) as e:
        small.add_prefilled("big", prompt[:30], SamplingParams(max_tokens=1),
                            first["p0"], pre2.export_kv("p0"))
    assert e.value.reason == "no_pages"
    assert small.num_free_pages == free and not small.get_sequences("big")
    _drain(small)
    assert small.num_free_pages == 8


def test_held_pages_are_released_aborted_or_refused(make_tiny_llm):
    """``hold_kv`` pages stay until ``export_kv`` or ``release_kv``; an
    aborted prefill frees them at once; unknown ids and bad skips are
    refused naming the value."""
    eng = make_tiny_llm().engine
    total = eng.num_pages
    _prefill(eng, [[5] * 20, [6] * 30])
    assert eng.num_held_kv == 2
    assert eng.release_kv("p0") and not eng.release_kv("p0")
    with pytest.raises(ValueError, match="skip_pages must be in"):
        eng.export_kv("p1", 4)
    with pytest.raises(KeyError, match="p9"):
        eng.export_kv("p9")
    assert eng.release_kv("p1")
    assert eng.num_free_pages == total
    chunked = make_tiny_llm(max_num_batched_tokens=16).engine  # a prefill of 3 chunks
    chunked.add_request("a", [4] * 40, SamplingParams(max_tokens=1), hold_kv=True)
    chunked.step()
    assert chunked.num_free_pages < total
    chunked.abort("a")
    _drain(chunked)
    assert chunked.num_held_kv == 0 and chunked.num_free_pages == total
    # Once it has finished, an abort leaves the held pages to release_kv (or the lease).
    _prefill(eng, [[4] * 40])
    eng.abort("p0")
    _drain(eng)
    assert eng.num_held_kv == 1 and eng.release_kv("p0")
    assert eng.num_free_pages == total
    with pytest.raises(ValueError, match="hold_kv needs SamplingParams.n == 1"):
        eng.add_request("n2", [4] * 5, SamplingParams(n=2), hold_kv=True)
    with pytest.raises(ValueError, match="n == 1 and no logprobs"):
        eng.add_prefilled("lp", [4] * 5, SamplingParams(logprobs=2), 3, [])
