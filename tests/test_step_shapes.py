"""Step shapes: the fine ladder pads by less than 25% and the two step
programs' ladders by less than 50%, every step a config can schedule lands
on one of the runner's ``step_buckets``, ``Engine.warmup`` compiles them all
so later traffic compiles nothing, and ``--mode serve`` reports ready only
after that."""

import re
import threading
import time

import numpy as np
import pytest

from jaxserve.engine.shapes import (bucket, coarse_bucket, coarse_ladder, decode_bucket,
                                    decode_buckets, ladder, prefill_bucket, prefill_buckets,
                                    step_token_counts)


def test_bucket_ladder():
    assert [bucket(n) for n in range(1, 9)] == list(range(1, 9))
    assert ladder(64) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    for n in range(1, 20000):
        b = bucket(n)
        assert n <= b < 1.25 * n, n
        assert bucket(b) == b
    assert bucket(17) == 20 and bucket(940) == 1024 and bucket(1025) == 1280
    with pytest.raises(ValueError, match="n must be >= 1"):
        bucket(0)


def test_step_token_counts_cover_every_step():
    counts = step_token_counts(2048, 64, 8192)
    assert counts[0] == 1 and counts[-1] == 2048 and len(counts) == 40
    assert all(bucket(n) in counts for n in range(1, 2049))
    # Without chunked prefill a whole prompt may run beside the decodes.
    unchunked = step_token_counts(512, 16, 4096, enable_chunked_prefill=False)
    assert bucket(4096 + 15) in unchunked and unchunked[-1] == bucket(4096 + 16)


def test_decode_and_prefill_ladders():
    assert decode_buckets(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert prefill_buckets(2048) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                                     1024, 1536, 2048]
    for n in range(1, 20000):
        b = coarse_bucket(n)
        assert n <= b < 1.5 * n or n <= 4 == b, n
        assert coarse_bucket(b) == b
    assert all(decode_bucket(n, 64) in decode_buckets(64) for n in range(1, 65))
    assert all(prefill_bucket(n, 2048) in prefill_buckets(2048) for n in range(1, 2049))
    assert prefill_bucket(3, 2048) == 16 and prefill_bucket(940, 2048) == 1024
    assert coarse_ladder(10) == [1, 2, 3, 4, 6, 8, 12]
    with pytest.raises(ValueError, match="decode step of 65 rows"):
        decode_bucket(65, 64)
    assert prefill_bucket(2049, 2048) == 3072  # a scoring batch past the budget
    assert prefill_buckets(8) == [16] and {prefill_bucket(n, 8) for n in (1, 8)} == {16}
    with pytest.raises(ValueError, match="prefill step of 0 tokens"):
        prefill_bucket(0, 2048)


def _mixed_traffic(llm):
    """Prompts of many lengths, n > 1, logprobs and seeded sampling, all at
    once, so steps mix decode rows and prefill chunks of every size."""
    from jaxserve import SamplingParams
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 250, size=int(n)).tolist()
               for n in rng.integers(1, 90, size=12)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=0.8 * (i % 2),
                             seed=i, n=1 + (i % 3 == 0), logprobs=2 if i % 4 == 0 else None,
                             ignore_eos=True) for i in range(len(prompts))]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_warmup_compiles_every_shape_once(make_tiny_llm):
    llm = make_tiny_llm(max_num_seqs=8, max_num_batched_tokens=32)
    engine = llm.engine
    buckets = engine.step_buckets()
    assert buckets == [(True, t) for t in (1, 2, 3, 4, 6, 8)] + \
        [(False, t) for t in (16, 24, 32)]
    assert engine.step_token_counts() == [1, 2, 3, 4, 6, 8, 16, 24, 32]
    first = engine.warmup()
    # One program per step bucket, and sampling per row count (with or without top-N).
    assert first >= len(buckets)
    assert engine.warmup() == 0  # all in this process's cache now
    before = engine.num_compilations
    outs = _mixed_traffic(llm)
    assert engine.num_compilations == before, "traffic compiled a new shape"
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) > 40


def test_background_warmup_never_makes_a_step_wait(make_tiny_llm):
    """``warmup(background=True)`` compiles the smallest buckets, then the
    rest in a thread (slowed here so traffic overlaps it); meanwhile the
    scheduler keeps every step within the ready buckets, so no step traces
    a program on the engine's thread."""
    llm = make_tiny_llm(max_num_seqs=8, max_num_batched_tokens=32)
    e = llm.engine
    traced_on, caps_seen = [], []
    real_step, real_compile, real_schedule = e.runner._step, e.runner._compile_plans, \
        e.scheduler.schedule

    def step(*a):
        traced_on.append(threading.current_thread().name)
        return real_step(*a)

    def slow_compile(plans):
        time.sleep(0.3)
        return real_compile(plans)

    def schedule(*a, **k):
        caps_seen.append(e.scheduler.caps)
        return real_schedule(*a, **k)
    e.runner._step, e.runner._compile_plans, e.scheduler.schedule = step, slow_compile, schedule
    e.warmup(background=True)
    assert e.scheduler.caps == (1, 16) and not e.warmup_done.is_set()
    n0 = len(traced_on)
    outs = _mixed_traffic(llm)
    assert any(c is not None and c[0] < 8 for c in caps_seen), caps_seen  # overlapped
    assert e.warmup_done.wait(120) and e.warmup_error is None
    assert e.scheduler.caps is None
    assert set(traced_on[n0:]) <= {"jaxserve-warmup"}, traced_on  # none on the engine thread
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) > 40
    before = e.num_compilations
    _mixed_traffic(llm)
    assert e.num_compilations == before


@pytest.fixture(scope="module")
def long_gguf(tmp_path_factory):
    """A tiny random Llama GGUF with room for 2,000-token prompts."""
    from tiny_gguf import write_tiny_gguf
    from jaxserve.config import ModelConfig
    path = tmp_path_factory.mktemp("long-gguf") / "tiny.gguf"
    write_tiny_gguf(path, ModelConfig(vocab_size=320, max_position_embeddings=2304,
                                      num_layers=2))
    return str(path)


def _burst(target):
    """Acceptance 4's burst, all at once over gRPC: prompts of 1 to 2,000
    tokens, n up to 4, logprobs, prompt logprobs, stop strings, penalties,
    seeded sampling. Returns each request's ``Result``."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxserve.server.client import Client
    rng = np.random.default_rng(1)
    lengths = [1, 2, 7, 40, 130, 333, 600, 1100, 2000, 1, 17, 64]
    kinds = [dict(n=4, temperature=0.9, seed=7), dict(logprobs=3), dict(prompt_logprobs=2),
             dict(stop=["a", "e"], temperature=1.0, seed=3),
             dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
             dict(n=2, logprobs=2, prompt_logprobs=1, repetition_penalty=1.1,
                  temperature=0.7, seed=5, top_k=20, top_p=0.9)]
    jobs = [dict(token_ids=rng.integers(2, 300, n).tolist(), max_tokens=int(rng.integers(2, 24)),
                 ignore_eos=True, **kinds[i % len(kinds)]) for i, n in enumerate(lengths)]
    with Client(target) as c, ThreadPoolExecutor(len(jobs)) as pool:
        return jobs, list(pool.map(lambda kw: c.complete(timeout=600, **kw), jobs))


def _check_burst(jobs, results):
    for kw, res in zip(jobs, results):
        assert len(res.completions) == kw.get("n", 1), kw
        for c in res.completions:
            assert c.token_ids, kw
            if "stop" not in kw:
                assert len(c.token_ids) == kw["max_tokens"], kw
            if kw.get("logprobs"):
                assert len(c.logprobs) == len(c.token_ids), kw


SERVE_ARGS = ["--max_num_seqs", "16", "--max_num_batched_tokens", "128", "--num_pages", "512",
              "--page_size", "16"]


@pytest.mark.slow
def test_serve_compiles_before_serving_and_a_mixed_burst_compiles_nothing(long_gguf):
    """With the whole warm-up before SERVING (--nowarmup_in_background), the
    server logs the compilation of every step shape before it reports
    serving, and a mixed burst afterwards compiles no XLA program
    (``/metrics``)."""
    from server_util import ServerProcess
    s = ServerProcess(["--model", long_gguf, "--nowarmup_in_background", *SERVE_ARGS],
                      warmup=True)
    try:
        log = "".join(s.lines)
        compiled = re.search(r"compiled (\d+) step shapes in [\d.]+ s", log)
        assert compiled and int(compiled.group(1)) == len(decode_buckets(16) +
                                                          prefill_buckets(128))
        assert log.index("compiled") < log.index("jaxserve: serving")
        before = s.metrics()["jaxserve_xla_compilations_total"]
        jobs, results = _burst(s.target)
        _check_burst(jobs, results)
        assert s.metrics()["jaxserve_xla_compilations_total"] == before
    finally:
        s.kill()


@pytest.mark.slow
def test_background_warmup_serves_at_once_and_compiles_nothing_after(long_gguf):
    """The default warm-up turns SERVING after the smallest decode and
    prefill steps; a burst then is served while the rest compile (steps
    kept within the ready buckets), the end of the warm-up is logged and
    in ``/metrics``, and a second burst after it compiles nothing."""
    from server_util import ServerProcess
    s = ServerProcess(["--model", long_gguf, *SERVE_ARGS], warmup=True)
    try:
        log = "".join(s.lines)
        assert "the rest in the background" in log
        assert "compiled 15 step shapes" not in log.split("jaxserve: serving")[0]
        _check_burst(*_burst(s.target))  # while the larger buckets compile
        done = threading.Event()
        t_end = time.monotonic() + 300
        while not re.search(r"compiled 15 step shapes in [\d.]+ s", "".join(s.lines)):
            assert time.monotonic() < t_end and not done.wait(0.2), "".join(s.lines[-20:])
        assert s.metrics()["jaxserve_startup_warmup_seconds"] > 0
        before = s.metrics()["jaxserve_xla_compilations_total"]
        _check_burst(*_burst(s.target))
        assert s.metrics()["jaxserve_xla_compilations_total"] == before
    finally:
        s.kill()
