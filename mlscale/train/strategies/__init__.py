"""Strategy plug-ins by name; adding one is a new file and one line here."""

from __future__ import annotations

from mlscale.errors import UsageError
from mlscale.train.strategies.ddp import DDPStrategy
from mlscale.train.strategies.pipeline import PipelineStrategy
from mlscale.train.strategies.ps import ParameterServerStrategy
from mlscale.train.strategies.sharded import FSDPStrategy, TensorParallelStrategy
from mlscale.train.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (
    DDPStrategy, FSDPStrategy, TensorParallelStrategy, PipelineStrategy, ParameterServerStrategy)}


def strategy_class(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise UsageError(f"bad value strategy={name!r}: unknown strategy (known: {', '.join(STRATEGIES)})") from None
