"""Text for language models: documents read from files (or object storage), tokenized once with a Hugging
Face ``tokenizers`` file, packed into fixed-length windows that keep documents apart.

*Documents:* a JSONL line's ``text`` field, a Parquet row's ``text`` column, or a whole ``.txt``/``.md`` file;
a path is a file, a folder of such files (sorted) or an fsspec URL of either (read and encoded by
``mlscale.data.tokens``, which a tokenizing process imports without torch).

*Tokens, once:* every document is encoded (``Tokenizer.encode_batch``, in the tokenizer's own threads, 1,000
documents at a time, so memory holds one chunk) and followed by the end-of-document token; the ids go to one
file of int32 (``tokens.bin``) in a folder named by what made it (the files' names, sizes and modification
times, the tokenizer file's bytes): a later run, or another rank, memory-maps it instead of tokenizing
again. Made under a temporary name and renamed, so a reader never maps half of one. With ``--data-workers N``
the pass is shared by N spawned processes (a contiguous range of the documents each, counted first without
parsing them, into part files joined in order): the same bytes, the same cache.

*Packing:* window ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len + 1)``: the model reads the first
``seq_len`` (``input_ids``) and predicts each next one (the target). A document may begin inside a window:
``position_ids`` start again at 0 after each end-of-document token, and the target that would predict a
new document's first token from the last one's end is ``-100`` (ignored by ``cross_entropy``). A model
that takes ``position_ids`` keeps documents apart with them (tinylm masks attention across documents;
Hugging Face models read packed sequences from them). Windows are a map-style Dataset: sharded, resumed
and logged by sample id like any other.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mlscale.common.io import atomic_write, atomic_write_json
from mlscale.data.tokens import (
    count_documents,
    documents,
    encode,
    encode_part,
    end_of_document,
    load_tokenizer,
    source_files,
)
from mlscale.errors import UsageError

IGNORED = -100  # the target cross_entropy ignores


def _fingerprint(files: list[str], tokenizer: str) -> str:
    import fsspec

    digest = hashlib.sha256(Path(tokenizer).read_bytes())
    for name in files:
        fs, path = fsspec.core.url_to_fs(name)
        info = fs.info(path)
        digest.update(f"{name}:{info.get('size')}:{info.get('mtime') or info.get('LastModified') or ''}".encode())
    return digest.hexdigest()[:20]


def _cache_root() -> Path:
    return Path(os.environ.get("MLSCALE_CACHE_DIR") or Path.home() / ".cache" / "mlscale") / "tokens"


def tokenize(path: str, tokenizer_path: str, text_field: str = "text",
             workers: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    """The token ids of every document of ``path`` (each followed by the end-of-document id), memory-mapped
    from the folder a first call made. ``workers`` > 0: that first pass is shared by as many spawned
    processes (``--data-workers``), each encoding a contiguous range of the documents with one thread into a
    part file of its own; the parts, joined in document order, are the same bytes as one process makes."""
    files = source_files(path)
    folder = _cache_root() / _fingerprint(files, tokenizer_path)
    tokens_path, meta_path = folder / "tokens.bin", folder / "meta.json"
    if not (tokens_path.exists() and meta_path.exists()):
        tokenizer = load_tokenizer(tokenizer_path)
        end = end_of_document(tokenizer)
        folder.mkdir(parents=True, exist_ok=True)
        counts = {"documents": 0, "tokens": 0}
        how = f"{workers} data-worker process{'es' * (workers > 1)}" if workers > 0 else "the tokenizer's threads"
        print(f"mlscale: tokenizing {len(files)} file(s) once into {folder}, in {how}", file=sys.stderr, flush=True)

        def write(temporary: Path) -> None:
            if workers > 0:
                done = _encode_in_processes(files, text_field, tokenizer_path, end, workers, temporary)
            else:
                done = encode(tokenizer, documents(files, text_field), end, temporary)
            counts.update(documents=done[0], tokens=done[1])

        atomic_write(tokens_path, write)
        atomic_write_json(meta_path, {"files": files, "tokenizer": str(tokenizer_path), "end": end,
                                      "vocab": tokenizer.get_vocab_size(), **counts})
    meta = json.loads(meta_path.read_text())
    return np.memmap(tokens_path, dtype=np.int32, mode="r"), meta


def _encode_in_processes(files: list[str], text_field: str, tokenizer_path: str, end: int, workers: int,
                         path: Path) -> tuple[int, int]:
    """``_encode`` shared by ``workers`` spawned processes (spawned: a fork of a process whose torch or
    tokenizer threads run can deadlock), a contiguous range of the documents each, joined in order."""
    counts = [count_documents(name, text_field) for name in files]
    total = sum(counts)
    shares = min(workers, max(1, total))
    bounds = [total * share // shares for share in range(shares + 1)]
    parts = [path.with_name(f"{path.name}.part{share}") for share in range(shares)]
    try:
        with ProcessPoolExecutor(shares, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(encode_part, files, counts, bounds[share], bounds[share + 1], text_field,
                                   tokenizer_path, end, str(part)) for share, part in enumerate(parts)]
            done = [future.result() for future in futures]
        with open(path, "wb") as out:
            for part in parts:
                with open(part, "rb") as piece:
                    shutil.copyfileobj(piece, out, 1 << 22)
    finally:
        for part in parts:
            part.unlink(missing_ok=True)
    return sum(d for d, _ in done), sum(t for _, t in done)


class PackedText(Dataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Windows of ``seq_len`` tokens (``indices`` of them: a split) as ``({"input_ids", "position_ids"},
    targets)`` items; documents apart by position ids and ignored targets at their seams."""

    def __init__(self, tokens: np.ndarray, seq_len: int, end: int, indices: list[int] | None = None) -> None:
        if seq_len < 2:
            raise UsageError(f"bad value seq_len={seq_len}: at least 2 tokens a window")
        windows = (len(tokens) - 1) // seq_len
        if windows < 1:
            raise UsageError(f"the text holds {len(tokens):,} tokens: fewer than one window of seq_len={seq_len}")
        self.tokens, self.seq_len, self.end = tokens, seq_len, end
        self.indices = indices if indices is not None else list(range(windows))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        start = self.indices[index] * self.seq_len
        window = torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        inputs, targets = window[:-1], window[1:].clone()
        ends = inputs == self.end
        targets[ends] = IGNORED  # a new document's first token is not predicted from the last one's end
        return {"input_ids": inputs, "position_ids": position_ids(ends)}, targets


def position_ids(ends: torch.Tensor) -> torch.Tensor:
    """Positions that start again at 0 after each end-of-document token (``ends``: where they are)."""
    length = len(ends)
    index = torch.arange(length)
    starts = torch.zeros(length, dtype=torch.int64)
    starts[1:] = torch.where(ends[:-1], index[1:], torch.zeros_like(index[1:]))
    return index - torch.cummax(starts, dim=0).values


def train_tokenizer(texts: list[str], path: str | Path, vocab_size: int = 256) -> Path:
    """A small byte-level BPE tokenizer trained on ``texts`` and saved as ``path`` (tokenizer.json), with
    ``<|endoftext|>``: for tests and demos, nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return Path(path)


__all__ = ["PackedText", "position_ids", "tokenize", "train_tokenizer"]
