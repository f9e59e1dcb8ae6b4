"""The gRPC wire checks: what every gRPC request passes before any
expensive work, and the wire helpers that keep a hostile message from
costing the server more than it sends.

The servicer's order of work for ``Generate`` (each step cheap before the next):

  1. decode the bytes (``safe_deserializer``): a message that is not a
     ``GenerateRequest`` (corrupt wire format, bad UTF-8 in a string field)
     is INVALID_ARGUMENT naming what is wrong, never UNKNOWN with a traceback;
  2. ``request_id`` (``check_request_id``), ``output_kind``, the sampling
     fields (``SamplingParams``), the cumulative output bound
     (``check_output_size``);
  3. the shared front end (``jaxserve.server.frontend``, the HTTP API's
     too): the engine's limits, the text's size, tokenizing on a worker
     pool, the prompt's token count; then the engine.

``InvalidRequest`` (a ``ValueError`` whose message starts with the field at
fault) is what every check of both APIs raises.

Request ids are any string of at most ``MAX_REQUEST_ID_CHARS`` characters; the
``x-request-id`` response header carries ``header_request_id(rid)``, the id
percent-encoded (RFC 3986) wherever it has a character gRPC metadata cannot
carry (not printable ASCII, or ``%``), so a plain ASCII id comes back as it is
and any id can be recovered with ``urllib.parse.unquote``.
"""

from __future__ import annotations

import urllib.parse

import grpc
from google.protobuf import message as pb_message
from google.protobuf.descriptor import FieldDescriptor

from jaxserve.server import jaxserve_pb2 as pb

MAX_REQUEST_ID_CHARS = 256
# A CUMULATIVE stream re-sends every token and logprob so far in each
# message, and a FINAL_ONLY one sends them all at once: that last message may
# hold at most this many logprob entries (n * max_tokens * (logprobs + 1)),
# about 6 MB at ~20 bytes an entry, well under the default 16 MiB message.
MAX_CUMULATIVE_LOGPROB_ENTRIES = 1 << 18

_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


class InvalidRequest(ValueError):
    """A request field is bad; the message starts with the field's name."""


def check_request_id(rid: str) -> str:
    """The caller's ``request_id`` if acceptable: at most ``MAX_REQUEST_ID_CHARS``
    characters, any of them (the proto's string type already guarantees valid
    UTF-8).

    Raises:
      InvalidRequest: the id is too long.
    """
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: {len(rid)} characters is more than the "
                             f"{MAX_REQUEST_ID_CHARS} allowed")
    return rid


def header_request_id(rid: str) -> str:
    """``rid`` as a gRPC metadata value: printable ASCII other than ``%`` as is,
    everything else percent-encoded from its UTF-8 bytes (at most ~3 KB for
    the longest id)."""
    return urllib.parse.quote(rid, safe=_HEADER_SAFE)


def check_output_size(params, output_kind: int) -> None:
    """Refuse a CUMULATIVE or FINAL_ONLY request whose last message could
    carry more than ``MAX_CUMULATIVE_LOGPROB_ENTRIES`` logprob entries.

    Raises:
      InvalidRequest: naming the fields and the limit.
    """
    if output_kind == pb.OUTPUT_KIND_DELTA or params.logprobs is None:
        return
    entries = params.n * params.max_tokens * (params.logprobs + 1)
    if entries > MAX_CUMULATIVE_LOGPROB_ENTRIES:
        raise InvalidRequest(
            f"output_kind: {pb.OutputKind.Name(output_kind)} with n={params.n}, max_tokens="
            f"{params.max_tokens}, logprobs={params.logprobs} could put {entries:,} logprob "
            f"entries in one message, more than the {MAX_CUMULATIVE_LOGPROB_ENTRIES:,} "
            f"allowed; use OUTPUT_KIND_DELTA")


# ---- decoding -----------------------------------------------------------------

class Undecodable:
    """What ``safe_deserializer`` hands the handler for bytes it cannot parse."""

    def __init__(self, type_name: str, reason: str):
        self.message = f"the request is not a valid {type_name}: {reason}"


def safe_deserializer(cls):
    """A gRPC request deserializer for ``cls`` that returns ``Undecodable``
    instead of raising (grpc would answer UNKNOWN and log a traceback)."""
    def deserialize(raw: bytes):
        try:
            return cls.FromString(raw)
        except pb_message.DecodeError as e:
            where = find_bad_utf8(raw, cls.DESCRIPTOR)
            return Undecodable(cls.DESCRIPTOR.name, where or str(e).split(": ", 1)[-1])
    return deserialize


def serialize(msg) -> bytes:
    """Response serializer: a message, or bytes the servicer assembled itself."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def check_decoded(request) -> None:
    """Raises ``InvalidRequest`` for an ``Undecodable`` request (the servicer
    answers INVALID_ARGUMENT); returns for a real one."""
    if isinstance(request, Undecodable):
        raise InvalidRequest(request.message)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise IndexError
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def find_bad_utf8(raw: bytes, descriptor, path: str = "") -> str | None:
    """Where a string field of ``raw`` (a ``descriptor`` message) holds invalid
    UTF-8: ``"<field path>: invalid UTF-8 at byte <offset in the field>"``,
    or None when no string field does (or the wire format breaks first)."""
    i = 0
    try:
        while i < len(raw):
            key, i = _read_varint(raw, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _read_varint(raw, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                size, i = _read_varint(raw, i)
                chunk = raw[i:i + size]
                field = descriptor.fields_by_number.get(number)
                name = f"{path}{field.name}" if field is not None else ""
                if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError as e:
                        return f"{name}: invalid UTF-8 at byte {e.start}"
                elif field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = find_bad_utf8(chunk, field.message_type, name + ".")
                    if found:
                        return found
                i += size
            else:
                return None
    except IndexError:
        return None
    return None


def add_generation_servicer(servicer, server) -> None:
    """Register ``servicer`` for ``jaxserve.v1.Generation`` like the generated
    ``add_GenerationServicer_to_server``, with ``safe_deserializer`` requests
    and ``serialize`` responses."""
    methods = {
        "Generate": (grpc.unary_stream_rpc_method_handler, pb.GenerateRequest),
        "Tokenize": (grpc.unary_unary_rpc_method_handler, pb.TokenizeRequest),
        "Detokenize": (grpc.unary_unary_rpc_method_handler, pb.DetokenizeRequest),
        "ModelInfo": (grpc.unary_unary_rpc_method_handler, pb.ModelInfoRequest),
        "LoadLoRAAdapter": (grpc.unary_unary_rpc_method_handler, pb.LoadLoRAAdapterRequest),
        "UnloadLoRAAdapter": (grpc.unary_unary_rpc_method_handler,
                              pb.UnloadLoRAAdapterRequest),
    }
    handlers = {name: make(getattr(servicer, name), request_deserializer=safe_deserializer(cls),
                           response_serializer=serialize)
                for name, (make, cls) in methods.items()}
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(service, handlers)


# ---- cumulative responses ---------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` as a protobuf length-delimited record (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


class CumulativeChoice:
    """One choice of an OUTPUT_KIND_CUMULATIVE stream, kept serialized so each
    message costs Python work for the new tokens only: token ids as packed
    varints and logprob entries as ``Completion.logprobs`` records, each
    appended once; the rest of the message is a byte copy."""

    def __init__(self):
        self.token_ids = bytearray()
        self.logprobs = bytearray()
        self.num_tokens = 0

    def extend(self, new_ids, new_logprobs) -> None:
        """Append tokens (ints >= 0) and, if given, their ``PositionLogprobs``."""
        for t in new_ids:
            self.token_ids += _varint(int(t))
        for lp in new_logprobs or ():
            self.logprobs += length_delimited(4, lp.SerializeToString())
        self.num_tokens += len(new_ids)

    def completion_bytes(self, head: "pb.Completion") -> bytes:
        """``head`` (index, text, finish and stop reasons, cumulative logprob)
        plus every token id and logprob so far, as one serialized Completion."""
        out = head.SerializeToString()
        if self.token_ids:
            out += length_delimited(3, bytes(self.token_ids))
        return out + bytes(self.logprobs)


__all__ = ["CumulativeChoice", "InvalidRequest",
           "MAX_CUMULATIVE_LOGPROB_ENTRIES", "MAX_REQUEST_ID_CHARS", "Undecodable",
           "check_decoded", "add_generation_servicer", "check_output_size",
           "check_request_id", "find_bad_utf8", "header_request_id", "length_delimited",
           "safe_deserializer", "serialize"]
