"""A judge for the digits models that shares nothing with their training rewards: closeness to real digits.

``digit_realism`` = 1 - the RMS pixel distance (pixels in [0, 1]) from a sample to the nearest of
scikit-learn's 1797 real 8x8 digits of the prompted digit (of any digit when a prompt names none). It uses
no learned weights, so it cannot be fooled the way the digit classifier is, and it is not the ink
statistic: a bolder stroke on a black background stays close to some real digit, an inverted digit (white
background) is far from all of them, and so is a blob. The digits presets log it as ``eval.judge``, on the
held-out samples only; no objective ever sees it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.types import RewardOutput


class DigitRealismReward:
    """1 - the RMS pixel distance from each sample to the nearest real 8x8 digit of the prompted digit (a held-out
    judge; see the module docstring)."""

    name = "digit_realism"
    differentiable = False

    def __init__(self) -> None:
        from flowrl.data.digits import load_digit_images

        images, labels = load_digit_images()
        self.real = ((images + 1) / 2).flatten(1).double()  # (N, 64) in [0, 1]
        self.labels = labels

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        x = samples.detach().double().cpu().flatten(1)
        dist = torch.cdist(x, self.real) / self.real.shape[1] ** 0.5  # RMS distance to every real digit
        wanted = torch.tensor([int(m["digit"]) if m.get("digit") is not None else -1 for m in metadata])
        other = (self.labels[None, :] != wanted[:, None]) & (wanted[:, None] >= 0)
        nearest = dist.masked_fill(other, float("inf")).min(1).values
        return RewardOutput(scores=(1 - nearest).float())
