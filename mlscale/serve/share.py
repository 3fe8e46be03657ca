"""The canary's share as the registry holds it: the model tag ``mlscale.canary_percent``.

Its own small module (no numpy, no server) so that ``mlscale models tag`` can refuse a bad share
where it is written, with the same rule the server reads it by.
"""

from __future__ import annotations

import math

SHARE_TAG = "mlscale.canary_percent"  # the model tag the canary's share follows


def canary_share(text: str) -> float:
    """The share a tag's text asks for, a finite percentage in [0, 100]; ValueError otherwise. Never
    clamped: ``150`` or ``inf`` is a typo, not a wish for all traffic, and ``nan`` compares false
    with everything, so it would silently send nothing."""
    try:
        share = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{SHARE_TAG}={text!r} is not a number") from None
    if not math.isfinite(share) or not 0.0 <= share <= 100.0:
        raise ValueError(f"{SHARE_TAG}={text!r}: the share must be a number between 0 and 100")
    return share
