"""Generation: a causal language model served token by token, many sequences batched at every step.

engine.py is the interface the endpoints use (GenerationEngine, SamplingParams, TokenEvent and the two
errors); the scheduler decides each step in plain data, the runner executes it against the paged KV
cache. Names are imported on first use so that importing the package loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlscale.common.lazy import lazy_names

if TYPE_CHECKING:
    from mlscale.serve.generation.engine import (
        ContextTooLong,
        EngineFull,
        EngineStats,
        GenerationEngine,
        SamplingParams,
        TokenEvent,
    )

__all__ = ["ContextTooLong", "EngineFull", "EngineStats", "GenerationEngine", "SamplingParams", "TokenEvent"]

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "mlscale.serve.generation.engine"))
