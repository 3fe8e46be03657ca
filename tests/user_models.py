"""Models nobody here wrote, declared as tasks the way a user declares theirs: Hugging Face ``transformers``
models built from small configs (random weights, nothing downloaded) and a plain CNN written as people
write them (a dict output, buffers, a free parameter outside any block).

- ``gpt2``: GPT-2 with its output head tied to the token embedding (one storage), returning a
  ``ModelOutput``; no tensor-parallel plan of its own.
- ``llama``: Llama with grouped-query attention, declaring its own tensor-parallel plan (``_tp_plan``);
  untied unless ``tie=True``.
- ``cnn``: convolutions with GroupNorm, a persistent and a non-persistent buffer, returning a dict.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mlscale import Task, TensorData, declare_task
from mlscale.tasks.tinylm import ALPHABET, encode, make_corpus

VOCAB = 32  # the tinylm alphabet (29 characters), rounded up


def _windows(samples: int, seq_len: int, seed: int = 1234) -> tuple[TensorData, TensorData]:
    held_out = max(1, samples // 8)
    window = seq_len + 1
    tokens = encode(make_corpus((samples + held_out) * window, seed))
    rows = tokens[: (samples + held_out) * window].view(samples + held_out, window)
    return (TensorData(rows[:samples, :-1].clone(), rows[:samples, 1:].clone()),
            TensorData(rows[samples:, :-1].clone(), rows[samples:, 1:].clone()))


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a causal LM's output (a ``ModelOutput`` with ``logits``), as a user writes it."""
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def lm_metrics(output, targets: torch.Tensor) -> dict[str, float]:
    return {"loss": lm_loss(output, targets).item(),
            "accuracy": (output.logits.argmax(-1) == targets).double().mean().item()}


@declare_task
def gpt2(layers: int = 4, dim: int = 32, heads: int = 4, seq_len: int = 16, samples: int = 256,
         tie: bool = True) -> Task:
    def build() -> nn.Module:  # transformers is imported by the processes that build the model, only
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=seq_len, n_embd=dim, n_layer=layers, n_head=heads, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=tie, bos_token_id=0,
            eos_token_id=0))

    train, held_out = _windows(samples, seq_len)
    return Task(name="gpt2", build_model=build, train=train, eval=held_out,
                loss_fn=lm_loss, metrics_fn=lm_metrics, info={"vocab": VOCAB, "seq_len": seq_len})


@declare_task
def llama(layers: int = 4, dim: int = 32, heads: int = 4, kv_heads: int = 2, seq_len: int = 16,
          samples: int = 256, tie: bool = False) -> Task:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
            use_cache=False, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=None))

    train, held_out = _windows(samples, seq_len)
    return Task(name="llama", build_model=build, train=train, eval=held_out,
                loss_fn=lm_loss, metrics_fn=lm_metrics, info={"vocab": VOCAB, "seq_len": seq_len})


class SmallCNN(nn.Module):
    """A CNN as people write one: blocks in a Sequential, a learned temperature outside them, the input
    normalised by a fixed (non-persistent) mean, and a persistent buffer counting nothing in particular."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.register_buffer("pixel_mean", torch.tensor(0.3), persistent=False)
        self.register_buffer("version", torch.tensor(1.0))
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.GroupNorm(2, channels), nn.ReLU()),
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(2, channels), nn.ReLU()),
            nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2)),
        )
        self.head = nn.Linear(8 * channels, classes)
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        image = (x - self.pixel_mean).reshape(-1, 1, 8, 8)
        logits = self.head(self.blocks(image).flatten(1)) / self.temperature
        return {"logits": logits, "features_norm": logits.norm(dim=1)}


def cnn_loss(output: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output["logits"], targets)


def cnn_metrics(output: dict[str, torch.Tensor], targets: torch.Tensor) -> dict[str, float]:
    return {"loss": cnn_loss(output, targets).item(),
            "accuracy": (output["logits"].argmax(1) == targets).double().mean().item()}


@declare_task
def cnn(channels: int = 8, samples: int = 512) -> Task:
    from mlscale.tasks.digits import load_digits, split

    train, held_out = split(load_digits())
    train = TensorData(train.inputs[:samples], train.targets[:samples])
    return Task(name="cnn", build_model=lambda: SmallCNN(channels), train=train, eval=held_out,
                loss_fn=cnn_loss, metrics_fn=cnn_metrics, info={"inputs": 64, "classes": 10})


__all__ = ["ALPHABET", "cnn", "gpt2", "llama"]
