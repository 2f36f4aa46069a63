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
from dataclasses import dataclass

import torch
from torch import Tensor

from ..samplers.rollout import rows_of, start_noise
from ..seeding import RowGenerators
from .candidates import sample_and_score
from .search import ImageSearchModel, Items, SearchOutcome


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
    model: ImageSearchModel, reward, items: Items, n: int, generator: torch.Generator | RowGenerators, stop_at: float | None = None
) -> BestOfN:
    """Sample ``n`` candidates for each item with ``model.sampler``, score them with ``reward``, keep the best.

    Candidates are generated and scored ``model.batch_size`` at a time, one round of P noises at a time, and only the
    best so far is kept, so memory does not grow with ``n``. ``stop_at``: an item whose best reward reaches it draws no
    further candidate (their scores stay NaN; ``draws`` counts what each item cost). With per-item streams
    (``RowGenerators``) an item's candidates are the same whichever others stopped.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    p = len(items)
    scores = torch.full((p, n), float("nan"))
    best = torch.zeros(p, dtype=torch.long)
    draws = torch.zeros(p, dtype=torch.long)
    for j in range(n):  # candidate j of every item still searching: its j-th noise
        active = torch.arange(p)
        if stop_at is not None and j > 0:
            current = scores.gather(1, best[:, None]).squeeze(1)
            active = torch.nonzero(~(torch.isfinite(current) & (current >= stop_at))).squeeze(1)
            if len(active) == 0:
                break
        rows = active.tolist()
        streams = rows_of(generator, rows)
        got = sample_and_score(model, reward, items.take(rows), start_noise(model.pipeline, len(rows), streams), streams)
        scores[active, j] = got.scores
        draws[active] += 1
        if j == 0:
            chosen, components = got.samples, got.extras
            continue
        better = _better(scores[active, j], scores[active].gather(1, best[active, None]).squeeze(1))
        won = active[better]
        chosen[won], best[won] = got.samples[better], j
        for key, v in got.extras.items():
            components[key][won] = v[better]
    bad = int((~torch.isfinite(scores)).sum() - (n * p - int(draws.sum())))
    if bad:
        warnings.warn(f"{bad} of {int(draws.sum())} candidates got a NaN or infinite reward; they are never chosen.", stacklevel=2)
    return BestOfN(samples=chosen, scores=scores, best=best, components=components, draws=draws)


def best_of_search(section, model: ImageSearchModel, reward, items: Items) -> SearchOutcome:
    """``flowrl eval --best-of N [--stop-at R]`` on an image / video model: the reward at N = 1, 2, 4, ..., the
    candidates drawn (fewer than N where an item stopped) and the chosen samples."""
    n, stop_at = section.n, section.stop_at
    result = best_of_n(model, reward, items, n, items.streams, stop_at=stop_at)
    curve = result.scaling_curve()
    lines = [f"best-of-N on {len(result.best)} held-out items ({items.per_prompt} per prompt):"]
    lines += [f"  N = {k:4d}   eval reward {v:.4f}" for k, v in curve.items()]
    steps = model.sigmas.numel() - 1
    draws = float(result.draws.double().mean())
    if stop_at is not None:
        lines.append(
            f"  stopping at reward {stop_at:g}: {draws:.2f} candidates drawn per item ({draws * steps:.1f} denoiser rows, {draws:.2f} reward calls)"
        )
    metrics = {
        **{f"eval/reward/mean@{k}": v for k, v in curve.items()},
        **{f"eval/reward/{k}@{n}": float(v[torch.isfinite(v)].mean()) for k, v in result.components.items()},
        # counted cost per item: candidates drawn (= reward calls), and denoiser rows (steps per candidate, no padding)
        f"eval/best_of{n}/draws_per_item": draws,
        f"eval/best_of{n}/denoiser_rows_per_item": draws * steps,
    }
    return SearchOutcome(metrics=metrics, lines=lines, samples=result.samples)
