"""One decoder layer body, scanned: stacking a model's layers and running them.

A model is built and loaded as a list of per-layer modules (``model.layers``,
what the checkpoint formats name: ``model.layers.{i}.*``). Before it serves,
``stack_layers`` turns each run of consecutive layers of identical structure
(the same NNX graph: parameter shapes, dtypes, quantized formats, static
attributes) into ONE layer module whose parameters carry a leading layer
axis, ``[n, ...]``; ``run_layers`` then runs each run as a ``jax.lax.scan``
over that axis. XLA compiles the layer body once per run instead of once per
layer, so a step program's size and compile time do not grow with depth
(MaxText's ``scan_layers``; jax-llm-examples' scanned decoders).

Most models are one run: every Llama/Mistral/Qwen/Gemma 3 layer has the same
structure. Runs split where layers really differ: an MoE model's dense
``mlp_only_layers``, a GGUF whose tensors mix kept block formats across
layers (``--quantization gguf``), and, with the Pallas kernels, layers of
another sliding window (the kernels take the window as a compile-time
constant). With the XLA attention a layer's window is a scanned input, so
Gemma 3's five local and one global layers share one body; so is the index of
its RoPE table (local and global layers use different bases).

The KV cache is one stacked buffer per K and V: ``KVPages`` with pages
``[layers, P, L, K, H]`` (and f32 ``[layers, P, L, K]`` scales when
quantized). It travels through the scan as part of the carry, and each layer
reads and writes its own slice by page offset: the attention sees the
buffer as ``[layers * P, L, K, H]`` (a free reshape, done once per step)
with this layer's page ids shifted by ``layer * P`` (``layer_pages``). So the cache is updated in
place inside the loop (a scatter into the carried, donated buffer); no
layer's pages are sliced out or copied.

``stack_layers`` moves the weights leaf by leaf: each stacked leaf is built
from the layers' arrays and those arrays are dropped at once, so at most one
leaf's worth of weights exists twice (no second copy of the model).

The unrolled form (``EngineConfig.scan_layers=False``) keeps the per-layer
modules and calls the same layer body in a Python loop over the same stacked
KV buffer; it is there to compare against, and for debugging.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import quant
from pallas_kernels.ragged_paged_attention.quant import KVPages

# A window no position reaches: a scanned layer without a sliding window.
NO_WINDOW = 1 << 30


def _signature(layer: nnx.Module):
    """What must be equal for two layers to share one compiled body: the
    module graph (static attributes included) and every leaf's shape and dtype."""
    graphdef, state = nnx.split(layer)
    return graphdef, tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(state))


def _variables(layer: nnx.Module) -> dict:
    """path -> the ``nnx.Variable`` objects of a module (the module's own)."""
    return {path: node for path, node in nnx.iter_graph(layer)
            if isinstance(node, nnx.Variable)}


def stack_layers(model: nnx.Module, dynamic_window: bool) -> tuple[tuple[int, int], ...]:
    """Stack ``model.layers`` in place into runs of identical layers.

    Args:
      model: a family model (``LlamaForCausalLM``, ``MoEForCausalLM``,
        ``Gemma3ForCausalLM``) whose ``layers`` is the loaded per-layer list.
      dynamic_window: the attention takes the sliding window as a traced
        value (the XLA path), so layers differing only by their window share
        a run; False for the Pallas kernels.

    Returns:
      The runs, ``((start, stop), ...)`` half-open layer ranges in order
      (also ``model.layer_segments``).

    Raises:
      ValueError: the model is already stacked.
    """
    if model.layer_segments is not None:
        raise ValueError("stack_layers: the model's layers are already stacked")
    layers = list(model.layers)
    if dynamic_window:  # the window then comes from model.layer_windows, per layer
        for layer in layers:
            layer.self_attn.sliding_window = None
    sigs = [_signature(layer) for layer in layers]
    segments, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or sigs[i] != sigs[start]:
            segments.append((start, i))
            start = i
    stacked = []
    for a, b in segments:
        template = layers[a]
        per_layer = [_variables(layer) for layer in layers[a:b]]
        for path, var in per_layer[0].items():
            sources = [vs[path] for vs in per_layer]
            value = jnp.stack([v.value for v in sources])
            for v in sources[1:]:  # drop each layer's copy as soon as it is stacked
                v.value = jnp.zeros((), v.value.dtype)
            var.value = value
            names = var.get_metadata().get("out_sharding")
            if names is not None:  # the leading layer axis is never split
                var.set_metadata("out_sharding", (None,) + tuple(names))
        stacked.append(template)
    model.layers = nnx.List(stacked)
    model.layer_segments = tuple(segments)
    return model.layer_segments


def flat_kv(cache: KVPages) -> KVPages:
    """A stacked cache [layers, P, ...] as [layers * P, ...] (a free reshape)."""
    pages = cache.pages_PLKH.reshape(-1, *cache.pages_PLKH.shape[2:])
    scales = None if cache.scales_PLK is None else \
        cache.scales_PLK.reshape(-1, *cache.scales_PLK.shape[2:])
    return KVPages(pages, scales)


def unflat_kv(flat: KVPages, like: KVPages) -> KVPages:
    """``flat`` [layers * P, ...] back in ``like``'s [layers, P, ...] shape."""
    scales = None if flat.scales_PLK is None else flat.scales_PLK.reshape(like.scales_PLK.shape)
    return KVPages(flat.pages_PLKH.reshape(like.pages_PLKH.shape), scales)


def layer_pages(md, layer, num_pages: int, num_layers: int):
    """The step's write slots and page table shifted to layer ``layer``'s
    pages of a flat [layers * P, ...] cache: (slot_pages_T, page_indices_SP).
    Padding slots (page P) stay out of range, so their writes are dropped.
    ``layer`` is a Python int, or an i32 scalar inside a scan."""
    offset = layer * num_pages
    slot_pages_T = jnp.where(md.slot_pages < num_pages, md.slot_pages + offset,
                             num_layers * num_pages)
    return slot_pages_T, md.page_indices + offset


def run_layers(model: nnx.Module, body, x_DT, k_cache: KVPages, v_cache: KVPages, ropes):
    """Run every decoder layer of ``model`` over ``x_DT``.

    ``body(layer, x_DT, k_cache, v_cache, cos_TH2, sin_TH2, window, index)
    -> (x_DT, k_cache, v_cache, aux)`` is the family's layer (its caches are
    the flat [layers * P, ...] ``KVPages``: ``flat_kv``): ``layer`` a
    per-layer module (inside a scan: merged from one slice of the stacked
    parameters), ``window`` the layer's sliding window (None, a Python int,
    or an i32 scalar with ``NO_WINDOW`` for none), ``index`` the layer index
    (int or i32 scalar) and ``aux`` a per-layer array (an MoE layer's expert
    load) or None. ``ropes`` is ``rope.layer_rope_tables``' (tables, index
    of each layer's table): the distinct RoPE (cos, sin) [T, H/2] tables.

    Returns:
      (x_DT, k_cache, v_cache, aux): ``aux`` stacked over layers in order
      ([num_layers, ...]) or None.
    """
    tables, rope_index = ropes
    windows = model.layer_windows
    auxes = []
    # The carry holds the flat [layers * P, ...] caches: one shape for every
    # write and read inside the loop, so XLA updates the one buffer in place
    # (a reshape per layer made it keep two versions, and copy).
    k_stacked, v_stacked = k_cache, v_cache
    k_cache, v_cache = flat_kv(k_cache), flat_kv(v_cache)
    if model.layer_segments is None:  # unrolled: one call per layer
        for i, layer in enumerate(model.layers):
            x_DT, k_cache, v_cache, aux = body(layer, x_DT, k_cache, v_cache,
                                               *tables[rope_index[i]], windows[i], i)
            auxes.append(None if aux is None else aux[None])
    else:
        for (a, b), layer in zip(model.layer_segments, model.layers):
            # Projections stay whole (read in place at the layer's offset:
            # quant.StackedRead); every other leaf is sliced by the scan.
            graphdef, resident, state = nnx.split(layer, quant.is_stacked_read, ...)
            seg_windows = windows[a:b]
            seg_ropes = rope_index[a:b]
            xs = {"state": state, "index": jnp.arange(a, b, dtype=jnp.int32),
                  "offset": jnp.arange(b - a, dtype=jnp.int32)}
            if len(set(seg_windows)) > 1:
                xs["window"] = jnp.asarray([NO_WINDOW if w is None else w for w in seg_windows],
                                           jnp.int32)
            if len(set(seg_ropes)) > 1:
                xs["rope"] = jnp.asarray(seg_ropes, jnp.int32)
                cos_RTH = jnp.stack([c for c, _ in tables])
                sin_RTH = jnp.stack([s for _, s in tables])

            def step(carry, xs, graphdef=graphdef, resident=resident, window=seg_windows[0],
                     rope=seg_ropes[0]):
                x_DT, k_cache, v_cache = carry
                reads = jax.tree.map(lambda w: quant.StackedRead(w, xs["offset"]), resident)
                layer = nnx.merge(graphdef, reads, xs["state"])
                cos, sin = ((cos_RTH[xs["rope"]], sin_RTH[xs["rope"]]) if "rope" in xs
                            else tables[rope])
                x_DT, k_cache, v_cache, aux = body(layer, x_DT, k_cache, v_cache, cos, sin,
                                                   xs.get("window", window), xs["index"])
                return (x_DT, k_cache, v_cache), aux

            (x_DT, k_cache, v_cache), aux = jax.lax.scan(step, (x_DT, k_cache, v_cache), xs)
            auxes.append(aux)
    aux = None if auxes[0] is None else jnp.concatenate(auxes)
    return x_DT, unflat_kv(k_cache, k_stacked), unflat_kv(v_cache, v_stacked), aux
