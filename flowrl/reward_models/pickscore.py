"""PickScore v1 (Kirstain et al. 2023, "Pick-a-Pic"): a CLIP ViT-H/14 fine-tuned on human preferences.

Model ``yuvalkirstain/PickScore_v1`` (a transformers ``CLIPModel``), processor
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (224 px, OpenAI CLIP mean / std), both as in the PickScore
README. Score, as the README computes it: ``model.logit_scale.exp() * cos(image, prompt)``; with the
released weights ``logit_scale.exp()`` is about 100 and scores sit around 18-24.

``normalize=True`` divides by 26, as Flow-GRPO's ``pickscore_scorer`` does, to put the reward near
[0, 1] for training; the unnormalised value is always logged as ``extras["raw"]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from flowrl.reward_models.clip_common import ClipBackedReward
from flowrl.types import RewardOutput

DEFAULT_MODEL = "yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
FLOW_GRPO_DIVISOR = 26.0


@dataclass(eq=False, repr=False)
class PickScoreReward(ClipBackedReward):
    """PickScore of each image for its prompt (``/ 26`` with ``normalize``).

    Args:
        normalize: divide by 26 (Flow-GRPO's pickscore_scorer), putting the reward near 0.8-0.9.
    """

    name = "pickscore"

    pretrained: str = DEFAULT_MODEL
    processor: str = DEFAULT_PROCESSOR
    normalize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.normalize = bool(self.normalize)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        img, txt = self.embed(samples, prompts)
        model = self.model_on(samples.device)
        raw = model.logit_scale.detach().float().exp() * (img * txt).sum(dim=-1)
        scores = raw / FLOW_GRPO_DIVISOR if self.normalize else raw
        return RewardOutput(scores=scores.float().to(samples.device), extras={"raw": raw.detach().float().to(samples.device)})
