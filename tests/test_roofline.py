"""Roofline counts (``jaxserve.bench.roofline``) against a hand count for a tiny
config, and the per-phase figures built from them.

Tiny config: D 8, N 2 query heads, K 1 kv head, H 4, F 16, V 100, 2 layers.
Per layer and token the projections have q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192
weights and the SwiGLU 3 * 8 * 16 = 384, so 2 * (192 + 384) = 1152 FLOPs;
attention costs 4 * N * H = 32 FLOPs per visible (query, key) pair; the LM
head 2 * 8 * 100 = 1600 FLOPs per sequence.
"""

import pytest

from jaxserve.bench import roofline
from jaxserve.bench.roofline import Ceilings, StepRecord
from jaxserve.config import ModelConfig

CFG = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=True)


def test_attention_pairs_causal_and_windowed():
    assert roofline.attention_pairs(1, 5) == 5          # one query sees 5 keys
    assert roofline.attention_pairs(4, 4) == 1 + 2 + 3 + 4
    assert roofline.attention_pairs(3, 7) == 5 + 6 + 7  # chunk on top of 4 cached
    assert roofline.attention_pairs(3, 7, window=5) == 5 + 5 + 5
    assert roofline.attention_pairs(3, 4, window=3) == 2 + 3 + 3


def test_flops_by_hand():
    # Decode, two sequences with 5 and 3 tokens in the cache after the step:
    # per layer 2 tokens * 1152 + 32 * (5 + 3) pairs = 2560; 2 layers; 2 LM-head rows.
    assert roofline.step_flops(CFG, [1, 1], [5, 3]) == 2 * 2560 + 2 * 1600
    # Prefill of 4 tokens: 4 * 1152 + 32 * 10 pairs per layer, one LM-head row.
    assert roofline.step_flops(CFG, [4], [4]) == 2 * (4 * 1152 + 320) + 1600
    # A sliding window of 5 on a 3-token chunk over 4 cached: 15 pairs.
    windowed = ModelConfig(**{**CFG.__dict__, "sliding_window": 5})
    assert roofline.step_flops(windowed, [3], [7]) == 2 * (3 * 1152 + 32 * 15) + 1600


def test_bytes_by_hand():
    # Weights per layer: 192 projections + 2 norms * 8 + 384 SwiGLU = 592; two
    # layers, the final norm (8), the LM head (800) and the 2 embedding rows
    # looked up (16): 2008 params at 4 bytes. KV per position: K and V, 2
    # layers, 1 head of 4 at 2 bytes = 32 bytes; read 5 + 3 positions, write 2.
    b = roofline.step_bytes(CFG, [1, 1], [5, 3], param_bytes=4, kv_bytes=2)
    assert b == {"weights": 2008 * 4, "kv_read": 8 * 32, "kv_written": 2 * 32,
                 "total": 2008 * 4 + 10 * 32}


def test_moe_counts_by_hand():
    moe = ModelConfig(**{**CFG.__dict__, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 8, "mlp_only_layers": (1,)})
    # Layer 0: router 2 * 8 * 4 = 64 and 2 experts * 2 * 3 * 8 * 8 = 768 FLOPs per
    # token instead of the SwiGLU's 768; layer 1 stays dense.
    dense = roofline.step_flops(CFG, [1], [1])
    assert roofline.step_flops(moe, [1], [1]) == dense - 768 + 64 + 768
    # One token touches E * (1 - (1 - k/E)^1) = 2 experts of 3 * 8 * 8 weights,
    # plus the 8 * 4 router, in place of layer 0's 384 SwiGLU weights.
    w_dense = roofline.step_bytes(CFG, [1], [1], 1, 1)["weights"]
    assert roofline.step_bytes(moe, [1], [1], 1, 1)["weights"] == w_dense - 384 + 32 + 384


def test_analyze_phases_mfu_mbu_and_bound():
    ceil = Ceilings(flops_per_s=1e6, bytes_per_s=1e5, source="given")
    steps = [StepRecord(0.0, 0.01, [1, 1], [5, 3], num_decode=2),
             StepRecord(0.01, 0.01, [1, 1], [5, 3], num_decode=2),
             StepRecord(0.02, 5.0, [1, 1], [6, 4], num_decode=2, compiled=True),  # left out
             StepRecord(0.03, 0.02, [4], [4], num_decode=0),
             StepRecord(0.05, 0.02, [1, 4], [6, 4], num_decode=1)]
    r = roofline.analyze(steps, CFG, ceil, param_bytes=4, kv_bytes=2)
    d = r["decode"]
    assert d["steps"] == 2 and d["tokens_per_step"] == 2 and d["ms_per_step"] == pytest.approx(10)
    assert d["flops_per_s"] == pytest.approx(8320 / 0.01)
    assert d["bytes_per_s"] == pytest.approx(8352 / 0.01)
    assert d["mfu"] == pytest.approx(0.832) and d["mbu"] == pytest.approx(8.352)
    assert d["bound"] == "bandwidth" and d["intensity"] == pytest.approx(8320 / 8352)
    assert "MBU above 100%" in d["warning"]  # 835% of the ceiling: it must be too low
    p = r["prefill"]
    assert p["steps"] == 1 and p["flops_per_step"] == 2 * (4 * 1152 + 320) + 1600
    assert r["mixed"]["steps"] == 1 and r["mixed"]["tokens_per_step"] == 5
    assert {(x["phase"], x["group"]) for x in r["points"]} == {
        ("decode", 2), ("prefill", 4), ("mixed", 8)}
    point = next(x for x in r["points"] if x["phase"] == "decode")  # the two 10 ms steps
    assert point["steps"] == 2 and point["mfu"] == pytest.approx(0.832)
    assert point["mbu"] == pytest.approx(8.352) and point["bound"] == "bandwidth"
    assert r["ceilings"]["ridge_flop_per_byte"] == pytest.approx(10.0)


def test_analyze_calls_a_compute_heavy_phase_compute_bound():
    ceil = Ceilings(flops_per_s=1e4, bytes_per_s=1e9, source="given")
    r = roofline.analyze([StepRecord(0.0, 1.0, [4], [4], 0)], CFG, ceil, param_bytes=4,
                         kv_bytes=2)
    assert r["prefill"]["bound"] == "compute"
    assert "warning" not in roofline.analyze(  # 1.1 MFLOP/s of 1e7: under both roofs
        [StepRecord(0.0, 1.0, [4], [4], 0)], CFG, Ceilings(1e7, 1e9, "given"), param_bytes=4,
        kv_bytes=2)["prefill"]


def test_measure_ceilings_small():
    c = roofline.measure_ceilings("float32", matmul_n=64, copy_mib=1, iters=1)
    assert c.flops_per_s > 0 and c.bytes_per_s > 0 and "64x64" in c.source
