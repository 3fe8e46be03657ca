"""The scheduler: which tokens of which sequences the next step computes, decided in plain data.

Iteration-level batching (Orca): every step, the running sequences each get their next token (or
their next prefill chunk) and waiting ones join while the step's token budget and the KV pool allow;
a sequence that finishes leaves at once. Prefill and decode share a step under ``max_batch_tokens``;
with chunked prefill a long prompt takes what is left of the budget step after step, so the running
streams keep their pace. When the pool has no block for a running sequence's next token, the
sequence admitted last is preempted: its blocks freed, its tokens so far (prompt and output) queued
again at the front, to be recomputed, partly from the prefix cache when its blocks were still there.

The scheduler returns a SchedulerOutput and is told by ``complete`` that it ran, so it is tested
without a model; the runner executes the output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlscale.serve.generation.kv_cache import ROOT_KEY, BlockPool, block_key, prefix_keys


@dataclass(eq=False)
class Sequence:
    """One request's tokens (prompt, then output) and where their K/V live."""

    seq_id: int
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in ``blocks``
    keys: list[bytes] = field(default_factory=list)  # prefix keys of the full blocks computed so far

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start`` .. ``start + len(token_ids)`` of one sequence, computed this step."""

    seq_id: int
    token_ids: tuple[int, ...]
    start: int  # the position of the first: the tokens before it are in the cache
    blocks: tuple[int, ...]  # the sequence's block table, covering every token up to the chunk's end
    sample: bool  # the chunk ends at the sequence's last token: its logits choose the next one


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[int, ...]  # sequences sent back to the waiting queue this step

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


class Scheduler:
    """Running and waiting sequences over one BlockPool."""

    def __init__(self, pool: BlockPool, *, max_batch_tokens: int, max_running: int, chunked_prefill: bool) -> None:
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and max_running ({max_running}) must be >= 1")
        self.pool, self.max_batch_tokens, self.max_running = pool, max_batch_tokens, max_running
        self.chunked_prefill = chunked_prefill
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.preemptions_total = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves at once; its blocks go back to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        """The next step: the running sequences first (in the order they were admitted), then the
        waiting ones while the budget, max_running and the free blocks allow (none in a step that
        had to preempt: the pool is short). Without chunked prefill, a prompt that does not fit beside
        the running sequences' next tokens gets a step of its own (theirs wait one step), as vLLM
        schedules whole prompts."""
        if not self.chunked_prefill and (alone := self._prefill_alone()) is not None:
            return alone
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[int] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = min(seq.pending, budget)
            if self._make_room(seq, count, preempted):
                chunks.append(self._chunk(seq, count))
                budget -= count
                index += 1
        if not preempted:
            self._admit(budget, chunks)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def complete(self, output: SchedulerOutput) -> None:
        """The runner computed ``output``: its tokens are cached, and blocks they filled are keyed."""
        by_id = {seq.seq_id: seq for seq in self.running}
        for chunk in output.chunks:
            seq = by_id.get(chunk.seq_id)
            if seq is not None and seq.computed == chunk.start:
                seq.computed = chunk.start + len(chunk.token_ids)
                self._register_full_blocks(seq)

    def _prefill_alone(self) -> SchedulerOutput | None:
        """The first waiting prompt alone, when it is too long to share the step with the decodes."""
        if not self.waiting or len(self.running) >= self.max_running:
            return None
        seq = self.waiting[0]
        if seq.pending <= self.max_batch_tokens - len(self.running):
            return None
        count = self._admission(seq, self.max_batch_tokens, others=False)
        if count == 0:
            return None
        self.running.append(self.waiting.popleft())
        return SchedulerOutput((self._chunk(seq, count),), ())

    def _chunk(self, seq: Sequence, count: int) -> ScheduledChunk:
        start = seq.computed
        tokens = tuple(seq.tokens[start : start + count])
        return ScheduledChunk(seq.seq_id, tokens, start, tuple(seq.blocks), start + count == len(seq.tokens))

    def _make_room(self, seq: Sequence, count: int, preempted: list[int]) -> bool:
        """Blocks for ``count`` more tokens of a running ``seq``, preempting the sequences admitted
        last while the pool is short; False when ``seq`` itself had to go."""
        need = self.pool.blocks_for(seq.computed + count) - len(seq.blocks)
        while need > self.pool.free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        seq.blocks += self.pool.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks, seq.computed, seq.keys = [], 0, []

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        """Waiting sequences join, first come first served, while they fit."""
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            count = self._admission(seq, budget, bool(chunks))
            if count == 0:
                return
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(self._chunk(seq, count))
            budget -= count

    def _admission(self, seq: Sequence, budget: int, others: bool) -> int:
        """Take ``seq``'s cached prefix and blocks for its first chunk; the chunk's length, or 0 (and
        nothing taken) when it does not fit. Without chunked prefill a prompt is computed whole: over
        the budget only alone in its step. At least the last token is computed: its logits are needed."""
        keys = prefix_keys(seq.tokens[: len(seq.tokens) - 1], self.pool.block_size)
        hits = self.pool.match_prefix(keys)
        cached = len(hits) * self.pool.block_size
        count = len(seq.tokens) - cached
        if self.chunked_prefill:
            count = min(count, budget)
        elif count > budget and others:
            count = 0
        need = self.pool.blocks_for(cached + count) - len(hits)
        if count == 0 or need > self.pool.free_blocks:
            self.pool.unmatch(hits, len(keys))
            return 0
        seq.blocks = hits + self.pool.allocate(need)
        seq.computed, seq.keys = cached, keys[: len(hits)]
        return count

    def _register_full_blocks(self, seq: Sequence) -> None:
        size = self.pool.block_size
        while (len(seq.keys) + 1) * size <= seq.computed:
            index = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else ROOT_KEY
            key = block_key(parent, seq.tokens[index * size : (index + 1) * size])
            self.pool.register(seq.blocks[index], key)
            seq.keys.append(key)
