"""Atomic file writes: a reader sees the old file or the complete new one, never a torn one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
