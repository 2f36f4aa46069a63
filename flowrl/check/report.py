"""The check's result: what passed, each mismatch in one sentence, and the report a person reads (or one JSON line)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .parity import Difference
from .rescore import TOLERANCE, Rescore


@dataclass
class CheckResult:
    source: str
    rescore: Rescore
    rows: dict[str, dict[str, Any]]  # path -> setting -> value (the model card's too)
    differences: list[Difference]  # every path against the rollout and the evaluation, intended or not
    unread: list[str]  # dotted config keys set but read by no part of the run
    notes: list[str] = field(default_factory=list)  # what did not apply, and why
    problems: list[str] = field(default_factory=list)  # further mismatches, one sentence each

    @property
    def mismatches(self) -> list[str]:
        return [
            *self.rescore.failures,
            *(d.sentence() for d in self.differences if d.intended is None),
            *(f"config key '{k}' is set but no part of this run reads it" for k in self.unread),
            *self.problems,
        ]

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def as_json(self) -> dict[str, Any]:
        r = self.rescore
        return {
            "config": self.source,
            "passed": self.passed,
            "mismatches": self.mismatches,
            "intended": [d.sentence() for d in self.differences if d.intended is not None],
            "rescore": {
                "applies": r.applies,
                "precision": r.precision,
                "note": r.note,
                "intended": r.intended,
                "steps": [vars(s) for s in r.steps],
            },
            "settings": self.rows,
            "unread": self.unread,
            "notes": self.notes,
        }


def format_report(result: CheckResult) -> str:
    """A few sections for a person: the re-score per step, the settings of every path, what is intended, what failed."""
    lines = [f"flowrl check {result.source}: " + ("PASS" if result.passed else f"FAIL ({len(result.mismatches)} mismatch(es))")]
    lines += ["", *_rescore_lines(result.rescore), "", *_settings_lines(result.rows)]
    intended = _grouped([d for d in result.differences if d.intended is not None])
    if intended:
        lines += ["", "intended differences:", *(f"  - {line}" for line in intended)]
    lines += ["", "config keys set but read by no part of the run: " + (", ".join(result.unread) if result.unread else "none")]
    if result.notes:
        lines += ["", "not checked:", *(f"  - {n}" for n in result.notes)]
    if result.mismatches:
        lines += ["", "mismatches:", *(f"  - {m}." for m in result.mismatches)]
    return "\n".join(lines)


def _grouped(differences: list[Difference]) -> list[str]:
    """One line per intended difference, naming every path that shows it."""
    groups: dict[tuple, list[str]] = {}
    for d in differences:
        groups.setdefault((d.setting, _show(d.value), d.against, _show(d.expected), d.intended), []).append(d.path)
    return [
        f"{setting}: {', '.join(paths)} {'has' if len(paths) == 1 else 'have'} {value} where the {against} has {expected}; {reason}"
        for (setting, value, against, expected, reason), paths in groups.items()
    ]


def _rescore_lines(r: Rescore) -> list[str]:
    if not r.applies:
        return [f"re-score: does not apply: {r.note}."]
    absolute, relative = TOLERANCE[r.precision]
    head = f"re-score ({r.note}; {r.precision} tolerance {absolute:g} + {relative:g} |log p|):"
    if r.intended:
        head += f"\n  off-policy by design, not a failure: {r.intended}"
    rows = [f"  {'step':<34}{'rows':>6}{'mean log r':>14}{'std':>12}{'max |log r|':>14}  ok"]
    for s in r.steps:
        ratio = math.exp(s.mean) if math.isfinite(s.mean) else float("nan")
        rows.append(
            f"  {s.step:<34}{s.rows:>6}{s.mean:>14.3e}{_num(s.std):>12}{s.max_abs:>14.3e}  {'yes' if s.passed else 'NO'}"
            + ("" if abs(ratio - 1) < 1e-3 else f"  (ratio {ratio:.6f})")
        )
    return [head, *rows] if r.steps else [head, "  no recorded step was re-scored"]


def _settings_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """One line per setting: its value when every path agrees, else each path's."""
    paths = [p for p, row in rows.items() if row]
    settings = list(dict.fromkeys(k for p in paths for k in rows[p]))
    lines = [f"settings ({', '.join(paths)}):"]
    for setting in settings:
        values = {p: rows[p][setting] for p in paths if setting in rows[p]}
        shown = {p: _show(v) for p, v in values.items()}
        if len(set(shown.values())) == 1:
            lines.append(f"  {setting}: {next(iter(shown.values()))} ({'every path' if len(shown) == len(paths) else ', '.join(shown)})")
        else:
            lines.append(f"  {setting}:")
            lines += [f"    {p:<16}{v}" for p, v in shown.items()]
    return lines


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _num(value: float) -> str:
    return f"{value:.3e}" if math.isfinite(value) else "-"
