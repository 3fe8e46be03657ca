"""A user's own data as a user writes it: a map-style ``torch.utils.data.Dataset`` of text-like samples of
different lengths, each item ``({"input_ids": ..., "weights": ...}, label)``, padded by ``PadCollate`` with
an attention mask, and a model whose ``forward`` takes the three by name. Nothing here is mlscale's own
data form; the tests train it under every strategy and compare with one process.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from mlscale import PadCollate, Task, declare_task

VOCAB, CLASSES = 50, 4


class Sentences(Dataset):
    """``size`` samples: token ids and one weight per token, 3 to ``longest`` tokens each; the label is a
    function of the tokens (so the model can learn it). Made from ``seed`` alone."""

    def __init__(self, size: int, longest: int = 12, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, longest + 1, (size,), generator=generator)
        self.ids = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in self.lengths]
        self.weights = [torch.rand(int(n), generator=generator) for n in self.lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        ids = self.ids[index]
        return {"input_ids": ids, "weights": self.weights[index]}, int(ids.sum()) % CLASSES


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Classifier(nn.Module):
    """Token embeddings scaled by their weights, averaged over the tokens the mask keeps (so padding
    changes nothing), then blocks and a head."""

    def __init__(self, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, input_ids: torch.Tensor, weights: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.head.weight.dtype)
        tokens = self.embed(input_ids) * weights.unsqueeze(-1).to(mask.dtype) * mask
        x = tokens.sum(dim=1) / mask.sum(dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@declare_task
def sentences(samples: int = 160, layers: int = 4, length: int = 0, side: str = "right") -> Task:
    """``length`` 0: each batch padded to its longest sample; N: every batch to N (a pipeline's stages
    exchange fixed shapes)."""
    collate = PadCollate(mask="attention_mask", side=side, length=length or None)
    return Task(name="sentences", build_model=lambda: Classifier(layers=layers), train=Sentences(samples, seed=1),
                eval=Sentences(40, seed=2), collate=collate,
                tp_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"})


class Broken(Sentences):
    """``Sentences`` with one mistake a user makes (``mistake``), at sample ``at`` where it is one sample's."""

    def __init__(self, mistake: str, at: int, size: int = 160) -> None:
        super().__init__(size, seed=1)
        self.mistake, self.at = mistake, at

    def __len__(self) -> int:
        return len(self.ids) + (5 if self.mistake == "long_len" else 0)

    def __getitem__(self, index: int):
        inputs, label = super().__getitem__(index)  # long_len: IndexError past the real samples
        if self.mistake == "not_a_pair":
            return inputs
        if self.mistake == "unknown_key":
            return {**inputs, "token_type_ids": inputs["input_ids"] * 0}, label
        if index == self.at and self.mistake == "raises":
            raise ValueError(f"cannot decode record {index}")
        if index == self.at and self.mistake == "dies":
            import os

            os._exit(3)  # the worker process dies as a segfault in a decoder would end it
        return inputs, label


@declare_task
def broken(mistake: str = "raises", at: int = 37, collate: bool = True) -> Task:
    """``sentences`` whose Dataset makes ``mistake``: not_a_pair, unknown_key, long_len (``__len__`` says 5
    more than ``__getitem__`` serves), raises (``ValueError`` at sample ``at``), dies (the process reading
    sample ``at`` exits); ``collate=False``: no collate, so samples of different lengths cannot be stacked."""
    task = sentences()
    task.train = Broken(mistake, at)
    task.collate = task.collate if collate else None
    if not collate:
        task.eval = Sentences(40, seed=2)
    return task
