"""GGUF blocks kept as they are (``gguf_loader.load_gguf(..., keep_blocks=True)``).

Layers: ``blocks_to_quantized`` of Q8_0 / Q4_0 / Q4_1 tensors quantized by
``gguf.quants.quantize`` dequantizes bit for bit to ``gguf.quants.dequantize``
(several blocks per row, several rows, a 3-D tensor, a q/k-permuted one
un-permuted); the same on real tensors of SmolLM2's Q4_1 GGUF (skipped when
absent); a tiny random GGUF of each type loads with ``keep_blocks`` to exactly
the ``keep_blocks=False`` params; ``tensor_types`` reads the types from the
header alone.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from tiny_gguf import permute_qk, write_tiny_gguf

from checkpoints import gguf_loader
from checkpoints.gguf_loader import blocks_to_quantized, load_gguf, tensor_types, unpermute_qk
from jaxserve.config import ModelConfig
from jaxserve.models import quant

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1]
SMOLLM2 = os.path.expanduser("~/.cache/jaxserve/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")


def _ggml(w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks, ``gguf.quants.dequantize`` of them) of a float tensor."""
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(6, 128), (3, 5, 96), (1, 32)])
def test_blocks_dequantize_bit_equal(qtype, shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[0, ..., :32] = 0.0  # an all-zero block: d = 0
    raw, want = _ggml(w, qtype)
    qt = blocks_to_quantized(raw, qtype, shape)
    assert qt.fmt == (quant.Q8_0 if qtype == T.Q8_0 else quant.Q4)
    assert qt.q.dtype == (np.int8 if qtype == T.Q8_0 else np.uint8)
    assert qt.q.shape == (shape if qtype == T.Q8_0 else (*shape[:-1], shape[-1] // 2))
    assert qt.scale.shape == (*shape[:-1], shape[-1] // 32) and qt.scale.dtype == np.float16
    assert (qt.zero is None) == (qtype == T.Q8_0)
    assert np.array_equal(qt.dequantize(), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_permuted_rows_unpermute_alike(qtype):
    n_head, H, D = 3, 8, 64
    w = np.random.default_rng(1).standard_normal((n_head * H, D)).astype(np.float32)
    raw, stored = _ggml(permute_qk(w, n_head), qtype)
    qt = blocks_to_quantized(raw, qtype, w.shape)
    back = quant.QuantizedTensor(qt.fmt, qt.shape, *(
        None if a is None else unpermute_qk(a, n_head) for a in (qt.q, qt.scale, qt.zero)))
    assert np.array_equal(back.dequantize(), unpermute_qk(stored, n_head))


def test_other_types_and_short_data_are_refused():
    with pytest.raises(ValueError, match="not F16"):
        blocks_to_quantized(np.zeros(64, np.uint8), T.F16, (1, 32))
    with pytest.raises(ValueError, match="do not fill"):
        blocks_to_quantized(np.zeros(33, np.uint8), T.Q8_0, (1, 32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiny_gguf_keep_blocks_equals_dequantized(qtype, tmp_path):
    cfg = ModelConfig(vocab_size=320, tie_word_embeddings=False)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_tiny_gguf(path, cfg, qtype=qtype)
    dense = load_gguf(path, show_progress=False).params
    kept = load_gguf(path, show_progress=False, keep_blocks=True).params
    assert sorted(kept) == sorted(dense) == sorted(expected)
    types = tensor_types(path)
    n_quantized = 0
    for name, value in kept.items():
        if types[name] == qtype:
            assert isinstance(value, quant.QuantizedTensor), name
            got = value.dequantize()
            n_quantized += 1
        else:
            assert types[name] == T.F32 and isinstance(value, np.ndarray), name
            got = value
        assert np.array_equal(got, dense[name]), name
        assert np.array_equal(got, expected[name]), name
    assert n_quantized == 2 + 7 * cfg.num_layers  # embed, lm_head, q/k/v/o/gate/up/down


def test_tensor_types_reads_no_tensor(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, ModelConfig(vocab_size=320), qtype=T.Q4_1)
    monkeypatch.setattr(gguf, "GGUFReader", None)  # the header walk alone
    types = tensor_types(path)
    assert types["model.layers.1.mlp.down_proj.weight"] == T.Q4_1
    assert types["model.norm.weight"] == T.F32
    assert set(types.values()) - set(gguf_loader.KEPT_TYPES) == {T.F32}


@pytest.mark.skipif(not os.path.exists(SMOLLM2), reason="SmolLM2 Q4_1 GGUF not cached")
def test_smollm2_tensors_bit_equal():
    reader = gguf.GGUFReader(SMOLLM2)
    by_name = {t.name: t for t in reader.tensors}
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
             "blk.3.ffn_down.weight", "blk.29.ffn_gate.weight"]
    for name in names:
        t = by_name[name]
        assert t.tensor_type in (T.Q8_0, T.Q4_1), (name, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        qt = blocks_to_quantized(t.data, t.tensor_type, shape)
        assert np.array_equal(qt.dequantize(), gguf.quants.dequantize(t.data, t.tensor_type)), name
    assert by_name["token_embd.weight"].tensor_type == T.Q8_0
    types = tensor_types(SMOLLM2)
    assert types["model.layers.0.self_attn.q_proj.weight"] == T.Q4_1
