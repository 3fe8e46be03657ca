"""Injected failures (``--fault SPEC``) for tests and demos.

``kill:rank=R:step=K`` kills worker R with SIGKILL when it reaches step K, on the first attempt only
(a restarted group must be able to get past the step). ``slow:rank=R:delay_ms=D`` makes worker R
D milliseconds slower on every step, which is how straggler handling is exercised.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from mlscale.errors import UsageError

_FIELDS = {"kill": ("rank", "step"), "slow": ("rank", "delay_ms")}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0
    delay_ms: float = 0.0


def parse_fault(spec: str) -> Fault:
    kind, *parts = spec.split(":")
    if kind not in _FIELDS:
        raise UsageError(f"bad value fault={spec!r}: kind must be one of {', '.join(_FIELDS)}")
    values: dict[str, float] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or key not in _FIELDS[kind]:
            raise UsageError(f"bad value fault={spec!r}: expected {kind}:" + ":".join(f"{f}=N" for f in _FIELDS[kind]))
        try:
            values[key] = float(raw)
        except ValueError:
            raise UsageError(f"bad value fault={spec!r}: {key} must be a number") from None
    missing = [field for field in _FIELDS[kind] if field not in values]
    if missing:
        raise UsageError(f"bad value fault={spec!r}: missing {', '.join(missing)}")
    return Fault(
        kind=kind,
        rank=int(values["rank"]),
        step=int(values.get("step", 0)),
        delay_ms=values.get("delay_ms", 0.0),
    )


class FaultInjector:
    """Applies the faults aimed at this rank; a no-op object when there are none."""

    def __init__(self, specs: list[str], rank: int, attempt: int) -> None:
        faults = [parse_fault(spec) for spec in specs]
        self._kill_steps = {f.step for f in faults if f.kind == "kill" and f.rank == rank and attempt == 0}
        self._delay_s = sum(f.delay_ms for f in faults if f.kind == "slow" and f.rank == rank) / 1000.0

    def before_step(self, step: int) -> None:
        if step in self._kill_steps:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._delay_s:
            time.sleep(self._delay_s)
