"""A Hugging Face model of your own, declared as a task: a small Llama built from its config (random
weights, nothing downloaded; ``pip install transformers``), learning the next character of a text.

    PYTHONPATH=. mlscale train --task examples.hf_llama:make_task --strategy fsdp --tp 2 --workers 4

mlscale splits it with nothing written for it: tensor parallelism takes the model's own plan
(``LlamaForCausalLM._tp_plan``), FSDP2 shards what is left, a pipeline cuts it at ``model.layers``, and
each layout trains what one process trains. The model returns a ``ModelOutput``; the loss reads its logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mlscale import Task, TensorData, declare_task
from mlscale.tasks.tinylm import encode, make_corpus

VOCAB = 32  # the corpus's 29 characters, rounded up


def next_token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def metrics(output, targets: torch.Tensor) -> dict[str, float]:
    return {"loss": next_token_loss(output, targets).item(),
            "accuracy": (output.logits.argmax(-1) == targets).double().mean().item()}


@declare_task
def make_task(layers: int = 4, dim: int = 64, heads: int = 4, kv_heads: int = 2, seq_len: int = 32,
              samples: int = 1024) -> Task:
    def build() -> nn.Module:  # imported where the model is built: the workers, not the launcher
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
            use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=None))

    held_out = samples // 8
    rows = encode(make_corpus((samples + held_out) * (seq_len + 1), seed=0))
    rows = rows[: (samples + held_out) * (seq_len + 1)].view(samples + held_out, seq_len + 1)
    return Task(name="hf-llama", build_model=build,
                train=TensorData(rows[:samples, :-1].clone(), rows[:samples, 1:].clone()),
                eval=TensorData(rows[samples:, :-1].clone(), rows[samples:, 1:].clone()),
                loss_fn=next_token_loss, metrics_fn=metrics, info={"vocab": VOCAB, "seq_len": seq_len})
