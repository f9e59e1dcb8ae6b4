"""PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

``load_adapter(path)`` reads a folder written by ``peft``'s
``save_pretrained`` into a ``PeftAdapter``: per target module, the HF name of
the base weight it adapts (``model.layers.3.self_attn.q_proj.weight``) ->
(A f32 [r, in], B f32 [out, r] * scaling). ``check_adapter`` then checks it
against a model (``ModelConfig``) and the slots (``LoRAConfig``);
``jaxserve.models.lora.slot_values`` turns it into one slot's values.

Supported (``adapter_config.json``):

* ``peft_type`` "LORA"; ``r``, ``lora_alpha``; ``use_rslora`` (scaling
  ``alpha / sqrt(r)`` instead of ``alpha / r``); per-module ``rank_pattern``
  / ``alpha_pattern`` (a key matches a module name when the name ends with
  it after a ``.``, as peft's ``get_pattern_key``: ``re.match(rf"(.*\\.)?({key})$",
  name)``, first key in order);
* ``target_modules`` among q_proj, k_proj, v_proj, o_proj, gate_proj,
  up_proj, down_proj (a list, or a regex string: the tensors then say which);
* tensor names ``base_model.model.<module>.lora_A.weight`` /
  ``.lora_B.weight``, with or without the adapter name
  (``lora_A.default.weight``), ``<module>`` = ``model.layers.{i}.self_attn.q_proj``
  (Llama, Mistral, Qwen2/3, Gemma 3's ``Gemma3ForCausalLM``, MoE attention)
  or ``model.language_model.layers.{i}...`` (Gemma 3 inside
  ``Gemma3ForConditionalGeneration``); f32, f16 or bf16.

Not supported, each a ``ValueError`` naming the file and the field (or
tensor): another ``peft_type``; DoRA (``use_dora: true``);
``modules_to_save``; ``bias`` other than "none" and ``lora_bias``;
``fan_in_fan_out``; ``target_parameters``; ``trainable_token_indices``;
embedding or ``lm_head`` targets; unknown target names; MoE expert weights
(``mlp.experts.*``, ``block_sparse_moe.*``); a tensor that fits no module
of the base model; a rank above ``LoRAConfig.max_lora_rank``; a missing
``adapter_model.safetensors`` (``adapter_model.bin`` pickles are not read).

The safetensors file is read with ``checkpoints.hf_loader``'s parser (it
validates the header and reads bf16, which ``safetensors``' numpy API
cannot).

References: HF ``peft`` ``tuners/lora/config.py`` (the fields),
``tuners/lora/layer.py`` (``scaling = lora_alpha / r``, rsLoRA
``lora_alpha / math.sqrt(r)``), ``tuners/lora/model.py`` (rank and alpha
patterns), ``utils/save_and_load.py`` (the saved names drop the adapter name).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from typing import Any

import numpy as np

from checkpoints.hf_loader import read_safetensors, read_safetensors_header
from jaxserve.config import LoRAConfig, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS

# <prefix><module>.lora_{A,B}[.<adapter name>].weight; module = layers.{i}.{sub}.{proj}
_KEY_RE = re.compile(r"(?:base_model\.model\.)?(?P<module>(?P<pre>model\.|model\.language_model\."
                     r"|language_model\.model\.)layers\.(?P<i>\d+)\.(?P<sub>self_attn|mlp)\."
                     r"(?P<proj>[A-Za-z0-9_]+))\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


@dataclasses.dataclass
class PeftAdapter:
    """One PEFT LoRA adapter, read and scaled.

    Attributes:
      path: the adapter folder.
      rank: the largest rank of its modules.
      target_modules: the projection names it adapts (sorted).
      tensors: base weight HF name (``model.layers.{i}.self_attn.q_proj.weight``)
        -> (A f32 [r_m, in], B f32 [out, r_m] multiplied by the module's
        scaling); r_m the module's rank.
      config: the raw ``adapter_config.json``.
    """

    path: str
    rank: int
    target_modules: tuple[str, ...]
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


def _pattern_value(patterns: dict, module: str, default):
    """peft's ``get_pattern_key`` + ``.get``: the value of the first key of
    ``patterns`` that ``module`` ends with (after a dot), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_config(cfg: dict, where: pathlib.Path) -> None:
    """Reject what the slots cannot hold (module docstring).

    Raises:
      ValueError: naming ``where`` (the config file) and the field.
    """
    def bad(field, why):
        raise ValueError(f"{where}: {field}: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        bad("peft_type", f"{cfg['peft_type']!r} is not supported (only 'LORA')")
    if cfg.get("use_dora"):
        bad("use_dora", "DoRA adapters are not supported (only plain LoRA)")
    if cfg.get("modules_to_save"):
        bad("modules_to_save", f"{cfg['modules_to_save']} not supported (an adapter may only "
            "add low-rank deltas, not replace whole modules)")
    if cfg.get("bias", "none") != "none":
        bad("bias", f"{cfg['bias']!r} is not supported (only 'none')")
    for field in ("lora_bias", "fan_in_fan_out", "target_parameters", "trainable_token_indices"):
        if cfg.get(field):
            bad(field, f"{cfg[field]!r} is not supported")
    for field in ("r", "lora_alpha"):
        v = cfg.get(field)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            bad(field, f"must be a positive number, got {v!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        for t in targets:
            if t in ("lm_head", "embed_tokens") or "embed" in str(t):
                bad("target_modules", f"{t!r}: embedding and lm_head targets are not supported "
                    f"(supported: {', '.join(TARGETS)})")
            if t not in TARGETS:
                bad("target_modules", f"unknown target {t!r} (supported: {', '.join(TARGETS)})")
    elif targets is not None and not isinstance(targets, str):
        bad("target_modules", f"must be a list of names or a regex string, got {targets!r}")


def load_adapter(path: str) -> PeftAdapter:
    """Read the PEFT LoRA adapter folder ``path``.

    Returns:
      The ``PeftAdapter`` (scaling folded into every B).

    Raises:
      ValueError: a missing or corrupt file, an unsupported field or tensor
        (module docstring); the message names the file and the field or tensor.
    """
    folder = pathlib.Path(path)
    cfg_file, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    try:
        cfg = json.loads(cfg_file.read_text())
    except OSError as e:
        raise ValueError(f"{cfg_file}: cannot read the adapter config: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: not a JSON object")
    _check_config(cfg, cfg_file)
    if not weights.exists():
        other = " (adapter_model.bin pickles are not read)" if (
            folder / "adapter_model.bin").exists() else ""
        raise ValueError(f"{weights}: missing{other}")
    header, _ = read_safetensors_header(weights)
    pairs: dict[str, dict[str, str]] = {}  # module -> {"A": key, "B": key}
    for key in header:
        m = _KEY_RE.fullmatch(key)
        if m is None or m["proj"] not in TARGETS:
            raise ValueError(f"{weights}: tensor {key!r}: {_why_unsupported(key)}")
        pairs.setdefault(m["module"], {})[m["ab"]] = key
    r0, alpha0 = cfg["r"], cfg["lora_alpha"]
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    tensors, targets = {}, set()
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{weights}: module {module!r} has lora_{''.join(ab)} but not "
                             f"lora_{'B' if 'A' in ab else 'A'}")
        arrs = read_safetensors(weights, {k: tuple(header[k]["shape"]) for k in ab.values()},
                                np.float32)
        a, b = arrs[ab["A"]], arrs[ab["B"]]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{weights}: tensors {ab['A']!r} {a.shape} and {ab['B']!r} "
                             f"{b.shape} are not a LoRA pair ([r, in] and [out, r])")
        r = _pattern_value(rank_pattern, module, r0)
        if a.shape[0] != r:
            raise ValueError(f"{weights}: tensor {ab['A']!r} has rank {a.shape[0]}, "
                             f"{CONFIG_FILE} (r / rank_pattern) gives {r}")
        alpha = _pattern_value(alpha_pattern, module, alpha0)
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        m = _KEY_RE.fullmatch(ab["A"])
        name = f"model.layers.{int(m['i'])}.{m['sub']}.{m['proj']}.weight"
        tensors[name] = (a, (b * np.float32(scaling)).astype(np.float32))
        targets.add(m["proj"])
    if not tensors:
        raise ValueError(f"{weights}: holds no LoRA tensor")
    return PeftAdapter(path=str(folder), rank=max(a.shape[0] for a, _ in tensors.values()),
                       target_modules=tuple(sorted(targets)), tensors=tensors, config=cfg)


def _why_unsupported(key: str) -> str:
    """Why a tensor name is not a supported LoRA tensor (for the error)."""
    if "lora_embedding" in key or "embed_tokens" in key:
        return "embedding targets are not supported"
    if "lm_head" in key:
        return "lm_head targets are not supported"
    if "lora_magnitude_vector" in key:
        return "DoRA (use_dora) is not supported"
    if "modules_to_save" in key:
        return "modules_to_save is not supported"
    if "experts" in key or "block_sparse_moe" in key:
        return "LoRA on MoE expert weights is not supported (attention projections only)"
    if key.endswith(".bias"):
        return "biases (bias / lora_bias) are not supported"
    return (f"not a LoRA tensor of a supported target ({', '.join(TARGETS)}: "
            "base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight)")


def _base_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Projection -> the base weight's [out, in] under ``cfg``."""
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F = cfg.intermediate_size
    return {"q_proj": (N * H, D), "k_proj": (K * H, D), "v_proj": (K * H, D),
            "o_proj": (D, N * H), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}


def check_adapter(adapter: PeftAdapter, model_config: ModelConfig,
                  lora_config: LoRAConfig) -> None:
    """Check that ``adapter`` fits the model and the slots.

    Raises:
      ValueError: naming the file and field or tensor: a rank above
        ``lora_config.max_lora_rank`` (``adapter_config.json`` ``r`` /
        ``rank_pattern``); a layer the model lacks, an MLP target on an MoE
        model (its experts take no adapter), or an A / B shape that does not
        fit the base weight (``adapter_model.safetensors``; e.g. an adapter
        trained for another model).
    """
    cfg_file = pathlib.Path(adapter.path) / CONFIG_FILE
    weights = pathlib.Path(adapter.path) / WEIGHTS_FILE
    if adapter.rank > lora_config.max_lora_rank:
        raise ValueError(f"{cfg_file}: r (rank_pattern included): rank {adapter.rank} > "
                         f"max_lora_rank {lora_config.max_lora_rank} (raise --max_lora_rank)")
    shapes = _base_shapes(model_config)
    for name, (a, b) in adapter.tensors.items():
        _, _, i, sub, proj, _ = name.split(".")
        if int(i) >= model_config.num_layers:
            raise ValueError(f"{weights}: {name}: layer {i}, the model has "
                             f"{model_config.num_layers} layers (an adapter for another model?)")
        if model_config.num_experts and sub == "mlp":
            raise ValueError(f"{weights}: {name}: an MoE model takes LoRA on its attention "
                             f"projections only (target_modules {proj!r} is not supported)")
        out_dim, in_dim = shapes[proj]
        if a.shape[1] != in_dim or b.shape[0] != out_dim:
            raise ValueError(f"{weights}: {name}: lora_A {list(a.shape)} / lora_B "
                             f"{list(b.shape)} do not fit the base weight [{out_dim}, {in_dim}] "
                             f"(an adapter for another model?)")
