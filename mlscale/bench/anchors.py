"""The servers we measure ourselves against, each a runnable module so it gets its own process:

- ``litserve``: LitServe with batching on, as its docs recommend (``max_batch_size``, ``batch_timeout``);
- ``litserve-tuned``: the same in the best configuration for one core we found (``litserve_config``);
- ``fastapi``: a plain FastAPI endpoint that runs the model once per request;
- ``noop``: a bare ASGI endpoint on uvicorn (the stack mlscale's inference routes run on) that parses
  the JSON body and returns a fixed answer of the same size as a model's: the floor for any HTTP JSON
  server here.

All run the same ONNX file with onnxruntime on 1 thread. A LitServe server is 5 processes, all on the one
server core: the launcher, a ``multiprocessing`` Manager holding the request and response queues (every
put and get is a round trip to it), multiprocessing's resource tracker, the uvicorn API server and the
inference worker. Usage:
``python -m mlscale.bench.anchors KIND ONNX_PATH PORT [LITSERVE_CONFIG_JSON]``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import orjson

from mlscale.export.session import onnx_session

LITSERVE_SYSTEMS = ("litserve", "litserve-tuned")


def litserve_config(system: str, max_batch_size: int, batch_timeout_s: float) -> dict[str, Any]:
    """The settings of a LitServe system, every one spelled out so the benchmark JSON records them.

    ``litserve`` is LitServe as its docs recommend, with the benchmark's shared batch size and delay.
    ``litserve-tuned`` is the fastest on one core of what we tried: the same, with the garbage
    collector's heap frozen after start-up (``freeze_gc``), as ``mlscale serve`` does. None of
    LitServe's own knobs beat its defaults here: ``fast_queue`` does nothing in 0.2.19 (LitServe issue
    #751) and with that fixed it was no faster; a second API server or inference worker only adds
    processes to the core; ``batch_timeout=0`` busy-polls the queue and ``max_batch_size=1`` runs the
    2048-wide MLP a row at a time; 2, 5 and 20 ms timeouts, untyped or orjson-encoded request and
    response, no access log, a thread API server and ``timeout=False`` were no faster than these."""
    return {"max_batch_size": max_batch_size, "batch_timeout": batch_timeout_s, "workers_per_device": 1,
            "num_api_servers": 1, "api_server_worker_type": "process", "fast_queue": False, "timeout": 30,
            "frozen_gc": system == "litserve-tuned"}


def _session(path: str):
    return onnx_session(path, threads=1)


def run_litserve(path: str, port: int, config: dict[str, Any]) -> None:
    import litserve as ls

    from mlscale.bench.litserve_api import OnnxAPI, freeze_gc

    api = OnnxAPI(path, max_batch_size=config["max_batch_size"], batch_timeout=config["batch_timeout"],
                  frozen_gc=config["frozen_gc"])
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=config["workers_per_device"],
                          fast_queue=config["fast_queue"], timeout=config["timeout"])
    if config["frozen_gc"]:
        freeze_gc()  # before run() forks the Manager and the API server, which inherit the frozen heap
    server.run(port=port, log_level="warning", generate_client_file=False, num_api_servers=config["num_api_servers"],
               api_server_worker_type=config["api_server_worker_type"])


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
    if kind in LITSERVE_SYSTEMS:
        run_litserve(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    elif kind == "fastapi":
        run_fastapi(sys.argv[2], int(sys.argv[3]))
    else:
        run_noop(int(sys.argv[3]))
