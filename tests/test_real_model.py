"""SmolLM2-135M-Instruct (Q4_1 GGUF) end to end: jaxserve against HF transformers.

Numerics (last-token logits, greedy tokens) are compared with transformers'
own f32 load of the same GGUF file, computed live once per module
(``hf_refs``); engine properties (paging, KV budget, seeded sampling, input
validation) and the CLI run on the real model. One jaxserve ``LLM`` with the
default engine args (``smollm2_llm`` in conftest.py) serves every test except
the paging one, which needs other page sizes and a tiny KV budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.engine.page_table import cdiv

from conftest import XLA_CACHE

pytestmark = pytest.mark.real_model

EOS = 2  # <|im_end|>, SmolLM2's only EOS id
N_GREEDY = 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUMMARIZE = (
    "Summarize in one sentence: The Industrial Revolution began in Great Britain in the late "
    "18th century and spread to Europe and North America. It replaced hand production with "
    "machines, brought new chemical and iron making processes, and made steam power and the "
    "factory system common. Living standards rose over the long run, but working conditions "
    "in early factories were often harsh, with long hours, child labour and dangerous "
    "machinery. Cities grew quickly as people moved from farms to find work, and new "
    "railways and canals carried coal, cotton and people across whole countries.")
LONG_RAW = (
    "The history of computing is longer than the history of computing hardware and modern "
    "computing technology and includes the history of methods intended for pen and paper or "
    "for chalk and slate, with or without the aid of tables. Digital computing is intimately "
    "tied to the representation of numbers. But long before abstractions like the number arose, "
    "there were mathematical concepts to serve the purposes of civilization. These concepts are "
    "implicit in concrete practices such as one-to-one correspondence, the basis of counting, "
    "comparison to a standard, used for measurement, and the 3-4-5 right triangle, a device "
    "for assuring a right angle. The earliest known tool for use in computation was the abacus, "
    "developed in the period between 2700 and 2300 BC in Sumer. Since then, many other forms "
    "of reckoning boards or tables have been invented. In a medieval European counting house, "
    "a checkered cloth would be placed on a table, and markers moved around on it according "
    "to certain rules, as an aid to calculating sums of money. The first")
# (chat?, text). Index 0 ends with EOS well before 32 tokens; the rest run the full 32.
PROMPT_SPECS = [
    (True, "What is the capital of France?"),
    (True, "Write a haiku about the sea."),
    (False, "The quick brown fox"),
    (False, "def fibonacci(n):\n    "),
    (True, SUMMARIZE),
    (False, LONG_RAW),
]


@pytest.fixture
def llm(smollm2_llm):
    """The session's shared LLM; checks each test leaves it idle with every page free."""
    yield smollm2_llm
    engine = smollm2_llm.engine
    assert not engine.has_unfinished_requests() and not engine._groups
    assert engine.num_free_pages == engine.num_pages


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    """Token ids of PROMPT_SPECS, chat-templated or raw, ~4 to ~220 tokens."""
    return [smollm2_llm.apply_chat_template([{"role": "user", "content": text}]) if chat
            else smollm2_llm.get_tokenizer().encode(text) for chat, text in PROMPT_SPECS]


@pytest.fixture(scope="module")
def hf_refs(smollm2_hf, prompts):
    """Per prompt, HF's ``generate(do_sample=False, max_new_tokens=32)``:
    (generated ids, including a final EOS if it stopped early; f32[V] logits of
    the first step, i.e. the prompt's last-position logits)."""
    refs = []
    for ids in prompts:
        with torch.no_grad():
            out = smollm2_hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=N_GREEDY, eos_token_id=EOS, pad_token_id=EOS,
                output_logits=True, return_dict_in_generate=True)
        refs.append((out.sequences[0, len(ids):].tolist(), out.logits[0][0].float().numpy()))
    return refs


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0)


def expected_finish(ref, n):
    return "stop" if ref[-1] == EOS and len(ref) <= n else "length"


def test_prompt_set_covers_lengths_and_endings(prompts, hf_refs):
    lens = [len(p) for p in prompts]
    assert min(lens) <= 6 and max(lens) >= 180, lens
    tokens = [t for t, _ in hf_refs]
    assert len(tokens[0]) < N_GREEDY and tokens[0][-1] == EOS  # stops early at EOS
    assert all(len(t) == N_GREEDY and EOS not in t for t in tokens[1:])  # runs the full 32


def test_last_token_logits_match_hf(llm, prompts, hf_refs):
    ours = llm.engine.last_token_logits(prompts)  # one ragged prefill of all prompts
    assert ours.shape == (len(prompts), llm.engine.model_config.vocab_size)
    assert ours.dtype == np.float32
    for ids, row, (_, ref) in zip(prompts, ours, hf_refs):
        diff = float(np.abs(row - ref).max())
        assert diff <= 1e-3, f"prompt of {len(ids)} tokens: max |diff| {diff}"


@pytest.mark.slow
def test_greedy_matches_hf_alone_and_batched(llm, prompts, hf_refs):
    refs = [t for t, _ in hf_refs]
    batched = llm.generate(prompts, greedy(N_GREEDY))
    alone = [llm.generate(p, greedy(N_GREEDY))[0] for p in prompts]
    for ids, ref, b, a in zip(prompts, refs, batched, alone):
        for out in (b, a):
            comp = out.outputs[0]
            assert comp.token_ids == ref, f"prompt of {len(ids)} tokens"
            assert comp.finish_reason == expected_finish(ref, N_GREEDY)
            assert out.prompt_token_ids == ids


def _drive(engine, rids):
    """Step ``engine`` until idle. Returns (final outputs by id, most requests
    running at once, whether requests ever waited while others ran)."""
    final, most_running, queued = {}, 0, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        most_running = max(most_running, len(engine.scheduler.running))
        queued |= bool(engine.scheduler.waiting) and bool(engine.scheduler.running)
    assert sorted(final) == sorted(rids)
    return [final[r] for r in rids], most_running, queued


@pytest.mark.slow
def test_paging_and_small_kv_budget_exact(llm, smollm2_ckpt, prompts, hf_refs):
    n = 24
    five = prompts[:5]
    want = [t[:n] for t, _ in hf_refs[:5]]
    parts = dict(model_config=smollm2_ckpt.config, params=smollm2_ckpt.params,
                 tokenizer=smollm2_ckpt.tokenizer, chat_template=smollm2_ckpt.chat_template)

    def check(outs):
        for ids, ref, out in zip(five, want, outs):
            assert out.outputs[0].token_ids == ref, f"prompt of {len(ids)} tokens"
            assert out.outputs[0].finish_reason == expected_finish(ref, n)

    check(llm.generate(five, greedy(n)))  # page size 16, ample pages
    for page_size in (8,):  # other page sizes: test_attention_xla (1, 4, 8) and the kernels
        other = LLM(page_size=page_size, num_pages=2048 // page_size,
                    compilation_cache_dir=XLA_CACHE, **parts)
        check(other.generate(five, greedy(n)))
        del other

    # A KV budget that holds only the two longest sequences at once.
    per_seq = sorted(cdiv(len(p) + n, 16) for p in five)
    small = LLM(page_size=16, num_pages=per_seq[-1] + per_seq[-2],
                compilation_cache_dir=XLA_CACHE, **parts)
    engine = small.engine
    rids = [engine.add_request(None, p, greedy(n)) for p in five]
    reqs = [engine.get_sequences(r)[0] for r in rids]
    outs, most_running, queued = _drive(engine, rids)
    check(outs)
    assert queued and most_running < len(five)
    queue_ms = [o.metrics.queue_ms for o in outs]
    assert max(queue_ms) > 50 * max(min(queue_ms), 1.0), queue_ms  # someone really waited
    assert engine.num_free_pages == engine.num_pages
    print(f"small KV budget: {engine.num_pages} pages, at most {most_running} "
          f"running, preemptions per request {[r.num_preemptions for r in reqs]}, "
          f"queue_ms {[round(q) for q in queue_ms]}")


def test_seeded_sampling_same_alone_and_batched(llm, prompts, hf_refs):
    n = 24
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=n)
    target = prompts[1]
    alone = llm.generate(target, seeded)[0].outputs[0].token_ids
    assert llm.generate(target, seeded)[0].outputs[0].token_ids == alone
    others = [SamplingParams(temperature=1.0, seed=1, max_tokens=n),
              SamplingParams(temperature=0.5, seed=12345, max_tokens=n),
              greedy(n)]
    batch = llm.generate([prompts[2], target, prompts[4], prompts[3]],
                         [others[0], seeded, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    assert batch[3].outputs[0].token_ids == hf_refs[3][0][:n]  # greedy row stays greedy
    assert alone != hf_refs[1][0][:n]  # sampling really happened


def test_bad_input_rejected_while_good_requests_run(llm, prompts, tmp_path):
    engine = llm.engine
    good = [prompts[2], prompts[3]]
    want = [o.outputs[0].token_ids for o in llm.generate(good, greedy(16))]
    rids = [engine.add_request(f"good{i}", p, greedy(16)) for i, p in enumerate(good)]
    finals = {o.request_id: o for o in engine.step() if o.finished}  # prefill: both running

    with pytest.raises(ValueError, match="no-such-model"):
        LLM("no-such-model")
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ValueError, match="missing.gguf.*no such file"):
        LLM(str(missing))
    with pytest.raises(ValueError, match="prompt is empty: ''"):
        engine.add_request(None, "", greedy(4))
    with pytest.raises(ValueError, match=r"prompt is empty: \[\]"):
        engine.add_request(None, [], greedy(4))
    too_long = [198] * (engine.max_model_len + 8)
    with pytest.raises(ValueError, match=f"{len(too_long)} tokens"):
        engine.add_request(None, too_long, greedy(4))
    with pytest.raises(ValueError, match="good0"):
        engine.add_request("good0", prompts[2], greedy(4))
    with pytest.raises(ValueError, match="max_tokens.*got 0$"):
        engine.add_request(None, "hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="temperature.*got -1$"):
        engine.add_request(None, "hi", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p.*got 0$"):
        engine.add_request(None, "hi", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match=r"top_p.*got 1\.5$"):
        engine.add_request(None, "hi", SamplingParams(top_p=1.5))
    assert sorted(engine._groups) == ["good0", "good1"]  # nothing half-queued

    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finals[r].outputs[0].token_ids for r in rids] == want
    assert all(finals[r].outputs[0].finish_reason == "length" for r in rids)


def _cli(cache_dir, *args):
    env = dict(os.environ, JAXSERVE_CACHE=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "jaxserve.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def cache_dir(smollm2_path):
    """The jaxserve cache holding the fetched model (``<cache>/<alias>/<file>``)."""
    return smollm2_path.parent.parent


def test_cli_chat_greedy_says_paris(cache_dir):
    r = _cli(cache_dir, "--chat", "--prompt", "What is the capital of France?",
             "--temperature", "0", "--max_tokens", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout


@pytest.mark.parametrize("flags,named", [
    (("--temperature", "-1"), "-1"),
    (("--max_tokens", "0"), "got 0"),
    (("--top_p", "0"), "0.0"),
    (("--top_p", "1.5"), "1.5"),
    (("--model", "no-such-model"), "no-such-model"),
    (("--model", "/tmp/jaxserve-missing.gguf"), "jaxserve-missing.gguf"),
])
def test_cli_bad_flags_exit_2(cache_dir, flags, named):
    """Each bad flag fails before the model loads, naming the value, with status 2."""
    r = _cli(cache_dir, *flags, "--prompt", "hi")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error:" in r.stderr and named in r.stderr.split("error:")[-1]


def test_cli_empty_prompt_exit_2(cache_dir):
    r = _cli(cache_dir, "--prompt", "")
    assert r.returncode == 2 and "prompt is empty" in r.stderr


def test_cli_demo_batch_prints_table(cache_dir):
    """The default text path: tagged streaming, one table row per request, totals."""
    r = _cli(cache_dir, "--max_tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[:3] == ["req", "prompt", "output"])
    rows = [l.split() for l in lines[header + 1:header + 9]]
    assert [row[0] for row in rows] == [str(i) for i in range(8)]
    assert all(1 <= int(row[2]) <= 8 for row in rows)
    assert any(l.startswith("[0] ") and "Paris" in l for l in lines)
    assert lines[header + 9].startswith("total: 8 requests") and "output tokens/s" in lines[-1]


def test_cli_json_demo_batch(cache_dir):
    r = _cli(cache_dir, "--json", "--max_tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert len(rows) == 8
    for row in rows:
        assert {"prompt_tokens", "output_tokens", "ttft_ms", "tpot_ms"} <= row.keys()
        assert row["prompt_tokens"] > 0 and 1 <= row["output_tokens"] <= 8
        assert row["ttft_ms"] > 0
