"""Training workers that start warm: one zygote per job forks every worker, on each start and restart.

A worker started cold is a fresh interpreter importing torch and mlscale: 2-3.5 s of CPU, paid by
every worker at the job's start and again at every restart, while the job waits. The zygote is a
process that has imported them once: the elastic agent starts each worker as a small client
(mlscale/train/warm_client.py, no torch) that asks the zygote to fork the worker with the client's
arguments, environment, working directory and stdin/stdout/stderr (passed with SCM_RIGHTS), then
stands in for it before the agent (signals passed on, the same exit code or death by signal).

The zygote is forked from the ``mlscale train`` process itself where that is safe (torch imported
there, one thread, no CUDA context), else spawned fresh (``python -m mlscale.train.warm``, importing
torch once). It listens on a unix socket in a private directory (0700) and forks only for a process
of this user that brings the job's random token, and only the modules it was made for. It ends with
the job: when the launcher closes its lifeline (a pipe), or dies, it kills what it started and exits.
A worker whose client dies (the agent's SIGKILL) is killed with it.

``MLSCALE_WARM_WORKERS=0`` starts every worker cold, as ``python -m mlscale.train RUN_DIR``.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import json
import os
import runpy
import secrets
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from mlscale.common.io import append_jsonl
from mlscale.common.safe_path import drop_implicit_cwd
from mlscale.train.warm_client import MAX_MESSAGE, SOCKET_ENV, TOKEN_ENV

WARM_ENV = "MLSCALE_WARM_WORKERS"  # "0": every worker starts cold
FORK_ENV = "MLSCALE_WARM_FORK"  # "0": never fork the launcher, spawn the zygote (a harness that forbids fork)
WORKER_MODULE = "mlscale.train"
# What a worker imports before its first step; the zygote has them imported before it forks one.
# torch._dynamo: DistributedDataParallel's constructor imports it (0.4 s of CPU a worker, paid once here).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing.errors", "torch._dynamo",
           "mlscale.config", "mlscale.tasks", "mlscale.train.worker", "mlscale.train.strategies")
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


def warm_enabled() -> bool:
    return os.environ.get(WARM_ENV, "1") != "0"


@contextlib.contextmanager
def worker_command(starts_log: Path) -> Iterator[tuple[str, ...]]:
    """The worker's command line before its ``RUN_DIR`` (after the interpreter), for the elastic agent:
    the warm client of a zygote that lives as long as this block, or ``-m mlscale.train`` cold."""
    if not warm_enabled():
        yield ("-m", WORKER_MODULE)
        return
    with zygote((WORKER_MODULE,), starts_log) as env, _environment(env):
        yield ("-m", "mlscale.train.warm_client", WORKER_MODULE)


@contextlib.contextmanager
def zygote(modules: tuple[str, ...], starts_log: Path | None = None) -> Iterator[dict[str, str]]:
    """A zygote that runs ``modules`` (as ``python -m``) for this job's clients, until the block ends.
    Yields the environment a client needs (the socket's path and the token)."""
    directory = tempfile.mkdtemp(prefix="mlscale-warm-")  # 0700: no other user reaches the socket
    path, token = os.path.join(directory, "zygote.sock"), secrets.token_hex(16)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lifeline, keep = os.pipe()
    proc: _Forked | subprocess.Popen[bytes] | None = None
    try:
        listener.bind(path)
        listener.listen(64)  # a client that comes before the zygote serves waits here
        made = "fork" if fork_is_safe() else "spawn"
        setup = _Setup(listener.fileno(), lifeline, keep, token, modules, str(starts_log or ""), made)
        proc = _fork(setup) if made == "fork" else _spawn(setup)
        listener.close()
        os.close(lifeline)
        lifeline = -1  # closed once only: its number may be another's by the end (torch's store's epoll)
        yield {SOCKET_ENV: path, TOKEN_ENV: token}
    finally:
        listener.close()
        for fd in (lifeline, keep):  # closing ``keep`` tells the zygote the job is over
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            _reap(proc)
        shutil.rmtree(directory, ignore_errors=True)


def fork_is_safe() -> bool:
    """Whether this process may become the zygote by ``os.fork()``: torch is imported here already (else
    there is nothing to gain), no Python thread but this one runs (one holding a lock at the fork leaves
    it held forever in the child), no CUDA context (not fork-safe), no harness said not to
    (``MLSCALE_WARM_FORK=0``), and no native thread either unless the workers run one intra-op thread
    (``OMP_NUM_THREADS=1``, the launcher's default): the OpenMP pool an operation here started does not
    survive a fork, and a forked child's first operation on two threads hung (torch 2.13, libgomp),
    while on one thread it never uses the pool (numpy's OpenBLAS pool is re-made by its own fork handler)."""
    if os.environ.get(FORK_ENV) == "0" or "torch" not in sys.modules or threading.active_count() != 1:
        return False
    if sys.modules["torch"].cuda.is_initialized():
        return False
    return _native_threads() == 1 or os.environ.get("OMP_NUM_THREADS") == "1"


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1  # no /proc: the Python count is all there is


@dataclass(frozen=True)
class _Setup:
    """What a zygote is made with: the listening socket, its lifeline and the launcher's end of it (which
    a forked zygote closes), the token, the modules it may run, where it records the workers it forks,
    and how it was made ("fork" of the launcher or "spawn")."""

    listener: int
    lifeline: int
    keep: int
    token: str
    modules: tuple[str, ...]
    starts_log: str
    made: str


def _fork(setup: _Setup) -> _Forked:
    for stream in (sys.stdout, sys.stderr):  # else what is buffered is written twice
        stream.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()  # the terminal's Ctrl-C is for the launcher, which stops the job
            os.close(setup.keep)
            _quiet_stdio()
            Zygote(setup).serve()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return _Forked(pid)


def _spawn(setup: _Setup) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "mlscale.train.warm", str(setup.listener), str(setup.lifeline),
               setup.starts_log, *setup.modules]
    return subprocess.Popen(command, pass_fds=(setup.listener, setup.lifeline),
                            env={**os.environ, TOKEN_ENV: setup.token}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, start_new_session=True)


class _Forked:
    """A forked zygote, waited for as a ``subprocess.Popen`` is."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self, timeout: float | None = None) -> None:
        pidfd = os.pidfd_open(self.pid)
        try:
            if not select.select([pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("zygote", timeout or 0)
        finally:
            os.close(pidfd)
        os.waitpid(self.pid, 0)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def _quiet_stdio() -> None:
    """The zygote reads and writes nothing: holding the launcher's stdout would keep a reader of it
    waiting (its stderr stays, for the zygote's own errors)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)


def _reap(proc: _Forked | subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """Wait for the zygote to leave after its lifeline closed; kill it past ``grace_s``."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block (the agent copies it to each worker)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class _Worker:
    pid: int
    pidfd: int
    conn: socket.socket | None


class Zygote:
    """The serving loop: one thread, a selector over the listening socket, the lifeline, each client's
    connection (its end: the client died) and each worker's pidfd (its end: the worker exited)."""

    def __init__(self, setup: _Setup) -> None:
        self.setup = setup
        self.listener = socket.socket(fileno=setup.listener)
        self.selector = selectors.DefaultSelector()
        self.workers: dict[int, _Worker] = {}
        self.serving = True

    def serve(self) -> None:
        for name in PRELOAD:
            importlib.import_module(name)
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.setup.lifeline, selectors.EVENT_READ, self._stop)
        while self.serving:
            for key, _ in self.selector.select():
                key.data(key)
        for worker in list(self.workers.values()):
            _kill_group(worker.pid)
            self._exited(worker)

    def _stop(self, _key: Any) -> None:
        self.serving = False

    def _accept(self, _key: Any) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(10)  # a client sends its request at once
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            request = json.loads(data) if data else {}
        except (OSError, ValueError):
            conn.close()
            return
        if not self._allowed(conn, request, fds):
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            conn.close()  # the client learns of the zygote's death from this end's closing
            self._become_worker(request, fds)
        for fd in fds:
            os.close(fd)
        self._started(pid, conn, request)

    def _allowed(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> bool:
        """This user's process, with the job's token, three descriptors, and a module this zygote runs."""
        _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        argv = request.get("argv")
        return (uid == os.getuid() and len(fds) == 3
                and hmac.compare_digest(str(request.get("token", "")), self.setup.token)
                and isinstance(argv, list) and bool(argv) and argv[0] in self.setup.modules
                and isinstance(request.get("env"), dict) and isinstance(request.get("cwd"), str))

    def _started(self, pid: int, conn: socket.socket, request: dict[str, Any]) -> None:
        worker = _Worker(pid, os.pidfd_open(pid), conn)
        self.workers[pid] = worker
        self.selector.register(worker.pidfd, selectors.EVENT_READ, lambda _key: self._exited(worker))
        self.selector.register(conn, selectors.EVENT_READ, lambda _key: self._client_gone(worker))
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"pid": pid}).encode())
        if self.setup.starts_log:
            env = request["env"]
            append_jsonl(Path(self.setup.starts_log), {
                "time": time.time(), "pid": pid, "zygote_pid": os.getpid(), "module": request["argv"][0],
                "rank": env.get("RANK"), "attempt": env.get("TORCHELASTIC_RESTART_COUNT"), "zygote": self.setup.made})

    def _client_gone(self, worker: _Worker) -> None:
        """The client ended (killed by the agent, SIGKILL): the worker goes with it."""
        self._drop_conn(worker)
        _kill_group(worker.pid)

    def _exited(self, worker: _Worker) -> None:
        _, status = os.waitpid(worker.pid, 0)
        if worker.conn is not None:
            with contextlib.suppress(OSError):
                worker.conn.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
            self._drop_conn(worker)
        self.selector.unregister(worker.pidfd)
        os.close(worker.pidfd)
        del self.workers[worker.pid]

    def _drop_conn(self, worker: _Worker) -> None:
        if worker.conn is not None:
            self.selector.unregister(worker.conn)
            worker.conn.close()
            worker.conn = None

    def _become_worker(self, request: dict[str, Any], fds: list[int]) -> NoReturn:
        """In the forked child: a process as ``python -m MODULE ARGS`` would have made it, then run it."""
        code = 1
        try:
            os.setsid()  # its own process group, as the agent gives a worker: signals reach its children
            self._close_inherited()
            _as_started_by(request, fds)
            runpy.run_module(request["argv"][0], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(code)

    def _close_inherited(self) -> None:
        self.selector.close()
        self.listener.close()
        os.close(self.setup.lifeline)
        for worker in self.workers.values():
            os.close(worker.pidfd)
            if worker.conn is not None:
                worker.conn.close()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _as_started_by(request: dict[str, Any], fds: list[int]) -> None:
    """The client's stdin/stdout/stderr, working directory, environment and arguments; signal handlers,
    torch's thread count and random generator as a fresh interpreter has them."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    sys.argv = list(request["argv"])
    sys.path.insert(0, os.getcwd())  # as ``python -m`` puts it (mlscale's entry points take it out again)
    _fresh_signals()
    _fresh_torch()


def _fresh_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if signal.getsignal(signum) not in (signal.SIG_DFL, None):
                signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what the interpreter sets at start
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_IGN)


def _fresh_torch() -> None:
    """OMP_NUM_THREADS is read when torch is imported, which the zygote did under its own environment;
    the default generator starts where a fresh process's does (the zygote may have drawn from it)."""
    import torch  # imported by the zygote (PRELOAD) after a spawned one took the cwd off its path: not above

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    torch.default_generator.set_state(torch.Generator().get_state())
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # not the zygote's draws, in every worker alike


def main(argv: list[str]) -> None:
    """``python -m mlscale.train.warm LISTEN_FD LIFELINE_FD STARTS_LOG MODULE...``: a spawned zygote."""
    drop_implicit_cwd()  # before PRELOAD: the modules a worker runs never come from the current directory
    setup = _Setup(int(argv[0]), int(argv[1]), -1, os.environ.pop(TOKEN_ENV), tuple(argv[3:]), argv[2], "spawn")
    Zygote(setup).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
