"""Sample diversity per prompt: how different the samples of one prompt (different seeds) are.

A policy that over-optimises a reward often collapses the seeds of a prompt onto one image long before
the reward curve says anything, so every image run logs this at each evaluation (``eval/diversity``)."""

from __future__ import annotations

import torch


def seed_diversity(samples: torch.Tensor, per_prompt: int) -> float:
    """Mean pairwise L2 distance between the samples of each prompt, averaged over prompts.

    ``samples``: (prompts * per_prompt, ...) prompt-major (the held-out order: each prompt's seeds in a
    row); each sample is flattened, so images, videos and points alike. NaN when ``per_prompt`` < 2."""
    if per_prompt < 2 or len(samples) < per_prompt:
        return float("nan")
    n = len(samples) // per_prompt * per_prompt
    flat = samples[:n].detach().double().cpu().reshape(n // per_prompt, per_prompt, -1)
    dist = torch.cdist(flat, flat)  # (prompts, seeds, seeds)
    i, j = torch.triu_indices(per_prompt, per_prompt, offset=1)
    return float(dist[:, i, j].mean())
