"""The models shipped with flowrl, by name, and the family that loads each: read from the families' own declarations
(an embedded adapter's ``embedded`` names, aMUSEd's and the diffusion LMs' shipped names), so a list shown to a user
never goes stale when a model is added."""

from __future__ import annotations

from .amused import EMBEDDED as AMUSED_EMBEDDED
from .digits import DigitsPipeline
from .digits_video import DigitsVideoPipeline

EMBEDDED_IMAGE_FAMILIES: dict[str, str] = {
    **dict.fromkeys(DigitsPipeline.embedded, "digits"),
    **dict.fromkeys(DigitsVideoPipeline.embedded, "digits_video"),
    **dict.fromkeys(AMUSED_EMBEDDED, "amused"),
}
