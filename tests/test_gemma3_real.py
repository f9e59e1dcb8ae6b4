"""Gemma 3 270M, the real Q4_K_M GGUF (alias ``gemma3-270m``), against HF
transformers loading the same file (``gguf_file=``, f32), computed live.

* Last-position logits within 1e-3 for five prompts, one of them (the
  essay, 619 tokens) longer than the 512-token sliding window, so both the
  local and the global layers shape them.
* 32 greedy tokens equal to HF's ``generate``, one request at a time and all
  five batched (decode rows and a long prefill in one step).
* The CLI's ``--chat`` answers the capital of France (the pretrained model
  has no chat template: a plain transcript, stopped at the next user line).
* Tensor parallel tp=2 and tp=4 (8 fake CPU devices) and the Pallas kernel
  in interpret mode give the one-device XLA tokens.

Loading HF's model takes ~70 s (it dequantizes with gguf-py), ours ~12 s.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import XLA_CACHE
from jaxserve import LLM, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

ESSAY = (
    'The river that runs through the old town has changed its course three times in recorded hi'
    'story. The first change came after a winter of heavy snow, when the spring melt carried so'
    ' much gravel down from the hills that the main channel filled and the water found a new pa'
    "th through the meadows to the east. The farmers who had fields there lost a season's crops"
    ', but within a decade the soil that the flood had left behind made those same fields the r'
    'ichest in the valley. The second change was the work of engineers. In the eighteenth centu'
    'ry the town council hired a surveyor from the capital to straighten the river, so that bar'
    'ges could reach the mills without being grounded on the sandbanks at every bend. He drew u'
    'p plans for a canal with four locks, a towpath on the northern bank and a stone basin wher'
    'e the boats could turn. The work took eleven years and cost more than twice what had been '
    'promised, and the surveyor left before it was finished, but the canal carried grain, timbe'
    'r and wool for almost a century. The third change was the slowest. As the railway arrived '
    'and the barges disappeared, nobody maintained the locks, and the river began to take back '
    'its old bends one flood at a time. Willows grew along the towpath, the stone basin silted '
    'up and became a pond, and children learned to swim where the boatmen had once unloaded sac'
    'ks of flour.\nToday the town is proud of all three rivers. The museum in the former customs'
    ' house has a room for each of them. In the first room there are maps drawn on parchment, s'
    'howing the old channel as a thick blue line that winds between villages whose names have s'
    "ince been forgotten. In the second room there are the surveyor's own drawings, with carefu"
    'l notes in the margins about the depth of the water, the hardness of the rock and the wage'
    's of the labourers, and a model of the third lock that visitors can open and close by turn'
    'ing a small brass wheel. In the last room there are photographs: a barge frozen into the i'
    'ce during the hard winter of 1891, a crowd on the bridge watching the last boat leave, and'
    ' a row of schoolchildren standing in the shallow water where the basin used to be, holding'
    ' up the fish they had caught with their hands.\nThe people who live along the river today a'
    'rgue about what should happen next. Some want the locks restored so that pleasure boats ca'
    'n come up from the coast and bring visitors with money to spend in the cafes and shops of '
    'the old town. Others say the river has earned its freedom and should be left alone, pointi'
    'ng to the otters and kingfishers that have returned to the quiet bends in the last twenty '
    'years. A third group, mostly farmers, worry only about the floods, which have become more '
    'frequent, and ask for higher banks and wider meadows where the water can spread without re'
    'aching the houses. The council has promised to decide by the end of the year, after a publ'
    'ic meeting in the town hall. Whatever they choose, the river will probably have the last w'
    'ord, as it always has.')
SHORT = ["The capital of France is", "def fibonacci(n):",
         "Once upon a time, in a land far away,", "1, 2, 3, 4, 5,"]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_path.parent), gguf_file=gemma3_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma3_parts(gemma3_path):
    """jaxserve's own load of the GGUF (read once for every engine here)."""
    from checkpoints.gguf_loader import load_gguf
    ckpt = load_gguf(gemma3_path, show_progress=False)
    return dict(model_config=ckpt.config, params=ckpt.params, tokenizer=ckpt.tokenizer)


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_parts):
    return LLM(num_pages=256, compilation_cache_dir=XLA_CACHE, **gemma3_parts)


@pytest.fixture(scope="module")
def prompt_ids(gemma3_llm, gemma3_hf_tokenizer):
    ids = [gemma3_llm.engine.encode(p) for p in SHORT + [ESSAY]]
    assert ids == [gemma3_hf_tokenizer(p).input_ids for p in SHORT + [ESSAY]]
    assert len(ids[-1]) > gemma3_llm.engine.model_config.sliding_window == 512
    return ids


@pytest.fixture(scope="module")
def hf_greedy(gemma3_hf, prompt_ids):
    """HF's 32 greedy tokens per prompt, EOS allowed and not stopping (as
    ``ignore_eos``; ``min_new_tokens`` would ban EOS instead: the essay's
    first token is ``<eos>``)."""
    import torch
    gemma3_hf.generation_config.eos_token_id = None  # as the bench's HF peer does
    with torch.no_grad():
        out = [gemma3_hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                                  pad_token_id=0)[0, len(p):].tolist() for p in prompt_ids]
    assert all(len(o) == 32 for o in out)
    return out


def test_config_from_gguf(gemma3_llm):
    cfg = gemma3_llm.engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.num_kv_heads) == (
        "gemma3", 18, 256, 1)
    assert cfg.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.sliding_window) == (1e6, 1e4, 512)
    assert cfg.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>


def test_logits_match_hf(gemma3_llm, gemma3_hf, prompt_ids):
    import torch
    ours = gemma3_llm.engine.last_token_logits(prompt_ids)
    with torch.no_grad():
        refs = [gemma3_hf(torch.tensor([p])).logits[0, -1].numpy() for p in prompt_ids]
    diffs = [float(np.abs(o - r).max()) for o, r in zip(ours, refs)]
    print("max |logit diff| per prompt:", ", ".join(f"{d:.2e}" for d in diffs))
    for row, ref in zip(ours, refs):
        np.testing.assert_allclose(row, ref, atol=1e-3, rtol=0)
        assert np.argmax(row) == np.argmax(ref)


def test_greedy_matches_hf_alone_and_batched(gemma3_llm, prompt_ids, hf_greedy):
    assert len({tuple(g) for g in hf_greedy}) == len(hf_greedy)
    alone = [gemma3_llm.generate([p], greedy(32))[0].outputs[0].token_ids for p in prompt_ids]
    assert alone == hf_greedy
    batched = [o.outputs[0].token_ids for o in gemma3_llm.generate(prompt_ids, greedy(32))]
    assert batched == hf_greedy
    assert gemma3_llm.engine.stats().num_running == 0


def test_chat_cli_answers():
    cmd = [sys.executable, "-m", "jaxserve.main", "--model", "gemma3-270m", "--chat",
           "--prompt", "What is the capital of France?", "--temperature", "0"]
    env = dict(os.environ, JAXSERVE_CACHE=os.environ.get(
        "JAXSERVE_CACHE", os.path.expanduser("~/.cache/jaxserve")))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = proc.stdout.split("\n\n req")[0]
    print(answer)
    assert "Paris" in answer
    assert "User:" not in answer  # the transcript's turn ended at the stop string
    assert " stop" in proc.stdout.split("\n\n req")[1]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_same_tokens(gemma3_llm, gemma3_parts, prompt_ids, tp):
    prompts = [prompt_ids[0], prompt_ids[2], prompt_ids[4]]
    want = [o.outputs[0].token_ids for o in gemma3_llm.generate(prompts, greedy(12))]
    import jax
    llm = LLM(mesh=f"tp={tp}", devices=jax.devices()[:tp], num_pages=128,
              compilation_cache_dir=XLA_CACHE, **gemma3_parts)
    assert len(llm.engine.mesh.devices.flat) == tp
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12))]
    assert got == want


def test_pallas_interpret_same_tokens(gemma3_llm, gemma3_parts, prompt_ids):
    prompts = prompt_ids[:3]
    want = [o.outputs[0].token_ids for o in gemma3_llm.generate(prompts, greedy(6))]
    llm = LLM(attention_impl="pallas", attention_interpret=True, num_pages=64,
              compilation_cache_dir=XLA_CACHE, **gemma3_parts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6))]
    assert got == want
