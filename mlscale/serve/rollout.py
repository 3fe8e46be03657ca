"""A safe rollout in one server: a canary version takes a share of a model's requests, a shadow version
answers copies of them off the response path, and a comparison of both with the version served.

Traffic split (``--canary URI=PERCENT``): a request by model name (no version in its path) goes to the
canary with the asked probability. Sticky: a request carrying a route key (the ``--route-header``, or
the first entity key of a request that names entities) goes where every request with that key goes (a
hash of the key, keyed with the server's secret, against the share: a client cannot pick keys that
land on the canary); a request without one is split evenly by a counter, so that the share is exact
(to a request) rather than right on average. The share follows the registry: the model tag
``mlscale.canary_percent`` (``mlscale models canary NAME PERCENT``), read as aliases are; a tag that
is not a finite number in [0, 100] is logged once and the last good share kept. The split is the only
way to a canary: a request naming its version is refused (``ServerState.answering``) unless the server
runs with ``--expose-rollout-versions``, and either way only the split's answers are judged
(``compare``).

Shadow (``--shadow URI[=PERCENT]``): after the served answer is computed, a copy of the request (or of
that share of them) is queued on the shadow version, whose model calls never run on the event loop;
at most ``--shadow-queue`` copies wait or run at once, past that copies are dropped and counted, so the
served path never waits for the shadow; no client gets the shadow's answer (a request naming its version
is refused as a canary's is). Each shadow answer is compared with the served one: agreement
(the same class for class scores, else equal within 1e-3 relative), mean absolute difference, latency.
A language model's greedy requests (temperature 0) are copied too, through ``copy_call``: agreement is
the same tokens in every choice, the difference the share of token positions that differ
(``generation.responses.same_tokens``); a sampled one has no answer to agree with, and is not copied.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mlscale.serve import tracing
from mlscale.serve.metrics import ModelStats
from mlscale.serve.share import SHARE_TAG, canary_share

if TYPE_CHECKING:
    from mlscale.serve.models import ModelSlot, ServedModel
    from mlscale.serve.runtime import Inputs

log = logging.getLogger("mlscale.serve")
__all__ = ["SHARE_TAG", "Shadow", "TrafficSplit", "compare", "key_bucket", "route_hash_key"]


class EvenSplit:
    """Picks ``share`` percent of calls, exactly: every call adds the share, a call that takes the sum
    past 100 is picked (10%: the 10th, 20th, ... calls)."""

    def __init__(self, share: float) -> None:
        self.share, self._sum = share, 0.0

    def pick(self) -> bool:
        self._sum += self.share
        if self._sum >= 100.0:
            self._sum -= 100.0
            return True
        return False


def route_hash_key(secret: str) -> bytes:
    """The key of the route-key hash, from the server's secret (``ServeOptions.route_secret``, of any
    length: blake2b takes keys of at most 64 bytes)."""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"mlscale-route").digest()


def key_bucket(key: bytes, hash_key: bytes) -> float:
    """A route key's place in [0, 100): the same key, the same place, in every worker of a server (they
    share its secret). Keyed: with a public hash a client could pick, offline, keys that all land
    below the share and send every request it likes to the canary."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, key=hash_key).digest(), "big") % 10_000 / 100


class TrafficSplit:
    """The requests by name of one model, split between its primary slot and a canary slot."""

    def __init__(self, primary: ModelSlot, canary: ModelSlot, share: float, hash_key: bytes) -> None:
        self.primary, self.canary, self.hash_key = primary, canary, hash_key
        self.even = EvenSplit(share)
        self.bad_tag: str | None = None  # the last bad tag text logged, so a bad tag is logged once
        self.set_share(share)

    @property
    def name(self) -> str:
        return self.primary.name

    @property
    def share(self) -> float:
        return self.even.share

    def set_share(self, share: float) -> None:
        if share != self.even.share:
            log.warning("canary %s now takes %g%% of %s's requests", self.canary.uri, share, self.name)
        self.even.share = share
        self._show_shares()

    def _show_shares(self) -> None:
        for slot, share in ((self.primary, 100.0 - self.share), (self.canary, self.share)):
            if slot.current is not None:
                slot.current.stats.share.set(share)

    def pick(self, key: bytes | None) -> ServedModel | None:
        """The version this request goes to (None: none is loaded yet)."""
        to_canary = self.even.pick() if key is None else key_bucket(key, self.hash_key) < self.share
        slot = self.canary if to_canary and self.canary.current is not None else self.primary
        served = slot.current
        if served is not None:
            served.stats.routed.inc()
        return served

    def follow_tag(self, text: str) -> None:
        """The share a tag's text asks for, if it is a finite number in [0, 100]; else the share stays
        and the bad text is logged, once (a poll every few seconds must not flood the log)."""
        try:
            share = canary_share(text)
        except ValueError as exc:
            if text != self.bad_tag:
                self.bad_tag = text
                log.warning("canary share of %s not changed, still %g%%: %s", self.name, self.share, exc)
            return
        self.bad_tag = None
        self.set_share(share)

    async def follow(self, interval_s: float) -> None:
        """The share, from the model's tag in the registry, checked as often as aliases are."""
        registry = self.primary.registry
        while True:
            self._show_shares()  # a version swapped in since shows its share too
            try:
                tags = await asyncio.to_thread(registry.model_tags, self.name)
            except Exception as exc:  # a registry hiccup: keep the split as it is
                log.warning("canary share of %s not read, still %g%%: %s", self.name, self.share, exc)
            else:
                if SHARE_TAG in tags:
                    self.follow_tag(tags[SHARE_TAG])
            await asyncio.sleep(interval_s)


def agreement(served: np.ndarray, shadow: np.ndarray) -> tuple[bool, float]:
    """(the answers agree, their mean absolute difference). Class scores (a last axis of several
    floats) agree when every row's best class is the same; other outputs when equal within 1e-3
    relative (1e-6 absolute)."""
    if served.shape != shadow.shape:
        return False, float("nan")
    a, b = served.astype(np.float64), shadow.astype(np.float64)
    difference = float(np.abs(a - b).mean()) if a.size else 0.0
    if a.ndim >= 2 and a.shape[-1] > 1 and np.issubdtype(served.dtype, np.floating):
        return bool((a.argmax(-1) == b.argmax(-1)).all()), difference
    return bool(np.allclose(b, a, rtol=1e-3, atol=1e-6)), difference


class Shadow:
    """Copies of one model's served requests, answered by the shadow slot's version and compared."""

    def __init__(self, slot: ModelSlot, share: float, queue_limit: int) -> None:
        self.slot, self.split, self.queue_limit = slot, EvenSplit(share), queue_limit
        self.in_flight = 0
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        return self.slot.name

    def copy(self, served: ServedModel, array: Inputs, output: np.ndarray, served_seconds: float) -> None:
        """Queue a copy of an inference request the primary version ``served`` answered with ``output``
        in ``served_seconds`` (see ``copy_call``)."""
        self.copy_call(served, lambda shadow: shadow.batcher.submit(array), lambda answer: agreement(output, answer),
                       served_seconds)

    def copy_call(self, served: ServedModel, call: Callable[[ServedModel], Awaitable[Any]],
                  judge: Callable[[Any], tuple[bool, float]], served_seconds: float) -> None:
        """Queue a copy of a request the primary version ``served`` answered in ``served_seconds`` (a
        canary's answers are not compared: the shadow is measured against the version served), unless it
        is not in the share, or the shadow holds ``queue_limit`` copies already (then dropped).
        ``call(shadow version)`` answers the copy; ``judge(its answer)``: (it agrees with the served
        answer, their mean absolute difference)."""
        shadow = self.slot.current
        if shadow is None or served.role != "primary" or not self.split.pick():
            return
        stats = shadow.stats
        stats.shadow_sent.inc()
        if self.in_flight >= self.queue_limit:
            stats.shadow_skipped.inc()
            return
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._answer(shadow, call, judge, served_seconds))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, shadow: ServedModel, call: Callable[[ServedModel], Awaitable[Any]],
                      judge: Callable[[Any], tuple[bool, float]], served_seconds: float) -> None:
        tracing.current.set(None)  # this task's own context: the copy is not part of the client's trace
        stats: ModelStats = shadow.stats
        start = time.perf_counter()
        try:
            answer = await call(shadow)
        except Exception:  # overloaded, replaced, a model error: counted, never the client's problem
            stats.shadow_failed.inc()
            return
        finally:
            self.in_flight -= 1
        stats.shadow_latency.observe(time.perf_counter() - start)
        stats.shadow_primary_latency.observe(served_seconds)
        agreed, difference = judge(answer)
        stats.shadow_compared.inc()
        stats.shadow_agreed.inc(1.0 if agreed else 0.0)
        stats.shadow_abs_diff.inc(difference if difference == difference else 0.0)


# -- the comparison ------------------------------------------------------------------------------
def quantile(stats_histogram: Any, q: float) -> float | None:
    """The upper bound of the bucket holding the ``q`` quantile (None: no observation; inf: past the
    last bucket): what a histogram can say, no finer."""
    total = stats_histogram.count
    if total == 0:
        return None
    cumulative = 0
    for bound, count in zip((*stats_histogram.bounds, float("inf")), stats_histogram.counts):
        cumulative += count
        if cumulative >= q * total:
            return bound
    return float("inf")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def outcome(stats: ModelStats, routed_only: bool) -> dict[str, Any]:
    """A version's answers, failures (the server's: 5xx), client errors (4xx, never held against a
    version) and latency: of the requests the traffic split routed to it when ``routed_only`` (requests
    that name a version are not the split's sample, and a client's typos are not the version's fault),
    else of every request."""
    if routed_only:
        answered, failed = stats.routed_success.value, stats.routed_failed.value
        client, duration = stats.routed_client_errors.value, stats.routed_duration
    else:
        answered, failed = stats.success.value, sum(counter.value for counter in stats.failures.values())
        client, duration = sum(c.value for c in stats.client_errors.values()), stats.duration
    return {"success": int(answered), "failed": int(failed), "client_errors": int(client),
            "error_rate": failed / (answered + failed) if answered + failed else None,
            "p50_ms": _ms(quantile(duration, 0.5)), "p99_ms": _ms(quantile(duration, 0.99)),
            "mean_ms": duration.sum / duration.count * 1e3 if duration.count else None}


def _shadow_row(stats: ModelStats) -> dict[str, Any]:
    compared = stats.shadow_compared.value
    return {"sent": int(stats.shadow_sent.value), "skipped": int(stats.shadow_skipped.value),
            "failed": int(stats.shadow_failed.value), "compared": int(compared),
            "agreement": stats.shadow_agreed.value / compared if compared else None,
            "mean_abs_diff": stats.shadow_abs_diff.value / compared if compared else None,
            "p99_ms": _ms(quantile(stats.shadow_latency, 0.99)),
            "served_p99_ms": _ms(quantile(stats.shadow_primary_latency, 0.99))}


def compare(state: Any, name: str) -> dict[str, Any]:
    """What ``GET /v2/models/NAME/compare`` answers: every version of NAME the server holds, its role,
    traffic and outcome, and the shadow's comparison, for the whole server. With a canary, outcomes
    are those of the requests the split routed (``judged``: routed), so that champion and challenger
    are judged on one sample."""
    view = state.metrics.view().models
    routed_only = name in state.splits
    rows = []
    for slot in state.slots:
        served = slot.current
        if served is None or served.name != name:
            continue
        stats = view.get((served.name, str(served.number)), served.stats)
        row = {"version": str(served.number), "uri": slot.uri, "role": slot.role,
               "aliases": list(served.version.aliases), "share_percent": stats.share.value,
               "routed": int(stats.routed.value), "judged": "routed" if routed_only else "all",
               **outcome(stats, routed_only)}
        if slot.role == "shadow":
            row["shadow"] = _shadow_row(stats)
        rows.append(row)
    if not rows:
        state.lookup(name)  # the 404
    return {"model": name, "versions": rows}
