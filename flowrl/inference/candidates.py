"""Generate and score one candidate per item, in batches: the step every search over start noises repeats."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..samplers.rollout import padded_samples
from ..seeding import RowGenerators
from .batching import in_batches
from .search import ImageSearchModel, Items


@dataclass
class Scored:
    samples: Tensor  # (P, *S) decoded, on the CPU
    scores: Tensor  # (P,) float32 rewards, NaN where the reward failed
    extras: dict[str, Tensor]  # reward component -> (P,)


@torch.no_grad()
def sample_and_score(model: ImageSearchModel, reward, items: Items, noise: Tensor, generator: torch.Generator | RowGenerators) -> Scored:
    """Sample item i from start noise ``noise[i]`` with ``model.sampler``, ``model.batch_size`` items at a time, and
    score it. Every batch has exactly ``batch_size`` rows (the last padded with copies of its last item, dropped
    unscored), so a sample's bits do not depend on how many items are searched beside it."""

    def batch(idx: list[int]) -> Scored:
        kept = padded_samples(
            model.pipeline, model.sampler, items.prompts, items.metadata, idx, model.batch_size, model.sigmas, generator,
            model.guidance_scale, noise,
        )  # fmt: skip
        out = reward(kept, [items.prompts[i] for i in idx], [items.metadata[i] for i in idx])
        return Scored(kept.cpu(), out.scores.float().cpu(), {k: v.float().cpu() for k, v in out.extras.items()})

    return in_batches(len(items), model.batch_size, batch)
