"""Metrics a person and a script can read: ``metrics.jsonl`` (one JSON object per logged step) and
TensorBoard event files, both in the run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def nanmean(values: list[float]) -> float:
    """Mean of the finite values (NaN when there are none): a dropped sample must not poison a metric."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


class RunLogger:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self.enabled = enabled
        self._tb = None  # created on the first log, so read-only uses (eval, sample) write nothing

    def truncate_after(self, step: int) -> None:
        """On resume, forget records past the checkpoint: they are about to be logged again."""
        if not (self.enabled and self.path.exists()):
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(k + "\n" for k in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and v is not None:
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _jsonable(v: Any) -> Any:
    v = float(v) if hasattr(v, "item") or isinstance(v, (int, float)) else v
    return None if isinstance(v, float) and not math.isfinite(v) else v
