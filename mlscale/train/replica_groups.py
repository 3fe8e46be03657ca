"""Launching a job under per-step fault tolerance on one machine: the torchft lighthouse, and one torchrun
agent per replica group.

Each agent runs its group's worker and restarts it (up to ``--max-restarts``) when it dies; the other
groups never notice more than a quorum without it. The lighthouse lives in this process (torchft's
``LighthouseServer``, the server behind its ``torchft_lighthouse`` binary) unless ``--lighthouse`` names
one that runs elsewhere, as a multi-host job needs. This process follows the run directory to show
progress and the quorum's changes, since the replica that writes the records changes with the quorum.

Everything the job listens on is on loopback (``LOCAL_HOST``): the lighthouse, each agent's stores
(``local_agent``), each worker's torchft Manager, checkpoint transport and gloo connections. Every state
transfer carries the job's secret (``$MLSCALE_JOB_TOKEN``, generated here unless set), which the
workers get in their environment and nothing writes down.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mlscale.config import TrainConfig
from mlscale.errors import UsageError, WorkerFailed
from mlscale.rundir import RunDir
from mlscale.train.dist import LOCAL_HOST, REPLICA_ENV, private_environment
from mlscale.train.progress import Progress
from mlscale.train.strategies.per_step import (
    LAUNCH_ENV,
    LIGHTHOUSE_ENV,
    TOKEN_ENV,
    import_torchft,
    job_finished,
)
from mlscale.train.trainer import NO_PROGRESS_ENV
from mlscale.train.warm import worker_command

_POLL_S = 0.2
_FINISHED_GRACE_S = 15.0  # after the report: for the other groups to write their last lines and leave


@contextlib.contextmanager
def lighthouse(config: TrainConfig) -> Iterator[str]:
    """The lighthouse's address: ``--lighthouse``, or one started here for the job's lifetime."""
    if config.torchft.lighthouse:
        yield config.torchft.lighthouse
        return
    import_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"{LOCAL_HOST}:0", min_replicas=config.torchft.min_replicas,
                              join_timeout_ms=max(10_000, 10 * config.torchft.heartbeat_timeout_ms),
                              heartbeat_timeout_ms=config.torchft.heartbeat_timeout_ms)
    try:
        # its address names this host, which may resolve to an address it does not listen on
        yield f"http://{LOCAL_HOST}:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


def gpus_per_group(config: TrainConfig) -> list[list[str]] | None:
    """The CUDA devices of each group's torchrun (each numbers its workers' LOCAL_RANK from 0), or None on
    the CPU. Several groups on one device would break NCCL, so too few devices is a usage error."""
    if config.compute.device == "cpu" or not torch.cuda.is_available():
        return None
    needed, count = config.workers * config.torchft.group_size, torch.cuda.device_count()
    if count < needed:
        raise UsageError(f"bad value workers={config.workers}: {config.workers} replica group(s) x "
                         f"{config.torchft.group_size} process(es) need {needed} CUDA devices, this machine has "
                         f"{count} (use fewer, or --device cpu)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the devices this launcher was given, if narrowed
    names = visible.split(",") if visible else [str(index) for index in range(count)]
    return [[names[group * config.torchft.group_size + rank] for rank in range(config.torchft.group_size)]
            for group in range(config.workers)]


def agent_command(config: TrainConfig, run_dir: RunDir, worker: tuple[str, ...]) -> list[str]:
    """One replica group's torchrun (``local_agent``: its stores on loopback): its own rendezvous
    (``--standalone``), ``--group-size`` workers, its own restarts; each worker started as ``worker``
    (``python WORKER RUN_DIR``: the warm client of the job's zygote, or the module cold)."""
    # --local-addr: the address the workers are told for the group's store, which listens on it only (the
    # host's name would resolve to another address on many machines: Docker, Debian's 127.0.1.1, a VM's IP)
    return [sys.executable, "-m", "mlscale.train.local_agent", "--standalone", "--nnodes=1",
            f"--local-addr={LOCAL_HOST}",
            f"--nproc-per-node={config.torchft.group_size}",
            f"--max-restarts={config.recovery.max_restarts}", "--monitor-interval=0.1",
            *worker, str(run_dir.path)]


def launch_replica_groups(config: TrainConfig, run_dir: RunDir, total_steps: int) -> None:
    """Run ``--workers`` replica groups to the end of training; the report is rank 0's (the quorum's leader)."""
    groups = config.workers
    # The zygote first, while this process may still be forked (the lighthouse runs threads of its own).
    with worker_command(run_dir.warm_starts_path) as worker, lighthouse(config) as address:
        env = {**os.environ, LIGHTHOUSE_ENV: address, LAUNCH_ENV: uuid.uuid4().hex[:12],
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "LOGLEVEL": "ERROR",
               "RUST_LOG": os.environ.get("RUST_LOG", "error"), "TORCH_CPP_LOG_LEVEL": "ERROR",
               NO_PROGRESS_ENV: "1", TOKEN_ENV: os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32),
               **private_environment(LOCAL_HOST)}
        if config.torchft.group_size > 1:
            # A fresh store per rendezvous round: a restarted group's ranks must not read the torchft
            # Manager address its previous attempt published in the agent's store.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        run_dir.agent_log(0).parent.mkdir(parents=True, exist_ok=True)
        devices = gpus_per_group(config)
        agents = []
        try:
            for group in range(groups):
                own = {REPLICA_ENV: str(group)}
                if devices is not None:
                    own["CUDA_VISIBLE_DEVICES"] = ",".join(devices[group])
                with run_dir.agent_log(group).open("ab") as out:
                    agents.append(subprocess.Popen(agent_command(config, run_dir, worker), env={**env, **own},
                                                   stdout=out, stderr=subprocess.STDOUT))
            codes = _follow(config, run_dir, agents, total_steps)
        finally:
            _stop(agents)
    failed = [group for group, code in enumerate(codes) if code != 0]
    if _completed(run_dir, total_steps):
        for group in failed:
            print(f"mlscale: replica group {group} stopped for good (its restarts spent); the others finished "
                  f"without it. Its log: {run_dir.agent_log(group)}", file=sys.stderr)
        return
    _fail(config, run_dir, failed or list(range(groups)))


def _follow(config: TrainConfig, run_dir: RunDir, agents: list[subprocess.Popen[bytes]], total: int) -> list[int]:
    """Wait for every agent, showing progress from ``metrics.jsonl`` and the quorum's changes from the
    replicas' logs. Returns the agents' exit codes."""
    watcher = _Watcher(run_dir, config.workers)
    progress = Progress(total) if config.records.progress else None
    finished_at = None
    while any(agent.poll() is None for agent in agents):
        time.sleep(_POLL_S)
        watcher.read(progress)
        if finished_at is None and _completed(run_dir, total):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > _FINISHED_GRACE_S:
            _stop(agents)  # a replacement that came too late, waiting for peers that are gone
            return [0 if agent.returncode in (0, -signal.SIGTERM) else agent.returncode for agent in agents]
    watcher.read(progress)
    if progress is not None:
        progress.close()
    return [agent.returncode for agent in agents]


class _Watcher:
    """Reads what the replicas append (metrics lines, replica logs) and says what changed."""

    def __init__(self, run_dir: RunDir, groups: int) -> None:
        self.run_dir, self.groups = run_dir, groups
        paths = [run_dir.metrics_path, *(run_dir.replica_log(group) for group in range(groups))]
        # What earlier launches of a resumed run wrote is not news.
        self.offsets: dict[Path, int] = {path: path.stat().st_size for path in paths if path.exists()}
        self.members: list[int] | None = None

    def _new_lines(self, path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        with path.open("rb") as handle:
            handle.seek(self.offsets.get(path, 0))
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offsets[path] = self.offsets.get(path, 0) + len(complete)
        lines = []
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):  # a line torn by a process killed mid-write: not news
                lines.append(json.loads(line))
        return lines

    def read(self, progress: Progress | None) -> None:
        say = progress.note if progress is not None else (lambda text: print(text, file=sys.stderr, flush=True))
        for group in range(self.groups):
            for line in self._new_lines(self.run_dir.replica_log(group)):
                if line.get("event") == "start" and line.get("attempt", 0) > 0:
                    say(f"mlscale: replica group {group} restarted (attempt {line['attempt']}); it will recover "
                        "from a live peer")
                elif line.get("event") == "received":
                    say(f"mlscale: replica group {group} received the state of step {line['step']} from a peer "
                        "and rejoined")
        for metrics in self._new_lines(self.run_dir.metrics_path):
            members = metrics.get("participants")
            if members is not None and members != self.members:
                if self.members is not None:
                    say(f"mlscale: step {metrics['step']}: the quorum is replica groups "
                        f"{', '.join(map(str, members))} ({len(members)} of {self.groups})")
                self.members = members
            if progress is not None:
                progress.update(metrics["step"], metrics["loss"], metrics["samples_per_s"])


def _stop(agents: list[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM to the agents still running (each passes it to its workers), SIGKILL after ``grace_s``."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    deadline = time.monotonic() + grace_s
    for agent in agents:
        try:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def _completed(run_dir: RunDir, total_steps: int) -> bool:
    """The last step committed and the leader's completed report written."""
    if not job_finished(run_dir, total_steps) or not run_dir.report_path.exists():
        return False
    with contextlib.suppress(ValueError):
        report = run_dir.read_report()
        return report.get("status") == "completed" and report.get("steps", 0) >= total_steps
    return False


def _fail(config: TrainConfig, run_dir: RunDir, failed: list[int]) -> None:
    lines = [f"training failed: replica group(s) {', '.join(map(str, failed))} stopped and the job did not finish."]
    lines.append(f"  restarts per group: {config.recovery.max_restarts} (--max-restarts); the fewest replica "
                 f"groups that may commit a step: {config.torchft.min_replicas} (--min-replicas).")
    for group in failed:
        where = run_dir.traceback_path(group * config.torchft.group_size)  # named by member: its rank 0's
        lines.append(f"  replica group {group}: " + (f"traceback {where}" if where.exists() else
                                                     f"log {run_dir.agent_log(group)}"))
    raise WorkerFailed("\n".join(lines), rank=failed[0] * config.torchft.group_size)  # its rank 0, counted in the job
