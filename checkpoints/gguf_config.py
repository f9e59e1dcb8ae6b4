"""A GGUF file's metadata as a ``ModelConfig``.

``read_fields`` flattens a ``gguf.GGUFReader``'s key/value fields;
``model_config_from_gguf`` maps them (``{arch}.context_length``,
``{arch}.rope.*``, the tokenizer's token list, Gemma 3's sliding-window
pattern, ...) to the ``ModelConfig`` fields for the architectures in
``SUPPORTED_ARCHITECTURES``. ``checkpoints.gguf_loader`` reads the tensors.

Every problem raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any, Mapping

import gguf
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
# llama.cpp writes no local RoPE base or layer pattern for Gemma 3: it uses
# these (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``), as do HF's defaults.
_GEMMA3_ROPE_LOCAL_THETA = 10000.0
_GEMMA3_SLIDING_PATTERN = 6


def read_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All metadata of an open file as Python values (str, int, float, bool, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def architecture(fields: Mapping[str, Any]) -> str:
    """``general.architecture``, checked to be one of ``SUPPORTED_ARCHITECTURES``.

    Raises:
      ValueError: another (or no) architecture; the message lists the supported ones.
    """
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r:.80}; supported: "
                         f"{list(SUPPORTED_ARCHITECTURES)}")
    return arch


def model_config_from_gguf(fields: Mapping[str, Any],
                           tensor_names: frozenset[str] | set[str] | None = None,
                           rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from GGUF metadata.

    Args:
      fields: GGUF key -> value, as ``read_fields`` returns.
      tensor_names: names of the file's tensors; ``tie_word_embeddings`` is True
        when ``output.weight`` is not among them. None means tied.
      rope_freqs: the ``rope_freqs.weight`` tensor's values f32[H/2] (Llama
        3.1+: llama.cpp's per-frequency RoPE divisors), or None.

    Returns:
      The config. ``eos_token_ids`` is ``tokenizer.ggml.eos_token_id`` followed by
      ``eot_token_id`` / ``eom_token_id`` when present and different (and,
      for Gemma 3, ``<end_of_turn>``, as its HF ``generation_config.json``
      and llama.cpp's end-of-generation tokens have it). RoPE scaling:
      ``rope_freqs``, or ``{arch}.rope.scaling.type`` ``linear`` with its
      ``factor``. Gemma 3: layer pattern, local RoPE base and score scale as
      llama.cpp sets them (``_gemma3_fields``).

    Raises:
      ValueError: the architecture is not supported (message lists the supported
        ones), a required key is missing or has the wrong type, a special token
        id lies outside the vocabulary, a RoPE scaling other than linear, or
        the values make no valid ``ModelConfig`` (message names the key or field).
    """
    arch = architecture(fields)

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        """``fields[key]`` (or ``default``), checked to be an int (``kind=int``) or a number."""
        if key not in fields:
            if default is None:
                raise ValueError(f"GGUF metadata lacks required key {key!r}")
            return default
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
            raise ValueError(f"GGUF metadata {key!r} must be "
                             f"{'an integer' if kind is int else 'a number'}, got {value!r:.80}")
        return value

    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ValueError("GGUF metadata lacks the token list tokenizer.ggml.tokens")
    hidden = get(f"{arch}.embedding_length")
    heads = get(f"{arch}.attention.head_count")
    kv_heads = get(f"{arch}.attention.head_count_kv", heads)
    head_dim = get(f"{arch}.attention.key_length", hidden // heads if heads > 0 else 0)
    if head_dim % 2:
        raise ValueError(f"head dim {head_dim} ({arch}.attention.key_length) is odd; "
                         "RoPE needs an even one")
    special: dict[str, int] = {}
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = get(f"tokenizer.ggml.{key}", -1)
        if token_id != -1 and not 0 <= token_id < len(tokens):
            raise ValueError(f"GGUF metadata tokenizer.ggml.{key} = {token_id} is outside "
                             f"the vocabulary of {len(tokens)} tokens")
        if token_id != -1:
            special[key] = token_id
    eos_ids = list(dict.fromkeys(special[k] for k in ("eos_token_id", "eot_token_id",
                                                      "eom_token_id") if k in special))
    family: dict[str, Any] = {}
    if arch == "gemma3":
        family = _gemma3_fields(fields, get, tokens, eos_ids)
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        family["rope_scaling"] = RopeScaling(
            "linear", float(get(f"{arch}.rope.scaling.factor", kind=float)))
    elif scaling != "none":
        raise ValueError(f"GGUF metadata {arch}.rope.scaling.type = {scaling!r:.40} is not "
                         "supported (none, linear; llama3 comes as the rope_freqs tensor)")
    if rope_freqs is not None:
        family["rope_freq_factors"] = tuple(float(f) for f in np.ravel(rope_freqs))
    return ModelConfig(
        architecture=arch,
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=get(f"{arch}.feed_forward_length"),
        num_layers=get(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0, float)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", kind=float)),
        max_position_embeddings=get(f"{arch}.context_length"),
        tie_word_embeddings=tensor_names is None or "output.weight" not in tensor_names,
        bos_token_id=special.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        **family,
    )


def _gemma3_fields(fields: Mapping[str, Any], get, tokens: list[str],
                   eos_ids: list[int]) -> dict[str, Any]:
    """The ``ModelConfig`` fields a Gemma 3 GGUF implies beyond llama's (as
    llama.cpp's ``LLM_ARCH_GEMMA3`` and transformers' GGUF loader read it):
    ``attention.sliding_window`` W; every sixth layer global (or
    ``attention.sliding_window_pattern``, a period or one bool per layer,
    True = sliding, where a file has it); the local RoPE base
    ``rope.freq_base_swa`` (default 10,000); scores scaled by ``key_length
    ** -0.5`` (``hidden / heads`` for the 62-layer 27B, as llama.cpp does);
    q/k norms, GeGLU, soft caps where the file sets them. Appends
    ``<end_of_turn>`` to ``eos_ids`` (in place) when the vocabulary has it.
    """
    n = get("gemma3.block_count")
    pattern = fields.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n or not all(isinstance(b, bool) for b in pattern):
            raise ValueError(f"GGUF metadata gemma3.attention.sliding_window_pattern must be "
                             f"one bool per layer ({n}), got {pattern!r:.80}")
        sliding = pattern
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        sliding = [bool((i + 1) % pattern) for i in range(n)]
    else:
        raise ValueError(f"GGUF metadata gemma3.attention.sliding_window_pattern must be a "
                         f"positive period or a list of bools, got {pattern!r:.80}")
    heads, hidden = get("gemma3.attention.head_count"), get("gemma3.embedding_length")
    head_dim = get("gemma3.attention.key_length", hidden // heads if heads > 0 else 0)
    caps = {name: float(get(f"gemma3.{name}", kind=float)) for name in (
        "attn_logit_softcapping", "final_logit_softcapping") if f"gemma3.{name}" in fields}
    if "<end_of_turn>" in tokens:
        eos_ids.append(tokens.index("<end_of_turn>"))
        eos_ids[:] = list(dict.fromkeys(eos_ids))
    return dict(
        sliding_window=get("gemma3.attention.sliding_window"),
        layer_types=tuple("sliding_attention" if b else "full_attention" for b in sliding),
        rope_local_theta=float(get("gemma3.rope.freq_base_swa", _GEMMA3_ROPE_LOCAL_THETA, float)),
        query_pre_attn_scalar=float(hidden // heads if n == 62 else head_dim),
        qk_norm=True, hidden_act="gelu_pytorch_tanh", **caps)
