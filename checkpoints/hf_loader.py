"""Read a Hugging Face model folder: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

``load_hf(path)`` returns an ``HFCheckpoint`` with the same fields as
``GGUFCheckpoint``: the ``ModelConfig`` (``model_config_from_hf``), every tensor
under its HF name converted to ``dtype`` (the names and ``[out, in]`` layouts of
``checkpoints.gguf_loader``'s docstring, plus q/k/v/o biases and Qwen3's
``self_attn.{q,k}_norm.weight`` [H], and for Mixtral / Qwen3-MoE each expert's
tensors as saved, ``MOE_TENSOR_NAMES``), the tokenizer and chat template, and
the raw ``config.json``. transformers 5 keeps experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2F, D]) but saves them per expert; a file
holding the fused form is rejected as missing the per-expert tensors.

Architectures: ``HF_ARCHITECTURES`` maps the ``config.json`` ``architectures[0]``
name to a function that returns the family's ``ModelConfig`` fields; add an
entry (and its tensors in ``expected_tensors``) for a new family.

Safetensors files are parsed here (8-byte little-endian header length, JSON
header, raw little-endian data; https://github.com/huggingface/safetensors)
rather than with ``safetensors.safe_open(framework="numpy")``, which cannot
return bf16 tensors; ``ml_dtypes`` gives numpy bf16 and fp8. Sharded
checkpoints are read through ``model.safetensors.index.json``'s ``weight_map``.

Every problem with the folder raises ``ValueError`` naming the file (and the
tensor or field): a missing or corrupt ``config.json``, a truncated or corrupt
safetensors file, a missing, unexpected or misshapen tensor, an unsupported
architecture or option.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import pathlib
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np
import tokenizers
from tqdm.auto import tqdm

from checkpoints.tokenizer import Tokenizer
from jaxserve.config import ROPE_SCALING_TYPES, ModelConfig, RopeScaling

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> numpy dtype (little-endian); only floating weights are loaded.
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
           "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
           "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
# Tensors HF checkpoints may carry that no parameter uses (HF drops them too).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass
class HFCheckpoint:
    """Everything an HF model folder holds, converted.

    Attributes:
      config: architecture, from ``model_config_from_hf``.
      params: HF name -> array of ``dtype`` (``expected_tensors`` lists them).
      tokenizer: from ``tokenizer.json``, or None when the folder has none.
      chat_template: Jinja source (``chat_template.jinja``, ``tokenizer_config.json``
        or ``chat_template.json``), or None.
      metadata: the parsed ``config.json``.
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    chat_template: str | None
    metadata: dict[str, Any]


# ---- config.json -> ModelConfig ---------------------------------------------

def _rope_scaling(rope: Mapping[str, Any] | None) -> RopeScaling | None:
    """A ``RopeScaling`` from an HF rope dict (v5 ``rope_parameters`` or v4
    ``rope_scaling``: ``rope_type`` (or ``type``), ``factor``, and llama3's
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).

    Raises:
      ValueError: a kind other than default, linear or llama3 (yarn, dynamic,
        longrope, ...), or a missing key (names it).
    """
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported (default, "
                         f"{', '.join(ROPE_SCALING_TYPES)})")
    keys = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if rope.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {kind!r} lacks {missing[0]!r}")
    return RopeScaling(kind, **{k: int(rope[k]) if k == "original_max_position_embeddings"
                                else float(rope[k]) for k in keys})


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` of a family with one kind of layer:
    ``rope_theta`` + ``rope_scaling`` (transformers v4) or ``rope_parameters``
    (v5).

    Raises:
      ValueError: as ``_rope_scaling``.
    """
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return dict(rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(rope))


def _qwen_window(hf: Mapping[str, Any]) -> int | None:
    """Qwen2/3 sliding window: set only when every layer slides (``use_sliding_window``
    with layers from ``max_window_layers`` on; transformers' ``layer_types`` rule).

    Raises:
      ValueError: some layers slide and others do not.
    """
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if window is None:
        return None
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(hf.get("num_hidden_layers", 0))]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise ValueError(f"layer_types {types} mix sliding and full attention; not supported")


def _llama(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported")
    bias = bool(hf.get("attention_bias", False))  # all four projections (modeling_llama.py)
    return dict(architecture="llama", attention_bias=bias, attention_out_bias=bias)


def _mistral(hf: Mapping[str, Any]) -> dict[str, Any]:
    return dict(architecture="mistral", sliding_window=hf.get("sliding_window", 4096))


def _qwen2(hf: Mapping[str, Any]) -> dict[str, Any]:
    # q/k/v always carry a bias, o_proj never (modeling_qwen2.py).
    return dict(architecture="qwen2", attention_bias=True, sliding_window=_qwen_window(hf))


def _qwen3(hf: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(architecture="qwen3", head_dim=int(hf.get("head_dim") or 128),
                attention_bias=bias, attention_out_bias=bias, qk_norm=True,
                sliding_window=_qwen_window(hf))


def _gemma3(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3 text (``Gemma3ForCausalLM``, ``model_type`` gemma3_text) as
    transformers reads its config: ``layer_types`` (or every
    ``sliding_window_pattern``-th layer global, default 6); RoPE per layer
    kind from v5 ``rope_parameters`` {full_attention, sliding_attention} or
    v4 ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (global
    layers only); defaults of ``Gemma3TextConfig`` for absent keys.

    Raises:
      ValueError: bidirectional attention (EmbeddingGemma), an activation
        other than the tanh GELU, a scaled local RoPE, attention biases, or a
        bad ``layer_types``.
    """
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder) is not supported")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for gemma3")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported for gemma3 "
                         "(only gelu_pytorch_tanh)")
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers v5
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
        if _rope_scaling(local) is not None:
            raise ValueError("scaled RoPE on sliding_attention layers is not supported")
    else:
        full = hf.get("rope_scaling") or {}
        theta, local_theta = hf.get("rope_theta", 1e6), hf.get("rope_local_base_freq", 1e4)
    n = hf.get("num_hidden_layers", 0)
    period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % period else
                                      "full_attention" for i in range(n)]
    caps = {k: None if hf.get(k) is None else float(hf[k])
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(architecture="gemma3", head_dim=int(hf.get("head_dim") or 256),
                rope_theta=float(theta), rope_local_theta=float(local_theta),
                rope_scaling=_rope_scaling(full), layer_types=tuple(types),
                sliding_window=int(hf.get("sliding_window") or 4096),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
                qk_norm=True, hidden_act=act,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), **caps)


def _mixtral(hf: Mapping[str, Any]) -> dict[str, Any]:
    # Every block is sparse; ``intermediate_size`` is each expert's width and
    # the router renormalises its top-k (modeling_mixtral.py).
    return dict(architecture="mixtral", sliding_window=hf.get("sliding_window"),
                num_experts=hf.get("num_local_experts", 8),
                num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                moe_intermediate_size=hf.get("intermediate_size"), norm_topk_prob=True)


def _qwen3_moe(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3 attention + sparse blocks. A layer i is dense (an MLP of
    ``intermediate_size``) when it is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0`` (modeling_qwen3_moe.py).

    Raises:
      ValueError: ``decoder_sparse_step`` < 1 or a bad ``mlp_only_layers`` entry.
    """
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    n = hf.get("num_hidden_layers", 0)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if any(not isinstance(i, int) or not 0 <= i < n for i in only):
        raise ValueError(f"mlp_only_layers {only!r} must hold layer indices in [0, {n})")
    attention = _qwen3(hf)
    del attention["head_dim"]  # Qwen3-MoE defaults to D / N, not Qwen3's 128
    return dict(attention, architecture="qwen3_moe",
                num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
                num_experts_per_tok=hf.get("num_experts_per_tok", 8),
                moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                mlp_only_layers=tuple(i for i in range(n) if i in only or (i + 1) % step))


# config.json ``architectures[0]`` -> the family's ModelConfig fields (overriding
# the common ones of ``model_config_from_hf``).
HF_ARCHITECTURES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Gemma3ForCausalLM": _gemma3,
}

# Tensors of one MoE layer after "model.layers.{i}.": the router [E, D], then
# expert {e}'s gate [F, D], up [F, D] and down [D, F], one tensor per expert as
# transformers (4.x and 5.x) saves them. Same table as
# ``jaxserve.models.moe.HF_MOE_NAMES`` (checkpoints may not import models).
MOE_TENSOR_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                  "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
}


def _ids(value) -> list[int]:
    """An HF ``eos_token_id`` (None, int or list of ints) as a list."""
    return [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]


def model_config_from_hf(hf: Mapping[str, Any],
                         generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from a parsed ``config.json``.

    Args:
      hf: the ``config.json`` dict (transformers v4 or v5 spelling).
      generation_config: the ``generation_config.json`` dict, or None; its
        ``eos_token_id`` ids join ``eos_token_ids`` (Llama 3 instruct ends turns
        with ids listed only there).

    Raises:
      ValueError: no ``architectures``, an architecture not in ``HF_ARCHITECTURES``
        (names it and the supported ones), a missing required key (names it), or
        an option this runtime does not implement (quantization, an activation
        other than silu (Gemma 3: the tanh GELU), RoPE scaling other than
        linear and llama3, Qwen's mixed sliding/full layers, MLP bias).
    """
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' list")
    family = HF_ARCHITECTURES.get(archs[0])
    if family is None:
        why = " (multimodal checkpoints are not supported; text-only ones are)" \
            if archs[0].endswith("ForConditionalGeneration") else ""
        raise ValueError(f"unsupported architecture {archs[0]!r}{why}; supported: "
                         f"{sorted(HF_ARCHITECTURES)}")
    if hf.get("quantization_config"):
        raise ValueError(f"quantized checkpoints are not supported "
                         f"(quantization_config={hf['quantization_config']!r})")
    if archs[0] != "Gemma3ForCausalLM":
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"config.json lacks required key {key!r}")
        return hf[key]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    eos = dict.fromkeys(_ids(hf.get("eos_token_id"))
                        + _ids((generation_config or {}).get("eos_token_id")))
    fields = dict(
        vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads, **_rope(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=tuple(eos))
    return ModelConfig(**{**fields, **family(hf)})


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor ``cfg``'s model loads (what
    ``jaxserve.models.llama.load_params`` reads, or ``moe.load_params`` for an
    MoE config: ``MOE_TENSOR_NAMES`` in place of a sparse layer's MLP;
    ``gemma3.load_params``: two more norms per layer)."""
    D, N, K, H, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    E, Fe = cfg.num_experts, cfg.moe_intermediate_size
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        out |= {pre + "input_layernorm.weight": (D,),
                pre + "post_attention_layernorm.weight": (D,),
                pre + "self_attn.q_proj.weight": (N * H, D),
                pre + "self_attn.k_proj.weight": (K * H, D),
                pre + "self_attn.v_proj.weight": (K * H, D),
                pre + "self_attn.o_proj.weight": (D, N * H)}
        if E and i not in cfg.mlp_only_layers:
            router, gate, up, down = MOE_TENSOR_NAMES[cfg.architecture]
            out[pre + router] = (E, D)
            for e in range(E):
                out |= {pre + gate.format(e=e): (Fe, D), pre + up.format(e=e): (Fe, D),
                        pre + down.format(e=e): (D, Fe)}
        else:
            out |= {pre + "mlp.gate_proj.weight": (F, D), pre + "mlp.up_proj.weight": (F, D),
                    pre + "mlp.down_proj.weight": (D, F)}
        if cfg.attention_bias:
            out |= {pre + "self_attn.q_proj.bias": (N * H,),
                    pre + "self_attn.k_proj.bias": (K * H,),
                    pre + "self_attn.v_proj.bias": (K * H,)}
        if cfg.attention_out_bias:
            out[pre + "self_attn.o_proj.bias"] = (D,)
        if cfg.qk_norm:
            out |= {pre + "self_attn.q_norm.weight": (H,), pre + "self_attn.k_norm.weight": (H,)}
        if cfg.architecture == "gemma3":  # sandwich norms around the MLP
            out |= {pre + "pre_feedforward_layernorm.weight": (D,),
                    pre + "post_feedforward_layernorm.weight": (D,)}
    return out


# ---- safetensors ------------------------------------------------------------

_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on the JSON header


def _entry_ok(info: Any) -> bool:
    """A tensor entry has a string dtype, a list of non-negative int dims and
    ``data_offsets`` ``[begin, end]`` of ints with ``0 <= begin <= end``."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return False
    shape, offsets = info.get("shape"), info.get("data_offsets")
    return (isinstance(shape, list) and all(map(is_int, shape)) and isinstance(offsets, list)
            and len(offsets) == 2 and all(map(is_int, offsets)) and offsets[0] <= offsets[1])


def read_safetensors_header(path: pathlib.Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensor table of a safetensors file and where its data starts.

    Checked before anything is read from the data section: the 8-byte header
    length fits the file (and the format's 100 MiB limit), the header is a
    UTF-8 JSON object, every entry has a string dtype, non-negative int dims
    and ``data_offsets`` ``[begin, end]`` (``0 <= begin <= end``) inside the
    data section, spanning exactly ``prod(shape) * itemsize`` bytes for the
    dtypes this loader reads, and no two tensors overlap.

    Returns:
      (name -> {"dtype": str, "shape": [int], "data_offsets": [begin, end]},
       byte offset of the data section).

    Raises:
      ValueError: the file is missing, truncated or its header is corrupt; the
        message starts with the path and names the entry.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file ({size} bytes, too short "
                                 f"for the 8-byte header length; truncated?)")
            n = int.from_bytes(head, "little")
            if not 0 < n <= min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"{path}: not a safetensors file (header length {n}, file "
                                 f"size {size} bytes; truncated?)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ValueError(f"{path}: cannot read safetensors file: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: corrupt safetensors header: "
                         f"{' '.join(str(e).split())[:200]}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        if not _entry_ok(info):
            raise ValueError(f"{path}: corrupt safetensors header entry {name!r:.80}: "
                             f"{info!r:.200}")
        begin, end = info["data_offsets"]
        if end > data_size:
            raise ValueError(f"{path}: truncated: tensor {name!r:.80} ends at byte {end} of "
                             f"the data section, which has {data_size} bytes")
        dtype = _DTYPES.get(info["dtype"])
        nbytes = math.prod(info["shape"]) * (dtype.itemsize if dtype is not None else 0)
        if dtype is not None and end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name!r:.80} spans {end - begin} bytes, its "
                             f"dtype and shape need {nbytes}")
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                   for name, info in header.items()
                   if info["data_offsets"][1] > info["data_offsets"][0])
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"{path}: tensor {second!r:.80} overlaps tensor {first!r:.80} "
                             f"in the data section (corrupt header)")
    return header, 8 + n


def read_safetensors(path: pathlib.Path, names: Mapping[str, tuple[int, ...]], dtype,
                     progress=None) -> dict[str, np.ndarray]:
    """Read tensors ``names`` (name -> expected shape) from one file, converted to ``dtype``.

    Raises:
      ValueError: a name the file lacks, a shape other than expected, a
        non-float dtype, or a corrupt / truncated file (all name the file).
    """
    header, start = read_safetensors_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, shape in names.items():
            info = header.get(name)
            if info is None:
                raise ValueError(f"{path}: lacks tensor {name!r}")
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}; "
                                 f"only {sorted(_DTYPES)} are supported")
            if tuple(info["shape"]) != tuple(shape):
                raise ValueError(f"{path}: tensor {name!r} has shape {tuple(info['shape'])}, "
                                 f"config.json implies {tuple(shape)}")
            begin, end = info["data_offsets"]
            f.seek(start + begin)
            raw = np.frombuffer(f.read(end - begin), _DTYPES[info["dtype"]]).reshape(shape)
            out[name] = np.array(raw, dtype=dtype)  # copies: writable, owns its memory
            if progress is not None:
                progress.update(1)
    return out


def _tensor_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it.

    Raises:
      ValueError: a corrupt index, an index naming a missing file, or no
        safetensors file at all.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: corrupt safetensors index ({e!r})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors file (and no {INDEX_FILE}); "
                         "other weight formats are not supported")
    return {name: file for file in files for name in read_safetensors_header(file)[0]}


# ---- tokenizer ----------------------------------------------------------------

def _read_json(path: pathlib.Path, required: bool = False) -> dict[str, Any] | None:
    """A JSON object file, or None when absent and not ``required``.

    Raises:
      ValueError: required and absent, unreadable, or not a JSON object (names the file).
    """
    if not path.is_file():
        if required:
            raise ValueError(f"{path}: missing")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _chat_template(folder: pathlib.Path, tok_config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` (transformers v5), else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates: the "default"),
    else ``chat_template.json``."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if template is None:
        template = (_read_json(folder / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def load_hf_tokenizer(folder: str | os.PathLike) -> tuple[Tokenizer | None, str | None]:
    """The folder's tokenizer and chat template.

    ``tokenizer.json`` is the whole ``tokenizers`` pipeline, used as is; the
    bos/eos/unk/pad tokens come from ``tokenizer_config.json`` (or
    ``special_tokens_map.json``), as strings or ``{"content": ...}`` dicts.

    Returns:
      (Tokenizer, chat template); (None, None) when there is no ``tokenizer.json``.

    Raises:
      ValueError: a corrupt ``tokenizer.json`` / ``tokenizer_config.json``, or
        only a sentencepiece ``tokenizer.model`` (names the file).
    """
    folder = pathlib.Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        if (folder / "tokenizer.model").is_file():
            raise ValueError(f"{folder / 'tokenizer.model'}: sentencepiece tokenizers are not "
                             "supported; save the model with a tokenizer.json")
        return None, None
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"{path}: cannot load tokenizer: {e}") from None
    tok_config = _read_json(folder / "tokenizer_config.json") or {}
    specials = {**(_read_json(folder / "special_tokens_map.json") or {}), **tok_config}
    ids = {}
    for name in ("bos", "eos", "unk", "pad"):
        token = specials.get(f"{name}_token")
        if isinstance(token, dict):
            token = token.get("content")
        ids[name] = backend.token_to_id(token) if isinstance(token, str) else None
    template = _chat_template(folder, tok_config)
    return Tokenizer(backend, ids, template), template


# ---- the folder ---------------------------------------------------------------

def _folder_config(folder: pathlib.Path) -> tuple[ModelConfig, dict[str, Any]]:
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    config_path = folder / "config.json"
    hf = _read_json(config_path, required=True)
    try:
        return model_config_from_hf(hf, _read_json(folder / "generation_config.json")), hf
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_path}: {e}") from None


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of an HF folder from its ``config.json`` alone (no
    tensor is read), so a mesh can be checked before any weights load.

    Raises:
      ValueError: not a folder, or a missing or unsupported ``config.json``.
    """
    return _folder_config(pathlib.Path(path).expanduser())[0]


def load_hf(path: str | os.PathLike, dtype: Any = np.float32,
            show_progress: bool = False) -> HFCheckpoint:
    """Load an HF model folder (``save_pretrained(..., safe_serialization=True)`` layout).

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` or sharded
        ``model-*.safetensors`` + ``model.safetensors.index.json``; optionally
        ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``.
      dtype: numpy dtype of the returned params (``np.float32``,
        ``ml_dtypes.bfloat16``, ...); stored values are converted (bf16 -> f32 exactly).
      show_progress: draw a tqdm bar over the tensors.

    Returns:
      An ``HFCheckpoint``; params are fresh arrays, exactly ``expected_tensors(config)``.

    Raises:
      ValueError: see the module docstring; every message names the file.
    """
    folder = pathlib.Path(path).expanduser()
    config, hf = _folder_config(folder)
    wanted = expected_tensors(config)
    where = _tensor_files(folder)
    missing = [name for name in wanted if name not in where]
    if missing:
        raise ValueError(f"{folder}: the safetensors files lack tensor {missing[0]!r} "
                         f"({len(missing)} missing) that config.json's {hf['architectures'][0]} "
                         f"needs")
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = [name for name in where if name not in wanted and name not in tied_head
             and not name.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise ValueError(f"{where[extra[0]]}: unexpected tensor {extra[0]!r}; config.json's "
                         f"{hf['architectures'][0]} has no such parameter")
    by_file: dict[pathlib.Path, dict[str, tuple[int, ...]]] = {}
    for name, shape in wanted.items():
        by_file.setdefault(where[name], {})[name] = shape
    params: dict[str, np.ndarray] = {}
    with tqdm(total=len(wanted), desc="reading safetensors", disable=not show_progress) as bar:
        for file, names in sorted(by_file.items()):
            params |= read_safetensors(file, names, dtype, bar)
    tokenizer, template = load_hf_tokenizer(folder)
    return HFCheckpoint(config=config, params=params, tokenizer=tokenizer,
                        chat_template=template, metadata=hf)


__all__ = ["HFCheckpoint", "HF_ARCHITECTURES", "INDEX_FILE", "MOE_TENSOR_NAMES", "expected_tensors",
           "load_hf", "load_hf_tokenizer", "model_config_from_hf", "read_safetensors",
           "read_safetensors_header"]
