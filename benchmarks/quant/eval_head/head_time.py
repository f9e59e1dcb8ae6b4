"""SmolLM2-135M's LM head alone ([49152, 576], ``logits_of``: final norm +
head), ms per call at R = 1 / 8 / 32 rows, each format's head against the f32
tied head, alternated in one process (median of 7). gguf's head is the Q8_0 of
SmolLM2's ``token_embd``. Run from the worktree:
``PYTHONPATH=. python benchmarks/quant/eval_head/head_time.py OUT.json``."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxserve.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM

cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=64, num_layers=1,
                  num_heads=9, num_kv_heads=3, head_dim=64)
fns = {}
for method in ("none", "int8", "w8a8", "int4", "gguf"):
    q = "int4" if method == "gguf" else method  # gguf's Q8_0 head: built below
    m = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), quantization=q)
    if method == "gguf":
        from jaxserve.models import quant
        m.lm_head = nnx.data(quant.QuantizedWeight((49152, 576), ("vocab", "embed"), quant.Q8_0))
        m.lm_head.load(np.asarray(m.embed_tokens[...]), "head")
    g, s = nnx.split(m)
    fns[method] = (jax.jit(lambda s, x, g=g: nnx.merge(g, s).logits_of(x)), s)
res = {}
for R in (1, 8, 32):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((576, R)), jnp.float32)
    for k, (f, s) in fns.items():
        f(s, x).block_until_ready()
    t = {k: [] for k in fns}
    for _ in range(7):
        for k, (f, s) in fns.items():
            t0 = time.perf_counter(); f(s, x).block_until_ready(); t[k].append(time.perf_counter() - t0)
    res[R] = {k: 1e3 * float(np.median(v)) for k, v in t.items()}
    print(R, {k: round(v, 2) for k, v in res[R].items()}, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
