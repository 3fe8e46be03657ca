"""The servers we measure ourselves against, each a runnable module so it gets its own process:

- ``litserve``: LitServe with batching on, as its docs recommend (``max_batch_size``, ``batch_timeout``);
- ``fastapi``: a plain FastAPI endpoint that runs the model once per request;
- ``noop``: a Starlette endpoint that parses the JSON body and returns a fixed answer of the same size
  as a model's, the floor for any HTTP JSON server here.

All run the same ONNX file with onnxruntime on 1 thread. Usage:
``python -m mlscale.bench.anchors KIND ONNX_PATH PORT [MAX_BATCH] [BATCH_TIMEOUT_S]``.
"""

from __future__ import annotations

import sys

import numpy as np


def _session(path: str):
    from mlscale.export.onnx import onnx_session

    return onnx_session(path, threads=1)


def run_litserve(path: str, port: int, max_batch: int, timeout_s: float) -> None:
    import litserve as ls

    from mlscale.bench.litserve_api import OnnxAPI

    server = ls.LitServer(OnnxAPI(path, max_batch_size=max_batch, batch_timeout=timeout_s), accelerator="cpu",
                          workers_per_device=1)
    server.run(port=port, log_level="warning", generate_client_file=False, num_api_servers=1)


def run_fastapi(path: str, port: int) -> None:
    import uvicorn
    from fastapi import Body, FastAPI

    session = _session(path)
    app = FastAPI()

    @app.post("/predict")
    def predict(payload: dict[str, list[float]] = Body(...)) -> dict:  # noqa: B008 - FastAPI's idiom
        output = session.run(["output"], {"input": np.asarray([payload["input"]], dtype=np.float32)})[0]
        return {"output": output.reshape(-1).tolist()}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def run_noop(port: int) -> None:
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    answer = {"model_name": "noop", "model_version": "1", "outputs": [
        {"name": "output", "shape": [1, 10], "datatype": "FP32", "data": [0.123456789] * 10}]}

    async def noop(request: Request) -> Response:  # same JSON library and server stack as mlscale serve
        orjson.loads(await request.body())
        return Response(orjson.dumps(answer), media_type="application/json")

    app = Starlette(routes=[Route("/noop", noop, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "litserve":
        run_litserve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    elif kind == "fastapi":
        run_fastapi(sys.argv[2], int(sys.argv[3]))
    else:
        run_noop(int(sys.argv[3]))
