"""CLIP score: how well an image matches its prompt, as the cosine of CLIP image and text embeddings.

Default model ``openai/clip-vit-large-patch14`` (the ViT-L/14 torchmetrics' CLIPScore and Flow-GRPO's
clip scorer use). Reported score: the raw cosine similarity, in [-1, 1] (about 0.15-0.35 for real
image / caption pairs with ViT-L/14).

Conventions from the literature, available as options:

* ``scale=2.5, clip_negative=True``: CLIP-S of Hessel et al. 2021 ("CLIPScore", w = 2.5 * max(cos, 0)).
* ``scale=100, clip_negative=True``: torchmetrics' ``CLIPScore`` (100 * max(cos, 0)).

The raw cosine is always logged as ``extras["cosine"]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from flowrl.reward_models.clip_common import ClipBackedReward
from flowrl.types import RewardOutput

DEFAULT_MODEL = "openai/clip-vit-large-patch14"


@dataclass(eq=False, repr=False)
class ClipScoreReward(ClipBackedReward):
    """``scale * cos(image, prompt)`` (``scale * max(cos, 0)`` with ``clip_negative``).

    Args:
        scale: factor on the cosine similarity.
        clip_negative: score max(cos, 0): a negative similarity counts as 0.
    """

    name = "clip_score"

    pretrained: str = DEFAULT_MODEL
    scale: float = 1.0
    clip_negative: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.scale, self.clip_negative = float(self.scale), bool(self.clip_negative)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        img, txt = self.embed(samples, prompts)
        cosine = (img * txt).sum(dim=-1)
        score = cosine.clamp(min=0.0) if self.clip_negative else cosine
        scores = (self.scale * score).float().to(samples.device)
        return RewardOutput(scores=scores, extras={"cosine": cosine.detach().float().to(samples.device)})
