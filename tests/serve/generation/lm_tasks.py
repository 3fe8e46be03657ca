"""Language models that misbehave in serving, declared as a user declares a task: Llama with an output
head that raises, or sleeps, on the calls serving makes (in inference mode: the engine's probe, the
warm-up, then a call each prefill or decode batch; training's calls never count).

- ``failing_llama``: the head raises once it has been called ``fail_after`` times, so that a failure
  during generation can be seen ending a stream.
- ``slow_llama``: the head sleeps ``delay_s`` a call, so that a sequence runs long enough to be seen
  occupying the engine (or not, once its client has gone).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from mlscale import Task, declare_task
from tests.user_models import llama


class ServingHead(nn.Linear):
    """An output head that, in inference mode, sleeps ``delay_s`` a call and raises from call
    ``fail_after`` + 1 on (None: never)."""

    def __init__(self, head: nn.Linear, fail_after: int | None = None, delay_s: float = 0.0) -> None:
        super().__init__(head.in_features, head.out_features, bias=False)
        self.calls, self.fail_after, self.delay_s = 0, fail_after, delay_s

    def forward(self, x):
        if torch.is_inference_mode_enabled():
            self.calls += 1
            time.sleep(self.delay_s)
            if self.fail_after is not None and self.calls > self.fail_after:
                raise RuntimeError(f"the output head broke at call {self.calls}")
        return super().forward(x)


def _llama_with_head(seq_len: int, samples: int, **head: float) -> Task:
    task = llama(seq_len=seq_len, samples=samples)
    build = task.build_model

    def build_with_head() -> nn.Module:
        model = build()
        model.lm_head = ServingHead(model.lm_head, **head)
        return model

    task.build_model = build_with_head
    return task


@declare_task
def failing_llama(fail_after: int = 6, seq_len: int = 64, samples: int = 32) -> Task:
    return _llama_with_head(seq_len, samples, fail_after=fail_after)


@declare_task
def slow_llama(delay_s: float = 0.05, seq_len: int = 64, samples: int = 32) -> Task:
    return _llama_with_head(seq_len, samples, delay_s=delay_s)
