"""Failures a user of the commands meets, each ending in one line and a
status, never a traceback: ``python -m jaxserve.main`` (generate and
``--mode serve``) and ``python -m jaxserve.server.client``.

Start-up failures print exactly one ``error: ...`` line on stderr (besides
the server's ``jaxserve: ...`` progress lines) and exit 2; Ctrl-C in the CLI
exits 130; SIGTERM on a server drains with its port open (health
NOT_SERVING, new ``Generate`` calls UNAVAILABLE) and exits 0.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from jaxserve.server.client import Client
from server_util import ServerProcess

pytestmark = pytest.mark.slow


def _run(args: list[str], module: str = "jaxserve.main", timeout: float = 120.0):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, timeout=timeout)


def _assert_one_error(proc, rc: int = 2, *needles: str) -> str:
    """Exit ``rc``; stderr has exactly one ``error:`` line (holding every
    needle), no traceback, and nothing else but ``jaxserve:`` progress lines
    and the GGUF progress bar. Returns the error line."""
    err = proc.stderr
    assert proc.returncode == rc, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    others = [line for line in lines if not line.startswith(("error:", "jaxserve:"))
              and "dequantizing GGUF tensors" not in line]
    assert not others, err[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def _serve(*args: str) -> list[str]:
    return ["--mode", "serve", "--port", "0", "--metrics_port", "-1", *args]


@pytest.fixture
def busy_port():
    """A port that a listening socket holds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_busy_grpc_port(tiny_gguf, busy_port):
    p = _run(["--mode", "serve", "--model", tiny_gguf, "--port", str(busy_port),
              "--metrics_port", "-1"])
    _assert_one_error(p, 2, f"--port {busy_port}", "in use")


def test_busy_metrics_port(tiny_gguf, busy_port):
    p = _run(["--mode", "serve", "--model", tiny_gguf, "--port", "0",
              "--metrics_port", str(busy_port)])
    _assert_one_error(p, 2, f"--metrics_port {busy_port}", "in use")


@pytest.mark.parametrize("host,why", [("203.0.113.7", "not an address of this machine"),
                                      ("not-a-host.invalid", "cannot resolve")])
def test_unbindable_host(tiny_gguf, host, why):
    p = _run(_serve("--model", tiny_gguf, "--host", host))
    _assert_one_error(p, 2, f"--host {host!r}", why)


def test_tls_files_missing_or_garbage(tiny_gguf, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(bytes(range(256)) * 4)
    missing = str(tmp_path / "missing.pem")
    p = _run(_serve("--model", tiny_gguf, "--tls_cert", missing, "--tls_key", missing))
    _assert_one_error(p, 2, "--tls_cert", missing, "No such file")
    p = _run(_serve("--model", tiny_gguf, "--tls_cert", str(garbage), "--tls_key",
                    str(garbage)))
    _assert_one_error(p, 2, "--tls_cert", "not a PEM certificate")


def test_client_tls_ca_missing(tmp_path):
    p = _run(["--tls_ca", str(tmp_path / "nope.pem"), "hi"], "jaxserve.server.client")
    _assert_one_error(p, 2, "--tls_ca", "No such file")


def test_client_to_a_dead_port():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _run(["--target", f"127.0.0.1:{port}", "hi"], "jaxserve.server.client")
    _assert_one_error(p, 1, f"UNAVAILABLE (127.0.0.1:{port})")


def test_prompt_not_valid_unicode(tiny_gguf):
    # What Python makes of the argv bytes b"ab\xff": "ab\udcff" (surrogateescape).
    p = _run(["--model", tiny_gguf, "--prompt", "ab\udcff", "--max_tokens", "2"])
    _assert_one_error(p, 2, "--prompt", "character 2", "0xff")


def test_serve_garbage_and_missing_model(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(bytes(range(256)) * 20)
    p = _run(_serve("--model", str(bogus)))
    _assert_one_error(p, 2, str(bogus))
    p = _run(_serve("--model", str(tmp_path / "nonexistent.gguf")))
    _assert_one_error(p, 2, "nonexistent.gguf")


def test_sigint_mid_generation_exits_130(tiny_gguf):
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.main", "--model", tiny_gguf,
                             "--prompt", "hello", "--max_tokens", "400", "--temperature", "0",
                             "--num_pages", "128", "--page_size", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        got = b""  # wait for streamed text: the model is loaded and generating
        t_end = time.monotonic() + 120
        while len(got) < 8 and proc.poll() is None and time.monotonic() < t_end:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                got += proc.stdout.read1(4096)
        assert proc.poll() is None and got, (got, proc.stderr.read().decode()[-2000:])
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "total:" not in out.decode()  # stopped, not run to the end


def test_sigterm_drains_with_health_not_serving(tiny_gguf):
    grace = 4.0
    s = ServerProcess(["--model", tiny_gguf, "--num_pages", "256", "--page_size", "8",
                       "--grace_period_s", str(grace)])
    try:
        with Client(s.target) as c:
            assert c.health() == "SERVING"
            stream = c.generate(token_ids=[7, 3], max_tokens=480, ignore_eos=True,
                                temperature=0.0)
            first = next(stream)  # the request is running
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert c.health(timeout=2) == "NOT_SERVING"  # an answer, not a refused connection
            with pytest.raises(grpc.RpcError) as err:
                c.complete(token_ids=[5], max_tokens=2, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert "shutting down" in err.value.details()
            rest = list(stream)  # ends with a final message: finished or aborted
            assert rest and rest[-1].finished, rest[-1:]
            assert rest[-1].completions[0].finish_reason in ("length", "abort")
        rc = s.proc.wait(grace + 5)
        elapsed = time.monotonic() - t0
    finally:
        s.kill()
    assert first.completions
    assert rc == 0, "".join(s.lines[-10:])
    assert elapsed < grace, (elapsed, "".join(s.lines[-8:]))
    assert "Traceback" not in "".join(s.lines)


@pytest.mark.parametrize("args, needles", [
    (["--quantization", "int3"], ["quantization must be one of", "'int3'"]),
    (["--kv_cache_dtype", "fp16x"], ["kv_cache_dtype must be one of", "'fp16x'"]),
    (["--quantization", "int4", "--quantization_group_size", "100"],
     ["quantization_group_size=100 does not divide the input dim 576"]),
])
def test_bad_quantization_flags_fail_before_weights_load(args, needles, smollm2_path):
    """Bad quantization values end in one line before any tensor is read
    (no "dequantizing GGUF tensors" bar: the int4 check reads the GGUF
    metadata only)."""
    proc = _run([*args, "--prompt", "hi", "--max_tokens", "2"])
    _assert_one_error(proc, 2, *needles)
    assert "dequantizing GGUF tensors" not in proc.stderr


@pytest.fixture(scope="module")
def other_vocab_gguf(tmp_path_factory):
    """A tiny random GGUF like ``tiny_gguf`` but with 300 tokens, not 320."""
    from tiny_gguf import write_tiny_gguf
    from jaxserve.config import ModelConfig
    path = tmp_path_factory.mktemp("vocab-300") / "tiny300.gguf"
    write_tiny_gguf(path, ModelConfig(vocab_size=300, max_position_embeddings=512, num_layers=2))
    return str(path)


def test_unknown_speculative_method(tiny_gguf):
    """An unknown method is absl's enum error, in the CLI's one-line form."""
    p = _run(["--model", tiny_gguf, "--speculative_method", "medusa", "--prompt", "hi"])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "speculative_method" in errors[0] and "medusa" in errors[0], \
        p.stderr


@pytest.mark.parametrize("args, needles", [
    (["--speculative_method", "draft"], ["--speculative_method draft needs --draft_model"]),
    (["--draft_model", "self"], ["--draft_model 'self' needs --speculative_method draft"]),
    (["--speculative_method", "ngram", "--prompt_lookup_min", "4", "--prompt_lookup_max", "3"],
     ["prompt_lookup_max (3) must be >= prompt_lookup_min (4)"]),
    (["--speculative_method", "ngram", "--num_speculative_tokens", "0"],
     ["num_speculative_tokens", "0"]),
])
@pytest.mark.parametrize("mode", ["generate", "serve"])
def test_bad_speculation_flags_fail_before_weights_load(tiny_gguf, mode, args, needles):
    """Bad speculation values end in one line before any tensor is read (a
    server, before its port is bound)."""
    base = ["--model", tiny_gguf, "--prompt", "hi", "--max_tokens", "2"] if mode == "generate" \
        else _serve("--model", tiny_gguf)
    proc = _run([*base, *args])
    _assert_one_error(proc, 2, *needles)
    assert "dequantizing GGUF tensors" not in proc.stderr
    assert "gRPC on" not in proc.stderr


def test_draft_with_another_vocabulary(tiny_gguf, other_vocab_gguf):
    """A draft model whose vocabulary differs from the target's: one line
    naming both sizes, before the draft's weights are read (only the
    target's tensors are dequantized)."""
    proc = _run(["--model", tiny_gguf, "--speculative_method", "draft", "--draft_model",
                 other_vocab_gguf, "--prompt", "hi", "--max_tokens", "2"])
    line = _assert_one_error(proc, 2, other_vocab_gguf, "300", "320", "vocabulary")
    assert line.index("300") < line.index("320"), line  # the draft's, then the target's
    assert proc.stderr.count("dequantizing GGUF tensors: 100%") == 1, proc.stderr
