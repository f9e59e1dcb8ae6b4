"""A request body's JSON, decoded with a nesting bound.

``json.loads`` recurses once per nested array or object and raises
``RecursionError`` near Python's recursion limit (a body nested 100,000
deep did, as a 500). ``loads`` measures the nesting first without
recursion (``json_depth``: bracket counts outside strings, numpy passes
over 1 MiB chunks)
and refuses bodies deeper than ``MAX_JSON_DEPTH`` with a 400 naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from jaxserve.server.openai_protocol import bad_request

# Deepest nesting of arrays and objects a JSON body may have. OpenAI's
# requests nest a few levels (messages -> content -> part; a tool's JSON
# schema a dozen or so); 64 leaves room and keeps every decoder and
# validator far from Python's recursion limit (a body nested 100,000 deep
# would raise RecursionError in ``json.loads``).
MAX_JSON_DEPTH = 64


_CHUNK = 1 << 20  # bytes scanned at a time
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep arrays and objects nest in the JSON text ``raw`` (brackets
    inside strings do not count), computed without recursion; 0 when ``raw``
    has at most ``limit`` opening brackets in all (it cannot nest deeper)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0
    bare = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    depth = deepest = 0
    for start in range(0, len(bare), _CHUNK):  # bounded scratch memory per request
        c = bare[start:start + _CHUNK]
        step = (c == ord("[")).astype(np.int32) + (c == ord("{")) - (c == ord("]")) \
            - (c == ord("}"))
        running = np.cumsum(step, dtype=np.int32)
        deepest = max(deepest, depth + int(running.max()))
        depth += int(running[-1])
    return deepest


def loads(raw: bytes) -> Any:
    """A request body's JSON, nested at most ``MAX_JSON_DEPTH`` deep.

    Raises:
      APIError: 400 for JSON that is malformed, not UTF-8, holds an integer
        longer than Python converts (4,300 digits), or is nested deeper than
        ``MAX_JSON_DEPTH`` (the message names the limit).
    """
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"the body nests arrays and objects {depth} deep; at most "
                          f"{MAX_JSON_DEPTH} is allowed (MAX_JSON_DEPTH)")
    try:
        return json.loads(raw)
    except ValueError as e:  # malformed, not UTF-8, an integer over 4300 digits
        raise bad_request(f"the body is not valid JSON: {e}") from None
    except RecursionError:  # not reached after the depth check; kept as a guard
        raise bad_request(f"the body nests deeper than {MAX_JSON_DEPTH}") from None


__all__ = ["MAX_JSON_DEPTH", "json_depth", "loads"]
