"""Step shapes: the bucket ladder pads by less than 25%, every step a config
can schedule lands on one of ``step_token_counts``, ``Engine.warmup``
compiles them all so later traffic compiles nothing, and ``--mode serve``
reports ready only after that."""

import re

import numpy as np
import pytest

from jaxserve.engine.shapes import bucket, ladder, step_token_counts


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
    counts = engine.step_token_counts()
    assert counts == ladder(32)
    first = engine.warmup()
    # One step program per token count, sampling per row count, with and without top-N.
    assert first >= len(counts)
    assert engine.warmup() == 0  # all in this process's cache now
    before = engine.runner.num_compilations
    outs = _mixed_traffic(llm)
    assert engine.runner.num_compilations == before, "traffic compiled a new shape"
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) > 40


@pytest.mark.slow
def test_serve_compiles_before_serving(tiny_gguf):
    """With warm-up on, the server logs the compilation before it reports
    serving, and requests afterwards compile nothing (the metric holds)."""
    from jaxserve.server.client import Client
    from server_util import ServerProcess
    s = ServerProcess(["--model", tiny_gguf, "--max_num_seqs", "8", "--max_num_batched_tokens",
                       "32", "--num_pages", "128", "--page_size", "8"], warmup=True)
    try:
        log = "".join(s.lines)
        compiled = re.search(r"compiled (\d+) step shapes in [\d.]+ s", log)
        assert compiled and int(compiled.group(1)) == len(ladder(32))
        assert log.index("compiling") < log.index("jaxserve: serving")
        before = s.metrics()["jaxserve_xla_compilations_total"]
        with Client(s.target) as c:
            assert c.health() == "SERVING"
            for i, n in enumerate((1, 5, 17, 29)):
                c.complete("hello " * n, max_tokens=3 + i, temperature=0)
        assert s.metrics()["jaxserve_xla_compilations_total"] == before
    finally:
        s.kill()
