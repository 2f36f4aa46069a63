"""SVDD-PM (Li et al. 2024, soft value-based decoding; docs/math.md section 7): per-step Best-of-M with a look-ahead.

At every denoising step but the last each sample draws M candidates x_{k+1} from the pre-trained (stochastic)
transition, scores each by the reward of its Tweedie estimate x0_hat(x_{k+1}), and keeps the best. No
training; the cost is about M times a plain rollout. x0_hat is the sampler's deterministic step to
sigma = 0 (for flows x - sigma v, for DDIM the predicted x0), so one code path serves every model
family. The model output computed for the chosen candidate's look-ahead is reused for its next step, so a step
costs M model calls, not M + 1.

The last step (``last_step``), where sigma_{k+1} = 0 and a look-ahead would be the candidate itself:

* ``plain`` (the default): one plain step, as the authors' released code takes it (github.com/masa-ue/SVDD-image at
  920d3b6, ``sd_pipeline.py``: ``Decoding_SDPipeline`` draws the M candidates and keeps the first of each item, lines
  948-950, "If we are in the last step"; ``Decoding_nonbatch_SDPipeline`` draws one, lines 603-611). flowrl keeps the
  first of the M candidates drawn, which with per-item streams is the item's next draw, i.e. exactly one plain step.
  The returned samples are then scored once by the verifier to report their reward (counted: P rows, as a plain
  evaluation's);
* ``best_of_m``: the M final candidates are scored by the verifier itself and the best is kept: an extra
  best-of-M at the end that the release does not do (flowrl's SVDD before issue #41).

Counted per item: denoiser rows 1 + M (K - 1) either way; verifier rows M (K - 1) + 1 (plain) or M K (best_of_m).
With M = 1 nothing is selected and the result is exactly a plain stochastic rollout with the same
generator, under either last step (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..samplers.rollout import rows_of, start_noise
from ..seeding import RowGenerators
from ..types import Condition, index_condition
from .batching import STEPS, in_batches, joined
from .search import ImageSearchModel, Items, SearchOutcome


@dataclass
class SVDDResult:
    samples: Tensor  # (P, *S) decoded final samples
    scores: Tensor  # (P,) their rewards
    step_scores: Tensor = joined(STEPS)  # (K, P, M) every candidate's look-ahead reward at every step
    components: dict[str, Tensor] = field(default_factory=dict)  # reward component -> (P,) its value for the final samples


def _repeat(cond: Condition, m: int) -> Condition:
    """Each row of the condition m times in a row (candidate-major within a sample)."""
    return index_condition(cond, torch.arange(next(iter(cond.values())).shape[0]).repeat_interleave(m)) if cond else cond


@torch.no_grad()
def svdd_sample(
    model: ImageSearchModel,
    reward,
    items: Items,
    m: int,
    generator: torch.Generator | RowGenerators,
    initial_noise: Tensor | None = None,
    last_step: str = "plain",
) -> SVDDResult:
    """Sample one result per item with SVDD-PM using ``m`` candidates per step from ``model.sampler`` (batch = items x m);
    ``last_step``: ``plain`` (the release: the first candidate) or ``best_of_m`` (the best final candidate)."""
    model.require_stochastic("SVDD draws candidates from", m)
    if last_step not in ("plain", "best_of_m"):
        raise ValueError(f"last_step must be plain or best_of_m, got {last_step!r}")
    pipeline, sampler, sigmas, p = model.pipeline, model.sampler, model.sigmas, len(items)
    x, cond = model.start(items, generator, initial_noise), model.encode(items)
    cond_m = _repeat(cond, m)
    prompts_m = [q for q in items.prompts for _ in range(m)]
    metadata_m = [d for d in items.metadata for _ in range(m)]
    output = pipeline.predict(x, sigmas[0], cond, model.guidance_scale)
    step_scores, first = [], torch.arange(p) * m
    for k in range(sigmas.shape[0] - 1):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        rows = torch.arange(p).repeat_interleave(m)
        # with per-item streams, item i's M candidates draw in turn from item i's stream
        candidates = sampler.step(output[rows], x[rows], sigma, sigma_next, generator=rows_of(generator, rows)).x_next  # (P*M, *S)
        if k == sigmas.shape[0] - 2 and last_step == "plain":  # the released last step: no choice, the first candidate
            samples = pipeline.decode(candidates[first])
            out = reward(samples, list(items.prompts), list(items.metadata))  # the returned samples' reward, reported
            components = {key: v.float().cpu() for key, v in out.extras.items()}
            return SVDDResult(samples=samples, scores=out.scores.float(), step_scores=_stacked(step_scores, p, m), components=components)
        if float(sigma_next) > 0:
            look = pipeline.predict(candidates, sigma_next, cond_m, model.guidance_scale)
            x0_hat = sampler.deterministic_step(look, candidates, sigma_next, torch.zeros_like(sigma_next))
        else:
            look, x0_hat = None, candidates
        out = reward(pipeline.decode(x0_hat), prompts_m, metadata_m)
        scores = out.scores.float().view(p, m)
        step_scores.append(scores)
        best = torch.where(torch.isfinite(scores), scores, float("-inf")).argmax(1)  # (P,) ties: the first candidate
        chosen = first + best
        x = candidates[chosen]
        if look is not None:
            output = look[chosen]
    final = torch.stack(step_scores)[-1].gather(1, best[:, None]).squeeze(1)
    components = {k: v.float().cpu()[chosen] for k, v in out.extras.items()}  # the last step scored the final samples themselves
    return SVDDResult(samples=pipeline.decode(x), scores=final, step_scores=torch.stack(step_scores), components=components)


def _stacked(step_scores: list[Tensor], p: int, m: int) -> Tensor:
    """(steps, P, M) the candidates' look-ahead rewards (no step: an empty (0, P, M))."""
    return torch.stack(step_scores) if step_scores else torch.zeros(0, p, m)


def svdd_in_batches(
    model: ImageSearchModel, reward, items: Items, m: int, generator: torch.Generator | RowGenerators, last_step: str = "plain"
) -> SVDDResult:
    """:func:`svdd_sample` over many items, ``model.batch_size // m`` items (x ``m`` candidates) at a time, item i
    starting from the plain evaluation's start noise (the first draw of its stream)."""
    noise = start_noise(model.pipeline, len(items), generator)
    return in_batches(
        len(items),
        model.batch_size // m,
        lambda rows: svdd_sample(model, reward, items.take(rows), m, rows_of(generator, rows), noise[rows], last_step),
    )


def svdd_search(section, model: ImageSearchModel, reward, items: Items) -> SearchOutcome:
    """``flowrl eval --svdd M`` on an image / video model: the reward of the samples SVDD chose."""
    m = section.m
    result = svdd_in_batches(model, reward, items, m, items.streams, section.last_step)
    finite = result.scores[torch.isfinite(result.scores)]
    metrics = {
        f"eval/reward/mean@svdd{m}": float(finite.mean()),
        **{f"eval/reward/{k}@svdd{m}": float(v.nanmean()) for k, v in result.components.items()},
    }
    return SearchOutcome(metrics=metrics, settings={"svdd_last_step": section.last_step}, samples=result.samples)
