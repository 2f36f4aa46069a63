"""How per-sample scores become one logged number (training rewards, held-out metrics, judges)."""

from __future__ import annotations

import math


def nanmean(values: list[float]) -> float:
    """Mean of the finite values (NaN when there are none): a dropped sample must not poison a metric."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")
