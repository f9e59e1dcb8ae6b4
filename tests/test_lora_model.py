"""Multi-LoRA, the model and checkpoint half (``jaxserve.models.lora``,
``checkpoints.peft``), run on the models directly (no engine).

Torch-free (fast tier): adapters written here in PEFT's file format with
numpy (``write_adapter``), then

* the batched delta equals a per-token loop; ``write_slot`` writes one slot;
* a model built with ``lora=`` on slot 0 gives exactly the logits of the
  model without LoRA; with an adapter in a slot, the logits of the same model
  with the adapter merged into its weights (``W + scaling * B A``, scaling
  computed here: ``alpha / r``, rsLoRA ``alpha / sqrt(r)``, ``rank_pattern`` /
  ``alpha_pattern``), stacked (scanned) and unrolled, for Llama and the MoE
  family (attention targets);
* a decode-only step applies each row's slot as the prefill does;
* writing a slot (the slot a traced scalar) and running after it compile
  nothing new; unloading zeroes the slot;
* on a tp=2 mesh the slots split along their base projection's axis and
  give the one-device logits;
* an int8 base with an f32 adapter stays within a measured bound of the f32
  base with the same adapter;
* each unsupported adapter is a ValueError naming the file and the field.

HF reference (slow: torch, transformers, peft): tiny random Llama, Qwen3 and
Gemma 3 HF models, random adapters made by ``peft`` (``init_lora_weights=False``
so B is not zero; one plain on all 7 targets, one with rsLoRA and a
``rank_pattern``) saved with ``save_pretrained`` and read by
``checkpoints.peft.load_adapter``: our logits at every position equal peft's
(unmerged and ``merge_and_unload``) within 1e-4 in f32, and one batch of three
sequences on slots 0, 1, 2 gives each its own model's logits.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from tiny_models import tiny_config, tiny_llama_params

from checkpoints.peft import check_adapter, load_adapter
from jaxserve.config import EngineConfig, LoRAConfig, ModelConfig
from jaxserve.models import MODEL_CLASSES, family, lora, stack
from jaxserve.models.llama import AttentionMetadata
from pallas_kernels.ragged_paged_attention.quant import KVPages

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PAGE = 8
PAGES_PER_ROW = 16  # the XLA attention's page block


SEQ_PAGES = 4  # pages of each sequence of a step: sequence k has pages 4k .. 4k + 3


def prefill_md(prompts, slots=None, decode=False) -> AttentionMetadata:
    """Metadata of one step over ``prompts`` (lists of ids), sequence k on
    pages ``SEQ_PAGES * k ..``, logits at every token; ``slots``: each
    sequence's LoRA slot (None: LoRA off). ``decode``: a decode-only step of
    each prompt's last token, its earlier tokens already in the cache
    (prefilled by ``prefill_md([p[:-1] ...])``); else all tokens from position 0."""
    ids, pos, pages, offs, kv_lens, table, cu = [], [], [], [], [], [], [0]
    for k, p in enumerate(prompts):
        row = list(range(SEQ_PAGES * k, SEQ_PAGES * (k + 1)))
        assert len(p) <= SEQ_PAGES * PAGE
        span = range(len(p) - 1, len(p)) if decode else range(len(p))
        ids += [p[t] for t in span]
        pos += list(span)
        pages += [row[t // PAGE] for t in span]
        offs += [t % PAGE for t in span]
        kv_lens.append(len(p))
        table.append(row + [0] * (PAGES_PER_ROW - len(row)))
        cu.append(cu[-1] + len(span))
    T = len(ids)
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    lora_slots = None if slots is None else i32(
        [s for n, s in zip(np.diff(cu), slots) for _ in range(n)])
    return AttentionMetadata(i32(ids), i32(pos), i32(pages), i32(offs), i32(kv_lens), i32(table),
                             i32(cu), i32([len(prompts)]), i32(range(T)),
                             i32([len(prompts) if decode else 0]), decode,
                             lora_slots=lora_slots)


def run(model, md, cache=None, return_cache=False):
    """Logits f32 [T, V] of every token of ``md``: one jitted step on
    ``cache`` (k, v ``KVPages``; None: a fresh one), and the updated cache
    with ``return_cache``."""
    cfg = model.cfg
    if cache is None:
        shape = (cfg.num_layers, 16, PAGE, cfg.num_kv_heads, cfg.head_dim)
        cache = KVPages(jnp.zeros(shape)), KVPages(jnp.zeros(shape))
    graphdef, state = nnx.split(model)
    if graphdef not in _STEPS:  # one jit per model structure: its programs are reused
        _STEPS[graphdef] = jax.jit(lambda state, k, v, md: nnx.merge(graphdef, state)(k, v, md))
    logits, k, v = _STEPS[graphdef](state, *cache, md)[:3]
    return (np.asarray(logits), (k, v)) if return_cache else np.asarray(logits)


_STEPS: dict = {}


def build(cfg: ModelConfig, params, lora_config=None, scan=True, **kw):
    """Our model of ``cfg`` holding ``params`` (HF names), stacked as the runner does."""
    model = MODEL_CLASSES[cfg.architecture](cfg, lora=lora_config, **kw)
    family(model).load_params(model, params)
    if scan:
        stack.stack_layers(model, dynamic_window=True)
    return model


def put_adapter(model, slot: int, adapter) -> None:
    """Write ``adapter`` into ``slot`` of ``model`` in place, as the engine
    will: one jitted ``write_slot`` over the LoRA leaves, slot traced, leaves donated."""
    _, state = nnx.split(model)
    leaves = lora.lora_leaves(state)
    write = jax.jit(lora.write_slot, donate_argnums=0)
    new = write(leaves, jnp.int32(slot), lora.slot_values(model, adapter))
    lora.set_lora_leaves(state, new)
    nnx.update(model, state)


def write_adapter(folder, cfg: ModelConfig, rng, r=8, alpha=16.0, targets=TARGETS,
                  layers=None, config=None, tensors=None, key_fmt=None, dtype=np.float32):
    """A PEFT LoRA adapter folder for ``cfg`` written with numpy, as peft's
    ``save_pretrained`` writes it; returns (folder, HF name -> (A, B) unscaled).
    ``config`` / ``tensors`` add or override fields and tensors; ranks follow
    ``config["rank_pattern"]`` (suffix keys)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F = cfg.intermediate_size
    dims = {"q_proj": (N * H, D), "k_proj": (K * H, D), "v_proj": (K * H, D),
            "o_proj": (D, N * H), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}
    conf = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=list(targets),
                bias="none", use_dora=False, use_rslora=False, modules_to_save=None,
                rank_pattern={}, alpha_pattern={}, task_type="CAUSAL_LM")
    conf.update(config or {})
    out, raw = {}, {}
    for i in (range(cfg.num_layers) if layers is None else layers):
        for t in targets:
            sub = "self_attn" if t in TARGETS[:4] else "mlp"
            module = f"model.layers.{i}.{sub}.{t}"
            rank = next((v for k, v in conf["rank_pattern"].items() if module.endswith(k)), r)
            o, d = dims[t]
            a = (rng.standard_normal((rank, d)) / math.sqrt(d)).astype(np.float32)
            b = (0.3 * rng.standard_normal((o, rank))).astype(np.float32)
            key = (key_fmt or "base_model.model.{module}.lora_{ab}.weight")
            raw[module + ".weight"] = (a, b)
            out[key.format(module=module, ab="A")] = a.astype(dtype)
            out[key.format(module=module, ab="B")] = b.astype(dtype)
    out.update(tensors or {})
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    save_file(out, str(folder / "adapter_model.safetensors"))
    return folder, raw


def merged_params(params, raw, scalings):
    """``params`` with each adapted weight replaced by ``W + scaling * B A``."""
    out = dict(params)
    for name, (a, b) in raw.items():
        out[name] = params[name] + scalings[name] * (b @ a)
    return out


# ---------------------------------------------------------------- torch-free tests


def test_lora_config_validates():
    assert EngineConfig().lora is None
    assert LoRAConfig() == LoRAConfig(max_loras=4, max_lora_rank=16)
    for kw, field in [(dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
                      (dict(max_lora_rank=513), "max_lora_rank")]:
        with pytest.raises(ValueError, match=field):
            LoRAConfig(**kw)


def test_lora_delta_equals_a_per_token_loop():
    rng = np.random.default_rng(0)
    S, R, I, O, T = 3, 4, 12, 10, 9
    m = lora.LoRA(I, O, ("mlp", "embed"), S, R, jnp.float32)
    m.a.value = jnp.asarray(rng.standard_normal((S, R, I)), jnp.float32)
    m.b.value = jnp.asarray(rng.standard_normal((S, O, R)), jnp.float32)
    x = rng.standard_normal((I, T)).astype(np.float32)
    slots = np.array([0, 1, 2, 3, 3, 0, 2, 1, 1], np.int32)
    got = np.asarray(jax.jit(lora.lora_delta)(m, jnp.asarray(x), jnp.asarray(slots)))
    a, b = np.asarray(m.a.value), np.asarray(m.b.value)
    want = np.stack([np.zeros(O) if s == 0 else b[s - 1] @ (a[s - 1] @ x[:, t])
                     for t, s in enumerate(slots)], axis=1)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not got[:, slots == 0].any()  # the base rows get exactly nothing


def test_leaves_paths_and_slot_axis():
    cfg = tiny_config(num_layers=2)
    params = tiny_llama_params(cfg)
    lc = LoRAConfig(max_loras=3, max_lora_rank=8)
    plain = build(cfg, params)
    assert not lora.lora_paths(nnx.state(plain))  # LoRA off: no adapter parameters
    assert not any("_lora" in str(p) for p, _ in nnx.to_flat_state(nnx.state(plain)))
    for scan, lead in ((False, ()), (True, (2,))):
        model = build(cfg, params, lc, scan=scan)
        leaves = lora.lora_leaves(nnx.state(model))
        paths = lora.lora_paths(nnx.state(model))
        assert list(leaves) == paths and len(paths) == 7 * 2 * (1 if scan else 2)
        a = leaves[("layers", 0, "self_attn", "q_proj_lora", "a")]
        b = leaves[("layers", 0, "mlp", "down_proj_lora", "b")]
        assert a.shape == lead + (3, 8, 64) and b.shape == lead + (3, 64, 8)
        assert lora.slot_axis(a) == len(lead)
        # The logical axes follow the base weight (slot and rank axes unsplit).
        var = nnx.state(model, lora.LoRAWeight)["layers"][0]["self_attn"]["q_proj_lora"]["a"]
        assert tuple(var.get_metadata()["out_sharding"]) == (None,) * (1 + len(lead)) + (
            None, "embed")
        var = nnx.state(model, lora.LoRAWeight)["layers"][0]["self_attn"]["o_proj_lora"]["b"]
        assert tuple(var.get_metadata()["out_sharding"])[-2:] == ("embed", None)
        values = {p: np.full(leaf.shape[:len(lead)] + leaf.shape[len(lead) + 1:], 1.0 + i)
                  for i, (p, leaf) in enumerate(leaves.items())}
        write = jax.jit(lora.write_slot)
        write(leaves, jnp.int32(1), values)
        programs = write._cache_size()
        new = write(leaves, jnp.int32(2), values)
        assert write._cache_size() == programs  # the slot is traced: one program, every slot
        for i, (p, leaf) in enumerate(new.items()):
            arr = np.moveaxis(np.asarray(leaf), len(lead), 0)
            assert (arr[1] == 1.0 + i).all() and not arr[0].any() and not arr[2].any()


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(num_layers=2)
    return cfg, tiny_llama_params(cfg, seed=3)


PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31, 4, 4, 60], list(range(10, 30)), [42] * 9]


def test_slot_zero_is_the_base_model(tiny, tmp_path):
    """Without slots the LoRA model is the base model bit for bit; on slot 0
    (its delta exactly zero) XLA fuses the program differently, so the
    logits differ by float rounding only (measured 3.2e-6), adapters loaded
    in other slots or not."""
    cfg, params = tiny
    base = run(build(cfg, params), prefill_md(PROMPTS))
    model = build(cfg, params, LoRAConfig(max_loras=2, max_lora_rank=8))
    np.testing.assert_array_equal(run(model, prefill_md(PROMPTS)), base)  # slots None
    np.testing.assert_allclose(run(model, prefill_md(PROMPTS, [0, 0, 0])), base, atol=1e-5,
                               rtol=0)
    step = _STEPS[nnx.split(model)[0]]
    programs = step._cache_size()
    put_adapter(model, 1, load_adapter(str(write_adapter(tmp_path / "a", cfg,
                                                         np.random.default_rng(0))[0])))
    np.testing.assert_allclose(run(model, prefill_md(PROMPTS, [0, 0, 0])), base, atol=1e-5,
                               rtol=0)
    assert step._cache_size() == programs  # a loaded adapter is values: nothing compiles
    put_adapter(model, 1, None)  # unload: the slot back to zeros
    assert not any(np.asarray(x).any() for x in lora.lora_leaves(nnx.state(model)).values())


@pytest.mark.parametrize("scan", [True, False])
def test_adapters_equal_merged_weights(tiny, tmp_path, scan):
    """Two adapters in slots 2 and 1 (one plain, one rsLoRA with rank and alpha
    patterns, not every layer or target) of a batch with a base row: each
    row's logits are those of our model without LoRA on merged weights."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    plain, raw_p = write_adapter(tmp_path / "plain", cfg, rng, r=8, alpha=16.0)
    conf = dict(use_rslora=True, rank_pattern={"self_attn.q_proj": 4, "down_proj": 2},
                alpha_pattern={"o_proj": 3.0})
    fancy, raw_f = write_adapter(tmp_path / "fancy", cfg, rng, r=6, alpha=5.0, layers=[1],
                                 targets=("q_proj", "v_proj", "o_proj", "down_proj"), config=conf)
    ad_p, ad_f = load_adapter(str(plain)), load_adapter(str(fancy))
    assert (ad_p.rank, ad_f.rank, ad_f.target_modules) == (
        8, 6, ("down_proj", "o_proj", "q_proj", "v_proj"))
    lc = LoRAConfig(max_loras=2, max_lora_rank=8)
    for ad in (ad_p, ad_f):
        check_adapter(ad, cfg, lc)
    scale_p = {n: 16.0 / 8 for n in raw_p}
    scale_f = {n: {"q_proj": 5.0 / math.sqrt(4), "down_proj": 5.0 / math.sqrt(2),
                   "o_proj": 3.0 / math.sqrt(6)}.get(n.split(".")[-2], 5.0 / math.sqrt(6))
               for n in raw_f}
    model = build(cfg, params, lc, scan=scan)
    put_adapter(model, 2, ad_p)
    put_adapter(model, 1, ad_f)
    ours = run(model, prefill_md(PROMPTS, [2, 1, 0]))
    want = [run(build(cfg, p), prefill_md([q]))
            for p, q in ((merged_params(params, raw_p, scale_p), PROMPTS[0]),
                         (merged_params(params, raw_f, scale_f), PROMPTS[1]),
                         (params, PROMPTS[2]))]
    start = 0
    for w in want:
        np.testing.assert_allclose(ours[start:start + len(w)], w, atol=2e-5, rtol=0)
        start += len(w)
    assert np.abs(want[0] - run(build(cfg, params), prefill_md(PROMPTS[:1]))).max() > 0.1


def test_decode_step_uses_the_slots(tiny, tmp_path):
    """A decode-only step (``md.decode_only``, one token per row) on slots 2
    and 1 after a prefill of the prompts but their last token gives the
    last-token logits of a whole-prompt prefill on the same slots."""
    cfg, params = tiny
    rng = np.random.default_rng(6)
    model = build(cfg, params, LoRAConfig(max_loras=2, max_lora_rank=8))
    for slot in (1, 2):
        folder, _ = write_adapter(tmp_path / str(slot), cfg, rng, r=4 * slot)
        put_adapter(model, slot, load_adapter(str(folder)))
    slots = [2, 1, 0]
    whole = run(model, prefill_md(PROMPTS, slots))
    last = np.cumsum([len(p) for p in PROMPTS]) - 1
    _, cache = run(model, prefill_md([p[:-1] for p in PROMPTS], slots), return_cache=True)
    decoded = run(model, prefill_md(PROMPTS, slots, decode=True), cache)
    np.testing.assert_allclose(decoded, whole[last], atol=2e-5, rtol=0)


def test_moe_attention_adapter_equals_merged(tmp_path):
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=128, hidden_size=32,
                      intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True, qk_norm=True, tie_word_embeddings=False)
    model0 = MODEL_CLASSES["qwen3_moe"](cfg, rngs=nnx.Rngs(0))
    params = {n: np.asarray(p.value)[e] if e is not None else np.asarray(p.value)
              for n, (p, e) in family(model0).hf_params(model0).items()}
    rng = np.random.default_rng(2)
    folder, raw = write_adapter(tmp_path / "a", cfg, rng, r=4, alpha=8.0, targets=TARGETS[:4])
    ad = load_adapter(str(folder))
    lc = LoRAConfig(max_loras=2, max_lora_rank=4)
    check_adapter(ad, cfg, lc)
    model = build(cfg, params, lc)
    put_adapter(model, 1, ad)
    ours = run(model, prefill_md(PROMPTS[:1], [1]))
    want = run(build(cfg, merged_params(params, raw, {n: 2.0 for n in raw})),
               prefill_md(PROMPTS[:1]))
    np.testing.assert_allclose(ours, want, atol=2e-5, rtol=0)
    mlp, _ = write_adapter(tmp_path / "mlp", cfg, rng, r=4, targets=("q_proj", "up_proj"))
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors.*mlp\.up_proj.*attention"):
        check_adapter(load_adapter(str(mlp)), cfg, lc)


def test_int8_base_with_adapter(tiny, tmp_path):
    """The adapter stays f32 over an int8 base; with it the logits move from
    the f32 base + adapter's by the int8 rounding of the base alone (as much
    as the base rows do: measured 0.114 with and 0.132 without the adapter on
    this chaotic tiny model; bound 0.2), and the adapter still acts."""
    cfg, params = tiny
    folder, _ = write_adapter(tmp_path / "a", cfg, np.random.default_rng(4))
    ad = load_adapter(str(folder))
    lc = LoRAConfig(max_loras=2, max_lora_rank=8)
    out = {}
    for q in ("none", "int8"):
        model = build(cfg, params, lc, quantization=q)
        put_adapter(model, 2, ad)
        leaf = lora.lora_leaves(nnx.state(model))[("layers", 0, "self_attn", "q_proj_lora", "a")]
        assert leaf.dtype == jnp.float32
        out[q] = run(model, prefill_md(PROMPTS[:2], [2, 0]))
    n = len(PROMPTS[0])
    diff = float(np.abs(out["int8"][:n] - out["none"][:n]).max())
    base_diff = float(np.abs(out["int8"][n:] - out["none"][n:]).max())
    print(f"int8 vs f32 base, max |logit diff|: {diff:.4f} with the adapter, "
          f"{base_diff:.4f} without")
    assert diff < 0.2 and base_diff < 0.2
    plain_int8 = run(build(cfg, params, quantization="int8"), prefill_md(PROMPTS[:1]))
    assert np.abs(out["int8"][:n] - plain_int8).max() > 1.0


@pytest.mark.parametrize("what, kw, pattern", [
    ("dora", dict(config=dict(use_dora=True)), r"adapter_config\.json: use_dora"),
    ("lm_head", dict(config=dict(target_modules=["q_proj", "lm_head"])),
     r"adapter_config\.json: target_modules: 'lm_head'"),
    ("unknown", dict(config=dict(target_modules=["q_proj", "qkv_proj"])),
     r"adapter_config\.json: target_modules: unknown target 'qkv_proj'"),
    ("modules_to_save", dict(config=dict(modules_to_save=["lm_head"])),
     r"adapter_config\.json: modules_to_save"),
    ("bias", dict(config=dict(bias="lora_only")), r"adapter_config\.json: bias"),
    ("lm_head_tensor", dict(config=dict(target_modules="q_proj|lm_head"), tensors={
        "base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32)}),
     r"adapter_model\.safetensors: tensor 'base_model\.model\.lm_head\.lora_A\.weight': "
     r"lm_head targets"),
    ("embedding", dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A":
                                np.zeros((8, 256), np.float32)}),
     r"adapter_model\.safetensors: tensor .*embed_tokens.*: embedding targets"),
])
def test_unsupported_adapters_name_file_and_field(tiny, tmp_path, what, kw, pattern):
    cfg, _ = tiny
    folder, _ = write_adapter(tmp_path / what, cfg, np.random.default_rng(0), **kw)
    with pytest.raises(ValueError, match=pattern):
        load_adapter(str(folder))


def test_adapter_that_does_not_fit(tiny, tmp_path):
    cfg, _ = tiny
    rng = np.random.default_rng(0)
    big, _ = write_adapter(tmp_path / "big", cfg, rng, r=16)
    with pytest.raises(ValueError, match=r"adapter_config\.json: r .*rank 16 > max_lora_rank 8"):
        check_adapter(load_adapter(str(big)), cfg, LoRAConfig(max_loras=2, max_lora_rank=8))
    other, _ = write_adapter(tmp_path / "other", tiny_config(hidden_size=32, head_dim=8), rng)
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: model\.layers\.\d\.\w+"
                                         r"\.\w+\.weight: lora_A \[8, (32|160)\] / lora_B "
                                         r"\[\d+, 8\] do not fit the base weight"):
        check_adapter(load_adapter(str(other)), cfg, LoRAConfig(max_lora_rank=8))
    deep, _ = write_adapter(tmp_path / "deep", tiny_config(num_layers=4), rng)
    with pytest.raises(ValueError, match=r"layer 2, the model has 2 layers"):
        check_adapter(load_adapter(str(deep)), cfg, LoRAConfig(max_lora_rank=8))


def test_bf16_and_named_adapter_keys(tiny, tmp_path):
    """bf16 tensors, and keys with the adapter name (``lora_A.default.weight``)."""
    import ml_dtypes
    cfg, _ = tiny
    folder, raw = write_adapter(tmp_path / "a", cfg, np.random.default_rng(0),
                                dtype=ml_dtypes.bfloat16,
                                key_fmt="base_model.model.{module}.lora_{ab}.default.weight")
    ad = load_adapter(str(folder))
    a, b = ad.tensors["model.layers.1.mlp.up_proj.weight"]
    ra, rb = raw["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_allclose(a, ra, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(b, 2.0 * rb, rtol=1e-2, atol=1e-2)
    # Gemma 3 inside Gemma3ForConditionalGeneration: model.language_model.layers.*
    from safetensors.numpy import load_file
    path = str(folder / "adapter_model.safetensors")
    save_file({k.replace("model.model.layers", "model.model.language_model.layers"): v
               for k, v in load_file(path).items()}, path)
    np.testing.assert_array_equal(
        load_adapter(str(folder)).tensors["model.layers.1.mlp.up_proj.weight"][1], b)


# ------------------------------------------------- HF transformers + peft reference (slow)

HF_FAMILIES = ("llama", "qwen3", "gemma3")


@pytest.fixture(scope="module", params=HF_FAMILIES)
def hf_case(request, tmp_path_factory):
    """A tiny random HF model (``test_hf_checkpoints.make_hf``: Llama with
    q/k/v/o biases, Qwen3 with q/k norms and head_dim 32;
    ``test_hf_gemma3_llama3.make_hf``: Gemma 3 with a sliding and a global
    layer), saved; two random peft adapters on all 7 targets, saved;
    peft's logits at every position of each prompt: unmerged, merged
    (``merge_and_unload``) and the base's.

    Returns (name, base folder, {adapter: (folder, unmerged, merged)}, base logits).
    """
    import copy

    import peft
    import torch
    name = request.param
    if name == "gemma3":
        from test_hf_gemma3_llama3 import make_hf
    else:
        from test_hf_checkpoints import make_hf
    hf = make_hf(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, safe_serialization=True)

    def logits(model):
        with torch.no_grad():
            return [model(torch.tensor([p])).logits[0].numpy() for p in PROMPTS]

    configs = {
        "plain": peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS),
                                 init_lora_weights=False),
        "rslora": peft.LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules=list(TARGETS),
                                  rank_pattern={"q_proj": 4, "down_proj": 12},
                                  init_lora_weights=False),
    }
    adapters = {}
    torch.manual_seed(7)
    for key, lc in configs.items():
        pm = peft.get_peft_model(copy.deepcopy(hf), lc).eval()
        pm.save_pretrained(folder / key)
        unmerged = logits(pm)
        adapters[key] = (folder / key, unmerged, logits(pm.merge_and_unload()))
    return name, folder, adapters, logits(hf)


@pytest.mark.slow
def test_logits_match_peft_unmerged_and_merged(hf_case):
    """Slot 2 holds the plain adapter, slot 1 the rsLoRA one: every prompt on
    slot 2 gives peft's logits (unmerged and merged) within 1e-4; one batch
    with rows on slots 2, 1 and 0 gives each row its own model's logits."""
    from checkpoints.hf_loader import load_hf
    name, folder, adapters, base = hf_case
    ckpt = load_hf(folder)
    cfg = ckpt.config
    lc = LoRAConfig(max_loras=2, max_lora_rank=16)
    model = build(cfg, ckpt.params, lc)
    for slot, key in ((2, "plain"), (1, "rslora")):
        ad = load_adapter(str(adapters[key][0]))
        check_adapter(ad, cfg, lc)
        assert ad.target_modules == tuple(sorted(TARGETS))
        put_adapter(model, slot, ad)
    assert load_adapter(str(adapters["rslora"][0])).rank == 12

    def rows(logits):
        out, start = [], 0
        for p in PROMPTS:
            out.append(logits[start:start + len(p)])
            start += len(p)
        return out

    ours = rows(run(model, prefill_md(PROMPTS, [2, 2, 2])))
    _, unmerged, merged = adapters["plain"]
    diff = [max(float(np.abs(o - r).max()) for o, r in zip(ours, ref)) for ref in (unmerged,
                                                                                  merged)]
    print(f"{name}: plain adapter, max |logit diff| vs peft unmerged / merged "
          f"{diff[0]:.2e} / {diff[1]:.2e}")
    for o, u, m in zip(ours, unmerged, merged):
        np.testing.assert_allclose(o, u, atol=1e-4, rtol=0)
        np.testing.assert_allclose(o, m, atol=1e-4, rtol=0)
    assert np.abs(ours[0] - base[0]).max() > 0.1  # the adapter changes the logits
    mixed = rows(run(model, prefill_md(PROMPTS, [2, 1, 0])))
    want = [adapters["plain"][1][0], adapters["rslora"][1][1], base[2]]
    for o, w in zip(mixed, want):
        np.testing.assert_allclose(o, w, atol=1e-4, rtol=0)
    np.testing.assert_allclose(mixed[1], adapters["rslora"][2][1], atol=1e-4, rtol=0)


def test_slots_shard_like_their_base_weights(tiny, tmp_path):
    """On a tp=2 mesh (fake CPU devices) each LoRA leaf splits along its base
    projection's split axis (slot and rank axes whole), and the sharded step
    gives the one-device logits."""
    from sharding.mesh import make_mesh, validate_mesh_for_model
    from sharding.rules import param_shardings
    cfg, params = tiny
    folder, _ = write_adapter(tmp_path / "a", cfg, np.random.default_rng(5))
    model = build(cfg, params, LoRAConfig(max_loras=2, max_lora_rank=8))
    put_adapter(model, 1, load_adapter(str(folder)))
    md = prefill_md(PROMPTS, [1, 0, 1])
    want = run(model, md)
    mesh = make_mesh("tp=2", jax.devices()[:2])
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, validate_mesh_for_model(mesh.shape, cfg))
    specs = {p: tuple(s.spec) for p, s in nnx.to_flat_state(shardings)}
    pre = ("layers", 0)
    assert specs[pre + ("self_attn", "q_proj_lora", "b")] == (None, None, "tp", None)
    assert specs[pre + ("self_attn", "o_proj_lora", "a")] == (None, None, None, "tp")
    assert specs[pre + ("mlp", "down_proj_lora", "a")] == (None, None, None, "tp")
    assert specs[pre + ("mlp", "gate_proj_lora", "a")] == (None, None, None, None)
    nnx.update(model, jax.device_put(state, shardings))
    assert len(model.layers[0].self_attn.q_proj_lora.b.value.sharding.device_set) == 2
    np.testing.assert_allclose(run(model, md), want, atol=2e-5, rtol=0)
