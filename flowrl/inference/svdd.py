"""SVDD-PM (Li et al. 2024, soft value-based decoding; docs/math.md section 7): per-step Best-of-M with a look-ahead.

At every denoising step each sample draws M candidates x_{k+1} from the pre-trained (stochastic)
transition, scores each by the reward of its Tweedie estimate x0_hat(x_{k+1}), and keeps the best. No
training; the cost is about M times a plain rollout. x0_hat is the sampler's deterministic step to
sigma = 0 (for flows x - sigma v, for DDIM the predicted x0), so one code path serves every model
family; at the last step sigma_{k+1} = 0 and the candidates are scored as they are. The model output
computed for the chosen candidate's look-ahead is reused for its next step, so a step costs M model
calls, not M + 1.

With M = 1 nothing is selected and the result is exactly a plain stochastic rollout with the same
generator (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.rollout import rows_of, start_noise
from ..seeding import RowGenerators
from ..types import Condition, Pipeline, Sampler, index_condition


@dataclass
class SVDDResult:
    samples: Tensor  # (P, *S) decoded final samples
    scores: Tensor  # (P,) their rewards
    step_scores: Tensor  # (K, P, M) every candidate's look-ahead reward at every step
    components: dict[str, Tensor]  # reward component -> (P,) its value for the final samples


def _repeat(cond: Condition, m: int) -> Condition:
    """Each row of the condition m times in a row (candidate-major within a sample)."""
    return index_condition(cond, torch.arange(next(iter(cond.values())).shape[0]).repeat_interleave(m)) if cond else cond


@torch.no_grad()
def svdd_sample(
    pipeline: Pipeline,
    sampler: Sampler,
    reward,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    m: int,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float = 1.0,
    initial_noise: Tensor | None = None,
) -> SVDDResult:
    """Sample one result per prompt with SVDD-PM using ``m`` candidates per step (batch = all prompts x m)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if not sampler.stochastic:
        raise FlowRLError(f"SVDD draws candidates from a stochastic transition; sampler '{sampler.name}' is deterministic.")
    p = len(prompts)
    # image-to-video adapters condition on metadata too (the first frame), as in rollout
    cond = pipeline.encode(list(prompts), list(metadata)) if getattr(pipeline, "needs_metadata", False) else pipeline.encode(list(prompts))
    cond_m = _repeat(cond, m)
    prompts_m = [q for q in prompts for _ in range(m)]
    metadata_m = [d for d in metadata for _ in range(m)]
    x = (initial_noise if initial_noise is not None else start_noise(pipeline, p, generator)).float()
    output = pipeline.predict(x, sigmas[0], cond, guidance_scale)
    step_scores = []
    for k in range(sigmas.shape[0] - 1):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        rows = torch.arange(p).repeat_interleave(m)
        # with per-item streams, item i's M candidates draw in turn from item i's stream
        candidates = sampler.step(output[rows], x[rows], sigma, sigma_next, generator=rows_of(generator, rows)).x_next  # (P*M, *S)
        if float(sigma_next) > 0:
            look = pipeline.predict(candidates, sigma_next, cond_m, guidance_scale)
            x0_hat = sampler.deterministic_step(look, candidates, sigma_next, torch.zeros_like(sigma_next))
        else:
            look, x0_hat = None, candidates
        out = reward(pipeline.decode(x0_hat), prompts_m, metadata_m)
        scores = out.scores.float().view(p, m)
        step_scores.append(scores)
        best = torch.where(torch.isfinite(scores), scores, float("-inf")).argmax(1)  # (P,) ties: the first candidate
        chosen = torch.arange(p) * m + best
        x = candidates[chosen]
        if look is not None:
            output = look[chosen]
    final = torch.stack(step_scores)[-1].gather(1, best[:, None]).squeeze(1)
    components = {k: v.float().cpu()[chosen] for k, v in out.extras.items()}  # the last step scored the final samples themselves
    return SVDDResult(samples=pipeline.decode(x), scores=final, step_scores=torch.stack(step_scores), components=components)


def svdd_in_batches(
    pipeline: Pipeline,
    sampler: Sampler,
    reward,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    m: int,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float,
    batch_size: int,
    initial_noise: Tensor,
) -> SVDDResult:
    """:func:`svdd_sample` over many prompts, ``batch_size // m`` prompts (x ``m`` candidates) at a time,
    prompt i starting from ``initial_noise[i]``."""
    chunk = max(1, batch_size // m)
    parts = [
        svdd_sample(
            pipeline,
            sampler,
            reward,
            prompts[i : i + chunk],
            metadata[i : i + chunk],
            m,
            sigmas,
            rows_of(generator, slice(i, i + chunk)),
            guidance_scale,
            initial_noise=initial_noise[i : i + chunk],
        )
        for i in range(0, len(prompts), chunk)
    ]
    return SVDDResult(
        samples=torch.cat([r.samples for r in parts]),
        scores=torch.cat([r.scores for r in parts]),
        step_scores=torch.cat([r.step_scores for r in parts], 1),
        components={k: torch.cat([r.components[k] for r in parts]) for k in parts[0].components},
    )
