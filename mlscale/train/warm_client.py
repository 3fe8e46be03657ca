"""``python -m mlscale.train.warm_client MODULE ARGS``: ``python -m MODULE ARGS``, run warm.

What the elastic agent starts for each worker when workers start warm (mlscale/train/warm.py). It
imports no torch (the whole point: a worker's interpreter start and imports cost 2-3.5 s of CPU), only
the standard library: it asks the job's zygote, a process that has imported torch and mlscale already,
to fork the worker with this process's arguments, environment, working directory and stdin/stdout/stderr,
then stands in for it. The agent sees this process as the worker: a signal it sends (SIGTERM, SIGINT)
is passed on to the worker's process group, and this process ends as the worker ended, with its exit
code or killed by the same signal, so the agent reads the same failure. Killed itself (SIGKILL), its
connection closes and the zygote kills the worker.

Where the zygote cannot be reached, the worker starts cold (``exec python -m MODULE ARGS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys

SOCKET_ENV = "MLSCALE_WARM_SOCKET"  # the zygote's unix socket, in a private (0700) directory
TOKEN_ENV = "MLSCALE_WARM_TOKEN"  # the job's random token, which a request must carry
MAX_MESSAGE = 1 << 20  # one request: arguments and environment (a few KiB)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def request(argv: list[str]) -> dict[str, object]:
    """What the zygote needs to start the worker as ``python -m MODULE ARGS`` would here."""
    return {"token": os.environ.get(TOKEN_ENV, ""), "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}


def connect(argv: list[str]) -> socket.socket:
    """Hand the request and this process's stdin, stdout and stderr to the zygote (SCM_RIGHTS)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(os.environ[SOCKET_ENV])
        socket.send_fds(sock, [json.dumps(request(argv)).encode()], [0, 1, 2])
    except BaseException:
        sock.close()
        raise
    return sock


def receive(sock: socket.socket) -> dict[str, int] | None:
    """The zygote's next message (``{"pid": N}``, then ``{"status": S}``), or None once it is gone."""
    try:
        data = sock.recv(MAX_MESSAGE)
    except OSError:
        return None
    return json.loads(data) if data else None


def forward_signals(pid: int) -> None:
    """A signal to this process goes to the worker's process group (it leads its own session, as a
    worker the agent started would): the worker decides how to end, and this process mirrors it."""
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)


def end_as(status: int) -> None:
    """Exit with the worker's exit code, or die of the signal that killed it (``status`` < 0)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if status < 0:
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL has no handler to reset)
            signal.signal(-status, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.kill(os.getpid(), -status)
        status = 128 - status  # a signal whose default is not to end the process
    os._exit(status)


def start_cold(argv: list[str], why: str) -> None:
    """No zygote to ask: become the worker the cold way."""
    print(f"mlscale: starting a worker cold ({why})", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", *argv])


def main(argv: list[str]) -> None:
    if not argv:
        print("usage: python -m mlscale.train.warm_client MODULE [ARGS...]", file=sys.stderr)
        os._exit(2)
    signal.pthread_sigmask(signal.SIG_BLOCK, set(FORWARDED))  # held until the worker's pid is known
    try:
        sock = connect(argv)
    except (KeyError, OSError) as exc:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(FORWARDED))
        start_cold(argv, f"no zygote: {type(exc).__name__}: {exc}")
        return
    started = receive(sock)
    if started is None:  # refused, or the zygote died before forking
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(FORWARDED))
        start_cold(argv, "the zygote closed the connection")
        return
    forward_signals(started["pid"])
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(FORWARDED))  # one that came meanwhile is delivered now
    ended = receive(sock)
    if ended is None:  # the zygote died under the worker: a failure, and no worker left behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(started["pid"], signal.SIGKILL)
    end_as(ended["status"] if ended is not None else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
