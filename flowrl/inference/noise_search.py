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
from dataclasses import dataclass

import torch
from torch import Tensor

from ..samplers.rollout import start_noise
from ..seeding import RowGenerators
from .candidates import sample_and_score
from .search import ImageSearchModel, Items, SearchOutcome


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
    model: ImageSearchModel,
    reward,
    items: Items,
    rounds: int,
    neighbors: int,
    step: float,
    generator: torch.Generator | RowGenerators,
    initial_noise: Tensor | None = None,
) -> NoiseSearchResult:
    """Search the start noise of each item's sample with ``rounds`` x ``neighbors`` evaluations (see the module docstring)."""
    if rounds < 0 or neighbors < 1 or not 0 < step <= 1:
        raise ValueError(f"need rounds >= 0, neighbors >= 1 and 0 < step <= 1, got {rounds}, {neighbors}, {step}")

    def evaluate(noise: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        got = sample_and_score(model, reward, items, noise, generator)
        return got.samples, torch.where(torch.isfinite(got.scores), got.scores, torch.tensor(float("-inf"))), got.extras

    pivot = (initial_noise if initial_noise is not None else start_noise(model.pipeline, len(items), generator)).float()
    best_samples, best_scores, components = evaluate(pivot)
    history = [best_scores.clone()]
    for _ in range(rounds):
        candidates = _neighbors(pivot, neighbors, step, generator)
        new_pivot = pivot.clone()
        for cand in candidates:  # each candidate set is one noise per item
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


def noise_search(section, model: ImageSearchModel, reward, items: Items) -> SearchOutcome:
    """``flowrl eval --noise-search ROUNDS`` on an image / video model (ODE samples, as best-of-N: the plain
    evaluation's start noise is round 0's pivot): the reward after every round."""
    rounds, neighbors, step = section.rounds, section.neighbors, float(section.step)
    result = zero_order_search(model, reward, items, rounds, neighbors, step, items.streams)
    tag = f"noise{rounds}x{neighbors}"
    history = [float(h[torch.isfinite(h)].mean()) for h in result.history]
    lines = [f"zero-order noise search on {len(items)} held-out items, {neighbors} neighbours at step {step:g} per round:"]
    lines += [f"  round {r:3d}   {1 + r * neighbors:4d} samples per item   eval reward {v:.4f}" for r, v in enumerate(history)]
    metrics = {
        f"eval/reward/mean@{tag}": history[-1],
        **{f"eval/reward/{k}@{tag}": float(v.nanmean()) for k, v in result.components.items()},
        **{f"eval/{tag}/reward_after_round{r}": v for r, v in enumerate(history)},
        f"eval/{tag}/samples_per_item": float(result.evaluations),
    }
    settings = {"noise_search": {"rounds": rounds, "neighbors": neighbors, "step": step}}
    return SearchOutcome(metrics=metrics, lines=lines, settings=settings, samples=result.samples)
