"""The serving engine: ``Engine`` (``engine.py``) is wiring of narrow parts
(``build``, ``intake``, ``scheduler`` + ``page_table``, ``plan`` +
``runner`` + ``programs``, ``sampling``, ``outputs``, ``kv_handoff``,
``warmup``, speculation) behind ``add_request`` / ``abort`` / ``step`` /
``stats`` / ``warmup`` and the read-only properties of ``views.py``;
``llm.py`` is the vLLM-style ``LLM`` facade.

May import: ``jaxserve.models``, ``pallas_kernels``, ``sharding``,
``checkpoints``, ``jaxserve.config``, ``jaxserve.metrics`` (the layers in
pyproject.toml's ``[tool.importlinter]``). Nothing outside this package
reaches into its parts.
"""
