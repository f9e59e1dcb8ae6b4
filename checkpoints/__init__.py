"""Checkpoint formats and tokenizers: GGUF (``gguf_check``, ``gguf_config``,
``gguf_loader``), Hugging Face folders (``hf_config``, ``hf_loader``), Orbax
(``orbax_metadata``, ``orbax_ckpt``), the tokenizer and chat template, the
model-alias fetcher (``fetch``) and ``loader`` (any of them by path).

May import: ``jaxserve.config``, ``jaxserve.models`` (weight formats only),
``sharding``.
"""
