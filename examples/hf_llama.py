"""A Hugging Face model of your own, declared as a task: a small Llama built from its config (random
weights, nothing downloaded; ``pip install transformers``), learning the next character of a text
(``make_task``) or the next token of your own text files (``make_text_task``).

    PYTHONPATH=. mlscale train --task examples.hf_llama:make_task --strategy fsdp --tp 2 --workers 4
    PYTHONPATH=. mlscale train --task examples.hf_llama:make_text_task --task-opt path=stories/ \
        --task-opt tokenizer=tokenizer.json --workers 2

mlscale splits it with nothing written for it: tensor parallelism takes the model's own plan
(``LlamaForCausalLM._tp_plan``), FSDP2 shards what is left, a pipeline cuts it at ``model.layers``, and
each layout trains what one process trains. The model returns a ``ModelOutput``; the loss reads its logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mlscale import Task, TensorData, declare_task
from mlscale.data.text import PackedText, tokenize
from mlscale.tasks.tinylm import encode, make_corpus

VOCAB = 32  # the corpus's 29 characters, rounded up


def next_token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def metrics(output, targets: torch.Tensor) -> dict[str, float]:
    return {"loss": next_token_loss(output, targets).item(),
            "accuracy": (output.logits.argmax(-1) == targets).double().mean().item()}


def llama(vocab: int, layers: int, dim: int, heads: int, kv_heads: int, context: int, end: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM  # imported where the model is built: the workers

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
        use_cache=False, bos_token_id=end, eos_token_id=end, pad_token_id=None))


@declare_task
def make_text_task(path: str, tokenizer: str, layers: int = 2, dim: int = 64, heads: int = 4, kv_heads: int = 2,
                   seq_len: int = 64, context: int = 256) -> Task:
    """Your text files (JSONL ``text`` fields, Parquet, ``.txt``), tokenized once with ``tokenizer`` (a Hugging
    Face tokenizer.json) and packed into windows of ``seq_len`` tokens; ``context``: the longest sequence the
    served model will take (prompt and answer)."""
    tokens, meta = tokenize(path, tokenizer)
    windows = range(len(PackedText(tokens, seq_len, meta["end"])))
    train = PackedText(tokens, seq_len, meta["end"], [i for i in windows if i % 10])
    held_out = PackedText(tokens, seq_len, meta["end"], [i for i in windows if i % 10 == 0])
    return Task(name="hf-llama-text", train=train, eval=held_out, loss_fn=next_token_loss, metrics_fn=text_metrics,
                build_model=lambda: llama(meta["vocab"], layers, dim, heads, kv_heads, context, meta["end"]),
                info={"vocab": meta["vocab"], "seq_len": seq_len})


def text_metrics(output, targets: torch.Tensor) -> dict[str, float]:
    kept = targets != -100  # a new document's first token is not predicted from the last one's end
    right = (output.logits.argmax(-1) == targets) & kept
    return {"loss": next_token_loss(output, targets).item(), "accuracy": (right.sum() / kept.sum()).item()}


@declare_task
def make_task(layers: int = 4, dim: int = 64, heads: int = 4, kv_heads: int = 2, seq_len: int = 32,
              samples: int = 1024) -> Task:
    def build() -> nn.Module:
        return llama(VOCAB, layers, dim, heads, kv_heads, seq_len, end=0)

    held_out = samples // 8
    rows = encode(make_corpus((samples + held_out) * (seq_len + 1), seed=0))
    rows = rows[: (samples + held_out) * (seq_len + 1)].view(samples + held_out, seq_len + 1)
    return Task(name="hf-llama", build_model=build,
                train=TensorData(rows[:samples, :-1].clone(), rows[:samples, 1:].clone()),
                eval=TensorData(rows[samples:, :-1].clone(), rows[samples:, 1:].clone()),
                loss_fn=next_token_loss, metrics_fn=metrics, info={"vocab": VOCAB, "seq_len": seq_len})
