"""The ``tinylm`` task: a small decoder-only transformer language model over generated text.

The corpus is made on the spot from a small English-like grammar (seeded, so every run sees the same
text; nothing is downloaded) and read character by character. A sample is a window of ``seq_len + 1``
characters: the model reads the first ``seq_len`` and predicts each next one.

The model is plain PyTorch: embeddings, ``layers`` blocks (causal self-attention and an MLP, each
with a residual and a pre-norm) in an ``nn.ModuleDict`` keyed "0".."n-1", a final norm and an output
projection. Nothing in it knows about parallelism; parallelisation code works on it from outside, as
torchtitan's models do: attention infers its head count from the width of its projections (so a
tensor-parallel split of the heads needs no change), and a pipeline traces it like any other model
(``mlscale.train.stages``).
"""

from __future__ import annotations

import math
import random

import torch
from torch import nn
from torch.nn import functional as F

from mlscale.tasks.base import Task, TensorData

ALPHABET = " ,.abcdefghijklmnopqrstuvwxyz"

_WORDS = {
    "det": ["the", "a", "every", "one", "some"],
    "adj": ["small", "quick", "old", "green", "quiet", "bright", "heavy", "tired", "clever", "cold"],
    "noun": ["fox", "bird", "river", "stone", "child", "engine", "garden", "letter", "window", "cat", "ship"],
    "verb": ["sees", "finds", "follows", "carries", "watches", "builds", "moves", "hears", "keeps"],
    "prep": ["near", "under", "behind", "over", "beside", "past"],
    "adv": ["slowly", "again", "today", "quietly", "often"],
}


def _phrase(rng: random.Random) -> str:
    words = [rng.choice(_WORDS["det"])]
    if rng.random() < 0.6:
        words.append(rng.choice(_WORDS["adj"]))
    words.append(rng.choice(_WORDS["noun"]))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    parts = [_phrase(rng), rng.choice(_WORDS["verb"]), _phrase(rng)]
    if rng.random() < 0.5:
        parts += [rng.choice(_WORDS["prep"]), _phrase(rng)]
    if rng.random() < 0.3:
        parts.append(rng.choice(_WORDS["adv"]))
    text = " ".join(parts)
    if rng.random() < 0.2:
        text += ", and " + _phrase(rng) + " " + rng.choice(_WORDS["verb"]) + " " + _phrase(rng)
    return text + ". "


def make_corpus(characters: int, seed: int) -> str:
    """About ``characters`` characters of generated sentences (the same for the same seed)."""
    rng = random.Random(seed)
    parts, length = [], 0
    while length < characters:
        parts.append(_sentence(rng))
        length += len(parts[-1])
    return "".join(parts)


def encode(text: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(ALPHABET)}
    return torch.tensor([index[c] for c in text], dtype=torch.int64)


class Attention(nn.Module):
    """Causal multi-head self-attention; the number of heads follows from the projections' width."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: where a query may attend (batch x 1 x seq x seq, causal already); None: causal."""
        q, k, v = self._heads(x)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def forward_cached(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """New tokens attending to cached keys and values (batch x heads x past x head_dim) and to
        themselves, where ``mask`` (batch x 1 x new x (past + new)) allows; also their own keys and
        values, for the cache (generation: mlscale.serve.generation)."""
        q, k, v = self._heads(x)
        out = F.scaled_dot_product_attention(q, torch.cat([past[0], k], 2), torch.cat([past[1], v], 2), attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)), (k, v)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, length, _ = x.shape
        return tuple(w(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(dim), FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), mask)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward_cached(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attended, new = self.attention.forward_cached(self.attention_norm(x), past, mask)
        x = x + attended
        return x + self.feed_forward(self.ffn_norm(x)), new


class TinyLM(nn.Module):
    """Token ids (batch x seq) in, next-token logits (batch x seq x vocab) out."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's initialisation, residual projections scaled down. Also what a rank runs on its own shards
        of a model built on the meta device (each parameter drawn in place, whatever part it holds)."""
        layers = len(self.layers)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(param, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.endswith("weight"):  # a norm's scale
                nn.init.ones_(param)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` (packed text: they start again at 0 where a document starts): positions from them,
        and attention kept within each document; without them, one sequence of positions 0..n-1."""
        if position_ids is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.tok_embeddings(input_ids) + self.pos_embeddings(positions)
            for block in self.layers.values():
                x = block(x)
        else:
            x = self.tok_embeddings(input_ids) + self.pos_embeddings(position_ids)
            mask = document_mask(position_ids)
            for block in self.layers.values():
                x = block(x, mask)
        return self.output(self.norm(x))

    def forward_cached(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Generation's step: logits of new tokens (batch x new) at ``position_ids``, after each layer's
        cached keys and values ``past``; ``mask`` (batch x 1 x new x (past + new)) says what each new
        token sees. Returns the logits and each layer's keys and values of the new tokens."""
        x = self.tok_embeddings(input_ids) + self.pos_embeddings(position_ids)
        new = []
        for block, layer_past in zip(self.layers.values(), past):
            x, kv = block.forward_cached(x, layer_past, mask)
            new.append(kv)
        return self.output(self.norm(x)), new


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within documents: query i may see key j <= i of the same document (a document
    starts where its position is 0). batch x 1 x seq x seq, boolean."""
    documents = torch.cumsum((position_ids == 0).long(), dim=1)
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((documents.unsqueeze(2) == documents.unsqueeze(1)) & causal).unsqueeze(1)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def language_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    loss = next_token_loss(logits, targets).item()
    scored = targets != -100  # (packed text: a document's first token is not predicted)
    accuracy = (logits.argmax(dim=-1) == targets)[scored].double().mean().item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": accuracy}


def make_tinylm(
    samples: int = 2048,
    seq_len: int = 32,
    dim: int = 64,
    layers: int = 4,
    heads: int = 4,
    ffn_mult: int = 4,
    data_seed: int = 1234,
) -> Task:
    if min(samples, seq_len, dim, layers, heads, ffn_mult) < 1:
        raise ValueError("samples, seq_len, dim, layers, heads and ffn_mult must be >= 1")
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
    n_eval = max(1, samples // 8)
    window = seq_len + 1
    tokens = encode(make_corpus((samples + n_eval) * window, data_seed))
    windows = tokens[: (samples + n_eval) * window].view(samples + n_eval, window)
    vocab = len(ALPHABET)
    return Task(
        name="tinylm",
        build_model=lambda: TinyLM(vocab, dim, layers, heads, seq_len, ffn_mult * dim),
        train=TensorData(windows[:samples, :-1].clone(), windows[:samples, 1:].clone()),
        eval=TensorData(windows[samples:, :-1].clone(), windows[samples:, 1:].clone()),
        loss_fn=next_token_loss,
        metrics_fn=language_metrics,
        info={"vocab": vocab, "seq_len": seq_len, "dim": dim, "layers": layers, "heads": heads},
    )
