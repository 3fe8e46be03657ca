"""The model runner: executes a SchedulerOutput against the paged KV cache.

KVStore holds the pool's tensors: for each layer, the keys and the values of every token slot
(block b's slots are b * block_size .. (b + 1) * block_size - 1). For a step, each sequence's cached
K/V are gathered from its blocks into a batch, left-padded to the longest (the layout of batched
generation with padding, which every model takes through a 2D attention mask), the model runs on the
new tokens with their own position ids, and their K/V are written back into the sequences' slots.

The model is reached through a small adapter (CachedModel): a Hugging Face causal LM through
transformers' DynamicCache, tinylm through its cached forward. A step's decodes (one token each) run
as one batch and its prefill chunks as another, so a long chunk does not pad every decode to its length.
"""

from __future__ import annotations

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
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: list[LayerKV], attention_mask: torch.Tensor,
        last: torch.Tensor,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """The logits at each row's ``last`` new token (batch x vocab) and each layer's K/V of the new
        tokens. ``attention_mask`` (batch x (past + new), 1 where a token is real) marks the padding of both."""
        ...


class HFCausalLM:
    """A transformers PreTrainedModel with a causal-LM head, its cache given as a DynamicCache."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.model, self._new_cache = model, DynamicCache
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
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: list[LayerKV], attention_mask: torch.Tensor,
        last: torch.Tensor,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        cache = self._new_cache()
        for index, (keys, values) in enumerate(past):
            if keys.shape[2]:
                cache.update(keys, values, index)
        keep, rows = self._kept(last)
        logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=True, **{self._cache_arg: cache}, **keep).logits
        cached = past[0][0].shape[2] if past else 0
        return logits[torch.arange(len(last), device=last.device), rows], [
            (k[:, :, cached:], v[:, :, cached:]) for k, v in _cache_layers(cache)]

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
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: list[LayerKV], attention_mask: torch.Tensor,
        last: torch.Tensor,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        new = input_ids.shape[1]
        cached = attention_mask.shape[1] - new
        causal = torch.ones(new, cached + new, dtype=torch.bool, device=input_ids.device).tril(cached)
        mask = (causal & attention_mask.bool()[:, None, :]).unsqueeze(1)
        logits, kv = self.model.forward_cached(input_ids, position_ids, past, mask)
        return logits[torch.arange(len(last), device=last.device), last], kv


def cached_model(model: torch.nn.Module) -> CachedModel:
    """The adapter for ``model``: tinylm's own, else a Hugging Face causal LM's."""
    from mlscale.tasks.tinylm import TinyLM

    return TinyLMCached(model) if isinstance(model, TinyLM) else HFCausalLM(model)


class KVStore:
    """Keys and values of every slot of the pool, per layer: layers x slots x heads x head_dim each."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int) -> None:
        size = (shape.layers, num_blocks * block_size, shape.heads, shape.head_dim)
        self.keys = torch.zeros(size, dtype=shape.dtype, device=shape.device)
        self.values = torch.zeros(size, dtype=shape.dtype, device=shape.device)
        self.block_size = block_size

    def gather(self, slots: torch.Tensor) -> list[LayerKV]:
        """Each layer's K/V at ``slots`` (batch x tokens): batch x heads x tokens x head_dim."""
        return [(keys[slots].transpose(1, 2), values[slots].transpose(1, 2))
                for keys, values in zip(self.keys, self.values)]

    def scatter(self, slots: torch.Tensor, new: list[LayerKV], valid: torch.Tensor) -> None:
        """Write each layer's new K/V (batch x heads x tokens x head_dim) where ``valid`` into ``slots``."""
        where = slots[valid]
        for layer, (keys, values) in enumerate(new):
            self.keys[layer, where] = keys.transpose(1, 2)[valid]
            self.values[layer, where] = values.transpose(1, 2)[valid]


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
        batch = _Batch.of(chunks, self.store.block_size, self.device)
        logits, new = self.model.forward(batch.input_ids, batch.position_ids, self.store.gather(batch.past_slots),
                                         batch.attention_mask, batch.lengths - 1)
        self.store.scatter(batch.new_slots, new, batch.new_valid)
        return logits


@dataclass(frozen=True)
class _Batch:
    """One forward's tensors: the cached tokens left-padded to the longest, then the new ones."""

    input_ids: torch.Tensor  # batch x new
    position_ids: torch.Tensor  # batch x new
    attention_mask: torch.Tensor  # batch x (past + new)
    past_slots: torch.Tensor  # batch x past
    new_slots: torch.Tensor  # batch x new
    new_valid: torch.Tensor  # batch x new, bool
    lengths: torch.Tensor  # batch

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> _Batch:
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
        tensors = (input_ids, positions, mask, _slots(table, past_positions.clamp(min=0), block_size),
                   _slots(table, positions, block_size), new_valid, lengths)
        return cls(*(tensor.to(device) for tensor in tensors))


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool slot of each position (batch x tokens) through each row's block table."""
    return table.gather(1, positions // block_size) * block_size + positions % block_size
