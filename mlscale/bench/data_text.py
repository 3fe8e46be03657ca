"""``mlscale bench data --suite text``: tokens/s of tokenizing and packing text into training windows.

A generated corpus (``--documents`` documents of 200-2,000 characters from tinylm's grammar, as JSONL) and a
byte-level BPE tokenizer trained on it (vocabulary 2,000). Both sides deliver batches of 64 windows of
``--seq-len`` tokens (inputs and targets). Measured, interleaved, medians of repeats:

- a plain loop, as one writes it: each document encoded with the tokenizer (``encode``) followed by the
  end token, appended to a buffer, windows cut from it, stacked into batches (every epoch does all of it);
- mlscale, first epoch: the corpus tokenized once into its memory-mapped token file (``encode_batch``,
  the tokenizer's own threads), then the windows through its loader (``PackedText``, shuffled, with
  position ids and masked seams);
- mlscale, later epochs: the windows only, from the token file;
- the tokenizing pass alone, into a fresh cache: in the process (the tokenizer's own threads, ``--data-workers
  0``) and shared by ``--tokenize-workers`` spawned processes (default: one per core; ``--data-workers N``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mlscale.bench.data_images import cores
from mlscale.data.dataset import MapData

BATCH = 64


def make_corpus_file(folder: Path, documents: int, seed: int = 0) -> tuple[Path, Path, list[str]]:
    from mlscale.data.text import train_tokenizer
    from mlscale.tasks.tinylm import make_corpus

    rng = random.Random(seed)
    texts = [make_corpus(rng.randint(200, 2000), seed=seed * 1_000_003 + i) for i in range(documents)]
    corpus = folder / "corpus.jsonl"
    with open(corpus, "w") as out:
        out.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    tokenizer = train_tokenizer(texts[:2000], folder / "tokenizer.json", vocab_size=2000)
    return corpus, tokenizer, texts


def plain_loop(texts: list[str], tokenizer_path: Path, seq_len: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    end = tokenizer.token_to_id("<|endoftext|>")
    start = time.perf_counter()
    buffer: list[int] = []
    windows: list[list[int]] = []
    tokens = 0
    for text in texts:
        buffer.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        buffer.append(end)
        while len(buffer) > seq_len:
            windows.append(buffer[:seq_len + 1])
            del buffer[:seq_len]
            if len(windows) == BATCH:
                batch = torch.tensor(windows)
                _ = batch[:, :-1], batch[:, 1:]
                tokens += BATCH * seq_len
                windows = []
    return {"tokens_per_s": tokens / (time.perf_counter() - start), "tokens": tokens}


@contextlib.contextmanager
def _token_cache() -> Iterator[None]:
    """A token cache of its own (``MLSCALE_CACHE_DIR``), so that every measurement tokenizes afresh."""
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-tokens-") as cache:
        saved = os.environ.get("MLSCALE_CACHE_DIR")
        os.environ["MLSCALE_CACHE_DIR"] = cache
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("MLSCALE_CACHE_DIR", None)
            else:
                os.environ["MLSCALE_CACHE_DIR"] = saved


def mlscale_epochs(corpus: Path, tokenizer_path: Path, seq_len: int) -> dict[str, Any]:
    """The first epoch (tokenizing into the token file, then the windows) and a later one (the windows)."""
    from mlscale.data.loader import ShardLoader
    from mlscale.data.text import PackedText, tokenize

    with _token_cache():
        start = time.perf_counter()
        tokens, meta = tokenize(str(corpus), str(tokenizer_path))
        built = time.perf_counter() - start
        data = MapData(PackedText(tokens, seq_len, meta["end"]))
        passes = []
        for _ in range(2):
            loader = ShardLoader(data, rank=0, world=1, step_batch=BATCH, seed=0)
            steps = len(data) // BATCH
            begin = time.perf_counter()
            for _ in range(steps):
                next(loader)
            passes.append((steps * BATCH * seq_len, time.perf_counter() - begin))
    delivered, seconds = passes[1]
    return {"first_epoch_tokens_per_s": passes[0][0] / (built + passes[0][1]), "tokenize_s": built,
            "later_epoch_tokens_per_s": delivered / seconds, "tokens": int(meta["tokens"])}


def tokenize_pass(corpus: Path, tokenizer_path: Path, workers: int) -> dict[str, Any]:
    """The one-time tokenizing pass alone: in this process (``workers`` 0: the tokenizer's own threads), or
    shared by ``workers`` spawned processes (``--data-workers``; their start counted)."""
    from mlscale.data.text import tokenize

    with _token_cache():
        start = time.perf_counter()
        _, meta = tokenize(str(corpus), str(tokenizer_path), workers=workers)
        seconds = time.perf_counter() - start
    return {"tokens_per_s": meta["tokens"] / seconds, "seconds": seconds, "workers": workers}


def run_suite(args: Any, say: Any) -> dict[str, Any]:
    processes = args.tokenize_workers or cores()
    passes = {"threads": 0, f"{processes} processes": processes}
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-text-") as scratch:
        corpus, tokenizer, texts = make_corpus_file(Path(scratch), args.documents)
        systems = {"plain": lambda: plain_loop(texts, tokenizer, args.seq_len),
                   "mlscale": lambda: mlscale_epochs(corpus, tokenizer, args.seq_len)}
        for name, workers in passes.items():
            systems[f"tokenize {name}"] = lambda n=workers: tokenize_pass(corpus, tokenizer, n)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        for repeat in range(args.repeats):
            for name in systems if repeat % 2 == 0 else list(systems)[::-1]:
                run = systems[name]()
                runs[name].append(run)
                say(f"text repeat {repeat + 1}/{args.repeats}  {name:<8} " + ", ".join(
                    f"{key} {value:,.0f}" for key, value in run.items() if key.endswith("per_s")))
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    first = statistics.median(r["first_epoch_tokens_per_s"] for r in runs["mlscale"])
    later = statistics.median(r["later_epoch_tokens_per_s"] for r in runs["mlscale"])
    tokenizing = {name: statistics.median(r["tokens_per_s"] for r in runs[f"tokenize {name}"]) for name in passes}
    return {
        "how": (f"{args.documents:,} generated documents of 200-2,000 characters (JSONL), a byte-level BPE "
                f"tokenizer of 2,000 tokens; batches of {BATCH} windows of {args.seq_len} tokens; plain: encode "
                "each document, buffer, cut, stack, every epoch; mlscale: tokenized once into its token file "
                "(encode_batch) then windows through ShardLoader (shuffled, position ids, masked seams); the "
                "tokenizing pass alone, into a fresh cache: in the process (the tokenizer's threads, --data-workers "
                f"0) and shared by {processes} spawned processes of one thread each (--data-workers {processes}, "
                f"their start counted); {args.repeats} interleaved repeats, medians"),
        "tokens_per_s": {"plain": plain, "mlscale first epoch": first, "mlscale later epochs": later},
        "first_vs_plain": first / plain, "later_vs_plain": later / plain,
        "tokenize_pass": {"tokens_per_s": tokenizing,
                          "processes_vs_threads": tokenizing[f"{processes} processes"] / tokenizing["threads"]},
        "runs": runs,
    }


def plot_text(left: Any, right: Any, section: dict[str, Any]) -> None:
    """tokens/s delivered (plain loop, mlscale's first and later epochs), and of the tokenizing pass alone."""
    rates = section["tokens_per_s"]
    bars = left.bar(list(rates), list(rates.values()), color=["grey", "tab:blue", "tab:green"])
    left.bar_label(bars, fmt="%.0f")
    left.set_ylabel("tokens/s")
    left.set_title("text: tokenize + pack into windows (medians)", fontsize=9)
    passes = section.get("tokenize_pass")
    if not passes:  # results of earlier versions
        right.axis("off")
        return
    bars = right.bar(list(passes["tokens_per_s"]), list(passes["tokens_per_s"].values()),
                     color=["tab:blue", "tab:purple"])
    right.bar_label(bars, fmt="%.0f")
    right.set_ylabel("tokens/s")
    right.set_title("the tokenizing pass: the tokenizer's threads vs --data-workers processes", fontsize=9)


__all__ = ["mlscale_epochs", "plain_loop", "plot_text", "run_suite", "tokenize_pass"]
