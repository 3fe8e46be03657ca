"""``mlscale bench serve`` counts the processes of a server's group (LitServe runs several on the one
server core) and records each LitServe system's settings; both without starting LitServe."""

import os
import subprocess
import sys
import time

from mlscale.bench.anchors import LITSERVE_SYSTEMS, litserve_config
from mlscale.bench.serve import Server, describe_server, group_processes


def test_group_processes_counts_a_server_and_the_processes_it_started():
    child = ("import subprocess, sys, time; "
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    server = Server("litserve", process, 0, "/predict", [])
    try:
        deadline = time.time() + 30
        while len(group_processes(process.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert group_processes(process.pid)[0] == process.pid
        assert len(group_processes(process.pid)) == 2
        assert os.getpid() not in group_processes(process.pid)
    finally:
        server.stop()
    assert group_processes(process.pid) == []


def test_litserve_systems_record_their_settings():
    default, tuned = (litserve_config(system, 64, 0.01) for system in LITSERVE_SYSTEMS)
    assert (default["max_batch_size"], default["batch_timeout"]) == (64, 0.01)  # the shared batching settings
    assert not default["frozen_gc"] and tuned == {**default, "frozen_gc": True}
    server = Server("litserve", None, 0, "/predict", [], processes=5, config=default)  # type: ignore[arg-type]
    row = describe_server(server)
    assert row["server_processes"] == 5 and row["litserve_config"] == default
    assert "5 processes" in row["note"]
    fastapi = Server("fastapi", None, 0, "/predict", [], processes=1)  # type: ignore[arg-type]
    assert "litserve_config" not in describe_server(fastapi)
