"""A server of several worker processes (``mlscale serve --workers N``): one supervisor, N workers.

How requests reach a worker: the supervisor binds the HTTP port once; every worker inherits that one
socket (it listens from when the first worker has loaded its models) and accepts from it (the kernel
hands each new connection to a worker waiting in ``accept``, so an idle worker takes more of them than
a busy one). A keep-alive
connection stays with the worker that accepted it. The gRPC port is bound by every worker with
``SO_REUSEPORT`` (the kernel spreads connections over them). Each worker holds its own copy of the
models, batchers and response cache (the cache's bound divided among them), so batches form per
worker from the requests its connections carry.

What the workers share, readiness and metrics, lives in a private folder (``peers.py``). A worker's
entry point is ``worker.py``; ``launch.py`` chooses between one server and this supervisor.

A worker that dies is restarted (counted: ``mlscale_worker_restarts``); the requests it held are
lost with it, the others never reached it (they wait in the shared socket's backlog or go to the
other workers). A worker not ready ``--worker-start-timeout-s`` after its start is stopped, saying so.
SIGTERM to the supervisor is passed to every worker, each drains as one server does, and the
supervisor exits 0 once all have; a second SIGTERM (or SIGINT) kills them at once. Workers run in a
session of their own (a terminal's Ctrl-C reaches the supervisor only, which passes it on once).

Nothing outlives the supervisor, however it goes (a SIGKILL, at any moment of the start included):
its signal handlers are in place before the first worker or the folder exists; a worker's very first
act, before any import of ours, is ``PR_SET_PDEATHSIG`` (and it exits at once if the supervisor is
gone already, the race that setting alone loses); the folder is made by a janitor process that removes
it once the supervisor and every worker have closed their end of its pipe, which the kernel does for
a killed process too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlscale.errors import MlscaleError
from mlscale.registry import Registry
from mlscale.serve.options import ServeOptions, usable_cores
from mlscale.serve.peers import Peers
from mlscale.serve.server import bind, model_uris

log = logging.getLogger("mlscale.serve")
BACKLOG = 2048
GIVE_UP_AFTER = 5  # workers in a row that die before ever being ready: the supervisor stops
STOP_GRACE_S = 2.0  # a worker stopped for not starting in time: SIGKILL this long after its SIGTERM
REAP_S = 5.0  # on exit, the longest the supervisor waits for a killed worker (or the janitor) to be gone

# A worker's interpreter runs this first: the death signal is set (Linux: PR_SET_PDEATHSIG = 1, SIGKILL
# = 9) before anything is imported (mlscale.serve.worker alone takes ~0.2 s, torch seconds), then the
# parent is checked: had the supervisor died before prctl, the worker was handed to another parent and
# no death signal would ever come. ctypes, os and sys are the interpreter's own, imported in ms.
_BOOTSTRAP = """\
# mlscale serve: a worker (ps shows this line first)
import ctypes, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
from mlscale.serve.worker import worker_main
sys.exit(worker_main())
"""

# The janitor of the shared folder: makes it, says where, then waits for the end of its standard input.
# The write end is held by the supervisor and passed to every worker, so the end comes when the last of
# them is gone, however it went (the kernel closes a killed process's files); then the folder goes. A
# supervisor killed before it read the folder's name (writing it fails) started no worker: it goes then.
# Terminal and stop signals are ignored: only that end ends it. -I -S: no site, no user paths (~20 ms).
_JANITOR = """\
# mlscale serve: the janitor of the workers' shared folder
import os, shutil, signal, tempfile
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
folder = tempfile.mkdtemp(prefix="mlscale-serve-")
try:
    os.write(1, folder.encode() + b"\\n")
    while os.read(0, 65536):
        pass
except OSError:
    pass
shutil.rmtree(folder, ignore_errors=True)
"""


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit {code}"



# -- the supervisor --------------------------------------------------------------------------------
class Supervisor:
    """Starts the workers, restarts those that die, stops them all on a signal; leaves nothing behind
    (see the module's docstring)."""

    def __init__(self, uris: list[str], options: ServeOptions, registry_location: str | None,
                 sock: socket.socket) -> None:
        self.uris, self.options, self.registry_location, self.sock = uris, options, registry_location, sock
        self.count = options.worker_count
        self.janitor: subprocess.Popen[bytes] | None = None
        self.directory: Path | None = None  # the shared folder, made in run() under the signal handlers
        self.peers: Peers | None = None
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * self.count
        self.generations = [0] * self.count
        self.started_at = [0.0] * self.count  # time.monotonic() of each worker's start
        self.kill_at: list[float | None] = [None] * self.count  # stopped for its start timeout: SIGKILL then
        self.restarts = 0
        self.failed_starts = 0  # workers in a row that died before they were ready
        self.was_ready = [False] * self.count
        self.stopping: int | None = None  # the signal being passed on
        self.signals = 0  # signals received: a second one kills every worker

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        """SIGTERM and SIGINT handled from before the folder or any worker exists until after the last
        is gone: else a signal during the start kills the supervisor with its default action, and the
        workers it started live on (holding the port) with the folder."""
        previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def on_signal(self, sig: int, _: Any) -> None:
        """The first signal is passed on (each worker drains); a second kills them all: an operator's
        second Ctrl-C, or an orchestrator's, must not wait for a stuck worker."""
        self.signals += 1
        if self.stopping is None:
            self.stopping = sig
        self.signal_all(sig if self.signals == 1 else signal.SIGKILL)

    def run(self) -> int:
        """Serve until stopped (under ``signals_handled``); the exit code. Whatever happens, every worker
        is killed and the folder removed on the way out."""
        try:
            self.open_folder()
            for index in range(self.count):
                if self.stopping is None:  # a signal during the start: no more workers
                    self.spawn(index)
            return self.watch()
        finally:
            self.close()

    def open_folder(self) -> None:
        """The shared folder, made by the janitor (``_JANITOR``), which removes it once the supervisor and
        all workers are gone: also after a SIGKILL of the supervisor, when no code of ours runs."""
        self.janitor = subprocess.Popen([sys.executable, "-I", "-S", "-c", _JANITOR], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        assert self.janitor.stdout is not None
        with self.janitor.stdout:
            folder = self.janitor.stdout.readline().decode().strip()
        if not folder:
            raise MlscaleError("cannot make the workers' shared folder in the temp directory (see $TMPDIR)")
        self.directory = Path(folder)
        self.peers = Peers(self.directory, self.count)

    def spec(self, index: int) -> dict[str, Any]:
        options = self.options.model_dump(mode="json")
        options["workers"] = self.count
        return {"uris": self.uris, "options": options, "registry": self.registry_location, "index": index,
                "generation": self.generations[index], "directory": str(self.directory),
                "fd": self.sock.fileno()}

    def spawn(self, index: int) -> None:
        threads = str(self.options.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "OPENBLAS_NUM_THREADS": threads}
        assert self.janitor is not None and self.janitor.stdin is not None
        keep = self.janitor.stdin.fileno()  # held open by the worker: the janitor waits for it too
        process = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(os.getpid())], stdin=subprocess.PIPE,
                                   pass_fds=(self.sock.fileno(), keep), env=env, start_new_session=True)
        self.processes[index] = process
        self.was_ready[index], self.started_at[index], self.kill_at[index] = False, time.monotonic(), None
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: reaped as any dead worker
            process.stdin.write(json.dumps(self.spec(index)).encode())  # no secret on a command line
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
        if self.stopping is not None:  # a signal came while it was being started: it stops too
            process.send_signal(self.stopping if self.signals < 2 else signal.SIGKILL)

    def signal_all(self, sig: int) -> None:
        for process in self.processes:
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    def watch(self) -> int:
        """Every 50 ms until the server is done: readiness announced once, workers late to start stopped,
        dead ones reaped and restarted; the exit code."""
        assert self.peers is not None
        announced = False
        while True:
            time.sleep(0.05)
            if not announced and self.stopping is None and self.peers.all_ready():
                announced = True
                print(f"mlscale serve: {self.count} workers ready", file=sys.stderr, flush=True)
            now = time.monotonic()
            for index in range(self.count):
                self.was_ready[index] = self.was_ready[index] or bool(self.peers.flags[index])
                self.enforce_start_timeout(index, now)
            code = self.reap(announced)
            if code is not None:
                if self.signals > 1:
                    log.warning("a second signal: every worker killed")
                return code

    def enforce_start_timeout(self, index: int, now: float) -> None:
        """A worker not ready ``worker_start_timeout_s`` after its start gets SIGTERM, and SIGKILL
        ``STOP_GRACE_S`` later: a start hung for ever (a model load that never returns, a stopped process)
        would otherwise keep readiness 503 for ever, with nothing said."""
        process = self.processes[index]
        if process is None or self.was_ready[index] or process.poll() is not None:
            return
        kill_at, limit = self.kill_at[index], self.options.worker_start_timeout_s
        if kill_at is None and now - self.started_at[index] > limit:
            log.error("worker %d (pid %d) not ready %g s after its start (--worker-start-timeout-s): stopping it",
                      index, process.pid, limit)
            self.kill_at[index] = now + STOP_GRACE_S
            process.send_signal(signal.SIGTERM)
        elif kill_at is not None and now >= kill_at:
            process.kill()

    def reap(self, started: bool) -> int | None:
        """Restart workers that died; an exit code once the server is done (all exited after a signal,
        or a worker failed to start)."""
        assert self.peers is not None
        if self.stopping is not None:
            codes = [process.poll() for process in self.processes if process is not None]
            if all(code is not None for code in codes):
                return max((code for code in codes if code is not None and code > 0), default=0)
            return None
        for index, process in enumerate(self.processes):
            code = process.poll() if process is not None else None
            if process is None or code is None:
                continue
            self.peers.flags[index] = 0
            self.peers.retire(index)
            self.generations[index] += 1
            if not started and not self.was_ready[index]:  # a bad model, a taken port (it said why), a hang
                log.error("worker %d (pid %d) died during the start (%s): stopping the server", index,
                          process.pid, _how(code))
                self.stopping = signal.SIGTERM
                self.signal_all(signal.SIGKILL)
                return code if code > 0 else 1
            self.failed_starts = 0 if self.was_ready[index] else self.failed_starts + 1
            if self.failed_starts >= GIVE_UP_AFTER:
                log.error("%d workers in a row died before they were ready: stopping", self.failed_starts)
                self.stopping = signal.SIGTERM
                self.signal_all(signal.SIGTERM)
                return 1
            self.restart(index, process.pid, code)
        return None

    def restart(self, index: int, pid: int, code: int) -> None:
        self.restarts += 1
        log.warning("worker %d (pid %d) died (%s): restarted (%d restarts)", index, pid, _how(code), self.restarts)
        assert self.peers is not None
        self.peers.record_restarts(self.restarts)
        self.spawn(index)

    def close(self) -> None:
        """Every way out (done, an exception, a signal): workers killed and waited for, the folder
        removed, then the janitor's pipe closed (it finds the folder gone and exits)."""
        self.signal_all(signal.SIGKILL)
        for process in self.processes:
            if process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=REAP_S)
        if self.peers is not None:
            self.peers.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self.janitor is not None:
            assert self.janitor.stdin is not None
            self.janitor.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.janitor.wait(timeout=REAP_S)


def supervise(uris: list[str], options: ServeOptions, registry_location: str | None) -> int:
    """Serve with ``options.worker_count`` processes (see the module's docstring); the exit code."""
    count = options.worker_count
    cores = usable_cores()
    busy = count * options.instances * options.threads
    if busy > cores:
        log.warning("%d workers x %d instances x %d threads = %d threads for %d cores: they will share them",
                    count, options.instances, options.threads, busy, cores)
    sock = bind(options.host, options.port)
    try:
        if options.grpc_port is not None:
            bind(options.host, options.grpc_port, flag="--grpc-port").close()
        registry = Registry(registry_location, create=False)
        for uri in model_uris(uris, options):  # an unknown model is one line before any worker starts
            registry.resolve(uri)
        sock.set_inheritable(True)  # listening once the first worker has loaded the models (uvicorn listens)
        supervisor = Supervisor(uris, options, registry_location, sock)
        with supervisor.signals_handled():
            grpc_note = f", gRPC on port {options.grpc_port}" if options.grpc_port else ""
            print(f"mlscale serve: {', '.join(uris)} on http://{options.host}:{options.port} with {count} workers "
                  f"(Open Inference Protocol v2, /predict, /metrics{grpc_note})", file=sys.stderr, flush=True)
            return supervisor.run()
    finally:
        sock.close()
