"""Model families. A literal dict maps GGUF/HF architecture names to classes."""

from jaxserve.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
}
