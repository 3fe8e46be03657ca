"""Users' own data as ``mlscale bench data`` measures it: map-style Datasets whose items cost what real
items cost.

A loader's overhead only shows against items that take time to make: an in-memory tensor row costs a
few microseconds, so any loader looks the same on it. ``SlowItems`` spends a fixed amount of pure-Python
work per item (``busy``, calibrated to about ``item_ms`` on this machine: the GIL-holding work a real
``__getitem__`` does decoding, augmenting or parsing), which is what DataLoader worker processes exist to
take off the training process. ``TextItems`` is text-like: each item is a sentence of 8 to 128 words
turned into token ids in Python (a dictionary lookup a word), padded per batch by
``PadCollate(mask="attention_mask")``: the variable-length case, where collating costs too.

``slow_items`` is a declared task on ``SlowItems`` (a small MLP) for the resume measurement, which has to
train: ``mlscale train --task mlscale.bench.data_sets:slow_items``.
"""

from __future__ import annotations

import random
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from mlscale import PadCollate, Task, declare_task

CLASSES = 4


def busy(loops: int) -> int:
    """Pure-Python work holding the GIL for ``loops`` iterations (no allocation, no C call to hide in)."""
    total = 0
    for i in range(loops):
        total += i * i % 7
    return total


def loops_for(item_ms: float, trials: int = 5) -> int:
    """The ``busy`` loops that take ``item_ms`` here, from the fastest of ``trials`` timings (the
    machine's uncontended speed: another process's load must not make the items cheaper)."""
    probe = 20_000
    fastest = min(_timed(probe) for _ in range(trials))
    return max(1, round(item_ms / 1e3 / (fastest / probe)))


def _timed(loops: int) -> float:
    start = time.perf_counter()
    busy(loops)
    return time.perf_counter() - start


class SlowItems(Dataset):
    """``size`` items ``(features floats, label)``, each costing ``loops`` of ``busy`` in ``__getitem__``.
    The label is a fixed linear rule of the features (so a model can learn it); all made from ``seed``."""

    def __init__(self, size: int, loops: int, features: int = 32, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, features, generator=generator)
        rule = torch.randn(features, CLASSES, generator=torch.Generator().manual_seed(12345))
        self.labels = (self.inputs @ rule).argmax(dim=1)
        self.loops = loops

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        busy(self.loops)
        return self.inputs[index], int(self.labels[index])


class TextItems(Dataset):
    """``size`` sentences of ``shortest`` to ``longest`` words from a vocabulary of ``vocab`` words, kept
    as strings and tokenized in ``__getitem__`` (split, then one dictionary lookup a word, as a simple
    word-level tokenizer does): items ``({"input_ids": ids}, label)``; batches need ``PadCollate``."""

    def __init__(self, size: int, shortest: int = 8, longest: int = 128, vocab: int = 2000, seed: int = 0) -> None:
        rng = random.Random(seed)
        words = [f"w{i}" for i in range(vocab)]
        self.token_of = {word: i + 2 for i, word in enumerate(words)}  # 0: padding, 1: unknown
        self.texts = [" ".join(rng.choices(words, k=rng.randint(shortest, longest))) for _ in range(size)]
        self.labels = [rng.randrange(CLASSES) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], int]:
        ids = [self.token_of.get(word, 1) for word in self.texts[index].split()]
        return {"input_ids": torch.tensor(ids)}, self.labels[index]


def text_collate() -> PadCollate:
    """How ``TextItems`` are batched: padded to the batch's longest sentence, with an attention mask."""
    return PadCollate(mask="attention_mask")


@declare_task
def slow_items(samples: int = 3840, features: int = 32, width: int = 64, item_ms: float = 0.2,
               loops: int = 0) -> Task:
    """A small MLP on ``SlowItems``. ``loops`` > 0: the per-item work as given (a benchmark calibrates
    once and passes it, so that every worker process reads equally costly items); 0: calibrated here
    to ``item_ms``."""
    loops = loops or loops_for(item_ms)
    return Task(name="slow_items",
                build_model=lambda: nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, CLASSES)),
                train=SlowItems(samples, loops, features, seed=1), eval=SlowItems(256, loops, features, seed=2),
                info={"item_loops": loops})


__all__ = ["SlowItems", "TextItems", "busy", "loops_for", "slow_items", "text_collate"]
