"""Atomic file writes: a reader sees the old file or the complete new one, never a torn one. And JSONL
record files (one JSON object per line, appended): a process killed mid-append leaves a torn last line,
which ``read_jsonl`` skips and ``append_jsonl`` cuts off before it appends (the next record would
otherwise be glued to it, and the whole line lost)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from mlscale.errors import MlscaleError


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None], *, exclusive: bool = False) -> Path:
    """Call ``write(tmp_path)``, fsync it, then rename over ``path`` (same folder, so atomic).

    ``exclusive``: write-once. The complete file is hard-linked into place instead, which fails with
    ``FileExistsError`` if ``path`` exists (checked and done in one step by the file system, so two
    writers racing for the same path cannot both win) and leaves the existing file untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        if exclusive:
            os.link(tmp, path)
            tmp.unlink()
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_json(path: str | Path, data: Any) -> Path:
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def _end_of_last_line(handle: BinaryIO, size: int) -> int:
    """The offset just past the last newline of an open file of ``size`` bytes (0: none)."""
    position = size
    while position > 0:
        start = max(0, position - (1 << 16))
        handle.seek(start)
        block = handle.read(position - start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0


def _cut_torn_line(handle: BinaryIO) -> None:
    size = handle.seek(0, os.SEEK_END)
    if size:
        handle.seek(size - 1)
        if handle.read(1) != b"\n":
            handle.truncate(_end_of_last_line(handle, size))


def repair_jsonl(path: str | Path) -> None:
    """Cut off a torn last line (no newline: its writer died mid-write), if there is one: what a writer
    that keeps the file open for appending calls once before it opens it."""
    try:
        with Path(path).open("r+b") as handle:
            _cut_torn_line(handle)
    except FileNotFoundError:
        pass


def append_jsonl(path: str | Path, record: Any) -> None:
    """Append ``record`` as one line. A torn last line (no newline: its writer died mid-write) is cut
    off first, so this record starts a line of its own. One writer per file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record) + "\n").encode()
    with path.open("a+b") as handle:  # appends at the end whatever was read or truncated before
        _cut_torn_line(handle)
        handle.write(line)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records (JSON objects) of a file that several processes append to side by side (each rank's
    faults and failures): any line one of them tore is skipped."""
    return [record for record in read_jsonl(path, many_writers=True) if isinstance(record, dict)]


def read_jsonl(path: str | Path, *, many_writers: bool = False) -> list[Any]:
    """The records of a JSONL file ([] if there is none). A torn last line (no newline, or one that does
    not parse) is skipped: its writer died while writing it. A bad line before the last one is damage
    that no crash explains: an ``MlscaleError`` naming the file and line. ``many_writers``: processes
    append to the file side by side (each rank's failures), so a line any of them tore may be followed
    by others' lines: every line that does not parse is skipped."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    lines.pop()  # after the last newline: b"" for a complete file, else a torn line
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if many_writers or number == len(lines):  # torn, then ended by a newline
                continue
            raise MlscaleError(f"{path}:{number} is not a JSON record (the file is damaged); move the line "
                               "away or delete it to go on") from None
    return records
