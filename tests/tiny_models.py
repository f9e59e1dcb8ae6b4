"""Tiny random models for tests, built without torch and without files.

The fast tier (``pytest -m "not slow and not real_model"``) must not import
torch or transformers, so the weights every tiny engine runs on are drawn
here with numpy, in HF's names and layout; transformers sees the very same
arrays only in the HF-reference tests (``hf_llama``; those are marked slow).

- ``TINY``: the tiny Llama's shape: vocab 256, D 64, F 160, 3 layers, N 4 query
  heads, K 2 kv heads, H 16, 512 positions, untied LM head, EOS id 1.
- ``tiny_llama_params(cfg, seed)``: HF name -> f32 array, drawn the way
  transformers initialises ``LlamaForCausalLM`` with ``initializer_range=0.15``
  (every matrix N(0, 0.15^2), every norm 1): large enough that greedy tokens
  vary from step to step. The logits are a deterministic function of the
  token ids (JetStream's ``mock_engine`` idea, through the real model code).
- ``mock_tokenizer(vocab_size)``: the tiny GGUF's tokenizer (``tiny_gguf``:
  ChatML specials at 0-2, the 256 byte tokens, a few merges) built straight
  from its metadata, no file: deterministic text <-> ids for engine, engine
  loop and server tests that need text.
- ``hf_llama(cfg, params)`` / ``hf_greedy(hf, ids, n)``: transformers' model
  holding exactly ``params``, and its greedy continuation (import torch).
- ``write_tiny_qwen3(folder, chat_template)``: a tiny random Qwen3 saved as an
  HF folder (``config.json`` ``Qwen3ForCausalLM``, ``model.safetensors``, the
  tiny GGUF's tokenizer as ``tokenizer.json``, the template in
  ``tokenizer_config.json``): q/k norms and head_dim 32 != D/N, the files a
  server loads with ``--model folder`` (the GGUF loader reads no qwen3 file).
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from checkpoints.tokenizer import Tokenizer
from jaxserve.config import ModelConfig

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=512)
INIT_STD = 0.15  # transformers' initializer_range of the tiny model
# The tiny model is chaotic (near-tied logits), and a few tests need a draw
# with particular behaviour, as the torch draw before it had: greedy's first
# token comes back after a 4-token ban for one prompt and never for another
# (test_engine_tiny's min_tokens), fp8 KV keeps the first greedy tokens
# (test_kv_quant). This seed has them all.
TINY_SEED = 29


def tiny_config(**overrides) -> ModelConfig:
    """The tiny Llama's ``ModelConfig`` (``TINY``, untied, EOS 1), with ``overrides``."""
    return ModelConfig(**{**TINY, "tie_word_embeddings": False, "eos_token_ids": (1,),
                          **overrides})


def llama_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of a dense Llama's weights (torch ``Linear``: [out, in])."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        shapes |= {pre + "input_layernorm.weight": (D,),
                   pre + "self_attn.q_proj.weight": (NH, D),
                   pre + "self_attn.k_proj.weight": (KH, D),
                   pre + "self_attn.v_proj.weight": (KH, D),
                   pre + "self_attn.o_proj.weight": (D, NH),
                   pre + "post_attention_layernorm.weight": (D,),
                   pre + "mlp.gate_proj.weight": (F, D),
                   pre + "mlp.up_proj.weight": (F, D),
                   pre + "mlp.down_proj.weight": (D, F)}
    shapes["model.norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def tiny_llama_params(cfg: ModelConfig, seed: int = 0,
                      std: float = INIT_STD) -> dict[str, np.ndarray]:
    """HF-named f32 weights of ``cfg``: matrices N(0, std^2), norms 1 (transformers' init)."""
    rng = np.random.default_rng(seed)
    return {name: (np.ones(shape, np.float32) if name.endswith("norm.weight")
                   else (std * rng.standard_normal(shape)).astype(np.float32))
            for name, shape in llama_param_shapes(cfg).items()}


def mock_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """The tiny GGUF's byte-level BPE tokenizer and ChatML template, from its fields."""
    from tiny_gguf import tokenizer_fields
    return Tokenizer.from_gguf_fields(tokenizer_fields(vocab_size))


# The tiny Qwen3's config.json: vocab 320 (the tiny GGUF's tokenizer), D 64,
# F 128, 2 layers, N 4, K 2, H 32 (not D/N = 16: Qwen3 sets head_dim itself),
# 4096 positions (a tools prompt in the byte-level tokenizer is ~800 tokens),
# tied head, BOS <|im_start|> (1), EOS <|im_end|> (2).
QWEN3_TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=320,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  hidden_act="silu", attention_bias=False, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def write_tiny_qwen3(folder: str | os.PathLike, chat_template: str | None = None,
                     seed: int = 0, **config) -> dict[str, np.ndarray]:
    """Write a tiny random Qwen3 HF folder and return its params.

    Files: ``config.json`` (``QWEN3_TINY`` with ``config`` overrides),
    ``model.safetensors`` (f32; matrices N(0, 0.1^2), every norm, q/k norms
    included, 1 + N(0, 0.1^2) so that they count), ``tokenizer.json`` (the
    tiny GGUF's byte-level BPE, ``mock_tokenizer``) and
    ``tokenizer_config.json`` (bos/eos/pad/unk tokens and ``chat_template``,
    ChatML by default).

    Returns:
      HF name -> float32 array, exactly what ``load_hf(folder).params`` holds.

    Raises:
      ValueError: ``config`` that ``model_config_from_hf`` rejects.
    """
    from safetensors.numpy import save_file

    from checkpoints.hf_config import expected_tensors, model_config_from_hf
    from tiny_gguf import CHATML_TEMPLATE, SPECIAL_TOKENS
    hf = {**QWEN3_TINY, **config}
    cfg = model_config_from_hf(hf)
    rng = np.random.default_rng(seed)
    params = {name: ((name.endswith("norm.weight") + 0.1 * rng.standard_normal(shape))
                     .astype(np.float32))
              for name, shape in expected_tensors(cfg).items()}
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    save_file(params, str(folder / "model.safetensors"), metadata={"format": "pt"})
    mock_tokenizer(cfg.vocab_size).backend.save(str(folder / "tokenizer.json"))
    endoftext, im_start, im_end = SPECIAL_TOKENS
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token=im_start, eos_token=im_end, pad_token=im_end, unk_token=endoftext,
        chat_template=chat_template or CHATML_TEMPLATE), indent=1))
    return params


def hf_llama(cfg: ModelConfig, params: dict[str, np.ndarray]):
    """transformers' f32 ``LlamaForCausalLM`` (eval) holding exactly ``params``."""
    import torch
    import transformers
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=INIT_STD,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(hf_cfg).eval().to(torch.float32)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Only a tied head may be absent from params (HF ties it to the embedding).
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def hf_greedy(hf, ids, n, **kw):
    """HF greedy continuation of ``ids``: exactly ``n`` tokens, or fewer if ``kw`` sets an EOS."""
    import torch
    kw.setdefault("min_new_tokens", n)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
    return out[0, len(ids):].tolist()
