"""The dynamic batcher and the response cache, driven directly with small runtimes."""

import asyncio
import time

import numpy as np
import pytest

from mlscale.serve.batcher import WORTH_WAITING_FOR_S, CostModel, DynamicBatcher, LatencyGuard, Overloaded
from mlscale.serve.cache import ResponseCache, cache_key
from mlscale.serve.metrics import ServerMetrics


class Doubler:
    """Returns 2x its input; raises on any row holding -1 (a request the model cannot handle)."""

    kind = "test"

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s, self.batches = delay_s, []

    def run(self, batch: np.ndarray) -> np.ndarray:
        self.batches.append(len(batch))
        time.sleep(self.delay_s)
        if (batch == -1).any():
            raise ValueError("cannot handle -1")
        return batch * 2


def make(runtime, **overrides):
    options = dict(stats=ServerMetrics().stats_for("m", "1"), max_batch_size=8, max_delay_s=0.002, queue_limit=64,
                   slo_s=None, timeout_s=10.0)
    options.update(overrides)
    return DynamicBatcher(runtime, **options)


async def seconds_for_one_more(batcher):
    """How long one more request takes to be answered; closes the batcher."""
    start = time.perf_counter()
    await batcher.submit(rows(2))
    elapsed = time.perf_counter() - start
    await batcher.close()
    return elapsed


def rows(*values):
    return np.array([[v, v] for v in values], dtype=np.float32)


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows():
    async def scenario():
        runtime = Doubler(delay_s=0.01)
        batcher = make(runtime)
        results = await asyncio.gather(*(batcher.submit(rows(i)) for i in range(20)))
        await batcher.close()
        return runtime, results

    runtime, results = asyncio.run(scenario())
    assert [r.tolist() for r in results] == [[[2.0 * i] * 2] for i in range(20)]
    assert len(runtime.batches) < 20 and max(runtime.batches) <= 8


@pytest.mark.alone
def test_a_lone_request_on_an_idle_server_is_not_held_back_by_the_delay():
    async def scenario():
        batcher = make(Doubler(), max_delay_s=1.0)
        await batcher.submit(rows(1))  # warm
        return await seconds_for_one_more(batcher)

    assert asyncio.run(scenario()) < 0.1


def test_one_bad_request_fails_alone_and_its_batch_mates_get_answers():
    async def scenario():
        runtime = Doubler(delay_s=0.02)
        batcher = make(runtime)
        blocker = asyncio.ensure_future(batcher.submit(rows(0)))  # keeps the model busy so the rest batch up
        await asyncio.sleep(0.005)
        results = await asyncio.gather(*(batcher.submit(rows(v)) for v in (1, -1, 3)), return_exceptions=True)
        await blocker
        await batcher.close()
        return runtime, results

    runtime, results = asyncio.run(scenario())
    assert results[0].tolist() == [[2.0, 2.0]] and results[2].tolist() == [[6.0, 6.0]]
    assert isinstance(results[1], ValueError)
    assert 3 in runtime.batches  # they really were one batch before the isolation retry


@pytest.mark.alone
def test_a_full_queue_refuses_at_once():
    async def scenario():
        batcher = make(Doubler(delay_s=0.2), queue_limit=2, max_batch_size=1)
        first = asyncio.ensure_future(batcher.submit(rows(0)))
        await asyncio.sleep(0.01)  # first is running; the next two queue
        queued = [asyncio.ensure_future(batcher.submit(rows(i))) for i in (1, 2)]
        await asyncio.sleep(0)
        start = time.perf_counter()
        with pytest.raises(Overloaded, match="queue full"):
            await batcher.submit(rows(3))
        refused_in = time.perf_counter() - start
        await asyncio.gather(first, *queued)
        await batcher.close()
        return refused_in

    assert asyncio.run(scenario()) < 0.005


def test_with_an_slo_the_batch_size_adapts_to_the_measured_cost_and_late_requests_are_refused():
    async def scenario():
        runtime = Doubler(delay_s=0.004)  # ~4 ms a batch whatever its size... plus per-row cost below
        batcher = make(runtime, max_batch_size=64, slo_s=0.05)
        for n in (1, 4, 16, 32, 8, 2):
            await batcher.submit(np.ones((n, 2), dtype=np.float32))
        target = batcher.batch_target()
        refused = 0
        tasks = [asyncio.ensure_future(batcher.submit(rows(i))) for i in range(400)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        refused = sum(isinstance(r, Overloaded) for r in results)
        await batcher.close()
        return target, refused

    target, refused = asyncio.run(scenario())
    assert 1 <= target <= 64
    assert refused > 0  # 400 requests at once cannot all finish within 50 ms


class PerRow(Doubler):
    """A batch costs ``fixed_s`` plus ``per_row_s`` a row, and the per-row cost can change mid-run (a
    noisy neighbour, thermal throttling): the SLO controller must follow it."""

    def __init__(self, fixed_s: float, per_row_s: float) -> None:
        super().__init__()
        self.fixed_s, self.per_row_s = fixed_s, per_row_s

    def run(self, batch: np.ndarray) -> np.ndarray:
        time.sleep(self.fixed_s + self.per_row_s * len(batch))
        return batch * 2


@pytest.mark.alone
def test_the_slo_batch_target_shrinks_when_batches_get_dearer_and_grows_back_when_they_get_cheaper():
    async def learn(batcher, runtime, per_row_s):
        runtime.per_row_s = per_row_s
        for _ in range(25):  # the cost model forgets old batches (decay 0.98): enough to move it
            for n in (2, 8, 16):
                await batcher.submit(np.ones((n, 2), dtype=np.float32))
        return batcher.batch_target()

    async def scenario():
        runtime = PerRow(fixed_s=0.001, per_row_s=0.0002)
        batcher = make(runtime, max_batch_size=256, slo_s=0.03)
        targets = [await learn(batcher, runtime, cost) for cost in (0.0002, 0.0008, 0.0002)]
        await batcher.close()
        return targets

    cheap, dear, cheap_again = asyncio.run(scenario())
    # half the SLO (15 ms) over the per-row cost: ~70 rows at 0.2 ms, ~17 at 0.8 ms
    assert 35 <= cheap <= 100 and 8 <= dear <= 25, (cheap, dear)
    assert dear < cheap / 2 and cheap_again > 1.5 * dear


def test_cache_keys_use_the_decoded_input_and_the_model_content():
    a = np.array([[1, 0.0]], dtype=np.float32)
    b = np.array([[1.0, -0.0]], dtype=np.float32)
    assert cache_key("v1", a) == cache_key("v1", b)
    assert cache_key("v1", a) != cache_key("v2", a)
    assert cache_key("v1", a) != cache_key("v1", a.astype(np.float64))
    assert cache_key("v1", a, {"p": 1}) != cache_key("v1", a)


def test_cache_is_lru_and_bounded_in_bytes():
    cache = ResponseCache(max_bytes=3 * (400 + 32 + 64))
    for i in range(5):
        cache.put(bytes([i]) * 32, np.zeros(100, dtype=np.float32))
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes
    assert cache.get(bytes([0]) * 32) is None and cache.get(bytes([4]) * 32) is not None


def _buffer_bytes(array: np.ndarray) -> int:
    """The bytes an array keeps alive: its root buffer's, whatever slice of it the array shows."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array.nbytes


def test_with_many_concurrent_distinct_requests_the_cache_holds_no_more_than_its_bound():
    """Answers are slices of a batch's output; the cache must hold copies of the rows, not the batch."""

    class Wide(Doubler):
        def run(self, batch: np.ndarray) -> np.ndarray:
            self.batches.append(len(batch))
            time.sleep(0.002)
            return np.repeat(batch, 256, axis=1)  # 2 KiB of output per row

    async def scenario():
        runtime = Wide()
        batcher = make(runtime, max_batch_size=32, max_delay_s=0.01, queue_limit=1000)
        cache = ResponseCache(max_bytes=64 * 1024)
        requests = [rows(float(i)) for i in range(400)]
        await asyncio.gather(*(cache.get_or_compute(cache_key("v1", r), lambda r=r: batcher.submit(r))
                               for r in requests))
        await batcher.close()
        return runtime, cache

    runtime, cache = asyncio.run(scenario())
    assert max(runtime.batches) > 8  # real batches: each answer was a slice of a larger output
    held = sum(_buffer_bytes(value) + len(key) + 64 for key, value in cache._entries.items())
    assert len(cache) > 10 and held == cache.bytes <= cache.max_bytes


def test_identical_concurrent_misses_run_the_model_once():
    async def scenario():
        runtime = Doubler(delay_s=0.05)
        batcher = make(runtime)
        cache = ResponseCache(1 << 20)
        key = cache_key("v1", rows(7))
        outcomes = await asyncio.gather(*(cache.get_or_compute(key, lambda: batcher.submit(rows(7)))
                                          for _ in range(100)))
        await batcher.close()
        return runtime, outcomes

    runtime, outcomes = asyncio.run(scenario())
    assert sum(runtime.batches) == 1
    hows = [how for _, how in outcomes]
    assert hows.count("miss") == 1 and hows.count("coalesced") == 99


def test_a_cancelled_first_caller_does_not_fail_those_waiting_on_the_same_miss():
    async def scenario():
        batcher = make(Doubler(delay_s=0.1))
        cache = ResponseCache(1 << 20)
        key = cache_key("v1", rows(3))
        first = asyncio.ensure_future(cache.get_or_compute(key, lambda: batcher.submit(rows(3))))
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(cache.get_or_compute(key, lambda: batcher.submit(rows(3))))
        await asyncio.sleep(0.01)
        first.cancel()  # a gRPC client that went away
        value, how = await waiting
        await batcher.close()
        return first, value, how, cache.get(key)

    first, value, how, cached = asyncio.run(scenario())
    assert first.cancelled() and how == "coalesced"
    assert np.array_equal(value, rows(3) * 2) and np.array_equal(cached, value)


def test_failures_are_not_cached():
    async def scenario():
        batcher = make(Doubler())
        cache = ResponseCache(1 << 20)
        key = cache_key("v1", rows(-1))
        with pytest.raises(ValueError):
            await cache.get_or_compute(key, lambda: batcher.submit(rows(-1)))
        await batcher.close()
        return cache

    assert len(asyncio.run(scenario())) == 0


def test_the_latency_guard_cuts_the_in_flight_limit_when_p99_runs_over_the_slo_and_regrows_it():
    guard = LatencyGuard(slo_s=0.05, limit=100, min_limit=10, max_limit=200, period_s=0.2, min_samples=5)
    now = guard._window_start
    assert all(guard.enter() for _ in range(100)) and not guard.enter()  # the cap holds
    for _ in range(100):
        guard.leave(0.08)  # every admitted request finished past the SLO
    now += 0.25
    guard.tick(now)
    assert guard.limit == 80
    for _ in range(30):  # still over: cut again and again, never under min_limit
        for _ in range(5):
            guard.enter()
            guard.leave(0.2)
        now += 0.25
        guard.tick(now)
    assert guard.limit == 10
    for _ in range(40):  # under the SLO while the cap is reached: grow back, never past max_limit
        while guard.enter():
            pass
        for _ in range(guard.in_flight):
            guard.leave(0.01)
        now += 0.25
        guard.tick(now)
    assert guard.limit > 50
    limit = guard.limit
    for _ in range(5):  # under the SLO but the cap never reached: no reason to grow
        guard.enter()
        guard.leave(0.01)
    guard.tick(now + 0.25)
    assert guard.limit == limit and guard.in_flight == 0


@pytest.mark.alone
def test_under_concurrent_load_an_arrival_to_an_empty_queue_waits_for_batch_mates():
    async def scenario():
        runtime = Doubler(delay_s=0.002)  # a fixed cost per batch worth sharing
        batcher = make(runtime, max_delay_s=0.2)
        for _ in range(3):  # let the cost model see it
            await batcher.submit(rows(0))
        await asyncio.gather(*(batcher.submit(rows(i)) for i in range(4)))  # concurrent: one batch of 4
        first = asyncio.ensure_future(batcher.submit(rows(10)))  # finds the queue empty, right after it
        await asyncio.sleep(0.02)
        rest = [asyncio.ensure_future(batcher.submit(rows(i))) for i in (11, 12)]
        await asyncio.gather(first, *rest)
        await batcher.close()
        return runtime.batches

    batches = asyncio.run(scenario())
    assert batches[3] == 4 and batches[4:] == [3]  # held for its batch-mates, not sent alone


@pytest.mark.alone
def test_a_model_whose_batches_cost_next_to_nothing_never_holds_requests_back():
    async def scenario():
        runtime = Doubler()  # microseconds a batch: nothing to gain from waiting
        batcher = make(runtime, max_delay_s=0.2)
        for _ in range(300):  # until the cost model forgets the first batches' thread hand-offs
            await batcher.submit(rows(0))
        await asyncio.gather(*(batcher.submit(rows(i)) for i in range(4)))
        return await seconds_for_one_more(batcher)

    assert asyncio.run(scenario()) < 0.1


def test_one_preempted_batch_does_not_teach_the_cost_model_that_every_batch_is_slow():
    model = CostModel()
    for _ in range(100):
        model.observe(1, 10e-6)
    model.observe(4, 20e-3)  # the OS took the core away mid-batch
    model.observe(1, 15e-3)
    assert model.coefficients()[1] < WORTH_WAITING_FOR_S  # still not worth waiting for batch-mates


def test_a_real_change_of_cost_still_reaches_the_cost_model():
    model = CostModel()
    for _ in range(100):
        model.observe(1, 10e-6)
    for _ in range(120):  # a heavier input: every batch now takes 5 ms (forgetting alone needs ~80)
        model.observe(1, 5e-3)
    assert model.cost(1) > 4e-3


class Overlaps(Doubler):
    """A Doubler that counts how many of its calls run at the same time (a model call that releases the
    GIL, as onnxruntime's and torch's do)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s)
        import threading

        self.running, self.most, self.lock = 0, 0, threading.Lock()

    def run(self, batch: np.ndarray) -> np.ndarray:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return super().run(batch)
        finally:
            with self.lock:
                self.running -= 1


@pytest.mark.parametrize("instances", [1, 3])
def test_instances_run_that_many_batches_at_once_and_every_request_gets_its_own_rows(instances):
    async def scenario():
        runtime = Overlaps(delay_s=0.05)
        batcher = make(runtime, max_batch_size=2, instances=instances)
        results = await asyncio.gather(*(batcher.submit(rows(i)) for i in range(12)))
        started = batcher.call_started
        await batcher.close()
        return runtime, results, started

    runtime, results, started = asyncio.run(scenario())
    assert [r.tolist() for r in results] == [[[2.0 * i] * 2] for i in range(12)]
    assert runtime.most == instances and max(runtime.batches) <= 2
    assert started is None  # no call left running
