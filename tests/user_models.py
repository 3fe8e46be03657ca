"""Models nobody here wrote, declared as tasks the way a user declares theirs: Hugging Face ``transformers``
models built from small configs (random weights, nothing downloaded) and a plain CNN written as people
write them (a dict output, buffers, a free parameter outside any block).

- ``gpt2``: GPT-2 with its output head tied to the token embedding (one storage), returning a
  ``ModelOutput``; no tensor-parallel plan of its own.
- ``llama``: Llama with grouped-query attention, declaring its own tensor-parallel plan (``_tp_plan``);
  untied unless ``tie=True``.
- ``cnn``: convolutions with GroupNorm, a persistent and a non-persistent buffer, returning a dict.

``wrapped=true`` puts GPT-2 or Llama inside the user's own module (``UsersLM``: the usual way to put a head
or a loss around a Hugging Face model), which returns the logits as a plain tensor.

- ``seqfirst``: blocks written sequence-first that hand their output back transposed (a view), so what one
  pipeline stage sends the next is not contiguous.
- ``bert``: a BERT sentence classifier called ``model(input_ids=..., attention_mask=...)``, trained on a
  ``Dataset`` of token-id sequences of different lengths padded by ``PadCollate`` (two inputs, a dynamic
  sequence axis: what export and serving must carry by name).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from mlscale import PadCollate, Task, TensorData, declare_task
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


class UsersLM(nn.Module):
    """A user's module around a Hugging Face causal LM: the model one level down, logits out."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids).logits


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def logits_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    accuracy = (logits.argmax(-1) == targets).double().mean().item()
    return {"loss": logits_loss(logits, targets).item(), "accuracy": accuracy}


def _lm_task(name: str, build, seq_len: int, samples: int, wrapped: bool) -> Task:
    train, held_out = _windows(samples, seq_len)
    if wrapped:
        return Task(name=name, build_model=lambda: UsersLM(build()), train=train, eval=held_out,
                    loss_fn=logits_loss, metrics_fn=logits_metrics, info={"vocab": VOCAB, "seq_len": seq_len})
    return Task(name=name, build_model=build, train=train, eval=held_out,
                loss_fn=lm_loss, metrics_fn=lm_metrics, info={"vocab": VOCAB, "seq_len": seq_len})


@declare_task
def gpt2(layers: int = 4, dim: int = 32, heads: int = 4, seq_len: int = 16, samples: int = 256,
         tie: bool = True, wrapped: bool = False) -> Task:
    def build() -> nn.Module:  # transformers is imported by the processes that build the model, only
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=seq_len, n_embd=dim, n_layer=layers, n_head=heads, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=tie, bos_token_id=0,
            eos_token_id=0))

    return _lm_task("gpt2", build, seq_len, samples, wrapped)


@declare_task
def llama(layers: int = 4, dim: int = 32, heads: int = 4, kv_heads: int = 2, seq_len: int = 16,
          samples: int = 256, tie: bool = False, wrapped: bool = False) -> Task:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
            use_cache=False, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=None))

    return _lm_task("llama", build, seq_len, samples, wrapped)


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


class SeqFirstBlock(nn.Module):
    """A block written sequence-first (nn.MultiheadAttention's default layout), its output handed back
    batch-first as a transposed view."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x.transpose(0, 1))).transpose(0, 1)


class SeqFirstLM(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(SeqFirstBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@declare_task
def seqfirst(dim: int = 16, layers: int = 4, seq_len: int = 16, samples: int = 256) -> Task:
    train, held_out = _windows(samples, seq_len)
    return Task(name="seqfirst", build_model=lambda: SeqFirstLM(dim, layers), train=train, eval=held_out,
                loss_fn=logits_loss, metrics_fn=logits_metrics, info={"vocab": VOCAB, "seq_len": seq_len})


class Sequences(Dataset):
    """``size`` token-id sequences of 3 to ``longest`` ids (no 0: the padding id), labelled by their sum's
    parity; made from ``seed`` alone."""

    def __init__(self, size: int, longest: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, longest + 1, (size,), generator=generator)
        self.ids = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        ids = self.ids[index]
        return {"input_ids": ids}, int(ids.sum()) % 2


@declare_task
def bert(dim: int = 16, layers: int = 2, heads: int = 2, longest: int = 12, samples: int = 64) -> Task:
    def build() -> nn.Module:
        from transformers import BertConfig, BertForSequenceClassification

        return BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=2 * dim, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=2, attn_implementation="eager"))

    return Task(name="bert", build_model=build, train=Sequences(samples, longest, seed=1),
                eval=Sequences(32, longest, seed=2), collate=PadCollate(mask="attention_mask"),
                loss_fn=classifier_loss, metrics_fn=bert_metrics)


def classifier_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)


def bert_metrics(output, targets: torch.Tensor) -> dict[str, float]:
    return {"loss": classifier_loss(output, targets).item(),
            "accuracy": (output.logits.argmax(1) == targets).double().mean().item()}


__all__ = ["ALPHABET", "SeqFirstLM", "UsersLM", "bert", "cnn", "gpt2", "llama", "seqfirst"]
