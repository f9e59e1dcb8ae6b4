"""Transport security: the bearer-token rule both APIs apply
(``bearer_refusal``; on gRPC every call passes ``BearerTokenInterceptor``) and the TLS certificate/key pair, read and
checked with ``ssl`` before gRPC sees it (gRPC reports only "failed to
bind"). Failures name the flag at fault (``--tls_cert``, ``--tls_key``).
"""

from __future__ import annotations

import hmac
import ssl

import grpc

from jaxserve.metrics import ServingMetrics


def bearer_refusal(values: list[str | bytes], token: str | None) -> str | None:
    """Why a request's ``authorization`` values do not open a server whose
    bearer token is ``token`` (None or "": no token, all open), or None when
    they do. One rule for both APIs (HTTP headers, gRPC metadata): exactly one
    value, ``Bearer <token>`` with the scheme in any case (RFC 9110 11.1),
    the token compared in constant time.

    Returns:
      None, or the reason (HTTP 401 / gRPC UNAUTHENTICATED carry it).
    """
    if not token:
        return None
    hint = "(send one 'authorization: Bearer <token>')"
    if not values:
        return f"missing bearer token {hint}"
    if len(values) > 1:
        return f"{len(values)} authorization values; exactly one is allowed {hint}"
    got = values[0]
    got = got if isinstance(got, str) else got.decode("latin-1")
    scheme, _, credentials = got.strip().partition(" ")
    if scheme.lower() != "bearer":
        return f"the authorization scheme is not Bearer {hint}"
    if not hmac.compare_digest(credentials.strip().encode("utf-8", "surrogateescape"),
                               token.encode()):
        return f"wrong bearer token {hint}"
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call whose ``authorization`` metadata does not pass
    ``bearer_refusal`` with UNAUTHENTICATED naming the reason."""

    def __init__(self, token: str, metrics: ServingMetrics | None = None):
        self._token = token
        self._metrics = metrics

    async def intercept_service(self, continuation, details):
        values = [v for k, v in (details.invocation_metadata or ()) if k == "authorization"]
        why = bearer_refusal(values, self._token)
        if why is None:
            return await continuation(details)
        if self._metrics is not None:
            self._metrics.rejected.labels("UNAUTHENTICATED").inc()
        handler = await continuation(details)
        if handler is None:
            return None
        return _denying_handler(handler, why)


def _denying_handler(handler: grpc.RpcMethodHandler, msg: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot read: {e.strerror}") from None


def tls_pair(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """Read and check a PEM certificate chain and its private key.

    Returns:
      (key PEM, cert PEM) bytes, as ``grpc.ssl_server_credentials`` takes them.

    Raises:
      ValueError: naming ``--tls_cert`` or ``--tls_key``: unreadable, not PEM,
        an encrypted key, or a key that does not match the certificate.
    """
    cert, key = _read(cert_path, "--tls_cert"), _read(key_path, "--tls_key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ValueError(f"--tls_cert {cert_path!r}: not a PEM certificate (no "
                         f"'-----BEGIN CERTIFICATE-----' line)")
    if b"PRIVATE KEY-----" not in key:
        raise ValueError(f"--tls_key {key_path!r}: not a PEM private key (no "
                         f"'-----BEGIN ... PRIVATE KEY-----' line)")
    if b"ENCRYPTED" in key:
        raise ValueError(f"--tls_key {key_path!r}: the key is encrypted; gRPC needs it "
                         f"unencrypted")

    def no_password():  # never prompt on the terminal
        raise ValueError(f"--tls_key {key_path!r}: the key is encrypted; gRPC needs it "
                         f"unencrypted")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path,
                                                                password=no_password)
    except ssl.SSLError as e:
        why = "the key does not match the certificate" if e.reason == "KEY_VALUES_MISMATCH" \
            else f"not a valid certificate and private key ({e.reason or e})"
        raise ValueError(f"--tls_cert {cert_path!r} / --tls_key {key_path!r}: {why}") from None
    except OSError as e:  # changed since the read above
        raise ValueError(f"--tls_cert {cert_path!r} / --tls_key {key_path!r}: cannot read: "
                         f"{e.strerror}") from None
    return key, cert


__all__ = ["BearerTokenInterceptor", "bearer_refusal", "tls_pair"]
