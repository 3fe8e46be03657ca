"""The worker's place in the job (rank, world, device) and the process group around it.

Read from the environment that torchrun and torch's elastic agent set (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), so the same worker runs under our launcher and under an external
``torchrun`` across hosts. A world of one creates no process group at all.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

from mlscale.errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    attempt: int = 0
    # Per-step fault tolerance runs replica groups, each its own world (rank, world_size above) that
    # torchft joins across groups step by step: this process's group and how many there are.
    replica: int = 0
    replicas: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # of its own group (a replica group under per-step fault tolerance)

    @property
    def member(self) -> int:
        """This process's number in the whole job (its rank, counted across replica groups): what faults,
        tracebacks and heartbeat files are named by."""
        return self.replica * self.world_size + self.rank


_OWN_GROUP = False  # init_distributed made the default process group (not a caller of ours)


def owns_process_group() -> bool:
    """True while the default process group that ``init_distributed`` made is up."""
    return _OWN_GROUP and dist.is_initialized()


def under_launcher() -> bool:
    """True inside a worker started by torchrun or the elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


LOCAL_HOST = "127.0.0.1"  # what a job on one machine listens on
BIND_ENV = "MLSCALE_BIND_HOST"  # the one address a worker's servers listen on (mlscale's local launchers: loopback)
_STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
               "master_listen_fd", "use_libuv")


def bind_host() -> str | None:
    """``$MLSCALE_BIND_HOST``: where this process's servers listen, and the address it gives its peers;
    None: every interface, advertised by host name (what torch and torchft do)."""
    return os.environ.get(BIND_ENV) or None


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` only (port 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def tcp_store_listening_on(host: str) -> type[dist.TCPStore]:
    """``TCPStore`` whose servers listen on ``host`` only: torch's own listen on every interface, whatever
    host name they are given, unless handed a listening socket (``master_listen_fd``)."""

    class BoundTCPStore(dist.TCPStore):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            params = {**dict(zip(_STORE_ARGS, args)), **kwargs}
            if params.get("is_master") and params.get("master_listen_fd") is None:
                sock = listening_socket(host, int(params.get("port") or 0))
                params["port"] = sock.getsockname()[1]
                params["master_listen_fd"] = sock.detach()  # the store's from now on
            super().__init__(**params)

    return BoundTCPStore


@contextlib.contextmanager
def stores_listening_on(host: str) -> Iterator[None]:
    """In this process, every ``TCPStore`` server torch's elastic agent starts (the rendezvous's, the
    workers' store) listens on ``host`` only, while the block runs."""
    original, bound = dist.TCPStore, tcp_store_listening_on(host)
    dist.TCPStore = c10d_rendezvous_backend.TCPStore = bound  # type: ignore[misc]  # read when called
    try:
        yield
    finally:
        dist.TCPStore = c10d_rendezvous_backend.TCPStore = original  # type: ignore[misc]


def loopback_interface() -> str | None:
    """The loopback network interface's name (``lo`` on Linux), if this machine has one by that name."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def private_environment(host: str) -> dict[str, str]:
    """What a local launcher gives its workers so that they listen on ``host`` (loopback) only: their own
    servers (``$MLSCALE_BIND_HOST``) and gloo's and NCCL's connections (unless the caller chose an
    interface)."""
    env = {BIND_ENV: host}
    loopback = loopback_interface()
    if loopback is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env[name] = os.environ.get(name, loopback)
    return env


def _attempt_store(attempt: int, world: int, timeout: timedelta) -> dist.Store | None:
    """The rendezvous store, with keys kept apart per restart attempt.

    Under the elastic agent, workers share the agent's TCPStore across restarts. Measured here (torch
    2.13, gloo): a restarted group then sometimes hangs in gloo's connect, a peer having read the
    address its partner published in the previous attempt. A prefix per attempt removes the stale keys.
    The restart count is each agent's own, so the prefix is used only when one agent runs every rank;
    across hosts, set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per rendezvous round, as
    mlscale's Kubernetes Job does), since a replaced host starts counting again from 0.
    Outside the agent, ``None`` lets ``init_process_group`` use ``env://`` as usual, unless
    ``$MLSCALE_BIND_HOST`` is set: rank 0's store then listens there only (env:// would listen on every
    interface).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        host, rank = bind_host(), int(os.environ.get("RANK", 0))
        if host is None or "MASTER_PORT" not in os.environ:
            return None
        store_type = tcp_store_listening_on(host) if rank == 0 else dist.TCPStore
        return store_type(os.environ.get("MASTER_ADDR", host), int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=timeout)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return store
    return dist.PrefixStore(f"mlscale/attempt_{attempt}", store)


def _agreed_attempt(attempt: int, device: torch.device) -> int:
    """The highest restart count of any rank. Each torchrun agent counts its own restarts: when one host
    (a Kubernetes pod) is replaced, its workers say 0 while their peers say 1. Whether to resume, which
    heartbeat files to write and what the report calls a restart must be the same on every rank."""
    count = torch.tensor([attempt], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


REPLICA_ENV = "REPLICA_GROUP_ID"  # torchft's name: which replica group this process belongs to
JOB_START_ENV = "MLSCALE_JOB_START"  # the launcher's start time (unix seconds), inherited by every worker


def replica_from_environ(replicas: int) -> int:
    """This process's replica group (``$REPLICA_GROUP_ID``, 0 when unset) under per-step fault tolerance."""
    raw = os.environ.get(REPLICA_ENV, "0")
    if not raw.isdigit() or int(raw) >= replicas:
        raise UsageError(f"bad value {REPLICA_ENV}={raw!r}: per-step fault tolerance with --workers {replicas} "
                         f"runs replica groups 0..{replicas - 1}; each host sets its own")
    return int(raw)


def member_from_environ(replicas: int = 1) -> int:
    """``DistEnv.member`` before the worker has joined anything (for naming its traceback): the rank, plus
    the replica group's offset under per-step fault tolerance (``replicas`` > 1)."""
    rank = int(os.environ.get("RANK", 0))
    if replicas <= 1:
        return rank
    return replica_from_environ(replicas) * int(os.environ.get("WORLD_SIZE", 1)) + rank


def init_distributed(device_preference: str = "auto", timeout_s: float = 300.0, replicas: int = 1) -> DistEnv:
    """Join the process group described by the environment (nccl on CUDA, gloo on CPU). With
    ``replicas`` > 1 (per-step fault tolerance) that group is this replica group's own."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    device = pick_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=_attempt_store(attempt, world, timeout), rank=rank,
                                world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        global _OWN_GROUP
        _OWN_GROUP = True
    if world > 1:
        attempt = _agreed_attempt(attempt, device)
    replica = replica_from_environ(replicas) if replicas > 1 else 0
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, attempt=attempt,
                   replica=replica, replicas=replicas)


def shutdown_distributed(destroy: bool = True) -> None:
    """Wait for every rank; then destroy the group, unless the process is about to exit anyway."""
    if dist.is_initialized():
        # A barrier first: destroying the group while a peer still talks to it aborts on gloo.
        dist.barrier()
        if destroy:
            dist.destroy_process_group()


def all_gather_floats(env: DistEnv, values: list[float]) -> list[list[float]]:
    """Every rank's list of floats (same length on all ranks), gathered on all ranks."""
    local = torch.tensor(values, dtype=torch.float64)
    if not env.distributed:
        return [local.tolist()]
    if env.device.type == "cuda":
        local = local.to(env.device)
    gathered = [torch.empty_like(local) for _ in range(env.world_size)]
    dist.all_gather(gathered, local)
    return [t.cpu().tolist() for t in gathered]


def broadcast_int(env: DistEnv, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if not env.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=env.device if env.device.type == "cuda" else "cpu")
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def all_gather_rows(env: DistEnv, rows: list[list[float]]) -> list[list[float]]:
    """Every rank's rows of floats, in rank order, where ranks may have different numbers of rows
    (some none); each rank's rows come back as long as its longest one (shorter ones NaN-padded)."""
    if not env.distributed:
        return rows
    device = env.device if env.device.type == "cuda" else torch.device("cpu")
    width = max((len(row) for row in rows), default=0)
    shape = torch.tensor([len(rows), width], dtype=torch.int64, device=device)
    shapes = [torch.empty_like(shape) for _ in range(env.world_size)]
    dist.all_gather(shapes, shape)
    most = max(int(s[0]) for s in shapes)
    width = max(int(s[1]) for s in shapes)
    if most == 0:
        return []
    local = torch.full((most, width), float("nan"), dtype=torch.float64, device=device)
    for i, row in enumerate(rows):
        local[i, : len(row)] = torch.tensor(row, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(env.world_size)]
    dist.all_gather(gathered, local)
    return [row[: int(s[1])] for t, s in zip(gathered, shapes) for row in t[: int(s[0])].cpu().tolist()]


def send_state(state: dict[str, Any], dst: int, group: Any) -> None:
    """Tensors (in plain containers) to rank ``dst`` over a gloo ``group``, as ``torch.save`` bytes."""
    handle = io.BytesIO()
    torch.save(state, handle)
    data = torch.frombuffer(bytearray(handle.getvalue()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=group)
    dist.send(data, dst=dst, group=group)


def receive_state(src: int, group: Any) -> dict[str, Any]:
    """What ``send_state`` sent, read with ``weights_only=True``: tensors and containers, no code."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=True)
