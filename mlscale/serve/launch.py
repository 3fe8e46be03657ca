"""``serve``: the Python API's and ``mlscale serve``'s start of a server, one process (``server.py``) or
a supervisor of several workers (``workers.py``)."""

from __future__ import annotations

import logging

from mlscale.serve.options import ServeOptions
from mlscale.serve.server import bind, run_server
from mlscale.serve.workers import supervise


def serve(uris: list[str], *, options: ServeOptions | None = None, registry_location: str | None = None,
          log_level: str = "warning") -> int:
    """Serve until a signal; the exit code. Several workers (``options.workers``): see ``workers.py``."""
    options = options or ServeOptions()
    logging.basicConfig(level=logging.WARNING, format="mlscale serve: %(message)s")
    if options.worker_count > 1:
        return supervise(uris, options, registry_location)
    sock = bind(options.host, options.port)
    run_server(uris, options, registry_location, sock, log_level=log_level, announce=True)
    return 0
