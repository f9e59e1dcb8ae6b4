"""Multi-LoRA: adapter slots beside the base projections, applied batched.

Dimension letters as in ``llama.py`` (T tokens, D model dim), plus S adapter
slots (``LoRAConfig.max_loras``), R the padded rank
(``LoRAConfig.max_lora_rank``), I and O a projection's input and output dims.

With ``EngineConfig.lora`` set, every q/k/v/o projection (and gate/up/down of
a dense MLP) gets a ``LoRA`` module beside its base weight, named
``<proj>_lora`` (``self_attn.q_proj_lora``, ``mlp.gate_proj_lora``), holding
two ``LoRAWeight`` parameters::

    a: [S, R, I]    (logical axes None, None, <base in-axis>)
    b: [S, O, R]    (logical axes None, <base out-axis>, None)

zeros at init, in the activation dtype (f32 on CPU) whatever the base's
quantized format. Slot s of the step's tokens (``AttentionMetadata.lora_slots``,
i32[T]) selects ``a[s - 1]`` / ``b[s - 1]``; slot 0 is the base model (no
delta). An adapter of rank r < R fills the first r rows of ``a`` and columns
of ``b`` (the rest stay zero), and its scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA) is folded into ``b`` when it is loaded
(``checkpoints.peft``), so the delta has no scale input::

    y[:, t] = W x[:, t] + b[s_t - 1] @ (a[s_t - 1] @ x[:, t])     (s_t > 0)

Loading or unloading an adapter writes array values into one slot
(``write_slot``): the step programs' shapes never change, so nothing compiles.

Lowering (``lora_delta``): one-hot over the slots as two plain 2-D GEMMs:
shrink every slot at once (``a`` as [S*R, I] @ x), zero each token's rows
of the slots it does not use (the one-hot of ``s_t - 1``), expand with ``b``
as [O, S*R]. It reads each slot's weights once per step, whatever T. A
per-token gather (``a[s_t]``, ``b[s_t]``: [T, R, I], [T, O, R]) copies the
weights T times. Measured (XLA:CPU, jax 0.10.2, "Intel(R) Xeon(R) Processor"
(AVX-512), 2 cores; S=8, R=16, ms per call, min of 7 x 20; ``W @ x`` the
base projection for scale)::

    | T, I -> O          | W @ x | one-hot 2-D | one-hot einsum | gather | shrink all, gather b |
    |--------------------|-------|-------------|----------------|--------|----------------------|
    | 32, 576 -> 1536    | 0.377 | 0.239       | 0.316          | 0.551  | 0.419                |
    | 32, 1536 -> 576    | 0.408 | 0.162       | 0.168          | 0.506  | 0.320                |
    | 512, 576 -> 1536   | 5.819 | 1.954       | 2.224          | 36.56  | 28.32                |
    | 512, 1536 -> 576   | 6.135 | 1.899       | 1.948          | 34.83  | 5.851                |

With the defaults S=4, R=16, one-hot 2-D: 0.077 / 0.071 ms at T=32 (base
0.350 / 0.350), 0.981 / 1.136 ms at T=512 (base 5.494 / 5.736); gather
0.408 / 0.392 and 33.2 / 34.9 ms. The one-hot form wins at both sizes (the
gather is 6-30x slower at T=512); its cost is the work of one rank-S*R LoRA
(20-65% of the base projection here), paid by every token of a step,
slot 0 included, whenever LoRA is on.

Paths: ``lora_paths``, ``slot_values`` and ``write_slot`` key the LoRA
leaves by their NNX state path (a tuple of str / int, as
``nnx.to_flat_state(state)`` gives it), e.g.
``("layers", 0, "self_attn", "q_proj_lora", "a")``. Before
``stack.stack_layers`` the int is the layer index and a leaf is ``[S, ...]``;
after it the int is the run index (``model.layer_segments``) and a leaf is
``[layers_in_run, S, ...]``. Every LoRA leaf is 3-D per layer, so its slot
axis is ``leaf.ndim - 3`` (``slot_axis``): 0 unstacked, 1 stacked.

References: Hu et al. 2021 (LoRA); Kalajdzievski 2023 (rsLoRA); Chen et al.
2023 (Punica: batched multi-LoRA, SGMV); Sheng et al. 2023 (S-LoRA);
HF ``peft`` ``tuners/lora/layer.py`` (the scaling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The projections a LoRA module may sit beside, by the sub-module holding them.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUFFIX = "_lora"  # the LoRA module of ``q_proj`` is ``q_proj_lora``


class LoRAWeight(nnx.Param):
    """An adapter-slot parameter (``LoRA.a`` / ``LoRA.b``): a Param (it is
    part of the state the step programs read, sharded by its logical axis
    names like every weight), of its own type so that ``nnx.state(model,
    LoRAWeight)`` selects the adapter slots alone."""


class LoRA(nnx.Module):
    """The adapter slots of one projection ``W`` [O, I].

    Args:
      in_dim, out_dim: I and O, the base weight's [out, in] dims.
      names: the base weight's logical axis names (out, in), e.g.
        ``("q_heads", "embed")``; ``a``'s input axis and ``b``'s output axis
        take them, so with tp they split like the base weight.
      num_slots: S, ``LoRAConfig.max_loras``.
      rank: R, ``LoRAConfig.max_lora_rank``.
      dtype: the activation dtype.

    Attributes:
      a: ``LoRAWeight`` [S, R, I], zeros.
      b: ``LoRAWeight`` [S, O, R], zeros (scaling folded in).
    """

    def __init__(self, in_dim: int, out_dim: int, names: tuple, num_slots: int, rank: int,
                 dtype):
        out_name, in_name = names
        self.a = LoRAWeight(jnp.zeros((num_slots, rank, in_dim), dtype),
                            sharding_names=(None, None, in_name), eager_sharding=False)
        self.b = LoRAWeight(jnp.zeros((num_slots, out_dim, rank), dtype),
                            sharding_names=(None, out_name, None), eager_sharding=False)


def make(lora_config, in_dim: int, out_dim: int, names: tuple, dtype) -> LoRA | None:
    """The ``LoRA`` module of one projection, or None when ``lora_config``
    (a ``jaxserve.config.LoRAConfig``) is None (LoRA off)."""
    if lora_config is None:
        return None
    return LoRA(in_dim, out_dim, names, lora_config.max_loras, lora_config.max_lora_rank, dtype)


def lora_delta(lora: LoRA, x_IT, slots_T):
    """The adapters' delta of one projection for a ragged batch.

    Args:
      lora: the projection's ``LoRA`` (a [S, R, I], b [S, O, R]).
      x_IT: [I, T] feature-major activations (the projection's input).
      slots_T: i32[T] each token's slot: 0 the base (delta 0), s in
        1..S adapter slot s (row s - 1 of ``a`` and ``b``).

    Returns:
      [O, T] in x's dtype: ``b[s-1] @ (a[s-1] @ x[:, t])`` per token t.
    """
    a_SRI, b_SOR = lora.a.value, lora.b.value
    S, R, I = a_SRI.shape
    O = b_SOR.shape[1]
    h_QT = jnp.einsum("qi,it->qt", a_SRI.reshape(S * R, I), x_IT)  # Q = S*R, every slot
    keep_ST = jax.nn.one_hot(slots_T - 1, S, dtype=h_QT.dtype).T  # slot 0 -> all zeros
    h_QT = (h_QT.reshape(S, R, -1) * keep_ST[:, None, :]).reshape(S * R, -1)
    b_OQ = jnp.transpose(b_SOR, (1, 0, 2)).reshape(O, S * R)
    return jnp.einsum("oq,qt->ot", b_OQ, h_QT).astype(x_IT.dtype)


def with_delta(y_OT, lora: LoRA | None, x_IT, slots_T):
    """``y + lora_delta(lora, x, slots)``, or ``y`` when there is no LoRA
    module (LoRA off) or no slots (``AttentionMetadata.lora_slots`` None).
    A step whose tokens are all the base's (every slot 0) skips the delta
    at run time (``lax.cond``): it reads none of the slots' weights."""
    if lora is None or slots_T is None:
        return y_OT
    return jax.lax.cond(jnp.any(slots_T > 0),
                        lambda: y_OT + lora_delta(lora, x_IT, slots_T), lambda: y_OT)


def slot_axis(leaf) -> int:
    """The slot axis S of a LoRA leaf (an array or shape): 0 for a per-layer
    leaf [S, ...], 1 for a stacked one [layers_in_run, S, ...]."""
    ndim = len(leaf) if isinstance(leaf, tuple) else leaf.ndim
    return ndim - 3


def lora_paths(state) -> list[tuple]:
    """The NNX state paths (tuples of str / int) of every ``LoRAWeight`` of
    a model's state (``nnx.split(model)[1]`` or ``nnx.state(model)``), in
    state order."""
    return [path for path, v in nnx.to_flat_state(state) if isinstance(v, LoRAWeight)]


def lora_leaves(state) -> dict[tuple, jax.Array]:
    """path -> array of every ``LoRAWeight`` of ``state`` (``lora_paths``)."""
    return {path: v.value for path, v in nnx.to_flat_state(state) if isinstance(v, LoRAWeight)}


def set_lora_leaves(state, leaves: dict) -> None:
    """Put ``leaves`` (path -> array, e.g. ``write_slot``'s result) back
    into ``state``'s ``LoRAWeight`` variables, in place.

    Raises:
      KeyError: a path that is not a LoRA leaf of ``state``.
    """
    variables = {path: v for path, v in nnx.to_flat_state(state) if isinstance(v, LoRAWeight)}
    for path, value in leaves.items():
        variables[path].value = value


def write_slot(leaves: dict, slot, values: dict) -> dict:
    """Write one adapter into slot ``slot`` of every LoRA leaf (pure jnp).

    Args:
      leaves: path -> LoRA leaf ([S, ...] or stacked [n, S, ...]).
      slot: the slot, 1..S (an int or a traced i32 scalar: one compiled
        program serves every slot).
      values: path -> that slot's values: the leaf's shape without its slot
        axis (``slot_values``); every path of ``leaves`` must be present.

    Returns:
      path -> the new leaf (under ``jit`` with ``leaves`` donated, updated
      in place).
    """
    out = {}
    for path, leaf in leaves.items():
        k = slot_axis(leaf)
        value = jnp.asarray(values[path], leaf.dtype)
        out[path] = leaf.at[(slice(None),) * k + (slot - 1,)].set(value)
    return out


def _modules(layer) -> list[tuple[str, str]]:
    """(sub-module, projection) of each LoRA module of one decoder layer
    (``("self_attn", "q_proj")``, ...), in a fixed order."""
    out = []
    for sub, names in (("self_attn", ATTENTION_TARGETS), ("mlp", MLP_TARGETS)):
        mod = getattr(layer, sub, None)
        for n in names:
            if getattr(mod, n + SUFFIX, None) is not None:
                out.append((sub, n))
    return out


def slot_values(model, adapter=None) -> dict[tuple, np.ndarray]:
    """One slot's values of every LoRA leaf of ``model`` for ``adapter``.

    Args:
      model: a family model built with ``lora=LoRAConfig(...)``, stacked
        (``stack.stack_layers``: layer i lives in run j of
        ``model.layer_segments``, row i - start) or not.
      adapter: a ``checkpoints.peft.PeftAdapter`` (its ``tensors``: the
        base weight's HF name -> (A f32 [r, I], B f32 [O, r], scaling folded
        into B)), checked against the model (``checkpoints.peft.check_adapter``);
        None: an empty slot (all zeros, to unload).

    Returns:
      path (as ``lora_paths``) -> f32 array of the leaf's shape without its
      slot axis: ``a`` [R, I] / ``b`` [O, R] (stacked: [n, R, I] / [n, O, R]),
      the adapter's rank zero-padded to R, zeros where it has no tensor. Every
      LoRA leaf has a value, so writing them overwrites the whole slot.

    Raises:
      ValueError: the model has no LoRA modules, or the adapter names a
        tensor no LoRA module of the model holds.
    """
    segments = model.layer_segments or tuple((i, i + 1) for i in range(len(model.layers)))
    stacked = model.layer_segments is not None
    tensors = {} if adapter is None else adapter.tensors
    out, used = {}, set()
    for j, ((start, stop), layer) in enumerate(zip(segments, model.layers)):
        for sub, proj in _modules(layer):
            mod = getattr(getattr(layer, sub), proj + SUFFIX)
            a_shape = mod.a.value.shape[slot_axis(mod.a.value) + 1:]  # [R, I]
            b_shape = mod.b.value.shape[slot_axis(mod.b.value) + 1:]  # [O, R]
            a = np.zeros((stop - start, *a_shape), np.float32)
            b = np.zeros((stop - start, *b_shape), np.float32)
            for i in range(start, stop):
                name = f"model.layers.{i}.{sub}.{proj}.weight"
                if name in tensors:
                    A, B = tensors[name]
                    r = A.shape[0]
                    a[i - start, :r] = A
                    b[i - start, :, :r] = B
                    used.add(name)
            pre = ("layers", j, sub, proj + SUFFIX)
            out[pre + ("a",)] = a if stacked else a[0]
            out[pre + ("b",)] = b if stacked else b[0]
    if not out:
        raise ValueError("slot_values: the model has no LoRA modules (built without lora=)")
    missed = sorted(set(tensors) - used)
    if missed:
        raise ValueError(f"{adapter.path}: the model has no LoRA module for {missed[:4]}")
    return out
