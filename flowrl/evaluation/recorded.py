"""Grade generations recorded in a JSONL file (e.g. LLaDA-8B-Instruct's GSM8K and MATH500 answers in the shared
data) with flowrl's math grader: ``flowrl eval FILE.jsonl`` or ``python -m flowrl.evaluation.recorded FILE [FIELD]``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..data.text_tasks import RECORDED_FIELD, format_gold
from ..errors import FlowRLError


def grade_recorded(
    path: str | os.PathLike,
    field: str = RECORDED_FIELD,
    limit: int | None = None,
    gold_field: str = "ground_truth",
) -> dict[str, Any]:
    """Grade the generations stored in ``field`` of a JSONL file against ``gold_field`` with flowrl's grader.

    Returns ``{"path", "field", "n", "n_skipped", "accuracy", "extracted_fraction", "rows"}``: ``n`` rows
    with a gold answer were graded (``n_skipped`` had none); ``rows`` holds one
    ``{"index", "gold", "extracted", "correct"}`` per graded row (``index`` is the 0-based line).
    """
    from ..reward_models.math_answer import extract_answer, grade

    p = Path(path)
    if not p.is_file():
        raise FlowRLError(f"recorded generations not found: {p}.")
    rows, skipped = [], 0
    for index, (number, row) in enumerate(_read_rows(p, limit)):
        if field not in row:
            raise FlowRLError(f"{p.name} line {number} has no field '{field}'.")
        gold = format_gold(row.get(gold_field))
        if gold is None:
            skipped += 1
            continue
        extracted = extract_answer(row[field] or "")
        rows.append({"index": index, "gold": gold, "extracted": extracted, "correct": grade(extracted, gold)})
    n = len(rows)
    if n == 0:  # an accuracy of nothing is no number: a script reading exit 0 would take NaN for a result
        why = f"none of its {skipped} rows has a '{gold_field}' answer" if skipped else "it holds no rows"
        raise FlowRLError(f"{p.name} has nothing to grade: {why}.")
    return {
        "path": str(p),
        "field": field,
        "n": n,
        "n_skipped": skipped,
        "accuracy": sum(r["correct"] for r in rows) / n,
        "extracted_fraction": sum(r["extracted"] is not None for r in rows) / n,
        "rows": rows,
    }


def _read_rows(path: Path, limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    """The (line number, object) of every non-blank line, up to ``limit`` rows; a line that is not a JSON object,
    or a file that is not UTF-8, is one sentence naming the file and the line."""
    import json

    from ..data.files import read_utf8

    rows = []
    for number, line in enumerate(read_utf8(path, f"recorded generations file '{path}'").splitlines(), 1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise FlowRLError(f"line {number} of recorded generations file '{path}' is not valid JSON ({e.msg}).") from None
        if not isinstance(row, dict):
            raise FlowRLError(f"line {number} of recorded generations file '{path}' is not a JSON object.")
        rows.append((number, row))
    return rows


def format_report(result: dict[str, Any], examples: int = 0) -> str:
    """One line per measure; with ``examples > 0`` also that many wrong answers (extracted vs gold)."""
    correct = sum(r["correct"] for r in result["rows"])
    lines = [
        f"{Path(result['path']).name} [{result['field']}]",
        f"  graded:    {result['n']} rows ({result['n_skipped']} without a gold answer skipped)",
        f"  accuracy:  {result['accuracy']:.4f} ({correct}/{result['n']})",
        f"  extracted: {result['extracted_fraction']:.4f}",
    ]
    wrong = [r for r in result["rows"] if not r["correct"]][:examples]
    for r in wrong:
        lines.append(f"  line {r['index'] + 1}: extracted {r['extracted']!r}, gold {r['gold']!r}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m flowrl.evaluation.recorded FILE [FIELD]
    import sys

    if len(sys.argv) < 2:
        print("usage: python -m flowrl.evaluation.recorded FILE.jsonl [FIELD]")
        raise SystemExit(2)
    print(format_report(grade_recorded(sys.argv[1], *(sys.argv[2:3] or [RECORDED_FIELD]))))
