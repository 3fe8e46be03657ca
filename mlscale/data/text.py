"""Text for language models: documents read from files (or object storage), tokenized once with a Hugging
Face ``tokenizers`` file, packed into fixed-length windows that keep documents apart.

*Documents:* a JSONL line's ``text`` field, a Parquet row's ``text`` column, or a whole ``.txt``/``.md`` file;
a path is a file, a folder of such files (sorted) or an fsspec URL of either.

*Tokens, once:* every document is encoded (``Tokenizer.encode_batch``, in the tokenizer's own threads, 1,000
documents at a time, so memory holds one chunk) and followed by the end-of-document token; the ids go to one
file of int32 (``tokens.bin``) in a folder named by what made it (the files' names, sizes and modification
times, the tokenizer file's bytes): a later run, or another rank, memory-maps it instead of tokenizing
again. Made under a temporary name and renamed, so a reader never maps half of one.

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
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mlscale.data.storage import is_remote
from mlscale.errors import UsageError
from mlscale.io import atomic_write, atomic_write_json

TEXT_SUFFIXES = (".jsonl", ".parquet", ".txt", ".md")
IGNORED = -100  # the target cross_entropy ignores
CHUNK = 1000  # documents encoded at a time


def source_files(path: str) -> list[str]:
    """The files of ``path`` (a file, or a folder's text files sorted), local or fsspec URLs."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    try:
        if fs.isdir(root):
            found = sorted(p for p in fs.find(root) if p.lower().endswith(TEXT_SUFFIXES))
        elif fs.exists(root):
            found = [root]
        else:
            found = []
    except (OSError, PermissionError) as exc:
        raise UsageError(f"bad value path={path!r}: cannot read it ({type(exc).__name__}: {exc})") from None
    if not found:
        raise UsageError(f"bad value path={path!r}: no {', '.join(TEXT_SUFFIXES)} files there")
    protocol = path.split("://")[0] + "://" if is_remote(path) else ""
    return [protocol + p if protocol and not p.startswith(protocol) else p for p in found]


def documents(files: list[str], text_field: str = "text") -> Iterator[str]:
    """Each document of ``files`` in order."""
    import fsspec

    for name in files:
        lower = name.lower()
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            with fsspec.open(name, "rb") as handle:
                table = pq.read_table(handle, columns=[text_field])
            yield from (str(value) for value in table.column(text_field).to_pylist() if value is not None)
        elif lower.endswith(".jsonl"):
            with fsspec.open(name, "rt", encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        yield _field(json.loads(line), text_field, name, number)
        else:
            with fsspec.open(name, "rt", encoding="utf-8") as handle:
                yield handle.read()


def _field(record: Any, field: str, name: str, number: int) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise UsageError(f"{name}:{number}: expected a JSON object with a text field {field!r}")
    return record[field]


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


def load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the tokenizers library's errors are plain exceptions with a message
        raise UsageError(f"bad value tokenizer={path!r}: not a tokenizers JSON file ({exc})") from None


def end_of_document(tokenizer: Any) -> int:
    """The id that ends a document: the tokenizer's own end token when it has one (``</s>``, ``<|endoftext|>``,
    ``[SEP]``, ``<eos>``), else refused."""
    for name in ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "[SEP]"):
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    raise UsageError("the tokenizer has no end-of-document token (<|endoftext|>, </s>, <eos>, [EOS] or [SEP]); "
                     "add one to its special tokens")


def tokenize(path: str, tokenizer_path: str, text_field: str = "text") -> tuple[np.ndarray, dict[str, Any]]:
    """The token ids of every document of ``path`` (each followed by the end-of-document id), memory-mapped
    from the folder a first call made."""
    files = source_files(path)
    folder = _cache_root() / _fingerprint(files, tokenizer_path)
    tokens_path, meta_path = folder / "tokens.bin", folder / "meta.json"
    if not (tokens_path.exists() and meta_path.exists()):
        tokenizer = load_tokenizer(tokenizer_path)
        end = end_of_document(tokenizer)
        folder.mkdir(parents=True, exist_ok=True)
        counts = {"documents": 0, "tokens": 0}

        def write(temporary: Path) -> None:
            with open(temporary, "wb") as out:
                batch: list[str] = []
                for document in [*documents(files, text_field), None]:
                    if document is not None:
                        batch.append(document)
                    if batch and (document is None or len(batch) == CHUNK):
                        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                            ids = np.asarray([*encoding.ids, end], dtype=np.int32)
                            out.write(ids.tobytes())
                            counts["tokens"] += len(ids)
                        counts["documents"] += len(batch)
                        batch = []

        atomic_write(tokens_path, write)
        atomic_write_json(meta_path, {"files": files, "tokenizer": str(tokenizer_path), "end": end,
                                      "vocab": tokenizer.get_vocab_size(), **counts})
    meta = json.loads(meta_path.read_text())
    return np.memmap(tokens_path, dtype=np.int32, mode="r"), meta


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


__all__ = ["PackedText", "documents", "end_of_document", "position_ids", "source_files", "tokenize",
           "train_tokenizer"]
