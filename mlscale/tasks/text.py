"""``--task text --task-opt path=FILE_OR_DIR_OR_URL --task-opt tokenizer=tokenizer.json``: tinylm trained on your text.

The documents (JSONL ``text`` fields, a Parquet ``text`` column, or whole ``.txt`` files; ``text_field`` names
another) are tokenized once with the Hugging Face ``tokenizers`` file given (by ``--data-workers`` processes when
given) and packed into windows of ``seq_len`` tokens that keep documents apart (``mlscale.data.text``); every
``held_out_every``-th window is held out. The model is tinylm's transformer (``mlscale.tasks.tinylm``) with the
tokenizer's vocabulary, attention kept within each document by the windows' position ids.
"""

from __future__ import annotations

from mlscale.data.text import PackedText, tokenize
from mlscale.errors import UsageError
from mlscale.tasks.base import Task
from mlscale.tasks.tinylm import TinyLM, language_metrics, next_token_loss


def make_text(path: str = "", tokenizer: str = "", seq_len: int = 64, dim: int = 64, layers: int = 4, heads: int = 4,
              ffn_mult: int = 4, held_out_every: int = 20, text_field: str = "text", *,
              data_workers: int | str = 0) -> Task:
    """``data_workers``: the run's ``--data-workers``; N > 0 tokenizes in N processes the first time (``auto``:
    the tokenizer's own threads, as 0)."""
    if not path or not tokenizer:
        raise UsageError("--task text needs --task-opt path=FILE_OR_DIR_OR_URL and --task-opt tokenizer=tokenizer.json")
    if dim % heads:
        raise UsageError(f"bad task options for 'text': dim ({dim}) must be a multiple of heads ({heads})")
    if held_out_every < 2:
        raise UsageError(f"bad value held_out_every={held_out_every}: at least 2 (one window in N is held out)")
    tokens, meta = tokenize(path, tokenizer, text_field, workers=data_workers if isinstance(data_workers, int) else 0)
    windows = PackedText(tokens, seq_len, meta["end"])
    every = range(len(windows))
    train = PackedText(tokens, seq_len, meta["end"], [i for i in every if i % held_out_every])
    held_out = PackedText(tokens, seq_len, meta["end"], [i for i in every if i % held_out_every == 0])
    vocab = meta["vocab"]
    return Task(name="text", build_model=lambda: TinyLM(vocab, dim, layers, heads, seq_len, ffn_mult * dim),
                train=train, eval=held_out, loss_fn=next_token_loss, metrics_fn=language_metrics,
                info={"vocab": vocab, "seq_len": seq_len, "documents": meta["documents"], "tokens": meta["tokens"]})
