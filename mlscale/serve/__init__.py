"""The inference server: dynamic batching, response cache, backpressure, hot reload, metrics."""

from mlscale.serve.options import ServeOptions
from mlscale.serve.server import serve

__all__ = ["ServeOptions", "serve"]
