"""The exported model's card against the evaluation: what the card tells whoever serves the model is what was measured.

``flowrl export`` writes ``README.md`` from the checkpoint's ``config.yaml`` (flowrl/model_card.py); its line
"Sampling, as evaluated" (diffusion LMs: "Generation, as evaluated") states the sampler, steps, guidance and the size
and shift the config sets. The check writes that card for the checkpoint it saved, reads the line back, and compares
each stated value with what the evaluation actually ran (the recorded calls, the samples' shape, the model's
schedule).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .parity import EVALUATION, Difference

CARD = "model card"
LINE = re.compile(r"^- \*\*(?:Sampling|Generation), as evaluated:\*\* (.*)$", re.MULTILINE)
VALUE = re.compile(r"`([^`=]+)(?:=([^`]*))?`")
NAMES = {
    "num_inference_steps": "steps",
    "guidance_scale": "guidance scale",
    "guidance_mode": "guidance mode",
    "negative_prompt": "negative prompt",
}


def write_card(checkpoint: Path, directory: Path) -> str:
    """The card ``flowrl export`` writes for ``checkpoint`` (from its own config.yaml), as text."""
    from ..config import load_config
    from ..model_card import write_model_card

    config = load_config(checkpoint / "config.yaml")
    directory.mkdir(parents=True, exist_ok=True)
    kind = "lora" if getattr(config.pipeline, "lora", None) is not None else "full"
    return write_model_card(directory, checkpoint, config, kind).read_text()


def stated(card: str) -> dict[str, Any] | None:
    """The settings the card's "as evaluated" line states (None: the card has no such line)."""
    match = LINE.search(card)
    if match is None:
        return None
    values: dict[str, Any] = {}
    for key, value in VALUE.findall(match.group(1)):
        if value == "" and "sampler" not in values:
            values["sampler"] = key
        else:
            values[NAMES.get(key, key)] = _parse(value)
    return values


def compare_card(card: dict[str, Any] | None, evaluated: dict[str, Any], measured: dict[str, Any]) -> list[Difference]:
    """The card's stated values against the evaluation's row (``evaluated``) and what it measured beside it
    (``measured``: the sample height / width / frames, the schedule's shift, the sampler's name)."""
    if card is None:
        return [Difference("sampling settings", CARD, "not stated", EVALUATION, "stated", None)]
    found = []
    for key, value in card.items():
        expected = measured.get(key, evaluated.get(key))
        if key not in measured and key not in evaluated:
            continue  # stated for the reader (a diffusion LM's block layout), nothing measured to hold it against
        if key == "negative prompt" and str(expected).startswith(("none", "a condition")):
            continue  # never encoded (no guidance), or encoded with the source images where its text is not recorded
        if not _same(value, expected):
            found.append(Difference(key, CARD, value, EVALUATION, expected, None))
    return found


def _parse(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(text, text)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
    return a == b
