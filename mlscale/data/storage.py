"""Where a data set's files are: a local folder, or object storage through fsspec (``s3://bucket/prefix``,
``gs://``, ``az://``, ``hf://``... whatever fsspec has a filesystem for, installed).

Object storage is configured the standard way, never by mlscale: for S3, ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` (and the rest of botocore's environment and files).
Reads are retried with exponential backoff on errors that can pass (a dropped connection, a timeout, a
throttled request); a missing bucket or object is not retried and is one line naming it.

``ObjectCache`` keeps the bytes of the objects read in a local folder bounded in bytes (``--data-cache-mb``):
the second epoch reads the local copies, and a host's ranks share one folder. Past the bound the
least-recently used copies go (a copy's modification time is its last use). Every process writes whole
files under a temporary name and renames them, so a reader never takes a partial copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mlscale.errors import UsageError

T = TypeVar("T")
RETRIES = 4  # tries in all
BACKOFF_S = 0.2  # the first wait; each next one 4 times the last (0.2, 0.8, 3.2 s)
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)


def is_remote(root: str | Path) -> bool:
    """Whether ``root`` names object storage (a URL with a scheme other than ``file``)."""
    text = str(root)
    return "://" in text and not text.startswith("file://")


def with_retries(what: str, call: Callable[[], T], tries: int = RETRIES, backoff_s: float = BACKOFF_S) -> T:
    """``call()``, tried again after a growing wait when it fails in a way that can pass; a permanent failure
    (the object is not there, access denied) at once."""
    for attempt in range(tries):
        try:
            return call()
        except PERMANENT:
            raise
        except Exception as exc:  # network and service errors, as the filesystem raises them
            if attempt == tries - 1:
                raise OSError(f"{what}: failed {tries} times, the last with {type(exc).__name__}: {exc}") from None
            time.sleep(backoff_s * 4**attempt)
    raise AssertionError("unreachable")


class Store:
    """A folder or an object-storage prefix, listed and read by paths relative to it. The fsspec filesystem
    is made in each process that uses it (one made before a DataLoader forked its workers is not reused:
    clients of object storage are not fork-safe)."""

    def __init__(self, root: str | Path) -> None:
        self.root = str(root).rstrip("/")
        self.cache: ObjectCache | None = None
        self._fs: Any = None
        self._pid = -1

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            try:
                protocol = fsspec.utils.get_protocol(self.root)
                self._fs = fsspec.filesystem(protocol, skip_instance_cache=True)
            except (ImportError, ValueError) as exc:
                raise UsageError(f"bad value root={self.root!r}: {exc} (object storage needs its fsspec package, "
                                 "e.g. pip install 'mlscale[s3]')") from None
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}  # a spawned worker makes its own

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def walk(self) -> dict[str, list[str]]:
        """Each top-level folder (prefix) of the root and the files below it, relative to the root, sorted. A
        root that is not there, or not readable, is one line."""
        try:
            found = with_retries(f"listing {self.root}", lambda: self.fs.find(self.root, withdirs=False))
        except (OSError, PermissionError) as exc:
            raise UsageError(f"bad value root={self.root!r}: cannot list it ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else 'not found'})") from None
        base = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        tree: dict[str, list[str]] = {}
        for path in sorted(found):
            relative = path[len(base):] if path.startswith(base) else path
            folder, _, name = relative.partition("/")
            if name and "/" not in name and not folder.startswith("."):
                tree.setdefault(folder, []).append(name)
        return tree

    def read(self, relative: str) -> bytes:
        """An object's bytes: the local copy when the cache has one, else fetched (retried) and kept."""
        url = self.url(relative)
        if self.cache is not None:
            kept = self.cache.get(url)
            if kept is not None:
                return kept
        data: bytes = with_retries(f"reading {url}", lambda: self.fs.cat_file(url))
        if self.cache is not None:
            self.cache.put(url, data)
        return data


class ObjectCache:
    """Objects' bytes in ``directory``, at most ``limit_bytes`` of them (least recently used go first)."""

    CHECK_EVERY = 64  # puts between scans of the folder's real size (other processes write into it too)

    def __init__(self, directory: Path, limit_bytes: int) -> None:
        self.directory, self.limit = directory, limit_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._written, self._puts = 0, 0

    def _path(self, url: str) -> Path:
        return self.directory / hashlib.sha256(url.encode()).hexdigest()

    def get(self, url: str) -> bytes | None:
        path = self._path(url)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        os.utime(path)  # used now: the last to go
        return data

    def put(self, url: str, data: bytes) -> None:
        if len(data) > self.limit:
            return
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".part")
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, self._path(url))
        self._written += len(data)
        self._puts += 1
        if self._written > self.limit // 8 or self._puts % self.CHECK_EVERY == 0:
            self.trim()

    def local_copy(self, url: str, fetch: Callable[[str], None]) -> Path:
        """The path of ``url``'s local copy, made by ``fetch(temporary_path)`` when there is none. The
        processes of a host take turns (a lock a URL), so an object is fetched once, not once per worker."""
        path = self._path(url)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".part")
                os.close(handle)
                try:
                    fetch(temporary)
                    os.replace(temporary, path)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temporary)
                self._written += path.stat().st_size
                if self._written > self.limit // 8:
                    self.trim()
        os.utime(path)
        return path

    def trim(self) -> None:
        """Remove the least recently used copies until the folder holds at most the limit."""
        self._written = 0
        files = []
        for entry in os.scandir(self.directory):
            if entry.is_file() and not entry.name.endswith((".part", ".lock")):
                stat = entry.stat()
                files.append((stat.st_mtime_ns, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.limit:
                break
            with contextlib.suppress(FileNotFoundError):  # another process took it
                os.unlink(path)
            total -= size

    @property
    def size_bytes(self) -> int:
        return sum(entry.stat().st_size for entry in os.scandir(self.directory)
                   if entry.is_file() and not entry.name.endswith(".lock"))


__all__ = ["ObjectCache", "Store", "is_remote", "with_retries"]
