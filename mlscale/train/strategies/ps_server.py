"""The parameter server's side: a shard of the parameters, and the sequence of decisions about them.

Server 0 decides (``Sequencer`` with ``leader=True``): it takes each worker's push in arrival order and
turns it into events — receive and keep/apply/drop this gradient, apply the step, release this worker
with the new parameters, end the step — which it broadcasts to the other servers before acting on
them itself. The other servers follow the same events, so all shards go through the same updates in
the same order. What each consistency model decides is in ``_on_push_bsp`` and ``_on_push_async``.
"""

from __future__ import annotations

from collections import Counter
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from mlscale.config import TrainConfig
from mlscale.data import Position
from mlscale.train.dist import DistEnv
from mlscale.train.strategies.ps_messages import Header, Reply, empty_flat, flat, unflatten_into
from mlscale.train.strategy import Learner, StepResult, StepRow
from mlscale.train.timing import StepTimes, median, now


def shard_by_size(sizes: list[int], servers: int) -> list[list[int]]:
    """Parameter indices per server: whole tensors, largest first onto the least loaded server."""
    shards: list[list[int]] = [[] for _ in range(servers)]
    load = [0] * servers
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(servers), key=lambda s: (load[s], s))
        shards[target].append(index)
        load[target] += sizes[index]
    return [sorted(shard) for shard in shards]


class ServerShard:
    """The parameters one server holds, the update rule for them, and the wire to each worker."""

    def __init__(self, params: list[torch.nn.Parameter], learner: Learner, env: DistEnv, control: Any,
                 workers: int) -> None:
        self.params, self.learner, self.env, self.control = params, learner, env, control
        self.first_worker = env.world_size - workers
        self.kept: dict[int, torch.Tensor] = {}
        self._sends: dict[int, list[dist.Work]] = {}
        self._flat: torch.Tensor | None = None  # the parameters as last sent, until the next update

    def receive(self, worker: int) -> torch.Tensor:
        buffer = empty_flat(self.params)
        dist.recv(buffer, src=self.first_worker + worker)
        return buffer

    def keep(self, worker: int) -> None:
        self.kept[worker] = self.receive(worker)

    def apply_now(self, worker: int, scale: float) -> None:
        """Apply one worker's gradient on its own (ssp, async): an optimizer step with the learning rate
        scaled by ``scale`` (so weight decay and Adam's step shrink too), no schedule step."""
        self._set_gradients(self.receive(worker))
        groups = self.learner.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] *= scale
        self.learner.optimizer.step()
        for group, rate in zip(groups, rates):
            group["lr"] = rate

    def apply_kept(self) -> None:
        """Apply the average of the kept gradients, summed in worker order (bsp: what ddp computes)."""
        total = sum(self.kept[w] for w in sorted(self.kept))
        self._set_gradients(total / len(self.kept))
        self.learner.apply()
        self.kept.clear()

    def _set_gradients(self, gradient: torch.Tensor) -> None:
        for param in self.params:
            if param.grad is None:
                param.grad = torch.empty_like(param)
        unflatten_into(gradient, [p.grad for p in self.params])
        self._flat = None

    def release(self, worker: int, reply: Reply | None) -> None:
        """Send this shard to a worker (and, from server 0, the reply that goes before it)."""
        for pending in self._sends.pop(worker, []):  # the worker took these before it pushed again
            pending.wait()
        rank, sends = self.first_worker + worker, []
        if reply is not None:
            sends.append(reply.send(rank, self.control))
        if reply is None or not reply.done:
            if self._flat is None:
                self._flat = flat(self.params)
            sends.append(dist.isend(self._flat, dst=rank))
        self._sends[worker] = sends

    def close(self) -> None:
        for sends in self._sends.values():
            for pending in sends:
                pending.wait()
        self._sends.clear()


class Event(IntEnum):
    DROP = 1  # receive a worker's gradient and discard it
    KEEP = 2  # receive it and keep it for this step's average (bsp)
    APPLY = 3  # receive it and apply it now (ssp, async)
    STEP = 4  # apply the average of the kept gradients (bsp)
    RELEASE = 5  # send a worker the parameters (b: 1 when training is over and none are sent)
    END = 6  # a global step is complete (a: its number; b: 2 x done + 1 if the LR schedule steps)


class Sequencer:
    """Runs the server side of one global step per call, leading (server 0) or following."""

    def __init__(self, config: TrainConfig, shard: ServerShard, group: Any, workers: int, total_steps: int,
                 start_step: int, batch_size: int) -> None:
        self.config, self.shard, self.group, self.workers = config, shard, group, workers
        self.total_steps, self.round, self.batch_size = total_steps, start_step, batch_size
        self.leader = shard.env.rank == 0
        self.bsp = config.ps.sync == "bsp"
        self.needed = workers - config.ps.backup_workers  # gradients a bsp step applies
        self.applied, self.dropped, self.samples_dropped, self.discarded_at_end = 0, 0, 0, 0
        self.in_round = 0  # ssp, async: gradients applied towards the current global step
        # Two views of how stale an applied gradient was. ``staleness``: how many steps its worker was
        # ahead of the slowest worker when it read the parameters (what ssp bounds); ``version_lag``:
        # how many global steps were applied between that read and this gradient's own application.
        self.staleness: Counter[int] = Counter()
        self.version_lag: Counter[int] = Counter()
        self.per_worker: Counter[int] = Counter()  # gradients applied, by worker (this attempt)
        self.step_ends: list[float] = []  # when each global step ended (server 0, this attempt)
        # Per attempt: clocks restart at 0 together after a restore, as all workers resume from one state.
        self.clock = [0] * workers
        self.next_staleness = [0] * workers
        self.waiting: set[int] = set()
        self.told_done: set[int] = set()

    # -- events ------------------------------------------------------------------------------------
    def _emit(self, event: Event, a: int = 0, b: int = 0) -> None:
        if self.group is not None:
            dist.broadcast(torch.tensor([int(event), a, b], dtype=torch.int64), src=0, group=self.group)
        self._act(event, a, b)

    def _act(self, event: Event, a: int, b: int) -> None:
        if event == Event.DROP:
            self.shard.receive(a)
        elif event == Event.KEEP:
            self.shard.keep(a)
        elif event == Event.APPLY:
            self.shard.apply_now(a, 1.0 / self.workers)
        elif event == Event.STEP:
            self.shard.apply_kept()
        elif event == Event.RELEASE:
            reply = Reply(version=self.round, done=bool(b)) if self.leader else None
            if not self.leader and b:
                return
            self.shard.release(a, reply)
        elif event == Event.END:
            self.round = a
            if b & 1:
                self.shard.learner.scheduler.step()

    def run_step(self) -> StepResult:
        return self._lead() if self.leader else self._follow()

    def _follow(self) -> StepResult:
        while True:
            message = torch.empty(3, dtype=torch.int64)
            dist.broadcast(message, src=0, group=self.group)
            event, a, b = (int(v) for v in message.tolist())
            self._act(Event(event), a, b)
            if event == Event.END:
                return StepResult(step=self.round, done=bool(b & 2))

    # -- the leader's decisions --------------------------------------------------------------------
    def _lead(self) -> StepResult:
        result = StepResult(step=self.round, done=False)
        stepped = False
        while len(self.told_done) < self.workers:
            sender, header = Header.receive_any(self.shard.control)
            worker = sender - self.shard.first_worker
            result.rows.append(_row(sender, header))
            result.positions[worker] = Position(epoch=header.epoch, offset=header.offset)
            completed = self._on_push_bsp(worker, header, result) if self.bsp else \
                self._on_push_async(worker, header, result)
            stepped = stepped or completed
            if completed and not self._finishing():
                break
        result.done = len(self.told_done) == self.workers
        result.step = self.round
        self._emit(Event.END, self.round, 2 * result.done + (stepped and not self.bsp))
        self.step_ends.append(now())
        return result

    def _finishing(self) -> bool:
        return self.round >= self.total_steps

    def _release(self, worker: int, done: bool) -> None:
        self._emit(Event.RELEASE, worker, int(done))
        if done:
            self.told_done.add(worker)

    def _drop(self, worker: int, header: Header) -> None:
        """Receive and discard a gradient that came too late for its step (backup workers)."""
        self._emit(Event.DROP, worker)
        self.dropped += 1
        self.samples_dropped += header.samples

    def _discard_after_end(self, worker: int) -> None:
        """A gradient computed while training ended elsewhere: received, discarded, the worker told."""
        self._emit(Event.DROP, worker)
        self.discarded_at_end += 1
        self._release(worker, done=True)

    def _on_push_bsp(self, worker: int, header: Header, result: StepResult) -> bool:
        """A step waits for ``needed`` gradients of that step; a gradient for an earlier step (a backup
        worker's, arriving after its step was applied without it) is dropped, and its worker goes on at
        once with the current parameters. Returns whether a step was applied."""
        if self._finishing():
            self._discard_after_end(worker)
            return False
        if header.version < self.round:
            self._drop(worker, header)
            self._release(worker, done=False)
            return False
        self._emit(Event.KEEP, worker)
        self.waiting.add(worker)
        if len(self.waiting) < self.needed:
            return False
        self._emit(Event.STEP)
        self.round += 1
        self._count_applied(sorted(self.waiting), result, staleness=0, lag=0)
        for other in sorted(self.waiting):
            self._release(other, done=self._finishing())
        self.waiting.clear()
        return True

    def _on_push_async(self, worker: int, header: Header, result: StepResult) -> bool:
        """Each gradient is applied as it arrives (with the learning rate / N). ssp then holds a worker
        back while it is more than ``staleness`` steps ahead of the slowest; async never does. Returns
        whether the gradient completed a global step (N applied)."""
        if self._finishing():
            self._discard_after_end(worker)
            return False
        self._emit(Event.APPLY, worker)
        self._count_applied([worker], result, staleness=self.next_staleness[worker],
                            lag=self.round - header.version)
        self.clock[worker] += 1
        self.waiting.add(worker)
        self.in_round += 1
        completed = self.in_round == self.workers
        if completed:
            self.round, self.in_round = self.round + 1, 0
        finished = self._finishing()
        slowest = min(self.clock)
        for other in sorted(self.waiting):
            ahead = self.clock[other] - slowest
            if finished or self.config.ps.sync == "async" or ahead <= self.config.ps.staleness:
                self.next_staleness[other] = ahead
                self._release(other, done=finished)
                self.waiting.discard(other)
        return completed

    def _count_applied(self, workers: list[int], result: StepResult, staleness: int, lag: int) -> None:
        self.applied += len(workers)
        self.staleness[staleness] += len(workers)
        self.version_lag[lag] += len(workers)
        self.per_worker.update(workers)
        result.samples += len(workers) * self.batch_size

    # -- bookkeeping for checkpoints and the report -------------------------------------------------
    def counters(self) -> dict[str, Any]:
        return {"applied": self.applied, "dropped": self.dropped, "samples_dropped": self.samples_dropped,
                "discarded_at_end": self.discarded_at_end, "staleness": _plain(self.staleness),
                "version_lag": _plain(self.version_lag)}

    def restore_counters(self, saved: dict[str, Any]) -> None:
        self.applied, self.dropped = int(saved["applied"]), int(saved["dropped"])
        self.samples_dropped = int(saved["samples_dropped"])
        self.staleness = Counter({int(k): int(v) for k, v in saved["staleness"].items()})
        self.version_lag = Counter({int(k): int(v) for k, v in saved["version_lag"].items()})

    def summary(self) -> dict[str, Any]:
        gaps = [(b - a) * 1e3 for a, b in zip(self.step_ends, self.step_ends[1:])]
        return {
            "sync": self.config.ps.sync,
            "staleness_bound": self.config.ps.staleness if self.config.ps.sync == "ssp" else None,
            "servers": self.config.ps.ps_servers,
            "backup_workers": self.config.ps.backup_workers,
            "gradients_applied": self.applied,
            "gradients_dropped": self.dropped,
            "samples_dropped": self.samples_dropped,
            "applied_by_worker": {str(self.shard.first_worker + w): n for w, n in sorted(self.per_worker.items())},
            "step_ms_p50": median(gaps),
            "discarded_at_end": self.discarded_at_end,
            "staleness": _histogram(self.staleness),
            "version_lag": _histogram(self.version_lag),
        }


def _plain(counts: Counter[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(counts.items())}


def _histogram(counts: Counter[int]) -> dict[str, Any]:
    total = sum(counts.values())
    return {"max": max(counts, default=0), "mean": sum(k * v for k, v in counts.items()) / max(total, 1),
            "histogram": _plain(counts)}


def _row(rank: int, header: Header) -> StepRow:
    return StepRow(rank=rank, loss=header.loss, times=StepTimes(
        step_ms=header.compute_ms + header.data_ms + header.comm_ms, compute_ms=header.compute_ms,
        comm_ms=header.comm_ms, comm_exposed_ms=header.comm_ms, data_wait_ms=header.data_ms))
