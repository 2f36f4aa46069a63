"""Metrics a person and a script can read: ``metrics.jsonl`` (one JSON object per logged step) in the run
directory, and the same numbers sent to the run's trackers (TensorBoard by default; flowrl/training/trackers.py).

Every line is valid JSON: non-finite numbers are written as ``null`` (never a bare ``NaN``), and a line
that cannot be written whole (a full disk) is taken back, so the file never ends in half a record."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..atomic_files import atomic_path, writing
from ..errors import FlowRLError


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (and tensor / numpy scalar) replaced by a JSON number or null,
    recursively, so ``json.dumps(..., allow_nan=False)`` always succeeds."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if hasattr(value, "item") or isinstance(value, (int, float)):
        v = value.item() if hasattr(value, "item") else value
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v
    return value


def json_line(value: Any, **kwargs: Any) -> str:
    """One valid JSON text: NaN and infinities become null."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


class RunLogger:
    def __init__(self, run_dir: Path, enabled: bool = True, trackers=None):
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self.enabled = enabled
        self.trackers = (
            trackers  # flowrl.training.trackers.Trackers, started by the trainer, so read-only uses (eval, sample) write nothing
        )

    def truncate_after(self, step: int) -> None:
        """On resume, forget records past the checkpoint: they are about to be logged again."""
        if not (self.enabled and self.path.exists()):
            return
        kept = [json_line(r) for r in self.records() if r["step"] <= step]
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(k + "\n" for k in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        line = (json_line(record) + "\n").encode()
        with writing(self.path):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                try:
                    written = os.write(fd, line)
                    if written != len(line):  # a short write: the disk filled up mid-line
                        raise OSError(28, os.strerror(28))
                except OSError:
                    os.ftruncate(fd, size)  # take the half line back: the file stays valid JSON lines
                    raise
            finally:
                os.close(fd)
        if self.trackers is not None:
            self.trackers.log(step, record)

    def records(self) -> list[dict[str, Any]]:
        """The logged records. A last line cut short (the process was killed while writing it) is ignored;
        an unreadable line anywhere else is reported."""
        if not self.path.exists():
            return []
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except ValueError:
                if i == len(lines) - 1:
                    break
                raise FlowRLError(f"'{self.path}' line {i + 1} is not valid JSON; remove or repair that line.") from None
        return records

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.finish()


def _jsonable(v: Any) -> Any:
    v = float(v) if hasattr(v, "item") or isinstance(v, (int, float)) else v
    return None if isinstance(v, float) and not math.isfinite(v) else v
