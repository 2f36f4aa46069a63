"""flowrl's rollover budget forcing (``rbf_rollover``): FlowRBF's per-step particle search with a fixed budget of M
candidates per step and item, rolled over to the very last step. flowrl's ``rbf`` before issue #41; the algorithm as
the authors released it is ``rbf`` now (rbf.py), and this variant is kept under its own name beside it
(docs/inference_scaling.md says where each wins on the cost curves).

After FlowRBF (Kim, Yoon, Hwang, Sung 2025, "Inference-time scaling for flow models via stochastic generation and
rollover budget forcing", arXiv 2503.19385; released code github.com/KAIST-Visual-AI-Group/Flow-Inference-Time-Scaling,
``rbf/rbf.py``). The flow ODE is replaced by an SDE with the same marginals (the run's stochastic
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
when its budget runs out, the start noise valued by its x0_hat. Where this variant differs from the release (rbf.py):
(1) the release starts each chain from the best of ``init_n_particles`` start noises (25), here an item starts from one
(the held-out evaluation's), valued but not searched, so that M = 1 is the plain rollout; (2) the release stops
advancing two steps before the end, spends all that is left there and returns the best candidate's x0_hat; here only
the last step cannot roll over, and its candidates are final samples; (3) the release counts its budget in NFEs and
stops when they run out (one candidate short of M K per chain); here every item spends exactly M K candidates;
(4) the release runs two chains per prompt and returns the better; here one; (5) the release's optional
"interpolant conversion" (a variance-preserving path) is not done here either.

Work, per item, counted: reward rows 1 + M K (the start noise's x0_hat and every candidate); denoiser rows
1 + (candidates drawn at steps 1 .. K - 1) = 1 + M K - c_K, where c_K (>= M) is what the last step drew (its
candidates are final samples and need no look-ahead). With M = 1 every step takes its only candidate and the result
is exactly a plain stochastic rollout with the same streams (tested).

Randomness: item i draws its start noise and then every candidate's step noise, in order, from its own stream
(``RowGenerators``), so its result does not depend on the other items. Items that sit at the same step draw their
candidates together, so batch sizes vary from call to call (a search's rows are what it spends, no padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..samplers.rollout import rows_of, start_noise
from ..seeding import RowGenerators
from ..types import index_condition
from .batching import STEPS, in_batches, joined
from .rbf import finite_or_worst, move_on, search_metrics
from .search import ImageSearchModel, Items, SearchOutcome


@dataclass
class RolloverResult:
    samples: Tensor  # (P, *S) decoded final samples
    scores: Tensor  # (P,) their rewards (NaN where the reward failed)
    components: dict[str, Tensor]  # reward component -> (P,) its value for the final samples
    candidates: Tensor = joined(STEPS)  # (K, P) long: candidates drawn at each step
    rolled_over: Tensor = joined(STEPS)  # (K, P) bool: the step ended early on a candidate beating the best so far
    denoiser_rows: Tensor  # (P,) long: rows through pipeline.predict per item
    reward_rows: Tensor  # (P,) long: rows scored per item


class _Rollover:
    """Every item's place in one batch's search: its state and model output, the step it is at, the candidates it has
    drawn there and its allowance, the step's best candidate so far, and the best look-ahead reward it has seen."""

    def __init__(self, model: ImageSearchModel, reward, items: Items, m: int, generator, cond, x: Tensor, output: Tensor, best: Tensor):
        p, num_steps = len(items), model.sigmas.shape[0] - 1
        self.model, self.reward, self.items, self.m, self.generator = model, reward, items, m, generator
        self.cond, self.num_steps = cond, num_steps
        self.x, self.output, self.best = x, output, best
        self.step = torch.zeros(p, dtype=torch.long)  # the step each item is at
        self.used = torch.zeros(p, dtype=torch.long)  # candidates drawn at that step
        self.allowance = torch.full((p,), m, dtype=torch.long)
        self.step_best = torch.full((p,), float("-inf"))
        self.step_best_x, self.step_best_out = x.clone(), output.clone()
        self.final_scores, self.components = torch.full((p,), float("nan")), {}
        self.candidates = torch.zeros(num_steps, p, dtype=torch.long)
        self.rolled = torch.zeros(num_steps, p, dtype=torch.bool)
        self.denoiser_rows, self.reward_rows = torch.ones(p, dtype=torch.long), torch.ones(p, dtype=torch.long)

    def steps_now(self) -> list[int]:
        """The steps some item is at, in order (items at the same step draw their candidates together)."""
        return sorted(set(self.step[self.step < self.num_steps].tolist()))

    def draw(self, k: int, idx: Tensor):
        """One candidate for each item ``idx`` at step ``k`` (item i's noise from item i's stream), its look-ahead model
        output (None at the last step: the candidates are final samples) and the reward of its x0_hat."""
        model, sigma, sigma_next = self.model, self.model.sigmas[k], self.model.sigmas[k + 1]
        step = model.sampler.step(self.output[idx], self.x[idx], sigma, sigma_next, generator=rows_of(self.generator, idx.tolist()))
        cand, look, x0_hat = step.x_next, None, step.x_next  # final samples: scored as they are
        if k < self.num_steps - 1:
            look = model.pipeline.predict(
                cand, sigma_next, index_condition(self.cond, idx) if self.cond else self.cond, model.guidance_scale
            )
            x0_hat = model.sampler.deterministic_step(look, cand, sigma_next, torch.zeros_like(sigma_next))
            self.denoiser_rows[idx] += 1
        out = self.reward(model.pipeline.decode(x0_hat), [self.items.prompts[i] for i in idx], [self.items.metadata[i] for i in idx])
        self.reward_rows[idx] += 1
        self.used[idx] += 1
        self.candidates[k, idx] += 1
        return cand, look, out

    def keep_step_best(self, idx: Tensor, cand: Tensor, look: Tensor | None, out, r: Tensor) -> None:
        """The step's best candidate so far (ties: the earlier; the first is kept even if its reward failed)."""
        better = (r > self.step_best[idx]) | (self.used[idx] == 1)
        won = idx[better]
        self.step_best[won], self.step_best_x[won] = r[better], cand[better].to(self.step_best_x.dtype)
        if look is not None:
            self.step_best_out[won] = look[better].to(self.step_best_out.dtype)
            return
        self.final_scores[won] = out.scores.float().cpu()[better]
        for key, v in out.extras.items():
            self.components.setdefault(key, torch.full((len(self.items),), float("nan")))[won] = v.float().cpu()[better]

    def move_on(self, k: int, idx: Tensor, cand: Tensor, look: Tensor | None, r: Tensor) -> None:
        """Items whose candidate beats the best they have seen take it at once, rolling the step's unspent allowance over
        to the next; items that spent their allowance move on with the step's best candidate."""
        beats = r > self.best[idx]
        self.best[idx] = torch.maximum(self.best[idx], r)
        rollover = beats & torch.tensor(k < self.num_steps - 1)
        spent = self.used[idx] >= self.allowance[idx]
        take = idx[rollover]
        if len(take):
            self.x[take], self.output[take] = cand[rollover].to(self.x.dtype), look[rollover].to(self.output.dtype)
            self.rolled[k, take] = True
            self.allowance[take] = self.m + self.allowance[take] - self.used[take]
        move_on(self, take, idx[spent & ~rollover])

    def result(self) -> RolloverResult:
        return RolloverResult(
            samples=self.model.pipeline.decode(self.x),
            scores=self.final_scores,
            components=self.components,
            candidates=self.candidates,
            rolled_over=self.rolled,
            denoiser_rows=self.denoiser_rows,
            reward_rows=self.reward_rows,
        )


@torch.no_grad()
def rbf_rollover_sample(
    model: ImageSearchModel, reward, items: Items, m: int, generator: torch.Generator | RowGenerators, initial_noise: Tensor | None = None
) -> RolloverResult:
    """One sample per item by rollover budget forcing with ``m`` candidates per step on average (module docstring)."""
    model.require_stochastic("RBF branches particles on", m)
    pipeline, sampler, sigmas = model.pipeline, model.sampler, model.sigmas
    x, cond = model.start(items, generator, initial_noise).clone(), model.encode(items)  # x is updated in place
    output = pipeline.predict(x, sigmas[0], cond, model.guidance_scale)
    x0_hat = sampler.deterministic_step(output, x, sigmas[0], torch.zeros_like(sigmas[0]))
    start = reward(pipeline.decode(x0_hat), list(items.prompts), list(items.metadata))
    search = _Rollover(model, reward, items, m, generator, cond, x, output, finite_or_worst(start.scores.float().cpu()))
    while bool((search.step < search.num_steps).any()):
        for k in search.steps_now():
            idx = torch.nonzero(search.step == k).squeeze(1)
            cand, look, out = search.draw(k, idx)
            r = finite_or_worst(out.scores.float().cpu())
            search.keep_step_best(idx, cand, look, out, r)
            search.move_on(k, idx, cand, look, r)
    return search.result()


def rbf_rollover_in_batches(
    model: ImageSearchModel, reward, items: Items, m: int, generator: torch.Generator | RowGenerators
) -> RolloverResult:
    """:func:`rbf_rollover_sample` over many items, ``model.batch_size`` items at a time (each draws one candidate per call),
    item i starting from the plain evaluation's start noise (the first draw of its stream)."""
    noise = start_noise(model.pipeline, len(items), generator)
    return in_batches(
        len(items),
        model.batch_size,
        lambda rows: rbf_rollover_sample(model, reward, items.take(rows), m, rows_of(generator, rows), noise[rows]),
    )


def rbf_rollover_search(section, model: ImageSearchModel, reward, items: Items) -> SearchOutcome:
    """``flowrl eval --rbf-rollover M`` on an image / video model: the reward, the candidates spent per step and the early
    moves. Its metrics keep the names they had when this was flowrl's ``rbf`` (``@rbfM``), so the specs written then
    re-run bit for bit."""
    m = section.m
    result = rbf_rollover_in_batches(model, reward, items, m, items.streams)
    per_step = result.candidates.double().mean(1)
    rollovers = float(result.rolled_over.double().sum(0).mean())
    metrics = search_metrics(f"rbf{m}", result, ("rollovers_per_item", rollovers), per_step)
    line = (
        f"RBF with rollover to the last step, {m} candidates per step on average, {len(items)} held-out items: "
        f"reward {metrics[f'eval/reward/mean@rbf{m}']:.4f}; candidates per step {' '.join(f'{c:.2f}' for c in per_step.tolist())}; "
        f"{rollovers:.2f} early moves per item"
    )
    return SearchOutcome(metrics=metrics, lines=[line], settings={"rbf_rollover": m}, samples=result.samples)
