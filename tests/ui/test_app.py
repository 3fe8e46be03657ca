"""`mlscale ui` as a server: loopback unless a token is given, the token asked of every request (header or
the cookie a first visit sets) and never printed, read-only, one-line refusals of bad settings."""

from __future__ import annotations

import os
import secrets
import socket

import httpx

from mlscale.rundir import RunDir
from tests.helpers import free_port, refused
from tests.ui.conftest import running_ui


def _runs(tmp_path):
    run = RunDir(tmp_path / "runs" / "one")
    run.path.mkdir(parents=True)
    run.write_config({"task": "digits", "strategy": "ddp", "workers": 1})
    return tmp_path / "runs"


def test_beyond_loopback_needs_a_token_and_bad_settings_are_one_line(tmp_path):
    runs = _runs(tmp_path)
    result = refused("ui", "--runs", str(runs), "--host", "0.0.0.0")
    assert result.returncode == 2 and "needs a token" in result.stderr and len(result.stderr.splitlines()) == 1
    result = refused("ui", "--runs", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no such folder" in result.stderr
    result = refused("ui", "--runs", str(runs), "--token", "short")
    assert result.returncode == 2 and "at least 16" in result.stderr
    result = refused("ui", "--runs", str(runs), "--server", "localhost:8000")
    assert result.returncode == 2 and "http://" in result.stderr
    result = refused("ui", "--runs", str(runs), "--registry", str(tmp_path / "no-registry"))
    assert result.returncode == 2 and "no registry" in result.stderr
    with socket.socket() as taken:
        port = free_port()
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = refused("ui", "--runs", str(runs), "--port", str(port))
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_token_guards_every_request_and_is_never_printed(tmp_path):
    token = secrets.token_hex(16)
    with running_ui("--runs", str(_runs(tmp_path)), env={"MLSCALE_UI_TOKEN": token}) as (base, process):
        assert httpx.get(f"{base}/api/runs").status_code == 401
        assert httpx.get(f"{base}/").status_code == 401
        assert httpx.get(f"{base}/api/runs", headers={"authorization": "Bearer " + "x" * 32}).status_code == 401
        ok = httpx.get(f"{base}/api/runs", headers={"authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and [r["id"] for r in ok.json()] == ["one"]
        login = httpx.get(f"{base}/?token={token}")  # a first visit: the token leaves the address for a cookie
        assert login.status_code == 303 and login.headers["location"] == "/"
        cookie = login.headers["set-cookie"]
        assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
        with httpx.Client(base_url=base, cookies=login.cookies) as browser_like:
            assert browser_like.get("/api/runs").status_code == 200
            assert browser_like.get("/static/app.js").status_code == 200
        assert httpx.get(f"{base}/?token={'y' * 32}").status_code == 401
    assert token not in process.stdout.read() + process.stderr.read()


def test_read_only_with_a_content_security_policy_and_unknown_runs_are_404(tmp_path):
    with running_ui("--runs", str(_runs(tmp_path))) as (base, _):
        page = httpx.get(f"{base}/")
        assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
        assert "<script src=\"/static/echarts.min.js\"" in page.text and "http" not in page.text.split("<body>")[0]
        assert httpx.post(f"{base}/api/runs").status_code == 405
        # a page of another site whose name was made to point here (DNS rebinding) reads nothing
        assert httpx.get(f"{base}/api/runs", headers={"host": "attacker.example:8080"}).status_code == 421
        assert httpx.get(f"{base}/api/runs", headers={"host": "localhost"}).status_code == 200
        for run_id in ("nope", "../one", str(tmp_path / "runs" / "one")):
            missing = httpx.get(f"{base}/api/run", params={"id": run_id})
            assert missing.status_code == 404 and "no run" in missing.json()["error"]
        detail = httpx.get(f"{base}/api/run", params={"id": "one"}).json()
        assert detail["status"] == "running" and detail["lines"] == 0 and detail["events"] == []  # just begun
        os.utime(tmp_path / "runs" / "one" / "config.json", (0, 0))  # begun long ago, no record since
        assert httpx.get(f"{base}/api/run", params={"id": "one"}).json()["status"] == "stopped"
        assert httpx.get(f"{base}/api/registry").json() == {"configured": False, "models": []}
        assert httpx.get(f"{base}/api/servers").json() == []
