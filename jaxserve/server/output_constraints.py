"""API fields that constrain the output -> the engine's ``StructuredOutputsParams``.

One rule for both doors: the OpenAI HTTP API (``response_format``, vLLM's
``structured_outputs`` object and its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` fields, and the
schema a forced ``tool_choice`` builds, ``tool_parsers.forced_tool_schema``)
and gRPC (the ``constraint`` oneof of ``SamplingParams``) both name the
fields a request set, by the names the client used, and hand them to
``structured_outputs_of``. At most one may be set: two constraints at once
are refused naming both (vLLM refuses the same), rather than one silently
winning.

Each field's value is checked here for its shape (a schema is a JSON object
or its text, a regex and a grammar are non-empty strings, a choice a
non-empty list of strings); whether the grammar backend can compile it is
checked by ``Frontend.compile_constraint`` off the event loop. Errors are
``InvalidRequest`` whose message starts with the field at fault (HTTP 400
with ``param``, gRPC INVALID_ARGUMENT).

Reference: vLLM ``vllm/entrypoints/openai/protocol.py``
(``_get_structured_outputs``, ``check_structured_outputs_count``) and
OpenAI's ``response_format`` (https://platform.openai.com/docs/api-reference/chat/create).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jaxserve.engine.sampling_params import StructuredOutputsParams
from jaxserve.server.checks import InvalidRequest

log = logging.getLogger(__name__)

# vLLM's older per-field names -> the StructuredOutputsParams field.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Keys of vLLM's ``structured_outputs`` object that tune a backend jaxserve does
# not run (accepted and ignored, as with ``guided_decoding_backend``).
IGNORED_STRUCTURED_KEYS = ("backend", "disable_fallback", "disable_any_whitespace",
                           "disable_additional_properties", "whitespace_pattern")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def json_schema_value(value: Any, field: str) -> dict | bool:
    """A JSON Schema given as an object (or a bool schema) or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{field}: is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequest(f"{field}: must be a JSON Schema object, got "
                             f"{type(value).__name__}")
    return value


def response_format_spec(rf: Any) -> tuple[str, dict] | None:
    """OpenAI's ``response_format`` as (field name, StructuredOutputsParams
    kwargs), or None for ``{"type": "text"}``.

    ``{"type": "json_object"}`` -> ``json_object``; ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}`` ->
    ``json`` (``strict`` is accepted: the schema is always enforced).

    Raises:
      InvalidRequest: another type, or a json_schema without an object
        ``schema`` (naming ``response_format.type`` /
        ``response_format.json_schema.schema``).
    """
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise InvalidRequest(f"response_format: must be an object, got {type(rf).__name__}")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest("response_format.json_schema: must be an object with a "
                                 "'schema' (and a 'name')")
        if "schema" not in js:
            raise InvalidRequest("response_format.json_schema.schema: is required")
        return "response_format", {"json": json_schema_value(
            js["schema"], "response_format.json_schema.schema")}
    shown = kind if isinstance(kind, str) else type(kind).__name__
    raise InvalidRequest(f"response_format.type: must be 'text', 'json_object' or "
                         f"'json_schema', got {shown!r:.60}")


def structured_object_spec(obj: Any) -> tuple[str, dict] | None:
    """vLLM's ``structured_outputs`` object (``{"json"|"regex"|"choice"|
    "grammar"|"json_object": ...}``) as (field name, kwargs); None when it
    sets nothing. Backend tuning keys (``IGNORED_STRUCTURED_KEYS``) are
    ignored.

    Raises:
      InvalidRequest: an unknown key or ``structural_tag`` (naming
        ``structured_outputs.<key>``), or more than one constraint in it.
    """
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"structured_outputs: must be an object, got {type(obj).__name__}")
    kw = {}
    for key, value in obj.items():
        if key in IGNORED_STRUCTURED_KEYS:
            continue
        if key not in _STRUCTURED_KEYS:
            why = "is not supported by jaxserve" if key == "structural_tag" else \
                f"unknown key; expected one of {', '.join(_STRUCTURED_KEYS)}"
            raise InvalidRequest(f"structured_outputs.{key}: {why}")
        if value is None or value is False:
            continue
        kw[key] = json_schema_value(value, "structured_outputs.json") if key == "json" else value
    if len(kw) > 1:
        raise InvalidRequest(f"structured_outputs: sets {' and '.join(kw)}; only one "
                             f"constraint per request")
    return ("structured_outputs", kw) if kw else None


def guided_specs(fields: dict[str, Any]) -> list[tuple[str, dict]]:
    """vLLM's ``guided_*`` fields that are set, each as (field name, kwargs)."""
    out = []
    for name, key in GUIDED_FIELDS.items():
        value = fields.get(name)
        if value is None:
            continue
        out.append((name, {key: json_schema_value(value, name) if key == "json" else value}))
    return out


def structured_outputs_of(specs: list[tuple[str, dict] | None]
                          ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's one constraint and the API field that set it (for
    errors of its compile), from the (field name, kwargs) each API field
    gave (None: that field set nothing); (None, None) when none did.

    Raises:
      InvalidRequest: more than one field set a constraint (the message
        starts with the second and names both), or a value
        ``StructuredOutputsParams`` refuses (naming the field the client
        used: ``guided_regex``, ``response_format.json_schema.schema``...).
    """
    specs = [s for s in specs if s is not None]
    if not specs:
        return None, None
    if len(specs) > 1:
        names = [name for name, _ in specs]
        raise InvalidRequest(f"{names[1]}: only one output constraint per request; this one "
                             f"sets {', '.join(names)}")
    name, kw = specs[0]
    where = name if name != "structured_outputs" else f"structured_outputs.{next(iter(kw))}"
    try:
        return StructuredOutputsParams(**kw), where
    except ValueError as e:
        msg = str(e)
        for key in _STRUCTURED_KEYS:  # "structured_outputs.regex must ..." -> the API name
            msg = msg.replace(f"structured_outputs.{key}", "")
        raise InvalidRequest(f"{where}: {msg.strip()}") from None


def ignored_backend_fields(fields: dict[str, Any]) -> list[str]:
    """Backend choices jaxserve accepts and ignores (it runs one grammar
    backend): ``guided_decoding_backend``, ``guided_whitespace_pattern``."""
    return [f for f in ("guided_decoding_backend", "guided_whitespace_pattern")
            if fields.get(f) is not None]


__all__ = ["GUIDED_FIELDS", "IGNORED_STRUCTURED_KEYS", "guided_specs", "ignored_backend_fields",
           "json_schema_value",
           "response_format_spec", "structured_object_spec", "structured_outputs_of"]
