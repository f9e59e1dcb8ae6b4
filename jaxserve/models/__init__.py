"""Model families. A literal dict maps ``ModelConfig.architecture`` to classes,
and each class to the module holding its ``hf_params`` / ``load_params``."""

from jaxserve.models import gemma3, llama, moe
from jaxserve.models.gemma3 import Gemma3ForCausalLM
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.moe import MoEForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,  # + rope_scaling (Llama 3.1/3.2)
    "mistral": LlamaForCausalLM,  # + sliding_window
    "qwen2": LlamaForCausalLM,  # + attention_bias
    "qwen3": LlamaForCausalLM,  # + qk_norm
    "mixtral": MoEForCausalLM,  # experts; norm_topk_prob
    "qwen3_moe": MoEForCausalLM,  # experts + qk_norm
    "gemma3": Gemma3ForCausalLM,  # local/global layers, sandwich norms, GeGLU
}

_FAMILIES = {LlamaForCausalLM: llama, MoEForCausalLM: moe, Gemma3ForCausalLM: gemma3}


def family(model):
    """The module of ``model``'s family: its ``hf_params(model)`` (HF name ->
    (param, expert index or None)) and ``load_params(model, params)``."""
    return _FAMILIES[type(model)]
