"""The servers we measure ourselves against, each a runnable module so it gets its own process:

- ``litserve``: LitServe with batching on, as its docs recommend (``max_batch_size``, ``batch_timeout``);
- ``litserve-tuned``: LitServe in the best configuration for one core we found (``litserve_config``);
- ``fastapi``: a plain FastAPI endpoint that runs the model once per request;
- ``noop``: a bare ASGI endpoint on uvicorn (the stack mlscale's inference routes run on) that parses
  the JSON body and returns a fixed answer of the same size as a model's: the floor for any HTTP JSON
  server here.

All run the same ONNX file with onnxruntime on 1 thread. Usage:
``python -m mlscale.bench.anchors KIND ONNX_PATH PORT [LITSERVE_CONFIG_JSON]``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

LITSERVE_SYSTEMS = ("litserve", "litserve-tuned")


def litserve_config(system: str, max_batch_size: int, batch_timeout_s: float) -> dict[str, Any]:
    """The LitServer, LitAPI and ``run`` settings of a LitServe system; the benchmark JSON records them.

    ``litserve`` is the docs' recommendation with the benchmark's shared batch size and delay.
    ``litserve-tuned`` is the fastest on one core of what we tried (``mlscale bench serve`` with
    ``--systems litserve,litserve-tuned``; see the README)."""
    config: dict[str, Any] = {"api": "numpy", "max_batch_size": max_batch_size, "batch_timeout": batch_timeout_s,
                              "workers_per_device": 1, "num_api_servers": 1, "api_server_worker_type": "process",
                              "fast_queue": False, "timeout": 30, "frozen_gc": False, "uvicorn": {}}
    if system == "litserve-tuned":
        config.update({"api": "lists", "frozen_gc": True})
    config.update(json.loads(os.environ.get("MLSCALE_LITSERVE_TRY", "{}")) if system == "litserve-tuned" else {})
    return config


def _session(path: str):
    from mlscale.export.session import onnx_session

    return onnx_session(path, threads=1)


def _fix_fast_queue(server: Any) -> None:
    """LitServe 0.2.19 drops ``fast_queue`` (LitServe issue #751) and wires ZeroMQ backwards; PR #752's fix."""
    from litserve.transport import factory
    from litserve.transport.zmq_transport import ZMQTransport

    def create(config: Any) -> ZMQTransport:
        broker = factory.Broker()
        broker.start()
        config.frontend_address, config.backend_address = broker.frontend_address, broker.backend_address
        return ZMQTransport(backend_address=broker.backend_address, frontend_address=broker.frontend_address)

    factory._create_zmq_transport = create
    server.transport_config.transport_type = "zmq"


def run_litserve(path: str, port: int, config: dict[str, Any]) -> None:
    import litserve as ls

    from mlscale.bench.litserve_api import APIS, freeze_gc

    api = APIS[config["api"]](path, max_batch_size=config["max_batch_size"], batch_timeout=config["batch_timeout"],
                              frozen_gc=config["frozen_gc"])
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=config["workers_per_device"],
                          fast_queue=config["fast_queue"], timeout=config["timeout"])
    if config.get("fix_fast_queue"):
        _fix_fast_queue(server)
    if config["frozen_gc"]:
        freeze_gc()  # before run() forks the Manager and the API server, which inherit the frozen heap
    server.run(port=port, log_level="warning", generate_client_file=False, num_api_servers=config["num_api_servers"],
               api_server_worker_type=config["api_server_worker_type"], **config["uvicorn"])


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
    if kind in LITSERVE_SYSTEMS:
        run_litserve(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    elif kind == "fastapi":
        run_fastapi(sys.argv[2], int(sys.argv[3]))
    else:
        run_noop(int(sys.argv[3]))
