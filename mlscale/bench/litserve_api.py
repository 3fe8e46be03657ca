"""The LitServe API used as an anchor: batched onnxruntime inference, as LitServe's docs recommend.

A module of its own (imports litserve at the top) so LitServe's worker processes can unpickle it.
"""

from __future__ import annotations

import gc

import litserve as ls
import numpy as np

from mlscale.export.session import onnx_session


def freeze_gc() -> None:
    """Move everything alive now (imports, the model) out of the garbage collector's reach, as ``mlscale
    serve`` does at start-up. Else every full collection walks it all: in LitServe's API server, forked
    from a launcher that imported FastAPI, NumPy and LitServe, those pauses stalled every request in
    flight often enough to set p99 (goodput ~390/s on the 2048-wide MLP with them, ~850/s without)."""
    gc.collect()
    gc.freeze()


class OnnxAPI(ls.LitAPI):
    def __init__(self, path: str, *, frozen_gc: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.path, self.frozen_gc = path, frozen_gc

    def setup(self, device: str) -> None:
        self.session = onnx_session(self.path, threads=1)
        if self.frozen_gc:  # the inference worker is spawned, not forked: it freezes its own heap
            freeze_gc()

    # decode_request and encode_response carry no type hints, as in LitServe's docs: LitServe builds
    # FastAPI's request and response handling from them, and typed ones made FastAPI allocate more per
    # request (more garbage-collector pauses: the default anchor's goodput halved on the 2048-wide MLP).
    def decode_request(self, request):
        return np.asarray(request["input"], dtype=np.float32)

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        batch = x if x.ndim == 2 else x[None, :]
        return self.session.run(["output"], {"input": batch})[0]

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output):
        return {"output": np.asarray(output).reshape(-1).tolist()}
