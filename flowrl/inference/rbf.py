"""Rollover budget forcing (RBF): a per-step particle search whose unspent budget rolls over to later steps.

After FlowRBF (Kim, Yoon, Hwang, Sung 2025, "Inference-time scaling for flow models via stochastic generation and
rollover budget forcing", arXiv 2503.19385; released code github.com/KAIST-Visual-AI-Group/Flow-Inference-Time-Scaling,
``rbf/rbf.py``, read for this). The flow ODE is replaced by an SDE with the same marginals (the run's stochastic
rollout sampler, e.g. the Flow-GRPO SDE) so that a state can branch into different next states; each branch is valued
by the reward of its predicted clean sample x0_hat (the sampler's deterministic step to sigma = 0, as SVDD and SMC
value theirs); and the budget of candidates is spent adaptively along the trajectory:

* every item has a budget of M K candidates for K steps, M per step;
* at step k an item draws candidates one at a time from its current state x_k (one SDE step each, and one denoiser
  call for the candidate's look-ahead, which is also the model output that moves it next if it is kept);
* the first candidate whose look-ahead reward beats the best reward the item has seen so far (any earlier
  candidate's, or its start noise's x0_hat) is taken at once and the step's unspent candidates roll over to step
  k + 1 (allowance M + leftover);
* an item that spends its step's allowance without such a candidate moves on with the step's best candidate;
* the last step has nothing to roll over to: it spends everything left and keeps its best candidate (the final
  samples themselves, scored as they are).

As in the released code: sequential draws within a step with the acceptance test against the best reward seen so far
(``best_rewards < new_rewards``), the leftover added to the next step's default budget, the step's best candidate
when its budget runs out, the start noise valued by its x0_hat. Where flowrl differs: (1) the released code starts
from the best of ``init_n_particles`` start noises (a best-of-N on x0_hat at t = 1, 25 by default); here an item
starts from one start noise (the held-out evaluation's), valued but not searched, so that M = 1 is the plain
rollout; (2) the released code stops rolling over two steps before the end, here only the last step cannot (it has
no later step); (3) the released code counts the budget in NFEs and stops mid-step when they run out, here the
budget is M candidates per step, so every item spends exactly M K; (4) the released code's optional "interpolant
conversion" (a variance-preserving path) is not done: the SDE is the run's rollout sampler on its own schedule.

Work, per item, counted: reward rows 1 + M K (the start noise's x0_hat and every candidate); denoiser rows
1 + (candidates drawn at steps 1 .. K - 1) = 1 + M K - c_K, where c_K (>= M) is what the last step drew (its
candidates are final samples and need no look-ahead). With M = 1 every step takes its only candidate and the result
is exactly a plain stochastic rollout with the same streams (tested).

Randomness: item i draws its start noise and then every candidate's step noise, in order, from its own stream
(``RowGenerators``), so its result does not depend on the other items. Items that sit at the same step draw their
candidates together, so batch sizes vary from call to call (a search's rows are what it spends, no padding).
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
from ..types import Pipeline, Sampler, index_condition


@dataclass
class RBFResult:
    samples: Tensor  # (P, *S) decoded final samples
    scores: Tensor  # (P,) their rewards (NaN where the reward failed)
    components: dict[str, Tensor]  # reward component -> (P,) its value for the final samples
    candidates: Tensor  # (K, P) long: candidates drawn at each step
    rolled_over: Tensor  # (K, P) bool: the step ended early on a candidate beating the best so far
    denoiser_rows: Tensor  # (P,) long: rows through pipeline.predict per item
    reward_rows: Tensor  # (P,) long: rows scored per item


def _finite(scores: Tensor) -> Tensor:
    return torch.where(torch.isfinite(scores), scores, torch.tensor(float("-inf")))


@torch.no_grad()
def rbf_sample(
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
) -> RBFResult:
    """One sample per prompt by rollover budget forcing with ``m`` candidates per step on average (module docstring)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if not sampler.stochastic:
        raise FlowRLError(f"RBF branches particles on a stochastic transition; sampler '{sampler.name}' is deterministic.")
    p, num_steps = len(prompts), sigmas.shape[0] - 1
    cond = pipeline.encode(list(prompts), list(metadata)) if getattr(pipeline, "needs_metadata", False) else pipeline.encode(list(prompts))
    x = (initial_noise if initial_noise is not None else start_noise(pipeline, p, generator)).float().clone()  # updated in place
    output = pipeline.predict(x, sigmas[0], cond, guidance_scale)
    zero = torch.zeros_like(sigmas[0])
    start = reward(pipeline.decode(sampler.deterministic_step(output, x, sigmas[0], zero)), list(prompts), list(metadata))
    best = _finite(start.scores.float().cpu())  # the best look-ahead reward each item has seen
    step = torch.zeros(p, dtype=torch.long)  # the step each item is at
    used = torch.zeros(p, dtype=torch.long)  # candidates drawn at that step
    allowance = torch.full((p,), m, dtype=torch.long)
    step_best = torch.full((p,), float("-inf"))
    step_best_x, step_best_out = x.clone(), output.clone()
    final_scores, components = torch.full((p,), float("nan")), {}
    candidates = torch.zeros(num_steps, p, dtype=torch.long)
    rolled = torch.zeros(num_steps, p, dtype=torch.bool)
    denoiser_rows, reward_rows = torch.ones(p, dtype=torch.long), torch.ones(p, dtype=torch.long)
    while bool((step < num_steps).any()):
        for k in sorted(set(step[step < num_steps].tolist())):
            idx = torch.nonzero(step == k).squeeze(1)
            sigma, sigma_next = sigmas[k], sigmas[k + 1]
            # one candidate per item at this step, item i's noise from item i's stream
            cand = sampler.step(output[idx], x[idx], sigma, sigma_next, generator=rows_of(generator, idx.tolist())).x_next
            last = k == num_steps - 1
            if not last:
                look = pipeline.predict(cand, sigma_next, index_condition(cond, idx) if cond else cond, guidance_scale)
                x0_hat = sampler.deterministic_step(look, cand, sigma_next, torch.zeros_like(sigma_next))
                denoiser_rows[idx] += 1
            else:
                look, x0_hat = None, cand  # final samples: scored as they are
            out = reward(pipeline.decode(x0_hat), [prompts[i] for i in idx], [metadata[i] for i in idx])
            raw = out.scores.float().cpu()
            r = _finite(raw)
            reward_rows[idx] += 1
            used[idx] += 1
            candidates[k, idx] += 1
            # the step's best candidate so far (ties: the earlier; the first is kept even if its reward failed)
            better = (r > step_best[idx]) | (used[idx] == 1)
            won = idx[better]
            step_best[won], step_best_x[won] = r[better], cand[better].to(step_best_x.dtype)
            if look is not None:
                step_best_out[won] = look[better].to(step_best_out.dtype)
            else:
                final_scores[won] = raw[better]
                for key, v in out.extras.items():
                    components.setdefault(key, torch.full((p,), float("nan")))[won] = v.float().cpu()[better]
            beats = r > best[idx]
            best[idx] = torch.maximum(best[idx], r)
            rollover = beats & torch.tensor(not last)
            spent = used[idx] >= allowance[idx]
            take = idx[rollover]  # move on with this candidate, the step's unspent allowance to the next
            if len(take):
                x[take], output[take] = cand[rollover].to(x.dtype), look[rollover].to(output.dtype)
                rolled[k, take] = True
                allowance[take] = m + allowance[take] - used[take]
            done = idx[spent & ~rollover]  # allowance spent: move on with the step's best candidate
            x[done], output[done] = step_best_x[done], step_best_out[done]
            allowance[done] = m
            moved = torch.cat([take, done])
            step[moved] += 1
            used[moved] = 0
            step_best[moved] = float("-inf")
    return RBFResult(
        samples=pipeline.decode(x),
        scores=final_scores,
        components=components,
        candidates=candidates,
        rolled_over=rolled,
        denoiser_rows=denoiser_rows,
        reward_rows=reward_rows,
    )


def rbf_in_batches(
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
) -> RBFResult:
    """:func:`rbf_sample` over many prompts, ``batch_size`` items at a time (each draws one candidate per call),
    prompt i starting from ``initial_noise[i]``."""
    parts = [
        rbf_sample(
            pipeline,
            sampler,
            reward,
            prompts[i : i + batch_size],
            metadata[i : i + batch_size],
            m,
            sigmas,
            rows_of(generator, slice(i, i + batch_size)),
            guidance_scale,
            initial_noise=initial_noise[i : i + batch_size],
        )
        for i in range(0, len(prompts), batch_size)
    ]
    return RBFResult(
        samples=torch.cat([r.samples for r in parts]),
        scores=torch.cat([r.scores for r in parts]),
        components={k: torch.cat([r.components[k] for r in parts]) for k in parts[0].components},
        candidates=torch.cat([r.candidates for r in parts], 1),
        rolled_over=torch.cat([r.rolled_over for r in parts], 1),
        denoiser_rows=torch.cat([r.denoiser_rows for r in parts]),
        reward_rows=torch.cat([r.reward_rows for r in parts]),
    )
