"""Disaggregated prefill and decode (DistServe, OSDI 2024; Splitwise, ISCA 2024).

A request's prefill (compute-bound, once per request) and decode
(bandwidth-bound, once per token) run in separate worker processes, each
with its own mesh, and the prompt's KV pages travel between them:

  client ─▶ decode worker (``--role decode``): gRPC/HTTP servers, router, decoding
               │ router: uncached prompt >= --disagg_min_prefill_tokens, mostly
               │ uncached, a prefill worker healthy?  else run it here (counted)
               ▼
            control RPC ``Prefill`` ─▶ prefill worker (``--role prefill``): the
               normal engine, the request with max_tokens=1 and ``hold_kv``;
               replies with the first token and holds the pages (lease)
            control RPC ``Pull`` ─▶ the prefill worker copies the pages the decode
               side's prefix cache lacks into one buffer per K/V
               (``Engine.export_kv``), frees its pages, offers the
               buffers to ``jax.experimental.transfer``
            ``TransferConnection.pull`` ◀─ the decode worker pulls them onto its
               first device, then ``Engine.add_prefilled`` writes them into fresh
               pages and the request decodes from the first token on

Modules: ``transfer`` (the thin wrapper over ``jax.experimental.transfer``),
``worker`` (the prefill worker's control service and its client), ``router``
(the decode worker's ``DecodeEngine``), ``roles`` (how each role plugs into
``jaxserve.server.serve``; the server never imports this package).
"""
