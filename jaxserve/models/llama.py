"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) in Flax NNX.

Dimension letters: T tokens, D model dim, N query heads, K kv heads, H head dim,
F SwiGLU width, V vocab, P pages, L page size, S sequences of a step.

Weights keep HF's layout, ``[out, in]``, and every ``nnx.Param`` names its
axes (``sharding_names``) for ``sharding.rules``. The module is split once into
graph and state; the runner jits pure functions over the state.

Activations between layers are feature-major, ``x_DT`` ([D, T]), so every
projection is ``W_FD @ x_DT``: XLA:CPU runs that form 1.3-1.6x faster than
``x_TD @ W_FD.T`` at decode batch sizes (8-32 rows; measured on the 2-core
dev machine: 61 vs 38 GFLOP/s for a 32x576x3072 matmul) and as fast at prefill
sizes. Attention sees token-major ``q_TNH`` (a small transpose per layer).

The variants differ only by ``ModelConfig`` flags: ``attention_bias`` (q/k/v
biases, Qwen2), ``attention_out_bias`` (o_proj bias), ``qk_norm`` (per-head
RMSNorm of q and k before RoPE, Qwen3) and ``sliding_window`` (Mistral).

References: HF transformers ``modeling_llama.py`` (RoPE with ``rotate_half``,
RMSNorm in f32, SwiGLU), ``modeling_qwen2.py``, ``modeling_qwen3.py``,
``modeling_mistral.py``; Touvron et al. 2023 (Llama); Ainslie et al. 2023 (GQA).

Multi-LoRA (``lora=LoRAConfig``): each q/k/v/o and gate/up/down projection
gets a ``lora.LoRA`` module of adapter slots, ``<proj>_lora``, and adds
``lora.lora_delta`` for the slots of ``AttentionMetadata.lora_slots``
(``jaxserve.models.lora``). Without it the modules have no such attribute
and the programs are those of a model without LoRA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import GGUF_BLOCK_METHODS, LoRAConfig, ModelConfig
from jaxserve.models import lora as lora_lib
from jaxserve.models import quant, quant_cpu, stack
from jaxserve.models.params import lm_head, load_tied_head, put_param
from jaxserve.models.rope import apply_rope, layer_rope_tables
from pallas_kernels.ragged_paged_attention import kernel as rpa_kernel
from pallas_kernels.ragged_paged_attention import kernel_xla as rpa_xla
from sharding.rules import ShardingRules


_param = quant.param  # gemma3 and moe import it from here


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """What one step's attention needs; built on the host by the runner.

    Attributes:
      input_ids: i32[T] packed token ids of every sequence (padding: 0).
      positions: i32[T] absolute position of each token (padding: 0).
      slot_pages: i32[T] page each token's K/V is written to (padding: P, dropped).
      slot_offsets: i32[T] offset inside that page.
      kv_lens: i32[S] kv length of each sequence, this step's tokens included.
      page_indices: i32[S, pages_per_seq] page table rows.
      cu_q_lens: i32[S + 1] prefix sums of query lengths.
      num_seqs: i32[1] rows of S in use: the decode rows plus the prefill
        sequences.
      logits_indices: i32[R] rows of T whose next-token logits are returned:
        each sampled sequence's last token (padding: 0), then any
        prompt-logprob rows.
      num_decode: i32[1] leading rows of S (and tokens of T) that are decode
        rows: row i is sequence i's single new token, at token i.
      decode_only: static: every real row is a decode row (a ``decode_step``
        program, T = S); the attention then compiles no prefill path.
      lora_slots: i32[T] each token's adapter slot (0: the base model, s in
        1..max_loras: slot s; padding: 0), or None when LoRA is off
        (``EngineConfig.lora`` None). After ``decode_only`` because
        ``engine.plan`` passes ``decode_only`` positionally.

    The rest of the rows are prefill sequences (or chunks) packed ragged after
    the decode tokens. Row and token counts are device values: one compiled
    program serves every mix that fits its T and S.
    """

    input_ids: jax.Array
    positions: jax.Array
    slot_pages: jax.Array
    slot_offsets: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    num_decode: jax.Array
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    lora_slots: jax.Array | None = None


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in f32 as HF does.

    The scale is ``offset + weight``: ``offset`` 0 for Llama-style weights
    (initialised to 1), 1 for Gemma's zero-centred ones (HF ``Gemma3RMSNorm``:
    ``x * (1 + w)``, initialised to 0).
    """

    def __init__(self, dim: int, eps: float, dtype, rngs=None, offset: float = 0.0):
        self.weight = _param((dim,), ("norm",), dtype, None, ones=offset == 0.0)
        self.eps = eps
        self.offset = offset

    def __call__(self, x_DT):
        """Normalise each column of feature-major ``x_DT`` [D, T]."""
        x32 = x_DT.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + self.eps)
        w = self.weight.value.astype(jnp.float32)
        return (((w + self.offset) if self.offset else w)[:, None] * x32).astype(x_DT.dtype)


def rms_norm_heads(x_TNH, w_H, eps: float, offset: float = 0.0):
    """RMSNorm over the last axis H of [T, heads, H] in f32, scale ``offset + w``
    (Qwen3 ``q_norm``/``k_norm``: offset 0; Gemma 3: 1)."""
    x32 = x_TNH.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = w_H.astype(jnp.float32)
    return (((w + offset) if offset else w) * x32).astype(x_TNH.dtype)


_OWN = object()  # Attention's window argument: the module's own ``sliding_window``

_linear = quant.linear  # W x (+ b) for a Param or a QuantizedWeight: [F, D] @ [D, T] -> [F, T]


def _value(p: nnx.Param | None):
    """The array of an optional parameter (None stays None)."""
    return None if p is None else p.value


def _kv_heads_mesh(cfg: ModelConfig):
    """(mesh, axis) for the Pallas attention's ``shard_map``: the abstract
    mesh the step is traced under (the runner's ``use_abstract_mesh``, as
    ``moe`` reads it) and the mesh axis of logical axis ``kv_heads`` when
    it splits the kv heads and the query heads with them
    (``ShardingRules.for_model``); else (None, None), and the call runs
    whole (one device, or kv heads replicated)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None, None
    rules = ShardingRules.for_model(dict(mesh.shape), cfg)
    axis = rules.kv_heads
    if axis is None or rules.q_heads != axis or dict(mesh.shape).get(axis, 1) == 1:
        return None, None
    return mesh, axis


def _add_projections(module, shapes: dict, dtype, rngs, qfmt, adopt, lora) -> None:
    """Set ``module.<name>`` to the weight of each projection of ``shapes``
    (name -> ([out, in], logical axes)) and, with ``lora``, ``<name>_lora``
    to its adapter slots (``lora.make``)."""
    for n, ((out_dim, in_dim), names) in shapes.items():
        setattr(module, n, quant.weight((out_dim, in_dim), names, dtype, rngs, qfmt, adopt))
        if lora is not None:
            setattr(module, n + lora_lib.SUFFIX,
                    lora_lib.make(lora, in_dim, out_dim, names, dtype))


class Attention(nnx.Module):
    """GQA self-attention over the paged cache: project, RoPE, write K/V, attend.

    ``attention_impl``: "xla" (``kernel_xla``: loops over page blocks, decode
    rows in row blocks, prefill sequences in query blocks) or "pallas" (one
    ragged Pallas kernel for the whole mixed batch; ``interpret`` as in
    ``rpa_kernel.ragged_paged_attention``). Both take the same metadata.

    Optional parameters (None when the config turns them off): ``q_bias``
    [N*H], ``k_bias`` / ``v_bias`` [K*H], ``o_bias`` [D], ``q_norm`` / ``k_norm`` [H].
    The four projections are ``quant.QuantizedWeight``s when ``qfmt`` is set
    (``adopt``: each takes its checkpoint tensor's own format, ``gguf``).

    ``sliding_window``: this layer's window (``ModelConfig.layer_window``);
    ``norm_offset``: the q/k norms scale by ``offset + w`` (Gemma: 1). The
    score scale and soft cap are the config's (``sm_scale``,
    ``attn_logit_softcapping``).

    ``lora``: adds ``q_proj_lora`` .. ``o_proj_lora`` (``lora.LoRA``, in
    ``dtype``), applied to the tokens of ``md.lora_slots``.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs, attention_impl: str = "xla",
                 interpret=False, qfmt: quant.TensorFormat | None = None, adopt: bool = False,
                 sliding_window: int | None = None, norm_offset: float = 0.0,
                 lora: LoRAConfig | None = None):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shapes = {"q_proj": ((N * H, D), ("q_heads", "embed")),
                  "k_proj": ((K * H, D), ("kv_heads", "embed")),
                  "v_proj": ((K * H, D), ("kv_heads", "embed")),
                  "o_proj": ((D, N * H), ("embed", "q_heads"))}
        _add_projections(self, shapes, dtype, rngs, qfmt, adopt, lora)
        bias = cfg.attention_bias
        self.q_bias = _param((N * H,), ("q_heads",), dtype, rngs) if bias else None
        self.k_bias = _param((K * H,), ("kv_heads",), dtype, rngs) if bias else None
        self.v_bias = _param((K * H,), ("kv_heads",), dtype, rngs) if bias else None
        self.o_bias = _param((D,), ("embed",), dtype, rngs) if cfg.attention_out_bias else None
        ones = norm_offset == 0.0
        self.q_norm = _param((H,), ("head_dim",), dtype, None, ones=ones) if cfg.qk_norm else None
        self.k_norm = _param((H,), ("head_dim",), dtype, None, ones=ones) if cfg.qk_norm else None
        self.cfg = cfg
        self.attention_impl = attention_impl
        self.interpret = interpret
        self.sliding_window = sliding_window
        self.norm_offset = norm_offset

    def __call__(self, x_DT, cos_TH2, sin_TH2, k_cache, v_cache, md: AttentionMetadata,
                 layer=0, window=_OWN):
        """Attend, writing this step's K/V into layer ``layer`` of the caches.

        Args:
          x_DT: [D, T] normalised activations.
          cos_TH2, sin_TH2: f32[T, H/2] this layer's RoPE tables.
          k_cache, v_cache: the ``KVPages`` of every layer, flat: pages
            [layers * P, L, K, H] (f32 [layers * P, L, K] scales when
            int8/fp8); this layer's are pages ``layer * P ..``
            (``stack.layer_pages``).
          md: the step's metadata.
          layer: this layer's index (int, or i32 scalar in a scan).
          window: the sliding window (None, int, or an i32 scalar where
            ``stack.NO_WINDOW`` means none); default this module's own.

        Returns:
          (out [D, T], k_cache, v_cache).
        """
        cfg = self.cfg
        window = self.sliding_window if window is _OWN else window
        T = x_DT.shape[1]
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_QT, k_KT, v_KT = self._projs(("q", "k", "v"), x_DT, md)
        q_TNH = q_QT.T.reshape(T, N, H)
        k_TKH = k_KT.T.reshape(T, K, H)
        v_TKH = v_KT.T.reshape(T, K, H)
        if cfg.qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm, before RoPE
            q_TNH = rms_norm_heads(q_TNH, self.q_norm.value, cfg.rms_norm_eps, self.norm_offset)
            k_TKH = rms_norm_heads(k_TKH, self.k_norm.value, cfg.rms_norm_eps, self.norm_offset)
        q_TNH = apply_rope(q_TNH, cos_TH2, sin_TH2)
        k_TKH = apply_rope(k_TKH, cos_TH2, sin_TH2)
        # Write this step's K/V first; padding tokens target page P (dropped).
        # int8/fp8 caches quantize here and dequantize inside the attention.
        P = k_cache.pages_PLKH.shape[0] // cfg.num_layers
        slot_pages_T, page_indices_SP = stack.layer_pages(md, layer, P, cfg.num_layers)
        k_flat, v_flat = rpa_kernel.write_kv(k_cache, v_cache, k_TKH, v_TKH, slot_pages_T,
                                             md.slot_offsets)
        kw = dict(sm_scale=cfg.sm_scale, sliding_window=window,
                  soft_cap=cfg.attn_logit_softcapping, k_scales_PLK=k_flat.scales_PLK,
                  v_scales_PLK=v_flat.scales_PLK)
        if self.attention_impl == "pallas":
            mesh, kv_heads_axis = _kv_heads_mesh(cfg)
            o_TNH = rpa_kernel.ragged_paged_attention(
                q_TNH, k_flat.pages_PLKH, v_flat.pages_PLKH, md.kv_lens, page_indices_SP,
                md.cu_q_lens, md.num_seqs, interpret=self.interpret, mesh=mesh,
                kv_heads_axis=kv_heads_axis, decode_only=md.decode_only, **kw)
        else:
            o_TNH = rpa_xla.ragged_paged_attention(
                q_TNH, k_flat.pages_PLKH, v_flat.pages_PLKH, md.kv_lens, page_indices_SP,
                md.cu_q_lens, md.num_seqs, md.num_decode,
                decode_only=md.decode_only, **kw)
        return self._proj("o", o_TNH.reshape(T, N * H).T, md), k_flat, v_flat

    def _proj(self, n: str, x_IT, md: AttentionMetadata):
        """Projection ``{n}_proj`` of x [I, T] -> [O, T]: weight, bias if
        any, and the LoRA delta of ``md.lora_slots`` if any."""
        return self._projs((n,), x_IT, md)[0]

    def _projs(self, names, x_IT, md: AttentionMetadata):
        """``_proj`` of each name over the same x (``quant.linears``: one
        kernel call for them all where the format allows)."""
        ys = quant.linears([getattr(self, n + "_proj") for n in names], x_IT,
                           [_value(getattr(self, n + "_bias")) for n in names])
        return [lora_lib.with_delta(y_OT, getattr(self, f"{n}_proj{lora_lib.SUFFIX}", None),
                                    x_IT, md.lora_slots) for n, y_OT in zip(names, ys)]


_ACTIVATIONS = {"silu": jax.nn.silu,
                "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated feed-forward (Shazeer 2020): down(act(gate(x)) * up(x)); act is
    ``cfg.hidden_act``: silu (SwiGLU) or the tanh GELU (Gemma's GeGLU).
    ``lora``: adds ``gate_proj_lora``, ``up_proj_lora``, ``down_proj_lora``."""

    def __init__(self, cfg: ModelConfig, dtype, rngs, qfmt: quant.TensorFormat | None = None,
                 adopt: bool = False, intermediate_size: int | None = None,
                 lora: LoRAConfig | None = None):
        D, F = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        shapes = {"gate_proj": ((F, D), ("mlp", "embed")), "up_proj": ((F, D), ("mlp", "embed")),
                  "down_proj": ((D, F), ("embed", "mlp"))}
        _add_projections(self, shapes, dtype, rngs, qfmt, adopt, lora)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x_DT, lora_slots_T=None):
        """[D, T] -> [D, T]; ``lora_slots_T`` (i32[T] or None) as
        ``AttentionMetadata.lora_slots``."""
        g_FT, u_FT = self._projs(("gate_proj", "up_proj"), x_DT, lora_slots_T)
        return self._projs(("down_proj",), self.act(g_FT) * u_FT, lora_slots_T)[0]

    def _projs(self, names, x_IT, slots_T):
        """Each projection of x [I, T] with its LoRA delta (``quant.linears``:
        one kernel call for them all where the format allows)."""
        ys = quant.linears([getattr(self, n) for n in names], x_IT)
        return [lora_lib.with_delta(y, getattr(self, n + lora_lib.SUFFIX, None), x_IT, slots_T)
                for n, y in zip(names, ys)]


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, dtype, rngs, qfmt=None, adopt=False,
                 lora: LoRAConfig | None = None, **attn):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, qfmt=qfmt, adopt=adopt, lora=lora, **attn)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs, qfmt, adopt, lora=lora)


def decoder_layer(layer: DecoderLayer, x_DT, k_cache, v_cache, cos_TH2, sin_TH2, window, index,
                  *, md: AttentionMetadata):
    """One pre-norm Llama block (``stack.run_layers``' body, with ``md``
    bound): returns (x_DT [D, T], k_cache, v_cache, None)."""
    h_DT, k_cache, v_cache = layer.self_attn(layer.input_layernorm(x_DT), cos_TH2, sin_TH2,
                                             k_cache, v_cache, md, index, window)
    x_DT = x_DT + h_DT
    return (x_DT + layer.mlp(layer.post_attention_layernorm(x_DT), md.lora_slots), k_cache,
            v_cache, None)


class LlamaForCausalLM(nnx.Module):
    """Llama decoder with an LM head.

    ``__call__`` runs the packed tokens of one step through all layers,
    writing their K/V into the paged cache, and returns the next-token logits
    of the rows in ``md.logits_indices`` plus the updated caches.

    ``quantization`` (``EngineConfig.quantization``) makes every q/k/v/o and
    gate/up/down weight a ``quant.QuantizedWeight`` of that method's format,
    and the LM head too unless ``quantize_lm_head`` is False (``lm_head``);
    the embedding and norms stay ``dtype``.

    ``lora`` (``EngineConfig.lora``): adapter slots beside every q/k/v/o and
    gate/up/down weight, in ``dtype`` (``jaxserve.models.lora``); None: none.

    Raises:
      ValueError: an unknown quantization method.
    """

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 attention_impl: str = "xla", interpret=False, quantization: str = "none",
                 quantization_group_size: int = 32, lora: LoRAConfig | None = None,
                 quantize_lm_head: bool = True):
        self.cfg = cfg
        V, D = cfg.vocab_size, cfg.hidden_size
        qfmt = quant.method_format(quantization, quantization_group_size)
        adopt = quantization in GGUF_BLOCK_METHODS
        self.embed_tokens = _param((V, D), ("vocab", "embed"), dtype, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, qfmt, adopt, lora=lora,
                                             attention_impl=attention_impl, interpret=interpret,
                                             sliding_window=cfg.layer_window(i))
                                for i in range(cfg.num_layers)])
        self.layer_windows = tuple(cfg.layer_window(i) for i in range(cfg.num_layers))
        self.layer_segments = None  # set by stack.stack_layers: the scanned runs
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.lm_head = lm_head(cfg, self.embed_tokens, dtype, rngs, qfmt if quantize_lm_head
                               else None, adopt)

    def __call__(self, k_cache, v_cache, md: AttentionMetadata, return_hidden: bool = False):
        """Forward one step.

        Args:
          k_cache, v_cache: ``KVPages`` of every layer, stacked: pages
            [layers, P, L, K, H], plus f32 [layers, P, L, K] scales for an
            int8/fp8 cache; updated in place when donated.
          md: the step's ``AttentionMetadata`` (its shapes, and
            ``decode_only``, are the only static part of a step).
          return_hidden: also return the last layer's output x [D, T] (before
            the final norm), for ``logits_of`` (prompt logprobs).

        Returns:
          (logits [R, V] f32 for ``md.logits_indices``, k_cache, v_cache[, x_DT]).
        """
        x_DT = self.embed_tokens.value[md.input_ids].T
        x_DT, k_cache, v_cache, _ = stack.run_layers(
            self, functools.partial(decoder_layer, md=md), x_DT, k_cache, v_cache,
            layer_rope_tables(self.cfg, md.positions))
        out = (self.logits_of(x_DT[:, md.logits_indices]), k_cache, v_cache)
        return out + (x_DT,) if return_hidden else out

    def logits_of(self, x_DR):
        """Next-token logits f32 [R, V] of last-layer outputs x [D, R] (final
        norm, then the LM head, then ``final_logit_softcapping`` if set)."""
        x_DR = self.norm(x_DR)
        head = self.lm_head
        # A tied head of a GGUF file's blocks holds exactly the f32 embedding's
        # values: where the CPU kernel does not serve this many rows, the f32
        # embedding is the faster form of the same numbers (XLA:CPU dequantizes
        # grouped blocks inside the dot 2-7x slower than an f32 dot).
        exact_dense = (isinstance(head, quant.QuantizedWeight) and head.adopt
                       and self.cfg.tie_word_embeddings and jax.default_backend() == "cpu"
                       and not any(quant_cpu.kernel_serves(f, head.shape[0], x_DR)
                                   for f in (head.fmt, head.fmt.weight_only())))
        if exact_dense and head.fmt.act_block:  # gguf_a8 / a16: the head reads x's blocks
            x_DR = quant.fake_quantize_act_blocks(x_DR, head.fmt.act_block, head.fmt.act_bits)
        if isinstance(head, quant.QuantizedWeight) and not exact_dense:
            logits_RV = head.matmul(x_DR).T
        else:
            head_VD = (self.embed_tokens.value if self.lm_head is None or exact_dense
                       else self.lm_head.value)
            logits_RV = jnp.einsum("vd,dr->rv", head_VD, x_DR, preferred_element_type=jnp.float32)
        cap = self.cfg.final_logit_softcapping
        return logits_RV if cap is None else cap * jnp.tanh(logits_RV / cap)


def attention_hf_params(layer, pre: str) -> dict[str, nnx.Param]:
    """HF name -> param of one decoder layer's norms and attention (``pre`` is
    ``"model.layers.{i}."``); shared with ``moe.hf_params``."""
    out = {pre + "input_layernorm.weight": layer.input_layernorm.weight,
           pre + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    attn = layer.self_attn
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[pre + f"self_attn.{n}.weight"] = getattr(attn, n)
        bias = getattr(attn, n[0] + "_bias")
        if bias is not None:
            out[pre + f"self_attn.{n}.bias"] = bias
    for n in ("q_norm", "k_norm"):
        if getattr(attn, n) is not None:
            out[pre + f"self_attn.{n}.weight"] = getattr(attn, n)
    return out


def hf_params(model: LlamaForCausalLM) -> dict[str, tuple[nnx.Param, int | None]]:
    """HF tensor name -> (the ``nnx.Param`` it fills, None), in load order.

    The None is the expert index of ``moe.hf_params`` (dense models have none);
    ``sharding.rules.hf_shardings`` turns this into one sharding per HF name.
    A tied head has no name of its own (``load_params`` fills a quantized
    one from the embedding: ``load_tied_head``).
    """
    out = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm.weight}
    if not model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        out |= attention_hf_params(layer, pre)
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[pre + f"mlp.{n}.weight"] = getattr(layer.mlp, n)
    return {name: (p, None) for name, p in out.items()}


def load_params(model: LlamaForCausalLM, params: dict) -> None:
    """Copy an HF-named dict of arrays into ``model`` in place.

    Names as in ``checkpoints.gguf_loader``'s docstring, plus, when the config
    asks for them, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.bias`` and
    ``model.layers.{i}.self_attn.{q,k}_norm.weight`` [H] (``hf_params``).
    Values are numpy arrays, or ``jax.Array``s (e.g. restored by Orbax straight
    into their sharding), which are kept as they are when the dtype matches.

    Raises:
      ValueError: a tensor is missing or has the wrong shape.
    """
    for name, (p, _) in hf_params(model).items():
        put_param(p, name, params)
    load_tied_head(model, params)
