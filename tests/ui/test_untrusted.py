"""The runs folder is untrusted (a shared volume anyone may write to): planted symlinks, FIFOs, huge or
malformed files never hang, exhaust or expose anything; a bad run is shown unreadable with its reason and
every other run stays visible; the UI's connections are bounded like the server's; a scraped server is
bounded in time and bytes; the login cookie is not the token."""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import orjson
import pytest

from mlscale.bench.ui import write_synthetic_run
from mlscale.rundir import RunDir
from mlscale.ui import runs as ui_runs
from mlscale.ui.runs import RunCatalog, RunView, Series
from mlscale.ui.serving import ServerWatch
from tests.helpers import REPO, free_port
from tests.ui.conftest import running_ui


def _run(root: Path, name: str, **files: bytes | str) -> RunDir:
    run = RunDir(root / name)
    run.path.mkdir(parents=True)
    run.write_config({"task": "digits", "strategy": "ddp", "workers": 2, "steps": 10})
    for relative, content in files.items():
        path = run.path / relative.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return run


def _line(step, **extra) -> str:
    return json.dumps({"step": step, "loss": 1.0, "lr": 0.1, "samples_per_s": 10.0,
                       "per_rank": [{"rank": 0, "step_ms": 5.0, "compute_ms": 3.0, "comm_ms": 1.0,
                                     "comm_exposed_ms": 1.0, "data_wait_ms": 0.5, "optimizer_ms": 0.5,
                                     "straggler_score": 1.0}], **extra}) + "\n"


REPLICA_LINES = '{"event": "start", "attempt": "2"}\n{"event": "start", "attempt": 1, "step": "x"}\n'


@pytest.fixture
def planted(tmp_path) -> Path:
    """A runs folder with a good run beside every planted file the review tried."""
    runs = tmp_path / "runs"
    _run(runs, "good", **{"metrics.jsonl": _line(1) + _line(2)})
    zero = _run(runs, "zero")
    os.symlink("/dev/zero", zero.metrics_path)
    fifo = _run(runs, "fifo")
    os.mkfifo(fifo.report_path)
    secret = tmp_path / "elsewhere" / "creds"
    secret.mkdir(parents=True)
    (secret / "config.json").write_text('{"task": "secret", "password": "hunter2"}')
    os.symlink(secret, runs / "creds")  # a folder outside --runs
    escape = RunDir(runs / "escape")
    escape.path.mkdir()
    os.symlink(secret / "config.json", escape.config_path)  # a file outside --runs
    _run(runs, "list-config").config_path.write_text("[1]")
    _run(runs, "odd-config").config_path.write_text('{"recovery": 1, "task": {"x": 1}, "steps": "many"}')
    _run(runs, "text-report", **{"report.json": '"done"', "plan.json": "[5]"})
    odd_metrics = "".join([
        _line(1), '{"step": "x"}\n', _line(2, lr="x", per_rank=5), _line(3, samples_per_s=[1]),
        json.dumps({"step": 4, "per_rank": [{"rank": 1e300, "step_ms": 1}, {"rank": 1, "step_ms": "x"},
                                            {"rank": 2, "step_ms": 10 ** 400}, 7]}) + "\n",
        _line(5, eval=[{"step": "x"}, 3, {"step": 5, "accuracy": 0.5, "note": "x"}], stragglers=["a", 0],
              degraded_steps=[{"steps": [1]}, 4]),
        "[1, 2]\n", "not json\n", _line(6)])
    _run(runs, "odd-values", **{"metrics.jsonl": odd_metrics,
                                "logs__faults.jsonl": '{"kind": 5, "step": "x", "rank": [1]}\n{"kind": "kill"}\n',
                                "logs__failures.jsonl": '{"step": "x", "rank": {}, "error": [1, 2]}\n',
                                "recovery.jsonl": '{"attempt": "x", "failed_at_step": [], "downtime_s": "y"}\n',
                                "logs__replica0.jsonl": REPLICA_LINES,
                                "logs__replicaX.jsonl": '{"event": "start", "attempt": 3}\n',
                                "report.json": json.dumps({"status": 5, "memory": [{"rank": "x"}, 3, {"rank": 1,
                                                           "state_mb": "big", "params_mb": 2.0}],
                                                           "pipeline": {"stages": "two"}, "per_rank": 3,
                                                           "final_loss": "low", "world_size": 1.5})})
    return runs


def _in_time(call, seconds: float = 10.0):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result(timeout=seconds)


def test_planted_files_are_refused_without_blocking_and_bad_runs_are_shown_unreadable(planted):
    catalog = RunCatalog(planted)
    assert "creds" not in catalog.ids() and catalog.view("creds") is None  # a folder outside is not followed
    rows = {row["id"]: row for row in _in_time(catalog.summaries)}  # the FIFO blocks nothing
    assert rows["good"]["status"] != "unreadable" and rows["good"]["steps"] == 2
    assert rows["fifo"] == {**rows["fifo"], "status": "unreadable", "reason": "report.json is not a regular file"}
    assert rows["escape"]["status"] == "unreadable" and "outside the runs folder" in rows["escape"]["reason"]
    assert "hunter2" not in json.dumps(rows) and "secret" not in json.dumps(rows)
    assert rows["list-config"]["reason"] == "config.json is not a JSON object"
    assert rows["text-report"]["reason"] == "report.json is not a JSON object"
    assert rows["odd-config"]["status"] != "unreadable" and rows["odd-config"]["task"] is None
    assert rows["odd-config"]["total_steps"] is None and rows["odd-config"]["fault_tolerance"] is None
    zero = _in_time(catalog.view("zero").detail)
    assert zero["lines"] == 0 and "outside the runs folder" in zero["reason"]  # /dev/zero never read
    for run_id in rows:
        orjson.dumps(_in_time(catalog.view(run_id).detail))  # every page's data: JSON, whatever the files


def test_odd_values_anywhere_in_a_run_are_dropped_counted_and_never_reach_the_page_as_they_are(planted):
    view = RunCatalog(planted).view("odd-values")
    detail = view.detail()
    assert detail["status"] == "5" and detail["loss"] is None and detail["world"] is None
    assert [line for line in view.series.steps] == [1, 2, 3, 4, 5, 6]
    assert view.series.ranks == [0, 1, 2]  # rank 1e300 is no rank; the rest kept with their odd values as gaps
    assert detail["dropped"]["lines without a whole step number"] == 1
    assert detail["dropped"]["per-rank entries of no valid rank or past the rank bound"] == 1
    assert detail["memory"] == [{"rank": 1, "params_mb": 2.0}] and detail["pipeline"] is None
    assert detail["report"]["per_rank"] == []
    kinds = {event["kind"] for event in detail["events"]}
    assert kinds == {"fault", "kill", "error", "restart", "resume", "replica_restart", "straggler"}
    assert all(isinstance(event["text"], str) for event in detail["events"])
    payload = view.series_payload(None, None, 600, rank="²")  # a digit that is no number
    assert payload["split_of"] == "²" and len(payload["steps"]) == 6
    assert payload["eval"] == [{"step": 5, "accuracy": 0.5}]
    assert view.series.extras[4]["stragglers"] == [0]


def test_a_line_without_its_newline_is_not_read_again_on_every_poll(tmp_path):
    run = _run(tmp_path, "run", **{"metrics.jsonl": _line(1) + "x" * (20 << 20)})  # 20 MB, no final newline
    view = RunView("run", run.path)

    def read_bytes() -> int:
        return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                        if line.startswith("rchar")).split()[1])

    assert view.refresh() == 1
    before = read_bytes()
    for _ in range(5):
        assert view.refresh() == 1
    assert read_bytes() - before < 1 << 20  # was 20 MB a poll
    assert view.series.dropped == {"lines longer than 1 MB": 1}
    with run.metrics_path.open("a") as handle:  # the long line ends; the next one is read
        handle.write("\n" + _line(2))
    assert view.refresh() == 2 and list(view.series.steps) == [1, 2]
    torn = _run(tmp_path, "torn", **{"metrics.jsonl": _line(1) + _line(2)[:30]})
    view = RunView("torn", torn.path)
    assert view.refresh() == 1
    torn.metrics_path.write_text(_line(1) + _line(2) + _line(3))  # the torn line cut off and written again
    assert view.refresh() == 3 and list(view.series.steps) == [1, 2, 3]


def test_a_thousand_ranks_on_one_line_cost_no_lines_times_ranks_of_memory(tmp_path):
    lines = [json.dumps({"step": 1, "loss": 1.0, "per_rank": [{"rank": r, "step_ms": 1.0} for r in range(1000)]})]
    lines += [_line(step).strip() for step in range(2, 10_002)]
    run = _run(tmp_path, "wide", **{"metrics.jsonl": "\n".join(lines) + "\n"})
    view = RunView("wide", run.path)
    tracemalloc.start()
    try:
        view.refresh()
        payload = view.series_payload(None, None, 600)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(view.series.ranks) == 1000 and len(payload["steps"]) == 600
    assert view.series.held_bytes() < 8 << 20  # its records; the 80 MB matrices are not kept
    assert peak < 200 << 20  # was ~560 MB of matrices (7 keys x 10,001 lines x 1,000 ranks), kept


def test_large_runs_lay_out_only_the_rows_asked_and_answer_the_same(tmp_path, monkeypatch):
    run = write_synthetic_run(tmp_path / "long", steps=4_000, ranks=4, log_every=10, slow_rank=1)
    cached = RunView("long", run.path).series_payload(None, None, 100)
    zoomed = RunView("long", run.path).series_payload(1_000, 1_990, 100)
    monkeypatch.setattr(ui_runs, "CACHE_CELLS", 0)
    assert RunView("long", run.path).series_payload(None, None, 100) == cached
    assert RunView("long", run.path).series_payload(1_000, 1_990, 100) == zoomed


def test_the_records_of_one_run_are_bounded_whatever_the_file_holds(monkeypatch):
    monkeypatch.setattr(ui_runs, "MAX_CELLS", 50)
    monkeypatch.setattr(ui_runs, "MAX_RANKS", 4)
    series = Series()
    series.add({"step": 1, "per_rank": [{"rank": r} for r in range(6)]})
    assert series.ranks == [0, 1, 2, 3] and series.dropped["per-rank entries past the rank bound"] == 2
    for step in range(2, 40):
        series.add({"step": step, "per_rank": [{"rank": 0}]})
    assert len(series.steps) * len(series.ranks) <= 50 and series.dropped["lines past what the UI keeps of a run"]


# -- through the UI process ----------------------------------------------------------------------------


def _listening_ui(*args: str, nofile: int | None = None):
    """``mlscale ui`` with its stderr in a file (read after), optionally under a lower open-file limit."""
    port = free_port()
    log = open(Path(args[args.index("--runs") + 1]).parent / "ui.log", "w+")  # noqa: SIM115 (closed by caller)
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    process = subprocess.Popen([sys.executable, "-m", "mlscale", "ui", "--port", str(port), *args], cwd=Path.cwd(),
                               stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)},
                               preexec_fn=limit)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{base}/api/info", timeout=2)
            return base, port, process, log
        except httpx.TransportError:
            assert process.poll() is None and time.monotonic() < deadline, log.read()
            time.sleep(0.1)


def test_through_http_a_planted_folder_answers_every_request_and_logs_no_traceback(planted):
    base, port, process, log = _listening_ui("--runs", str(planted))
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:  # more than the app's thread pool
            answers = list(pool.map(lambda path: httpx.get(base + path, timeout=15),
                                    ["/api/runs"] * 8 + ["/api/run?id=fifo", "/api/run?id=zero",
                                                         "/api/run?id=odd-values", "/api/run?id=list-config"]))
        assert [a.status_code for a in answers] == [200] * 12
        assert {r["id"] for r in answers[0].json()} >= {"good", "fifo", "zero", "escape", "odd-values"}
        assert httpx.get(f"{base}/api/run?id=creds").status_code == 404
        assert "hunter2" not in httpx.get(f"{base}/api/run?id=escape").text
        series = httpx.get(f"{base}/api/series", params={"id": "odd-values", "rank": "²", "points": "nan"})
        assert series.status_code == 200 and len(series.json()["steps"]) == 6
        quick = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as big:  # one 48 MB header: 431 at once
            big.sendall(b"GET /api/info HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: ")
            with pytest.raises(OSError):
                for _ in range(48 * 16):
                    big.sendall(b"a" * 65536)
        assert time.perf_counter() - quick < 5
        assert httpx.get(f"{base}/api/info", headers={"x-one": "a" * 20_000}).status_code == 431
        assert httpx.get(f"{base}/api/info", headers={f"x-{i}": "a" * 9_000 for i in range(8)}).status_code == 431
        assert httpx.get(f"{base}/api/info", headers={"x-fine": "a" * 8_000}).status_code == 200
    finally:
        process.terminate()
        process.wait(10)
    log.seek(0)
    text = log.read()
    log.close()
    assert "Traceback" not in text, text


def test_idle_sockets_past_the_open_file_limit_do_not_lock_the_user_out(tmp_path):
    """With 256 open files, the review's 260 idle sockets held the UI for good; the header deadline
    closes them, and past the connection cap new ones get a 503 instead of failing accept."""
    runs = tmp_path / "runs"
    _run(runs, "good")
    base, port, process, log = _listening_ui("--runs", str(runs), nofile=256)
    idle = []
    try:
        for _ in range(260):
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        deadline, answered = time.monotonic() + 12, None
        while time.monotonic() < deadline:
            try:
                answered = httpx.get(f"{base}/api/runs", timeout=2)
                if answered.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        assert answered is not None and answered.status_code == 200
        closed = sum(_closed(sock) for sock in idle)
        assert closed >= 200  # the silent ones were closed (the header deadline) or refused (the cap)
        assert process.poll() is None
    finally:
        for sock in idle:
            sock.close()
        process.terminate()
        process.wait(10)
        log.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed (or refused with a 503 and closed) this connection."""
    sock.settimeout(0.01)
    try:
        sock.recv(1024)  # b"": closed; bytes: the 503 of the connection cap
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def test_the_login_cookie_is_derived_per_port_and_never_the_token(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "good")
    token = "t" * 32
    with running_ui("--runs", str(runs), env={"MLSCALE_UI_TOKEN": token}) as (base, _):
        login = httpx.get(f"{base}/?token={token}")
        port = base.rsplit(":", 1)[1]
        (name, value), = login.cookies.items()
        assert name == f"mlscale_ui_{port}" and value != token and token not in login.headers["set-cookie"]
        assert "secure" not in login.headers["set-cookie"].lower()  # on loopback, over plain http
        with httpx.Client(base_url=base, cookies=login.cookies) as browser_like:
            assert browser_like.get("/api/runs").status_code == 200
        assert httpx.get(f"{base}/api/runs", cookies={name: token}).status_code == 401  # the raw token is no cookie


# -- a scraped server ---------------------------------------------------------------------------------


class _Hostile(BaseHTTPRequestHandler):
    mode = "slow"

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        try:
            if self.server.mode == "slow":  # a byte every 0.5 s, for ever
                for _ in range(60):
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.5)
            else:  # 50 MB of metrics
                line = b"mlscale_inference_request_success_total{model=\"d\",version=\"1\"} 1\n"
                for _ in range(50_000_000 // len(line)):
                    self.wfile.write(line)
        except OSError:
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("mode, says", [("slow", "too slow"), ("huge", "too large")])
def test_a_slow_or_huge_server_is_given_up_within_one_deadline(mode, says):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.mode = mode
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        watch = ServerWatch(f"http://127.0.0.1:{server.server_address[1]}", 100.0)
        threads = threading.active_count()
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: watch.poll(), range(8)))  # eight pages at once: one scrape
        assert time.perf_counter() - start < 5  # was 7 s a call, 38 threads
        assert results[0]["up"] is False and results[0]["error"] == says
        assert threading.active_count() <= threads + 1
    finally:
        server.shutdown()
        server.server_close()


def _rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_six_live_streams_from_the_start_of_a_long_run_cost_bounded_memory(tmp_path):
    """6 streams with after=0 on a 26 MB run sent 23 MB each at once and added 434 MB of peak memory."""
    run = write_synthetic_run(tmp_path / "runs" / "long", steps=20_000, ranks=16, log_every=2, slow_rank=3)
    run.report_path.unlink(missing_ok=True)  # a run in progress: the page follows it live
    base, _, process, log = _listening_ui("--runs", str(tmp_path / "runs"))
    try:
        httpx.get(f"{base}/api/run?id=long", timeout=60)  # read once, as opening its page does
        idle, peak, done = _rss_mb(process.pid), [0.0], threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                peak[0] = max(peak[0], _rss_mb(process.pid))

        def stream() -> int:
            rows = 0
            with httpx.stream("GET", f"{base}/api/live", params={"id": "long", "after": "0"}, timeout=30) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: ["):
                        rows += line.count('"line":')
                    if rows >= 10_000:
                        return rows
            return rows

        threading.Thread(target=sample, daemon=True).start()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            counts = list(pool.map(lambda _: stream(), range(6)))
        done.set()
        assert min(counts) >= 10_000  # every line, to each stream
        assert peak[0] - idle < 120, (idle, peak[0])
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def test_samples_left_out_by_bad_samples_skip_are_events_of_the_run_page_each_field_checked(tmp_path):
    error = "sample 37: ValueError: cannot decode " + "x" * 500
    lines = (json.dumps({"step": 3, "index": 37, "epoch": 0, "error": error}) + "\n"
             + '{"step": "three", "index": [1], "epoch": null, "error": 5}\n' + "not json\n")
    run = _run(tmp_path, "run", **{"metrics.jsonl": _line(1), "bad_samples__rank1.jsonl": lines,
                                   "bad_samples__notes.txt": "not a rank's file"})
    events = [e for e in RunView("run", run.path).detail()["events"] if e["kind"] == "bad_sample"]
    assert [(e["step"], e["rank"]) for e in events] == [(None, 1), (3, 1)]
    assert events[1]["text"].startswith("sample 37 left out (epoch 0, rank 1): sample 37: ValueError: cannot decode")
    assert len(events[1]["text"]) < 250  # the error cut to what the table shows
