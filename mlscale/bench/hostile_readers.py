"""`mlscale bench hostile`'s readers half: what the files, servers and signals ``mlscale ui`` and the serving
supervisor read cost them. Each attack runs against ``mlscale ui`` (or ``mlscale serve --workers 2``) of
each checkout side by side, with the same normal user as the clients' half: a GET of the runs table every
20 ms over one keep-alive connection, its p99 during the attack, and the process's RSS before and after.

- ``planted_runs``: a runs folder beside a good run holding ``metrics.jsonl -> /dev/zero``, a FIFO for
  ``report.json``, a symlink to a folder outside, malformed config/report/plan/metrics values and a 200 MB
  line without its newline; the attack asks for every run, its series and 3 live streams, over and over.
- ``slow_scrape`` / ``huge_scrape``: the UI's ``--server`` sends a byte every 0.5 s, or 50 MB of metrics;
  the attack asks for the serving view from 8 clients at once, over and over.
- ``ui_big_headers``: 4 connections each sending a 48 MB header to the UI.
- ``supervisor_signals``: ``mlscale serve --workers 2`` is sent SIGKILL or SIGTERM 0, 0.05, 0.1 and 0.3 s
  after it says it starts its workers; counted: runs that left a process serving or the port bound.
Everything listens on 127.0.0.1 and stops by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mlscale.bench.hostile import Target, big_headers, measure
from mlscale.rundir import RunDir

UI_ATTACKS = ("planted_runs", "slow_scrape", "huge_scrape", "ui_big_headers")
READER_ATTACKS = (*UI_ATTACKS, "supervisor_signals")
UI_MEMORY_CAP = 4 << 30


def plant(root: Path) -> Path:
    """A runs folder: one good run and every planted file of the review."""
    runs = root / "runs"

    def run(name: str, config: str = '{"task": "digits", "strategy": "ddp", "steps": 10}') -> RunDir:
        made = RunDir(runs / name)
        made.path.mkdir(parents=True)
        made.config_path.write_text(config)
        return made

    line = {"step": 1, "loss": 1.0, "per_rank": [{"rank": 0, "step_ms": 5.0, "compute_ms": 3.0}]}
    run("good").metrics_path.write_text("".join(json.dumps({**line, "step": s}) + "\n" for s in range(1, 200)))
    os.symlink("/dev/zero", run("zero").metrics_path)
    os.mkfifo(run("fifo").report_path)
    outside = RunDir(root / "outside")
    outside.path.mkdir()
    outside.config_path.write_text('{"task": "not yours"}')
    os.symlink(outside.path, runs / "outside")
    run("list-config", "[1]")
    odd = run("odd")
    odd.report_path.write_text('"done"')
    odd.plan_path.write_text("[5]")
    odd.metrics_path.write_text(
        '{"step": "x"}\n{"step": 2, "lr": "x", "per_rank": 5}\n{"step": 3, "per_rank": [{"rank": 1e300}]}\n')
    with run("torn").metrics_path.open("wb") as handle:
        handle.write(json.dumps(line).encode() + b"\n")
        handle.write(b"x" * (200 << 20))  # no final newline
    wide = [{"step": 1, "per_rank": [{"rank": r, "step_ms": 1.0} for r in range(1000)]}]
    wide += [{"step": s, "loss": 1.0, "per_rank": [{"rank": 0, "step_ms": 1.0}]} for s in range(2, 10_002)]
    run("wide").metrics_path.write_text("".join(json.dumps(w) + "\n" for w in wide))
    return runs


class _Hostile(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        with contextlib.suppress(OSError):
            if self.server.mode == "slow":  # type: ignore[attr-defined]
                for _ in range(120):
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.5)
            else:
                line = b'mlscale_inference_request_success_total{model="d",version="1"} 1\n'
                self.wfile.write(line * (50_000_000 // len(line)))

    def log_message(self, *args: Any) -> None:
        pass


def hostile_server(mode: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.mode = mode  # type: ignore[attr-defined]
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_cap() -> None:
    """4 GiB of address space for a UI under attack: an unbounded read fails there, not on the host."""
    resource.setrlimit(resource.RLIMIT_AS, (UI_MEMORY_CAP, UI_MEMORY_CAP))


def start_ui(src: Path, runs: Path, servers: list[str]) -> tuple[subprocess.Popen[bytes], Target]:
    port = _free_port()
    flags = [arg for url in servers for arg in ("--server", url)]
    process = subprocess.Popen([sys.executable, "-m", "mlscale", "ui", "--runs", str(runs), "--port", str(port),
                                *flags], cwd=src, env={**os.environ, "PYTHONPATH": str(src)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_memory_cap)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("GET", "/api/info")
            if connection.getresponse().status == 200:
                return process, Target(port, b"", path="/api/runs", pid=process.pid, method="GET")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"mlscale ui from {src} did not start")


async def _ask(target: Target, paths: list[str], seconds: float, clients: int) -> dict[str, Any]:
    """``clients`` threads GETting ``paths`` in turn for ``seconds``: answers by status, and the slowest."""
    statuses: dict[str, int] = {}
    slowest = [0.0]
    end = time.monotonic() + seconds

    def one(offset: int) -> None:
        i = offset
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                connection = http.client.HTTPConnection(target.host, target.port, timeout=15)
                connection.request("GET", paths[i % len(paths)])
                response = connection.getresponse()
                got = 0
                while got < 1 << 20 and time.monotonic() < end + 1:  # a live stream: up to 1 MB, in time
                    chunk = response.read1(65536)
                    if not chunk:
                        break
                    got += len(chunk)
                status = str(response.status)
                connection.close()
            except (OSError, http.client.HTTPException):
                status = "no answer"
            statuses[status] = statuses.get(status, 0) + 1
            slowest[0] = max(slowest[0], time.perf_counter() - start)
            i += 1

    await asyncio.gather(*(asyncio.to_thread(one, k) for k in range(clients)))
    return {"answers": statuses, "slowest_ms": round(slowest[0] * 1e3, 1)}


async def planted_runs(target: Target, seconds: float) -> dict[str, Any]:
    ids = ("good", "zero", "fifo", "outside", "list-config", "odd", "torn", "wide")
    paths = ["/api/runs", *(f"/api/run?id={i}" for i in ids), *(f"/api/series?id={i}&rank=%C2%B2" for i in ids),
             "/api/live?id=torn&after=0", "/api/live?id=wide&after=0"]
    return await _ask(target, paths, seconds, clients=3)


async def scrape_flood(target: Target, seconds: float) -> dict[str, Any]:
    return await _ask(target, ["/api/servers"], seconds, clients=8)


def _threads(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/task"))
    return None


def ui_trial(src: Path, attack: str, seconds: float, root: Path) -> dict[str, Any]:
    """One UI attack against the UI of checkout ``src``, measured as the clients' half measures."""
    servers = []
    if attack in ("slow_scrape", "huge_scrape"):
        servers = [hostile_server("slow" if attack == "slow_scrape" else "huge")]
    runs = root / "runs" if (root / "runs").is_dir() else plant(root)
    process, target = start_ui(src, runs, [f"http://127.0.0.1:{s.server_address[1]}" for s in servers])
    run = {"planted_runs": planted_runs, "slow_scrape": scrape_flood, "huge_scrape": scrape_flood,
           "ui_big_headers": big_headers}[attack]
    try:
        trial = measure(target, attack, seconds, runner=run)
        trial["threads_after"] = _threads(process.pid)
        return trial
    finally:
        process.kill()
        process.wait(10)
        for server in servers:
            server.shutdown()
            server.server_close()


def _pids_of(marker: str) -> list[int]:
    """Processes whose environment carries ``marker`` (the supervisor's and its workers')."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
    return found


def _bound(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _announced(process: subprocess.Popen[str], seconds: float = 60.0) -> bool:
    """Wait for the supervisor's "with N workers" line (it has imported what it needs and starts its
    workers now); the rest of its output is drained in a thread so that it never blocks on the pipe."""
    assert process.stderr is not None
    deadline = time.monotonic() + seconds
    for line in process.stderr:
        if " workers" in line or time.monotonic() > deadline:
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return True
    return False


def supervisor_signals(src: Path, registry: str, path: str = "") -> dict[str, Any]:
    """SIGKILL and SIGTERM of ``mlscale serve --workers 2`` at 0, 0.05, 0.1, 0.3 s after it says it starts
    its workers: how many runs left a process alive or the port bound 10 s later."""
    left, cases = [], []
    for sig in (signal.SIGKILL, signal.SIGTERM):
        for delay in (0.0, 0.05, 0.1, 0.3):
            port, marker = _free_port(), f"MLSCALE_BENCH_RUN={time.monotonic_ns()}"
            process = subprocess.Popen(
                [sys.executable, "-m", "mlscale", "serve", "models:/digits/1", "--workers", "2", "--port", str(port),
                 "--registry", registry], cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(src), path))),
                     marker.split("=")[0]: marker.split("=")[1]})
            _announced(process)
            time.sleep(delay)
            process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(15)
            time.sleep(10)  # a worker that outlived it has loaded its model by now
            survivors, bound = _pids_of(marker), _bound(port)
            cases.append({"signal": sig.name, "after_s": delay, "survivors": len(survivors), "port_bound": bound})
            if survivors or bound:
                left.append(cases[-1])
            for pid in survivors:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    return {"runs": len(cases), "left_something": len(left), "cases": cases}
