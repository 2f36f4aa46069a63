"""Prompts from files: ``prompts.dataset: file`` with ``train_file`` / ``eval_file``.

A ``.txt`` file holds one prompt per line (blank lines and lines starting with ``#`` are skipped). A
``.jsonl`` file holds one JSON object per line with a ``"prompt"`` key; its other keys become the
prompt's metadata, which rewards read (e.g. ``{"prompt": "...", "image": "first_frame.png"}`` for
image-to-video, or a ground-truth label). A bare name refers to a file bundled in
``flowrl/data/prompts`` (e.g. ``general.txt``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..data.files import read_utf8
from ..errors import FlowRLError

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "prompts"


def resolve_prompt_file(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if (BUNDLED / spec).is_file():
        return BUNDLED / spec
    bundled = ", ".join(sorted(p.name for p in BUNDLED.glob("*"))) if BUNDLED.is_dir() else "none"
    raise FlowRLError(f"prompt file '{spec}' does not exist (bundled prompt files: {bundled}).")


def read_prompt_file(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """Return the (prompt, metadata) pairs of a .txt or .jsonl prompt file, in file order."""
    path = resolve_prompt_file(spec)
    pairs: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(read_utf8(path, f"prompt file '{path}'").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if path.suffix != ".jsonl":
            pairs.append((line.strip(), {}))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise FlowRLError(f"prompt file '{path}' line {number} is not valid JSON ({e.msg}).") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise FlowRLError(f"prompt file '{path}' line {number} needs a string \"prompt\" key.")
        if isinstance(record.get("image"), str) and not Path(record["image"]).is_absolute():
            record["image"] = str(path.parent / record["image"])  # image paths are relative to the file
        pairs.append((record.pop("prompt"), record))
    if not pairs:
        raise FlowRLError(f"prompt file '{path}' holds no prompts.")
    return pairs
