"""Artifact storage behind a small interface: files in a folder today, an object store later.

Every artifact is addressed by a key (``NAME/VERSION/FILE``), written once and atomically, recorded
with its SHA-256 at registration, and verified on every fetch, so a tampered or truncated file is
refused. ``fetch_bytes`` returns the very bytes it hashed: what is loaded is what was verified, even if
the file is replaced a moment later (a path, from ``fetch``, would be opened a second time).
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlscale.common.io import atomic_write
from mlscale.errors import MlscaleError

OWNER_MARK = ".owner"  # in each version's folder: the identity of the registry whose folder it is


class ArtifactIntegrityError(MlscaleError):
    """An artifact's bytes are not the ones registered."""


class ArtifactExists(MlscaleError):
    """An artifact is write-once: a file is already stored under this key."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class StoredArtifact:
    key: str
    sha256: str
    size_bytes: int


class ArtifactStore(Protocol):
    def put(self, key: str, source: Path) -> StoredArtifact: ...

    def fetch(self, key: str, sha256: str) -> Path: ...

    def fetch_bytes(self, key: str, sha256: str) -> bytes: ...

    def digest(self, key: str) -> str: ...

    def move_prefix(self, source: str, target: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...


def _verified(key: str, registered: str, actual: str) -> None:
    if actual != registered:
        raise ArtifactIntegrityError(f"artifact {key} is damaged or was changed: SHA-256 {actual[:12]}... "
                                     f"differs from the registered {registered[:12]}...; refusing to load it")


def _owner(folder: Path) -> str | None:
    mark = folder / OWNER_MARK
    return mark.read_text().strip() if mark.is_file() else None


class LocalArtifactStore:
    """Artifacts as files under ``root``; ``fetch`` returns a verified local path."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise MlscaleError(f"artifact key {key!r} escapes the artifact root")
        return path

    def put(self, key: str, source: Path) -> StoredArtifact:
        """Store a copy of ``source`` under ``key``, atomically and once: a reader never sees a partial
        file, and an existing artifact is never overwritten (``ArtifactExists``)."""
        target = self._path(key)
        try:
            atomic_write(target, lambda tmp: shutil.copyfile(source, tmp), exclusive=True)
        except FileExistsError:
            raise ArtifactExists(f"artifact {key} is already stored; artifacts are write-once") from None
        return StoredArtifact(key, sha256_file(target), target.stat().st_size)

    def fetch(self, key: str, sha256: str) -> Path:
        """A local path whose file had the registered SHA-256 when it was checked; opening it again may
        read other bytes: to load an artifact, use ``fetch_bytes``."""
        path = self._path(key)
        if not path.is_file():
            raise ArtifactIntegrityError(f"artifact {key} is missing from {self.root}")
        _verified(key, sha256, sha256_file(path))
        return path

    def fetch_bytes(self, key: str, sha256: str) -> bytes:
        """The artifact's bytes, read once and checked against the registered SHA-256: the bytes
        returned are the bytes hashed."""
        path = self._path(key)
        try:
            with path.open("rb") as handle:
                data = handle.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactIntegrityError(f"artifact {key} is missing from {self.root}") from None
        _verified(key, sha256, hashlib.sha256(data).hexdigest())
        return data

    def digest(self, key: str) -> str:
        """The SHA-256 of what is stored under ``key`` now."""
        return sha256_file(self._path(key))

    def move_prefix(self, source: str, target: str) -> None:
        """Rename a folder of artifacts. An existing ``target`` is replaced only when it carries the same
        owner mark as ``source`` (a leftover of the same registry); anything else is refused, never
        overwritten: two registries sharing one artifact folder must not replace each other's files."""
        src, dst = self._path(source), self._path(target)
        if dst.exists():
            owner = _owner(dst)
            if owner is None or owner != _owner(src):
                raise ArtifactExists(f"artifacts {target} already exist in {self.root} and belong to another "
                                     "registry (or to none): give each registry its own artifact folder "
                                     "($MLSCALE_ARTIFACTS), or remove the leftover folder")
            shutil.rmtree(dst)
        src.rename(dst)

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)
