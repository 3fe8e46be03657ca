"""The inference server: dynamic batching, response cache, backpressure, hot reload, metrics.

Its names are imported on first use, so that reading the options (``mlscale serve --help``) does not
start up the server's stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlscale.common.lazy import lazy_names

if TYPE_CHECKING:
    from mlscale.serve.launch import serve
    from mlscale.serve.options import ServeOptions

__all__ = ["ServeOptions", "serve"]

__getattr__, __dir__ = lazy_names(__name__, {"ServeOptions": "mlscale.serve.options", "serve": "mlscale.serve.launch"})
