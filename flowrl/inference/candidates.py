"""Generate and score one candidate per prompt, in batches: the step every search over start noises repeats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..samplers.rollout import padded_rows, rollout
from ..seeding import RowGenerators
from ..types import Pipeline, Sampler


@torch.no_grad()
def sample_and_score(
    pipeline: Pipeline,
    sampler: Sampler,
    reward,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    noise: Tensor,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float,
    batch_size: int,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Sample prompt i from start noise ``noise[i]``, ``batch_size`` prompts at a time, and score it. Every
    batch has exactly ``batch_size`` rows (the last padded with copies of its last item, dropped unscored), so
    a sample's bits do not depend on how many items are searched beside it.

    Returns the decoded samples (P, *S) on the CPU, their rewards (P,) float32 (NaN where the reward
    failed) and the reward's components (name -> (P,))."""
    samples, scores, extras = [], [], []
    for start in range(0, len(prompts), batch_size):
        idx = list(range(start, min(start + batch_size, len(prompts))))
        rows, streams = padded_rows(idx, batch_size, generator)
        traj = rollout(
            pipeline,
            sampler,
            [prompts[i] for i in rows],
            [metadata[i] for i in rows],
            torch.tensor(rows),
            sigmas,
            streams,
            guidance_scale,
            initial_noise=noise[rows],
            same_noise_in_group=False,
        )
        kept = traj.samples[: len(idx)]
        out = reward(kept, traj.prompts[: len(idx)], traj.metadata[: len(idx)])
        samples.append(kept.cpu())
        scores.append(out.scores.float().cpu())
        extras.append({k: v.float().cpu() for k, v in out.extras.items()})
    return torch.cat(samples), torch.cat(scores), {k: torch.cat([e[k] for e in extras]) for k in extras[0]}
