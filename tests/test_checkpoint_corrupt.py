"""Corrupt checkpoints end in one ``ValueError`` naming the file, never another exception.

1. Hypothesis fuzz over a tiny GGUF (25 KB; ``write_tiny_gguf``), 1,500 mutated
   files (300 + 500 + 700), each read four ways in a few ms: truncation at
   any offset, byte overwrites and bit flips in the header region, and
   structured edits of every count, length, type tag, n_dims, dim and offset
   (``_slots`` lists where they are) to boundary values. Every outcome of
   ``load_gguf_config``, ``load_gguf`` and ``loader.load_checkpoint`` must be
   success or a one-line ``ValueError`` starting with the path, within
   ``_LIMIT_S`` seconds (SIGALRM). Derandomized: CI sees the same files.
2. The issue's three real-file cases on SmolLM2 (truncated to 1 MB, header
   claiming more tensors / keys, cut to 60%), through the API and through
   ``python -m jaxserve.main`` (generate and ``--mode serve``): exit 2, one
   ``error:`` line naming the file.
3. Safetensors (HF folder; 60 fuzzed files too) and Orbax corruptions.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny_gguf import write_tiny_gguf

from checkpoints import loader
from checkpoints.gguf_check import check_gguf
from checkpoints.gguf_loader import load_gguf, load_gguf_config
from jaxserve.config import ModelConfig

# Smallest model write_tiny_gguf allows: vocab 269, one layer, Q8_0 rows of 32.
_CONFIG = ModelConfig(vocab_size=269, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
_LIMIT_S = 10
_FUZZ = settings(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


def _fuzz(examples: int) -> settings:
    return settings(_FUZZ, max_examples=examples)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_HUGE = (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
         2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 33, 2**64 - 1)


pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


class _Bytes(bytes):
    """bytes with a short repr (Hypothesis prints fixtures of a failing example)."""

    def __repr__(self):
        return f"<{len(self)} bytes>"


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("corrupt-src") / "tiny.gguf"
    write_tiny_gguf(path, _CONFIG)
    load_gguf(path, show_progress=False)  # the unmutated file loads
    return _Bytes(path.read_bytes())


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("corrupt")


def _slots(data: bytes) -> tuple[list[tuple[str, int, int]], int]:
    """Where the header's structured fields lie in a valid little-endian GGUF:
    ([(kind, byte offset, width)], end of the tensor table). An independent,
    minimal walk (the test's map of targets; ``check_gguf`` is under test)."""
    slots = [("n_tensors", 8, 8), ("n_kv", 16, 8), ("version", 4, 4)]
    pos = 24

    def u(fmt):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string(kind):  # records the length field; returns the length
        slots.append((kind, pos, 8))
        return u("Q")

    def skip(n):
        nonlocal pos
        pos += n

    def value(tag, kind):
        if tag == 8:
            skip(string(kind + "_string_len"))
        elif tag == 9:
            slots.append(("array_item_type", pos, 4))
            item = u("I")
            slots.append(("array_len", pos, 8))
            count = u("Q")
            for _ in range(count):
                value(item, "array_item")
        else:
            skip(_SCALAR_SIZES[tag])

    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    for _ in range(n_kv):
        skip(string("key_len"))
        slots.append(("type_tag", pos, 4))
        value(u("I"), "value")
    for _ in range(n_tensors):
        skip(string("tensor_name_len"))
        slots.append(("n_dims", pos, 4))
        for _ in range(u("I")):
            slots.append(("dim", pos, 8))
            skip(8)
        slots.append(("ggml_type", pos, 4))
        skip(4)
        slots.append(("tensor_offset", pos, 8))
        skip(8)
    return slots, pos


@contextlib.contextmanager
def _time_limit(seconds: int):
    def on_alarm(signum, frame):
        raise TimeoutError(f"took more than {seconds} s (a hang?)")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _assert_loads_or_names_file(path: pathlib.Path, readers=None) -> None:
    """Each reader succeeds or raises a one-line ValueError starting with the path."""
    readers = readers or (load_gguf_config, lambda p: load_gguf(p, show_progress=False),
                          loader.load_model_config,
                          lambda p: loader.load_checkpoint(p, show_progress=False))
    for read in readers:
        with _time_limit(_LIMIT_S):
            try:
                read(path)
            except ValueError as e:
                message = str(e)
                assert message.startswith(f"{path}: "), message
                assert "\n" not in message, message
                assert len(message) < 600, message
                # --hypothesis-show-statistics: which checks the examples reach
                event(" ".join(re.sub(r"'[^']*'|\d+", "_", message[len(f"{path}: "):])
                               .split()[:4]))
            else:
                event("loads")


def _write(work_dir: pathlib.Path, data: bytes) -> pathlib.Path:
    path = work_dir / "mutated.gguf"
    path.write_bytes(data)
    return path


@_fuzz(300)
@given(st.data())
def test_fuzz_truncated(tiny_bytes, work_dir, data):
    slots, table_end = _slots(tiny_bytes)
    edges = sorted({pos + k for _, pos, width in slots for k in (0, 1, width - 1, width)})
    cut = data.draw(st.one_of(st.integers(0, table_end), st.integers(0, len(tiny_bytes) - 1),
                              st.sampled_from(edges)))  # inside / at the end of every field
    _assert_loads_or_names_file(_write(work_dir, tiny_bytes[:cut]))


@_fuzz(500)
@given(st.data())
def test_fuzz_header_bytes(tiny_bytes, work_dir, data):
    """1-6 overwritten bytes or flipped bits anywhere before the tensor data."""
    _, table_end = _slots(tiny_bytes)
    mutated = bytearray(tiny_bytes)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, table_end - 1))
        if data.draw(st.booleans()):
            mutated[pos] = data.draw(st.integers(0, 255))
        else:
            mutated[pos] ^= 1 << data.draw(st.integers(0, 7))
    _assert_loads_or_names_file(_write(work_dir, bytes(mutated)))


@_fuzz(700)
@given(st.data())
def test_fuzz_structured(tiny_bytes, work_dir, data):
    """1-2 header fields (counts, lengths, type tags, n_dims, dims, offsets) set to
    boundary values, off-by-one values or random ones; sometimes also truncated."""
    slots, table_end = _slots(tiny_bytes)
    kinds = sorted({kind for kind, _, _ in slots})
    mutated = bytearray(tiny_bytes)
    for _ in range(data.draw(st.integers(1, 2))):
        kind = data.draw(st.sampled_from(kinds))
        _, pos, width = data.draw(st.sampled_from([s for s in slots if s[0] == kind]))
        fmt = "<I" if width == 4 else "<Q"
        old = struct.unpack_from(fmt, mutated, pos)[0]
        new = data.draw(st.one_of(st.sampled_from(_HUGE), st.sampled_from([old - 1, old + 1,
                                                                            old * 2, old + 32]),
                                  st.integers(0, 2**(8 * width) - 1)))
        struct.pack_into(fmt, mutated, pos, new % 2**(8 * width))
    if data.draw(st.integers(0, 4)) == 0:
        mutated = mutated[:data.draw(st.integers(table_end, len(mutated)))]
    _assert_loads_or_names_file(_write(work_dir, bytes(mutated)))


# ---- targeted GGUF cases: messages say what is wrong --------------------------------

def _edit(data: bytes, slot_kind: str, value: int, index: int = 0) -> bytes:
    slots, _ = _slots(data)
    _, pos, width = [s for s in slots if s[0] == slot_kind][index]
    out = bytearray(data)
    struct.pack_into("<I" if width == 4 else "<Q", out, pos, value)
    return bytes(out)


@pytest.mark.parametrize("kind,value,match", [
    ("n_tensors", 2**63, r"claims 9223372036854775808 tensors"),
    ("n_kv", 2**64 - 1, r"18446744073709551615 metadata keys"),
    ("array_len", 2**62, r"metadata 'tokenizer.ggml.tokens' claims 4611686018427387904 STRING"),
    ("key_len", 2**40, r"metadata key 0 .* claims 1099511627776 bytes"),
    ("type_tag", 99, r"unknown value type tag 99"),
    ("n_dims", 7, r"tensor 'token_embd.weight' has n_dims 7"),
    ("ggml_type", 1000, r"tensor 'token_embd.weight' has unknown ggml type 1000"),
    ("dim", 2**40, r"tensor 'token_embd.weight' data \[\d+, \d+\) runs past the end"),
    ("tensor_offset", 2**64 - 32, r"tensor 'token_embd.weight' data .* runs past the end"),
    ("tensor_offset", 1, r"offset 1 is not a multiple of the alignment 32"),
])
def test_structured_edit_message(tiny_bytes, work_dir, kind, value, match):
    path = _write(work_dir, _edit(tiny_bytes, kind, value))
    for read in (check_gguf, load_gguf_config, loader.load_checkpoint):
        with _time_limit(_LIMIT_S), pytest.raises(ValueError, match=match) as e:
            read(path)
        assert str(e.value).startswith(f"{path}: ")


def test_truncated_data_message(tiny_bytes, work_dir):
    path = _write(work_dir, tiny_bytes[:len(tiny_bytes) - 100])
    with pytest.raises(ValueError, match=r"data \[\d+, \d+\) runs past the end of the file "
                                         rf"\({len(tiny_bytes) - 100} bytes"):
        load_gguf(path, show_progress=False)


def test_metadata_inconsistent_with_tensors(tmp_path):
    """A valid file whose tensor shapes do not match its metadata."""
    path = tmp_path / "wide.gguf"
    write_tiny_gguf(path, _CONFIG)
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    pos = data.index(key) + len(key) + 4  # after the u32 type tag
    struct.pack_into("<I", data, pos, 96)
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_gate.weight' has shape \(64, 32\), "
                                         r"the metadata implies \(96, 32\)"):
        load_gguf_config(path)


def test_tokenizer_lengths(tmp_path):
    """token_type must have one entry per token."""
    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, _CONFIG)
    slots, _ = _slots(path.read_bytes())
    data = path.read_bytes()
    # tokens is the first array, token_type the second: make token_type one shorter.
    arrays = [s for s in slots if s[0] == "array_len"]
    _, pos, _ = arrays[1]
    assert struct.unpack_from("<Q", data, pos)[0] == 269
    # One entry fewer: drop its 4 bytes, re-pad the table to the data section.
    _, table_end = _slots(data)
    out = bytearray(data[:table_end])
    struct.pack_into("<Q", out, pos, 268)
    del out[pos + 8 + 268 * 4:pos + 8 + 269 * 4]
    out += b"\0" * (-len(out) % 32) + data[-(-table_end // 32) * 32:]
    path.write_bytes(out)
    with pytest.raises(ValueError, match=rf"{path}: tokenizer.ggml.token_type has 268 entries, "
                                         r"tokenizer.ggml.tokens 269"):
        load_gguf(path, show_progress=False)


def test_valid_file_passes_check(tiny_bytes, work_dir):
    layout = check_gguf(_write(work_dir, tiny_bytes))
    assert layout.version == 3 and layout.alignment == 32
    assert layout.tensors[0].name == "token_embd.weight"
    assert layout.tensors[-1].start + layout.tensors[-1].nbytes == len(tiny_bytes)


# ---- the real-file cases (SmolLM2) ------------------------------------------

def _real_cases(src: pathlib.Path, out: pathlib.Path) -> dict[str, pathlib.Path]:
    """truncated to 1 MB, 5 more tensors / 5 more keys claimed (whole file), cut to 60%."""
    data = src.read_bytes()
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    more_tensors, more_keys = bytearray(data), bytearray(data)
    struct.pack_into("<Q", more_tensors, 8, n_tensors + 5)
    struct.pack_into("<Q", more_keys, 16, n_kv + 5)
    cases = {"trunc-1mb": data[:1 << 20], "more-tensors": more_tensors,
             "more-keys": more_keys, "cut-60": data[:len(data) * 6 // 10]}
    paths = {}
    for name, content in cases.items():
        paths[name] = out / f"{name}.gguf"
        paths[name].write_bytes(content)
    return paths


@pytest.fixture(scope="module")
def real_bad(smollm2_path, tmp_path_factory):
    return _real_cases(pathlib.Path(smollm2_path), tmp_path_factory.mktemp("real-bad"))


_REAL_MESSAGES = {
    "trunc-1mb": r"metadata 'tokenizer.ggml.merges' claims 48900 STRING items, more than",
    "more-tensors": r"tensor 272 \(of 277 the header claims\) name at byte \d+ claims",
    "more-keys": r"metadata key \d+ \(of 38 the header claims\)",
    "cut-60": r"tensor '[\w.]+' data \[\d+, \d+\) runs past the end of the file",
}


@pytest.mark.real_model
@pytest.mark.parametrize("case", sorted(_REAL_MESSAGES))
def test_real_file_cases(real_bad, case):
    path = real_bad[case]
    for read in (load_gguf_config, lambda p: load_gguf(p, show_progress=False),
                 loader.load_model_config):
        with _time_limit(_LIMIT_S), pytest.raises(ValueError, match=_REAL_MESSAGES[case]) as e:
            read(path)
        assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["generate", "serve"])
@pytest.mark.parametrize("case", ["trunc-1mb", "more-tensors", "more-keys", "cut-60"])
def test_real_file_cases_cli(real_bad, case, mode):
    """The CLI and ``--mode serve`` exit 2 with one ``error:`` line naming the file."""
    path = real_bad[case]
    args = (["--max_tokens", "1"] if mode == "generate"
            else ["--mode", "serve", "--port", "0", "--metrics_port", "-1"])
    result = subprocess.run([sys.executable, "-m", "jaxserve.main", "--model", str(path), *args],
                            capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}: "), result.stderr[-2000:]


# ---- safetensors (HF folders) -------------------------------------------------------

def _hf_folder(folder: pathlib.Path) -> pathlib.Path:
    """A two-tensor safetensors file in an otherwise valid-looking HF folder
    (the tensor table is what is under test, not the config)."""
    from safetensors.numpy import save_file
    folder.mkdir()
    save_file({"a": np.ones((4, 8), np.float32), "b": np.zeros((3,), np.float16)},
              folder / "model.safetensors")
    return folder / "model.safetensors"


def _with_header(header: dict, data: bytes = b"\0" * 200) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("name,content,match", [
    ("empty", lambda d: b"", r"0 bytes, too short for the 8-byte header length"),
    ("short", lambda d: d[:5], r"5 bytes, too short for the 8-byte header length"),
    ("huge-len", lambda d: struct.pack("<Q", 2**63) + d[8:], r"header length 9223372036854775808"),
    ("cut", lambda d: d[:len(d) - 10], r"truncated: tensor '\w' ends at byte \d+"),
    ("bad-json", lambda d: d[:8] + b"{" * (len(d) - 8), r"corrupt safetensors header"),
    ("not-utf8", lambda d: struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc", r"corrupt safetensors"),
    ("list", lambda d: _with_header([1, 2]), r"not a JSON object"),  # type: ignore[arg-type]
    ("beyond", lambda d: _with_header({"a": {"dtype": "F32", "shape": [4],
                                             "data_offsets": [0, 2**40]}}), r"truncated"),
    ("reversed", lambda d: _with_header({"a": {"dtype": "F32", "shape": [4],
                                               "data_offsets": [16, 0]}}), r"corrupt"),
    ("negative", lambda d: _with_header({"a": {"dtype": "F32", "shape": [-4],
                                               "data_offsets": [0, 16]}}), r"corrupt"),
    ("no-shape", lambda d: _with_header({"a": {"dtype": "F32", "data_offsets": [0, 16]}}),
     r"corrupt"),
    ("str-shape", lambda d: _with_header({"a": {"dtype": "F32", "shape": "4",
                                                "data_offsets": [0, 16]}}), r"corrupt"),
    ("float-offset", lambda d: _with_header({"a": {"dtype": "F32", "shape": [4],
                                                   "data_offsets": [0.5, 16]}}), r"corrupt"),
    ("size", lambda d: _with_header({"a": {"dtype": "F32", "shape": [5],
                                           "data_offsets": [0, 16]}}), r"spans 16 bytes"),
    ("overlap", lambda d: _with_header({"a": {"dtype": "F32", "shape": [4],
                                              "data_offsets": [0, 16]},
                                        "b": {"dtype": "F32", "shape": [4],
                                              "data_offsets": [8, 24]}}), r"overlaps"),
    ("entry", lambda d: _with_header({"a": 3}), r"corrupt safetensors header entry 'a'"),
])
def test_safetensors_corrupt(tmp_path, name, content, match):
    from checkpoints.hf_loader import read_safetensors, read_safetensors_header
    file = _hf_folder(tmp_path / name)
    file.write_bytes(content(file.read_bytes()))
    with pytest.raises(ValueError) as e:
        read_safetensors_header(file)
    message = str(e.value)
    assert message.startswith(f"{file}: ") and "\n" not in message, message
    assert re.search(match, message[len(f"{file}: "):]), message  # not in the path
    with pytest.raises(ValueError):
        read_safetensors(file, {"a": (4, 8)}, np.float32)


@_fuzz(60)
@given(st.data())
def test_fuzz_safetensors(tmp_path_factory, data):
    from checkpoints.hf_loader import read_safetensors, read_safetensors_header
    folder = tmp_path_factory.mktemp("st-fuzz")
    file = _hf_folder(folder / "m")
    raw = bytearray(file.read_bytes())
    header_end = 8 + struct.unpack_from("<Q", raw)[0]
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    file.write_bytes(raw)
    for read in (read_safetensors_header,
                 lambda f: read_safetensors(f, {"a": (4, 8), "b": (3,)}, np.float32)):
        with _time_limit(_LIMIT_S):
            try:
                read(file)
            except ValueError as e:
                assert str(e).startswith(f"{file}: ") and "\n" not in str(e), str(e)


@pytest.fixture(scope="module")
def hf_src(tiny_bytes, tmp_path_factory) -> pathlib.Path:
    """The tiny GGUF's params as a loadable HF folder (config.json + model.safetensors)."""
    from safetensors.numpy import save_file
    src = tmp_path_factory.mktemp("hf-src") / "tiny.gguf"
    src.write_bytes(tiny_bytes)
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    folder.mkdir()
    c = _CONFIG
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-5}))
    save_file(load_gguf(src, show_progress=False).params, folder / "model.safetensors")
    loader.load_checkpoint(folder, show_progress=False)  # the unmutated folder loads
    return folder


def _shift_first_end(d: bytes) -> bytes:
    """Move the first tensor's end offset past the data section (header rewritten)."""
    n = struct.unpack_from("<Q", d)[0]
    header = json.loads(d[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += len(d)
    return _with_header(header, d[8 + n:])


@pytest.mark.parametrize("case,corrupt,match", [
    ("truncated", lambda d: d[:len(d) * 2 // 3], r"truncated: tensor"),
    ("header-len", lambda d: struct.pack("<Q", len(d)) + d[8:], r"header length"),
    ("bad-json", lambda d: d[:8] + b"[" + d[9:], r"corrupt safetensors header"),
    ("outside", _shift_first_end, r"ends at byte \d+ of the data section"),
])
def test_hf_folder_corrupt(hf_src, tmp_path, case, corrupt, match):
    folder = _copy(hf_src, tmp_path / case)
    file = folder / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    for read in (lambda f: loader.load_checkpoint(f, show_progress=False),):
        with pytest.raises(ValueError, match=match) as e:
            read(folder)
        assert str(e.value).startswith(f"{file}: ") and "\n" not in str(e.value)


# ---- Orbax --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def orbax_src(tiny_bytes, tmp_path_factory) -> pathlib.Path:
    """A tiny GGUF converted to an Orbax folder (the pristine copy; tests copy it)."""
    src = tmp_path_factory.mktemp("orbax-src") / "tiny.gguf"
    src.write_bytes(tiny_bytes)
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    loader.convert_to_orbax(src, out, show_progress=False)
    return out


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def _orbax_reads(folder):
    return (loader.load_model_config(folder),
            loader.load_checkpoint(folder, show_progress=False))


def _json_edit(rel: str, edit):
    def apply(folder: pathlib.Path):
        path = folder / rel
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return apply


def _cut(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(data)


def _params_file(folder: pathlib.Path, name: str) -> pathlib.Path:
    return next(p for p in sorted((folder / "params").rglob("*")) if p.name == name)


@pytest.mark.parametrize("case,corrupt,where", [
    ("config-not-json", lambda f: (f / "model_config.json").write_text("{"), "model_config.json"),
    ("config-list", lambda f: (f / "model_config.json").write_text("[1]"), "model_config.json"),
    ("config-field", _json_edit("model_config.json", lambda c: {**c, "num_heads": -1}),
     "model_config.json"),
    ("config-unknown", _json_edit("model_config.json", lambda c: {**c, "bogus": 1}),
     "model_config.json"),
    ("config-shape", _json_edit("model_config.json", lambda c: {**c, "intermediate_size": 96}),
     "params"),
    ("config-layers", _json_edit("model_config.json", lambda c: {**c, "num_layers": 2}),
     "params"),
    ("info-not-json", lambda f: (f / "jaxserve_orbax.json").write_text("nope"),
     "jaxserve_orbax.json"),
    ("info-sizes", _json_edit("jaxserve_orbax.json", lambda i: {**i, "params_files": [1]}),
     "jaxserve_orbax.json"),
    ("info-size-type", _json_edit("jaxserve_orbax.json", lambda i: {
        **i, "params_files": {k: "big" for k in i["params_files"]}}), "jaxserve_orbax.json"),
    ("info-crc", _json_edit("jaxserve_orbax.json", lambda i: {
        **i, "params_crc32": {k: 1 for k in i["params_crc32"]}}), "params"),
    ("info-escape", _json_edit("jaxserve_orbax.json", lambda i: {
        **i, "params_files": {"../model_config.json": 1}}), "jaxserve_orbax.json"),
    ("info-metadata", _json_edit("jaxserve_orbax.json", lambda i: {**i, "metadata": [1]}),
     "jaxserve_orbax.json"),
    ("tok-meta", lambda f: (f / "tokenizer_meta.json").write_text("[]"), "tokenizer_meta.json"),
    ("tokenizer", lambda f: (f / "tokenizer.json").write_text("{}"), "tokenizer.json"),
    ("manifest", lambda f: _params_file(f, "manifest.ocdbt").write_bytes(b"x" * 10), "params"),
    ("shard-cut", lambda f: _cut(next((f / "params" / "d").iterdir())), "params"),
    ("shard-gone", lambda f: next((f / "params" / "d").iterdir()).unlink(), "params"),
    ("shard-flip", lambda f: _flip(next((f / "params" / "d").iterdir())), "params"),
    ("metadata-file", lambda f: (f / "params" / "_METADATA").write_text("{"), "params"),
])
def test_orbax_corrupt(orbax_src, tmp_path, case, corrupt, where):
    folder = _copy(orbax_src, tmp_path / case)
    corrupt(folder)
    with _time_limit(60), pytest.raises(ValueError) as e:
        _orbax_reads(folder)
    message = str(e.value)
    assert message.startswith(f"{folder}"), message
    assert where in message.split(": ")[0] and "\n" not in message, message


def test_orbax_no_info_file(orbax_src, tmp_path):
    """A folder without ``jaxserve_orbax.json`` (another tool's): a corrupt
    Orbax metadata file still ends in a ValueError naming the params folder."""
    folder = _copy(orbax_src, tmp_path / "no-info")
    (folder / "jaxserve_orbax.json").unlink()
    (folder / "params" / "_METADATA").write_text("{")
    with _time_limit(60), pytest.raises(ValueError, match=rf"^{folder / 'params'}: Orbax finds "
                                                          r"no tensor metadata"):
        _orbax_reads(folder)
