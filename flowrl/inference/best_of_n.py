"""Best-of-N (docs/math.md section 7): N candidates per prompt, scored by a verifier, keep the argmax.

Any reward or reward mix is the verifier. The N candidates of a prompt differ only in their initial
noise: N successive draws of P noises from the generator, so candidate 0 gets exactly the noise a plain
evaluation with the same generator draws, and best-of-1 *is* the plain evaluation (tested).
The scaling curve uses nested subsets (the first k candidates), so it rises monotonically by
construction and its points are comparable: the best of 4 is chosen among the same 4 samples that the
best of 2 saw 2 of.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..samplers.rollout import rows_of, start_noise
from ..seeding import RowGenerators
from ..types import Pipeline, Sampler
from .candidates import sample_and_score


@dataclass
class BestOfN:
    samples: Tensor  # (P, *S): the chosen candidate of each prompt, decoded
    scores: Tensor  # (P, N): every candidate's reward; NaN where the reward failed
    best: Tensor  # (P,): the chosen candidate's index (0 where no candidate has a finite reward)
    components: dict[str, Tensor]  # reward component -> (P,) its value for the chosen candidate
    draws: Tensor | None = None  # (P,): candidates sampled and scored per prompt (< N where stop_at stopped it)

    def scaling_curve(self) -> dict[int, float]:
        """Mean over prompts of the best reward among the first k candidates, for k = 1, 2, 4, ..., N."""
        n = self.scores.shape[1]
        ks = sorted({2**i for i in range(int(math.log2(n)) + 1)} | {n})
        finite = torch.where(torch.isfinite(self.scores), self.scores, float("-inf"))
        curve = {}
        for k in ks:
            best = finite[:, :k].max(1).values
            curve[k] = float(best[torch.isfinite(best)].mean()) if torch.isfinite(best).any() else float("nan")
        return curve


def _better(score: Tensor, current: Tensor) -> Tensor:
    """A finite score beats a non-finite one and any smaller score; a tie keeps the earlier candidate."""
    return torch.isfinite(score) & (~torch.isfinite(current) | (score > current))


@torch.no_grad()
def best_of_n(
    pipeline: Pipeline,
    sampler: Sampler,
    reward,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    n: int,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float = 1.0,
    batch_size: int = 16,
    stop_at: float | None = None,
) -> BestOfN:
    """Sample ``n`` candidates for each prompt with ``sampler``, score them with ``reward``, keep the best.

    Candidates are generated and scored ``batch_size`` at a time, one round of P noises at a time, and
    only the best so far is kept, so memory does not grow with ``n``. ``stop_at``: a prompt whose best reward
    reaches it draws no further candidate (their scores stay NaN; ``draws`` counts what each prompt cost). With
    per-prompt streams (``RowGenerators``) a prompt's candidates are the same whichever others stopped.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    p = len(prompts)
    scores = torch.full((p, n), float("nan"))
    best = torch.zeros(p, dtype=torch.long)
    draws = torch.zeros(p, dtype=torch.long)
    for j in range(n):  # candidate j of every prompt still searching: its j-th noise
        active = torch.arange(p)
        if stop_at is not None and j > 0:
            current = scores.gather(1, best[:, None]).squeeze(1)
            active = torch.nonzero(~(torch.isfinite(current) & (current >= stop_at))).squeeze(1)
            if len(active) == 0:
                break
        rows = active.tolist()
        streams = rows_of(generator, rows)
        samples, scores[active, j], extras = sample_and_score(
            pipeline,
            sampler,
            reward,
            [prompts[i] for i in rows],
            [metadata[i] for i in rows],
            start_noise(pipeline, len(rows), streams),
            sigmas,
            streams,
            guidance_scale,
            batch_size,
        )
        draws[active] += 1
        if j == 0:
            chosen, components = samples, extras
            continue
        better = _better(scores[active, j], scores[active].gather(1, best[active, None]).squeeze(1))
        won = active[better]
        chosen[won], best[won] = samples[better], j
        for key, v in extras.items():
            components[key][won] = v[better]
    bad = int((~torch.isfinite(scores)).sum() - (n * p - int(draws.sum())))
    if bad:
        warnings.warn(f"{bad} of {int(draws.sum())} candidates got a NaN or infinite reward; they are never chosen.", stacklevel=2)
    return BestOfN(samples=chosen, scores=scores, best=best, components=components, draws=draws)
