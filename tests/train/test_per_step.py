"""Per-step fault tolerance (torchft): killed replica groups cost the others no restart, and their
replacements recover live from a peer.

One ddp run of 3 replica groups (real worker processes under their own torchrun agents, gloo, float64,
checkpoints only at the end) loses two of them to SIGKILL: group 1 in the middle of step 5 (a step in
flight, which the quorum discards and redoes), then group 0, the quorum's leader that writes the run
directory, before step 13. Each comes back under its agent and receives the state from a live peer.
The final weights are compared with a reference that averages, step by step, the gradients of exactly
the groups the quorum recorded. While it runs, the job's listening sockets are checked: loopback only,
and a state fetch without the job's token gets 401. One HSDP run (fsdp inside 2 groups of 2
processes) loses a process of group 1: the whole group restarts and each of its ranks receives its own
shards from the same rank of group 0.
"""

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from mlscale.config import TrainConfig
from mlscale.data import ShardLoader
from mlscale.tasks import make_task
from mlscale.train.strategies.per_step import read_replica_logs
from mlscale.train.trainer import build_optimizer, lr_factor
from tests.helpers import REPO, final_weights, run_cli

STEPS, GROUPS, BATCH, COMPUTE_MS = 28, 3, 16, 300
# replica group -> how, the step (1-based), and the step before which the others wait for its replacement
# to be up (rejoin_by: the test waits on the replacement, not on the host starting it fast)
KILLS = {1: ("kill_in_step", 5, 12), 0: ("kill", 13, 24)}
HSDP_STEPS, HSDP_COMPUTE_MS = 28, 150


TOKEN = secrets.token_urlsafe(32)  # the job's secret ($MLSCALE_JOB_TOKEN) for the killed run


@pytest.fixture(scope="module")
def killed_run_live(tmp_path_factory):
    """The killed run, and what its sockets looked like while it ran (``_probe``)."""
    root = tmp_path_factory.mktemp("per-step")
    run_dir = root / "run"
    faults = [arg for group, (kind, step, by) in KILLS.items()
              for arg in ("--fault", f"{kind}:rank={group}:step={step}:rejoin_by={by}")]
    args = ["train", "--task", "digits", "--workers", str(GROUPS), "--fault-tolerance", "per-step",
            "--steps", str(STEPS), "--batch-size", str(BATCH), "--dtype", "float64",
            "--simulated-compute-ms", str(COMPUTE_MS), "--heartbeat-timeout-ms", "300",
            "--max-restarts", "1", "--log-every", "4", "--collective-timeout", "30",
            "--run-dir", str(run_dir), *faults]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLSCALE_JOB_TOKEN": TOKEN}
    with (root / "stdout").open("w") as out, (root / "stderr").open("w") as err:
        job = subprocess.Popen([sys.executable, "-m", "mlscale", *args], stdout=out, stderr=err, cwd=REPO, env=env)
        try:
            probe = _probe(job, run_dir)
            code = job.wait(timeout=150)
        finally:
            if job.poll() is None:
                job.kill()
    stderr = (root / "stderr").read_text()
    assert code == 0, stderr
    report = json.loads((run_dir / "report.json").read_text())
    return run_dir, report, read_replica_logs(run_dir), stderr, {**probe, "stdout": (root / "stdout").read_text()}


@pytest.fixture(scope="module")
def killed_run(killed_run_live):
    return killed_run_live[:4]


def _probe(job, run_dir):
    """Once group 2 (never killed) has trained a step: every TCP socket the job's processes listen on, which
    of them answer on a non-loopback address of this machine, and group 2's state transport's answers to
    requests without the token."""
    deadline, transport = time.monotonic() + 120, None
    while transport is None and time.monotonic() < deadline and job.poll() is None:
        with contextlib.suppress(OSError, ValueError):  # a line being written
            lines = read_replica_logs(run_dir).get((2, 0), [])
            if any(line["event"] == "step" for line in lines):
                transport = next(line["transport"] for line in lines if line["event"] == "up")
        time.sleep(0.05)
    assert transport is not None, "the run ended or stalled before its first step"
    sockets = _listening(job.pid)
    outside = _non_loopback_address()
    answers = {name: _get(f"{transport}1/full", headers) for name, headers in
               (("no token", {}), ("a wrong token", {"Authorization": "Bearer " + secrets.token_urlsafe(32)}),
                ("the token without Bearer", {"Authorization": TOKEN}))}
    return {"sockets": sockets, "outside": outside, "transport": transport, "answers": answers,
            "reachable_outside": [port for _, port, _ in sockets if outside and _connects(outside, port)]}


def _listening(root):
    """(address, port, pid) of each TCP socket listening in process ``root`` and its descendants."""
    children = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(
                int(entry.name))
    tree, owner = [root], {}
    for pid in tree:
        tree.extend(children.get(pid, []))
        with contextlib.suppress(OSError):
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        owner[target[8:-1]] = pid
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in owner:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = b"".join(struct.pack("<I", int(address[i:i + 8], 16)) for i in range(0, len(address), 8))
            found.append((socket.inet_ntop(family, raw), int(port, 16), owner[fields[9]]))
    return found


def _non_loopback_address():
    """An IPv4 address of this machine other than loopback, or None."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
        for address in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", shown):
            if not address.startswith("127."):
                return address
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # a UDP "connection" sends nothing: the source address of the route
        if not probe.getsockname()[0].startswith("127."):
            return probe.getsockname()[0]
    return None


def _connects(host, port):
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def _get(url, headers):
    """(status, body) of a GET."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _steps(lines):
    return [line for line in lines if line["event"] == "step"]


def test_the_survivors_never_stop(killed_run):
    _, report, logs, stderr = killed_run
    assert report["status"] == "completed" and report["steps"] == STEPS
    killed_at = KILLS[0][1] - 1  # the 0-based step group 0 died before
    # A step in which a replacement rejoined (group 1's may fall near this kill) is a quorum growing
    # and a state sent, not a survivor waiting; a survivor's steps before its own rejoining are not its.
    rejoined = {line["step"] for lines in logs.values() for line in lines if line["event"] == "received"}
    for group in (1, 2):
        joined = max((line["step"] for line in logs[group, 0] if line["event"] == "received"), default=-1)
        rows = [row for row in _steps(logs[group, 0])
                if row["committed"] and row["step"] > joined and row["step"] not in rejoined]
        typical = statistics.median(row["ms"] for row in rows)
        around = [row for row in rows if abs(row["step"] - killed_at) <= 3]
        assert around and all(row["ms"] < 3 * typical for row in around), (group, typical, around)
    for group in set(range(GROUPS)) - set(KILLS):  # one process all along: never restarted
        assert [line["attempt"] for line in logs[group, 0] if line["event"] == "start"] == [0]
    assert "replica group 0 restarted" in stderr and "replica group 1 restarted" in stderr


def test_each_replacement_received_the_state_of_a_live_peer_bitwise(killed_run):
    run_dir, report, logs, _ = killed_run
    sent = {(line["step"], line["sha256"]) for lines in logs.values() for line in lines if line["event"] == "sent"}
    for victim, (_, kill_step, by) in KILLS.items():
        starts = [line for line in logs[victim, 0] if line["event"] == "start"]
        assert [line["attempt"] for line in starts] == [0, 1]
        [received] = [line for line in logs[victim, 0] if line["event"] == "received"]
        # at the earliest the state the survivors held at the kill (a warm replacement can be back in time
        # to redo the step in flight with them), at the latest the step the others waited for it
        assert kill_step - 1 <= received["step"] <= by
        # weights, optimizer state and schedule as the survivor that sent them held them
        assert (received["step"], received["sha256"]) in sent
    # no checkpoint existed then: only the final one is ever written (live recovery needs none)
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == [f"step_{STEPS:08d}"]
    recoveries = report["recovery"]["live_recoveries"]
    assert sorted(r["replica"] for r in recoveries) == [0, 1]
    assert all(r["state_matches_sender"] and 0 < r["rejoin_s"] < 60 for r in recoveries)


def test_every_replica_ends_with_the_same_state(killed_run):
    _, _, logs, _ = killed_run
    finals = {group: [line for line in lines if line["event"] == "final"][-1] for group, lines in logs.items()}
    assert {line["step"] for line in finals.values()} == {STEPS}
    assert len({line["sha256"] for line in finals.values()}) == 1


def test_the_step_in_flight_is_discarded_and_redone_once(killed_run):
    _, _, logs, _ = killed_run
    in_flight = KILLS[1][1] - 1
    for group in (0, 2):  # group 0 was alive then
        rows = [row for row in _steps(logs[group, 0]) if row["step"] == in_flight]
        assert [row["committed"] for row in rows] == [False, True], rows


def test_no_sample_is_trained_twice_and_the_missing_ones_are_counted(killed_run):
    _, report, logs, _ = killed_run
    for lines in logs.values():
        committed = [row["step"] for row in _steps(lines) if row["committed"]]
        assert len(committed) == len(set(committed))  # a redone step is the same batch, committed once
    history = participants_by_step(report)
    missing = sum(GROUPS - len(history.get(step, range(GROUPS))) for step in range(STEPS))
    # a kill costs the steps the quorum went on without the group: none when its replacement (warm) was back
    # for the redo of the step it died in, at most those up to the step the others waited for it
    assert missing <= sum(by - step + 1 for _, step, by in KILLS.values())
    assert report["recovery"]["samples_not_trained"] == missing * BATCH
    assert report["samples_seen"] == (STEPS * GROUPS - missing) * BATCH


def participants_by_step(report):
    return {step: run["participants"] for run in report["recovery"]["degraded_steps"]
            for step in range(run["steps"][0], run["steps"][1] + 1)}


def test_the_weights_are_those_of_the_recorded_history(killed_run):
    """A float64 reference that averages, at each step, the gradients of exactly the recorded participants."""
    run_dir, report, _, _ = killed_run
    assert_trained_as_recorded(run_dir, report, GROUPS, group_size=1)


def assert_trained_as_recorded(run_dir, report, groups, group_size, steps=STEPS):
    shards = groups * group_size
    config = TrainConfig(task="digits", steps=steps, batch_size=BATCH, dtype="float64", workers=groups)
    task = make_task("digits", {})
    data = task.train.to(torch.float64)
    torch.manual_seed(config.seed)
    model = task.build_model().to(torch.float64)
    optimizer = build_optimizer(config, model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config, steps))
    loaders = [ShardLoader(data, rank=shard, world=shards, step_batch=BATCH, seed=config.seed)
               for shard in range(shards)]
    history = participants_by_step(report)
    for step in range(steps):
        batches = [next(loader) for loader in loaders]  # every shard moves on, trained or not
        groups_in = history.get(step, list(range(groups)))
        members = [group * group_size + rank for group in groups_in for rank in range(group_size)]
        total = None
        for member in members:
            model.zero_grad(set_to_none=True)
            task.loss_fn(model(batches[member][0]), batches[member][1]).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for param, grad in zip(model.parameters(), total):
            param.grad = grad / len(members)
        optimizer.step()
        schedule.step()
    trained = final_weights(run_dir)
    expected = model.state_dict()
    assert trained.keys() == expected.keys()
    worst = max((trained[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-10, worst


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hsdp") / "run"
    result = run_cli("train", "--task", "digits", "--strategy", "fsdp", "--workers", "2", "--group-size", "2",
                     "--fault-tolerance", "per-step", "--steps", str(HSDP_STEPS), "--batch-size", str(BATCH),
                     "--dtype", "float64", "--simulated-compute-ms", str(HSDP_COMPUTE_MS),
                     "--heartbeat-timeout-ms", "300", "--max-restarts", "1", "--log-every", "4",
                     "--collective-timeout", "30", "--fault", "kill:rank=2:step=3:rejoin_by=20",
                     "--checkpoint-every", "8", "--run-dir", str(run_dir), timeout=150)
    assert result.returncode == 0, result.stderr
    return run_dir, json.loads((run_dir / "report.json").read_text()), read_replica_logs(run_dir)


def test_hsdp_a_replacement_group_receives_each_ranks_shards_and_trains_as_recorded(hsdp_run):
    run_dir, report, logs = hsdp_run
    assert report["status"] == "completed" and report["fault_tolerance"]["group_size"] == 2
    for key in ((0, 0), (0, 1)):  # group 0's two processes never restarted
        assert [line["attempt"] for line in logs[key] if line["event"] == "start"] == [0]
    sent = {(line["step"], line["sha256"]) for lines in logs.values() for line in lines if line["event"] == "sent"}
    for key in ((1, 0), (1, 1)):  # both ranks of group 1 came back and got their own rank's shards
        # Once, or again when a later quorum (a heartbeat missed on busy cores) sent the state anew: seen
        # once in 3 runs of the whole suite on 2 cores. Every state received must be one that was sent.
        received = [line for line in logs[key] if line["event"] == "received"]
        assert received and all((line["step"], line["sha256"]) in sent for line in received)
    finals = {key: [line for line in lines if line["event"] == "final"][-1]["sha256"] for key, lines in logs.items()}
    assert finals[0, 0] == finals[1, 0] and finals[0, 1] == finals[1, 1]  # rank r's shards, bitwise, per group
    # what the steps group 1 missed cost, as the quorum recorded them (none when its replacement, warm,
    # was back before a step went on without it): each of its ranks' batch a step
    history = participants_by_step(report)
    missing = sum(2 - len(history.get(step, range(2))) for step in range(HSDP_STEPS))
    assert report["recovery"]["samples_not_trained"] == missing * 2 * BATCH
    assert_trained_as_recorded(run_dir, report, groups=2, group_size=2, steps=HSDP_STEPS)


def test_the_job_listens_on_loopback_only_and_its_state_needs_the_token(killed_run_live):
    run_dir, _, _, stderr, probe = killed_run_live
    sockets = probe["sockets"]
    # the lighthouse (the launcher's), each agent's stores, each worker's Manager, transport and gloo
    assert len({pid for _, _, pid in sockets}) >= 1 + 2 * GROUPS, sockets
    assert all(address in ("127.0.0.1", "::1") for address, _, _ in sockets), sockets
    for name, (status, body) in probe["answers"].items():
        assert status == 401, (name, status, body)
        assert re.findall(rb"\d+", body) == [b"401"], body  # nothing about the state, not even its step
    written = [path.read_bytes() for path in run_dir.rglob("*") if path.is_file()]
    assert not any(TOKEN.encode() in data for data in written)  # config, report, logs: none holds the secret
    assert TOKEN not in stderr and TOKEN not in probe["stdout"]
    if probe["outside"] is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try the job's ports from")
    assert probe["reachable_outside"] == [], (probe["outside"], probe["reachable_outside"])


def test_the_state_transport_answers_only_the_jobs_token():
    """In process, on real sockets: a fetch with the token gets the state; without it, or with another
    job's, 401 and nothing about the state."""
    from mlscale.train.strategies.per_step import _safe_transport

    timeout = timedelta(seconds=20)
    sender, receiver, stranger = (_safe_transport(timeout, token, "127.0.0.1") for token in ("s3cret", "s3cret",
                                                                                             "other"))
    try:
        state = {"model": {"w": torch.arange(4.0)}, "job": {"history": [[2, 3, [0]]], "position": [0, 64]}}
        sender.send_checkpoint([1], step=7, state_dict=state, timeout=timeout)
        address = sender.metadata()
        assert address.startswith("http://127.0.0.1:")
        received = receiver.recv_checkpoint(0, address, 7, timeout)
        assert torch.equal(received["model"]["w"], state["model"]["w"]) and received["job"] == state["job"]
        with pytest.raises(urllib.error.HTTPError, match="401"):
            stranger.recv_checkpoint(0, address, 7, timeout)
        for step in (7, 8):
            status, body = _get(f"{address}{step}/full", {})
            assert status == 401 and re.findall(rb"\d+", body) == [b"401"], body
    finally:
        for transport in (sender, receiver, stranger):
            transport.shutdown()


def test_a_replica_that_finds_the_last_step_committed_leaves(tmp_path):
    """What keeps a replacement that came too late from training alone over a finished run."""
    from mlscale.rundir import RunDir
    from mlscale.train.strategies.per_step import job_finished

    finished = RunDir(tmp_path).finished_path
    assert not job_finished(tmp_path, 20)  # no marker yet
    finished.parent.mkdir(parents=True)
    finished.write_text(json.dumps({"step": 20}))
    assert job_finished(tmp_path, 20)
    assert not job_finished(tmp_path, 30)  # a resumed run going on to step 30
    finished.write_text("{")  # torn
    assert not job_finished(tmp_path, 20)


def test_hsdp_checkpoints_are_written_by_the_leading_group_and_a_lost_job_resumes(hsdp_run, tmp_path):
    """Checkpoints are for losing the whole job: the leading group's ranks write them together, and
    ``--resume`` continues the run from the newest one."""
    run_dir, _, _ = hsdp_run
    steps = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert steps[-1] == f"step_{HSDP_STEPS:08d}" and len(steps) >= 2
    resumed = tmp_path / "run"
    shutil.copytree(run_dir, resumed)
    result = run_cli("train", "--run-dir", str(resumed), "--resume", "--steps", str(HSDP_STEPS + 4), timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads((resumed / "report.json").read_text())
    assert report["status"] == "completed" and report["resumed_from_step"] == HSDP_STEPS
    assert report["steps"] == HSDP_STEPS + 4 and report["recovery"]["degraded_steps"] == []
