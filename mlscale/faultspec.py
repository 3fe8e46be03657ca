"""Injected failures as typed values: ``--fault SPEC`` parsed once, where the configuration is read.

The spec language (``kill:rank=R:step=K`` and the others) is described in ``mlscale.train.faults``,
which injects them. This module sits below the configuration so that reading a run's configuration
(the registry does) never imports the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlscale.errors import UsageError

_OPTIONAL = {"p", "rejoin_by"}
ANY_RANK = -1  # rank=any
_FIELDS = {
    "kill": ("rank", "step", "rejoin_by"),
    "kill_in_step": ("rank", "step", "rejoin_by"),
    "hang": ("rank", "step"),
    "slow": ("rank", "delay_ms", "p"),
    "kill_during_checkpoint": ("step",),
    "inf_grad": ("rank", "step"),
}
FAULT_KINDS = tuple(_FIELDS)


@dataclass(frozen=True)
class Fault:
    """One injected failure; ``spec`` is the text it was given as (what ``config.json`` keeps)."""

    kind: str
    rank: int = 0
    step: int = 0
    delay_ms: float = 0.0
    p: float = 1.0  # the fraction of steps a slow fault is slow on
    rejoin_by: int = 0  # a kill: the step before which the others wait for the killed rank's replacement
    spec: str = ""

    def __str__(self) -> str:
        return self.spec

    @property
    def aims_at_rank(self) -> bool:
        """Whether the fault names a rank (every kind but ``kill_during_checkpoint``)."""
        return "rank" in _FIELDS[self.kind]


def parse_fault(spec: str | Fault) -> Fault:
    """A ``Fault`` from its spec; a bad spec is a ``UsageError`` naming it."""
    if isinstance(spec, Fault):
        return spec
    kind, *parts = spec.split(":")
    if kind not in _FIELDS:
        raise UsageError(f"bad value fault={spec!r}: kind must be one of {', '.join(_FIELDS)}")
    expected = f"{kind}:" + ":".join(f"{f}=N" for f in _FIELDS[kind] if f not in _OPTIONAL)
    values: dict[str, float] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or key not in _FIELDS[kind]:
            raise UsageError(f"bad value fault={spec!r}: expected {expected}")
        values[key] = _number(spec, key, raw, kind)
    missing = [field for field in _FIELDS[kind] if field not in values and field not in _OPTIONAL]
    if missing:
        raise UsageError(f"bad value fault={spec!r}: missing {', '.join(missing)}")
    fault = Fault(kind=kind, rank=int(values.get("rank", 0)), step=int(values.get("step", 0)),
                  delay_ms=values.get("delay_ms", 0.0), p=values.get("p", 1.0),
                  rejoin_by=int(values.get("rejoin_by", 0)), spec=spec)
    if "rejoin_by" in values and fault.rejoin_by <= fault.step:
        raise UsageError(f"bad value fault={spec!r}: rejoin_by must come after the step of the kill ({fault.step})")
    return fault


def _number(spec: str, key: str, raw: str, kind: str) -> float:
    if key == "rank" and raw == "any" and kind == "slow":
        return ANY_RANK
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"bad value fault={spec!r}: {key} must be a number"
                         + (" or 'any'" if key == "rank" and kind == "slow" else "")) from None
    if key == "p" and not 0 < value <= 1:
        raise UsageError(f"bad value fault={spec!r}: p must be in (0, 1]")
    if value < 0:
        raise UsageError(f"bad value fault={spec!r}: {key} must not be negative")
    return value
