"""Structured-output specs as llguidance grammars: pure functions, no tokenizer.

``canonical_spec`` gives a ``StructuredOutputsParams`` its cache key;
``llguidance_grammar`` its llguidance grammar text (JSON), which
``structured.GrammarBackend.compile`` validates against the tokenizer.
What each kind becomes:

- ``json``: llguidance's JSON Schema compiler with rigid separators
  (``JSON_SEPARATORS``, no other whitespace); object schemas with
  ``properties`` and nothing said of extra keys are closed
  (``additionalProperties: false``, OpenAI strict mode); ``pattern``s get
  ASCII ``\\d`` (``ascii_digits``). ``true`` is any JSON value; ``false``
  is refused.
- ``json_object``: ``{"type": "object"}``, the same separators.
- ``regex``: llguidance's regex (Rust ``regex`` syntax, whole output),
  ASCII ``\\d``.
- ``choice``: a Lark alternation of JSON-escaped string literals.
- ``grammar``: Lark as llguidance takes it, or GBNF (llama.cpp's), which
  llguidance converts to Lark (``llguidance.grammar_from("grammar", ...)``).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import llguidance

from jaxserve.engine.sampling_params import StructuredOutputsParams

JSON_SEPARATORS = (", ", ": ")
_VALUE_KEYWORDS = ("const", "enum", "default", "examples")  # JSON values, not schemas
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": JSON_SEPARATORS[0],
                 "key_separator": JSON_SEPARATORS[1]}


def _close_objects(schema: Any, in_all_of: bool = False) -> Any:
    """The schema with ``additionalProperties: false`` added to every object
    schema that lists ``properties`` and says nothing of extra keys (not to
    ``allOf`` members, whose properties are merged)."""
    if isinstance(schema, list):
        return [_close_objects(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_close_objects(v, k == "allOf")
               if isinstance(v, (dict, list)) and k not in _VALUE_KEYWORDS else v)
           for k, v in schema.items()}
    if (isinstance(out.get("properties"), dict) and not in_all_of
            and not {"additionalProperties", "unevaluatedProperties",
                     "patternProperties"} & out.keys()):
        out["additionalProperties"] = False
    return out


def ascii_digits(regex: str) -> str:
    """``regex`` with ``\\d`` as ``[0-9]`` and ``\\D`` as ``[^0-9]`` (``0-9``
    inside a class): ECMA-262's meaning (JSON Schema ``pattern``), and
    xgrammar's and Outlines'; llguidance's Rust ``regex`` would take any
    Unicode digit (Arabic-Indic, Devanagari, ...). Escaped backslashes are
    kept; ``\\D`` inside a class is left as written."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            # a "]" right after "[" or "[^" is a literal
            j = i + 1
            if j < len(regex) and regex[j] == "^":
                out.append("^")
                j += 1
            if j < len(regex) and regex[j] == "]":
                out.append("]")
                j += 1
            i = j
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def _ascii_patterns(schema: Any) -> Any:
    """The schema with ``ascii_digits`` applied to every ``pattern`` and
    ``patternProperties`` key."""
    if isinstance(schema, list):
        return [_ascii_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "pattern" and isinstance(v, str):
            out[k] = ascii_digits(v)
        elif k == "patternProperties" and isinstance(v, dict):
            out[k] = {ascii_digits(p): _ascii_patterns(s) for p, s in v.items()}
        elif k in _VALUE_KEYWORDS:
            out[k] = v
        else:
            out[k] = _ascii_patterns(v)
    return out


def _choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar matching exactly one of ``choices``: each a string
    literal with JSON escapes (llguidance's lark literals take them)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def canonical_spec(spec: StructuredOutputsParams) -> tuple[str, Any]:
    """(cache key, the spec's value in canonical form): the JSON text of a
    schema parsed and re-dumped with sorted keys.

    Raises:
      ValueError: ``structured_outputs.json`` text that is not JSON, or a
        schema that is not an object or a boolean.
    """
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON Schema object or boolean, "
                             f"got {type(schema).__name__}")
        try:
            text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json is not JSON-serialisable: {e}") from None
        return f"json:{text}", schema
    if kind == "choice":
        return "choice:" + json.dumps(list(spec.choice), ensure_ascii=False), spec.choice
    if kind == "json_object":
        return "json_object", None
    return f"{kind}:{getattr(spec, kind)}", getattr(spec, kind)


def llguidance_grammar(kind: str, value: Any) -> str:
    """The llguidance grammar of one spec field (``canonical_spec``'s value).

    Raises:
      ValueError: a ``false`` schema, a non-object JSON Schema argument, or
        a GBNF grammar llguidance cannot convert (without the field's name;
        ``compile`` adds it). Other errors show when the grammar is
        validated.
    """
    m = llguidance.LLMatcher
    if kind == "json":
        if value is False:
            raise ValueError("the schema is false: no output satisfies it")
        schema = _ascii_patterns(_close_objects(value)) if isinstance(value, dict) else {}
        return m.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return m.grammar_from_regex(ascii_digits(value))
    if kind == "choice":
        return m.grammar_from_lark(_choice_lark(value))
    return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark


__all__ = ["JSON_SEPARATORS", "ascii_digits", "canonical_spec", "llguidance_grammar"]
