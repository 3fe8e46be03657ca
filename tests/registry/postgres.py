"""A throwaway PostgreSQL server for tests: initdb into a temporary folder, listen on 127.0.0.1 only.

Uses the server binaries of the machine (Debian's postgresql package); runs them as the ``postgres``
user when the tests run as root, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(candidates[-1]) if candidates else None


def available() -> bool:
    return bool(_binary("initdb") and _binary("pg_ctl"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def temporary_server() -> Iterator[str]:
    """Yields a SQLAlchemy URL of a fresh database; stops the server and removes its files afterwards."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    folder = Path(tempfile.mkdtemp(prefix="mlscale-pg-"))  # not under pytest's tmp: postgres must reach it
    data = folder / "pgdata"
    if as_user:
        shutil.chown(folder, "postgres")
    port = _free_port()
    subprocess.run([*as_user, _binary("initdb"), "-D", str(data), "-A", "trust", "-U", "mlscale"], check=True,
                   capture_output=True, timeout=120)
    subprocess.run([*as_user, _binary("pg_ctl"), "-D", str(data), "-l", str(folder / "log"), "-w", "-o",
                    f"-c listen_addresses=127.0.0.1 -p {port} -k {folder}", "start"], check=True,
                   capture_output=True, timeout=120)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        yield f"postgresql+psycopg://mlscale@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, _binary("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
