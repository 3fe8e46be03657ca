"""``mlscale serve --workers N``: processes sharing the ports, a whole-server readiness and /metrics,
hot reload followed by every worker, a worker killed under load restarted with nothing lost but what
it held, and a drain on SIGTERM. Nothing outlives the supervisor: a signal at any moment of the start,
a SIGKILL included, leaves no worker, no bound port and no temp folder; a worker stuck in its start is
stopped and named; a second signal kills."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from mlscale.registry import Registry
from tests.helpers import REPO, free_port
from tests.serve.conftest import infer_body, metric, running_server


def _workers_of(supervisor_pid: int) -> list[int]:
    """The supervisor's worker processes (not its janitor): those running the worker bootstrap."""
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    workers = []
    for pid in children:
        try:
            if b"worker_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                workers.append(int(pid))
        except OSError:  # gone since the listing
            pass
    return workers


def _eventually(check, timeout: float = 15.0):
    deadline = time.time() + timeout
    while True:
        value = check()
        if value or time.time() > deadline:
            return value
        time.sleep(0.1)


def _counted_success(base: str) -> float:
    return metric(base, "mlscale_inference_request_success_total", model="digits", version="1")


@pytest.mark.timeout(180)
def test_a_worker_killed_under_load_is_restarted_and_only_its_own_requests_fail(serve_registry):
    Registry(serve_registry).set_alias("digits", 1, "production")
    with running_server(serve_registry, "models:/digits@production", "--workers", "2", "--cache-mb", "1",
                        "--reload-interval-s", "0.3") as (base, server):
        workers = _workers_of(server.pid)
        assert len(workers) == 2
        # one server, seen whole from either worker: both workers' gauges, the cache's bound for both
        assert metric(base, "mlscale_model_loaded", model="digits", version="1", worker="0") == 1
        assert metric(base, "mlscale_model_loaded", model="digits", version="1", worker="1") == 1
        assert metric(base, "mlscale_cache_max_bytes") == 1024 * 1024
        assert metric(base, "mlscale_workers", state="ready") == 2

        rng = np.random.default_rng(0)
        answered, failed, stop = [], [], threading.Event()
        clients = 6

        def load():
            while not stop.is_set():  # a new connection per request: each is handed to either worker
                try:
                    response = httpx.post(f"{base}/v2/models/digits/infer", timeout=10,
                                          json=infer_body(rng.random((1, 64)).tolist()))
                    (answered if response.status_code == 200 else failed).append(response.status_code)
                except httpx.TransportError as exc:  # the connection the killed worker held
                    failed.append(type(exc).__name__)

        threads = [threading.Thread(target=load) for _ in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        os.kill(workers[0], signal.SIGKILL)
        saw_unready = _eventually(lambda: httpx.get(f"{base}/v2/health/ready").status_code == 503, 5)
        time.sleep(1.0)
        before_restart = len(answered)
        assert _eventually(lambda: httpx.get(f"{base}/v2/health/ready").status_code == 200, 60)
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join()

        assert saw_unready, "readiness stayed 200 with a worker down"
        assert len(failed) <= clients, failed  # at most one request in flight per client, on the dead worker
        assert len(answered) > before_restart > 0  # the other worker served meanwhile, and both after
        assert metric(base, "mlscale_worker_restarts_total") == 1
        new_workers = _workers_of(server.pid)
        assert len(new_workers) == 2 and workers[0] not in new_workers and workers[1] in new_workers
        # the whole server's count, exact: everything answered, the dead worker's to its last request
        # (its cells outlive it), plus at most the requests it counted but died before answering
        counted = _counted_success(base)
        assert len(answered) <= counted <= len(answered) + clients

        # a hot reload is followed by every worker
        Registry(serve_registry).set_alias("digits", 2, "production")
        both = _eventually(lambda: all(metric(base, "mlscale_model_loaded", model="digits", version="2",
                                              worker=str(w)) == 1 for w in (0, 1)), 20)
        Registry(serve_registry).set_alias("digits", 1, "production")
        assert both
        versions = {httpx.post(f"{base}/v2/models/digits/infer", json=infer_body(rng.random((1, 64)).tolist())
                               ).json()["model_version"] for _ in range(20)}
        assert versions <= {"1", "2"}

        # SIGTERM: every worker drains and goes, the supervisor exits 0
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in new_workers)


@pytest.mark.timeout(120)
def test_a_scrape_right_after_a_burst_counts_every_request_answered_before_it(serve_registry):
    """--workers 2: a scrape reads every worker's counters as they are then, not as last published (every
    0.5 s, once), so /metrics fetched right after the last answer counts every request sent."""
    sent = 300
    body = infer_body(np.random.default_rng(2).random((1, 64)).tolist())
    with running_server(serve_registry, "models:/digits/1", "--workers", "2", "--no-grpc",
                        "--cache-mb", "0") as (base, _):

        def post(_: int) -> int:  # a new connection per request: the kernel hands them to either worker
            return httpx.post(f"{base}/v2/models/digits/infer", json=body, timeout=10).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(post, range(sent)))
        counted = _counted_success(base)
    assert codes == [200] * sent
    assert counted == sent


def test_grpc_is_served_by_every_worker_on_one_port_and_a_route_key_sticks_across_them(serve_registry):
    import tritonclient.grpc as grpcclient

    from mlscale.serve.share import SHARE_TAG

    registry = Registry(serve_registry)
    registry.set_tag("digits", None, SHARE_TAG, "50")  # what the canary's flag says, whatever ran before
    try:
        with running_server(serve_registry, "models:/digits/1", "--workers", "2", "--canary",
                            "models:/digits/2=50") as (base, server):
            rows = np.random.default_rng(1).random((3, 64)).astype(np.float32)
            for _ in range(6):  # a new channel each time: the kernel spreads them over the workers
                client = grpcclient.InferenceServerClient(server.grpc_address)
                tensor = grpcclient.InferInput("input", list(rows.shape), "FP32")
                tensor.set_data_from_numpy(rows)
                result = client.infer("digits", [tensor])
                assert result.as_numpy("output").shape == (3, 10)
                assert client.is_server_ready()
                client.close()
            # the route-key hash's secret is the server's, shared by its workers: a key meets one version
            # whichever worker takes its connection (a new one per request)
            for key in (f"key-{i}" for i in range(8)):
                versions = {httpx.post(f"{base}/v2/models/digits/infer", headers={"x-route-key": key},
                                       json=infer_body(rows[:1].tolist())).json()["model_version"] for _ in range(5)}
                assert len(versions) == 1, (key, versions)
    finally:
        registry.set_tag("digits", None, SHARE_TAG, "10")  # as the rollout tests leave it


def test_a_bad_worker_count_is_one_line(serve_registry):
    from tests.helpers import refused

    for value, says in (("0", "workers 0 must be at least 1"), ("many", "not a number of workers")):
        result = refused("serve", "models:/digits/1", "--workers", value, "--registry", serve_registry)
        assert result.returncode == 2 and says in result.stderr, result.stderr


# -- nothing outlives the supervisor ----------------------------------------------------------------
class _Supervised:
    """``mlscale serve models:/digits/1 --workers 2 --no-grpc ARGS`` started here, its stderr collected,
    every process of it marked by an environment variable (workers and janitor inherit it), its temp
    folder under ``tmp`` ($TMPDIR). On leaving, whatever of it is still there is killed, so a failing
    test leaves no process behind either."""

    def __init__(self, registry: str, tmp: Path, *args: str) -> None:
        self.port, self.tmp, self.mark = free_port(), tmp, f"MLSCALE_SUPERVISOR_TEST={uuid.uuid4().hex}"
        name, value = self.mark.split("=")
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), name: value}
        self.process = subprocess.Popen([sys.executable, "-m", "mlscale", "serve", "models:/digits/1", "--workers",
                                         "2", "--no-grpc", "--port", str(self.port), "--registry", registry, *args],
                                        cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def __enter__(self) -> _Supervised:
        return self

    def __exit__(self, *_: object) -> None:
        for pid in [self.process.pid, *_marked(self.mark)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert self.process.poll() is None, f"exited {self.process.returncode} before {text!r}: {self.log()}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s: {self.log()}"
            time.sleep(0.005)

    def workers(self, timeout: float = 30) -> list[int]:
        """The two worker pids, as soon as both are started."""
        deadline = time.monotonic() + timeout
        while len(workers := _workers_of(self.process.pid)) < 2:
            assert time.monotonic() < deadline and self.process.poll() is None, self.log()
            time.sleep(0.005)
        return workers

    def assert_nothing_left(self, timeout: float = 10) -> None:
        """No process of this server alive (zombies excepted: they hold nothing), its port free to bind
        again, its temp folder gone; a leftover process is given ``timeout`` to go."""
        deadline = time.monotonic() + timeout
        while (left := _marked(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes outlived the supervisor: {_describe(left)}\n{self.log()}"
        with socket.socket() as probe:  # no SO_REUSEADDR: any socket still on the port refuses it
            probe.bind(("127.0.0.1", self.port))
        assert not list(self.tmp.glob("mlscale-serve-*")), "the workers' temp folder was left behind"


def _marked(mark: str) -> list[int]:
    """Live (not zombie) processes whose environment holds ``mark``."""
    found, needle = [], mark.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes() and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            pass
    return found


def _stop(pid: int) -> None:
    """SIGSTOP, as a worker hung in its start or in a model call would be: returns once it is stopped (a
    SIGTERM sent before the stop took hold would still kill it)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"worker {pid} did not stop"
        time.sleep(0.005)


def _describe(pids: list[int]) -> str:
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80].decode(errors="replace")
        except OSError:
            return "?"
    return ", ".join(f"{pid} ({cmdline(pid)})" for pid in pids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("delay", [0, 0.05, 0.1, 0.3])
def test_a_supervisor_signalled_during_the_start_leaves_no_worker_port_or_folder(serve_registry, tmp_path, sig,
                                                                                 delay):
    """The delay counts from the supervisor's line saying it starts the workers: the moments when they
    are being spawned, importing, loading the model; a SIGKILL leaves no code of the supervisor to run."""
    with _Supervised(serve_registry, tmp_path) as server:
        server.wait_for("with 2 workers")
        time.sleep(delay)
        server.process.send_signal(sig)
        code = server.process.wait(timeout=30)
        server.assert_nothing_left()
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), server.log()


@pytest.mark.timeout(60)
def test_a_worker_stuck_in_its_start_is_stopped_after_the_start_timeout_and_named(serve_registry, tmp_path):
    """Both workers stopped (SIGSTOP) as a hung model load would hold them: each gets SIGTERM at the
    timeout (it cannot act on it), SIGKILL after the grace; the server stops, exit 1, saying why."""
    with _Supervised(serve_registry, tmp_path, "--worker-start-timeout-s", "2") as server:
        workers = server.workers()
        for pid in workers:
            _stop(pid)
        assert server.process.wait(timeout=30) == 1
        server.assert_nothing_left()
        log = server.log()
    for index, pid in enumerate(workers):
        assert f"worker {index} (pid {pid}) not ready 2 s after its start (--worker-start-timeout-s): stopping it" \
            in log, log
    assert re.search(r"worker [01] \(pid \d+\) died during the start \(signal 9\): stopping the server", log), log


@pytest.mark.timeout(60)
def test_a_worker_killed_during_the_start_is_named_with_its_signal(serve_registry, tmp_path):
    with _Supervised(serve_registry, tmp_path) as server:
        first = server.workers()[0]
        os.kill(first, signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1
        server.assert_nothing_left()
        assert f"worker 0 (pid {first}) died during the start (signal 9): stopping the server" in server.log()


@pytest.mark.timeout(60)
def test_a_second_signal_kills_the_workers_even_a_stuck_one(serve_registry, tmp_path):
    """A worker that cannot act on SIGTERM (stopped here, hung in a model call in life) holds the first
    signal's drain; the second signal (SIGINT, a second Ctrl-C) kills it and the supervisor exits."""
    with _Supervised(serve_registry, tmp_path) as server:
        stuck = server.workers()[0]
        _stop(stuck)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.process.poll() is None  # the first signal waits for the stuck worker
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=5) == 0
        server.assert_nothing_left()
        assert "a second signal: every worker killed" in server.log()


def _snapshot(success: int, failures: int = 0, peers=None) -> dict:
    """A real worker's snapshot: ``success`` requests answered, ``failures`` failed; counted in the cells
    file of ``peers`` (a worker's) when given."""
    from mlscale.serve.metrics import ServerMetrics

    metrics = ServerMetrics(peers=peers)
    stats = metrics.stats_for("digits", "1")
    stats.hold("primary")
    stats.success.inc(success)
    if failures:
        stats.failure("model", failures)
    return metrics.snapshot()


def _counted(peers, own: dict, series: str = "success") -> float:
    """The whole server's count of ``series`` as a scrape of the worker holding ``peers`` shows it."""
    from mlscale.serve.metrics import MetricsView

    stats = MetricsView.merge(peers.snapshots(own)).models[("digits", "1")]
    return stats.failures["model"].value if series == "failures" else stats.success.value


def test_a_workers_counters_are_read_as_they_are_now_with_its_role_and_gauges(tmp_path):
    """What another worker's scrape reads of a worker: every series as its cells hold it this moment
    (nothing published), equal to the worker's own snapshot; what only the worker knows (the cache's
    bytes) from what it published."""
    from mlscale.serve.metrics import MetricsView, ServerMetrics
    from mlscale.serve.peers import Peers

    worker, reader = Peers(tmp_path, 2, index=0), Peers(tmp_path, 2, index=1)
    metrics = ServerMetrics(peers=worker)
    stats = metrics.stats_for("digits", "2")
    stats.hold("canary")
    stats.success.inc(3)
    stats.duration.observe(0.004)
    stats.queue_depth.set(7)
    stats.client_error("bad_request")
    stats.last_inference_ms = 1_765_000_000_123
    metrics.refused["connections"].inc()
    found = dict(((worker_, live), snapshot) for worker_, snapshot, live in reader.snapshots(_snapshot(0)))
    seen = found[("0", True)]
    own = metrics.snapshot()
    assert seen["models"] == own["models"] and seen["refused"] == own["refused"]
    assert seen["cache"] is None  # nothing published yet
    worker.publish({**metrics.local(), "cache": [10, 100, 1]})
    view = MetricsView.merge(reader.snapshots(_snapshot(0)))
    assert view.cache == [10, 100, 1] and view.refused["connections"] == 1
    merged = view.models[("digits", "2")]
    assert (merged.role, merged.success.value, merged.duration.count, merged.last_inference_ms) == (
        "canary", 3, 1, 1_765_000_000_123)
    stats.success.inc()  # no publish: the next read has it
    assert _counted_of(reader, ("digits", "2")) == 4
    worker.close()
    reader.close()


def _counted_of(peers, labels: tuple[str, str]) -> float:
    from mlscale.serve.metrics import MetricsView

    return MetricsView.merge(peers.snapshots(_snapshot(0))).models[labels].success.value


def test_dead_workers_counters_are_kept_in_one_file_per_worker_however_often_it_restarts(tmp_path):
    from mlscale.serve.peers import Peers

    supervisor, reader = Peers(tmp_path, 2), Peers(tmp_path, 2, index=1)
    for generation in range(5):  # worker 0 answers 10 requests, dies, is restarted: five times
        worker = Peers(tmp_path, 2, index=0, generation=generation)
        _snapshot(10, failures=1, peers=worker)
        worker.close()
        assert _counted(reader, _snapshot(1)) == 10 * generation + 10 + 1
        supervisor.retire(0)
        assert _counted(reader, _snapshot(1)) == 10 * generation + 10 + 1  # never less, never twice
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cells-1.bin", "flags.bin", "retired-0.json"]
    assert _counted(reader, _snapshot(0), "failures") == 5  # every counter, failures too

    # a reader that finds the cells file still there after its counts went into the retired file (the
    # retirement writes the retired file first, then removes the cells) counts them once
    worker = Peers(tmp_path, 2, index=0, generation=5)
    _snapshot(10, peers=worker)
    worker.close()
    live = (tmp_path / "cells-0.bin").read_bytes()
    supervisor.retire(0)
    (tmp_path / "cells-0.bin").write_bytes(live)
    assert _counted(reader, _snapshot(0)) == 60
