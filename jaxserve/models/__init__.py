"""Model families. A literal dict maps ``ModelConfig.architecture`` to classes."""

from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.moe import MoEForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # + sliding_window
    "qwen2": LlamaForCausalLM,  # + attention_bias
    "qwen3": LlamaForCausalLM,  # + qk_norm
    "mixtral": MoEForCausalLM,  # experts; norm_topk_prob
    "qwen3_moe": MoEForCausalLM,  # experts + qk_norm
}
