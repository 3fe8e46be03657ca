"""Documents read from text files and encoded into token ids: the part of ``mlscale.data.text``'s one-time
tokenizing pass that a tokenizing process runs. It imports no torch, so a spawned process starts in about a
second (``--data-workers N`` for ``--task text``: ``text.tokenize`` shares the pass among N of them).

*Documents:* a JSONL line's ``text`` field, a Parquet row's ``text`` column, or a whole ``.txt``/``.md`` file;
a path is a file, a folder of such files (sorted) or an fsspec URL of either. ``count_documents`` counts a
file's documents without parsing them, and ``document_range`` reads a range of them without opening the
files before it, so that N processes can each take a contiguous range.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mlscale.data.storage import is_remote
from mlscale.errors import UsageError

TEXT_SUFFIXES = (".jsonl", ".parquet", ".txt", ".md")
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
    for name in files:
        yield from _file_documents(name, text_field)


def _file_documents(name: str, text_field: str, skip: int = 0) -> Iterator[str]:
    """The documents of one file after its first ``skip`` (a JSONL line skipped is not parsed)."""
    import fsspec

    lower = name.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fsspec.open(name, "rb") as handle:
            table = pq.read_table(handle, columns=[text_field])
        texts = [str(value) for value in table.column(text_field).to_pylist() if value is not None]
        yield from texts[skip:]
    elif lower.endswith(".jsonl"):
        with fsspec.open(name, "rt", encoding="utf-8") as handle:
            seen = 0
            for number, line in enumerate(handle, 1):
                if line.strip():
                    seen += 1
                    if seen > skip:
                        yield _field(json.loads(line), text_field, name, number)
    elif not skip:
        with fsspec.open(name, "rt", encoding="utf-8") as handle:
            yield handle.read()


def count_documents(name: str, text_field: str = "text") -> int:
    """How many documents one file holds, without parsing them (a JSONL file's non-blank lines, a Parquet
    column's values that are not null, a text file one)."""
    import fsspec

    lower = name.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fsspec.open(name, "rb") as handle:
            column = pq.read_table(handle, columns=[text_field]).column(text_field)
        return len(column) - column.null_count
    if lower.endswith(".jsonl"):
        with fsspec.open(name, "rt", encoding="utf-8") as handle:
            return sum(1 for line in handle if line.strip())
    return 1


def document_range(files: list[str], counts: list[int], start: int, stop: int,
                   text_field: str = "text") -> Iterator[str]:
    """Documents ``start`` to ``stop`` (not included) of ``files``, whose documents number ``counts``: the files
    before ``start`` are not opened."""
    offset = 0
    for name, count in zip(files, counts, strict=True):
        if offset + count > start and offset < stop:
            for index, document in enumerate(_file_documents(name, text_field, max(0, start - offset)),
                                             max(offset, start)):
                if index >= stop:
                    return
                yield document
        offset += count


def _field(record: Any, field: str, name: str, number: int) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise UsageError(f"{name}:{number}: expected a JSON object with a text field {field!r}")
    return record[field]


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


def encode(tokenizer: Any, texts: Iterator[str], end: int, path: Path) -> tuple[int, int]:
    """``texts`` encoded ``CHUNK`` at a time (``encode_batch``: the tokenizer's own threads; memory holds one
    chunk), each followed by ``end``, into ``path`` as int32; returns the documents and tokens written."""
    written = [0, 0]
    with open(path, "wb") as out:
        while batch := list(itertools.islice(texts, CHUNK)):
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray([*encoding.ids, end], dtype=np.int32)
                out.write(ids.tobytes())
                written[1] += len(ids)
            written[0] += len(batch)
    return written[0], written[1]


def encode_part(files: list[str], counts: list[int], start: int, stop: int, text_field: str,
                 tokenizer_path: str, end: int, part: str) -> tuple[int, int]:
    """A tokenizing process's share: documents ``start`` to ``stop`` into ``part``, with one thread (the
    processes are the parallelism; read when the tokenizer first encodes)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    texts = document_range(files, counts, start, stop, text_field)
    return encode(load_tokenizer(tokenizer_path), texts, end, Path(part))


__all__ = ["CHUNK", "TEXT_SUFFIXES", "count_documents", "document_range", "documents", "encode", "encode_part",
           "end_of_document", "load_tokenizer", "source_files"]
