"""The scheduler and the block pool alone, in plain data (no model): the token budget, chunked prefill,
admission by free blocks, preemption, and the prefix cache's sharing and least-recently-used reuse."""

from __future__ import annotations

from mlscale.serve.generation.kv_cache import BlockPool, prefix_keys
from mlscale.serve.generation.scheduler import Scheduler, SchedulerOutput, Sequence


def _scheduler(blocks: int, budget: int = 16, chunked: bool = True, prefix: bool = True) -> Scheduler:
    return Scheduler(BlockPool(blocks, 4, prefix), max_batch_tokens=budget, max_running=8, chunked_prefill=chunked)


def _step(scheduler: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """One step as the engine runs it: scheduled, computed, and a token appended where one is sampled."""
    output = scheduler.schedule()
    scheduler.complete(output)
    by_id = {seq.seq_id: seq for seq in scheduler.running}
    for chunk in output.chunks:
        if chunk.sample:
            by_id[chunk.seq_id].tokens.append(next_token)
    return output


def test_prefill_and_decode_share_the_budget_and_long_prompts_go_in_chunks():
    scheduler = _scheduler(blocks=32, budget=16)
    scheduler.add(Sequence(0, list(range(10, 15))))
    assert [len(chunk.token_ids) for chunk in _step(scheduler).chunks] == [5]
    scheduler.add(Sequence(1, list(range(40))))
    second = _step(scheduler)
    assert [(chunk.seq_id, len(chunk.token_ids), chunk.sample) for chunk in second.chunks] == [
        (0, 1, True), (1, 15, False)]
    third = _step(scheduler)
    assert [(chunk.seq_id, chunk.start, len(chunk.token_ids)) for chunk in third.chunks] == [(0, 6, 1), (1, 15, 15)]
    assert third.num_tokens == 16

    whole = _scheduler(blocks=32, budget=16, chunked=False)
    whole.add(Sequence(0, list(range(100, 105))))
    whole.add(Sequence(1, list(range(40))))
    assert [len(chunk.token_ids) for chunk in _step(whole).chunks] == [5]  # the long one does not fit beside it
    assert [len(chunk.token_ids) for chunk in _step(whole).chunks] == [40]  # a step of its own: 0 waits a step
    assert [len(chunk.token_ids) for chunk in _step(whole).chunks] == [1, 1]


def test_when_blocks_run_out_the_sequence_admitted_last_is_preempted_and_recomputed():
    scheduler = _scheduler(blocks=4, budget=64)
    first, second = Sequence(0, list(range(8))), Sequence(1, list(range(20, 27)))
    scheduler.add(first)
    scheduler.add(second)
    _step(scheduler)  # 2 blocks each: the pool is full
    assert scheduler.pool.free_blocks == 0
    output = _step(scheduler)  # first's 9th token needs a third block: second goes
    assert output.preempted == (1,) and [chunk.seq_id for chunk in output.chunks] == [0]
    assert scheduler.preemptions_total == 1 and second.blocks == [] and scheduler.waiting[0] is second
    scheduler.remove(first)
    again = _step(scheduler)  # back with its prompt and the token it had generated, all recomputed
    assert [(chunk.seq_id, chunk.start, chunk.token_ids) for chunk in again.chunks] == [(1, 4, (24, 25, 26, 7))]


def test_a_cached_prefix_is_shared_not_recomputed_and_free_blocks_are_reused_oldest_first():
    scheduler = _scheduler(blocks=6, budget=64)
    prompt = list(range(30, 41))  # 2 full blocks and 3 tokens
    owner = Sequence(0, list(prompt))
    scheduler.add(owner)
    _step(scheduler)
    reader = Sequence(1, [*prompt[:9], 99])
    scheduler.add(reader)
    chunk = _step(scheduler).chunks[-1]
    assert (chunk.seq_id, chunk.start, chunk.token_ids) == (1, 8, (38, 99))
    assert reader.blocks[:2] == owner.blocks[:2] and scheduler.pool.hits_total == 2
    owner_blocks = list(owner.blocks)
    scheduler.remove(reader)
    scheduler.remove(owner)
    assert scheduler.pool.used_blocks == 0 and scheduler.pool.cached_blocks == 3  # the owner's full blocks

    exact = Sequence(2, prompt[:8])  # all in cached blocks: the last block is computed again, its logits needed
    scheduler.add(exact)
    assert _step(scheduler).chunks[0].start == 4
    scheduler.remove(exact)
    filler = Sequence(3, list(range(60, 80)))  # 5 blocks: the 3 keyless, then the 2 least recently used
    scheduler.add(filler)
    _step(scheduler)
    assert scheduler.pool.match_prefix(prefix_keys(prompt, 4)) == owner_blocks[:1]  # the head, used last, stays

    off = _scheduler(blocks=6, prefix=False)
    off.add(Sequence(0, list(prompt)))
    _step(off)
    off.add(Sequence(1, list(prompt)))
    assert _step(off).chunks[-1].start == 0 and off.pool.hits_total == 0
