"""Zero-order search over the initial noise (Ma et al. 2025, "Inference-time scaling for diffusion models
beyond scaling denoising steps"; docs/math.md section 7).

Random search over the start noise is Best-of-N (best_of_n.py). Zero-order search spends the same
budget locally: keep a pivot noise per item, draw ``neighbors`` candidates around it, move the pivot to
the best candidate if it beats the pivot, repeat for ``rounds``. A candidate around pivot e is

    e' = sqrt(1 - step^2) e + step d,   d ~ N(0, I)

which keeps e' ~ N(0, I) whenever e is (the sampler is only ever given noise of the distribution it was
trained on; a plain e + step d would inflate its norm round after round). With ``rounds = 1`` and
``step = 1`` every candidate is a fresh noise, and the search is exactly Best-of-(1 + neighbors) on the
same draws (tested); with ``rounds = 0`` only the start noise is sampled: the plain evaluation (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..samplers.rollout import start_noise
from ..seeding import RowGenerators
from ..types import Pipeline, Sampler
from .candidates import sample_and_score


@dataclass
class NoiseSearchResult:
    samples: Tensor  # (P, *S) the samples of the final pivots
    scores: Tensor  # (P,) their rewards
    history: Tensor  # (rounds + 1, P) the pivot's reward after each round (round 0: the start noise)
    evaluations: int  # samples generated and scored per item: 1 + rounds * neighbors
    components: dict[str, Tensor]  # reward component -> (P,) its value for the final pivots' samples


def _neighbors(pivot: Tensor, n: int, step: float, generator: torch.Generator | RowGenerators) -> Tensor:
    """(n, P, *S) candidates sqrt(1 - step^2) pivot + step d around every pivot (with per-item streams, item i's
    directions from item i's stream)."""
    if isinstance(generator, RowGenerators):
        d = torch.stack([generator.randn(tuple(pivot.shape)) for _ in range(n)]).to(pivot.device)
    else:
        d = torch.stack([torch.randn(pivot.shape, generator=generator) for _ in range(n)]).to(pivot.device)
    return math.sqrt(max(0.0, 1.0 - step**2)) * pivot + step * d


@torch.no_grad()
def zero_order_search(
    pipeline: Pipeline,
    sampler: Sampler,
    reward,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    rounds: int,
    neighbors: int,
    step: float,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float = 1.0,
    batch_size: int = 16,
    initial_noise: Tensor | None = None,
) -> NoiseSearchResult:
    """Search the start noise of each prompt's sample with ``rounds`` x ``neighbors`` evaluations (see the module docstring)."""
    if rounds < 0 or neighbors < 1 or not 0 < step <= 1:
        raise ValueError(f"need rounds >= 0, neighbors >= 1 and 0 < step <= 1, got {rounds}, {neighbors}, {step}")
    p = len(prompts)

    def evaluate(noise: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        samples, scores, extras = sample_and_score(
            pipeline, sampler, reward, prompts, metadata, noise, sigmas, generator, guidance_scale, batch_size
        )
        return samples, torch.where(torch.isfinite(scores), scores, torch.tensor(float("-inf"))), extras

    pivot = (initial_noise if initial_noise is not None else start_noise(pipeline, p, generator)).float()
    best_samples, best_scores, components = evaluate(pivot)
    history = [best_scores.clone()]
    for _ in range(rounds):
        candidates = _neighbors(pivot, neighbors, step, generator)
        new_pivot = pivot.clone()
        for cand in candidates:  # each candidate set is one noise per prompt
            samples, scores, extras = evaluate(cand)
            better = scores > best_scores
            best_scores = torch.where(better, scores, best_scores)
            best_samples[better] = samples[better]
            for key, v in extras.items():
                components[key][better] = v[better]
            new_pivot[better.to(pivot.device)] = cand[better.to(pivot.device)]
        pivot = new_pivot
        history.append(best_scores.clone())
    nan = torch.tensor(float("nan"))
    return NoiseSearchResult(
        samples=best_samples,
        scores=torch.where(torch.isfinite(best_scores), best_scores, nan),
        history=torch.stack(history),
        evaluations=1 + rounds * neighbors,
        components=components,
    )
