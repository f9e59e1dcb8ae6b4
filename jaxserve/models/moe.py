"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE) in Flax NNX.

Dimension letters as in ``llama.py`` (T tokens, D model dim, F SwiGLU width,
V vocab), plus E experts, X the top-k slots of a token
(``num_experts_per_tok``) and A = T * X token-expert assignments.

Everything but the feed-forward is ``llama.py``'s: embedding, RMSNorm,
RoPE, the paged GQA attention (with Qwen3's per-head q/k norm through
``ModelConfig.qk_norm``) and the LM head. Each decoder block's SwiGLU is
replaced by a sparse MoE block (``MoEBlock``): a router ``[E, D]`` gives
logits per token, each token goes to its top-k experts, and their SwiGLU
outputs are summed with the routing weights. The two families differ only in
how the weights are normalised (``ModelConfig.norm_topk_prob``):

* Mixtral: softmax over the k selected router logits (always; HF computes the
  same numbers as a softmax over all E, top-k, renormalised);
* Qwen3-MoE: softmax over all E experts, then top-k; renormalised to sum 1
  iff ``norm_topk_prob``. Layers listed in ``mlp_only_layers`` (HF
  ``mlp_only_layers`` and ``decoder_sparse_step``, resolved by the loader)
  keep a dense SwiGLU of ``intermediate_size``.

Neither family has shared experts; Qwen2-MoE and DeepSeek (shared experts,
grouped routing) are not covered.

Compute: the A assignments are sorted by expert, so each expert's tokens form
one contiguous segment, and the three expert projections are grouped matmuls
(``jax.lax.ragged_dot_general`` over the stacked weights ``[E, F, D]`` /
``[E, D, F]``, HF's ``[out, in]`` layout, no transpose); the outputs are
unsorted and summed per token with the routing weights. Padding tokens of
the step's bucket (those whose K/V slot is the dropped page P) are routed
nowhere. XLA:CPU lowers ``ragged_dot`` to a masked dense matmul (E times the
FLOPs of the real work); GPU and TPU have grouped kernels.

Expert load: every forward also returns ``expert_load`` i32[num_layers, E],
the real tokens routed to each expert in each layer (zeros for dense layers;
each MoE row sums to tokens * k). The runner keeps the last step's as
``ModelRunner.last_expert_load``.

Expert parallelism: a ``shard_map`` over the whole mesh. The expert weights
are split over E on the mesh axis of logical axis ``"experts"`` (ep) and over
F on that of ``"mlp"`` (tp) (``sharding.rules``). Routing runs replicated,
before the ``shard_map``, so every device sees every token and its top-k ids;
each device then sorts the assignments to its own E/ep experts to the front
(the rest, and padding, last, outside every group), runs the grouped matmuls
on its F/tp slice, and the partial [T, D] outputs are summed with one
``psum`` over ep and tp. This is the simplest correct EP (no all-to-all
dispatch: tokens are not moved, attention stays replicated over ep); each
device still pays ragged_dot's cost for all A rows on CPU. The mesh comes
from the abstract mesh the runner traces under
(``jax.sharding.use_abstract_mesh``); without one, or on a one-device mesh,
the same local function runs directly.

References: HF transformers ``modeling_mixtral.py`` (``MixtralTopKRouter``,
``MixtralExperts``), ``modeling_qwen3_moe.py`` (``Qwen3MoeTopKRouter``,
``Qwen3MoeDecoderLayer``); Jiang et al. 2024 (Mixtral of Experts); Shazeer
et al. 2017 (sparsely-gated MoE); Gale et al. 2023 (MegaBlocks: grouped
matmuls over sorted tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.config import GGUF_BLOCK_METHODS, LoRAConfig, ModelConfig
from jaxserve.models import quant, stack
from jaxserve.models.llama import (MLP, Attention, AttentionMetadata, LlamaForCausalLM, RMSNorm,
                                   _param, attention_hf_params)
from jaxserve.models.params import lm_head, load_tied_head, put_param
from jaxserve.models.rope import layer_rope_tables
from sharding.rules import ShardingRules
from sharding.rules import _logical_axes as logical_axes

# ragged_dot_general: lhs [A, in] with A ragged (grouped), rhs [E, out, in]
# grouped on E, contracting ``in`` (lhs dim 1 with rhs dim 2): HF's [out, in].
_GROUPED_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])

# HF checkpoint names of one MoE layer's tensors after "model.layers.{i}.":
# router, then gate / up / down of expert {e}. ``checkpoints.hf_loader``
# lists the same names in ``expected_tensors``.
HF_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                  "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
}


def route(logits_TE, top_k: int, norm_topk_prob: bool):
    """Top-k routing.

    Args:
      logits_TE: f32[T, E] router logits.
      top_k: k, experts per token.
      norm_topk_prob: True: softmax over the k largest logits (Mixtral; equal
        to renormalising the top-k of the full softmax). False: the top-k
        probabilities of the softmax over all E (Qwen3-MoE default).

    Returns:
      (ids_TX i32[T, k] expert ids, largest weight first; weights_TX f32[T, k]).
    """
    if norm_topk_prob:
        top_TX, ids_TX = jax.lax.top_k(logits_TE, top_k)
        return ids_TX, jax.nn.softmax(top_TX, axis=-1)
    weights_TX, ids_TX = jax.lax.top_k(jax.nn.softmax(logits_TE, axis=-1), top_k)
    return ids_TX, weights_TX


def expert_ffn(x_TD, ids_TX, weights_TX, gate_EFD, up_EFD, down_EDF, first_expert):
    """The SwiGLU experts ``[first_expert, first_expert + E)`` applied to
    their share of the assignments, weighted and summed per token.

    Assignments to other experts (ids outside that range, e.g. the padding
    id ``num_experts``) contribute zero. Used whole on one device, and per
    device (its local experts and F slice) inside the EP ``shard_map``.

    Args:
      x_TD: [T, D] token activations.
      ids_TX: i32[T, k] global expert ids.
      weights_TX: f32[T, k] routing weights.
      gate_EFD, up_EFD: [E, F, D] local experts' gate and up projections.
      down_EDF: [E, D, F] local experts' down projections.
      first_expert: global id of local expert 0 (int or i32 scalar).

    Returns:
      f32[T, D]: sum over k of weight * down(silu(gate x) * up x).
    """
    T, X = ids_TX.shape
    E = gate_EFD.shape[0]
    local_A = ids_TX.reshape(-1) - first_expert
    local_A = jnp.where((local_A >= 0) & (local_A < E), local_A, E)  # E: not here, sorts last
    order_A = jnp.argsort(local_A, stable=True)
    sizes_E = jnp.zeros(E, jnp.int32).at[local_A].add(1, mode="drop")
    x_AD = x_TD[order_A // X]
    gate_AF = jax.lax.ragged_dot_general(x_AD, gate_EFD, sizes_E, _GROUPED_OUT_IN)
    up_AF = jax.lax.ragged_dot_general(x_AD, up_EFD, sizes_E, _GROUPED_OUT_IN)
    h_AF = jax.nn.silu(gate_AF) * up_AF
    y_AD = jax.lax.ragged_dot_general(h_AF, down_EDF, sizes_E, _GROUPED_OUT_IN,
                                      preferred_element_type=jnp.float32)
    # Rows outside every group are unspecified on some backends: zero them.
    y_AD = jnp.where((local_A[order_A] < E)[:, None], y_AD, 0.0)
    unsort_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(T * X, dtype=order_A.dtype))
    y_TXD = y_AD[unsort_A].reshape(T, X, -1)
    return jnp.einsum("txd,tx->td", y_TXD, weights_TX.astype(jnp.float32))


class MoEBlock(nnx.Module):
    """Sparse MoE feed-forward: router, top-k, E SwiGLU experts (no shared expert).

    Parameters (HF ``[out, in]`` layout, stacked over experts):
      router [E, D] (replicated), gate_proj / up_proj [E, F, D] (``experts``,
      ``mlp``, ``embed``), down_proj [E, D, F] (``experts``, ``embed``, ``mlp``);
      F = ``moe_intermediate_size``. With ``qfmt`` the three expert weights
      are ``quant.QuantizedWeight``s (the router stays precise); each device
      dequantizes its own experts' slices inside the expert function (the
      grouped matmul has no quantized form), and w8a8 quantizes the tokens
      per token first, so the numbers are those of the format's definition.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs, qfmt=None, adopt=False):
        E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.router = _param((E, D), (None, "embed"), dtype, rngs)
        self.gate_proj = quant.weight((E, F, D), ("experts", "mlp", "embed"), dtype, rngs, qfmt,
                                      adopt)
        self.up_proj = quant.weight((E, F, D), ("experts", "mlp", "embed"), dtype, rngs, qfmt,
                                    adopt)
        self.down_proj = quant.weight((E, D, F), ("experts", "embed", "mlp"), dtype, rngs, qfmt,
                                      adopt)
        self.cfg = cfg

    def __call__(self, x_DT, valid_T):
        """Apply the block.

        Args:
          x_DT: [D, T] feature-major activations (after the post-attention norm).
          valid_T: bool[T], False for the step's padding tokens (routed nowhere).

        Returns:
          (y_DT [D, T] in x's dtype, load_E i32[E] real tokens per expert).
        """
        cfg = self.cfg
        E = cfg.num_experts
        logits_TE = jnp.einsum("ed,dt->te", self.router.value, x_DT,
                               preferred_element_type=jnp.float32)
        ids_TX, weights_TX = route(logits_TE, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        ids_TX = jnp.where(valid_T[:, None], ids_TX, E)  # padding: expert E, i.e. none
        load_E = jnp.zeros(E, jnp.int32).at[ids_TX.reshape(-1)].add(1, mode="drop")
        x_TD = x_DT.T
        experts = (self.gate_proj, self.up_proj, self.down_proj)
        if isinstance(self.gate_proj, quant.QuantizedWeight) and self.gate_proj.fmt.act_int8:
            xq_DT, sx_1T = quant.quantize_act(x_DT)  # w8a8: the tokens as int8 per token
            x_TD = (xq_DT.astype(jnp.float32) * sx_1T).T.astype(x_DT.dtype)
        elif isinstance(self.gate_proj, quant.QuantizedWeight) and self.gate_proj.fmt.act_block:
            # gguf_a8 / a16: the tokens as their blocks (the down projection's input, inside
            # the ragged expert FFN, stays precise, as under w8a8)
            fmt = self.gate_proj.fmt
            x_TD = quant.fake_quantize_act_blocks(x_DT, fmt.act_block, fmt.act_bits).T.astype(
                x_DT.dtype)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1:
            y_TD = expert_ffn(x_TD, ids_TX, weights_TX,
                              *(_dense(w, x_DT.dtype) for w in experts), 0)
        else:
            y_TD = _expert_parallel_ffn(mesh, cfg, x_TD, ids_TX, weights_TX, experts)
        return y_TD.astype(x_DT.dtype).T, load_E


def _dense(w, dtype):
    """The array of an expert weight: a Param's value, or a QuantizedWeight dequantized."""
    return w.dense(dtype) if isinstance(w, quant.QuantizedWeight) else w.value


def _expert_parallel_ffn(mesh, cfg: ModelConfig, x_TD, ids_TX, weights_TX, experts):
    """``expert_ffn`` over a mesh: experts split on the ``experts`` mesh axis
    (ep), F on the ``mlp`` one (tp); tokens and routing replicated; partial
    outputs summed by one psum. Shapes as ``expert_ffn``; ``experts`` the
    gate, up and down weights (``nnx.Param`` or ``quant.QuantizedWeight``,
    global; a quantized one's parts enter split like its values and are
    dequantized per device).
    """
    rules = ShardingRules.for_model(dict(mesh.shape), cfg)
    expert_axis = rules.experts
    summed = tuple(a for a in (rules.experts, rules.mlp) if a is not None)
    # Flatten every weight into (arrays, their specs); remember how to rebuild.
    arrays, specs, kinds = [], [], []
    for w in experts:
        if isinstance(w, quant.QuantizedWeight):
            parts = [p for p in (w.q, w.scale, w.zero) if p is not None]
            kinds.append((w.fmt, w.zero is not None, len(parts)))
        else:
            parts = [w]
            kinds.append((None, False, 1))
        for p in parts:
            arrays.append(p.value)
            # Inside a scanned layer the names still carry the stacked layer axis.
            axes = logical_axes(p)
            specs.append(rules.spec(axes[len(axes) - p.value.ndim:]))
    dtype = x_TD.dtype

    def local(x_TD, ids_TX, weights_TX, *flat):
        dense, i = [], 0
        for fmt, has_zero, n in kinds:
            part = flat[i:i + n]
            i += n
            if fmt is None:
                dense.append(part[0])
            else:
                zero = part[2] if has_zero else None
                dense.append(quant.dequantize(fmt, part[0], part[1] if n > 1 else None, zero,
                                              dtype))
        first = 0 if expert_axis is None else jax.lax.axis_index(expert_axis) * dense[0].shape[0]
        y_TD = expert_ffn(x_TD, ids_TX, weights_TX, *dense, first)
        return jax.lax.psum(y_TD, summed) if summed else y_TD

    rep = PartitionSpec()
    return jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, *specs),
                         out_specs=rep)(x_TD, ids_TX, weights_TX, *arrays)


class MoEDecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)), where ffn is
    an ``MoEBlock`` or, for ``mlp_only_layers``, llama's dense ``MLP``."""

    def __init__(self, cfg: ModelConfig, dtype, rngs, sparse: bool, qfmt=None, adopt=False,
                 lora: LoRAConfig | None = None, **attn):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, qfmt=qfmt, adopt=adopt, lora=lora, **attn)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MoEBlock(cfg, dtype, rngs, qfmt, adopt) if sparse \
            else MLP(cfg, dtype, rngs, qfmt, adopt)


def moe_layer(layer: MoEDecoderLayer, x_DT, k_cache, v_cache, cos_TH2, sin_TH2, window, index,
              *, md: AttentionMetadata, valid_T, num_experts: int):
    """One MoE (or dense, ``mlp_only_layers``) block, ``stack.run_layers``'
    body with the step bound: returns (x_DT, k_cache, v_cache, load_E i32[E]:
    real tokens routed to each expert, zeros for a dense layer)."""
    h_DT, k_cache, v_cache = layer.self_attn(layer.input_layernorm(x_DT), cos_TH2, sin_TH2,
                                             k_cache, v_cache, md, index, window)
    x_DT = x_DT + h_DT
    h_DT = layer.post_attention_layernorm(x_DT)
    if isinstance(layer.mlp, MoEBlock):
        h_DT, load_E = layer.mlp(h_DT, valid_T)
    else:
        h_DT, load_E = layer.mlp(h_DT), jnp.zeros(num_experts, jnp.int32)
    return x_DT + h_DT, k_cache, v_cache, load_E


class MoEForCausalLM(nnx.Module):
    """Mixtral / Qwen3-MoE decoder with an LM head.

    Same interface as ``LlamaForCausalLM`` except that ``__call__`` also
    returns the step's expert load (``has_expert_load`` tells the runner).
    ``lora`` adds adapter slots to the attention's q/k/v/o only (none on the
    experts, nor on the dense MLPs of ``mlp_only_layers``).

    Raises:
      ValueError: ``cfg.num_experts`` is 0 (a dense config).
    """

    has_expert_load = True

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 attention_impl: str = "xla", interpret=False, quantization: str = "none",
                 quantization_group_size: int = 32, lora: LoRAConfig | None = None,
                 quantize_lm_head: bool = True):
        if cfg.num_experts < 1:
            raise ValueError(f"architecture {cfg.architecture!r} needs num_experts >= 1, "
                             f"got {cfg.num_experts}")
        self.cfg = cfg
        V, D = cfg.vocab_size, cfg.hidden_size
        qfmt = quant.method_format(quantization, quantization_group_size)
        adopt = quantization in GGUF_BLOCK_METHODS
        self.embed_tokens = _param((V, D), ("vocab", "embed"), dtype, rngs)
        self.layers = nnx.List([
            MoEDecoderLayer(cfg, dtype, rngs, i not in cfg.mlp_only_layers, qfmt, adopt, lora,
                            attention_impl=attention_impl, interpret=interpret,
                            sliding_window=cfg.layer_window(i))
            for i in range(cfg.num_layers)])
        self.layer_windows = tuple(cfg.layer_window(i) for i in range(cfg.num_layers))
        self.layer_segments = None  # set by stack.stack_layers
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.lm_head = lm_head(cfg, self.embed_tokens, dtype, rngs,
                               qfmt if quantize_lm_head else None, adopt)

    def __call__(self, k_cache, v_cache, md: AttentionMetadata, return_hidden: bool = False):
        """Forward one step (arguments as ``LlamaForCausalLM.__call__``).

        Returns:
          (logits [R, V] f32 for ``md.logits_indices``, k_cache, v_cache
          (stacked), expert_load i32[num_layers, E]: real tokens routed to each
          expert per layer, zeros for dense layers[, x_DT with return_hidden]).
        """
        cfg = self.cfg
        x_DT = self.embed_tokens.value[md.input_ids].T
        valid_T = md.slot_pages < k_cache.pages_PLKH.shape[1]  # padding writes to page P
        body = functools.partial(moe_layer, md=md, valid_T=valid_T, num_experts=cfg.num_experts)
        x_DT, k_cache, v_cache, load_LE = stack.run_layers(
            self, body, x_DT, k_cache, v_cache, layer_rope_tables(cfg, md.positions))
        out = (self.logits_of(x_DT[:, md.logits_indices]), k_cache, v_cache, load_LE)
        return out + (x_DT,) if return_hidden else out

    logits_of = LlamaForCausalLM.logits_of


def hf_params(model: MoEForCausalLM) -> dict[str, tuple[nnx.Param, int | None]]:
    """HF tensor name -> (the ``nnx.Param`` it fills, expert index e or None).

    Names as ``checkpoints.hf_loader.expected_tensors``: llama's (embedding,
    norms, attention with optional biases and q/k norms, lm_head, and
    ``mlp.{gate,up,down}_proj.weight`` of dense layers), plus per MoE layer
    the router and each expert's gate [F, D], up [F, D] and down [D, F] under
    the family's names (``HF_MOE_NAMES``: Mixtral ``block_sparse_moe.gate``,
    ``block_sparse_moe.experts.{e}.w1/w3/w2``; Qwen3-MoE ``mlp.gate``,
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``); expert e's tensor is
    slice e of the stacked ``[E, ...]`` param.

    Raises:
      ValueError: the architecture has no MoE names.
    """
    cfg = model.cfg
    if cfg.architecture not in HF_MOE_NAMES:
        raise ValueError(f"no MoE tensor names for architecture {cfg.architecture!r}; "
                         f"known: {sorted(HF_MOE_NAMES)}")
    out = {"model.embed_tokens.weight": (model.embed_tokens, None),
           "model.norm.weight": (model.norm.weight, None)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, None)
    router_name, *expert_names = HF_MOE_NAMES[cfg.architecture]
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        out |= {n: (p, None) for n, p in attention_hf_params(layer, pre).items()}
        if not isinstance(layer.mlp, MoEBlock):
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[pre + f"mlp.{n}.weight"] = (getattr(layer.mlp, n), None)
            continue
        out[pre + router_name] = (layer.mlp.router, None)
        for p, fmt in zip((layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj),
                          expert_names):
            out |= {pre + fmt.format(e=e): (p, e) for e in range(cfg.num_experts)}
    return out


def load_params(model: MoEForCausalLM, params: dict) -> None:
    """Copy an HF-named dict of arrays (numpy, or ``jax.Array``s already in
    their sharding) into ``model`` in place; names as ``hf_params``, the
    experts' tensors stacked over e here.

    Raises:
      ValueError: a tensor is missing, has the wrong shape, or the
        architecture has no MoE names.
    """
    stacks: dict[int, tuple[nnx.Param, str, list]] = {}
    for name, (p, e) in hf_params(model).items():
        if e is None:
            put_param(p, name, params)
            continue
        if name not in params:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        stacks.setdefault(id(p), (p, name, []))[2].append(params[name])
    for p, name, arrs in stacks.values():
        put_param(p, f"{name} (stacked over experts)", params, _stack(arrs))
    load_tied_head(model, params)


def _stack(arrs):
    """Stack the experts' tensors over a new leading E dim (numpy, jax, or
    ``quant.QuantizedTensor``s part by part)."""
    if isinstance(arrs[0], quant.QuantizedTensor):
        fmts = {a.fmt for a in arrs}
        if len(fmts) > 1:  # gguf: experts of one tensor in different ggml types
            arrs = [quant.QuantizedTensor(quant.DENSE, a.shape, a.dequantize(), None)
                    for a in arrs]
        part = lambda n: None if getattr(arrs[0], n) is None else _stack(  # noqa: E731
            [getattr(a, n) for a in arrs])
        return quant.QuantizedTensor(arrs[0].fmt, (len(arrs), *arrs[0].shape), part("q"),
                                     part("scale"), part("zero"))
    stack = jnp.stack if isinstance(arrs[0], jax.Array) else np.stack
    return stack(arrs)
