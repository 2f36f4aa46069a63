"""The models shipped with flowrl, by name, and the family that loads each: read from the families' own declarations
(an embedded adapter's ``embedded`` names, aMUSEd's and the diffusion LMs' shipped names), so a list shown to a user
never goes stale when a model is added."""

from __future__ import annotations

from functools import cache

from .amused import EMBEDDED as AMUSED_EMBEDDED
from .digits import DigitsPipeline
from .digits_video import DigitsVideoPipeline
from .dllm import EMBEDDED_LMS

EMBEDDED_IMAGE_FAMILIES: dict[str, str] = {
    **dict.fromkeys(DigitsPipeline.embedded, "digits"),
    **dict.fromkeys(DigitsVideoPipeline.embedded, "digits_video"),
    **dict.fromkeys(AMUSED_EMBEDDED, "amused"),
}


@cache
def embedded_lm_presets() -> dict[str, str]:
    """Each shipped diffusion LM and the first preset that trains it (``flowrl sample NAME`` samples as it does)."""
    import yaml

    from ..presets import PRESET_DIR, preset_names

    found: dict[str, str] = {}
    for name in preset_names():
        pipeline = (yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text()) or {}).get("pipeline") or {}
        if pipeline.get("pretrained") in EMBEDDED_LMS:
            found.setdefault(pipeline["pretrained"], name)
    return found


def embedded_names() -> list[str]:
    """Every shipped generator's name (the digit classifier, a reward model, aside)."""
    return [*EMBEDDED_IMAGE_FAMILIES, *EMBEDDED_LMS]
