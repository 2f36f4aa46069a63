"""Generate and score one candidate per prompt, in batches: the step every search over start noises repeats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..samplers.rollout import rollout
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
    generator: torch.Generator,
    guidance_scale: float,
    batch_size: int,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Sample prompt i from start noise ``noise[i]``, ``batch_size`` prompts at a time, and score it.

    Returns the decoded samples (P, *S) on the CPU, their rewards (P,) float32 (NaN where the reward
    failed) and the reward's components (name -> (P,))."""
    samples, scores, extras = [], [], []
    for start in range(0, len(prompts), batch_size):
        idx = list(range(start, min(start + batch_size, len(prompts))))
        traj = rollout(
            pipeline,
            sampler,
            [prompts[i] for i in idx],
            [metadata[i] for i in idx],
            torch.tensor(idx),
            sigmas,
            generator,
            guidance_scale,
            initial_noise=noise[idx],
            same_noise_in_group=False,
        )
        out = reward(traj.samples, traj.prompts, traj.metadata)
        samples.append(traj.samples.cpu())
        scores.append(out.scores.float().cpu())
        extras.append({k: v.float().cpu() for k, v in out.extras.items()})
    return torch.cat(samples), torch.cat(scores), {k: torch.cat([e[k] for e in extras]) for k in extras[0]}
