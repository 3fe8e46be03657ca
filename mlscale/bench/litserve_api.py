"""The LitServe API used as an anchor: batched onnxruntime inference, as LitServe's docs recommend.

A module of its own (imports litserve at the top) so LitServe's worker processes can unpickle it.
"""

from __future__ import annotations

import litserve as ls
import numpy as np


class OnnxAPI(ls.LitAPI):
    def __init__(self, path: str, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.path = path

    def setup(self, device: str) -> None:
        from mlscale.export.session import onnx_session

        self.session = onnx_session(self.path, threads=1)

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
