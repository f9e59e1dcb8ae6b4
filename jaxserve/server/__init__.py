"""The API servers over one ``AsyncEngine`` thread: gRPC (``servicer.py``,
``jaxserve.proto``) and OpenAI HTTP (``http.py`` routes, ``openai_protocol.py``
models and response builders), sharing ``frontend.py``'s tokenizing and
request checks; ``serve.py`` runs them (health, reflection, auth, shutdown).

May import: ``jaxserve.engine`` (its public members only) and the layers
below it; never ``jaxserve.disagg`` (the entry point hands ``serve`` a role).
"""
