"""``mlscale bench generate``'s model, and mlscale measured as users reach it: through ``mlscale serve``.

The tiny Llama is a declared task (``bench_llama``), so that it is registered and served as a user's model
is: its weights written as a finished run's, ``register_run``, then ``mlscale serve`` in its own process
(torch runtime, one worker) with the engine sized as the in-process systems are. The client streams
``POST /v1/completions`` (``stream: true``, the prompt as token ids: the version has no tokenizer, so each
server-sent event carries its ``token_ids``) over a connection of its own per request, and keeps the time
each event arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlscale import Task, TensorData, declare_task
from mlscale.bench.generate_systems import Request, TokenTimes, replay
from mlscale.rundir import RunDir

VOCAB = 1024
MODEL_NAME = "bench-llama"


def build_model(layers: int, hidden: int, context: int) -> nn.Module:
    """A Llama from its config: 4 query heads sharing 2 KV heads, no end-of-sequence token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def _lm_metrics(output: Any, targets: torch.Tensor) -> dict[str, float]:
    return {"loss": _lm_loss(output, targets).item()}


@declare_task
def bench_llama(layers: int = 4, hidden: int = 128, context: int = 1024) -> Task:
    """The benchmark's Llama as a task (its data: random token ids, only to give serving its signature)."""
    ids = torch.randint(1, VOCAB, (8, 17), generator=torch.Generator().manual_seed(0))
    data = TensorData(ids[:, :-1].clone(), ids[:, 1:].clone())
    return Task(name="bench_llama", build_model=lambda: build_model(layers, hidden, context), train=data, eval=data,
                loss_fn=_lm_loss, metrics_fn=_lm_metrics, info={"vocab": VOCAB, "seq_len": 16})


def register(model: nn.Module, options: dict[str, int], scratch: Path) -> str:
    """The model registered as a finished run's final weights; returns the registry's folder."""
    from mlscale import TrainConfig
    from mlscale.registry import Registry, register_run

    run = RunDir(scratch / "run")
    config = TrainConfig(task="mlscale.bench.generate_server:bench_llama", task_options=options, run_dir=str(run.path))
    run.write_config(config.model_dump(mode="json"))
    run.write_final_model(model)
    run.write_report({"status": "completed", "steps": 0})
    register_run(Registry(str(scratch / "registry")), run.path, MODEL_NAME)
    return str(scratch / "registry")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(process: subprocess.Popen[bytes], base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlscale serve exited with {process.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/v2/health/ready", timeout=1) as answer:
            if answer.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"mlscale serve was not ready after {timeout_s:.0f} s")


@contextlib.contextmanager
def serving(registry: str, engine: dict[str, Any], threads: int, timeout_s: float = 120.0) -> Iterator[str]:
    """``mlscale serve`` of the registered model in its own process; yields its base URL."""
    port = _free_port()
    command = [sys.executable, "-m", "mlscale", "serve", f"models:/{MODEL_NAME}/1", "--registry", registry,
               "--port", str(port), "--no-grpc", "--runtime", "torch", "--cache-mb", "0", "--threads", str(threads),
               "--max-sequences", str(engine["max_batch"]), "--max-batch-tokens", str(engine["max_batch_tokens"]),
               "--kv-cache-mb", str(engine["kv_cache_mb"]), "--queue-limit", str(engine["queue_limit"])]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, base, timeout_s)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _events(base: str, request: Request) -> AsyncIterator[int]:
    """The streamed completion of one request: the number of tokens each server-sent event carries."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL_NAME, "prompt": request.prompt, "max_tokens": request.max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        status = await reader.readline()
        if b" 200 " not in status:
            return
        async for line in reader:  # chunked framing lines are skipped: only "data: " lines are events
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return
            yield sum(len(choice.get("token_ids") or ()) for choice in event["choices"])
    finally:
        writer.close()


def run_http(base: str, requests: list[Request], timeout_s: float = 600.0) -> list[TokenTimes]:
    return asyncio.run(replay(requests, lambda request: _events(base, request), timeout_s))
