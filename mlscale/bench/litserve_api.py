"""The LitServe APIs used as anchors: batched onnxruntime inference, as LitServe's docs recommend.

A module of its own (imports litserve at the top) so LitServe's worker processes can unpickle it.
``OnnxAPI`` is the docs' shape (numpy per request, typed ``dict`` in and out); ``ListsOnnxAPI`` accepts
the same JSON and answers the same JSON with less work per request (see its docstring).
"""

from __future__ import annotations

import gc

import litserve as ls
import numpy as np


def freeze_gc() -> None:
    """Move everything alive now (imports, the model) out of the garbage collector's reach, as ``mlscale
    serve`` does at start-up: else each full collection walks it all, a pause that stalls every request
    in flight (LitServe's API server, forked from a launcher that imported FastAPI and NumPy, paused
    often enough under load to set p99)."""
    gc.collect()
    gc.freeze()


class OnnxAPI(ls.LitAPI):
    def __init__(self, path: str, *, frozen_gc: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.path, self.frozen_gc = path, frozen_gc

    def setup(self, device: str) -> None:
        from mlscale.export.session import onnx_session

        self.session = onnx_session(self.path, threads=1)
        if self.frozen_gc:
            freeze_gc()

    def decode_request(self, request: dict) -> np.ndarray:
        return np.asarray(request["input"], dtype=np.float32)

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        batch = x if x.ndim == 2 else x[None, :]
        return self.session.run(["output"], {"input": batch})[0]

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict:
        return {"output": np.asarray(output).reshape(-1).tolist()}


class ListsOnnxAPI(OnnxAPI):
    """The same model and JSON, with the per-request work cut: one ``np.asarray`` and one ``tolist`` per
    batch instead of one per request, and no type annotations on ``decode_request``/``encode_response``,
    so LitServe's endpoint reads the body with ``request.json()`` and FastAPI skips validating the
    request and response against ``dict`` (LitServe derives the endpoint's types from them)."""

    def decode_request(self, request):  # unannotated on purpose, see the class
        return request["input"]

    def batch(self, inputs: list[list[float]]) -> np.ndarray:
        return np.asarray(inputs, dtype=np.float32)

    def predict(self, x: np.ndarray | list[float]) -> np.ndarray:
        return super().predict(np.asarray(x, dtype=np.float32))  # a list when unbatched (max_batch_size 1)

    def unbatch(self, output: np.ndarray) -> list[list[float]]:
        return output.reshape(len(output), -1).tolist()

    def encode_response(self, output):  # unannotated on purpose, see the class
        return {"output": output if isinstance(output, list) else output.reshape(-1).tolist()}


class BytesOnnxAPI(ListsOnnxAPI):
    """``ListsOnnxAPI`` that encodes its answer with orjson in the inference worker and hands the API server
    a ready ``Response`` (LitServe's documented way to return non-JSON bodies), which FastAPI sends as is
    instead of walking the dict with ``jsonable_encoder``."""

    def encode_response(self, output):  # unannotated on purpose, see ListsOnnxAPI
        import orjson
        from starlette.responses import Response

        return Response(orjson.dumps(super().encode_response(output)), media_type="application/json")


APIS: dict[str, type[OnnxAPI]] = {"numpy": OnnxAPI, "lists": ListsOnnxAPI, "bytes": BytesOnnxAPI}
