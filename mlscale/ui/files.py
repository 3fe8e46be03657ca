"""Reading a runs folder that others write to, as untrusted data.

``--runs`` is often a shared volume: anyone who can write there can plant a symlink to ``/dev/zero`` or to
a file they may not read themselves, a FIFO that blocks its reader for ever, or a file of gigabytes. So the
UI reads a run's files only through ``RunsFolder``: a path is opened only if its real path lies inside the
folder's real path (checked on the open descriptor, so a symlink swapped in between check and open does not
escape), only if it is a regular file, opened non-blocking (a FIFO never blocks), and read with a byte
bound. Everything refused or cut raises ``Unreadable`` with a short reason the page can show.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import orjson

JSON_BYTES = 4 << 20  # config.json, report.json, plan.json: far beyond what a run writes
RECORDS_BYTES = 16 << 20  # faults, failures, recovery, replica logs: each file
LISTED = 1024  # entries looked at in one folder (heartbeats, replica logs, run folders)


class Unreadable(Exception):
    """A run file the UI will not read: the message is the short reason shown on the page."""


class RunsFolder:
    """The folder ``--runs`` names; every file the UI reads is opened through ``open``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.real = Path(os.path.realpath(root))

    def inside(self, path: Path) -> bool:
        """Whether ``path``, symlinks resolved, lies at or under the folder."""
        real = os.path.realpath(path)
        return real == str(self.real) or real.startswith(str(self.real) + os.sep)

    def _open(self, path: Path) -> int:
        """A descriptor of ``path``: a regular file inside the folder, or ``Unreadable``."""
        if not self.inside(path):
            raise Unreadable(f"{path.name} leads outside the runs folder")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise Unreadable(f"{path.name}: {exc.strerror or exc}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Unreadable(f"{path.name} is not a regular file")
            held = f"/proc/self/fd/{fd}"  # what was opened, not what the name leads to now
            if os.path.exists(held) and not self.inside(Path(os.readlink(held))):
                raise Unreadable(f"{path.name} leads outside the runs folder")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, path: Path, limit: int, offset: int = 0) -> bytes:
        """At most ``limit`` bytes of ``path`` from ``offset`` (FileNotFoundError when there is none)."""
        fd = self._open(path)
        try:
            chunks, left = [], limit
            while left > 0:
                chunk = os.pread(fd, min(left, 1 << 20), offset)
                if not chunk:
                    break
                chunks.append(chunk)
                offset += len(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                raise Unreadable(f"{path.name} would block") from None
            raise Unreadable(f"{path.name}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def size(self, path: Path) -> int | None:
        """The size of a regular file inside the folder; None when there is none or it is refused."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) and self.inside(path) else None

    def json(self, path: Path, limit: int = JSON_BYTES) -> Any:
        """A JSON file's value (None when there is none); ``Unreadable`` when it is refused, larger than
        ``limit`` or not JSON."""
        try:
            data = self.read(path, limit + 1)
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise Unreadable(f"{path.name} is larger than {limit >> 20} MB")
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            raise Unreadable(f"{path.name} is not JSON") from None

    def records(self, path: Path, limit: int = RECORDS_BYTES) -> list[dict[str, Any]]:
        """A JSONL file's objects, lines that do not parse (torn by a writer that died) skipped; only its
        first ``limit`` bytes are read. [] when there is none or it is refused."""
        try:
            data = self.read(path, limit)
        except (FileNotFoundError, Unreadable):
            return []
        if len(data) == limit:
            data = data[:data.rfind(b"\n") + 1]
        out = []
        for line in data.splitlines():
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def listing(self, folder: Path, limit: int = LISTED) -> Iterator[os.DirEntry[str]]:
        """At most ``limit`` entries of ``folder`` (none when it is not a folder inside this one)."""
        if not self.inside(folder):
            return iter(())
        try:
            with os.scandir(folder) as entries:
                return iter(list(islice(entries, limit)))
        except OSError:
            return iter(())
