"""Choosing each sequence's next token from its logits: greedy, or sampled with temperature, top-k
and top-p from the request's own generator; and the logprobs a request asked for.

Logprobs are those of the model's raw distribution (log_softmax of the logits, before temperature
or filtering), as OpenAI and vLLM report them. Greedy rows are chosen together (one argmax); a
sampled row draws from its own torch.Generator only, so a seeded request's tokens do not depend on
the requests beside it in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen. temperature 0 is greedy; a seed gives the request its own
    torch.Generator, so its tokens do not depend on the requests batched beside it. Checked when made
    (ValueError naming the field): the endpoints check their requests first, in their own words."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    seed: int | None = None  # per-request generator: same tokens whatever the neighbours
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's logprob and the top k
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-sequence ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = {
            "max_tokens": self.max_tokens >= 1,
            "temperature": self.temperature >= 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "logprobs": self.logprobs is None or self.logprobs >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingParams.{name} cannot be {getattr(self, name)!r}")


@dataclass(frozen=True)
class Choice:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


def choose(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
           ) -> list[Choice]:
    """One Choice per row of ``logits`` (rows x vocab), row i under ``params[i]`` and ``generators[i]``."""
    if not params:
        return []
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for row, (param, generator) in enumerate(zip(params, generators)):
        if param.temperature > 0:
            tokens[row] = sample(logits[row], param, generator)
    logprobs = _logprobs(logits, params, tokens)
    return [Choice(token, *logprobs.get(row, (None, ()))) for row, token in enumerate(tokens)]


def _logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
              ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """For each row that asked: the chosen token's logprob and the top k, computed for all rows at once."""
    rows = [row for row, param in enumerate(params) if param.logprobs is not None]
    if not rows:
        return {}
    values = torch.log_softmax(logits[rows], dim=-1)
    chosen = values.gather(1, torch.tensor([tokens[row] for row in rows], device=values.device)[:, None])
    most = min(max(params[row].logprobs or 0 for row in rows), values.shape[1])
    top = torch.topk(values, most)
    pairs = [list(zip(ids, logprobs)) for ids, logprobs in zip(top.indices.tolist(), top.values.tolist())]
    return {row: (logprob, tuple(pair[: params[row].logprobs]))
            for row, logprob, pair in zip(rows, chosen.squeeze(1).tolist(), pairs)}


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """A token drawn from softmax(logits / temperature), kept to the top_k most likely and to the
    smallest set whose probability reaches top_p (the most likely token always stays)."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.numel():
        threshold = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
