"""One worker of a server of several (``mlscale serve --workers N``): started by the supervisor
(``workers.py``) with its death signal set already, it reads its spec from standard input, inherits the
listening socket and runs a server as ``mlscale serve`` runs one, sharing readiness and metrics with
the others (``peers.py``)."""

from __future__ import annotations

import json
import socket
import sys

from mlscale.errors import MlscaleError, report_error
from mlscale.serve.options import ServeOptions
from mlscale.serve.peers import Peers
from mlscale.serve.server import run_server


def worker_main() -> int:
    """The spec from standard input, the listening socket inherited, then the server; the exit code."""
    spec = json.loads(sys.stdin.buffer.read())
    options = ServeOptions(**spec["options"])
    sock = socket.socket(fileno=spec["fd"])
    peers = Peers(spec["directory"], options.worker_count, spec["index"], spec["generation"])
    try:
        run_server(spec["uris"], options, spec["registry"], sock, peers=peers)
    except MlscaleError as exc:
        return report_error(exc)
    return 0
