"""Benchmarks, one CLI: ``python -m jaxserve.bench
serve|throughput|latency|sweep|startup|soak|eval|device`` over one workloads
module (``workloads.py``), one peers module (``peers.py``: HF transformers,
llama.cpp in-process and its server) and one report writer (``report.py``).

May import: ``jaxserve.engine`` (its public members), ``jaxserve.server``
(clients) and the layers below; torch, transformers and llama_cpp only
lazily, inside the peers that need them.
"""
