"""The servers we measure ourselves against, each a runnable module so it gets its own process:

- ``litserve``: LitServe with batching on, as its docs recommend (``max_batch_size``, ``batch_timeout``);
- ``fastapi``: a plain FastAPI endpoint that runs the model once per request;
- ``noop``: a bare ASGI endpoint on uvicorn (the stack mlscale's inference routes run on) that parses
  the JSON body and returns a fixed answer of the same size as a model's: the floor for any HTTP JSON
  server here.

All run the same ONNX file with onnxruntime on 1 thread. Usage:
``python -m mlscale.bench.anchors KIND ONNX_PATH PORT [MAX_BATCH] [BATCH_TIMEOUT_S]``.
"""

from __future__ import annotations

import sys

import numpy as np


def _session(path: str):
    from mlscale.export.session import onnx_session

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

    answer = orjson.dumps({"model_name": "noop", "model_version": "1", "outputs": [
        {"name": "output", "shape": [1, 10], "datatype": "FP32", "data": [0.123456789] * 10}]})
    head = {"type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]}

    async def noop(scope: dict, receive, send) -> None:  # the same server stack as mlscale's inference routes
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        orjson.loads(body)
        await send(head)
        await send({"type": "http.response.body", "body": answer})

    uvicorn.run(noop, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                proxy_headers=False, server_header=False, date_header=False)


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "litserve":
        run_litserve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    elif kind == "fastapi":
        run_fastapi(sys.argv[2], int(sys.argv[3]))
    else:
        run_noop(int(sys.argv[3]))
