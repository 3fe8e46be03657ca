"""`mlscale ui` in a real browser (Debian's Chromium, headless, driven by Playwright) over runs this module
makes for real: a ddp run with a killed rank and a slowed one, a per-step fault-tolerant run watched while
it trains, a long run that must be down-sampled, a registered and exported model served under load. Each
page must load without a console error, and its charts must hold the runs' own records."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlscale.bench.ui import write_synthetic_run
from mlscale.rundir import RunDir
from tests.conftest import unavailable
from tests.helpers import REPO, run_cli
from tests.serve.conftest import running_server
from tests.ui.conftest import FIREFOX, Watched, running_ui

KILL_STEP, SLOW_RANK = 25, 1


def _standing(run_dir: Path) -> list[dict]:
    """metrics.jsonl's lines that stand: a step written again after a restart replaces the first try."""
    standing: dict[int, dict] = {}
    for record in RunDir(run_dir).read_metrics():
        standing = {s: r for s, r in standing.items() if s < record["step"]}
        standing[record["step"]] = record
    return [standing[s] for s in sorted(standing)]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The runs folder (a killed-and-slowed ddp run, a pipeline run, a long synthetic one) and a registry
    holding the ddp run's model, exported to ONNX and staged."""
    from mlscale.export import export_version
    from mlscale.registry import Registry, register_run

    root = tmp_path_factory.mktemp("ui")
    runs = root / "runs"
    result = run_cli("train", "--task", "digits", "--workers", "2", "--steps", "60", "--log-every", "2",
                     "--checkpoint-every", "10", "--max-restarts", "1", "--no-progress", "--eval-every", "20",
                     "--fault", f"kill:rank=1:step={KILL_STEP}", "--fault", f"slow:rank={SLOW_RANK}:delay_ms=20",
                     "--run-dir", str(runs / "faulty"), timeout=240)
    assert result.returncode == 0, result.stderr
    result = run_cli("train", "--task", "tinylm", "--strategy", "pipeline", "--workers", "2", "--stages", "2",
                     "--microbatches", "2", "--steps", "6", "--log-every", "2", "--no-progress",
                     "--run-dir", str(runs / "pipe"), timeout=240)
    assert result.returncode == 0, result.stderr
    write_synthetic_run(runs / "long", steps=3_000, ranks=4, log_every=1, slow_rank=2)
    registry = Registry(str(root / "registry"))
    register_run(registry, runs / "faulty", "digits", description="ddp, one rank killed")
    export_version(registry, "models:/digits/1")
    registry.set_stage("digits", 1, "Production")
    registry.set_alias("digits", 1, "production")
    return runs, str(root / "registry")


def _points(series: dict) -> list[list[float]]:
    return [list(point) for point in series["data"]]


def test_runs_table_and_the_run_page_hold_the_runs_records(browser, made, screenshots):
    runs, registry = made
    faulty = RunDir(runs / "faulty")
    standing = _standing(faulty.path)
    report = faulty.read_report()
    with running_ui("--runs", str(runs), "--registry", registry) as (base, _):
        page = Watched(browser)
        page.open(f"{base}/#/runs")
        rows = page.page.locator("#runs-table tbody tr")
        assert sorted(rows.evaluate_all("(rows) => rows.map((r) => r.dataset.run)")) == ["faulty", "long", "pipe"]
        page.page.click("th[data-key=steps]")  # sorted by steps, most first
        assert rows.evaluate_all("(rows) => rows.map((r) => r.dataset.run)") == ["long", "faulty", "pipe"]
        page.page.click("th[data-key=steps]")  # and the other way
        assert rows.evaluate_all("(rows) => rows.map((r) => r.dataset.run)") == ["pipe", "faulty", "long"]
        row = page.page.locator("tr[data-run=faulty]").inner_text()
        assert "completed" in row and "ddp" in row and "60 / 60" in row
        page.page.fill("#run-search", "digits")
        assert rows.evaluate_all("(rows) => rows.map((r) => r.dataset.run)") == ["faulty"]
        page.page.fill("#run-search", "")

        page.open(f"{base}/#/run/faulty")
        loss, *evaluated = page.series("chart-loss")
        assert _points(loss) == [[r["step"], pytest.approx(r["loss"], abs=1e-6)] for r in standing]
        evals = [e for r in standing for e in r.get("eval", [])]
        assert len(evals) >= 2 and {s["name"] for s in evaluated} == {"eval accuracy", "eval loss"}
        accuracy = next(s for s in evaluated if s["name"] == "eval accuracy")
        assert _points(accuracy) == [[e["step"], pytest.approx(e["accuracy"])] for e in evals]
        speed, *_ = page.series("chart-speed")
        assert _points(speed) == [[r["step"], pytest.approx(r["samples_per_s"], abs=0.06)] for r in standing]
        compute = page.series("chart-split")[0]
        assert _points(compute) == [[r["step"], pytest.approx(sum(x["compute_ms"] for x in r["per_rank"]) / 2,
                                                              abs=2e-3)] for r in standing]
        # the heat map: the slowed rank's row is hot, the other's is not
        cells = page.series("chart-stragglers")[0]["data"]
        threshold = report["straggler_detection"]["threshold"]
        by_rank = {rank: [score for _, r, score in cells if r == rank] for rank in (0, 1)}
        assert max(by_rank[SLOW_RANK]) >= threshold and max(by_rank[1 - SLOW_RANK]) < threshold
        # the failure and the recovery on the timeline, at the kill's step
        recovery = json.loads(faulty.recovery_path.read_text().splitlines()[0])
        marks = {m["name"]: m["xAxis"] for m in loss["markLine"]}
        assert marks["kill"] == KILL_STEP and marks["restart"] == recovery["failed_at_step"] == KILL_STEP - 1
        assert marks["resume"] == recovery["resumed_from_step"]
        assert page.page.locator("#events tr[data-kind=kill]").get_attribute("data-step") == str(KILL_STEP)
        heat_lines = [m["xAxis"] for m in page.series("chart-stragglers")[0]["markLine"]]
        steps = page.option("chart-stragglers", "xAxis.0.data")
        assert str(KILL_STEP - 1) in [steps[i] for i in heat_lines]  # the restart line, on the heat map too
        memory = page.series("chart-memory")
        assert [m["rank"] for m in report["memory"]] == [0, 1] and memory[0]["data"]
        assert json.loads(page.page.locator("#run-config").text_content())["strategy"] == "ddp"
        assert page.page.locator("#resolution").inner_text().startswith("every record")  # not down-sampled
        page.page.locator("#chart-loss").hover()  # a tooltip (HTML the page's CSP must allow)
        page.page.locator("#chart-stragglers").hover()
        time.sleep(0.3)
        page.page.screenshot(path=str(screenshots / "run.png"), full_page=True)

        # overlaid on another run
        page.open(f"{base}/#/run/faulty?vs=long")
        names = [s["name"] for s in page.series("chart-loss")]
        assert "loss (faulty)" in names and "loss (long)" in names

        # a long run reaches the page down-sampled; zoomed in, every record
        page.open(f"{base}/#/run/long")
        assert "down-sampled" in page.page.locator("#resolution").inner_text()
        assert len(page.series("chart-loss")[0]["data"]) == 600
        page.page.evaluate("""() => echarts.getInstanceByDom(document.getElementById('chart-loss'))
            .dispatchAction({type: 'dataZoom', start: 50, end: 55})""")
        deadline = time.monotonic() + 15
        while not page.page.locator("#resolution").inner_text().startswith("every record"):  # the zoomed data drawn
            assert time.monotonic() < deadline, page.page.locator("#resolution").inner_text()
            time.sleep(0.1)
        long_standing = {r["step"]: r for r in _standing(runs / "long")}
        zoomed = _points(page.series("chart-loss")[0])
        assert 100 <= len(zoomed) <= 200
        assert zoomed == [[step, pytest.approx(long_standing[step]["loss"], abs=1e-6)] for step, _ in zoomed]
        assert [s for s, _ in zoomed] == sorted(s for s in long_standing if zoomed[0][0] <= s <= zoomed[-1][0])
        assert page.errors == []
        page.close()


def test_a_pipeline_run_shows_its_stages_and_memory(browser, made):
    runs, _ = made
    report = RunDir(runs / "pipe").read_report()
    with running_ui("--runs", str(runs)) as (base, _):
        page = Watched(browser)
        page.open(f"{base}/#/run/pipe")
        params, stage_ms = page.series("chart-stages")
        assert params["data"] == report["pipeline"]["stage_params"]
        assert stage_ms["data"] == [pytest.approx(r["step_ms_p50"]) for r in report["per_rank"][:2]]
        memory = page.series("chart-memory")
        assert {s["name"]: s["data"] for s in memory}["params"] == [m["params_mb"] for m in report["memory"]]
        assert page.errors == []
        page.close()


def test_registry_pages_show_lineage_and_link_to_the_run(browser, made, screenshots):
    from mlscale.registry import Registry

    runs, registry_path = made
    registry = Registry(registry_path, create=False)
    version = registry.get_version("digits", 1)
    with running_ui("--runs", str(runs), "--registry", registry_path) as (base, _):
        page = Watched(browser)
        page.open(f"{base}/#/registry")
        row = page.page.locator("tr[data-model=digits]").inner_text()
        assert "Production v1" in row and "@production" in row
        page.page.click("tr[data-model=digits] a")
        page.ready("/registry/digits")
        card = page.page.locator(".version[data-version='1']")
        assert card.locator("a.source-run").get_attribute("href") == "#/run/faulty"
        assert "verified" in card.locator("tr[data-field='source run']").inner_text()
        assert card.locator("tr[data-field=data] td").inner_text() == version.data_fingerprint
        parity = version.artifacts["model.onnx"].info["parity"]
        assert f"{parity['samples']} inputs" in card.locator("tr[data-field='ONNX parity']").inner_text()
        assert page.page.locator("#history-table tbody tr").count() == len(registry.history("digits"))
        page.page.screenshot(path=str(screenshots / "registry.png"), full_page=True)
        page.page.click(".version[data-version='1'] a.source-run")
        page.ready("/run/faulty")
        assert page.errors == []
        page.close()


def test_the_serving_page_follows_a_server_under_load(browser, made, screenshots):
    from mlscale.registry import Registry
    from mlscale.registry.models import sample_request

    runs, registry_path = made
    rows = sample_request(Registry(registry_path, create=False).get_version("digits", 1), rows=256)["inputs"][0]
    width = rows["shape"][1]
    bodies = [{"inputs": [{**rows, "shape": [1, width], "data": rows["data"][i * width:(i + 1) * width]}]}
              for i in range(256)]  # held-out rows, each its own request: answers computed, not cache hits
    stop = threading.Event()
    with running_server(registry_path, "models:/digits@production", "--no-grpc") as (server, _):
        def load(offset: int) -> None:
            with httpx.Client(base_url=server, timeout=10) as client:
                for n in itertools.count(offset, 2):
                    if stop.is_set():
                        return
                    body = bodies[n % len(bodies)]
                    first = body["inputs"][0]  # a new input each time (the pixel a hair apart): never a cache hit
                    unique = {"inputs": [{**first, "data": [first["data"][0] + n * 1e-6, *first["data"][1:]]}]}
                    client.post("/v2/models/digits/infer", json=unique)
                    time.sleep(0.005)

        loaders = [threading.Thread(target=load, args=(offset,), daemon=True) for offset in range(2)]
        for loader in loaders:
            loader.start()
        try:
            with running_ui("--runs", str(runs), "--server", server) as (base, _):
                page = Watched(browser)
                page.open(f"{base}/#/serving")
                row = page.page.locator("[data-server='0'] tr[data-version='digits/1']")
                deadline = time.monotonic() + 30
                while True:  # the second scrape gives rates: answers per second over the interval
                    cells = row.locator("td").all_inner_texts() if row.count() else []
                    if cells and cells[5] not in ("–", "0"):
                        break
                    assert time.monotonic() < deadline, cells
                    time.sleep(0.3)
                assert cells[2] == "primary" and float(cells[5].replace(",", "")) > 0
                assert cells[7] != "–" and cells[9] != "–"  # p50 and p99 from the server's histogram
                time.sleep(2.5)  # a few more scrapes for the time series
                batches = page.series("srv0-batches")[0]["data"]
                assert sum(batches) > 0
                answered = [v for v in page.series("srv0-rate")[1]["data"] if v is not None]
                assert len(answered) >= 2 and max(answered) > 0
                served = httpx.get(f"{server}/metrics").text
                assert "mlscale_inference_request_success" in served
                page.page.screenshot(path=str(screenshots / "serving.png"), full_page=True)
                assert page.errors == []
                page.close()
        finally:
            stop.set()
            for loader in loaders:
                loader.join(10)


def test_a_run_in_progress_gains_points_without_a_reload(browser, made, screenshots, tmp_path):
    """A per-step fault-tolerant run (torchft), one replica group killed and replaced: its page gains the
    records as they are written (pushed, the page never reloads), then shows the live recovery."""
    runs, _ = made
    run_dir = runs / "live"
    args = ["train", "--task", "digits", "--workers", "2", "--fault-tolerance", "per-step", "--steps", "40",
            "--batch-size", "16", "--simulated-compute-ms", "150", "--heartbeat-timeout-ms", "300",
            "--max-restarts", "1", "--log-every", "2", "--collective-timeout", "30", "--no-progress", "--no-plot",
            "--fault", "kill:rank=1:step=12:rejoin_by=20", "--run-dir", str(run_dir)]
    with (tmp_path / "stderr").open("w") as err:
        job = subprocess.Popen([sys.executable, "-m", "mlscale", *args], stdout=subprocess.DEVNULL, stderr=err,
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            metrics = RunDir(run_dir).metrics_path
            deadline = time.monotonic() + 120
            while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
                assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
                time.sleep(0.2)
            with running_ui("--runs", str(runs)) as (base, _):
                page = Watched(browser)
                page.open(f"{base}/#/runs")  # the table with a run in progress
                assert "running" in page.page.locator("tr[data-run=live]").inner_text()
                page.page.screenshot(path=str(screenshots / "runs.png"))
                page.open(f"{base}/#/run/live")
                assert "running" in page.page.locator("h1").inner_text()
                page.page.evaluate("() => { window.sameDocument = true; }")
                before = len(page.series("chart-loss")[0]["data"])
                deadline = time.monotonic() + 90
                while len(page.series("chart-loss")[0]["data"]) < before + 2:
                    assert job.poll() is None and time.monotonic() < deadline, "no new points reached the page"
                    time.sleep(0.3)
                assert page.page.evaluate("() => window.sameDocument === true")  # pushed, not reloaded
                page.page.screenshot(path=str(screenshots / "live.png"), full_page=True)
                assert job.wait(timeout=180) == 0, (tmp_path / "stderr").read_text()
                time.sleep(1)  # the page notices the run ended (status polled every 3 s) ...
                page.open(f"{base}/#/run/live")  # ... and a fresh load shows the whole of it
                standing = _standing(run_dir)
                loss = page.series("chart-loss")[0]
                assert _points(loss) == [[r["step"], pytest.approx(r["loss"], abs=1e-6)] for r in standing]
                kinds = page.page.locator("#events tbody tr").evaluate_all(
                    "(rows) => rows.map((r) => [r.dataset.kind, r.dataset.step])")
                assert ["kill", "12"] in kinds
                assert any(kind == "live_recovery" and int(step) >= 12 for kind, step in kinds), kinds
                assert page.errors == []
                page.close()
        finally:
            if job.poll() is None:
                job.kill()



def test_every_view_draws_in_firefox_without_an_error(made):
    """The pages in Firefox too (Debian's firefox-esr through WebDriver BiDi, by web/check-firefox.mjs on
    puppeteer-core from web/package-lock.json; `.ci/run` installs both): each view draws, no error logged."""
    from mlscale.registry import Registry
    from mlscale.registry.models import sample_request

    if not Path(FIREFOX).exists():
        unavailable(f"no Firefox at {FIREFOX} (apt-get install firefox-esr; .ci/run installs it)")
    if not shutil.which("node") or not (REPO / "web/node_modules/puppeteer-core").is_dir():
        unavailable("no node or no web/node_modules (cd web && npm ci; .ci/run runs it)")
    runs, registry_path = made
    body = sample_request(Registry(registry_path, create=False).get_version("digits", 1), rows=4)
    views = ["/run/faulty", "/run/faulty?vs=long", "/run/long", "/run/pipe", "/registry/digits"]
    with running_server(registry_path, "models:/digits@production", "--no-grpc") as (server, _):
        for _ in range(3):
            assert httpx.post(f"{server}/v2/models/digits/infer", json=body).status_code == 200
        with running_ui("--runs", str(runs), "--registry", registry_path, "--server", server) as (base, _):
            result = subprocess.run(["node", "web/check-firefox.mjs", base, *views], cwd=REPO, timeout=300,
                                    capture_output=True, text=True, env={**os.environ, "FIREFOX": FIREFOX})
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    drawn = [line for line in result.stdout.splitlines() if " drawn in " in line]
    assert len(drawn) == 3 + len(views) and all(line.endswith(" 0 error(s)") for line in drawn), result.stdout
    assert all(" 0 chart canvas" not in line for line in drawn if "/run/" in line), result.stdout
