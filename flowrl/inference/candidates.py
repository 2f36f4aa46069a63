"""Generate and score one candidate per item, in batches: the step every search over start noises repeats."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..samplers.rollout import padded_rows, rollout
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
        rows, streams = padded_rows(idx, model.batch_size, generator)
        traj = rollout(
            model.pipeline,
            model.sampler,
            [items.prompts[i] for i in rows],
            [items.metadata[i] for i in rows],
            torch.tensor(rows),
            model.sigmas,
            streams,
            model.guidance_scale,
            initial_noise=noise[rows],
            same_noise_in_group=False,
        )
        kept = traj.samples[: len(idx)]
        out = reward(kept, traj.prompts[: len(idx)], traj.metadata[: len(idx)])
        return Scored(kept.cpu(), out.scores.float().cpu(), {k: v.float().cpu() for k, v in out.extras.items()})

    return in_batches(len(items), model.batch_size, batch)
