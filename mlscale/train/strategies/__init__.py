"""Strategy plug-ins by name; adding one is a new file and one line here."""

from __future__ import annotations

from mlscale.config import TrainConfig
from mlscale.errors import UsageError
from mlscale.train.strategies.ddp import DDPStrategy
from mlscale.train.strategies.per_step import PerStepDDPStrategy, PerStepFSDPStrategy
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


# Strategies that run as torchft replica groups under --fault-tolerance per-step.
PER_STEP: dict[str, type[Strategy]] = {cls.name: cls for cls in (PerStepDDPStrategy, PerStepFSDPStrategy)}


def strategy_for(config: TrainConfig) -> type[Strategy]:
    """The strategy class that runs ``config``: its ``--strategy``, under ``--fault-tolerance``."""
    strategy = strategy_class(config.strategy)
    if not config.per_step:
        return strategy
    if config.strategy not in PER_STEP:
        raise UsageError(f"bad value fault-tolerance='per-step': built for --strategy {' and '.join(PER_STEP)} "
                         f"(replica groups of torchft); --strategy {config.strategy} restarts on failure (restart)")
    return PER_STEP[config.strategy]
