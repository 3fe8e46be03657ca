"""The model runner: executes a SchedulerOutput against the paged KV cache.

KVStore holds the pool's tensors: for each layer, the keys and the values of every token slot
(block b's slots are b * block_size .. (b + 1) * block_size - 1), and one spare slot that padding
writes to. For a step, each sequence's tokens are laid out left-padded to the longest (the layout of
batched generation with padding, which every model takes through a 2D attention mask); the model runs
on the new tokens with their own position ids. A StepKV is the step's view of the pool: a layer's new
K/V are written into their sequences' slots, then the layer reads its cached and new K/V back with one
gather (no per-step copy of the whole cache into a growing cache and back).

The model is reached through a small adapter (CachedModel): a Hugging Face causal LM through a
transformers Cache whose layers read and write the pool (``pool_cache``), tinylm through its cached forward.
A step's decodes (one token each) run as one batch and its prefill chunks as another, so a long chunk
does not pad every decode to its length.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mlscale.serve.generation.scheduler import ScheduledChunk, SchedulerOutput

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: batch x heads x tokens x head_dim


@dataclass(frozen=True)
class KVShape:
    layers: int
    heads: int  # key/value heads (fewer than the query heads under grouped-query attention)
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def block_bytes(self, block_size: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.heads * self.head_dim * block_size * itemsize


class CachedModel(Protocol):
    """A causal LM run on new tokens after cached ones."""

    shape: KVShape
    vocab_size: int

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: StepKV, attention_mask: torch.Tensor,
        last: torch.Tensor,
    ) -> torch.Tensor:
        """The logits at each row's ``last`` new token (batch x vocab); each layer's K/V of the new tokens
        written through ``kv``. ``attention_mask`` (batch x (past + new), 1 where a token is real) marks the
        padding of both."""
        ...


class HFCausalLM:
    """A transformers PreTrainedModel with a causal-LM head, its cache the pool itself (``pool_cache``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        # transformers 5 renamed past_key_values to cache (the old name deprecated)
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self._keeps = "logits_to_keep" in parameters
        parameter = next(model.parameters())
        probe = torch.zeros(1, 1, dtype=torch.long, device=parameter.device)
        cache = DynamicCache()
        with torch.inference_mode():
            logits = model(input_ids=probe, attention_mask=torch.ones_like(probe), use_cache=True,
                           **{self._cache_arg: cache}).logits
        layers = _cache_layers(cache)
        _, heads, _, head_dim = layers[0][0].shape
        self.vocab_size = logits.shape[-1]
        self.shape = KVShape(len(layers), heads, head_dim, layers[0][0].dtype, parameter.device)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: StepKV, attention_mask: torch.Tensor,
        last: torch.Tensor,
    ) -> torch.Tensor:
        keep, rows = self._kept(last)
        logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=True, **{self._cache_arg: pool_cache(kv)}, **keep).logits
        return logits[torch.arange(len(last), device=last.device), rows]

    def _kept(self, last: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The LM head on the positions some row needs only (``logits_to_keep``, where the model takes
        it): the keyword, and where each row's last token is among the logits."""
        if not self._keeps:
            return {}, last
        keep = torch.unique(last)
        return {"logits_to_keep": keep}, torch.searchsorted(keep, last)


def _cache_layers(cache: Any) -> list[LayerKV]:
    """Each layer's (keys, values) of a DynamicCache, across the versions' layouts."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


class TinyLMCached:
    """mlscale's tinylm through TinyLM.forward_cached."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        parameter = next(model.parameters())
        attention = next(iter(model.layers.values())).attention
        heads = attention.wq.out_features // attention.head_dim
        self.vocab_size = model.output.out_features
        self.shape = KVShape(len(model.layers), heads, attention.head_dim, parameter.dtype, parameter.device)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv: StepKV, attention_mask: torch.Tensor,
        last: torch.Tensor,
    ) -> torch.Tensor:
        new = input_ids.shape[1]
        cached = attention_mask.shape[1] - new
        causal = torch.ones(new, cached + new, dtype=torch.bool, device=input_ids.device).tril(cached)
        mask = (causal & attention_mask.bool()[:, None, :]).unsqueeze(1)
        past = [kv.past(layer) for layer in range(self.shape.layers)]
        logits, written = self.model.forward_cached(input_ids, position_ids, past, mask)
        for layer, (keys, values) in enumerate(written):
            kv.write(layer, keys, values)
        return logits[torch.arange(len(last), device=last.device), last]


def cached_model(model: torch.nn.Module) -> CachedModel:
    """The adapter for ``model``: tinylm's own, else a Hugging Face causal LM's."""
    from mlscale.tasks.tinylm import TinyLM

    return TinyLMCached(model) if isinstance(model, TinyLM) else HFCausalLM(model)


class KVStore:
    """Keys and values of every slot of the pool, per layer: layers x slots x heads x head_dim each. The
    last slot belongs to no block: padding positions write there, and nothing reads it unmasked."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int) -> None:
        size = (shape.layers, num_blocks * block_size + 1, shape.heads, shape.head_dim)
        self.keys = torch.zeros(size, dtype=shape.dtype, device=shape.device)
        self.values = torch.zeros(size, dtype=shape.dtype, device=shape.device)
        self.block_size = block_size
        self.spare_slot = num_blocks * block_size


class StepKV:
    """One forward's view of the pool: where each row's cached tokens (left-padded) and new tokens
    live. Batch x heads x tokens x head_dim in and out, the layout transformers and tinylm use."""

    def __init__(self, store: KVStore, past_slots: torch.Tensor, new_slots: torch.Tensor) -> None:
        self.store = store
        self.batch, self.past_tokens = past_slots.shape
        self._past = past_slots.reshape(-1)
        self._new = new_slots.reshape(-1)
        self._all = torch.cat([past_slots, new_slots], dim=1).reshape(-1)

    def past(self, layer: int) -> LayerKV:
        """The layer's cached K/V of each row."""
        return self._read(layer, self._past, self.past_tokens)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The layer's K/V of the new tokens into their slots (a padding position's into the spare slot)."""
        for pool, new in ((self.store.keys[layer], keys), (self.store.values[layer], values)):
            pool.index_copy_(0, self._new, new.transpose(1, 2).reshape(-1, *pool.shape[1:]))

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> LayerKV:
        """Write the layer's new K/V, then read its cached and new ones (past + new tokens)."""
        self.write(layer, keys, values)
        return self._read(layer, self._all, self.past_tokens + keys.shape[2])

    def _read(self, layer: int, slots: torch.Tensor, tokens: int) -> LayerKV:
        keys, values = self.store.keys[layer], self.store.values[layer]
        shape = (self.batch, tokens, *keys.shape[1:])
        return (keys.index_select(0, slots).view(shape).transpose(1, 2),
                values.index_select(0, slots).view(shape).transpose(1, 2))


def pool_cache(kv: StepKV) -> Any:
    """A transformers DynamicCache whose layers read and write the pool through ``kv``: what the model's
    attention gets back from ``update`` is the layer's cached and new K/V, gathered once."""
    from transformers import DynamicCache  # transformers: an optional dependency, loaded with a model of its own

    cache = DynamicCache()
    cache.layers = [_pool_layer_class()(kv, layer) for layer in range(len(kv.store.keys))]
    return cache


@functools.cache
def _pool_layer_class() -> type:
    """PoolLayer, a transformers cache layer over a StepKV (made once: transformers loads on first use)."""
    from transformers.cache_utils import DynamicLayer

    class PoolLayer(DynamicLayer):
        def __init__(self, kv: StepKV, layer: int) -> None:
            super().__init__()
            self.kv, self.layer, self.is_initialized, self.device = kv, layer, True, kv.store.keys.device

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> LayerKV:
            self.keys, self.values = self.kv.update(self.layer, key_states, value_states)
            return self.keys, self.values

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return self.kv.past_tokens if self.keys is None else self.keys.shape[-2]

    return PoolLayer


class ModelRunner:
    """Runs the chunks of a step; returns the logits (float32) of the chunks that sample, in their order."""

    def __init__(self, model: CachedModel, store: KVStore) -> None:
        self.model, self.store = model, store
        self.device = model.shape.device

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        decodes = [chunk for chunk in output.chunks if len(chunk.token_ids) == 1]
        prefills = [chunk for chunk in output.chunks if len(chunk.token_ids) > 1]
        logits = {}
        for group in (decodes, prefills):
            if group:
                logits.update(zip((chunk.seq_id for chunk in group), self._run(group)))
        rows = [logits[chunk.seq_id] for chunk in output.chunks if chunk.sample]
        return torch.stack(rows).float() if rows else torch.empty(0)

    def _run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The last logits of each chunk of one batch."""
        batch = _Batch.of(chunks, self.store, self.device)
        kv = StepKV(self.store, batch.past_slots, batch.new_slots)
        return self.model.forward(batch.input_ids, batch.position_ids, kv, batch.attention_mask, batch.lengths - 1)


@dataclass(frozen=True)
class _Batch:
    """One forward's tensors: the cached tokens left-padded to the longest, then the new ones."""

    input_ids: torch.Tensor  # batch x new
    position_ids: torch.Tensor  # batch x new
    attention_mask: torch.Tensor  # batch x (past + new)
    past_slots: torch.Tensor  # batch x past (a padding position: any slot, masked)
    new_slots: torch.Tensor  # batch x new (a padding position: the spare slot)
    lengths: torch.Tensor  # batch

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], store: KVStore, device: torch.device) -> _Batch:
        starts = torch.tensor([chunk.start for chunk in chunks])
        lengths = torch.tensor([len(chunk.token_ids) for chunk in chunks])
        past, new = int(starts.max()), int(lengths.max())
        width = max(len(chunk.blocks) for chunk in chunks)
        table = torch.tensor([list(chunk.blocks) + [0] * (width - len(chunk.blocks)) for chunk in chunks])
        input_ids = torch.tensor([list(chunk.token_ids) + [0] * (new - len(chunk.token_ids)) for chunk in chunks])
        steps = torch.arange(new)
        new_valid = steps < lengths[:, None]
        positions = torch.where(new_valid, starts[:, None] + steps, 0)
        past_positions = torch.arange(past) - (past - starts[:, None])  # left padding: negative
        past_valid = past_positions >= 0
        mask = torch.cat([past_valid, new_valid], dim=1).long()
        new_slots = torch.where(new_valid, _slots(table, positions, store.block_size), store.spare_slot)
        tensors = (input_ids, positions, mask, _slots(table, past_positions.clamp(min=0), store.block_size),
                   new_slots, lengths)
        return cls(*(tensor.to(device) for tensor in tensors))


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool slot of each position (batch x tokens) through each row's block table."""
    return table.gather(1, positions // block_size) * block_size + positions % block_size
