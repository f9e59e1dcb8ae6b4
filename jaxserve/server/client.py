"""A small client of ``jaxserve.v1.Generation``.

Command line: ``python -m jaxserve.server.client "prompt"`` streams the answer
to stdout (``--chat`` wraps the prompt as a user turn; ``--target``,
``--max_tokens``, ``--temperature``, ``--seed``, ``--token``, ``--tls_ca``).

Library (what the tests use)::

    with Client("127.0.0.1:50051") as c:
        for resp in c.generate("Hello", max_tokens=16, temperature=0):
            print(resp.completions[0].text, end="")
        result = c.complete(messages=[{"role": "user", "content": "Hi"}], max_tokens=8)

``AsyncClient`` has the same methods as coroutines / async iterators, for
many concurrent streams from one thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import ssl
import sys
from typing import AsyncIterator, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc

SERVICE_NAME = "jaxserve.v1.Generation"


def make_request(prompt: str | None = None, *, token_ids=None, messages=None,
                 request_id: str = "", output_kind: int = pb.OUTPUT_KIND_DELTA,
                 lora_name: str = "", **sampling) -> pb.GenerateRequest:
    """A ``GenerateRequest`` from exactly one of ``prompt`` (text), ``token_ids``
    or ``messages`` (``[{"role", "content"}]``), a LoRA adapter's name
    (``lora_name``; empty: the base model), and ``SamplingParams`` fields
    as keywords (``max_tokens=16, temperature=0, stop=[...]``, ...; one
    constraint: ``json_schema=<JSON text>``, ``regex=``, ``choice=[...]``,
    ``grammar=``, ``json_object=True``; ``logit_bias={id: bias}``).

    Raises:
      ValueError: not exactly one prompt form, or an unknown sampling field.
    """
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, token_ids or messages")
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    unknown = sorted(set(sampling) - set(fields))
    if unknown:
        raise ValueError(f"unknown sampling fields {unknown}")
    if isinstance(sampling.get("choice"), (list, tuple)):
        sampling["choice"] = pb.Choices(choices=sampling["choice"])
    req = pb.GenerateRequest(request_id=request_id, output_kind=output_kind, lora_name=lora_name,
                             sampling=pb.SamplingParams(**{
                                 k: v for k, v in sampling.items() if v is not None}))
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    return req


@dataclasses.dataclass
class Completion:
    """One choice, gathered from a stream."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Result:
    """A whole streamed request: its choices (by index), usage and timing
    (and, from a disaggregated decode worker, how it was served: ``disagg``)."""

    request_id: str
    completions: list[Completion]
    usage: pb.Usage | None
    timing: pb.Timing | None
    num_responses: int
    disagg: pb.Disagg | None = None

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids


class _Gather:
    def __init__(self):
        self.choices: dict[int, Completion] = {}
        self.last = None
        self.n = 0

    def add(self, resp: pb.GenerateResponse) -> None:
        self.n += 1
        self.last = resp
        for c in resp.completions:
            g = self.choices.setdefault(c.index, Completion(c.index))
            g.text += c.text
            g.token_ids += list(c.token_ids)
            g.logprobs += list(c.logprobs)
            g.finish_reason = c.finish_reason or g.finish_reason
            g.stop_reason = c.stop_reason or g.stop_reason

    def result(self) -> Result:
        last = self.last
        fin = last is not None and last.finished
        return Result(last.request_id if last else "",
                      [self.choices[i] for i in sorted(self.choices)],
                      last.usage if fin else None, last.timing if fin else None, self.n,
                      last.disagg if fin and last.HasField("disagg") else None)


def _channel(target, root_certificates, max_message_bytes, aio):
    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]
    mod = grpc.aio if aio else grpc
    if root_certificates is None:
        return mod.insecure_channel(target, options=opts)
    return mod.secure_channel(target, grpc.ssl_channel_credentials(root_certificates),
                              options=opts)


def _tokenize_request(text, messages, add_special_tokens) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest(add_special_tokens=add_special_tokens)
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    else:
        req.text = text
    return req


class Client:
    """Blocking client.

    Args:
      target: ``host:port``.
      token: bearer token sent as ``authorization`` metadata on every call.
      root_certificates: PEM bytes of the CA (or self-signed cert) to trust;
        None means plaintext.
      max_message_bytes: largest message sent or received.
    """

    _aio = False

    def __init__(self, target: str = "127.0.0.1:50051", *, token: str | None = None,
                 root_certificates: bytes | None = None, max_message_bytes: int = 16 << 20):
        self.channel = _channel(target, root_certificates, max_message_bytes, self._aio)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kw) -> Iterator[pb.GenerateResponse]:
        """Stream responses (see ``make_request`` for the arguments). Cancel
        with ``.cancel()`` on the returned iterator.

        Raises:
          grpc.RpcError: with the server's status (INVALID_ARGUMENT, ...).
        """
        return self.stub.Generate(make_request(prompt, **kw), timeout=timeout,
                                  metadata=self.metadata)

    def complete(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kw) -> Result:
        """Run a request to the end and gather its stream into a ``Result``."""
        g = _Gather()
        for resp in self.generate(prompt, timeout=timeout, **kw):
            g.add(resp)
        return g.result()

    def tokenize(self, text: str | None = None, *, messages=None,
                 add_special_tokens: bool = False) -> list[int]:
        req = _tokenize_request(text, messages, add_special_tokens)
        return list(self.stub.Tokenize(req, metadata=self.metadata).token_ids)

    def detokenize(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self.stub.Detokenize(pb.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens),
            metadata=self.metadata).text

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Register the server-side PEFT folder ``lora_path`` as ``lora_name``."""
        self.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_name=lora_name, lora_path=lora_path), metadata=self.metadata)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=lora_name),
                                    metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """``"SERVING"``, ``"NOT_SERVING"``, ... of the standard health service."""
        r = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                   timeout=timeout, metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class AsyncClient:
    """``Client`` over ``grpc.aio``: ``async for r in c.generate(...)``,
    ``await c.complete(...)``; same arguments."""

    _aio = True
    __init__ = Client.__init__

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kw) -> AsyncIterator[pb.GenerateResponse]:
        """The call object: async-iterate it for responses; ``.cancel()`` it."""
        return self.stub.Generate(make_request(prompt, **kw), timeout=timeout,
                                  metadata=self.metadata)

    async def complete(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kw) -> Result:
        g = _Gather()
        async for resp in self.generate(prompt, timeout=timeout, **kw):
            g.add(resp)
        return g.result()

    async def tokenize(self, text: str | None = None, *, messages=None,
                       add_special_tokens: bool = False) -> list[int]:
        req = _tokenize_request(text, messages, add_special_tokens)
        return list((await self.stub.Tokenize(req, metadata=self.metadata)).token_ids)

    async def detokenize(self, token_ids, skip_special_tokens: bool = False) -> str:
        return (await self.stub.Detokenize(pb.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens),
            metadata=self.metadata)).text

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        await self.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_name=lora_name, lora_path=lora_path), metadata=self.metadata)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=lora_name),
                                          metadata=self.metadata)

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        r = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=timeout, metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _read_ca(path: str) -> bytes:
    """The ``--tls_ca`` PEM file's bytes, checked to hold a certificate.

    Raises:
      ValueError: naming ``--tls_ca``: unreadable, or no PEM certificate.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"--tls_ca {path!r}: cannot read: {e.strerror}") from None
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(f"--tls_ca {path!r}: not a PEM certificate ({e})") from None
    return data


def main(argv=None) -> int:
    """The command: stream one answer. Exit status 0; 2 for bad arguments
    (``error: ...`` on stderr); 1 when the call fails (the gRPC status code
    and message, e.g. ``UNAVAILABLE`` for a server that cannot be reached);
    130 on Ctrl-C (the stream is cancelled)."""
    ap = argparse.ArgumentParser(prog="python -m jaxserve.server.client",
                                 description="Stream one answer from a jaxserve server.")
    ap.add_argument("prompt")
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--chat", action="store_true", help="send the prompt as a user turn")
    ap.add_argument("--max_tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--token", default=None, help="bearer token")
    ap.add_argument("--tls_ca", default=None, help="PEM file of the CA to trust (TLS)")
    ap.add_argument("--timeout", type=float, default=None, help="deadline, seconds")
    ap.add_argument("--lora_name", default="", help="a LoRA adapter the server has loaded")
    a = ap.parse_args(argv)
    kw = dict(messages=[{"role": "user", "content": a.prompt}]) if a.chat else \
        dict(prompt=a.prompt)
    try:
        ca = _read_ca(a.tls_ca) if a.tls_ca else None
        request = make_request(max_tokens=a.max_tokens, temperature=a.temperature,
                               seed=a.seed, lora_name=a.lora_name, **kw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wrote = False
    last = None
    try:
        with Client(a.target, token=a.token, root_certificates=ca) as c:
            stream = c.stub.Generate(request, timeout=a.timeout, metadata=c.metadata)
            try:
                for resp in stream:
                    for comp in resp.completions:
                        sys.stdout.write(comp.text)
                        wrote = wrote or bool(comp.text)
                    sys.stdout.flush()
                    last = resp
            except KeyboardInterrupt:
                stream.cancel()  # the server aborts the request
                raise
    except grpc.RpcError as e:
        if wrote:
            print()
        where = f" ({a.target})" if e.code() == grpc.StatusCode.UNAVAILABLE else ""
        print(f"error: {e.code().name}{where}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if wrote:
            print()
        return 130
    print()
    if last is not None and last.finished:
        u, t = last.usage, last.timing
        print(f"[{last.completions[0].finish_reason if last.completions else ''}] "
              f"prompt {u.prompt_tokens}, output {u.completion_tokens}, cached "
              f"{u.cached_tokens} tokens; queue {t.queue_ms:.0f} ms, TTFT {t.ttft_ms:.0f} ms, "
              f"TPOT {t.tpot_ms:.1f} ms, E2E {t.e2e_ms:.0f} ms" + (
                  f"; drafts {u.num_accepted_tokens}/{u.num_draft_tokens} accepted"
                  if u.num_draft_tokens else "") + (
                  f"; route {last.disagg.route}" + (
                      f" ({last.disagg.kv_transfer_bytes / 1e6:.1f} MB of KV in "
                      f"{last.disagg.kv_transfer_ms:.0f} ms)" if last.disagg.kv_transfer_bytes
                      else "") if last.HasField("disagg") else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
