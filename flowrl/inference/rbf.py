"""FlowRBF as its authors released it: rollover budget forcing over chains that stop advancing two steps early.

Kim, Yoon, Hwang, Sung 2025, "Inference-time scaling for flow models via stochastic generation and rollover budget
forcing" (arXiv 2503.19385). Reference: github.com/KAIST-Visual-AI-Group/Flow-Inference-Time-Scaling at b65bb07,
``rbf/rbf.py`` (``RBF.train_single_step``, lines 121-334; the budget, lines 346-347; ``finished``, lines 111-118) and
``rbf/corrector/rgrp_sampler.py`` (``pre_correct`` for ``rbf``, lines 270-293). Its loop, as flowrl runs it:

* chains: every prompt runs ``chains`` chains side by side (the release's ``batch_size``, 2 in both its configs, all
  with the same prompt) and returns the better chain's result;
* start: each chain draws ``init_particles`` start noises (``init_n_particles``, 25), values each by the reward of
  its predicted clean sample x0_hat (one denoiser row each) and starts from the best;
* budget: with K steps and M candidates per step (the release's ``default_budget``), the release's NFE budget is
  ``max_nfe = chains (init_particles + M K)``; it stops as soon as the next round would reach it (``nfe + dnfe >=
  max_nfe``), so every chain draws C = M K - 1 candidates, one per round, all chains in every round;
* a candidate is one step of the run's stochastic sampler from the chain's state, valued by the reward of its x0_hat
  (one denoiser row: the look-ahead, which is also the model output that moves the chain on if it is kept);
* rollover (``best_rewards < new_rewards``): a candidate beating the best reward its chain has seen (any earlier
  candidate's, or its start's) is taken at once; the step's unspent allowance moves to the next step
  (``leftover + default_budget``);
* budget full (``budget_counter % max_budget == 0``): a chain that spent its step's allowance without such a
  candidate moves on with the step's best candidate (``cur_step_best_*``, ties: the earlier);
* two steps early (``proceed = step_counter < max_steps - 2``): a chain at step K - 2 never advances; it spends every
  remaining round there, drawing candidates x_{K-1} from its state x_{K-2} and keeping the step's best; the last
  step, to sigma = 0, is never taken;
* result (``finished``): the chain whose current step's best reward is highest (ties: the first chain), and of it that
  candidate's x0_hat, the sample returned, already scored (no further reward call).

Also as released: a chain that has just moved on keeps its previous step's best x0_hat until a candidate of the new
step beats -inf (the release resets only the reward, to -1e9); the step grid is the model's K steps (the release's
``t_max / max_steps`` grid through its scheduler). Where flowrl differs: rewards that fail count as -inf (never kept
over a finite one) where the release would compare NaN; the stochastic sampler is the run's own (the release's SDE
with ``diffusion_norm`` 3 and its optional variance-preserving "interpolant conversion" are not reproduced); the
start noises are drawn from each item's own stream (below). A budget that does not reach the second round of a step
(M K = 1) returns the first chain's best start x0_hat, as the release's ``finished`` does.

Work, per item, counted: denoiser rows chains (init_particles + M K - 1), reward rows the same (every start noise
and every candidate is valued once). With chains = init_particles = M = 1 the result is exactly K - 1 steps of the
stochastic sampler followed by the deterministic step to sigma = 0 (tested bit for bit).

Randomness: item i draws its chains' start noises (chain b's ``init_particles`` in a row; the first is the plain
evaluation's start noise) and then every candidate's step noise from its own stream (``RowGenerators``), its chains
in turn, so its result does not depend on the other items. Chains at the same step draw together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..samplers.rollout import rows_of, start_noise
from ..seeding import RowGenerators
from ..types import RewardOutput, index_condition
from .batching import chunks, in_batches
from .search import ImageSearchModel, Items, SearchOutcome


@dataclass
class RBFResult:
    samples: Tensor  # (P, *S) decoded: the x0_hat of each item's returned candidate
    scores: Tensor  # (P,) their rewards (NaN where the reward failed)
    components: dict[str, Tensor]  # reward component -> (P,) its value for the returned samples
    chain: Tensor  # (P,) long: the chain each item returned
    candidates: Tensor  # (P, chains, K) long: candidates each chain drew at each step
    rollovers: Tensor  # (P, chains) long: steps each chain left early on a candidate beating its best so far
    denoiser_rows: Tensor  # (P,) long: rows through pipeline.predict per item
    reward_rows: Tensor  # (P,) long: rows scored per item


def finite_or_worst(scores: Tensor) -> Tensor:
    """A failed reward (NaN) as -inf, so that it is never kept over a finite one (both RBFs' comparisons)."""
    return torch.where(torch.isfinite(scores), scores, torch.tensor(float("-inf")))


def move_on(search, went: Tensor, done: Tensor) -> None:
    """The release's step change on a search's rows (lines 264-284): rows ``done`` spent their step's allowance and move
    on with the step's best candidate (allowance M again); they and the rows that ``went`` on a candidate beating their
    best (already moved to it) start the next step with nothing drawn and no step best."""
    search.x[done], search.output[done] = search.step_best_x[done], search.step_best_out[done]
    search.allowance[done] = search.m
    moved = torch.cat([went, done])
    search.step[moved] += 1
    search.used[moved] = 0
    search.step_best[moved] = float("-inf")


class _Chains:
    """Every chain of one batch of items (row i chains + b: item i's chain b) as the released loop keeps it: its
    state and model output, its step, the candidates drawn there and its allowance, the best reward it has seen, the
    step's best candidate, and the x0_hat (with its reward) it would return."""

    def __init__(self, model: ImageSearchModel, reward, items: Items, m: int, chains: int, generator, cond):
        self.model, self.reward, self.items, self.m, self.chains = model, reward, items, m, chains
        self.num_steps = model.sigmas.shape[0] - 1
        self.last = max(self.num_steps - 2, 0)  # the step a chain stops advancing at (proceed = step < K - 2)
        self.item = torch.arange(len(items)).repeat_interleave(chains)  # row -> item
        self.generator, self.cond = generator, cond
        rows = len(self.item)
        self.step = torch.zeros(rows, dtype=torch.long)
        self.used = torch.zeros(rows, dtype=torch.long)  # candidates drawn at the current step
        self.allowance = torch.full((rows,), m, dtype=torch.long)
        self.step_best = torch.full((rows,), float("-inf"))
        self.candidates = torch.zeros(rows, self.num_steps, dtype=torch.long)
        self.rollovers = torch.zeros(rows, dtype=torch.long)
        self.components: dict[str, Tensor] = {}

    def _cond(self, rows: Tensor):
        return index_condition(self.cond, self.item[rows]) if self.cond else self.cond

    def _score(self, x0_hat: Tensor, rows: Tensor):
        items = self.items
        return self.reward(
            self.model.pipeline.decode(x0_hat), [items.prompts[i] for i in self.item[rows]], [items.metadata[i] for i in self.item[rows]]
        )

    def _keep(self, won: Tensor, x0_hat: Tensor, out, picked: Tensor) -> None:
        """Rows ``won`` keep the x0_hat (and its reward and components) of candidates ``picked`` as the one they return."""
        self.kept_x0[won] = x0_hat[picked].to(self.kept_x0.dtype)
        self.kept_score[won] = out.scores.float().cpu()[picked]
        for key, v in out.extras.items():
            self.components.setdefault(key, torch.full((len(self.item),), float("nan")))[won] = v.float().cpu()[picked]

    def start(self, init_particles: int) -> None:
        """Each chain from the best of its ``init_particles`` start noises by the reward of their x0_hat (the release's
        ``pre_correct``), valued ``model.batch_size`` rows at a time."""
        model, sigma = self.model, self.model.sigmas[0]
        owner = self.item.repeat_interleave(init_particles)  # start noise -> item (chain-major within an item)
        noise = start_noise(model.pipeline, len(owner), rows_of(self.generator, owner.tolist())).float()
        outputs, x0s, scored = [], [], []
        for part in chunks(len(owner), model.batch_size):
            rows = torch.tensor(part)
            chain_rows = rows // init_particles
            outputs.append(model.pipeline.predict(noise[rows], sigma, self._cond(chain_rows), model.guidance_scale))
            x0s.append(model.sampler.deterministic_step(outputs[-1], noise[rows], sigma, torch.zeros_like(sigma)))
            scored.append(self._score(x0s[-1], chain_rows))
        output, x0_hat = torch.cat(outputs), torch.cat(x0s)
        out = RewardOutput(
            scores=torch.cat([o.scores.float().cpu() for o in scored]),
            extras={key: torch.cat([o.extras[key].float().cpu() for o in scored]) for key in scored[0].extras},
        )
        r = finite_or_worst(out.scores).view(-1, init_particles)
        picked = torch.arange(len(self.item)) * init_particles + r.argmax(1)  # ties: the first start noise
        self.x, self.output, self.best = noise[picked].clone(), output[picked].clone(), r.max(1).values
        self.step_best_x, self.step_best_out = self.x.clone(), self.output.clone()
        self.kept_x0, self.kept_score = x0_hat[picked].clone(), torch.full((len(self.item),), float("nan"))
        self._keep(torch.arange(len(self.item)), x0_hat, out, picked)

    def round(self) -> None:
        """One candidate for every chain from the step it is at (chains at the same step together), each valued by the
        reward of its x0_hat, then the release's rules: rollover, budget full, the step's best."""
        model, sigmas = self.model, self.model.sigmas
        cand, look, x0_hat = torch.empty_like(self.x), torch.empty_like(self.output), torch.empty_like(self.kept_x0)
        for k in sorted(set(self.step.tolist())):
            rows = torch.nonzero(self.step == k).squeeze(1)
            step = model.sampler.step(
                self.output[rows], self.x[rows], sigmas[k], sigmas[k + 1], generator=rows_of(self.generator, self.item[rows].tolist())
            )
            cand[rows] = step.x_next.to(cand.dtype)
            look[rows] = model.pipeline.predict(cand[rows], sigmas[k + 1], self._cond(rows), model.guidance_scale).to(look.dtype)
            x0_hat[rows] = model.sampler.deterministic_step(look[rows], cand[rows], sigmas[k + 1], torch.zeros_like(sigmas[k + 1])).to(
                x0_hat.dtype
            )
            self.candidates[rows, k] += 1
        every = torch.arange(len(self.item))
        out = self._score(x0_hat, every)
        self._advance(cand, look, x0_hat, out, finite_or_worst(out.scores.float().cpu()))

    def _advance(self, cand: Tensor, look: Tensor, x0_hat: Tensor, out, r: Tensor) -> None:
        """The release's lines 217-284 on every chain at once."""
        self.used += 1
        rollover = self.best < r
        proceed = self.step < self.last
        full = (self.used % self.allowance == 0) & ~rollover & proceed
        improved = self.step_best < r
        won = torch.nonzero(improved).squeeze(1)
        self.step_best[won], self.step_best_x[won], self.step_best_out[won] = r[won], cand[won], look[won]
        self._keep(won, x0_hat, out, won)
        self.best = torch.where(rollover, r, self.best)
        go = torch.nonzero(rollover & proceed).squeeze(1)
        self.x[go], self.output[go] = cand[go], look[go]
        self.allowance[go] = self.allowance[go] - self.used[go] + self.m
        self.rollovers[go] += 1
        move_on(self, go, torch.nonzero(full).squeeze(1))

    def result(self, spent: int) -> RBFResult:
        """Each item's chain with the highest current-step best (ties: the first) and that candidate's x0_hat;
        ``spent``: the denoiser and reward rows each item used."""
        p, b = len(self.items), self.chains
        chain = self.step_best.view(p, b).argmax(1)
        rows = torch.arange(p) * b + chain
        return RBFResult(
            samples=self.model.pipeline.decode(self.kept_x0[rows]),
            scores=self.kept_score[rows],
            components={key: v[rows] for key, v in self.components.items()},
            chain=chain,
            candidates=self.candidates.view(p, b, self.num_steps),
            rollovers=self.rollovers.view(p, b),
            denoiser_rows=torch.full((p,), spent, dtype=torch.long),
            reward_rows=torch.full((p,), spent, dtype=torch.long),
        )


def candidates_per_chain(m: int, num_steps: int) -> int:
    """Rounds the release runs on ``max_nfe = chains (init_particles + M K)``: it stops when the next round would reach
    the budget (``nfe + dnfe >= max_nfe``), so each chain draws M K - 1 candidates."""
    return m * num_steps - 1


@torch.no_grad()
def rbf_sample(model: ImageSearchModel, reward, items: Items, rbf, generator: torch.Generator | RowGenerators) -> RBFResult:
    """One sample per item by FlowRBF as released (module docstring) with the settings of ``rbf`` (an
    :class:`~flowrl.inference.sections.RBFConfig`): ``chains`` chains per item, each from the best of
    ``init_particles`` start noises, ``m`` candidates per step and chain."""
    model.require_stochastic("RBF branches particles on", rbf.m)
    search = _Chains(model, reward, items, rbf.m, rbf.chains, generator, model.encode(items))
    search.start(rbf.init_particles)
    rounds = candidates_per_chain(rbf.m, search.num_steps)
    for _ in range(rounds):
        search.round()
    return search.result(rbf.chains * (rbf.init_particles + rounds))


def rbf_in_batches(model: ImageSearchModel, reward, items: Items, rbf, generator: torch.Generator | RowGenerators) -> RBFResult:
    """:func:`rbf_sample` over many items, ``model.batch_size // chains`` items (x ``chains`` chains: one denoiser call
    per round holds ``model.batch_size`` rows) at a time, item i drawing from its own stream."""
    return in_batches(
        len(items),
        max(1, model.batch_size // rbf.chains),
        lambda rows: rbf_sample(model, reward, items.take(rows), rbf, rows_of(generator, rows)),
    )


def search_metrics(tag: str, result, rollovers: tuple[str, float], per_step: Tensor) -> dict[str, float]:
    """The numbers an RBF search records (``tag``: ``rbfMxB``, or ``rbfM`` for the rollover variant): the mean reward of
    the returned samples, each component's, the early moves (``rollovers``: its name and value) and the candidates spent
    at each step."""
    finite = result.scores[torch.isfinite(result.scores)]
    return {
        f"eval/reward/mean@{tag}": float(finite.mean()),
        **{f"eval/reward/{k}@{tag}": float(v.nanmean()) for k, v in result.components.items()},
        f"eval/{tag}/{rollovers[0]}": rollovers[1],
        **{f"eval/{tag}/candidates_at_step{k + 1}": float(c) for k, c in enumerate(per_step.tolist())},
    }


def rbf_search(section, model: ImageSearchModel, reward, items: Items) -> SearchOutcome:
    """``flowrl eval --rbf M`` on an image / video model: the reward of the returned x0_hat, the candidates each chain
    spent per step and its early moves."""
    m, b, n0 = section.m, section.chains, section.init_particles
    result = rbf_in_batches(model, reward, items, section, items.streams)
    per_step = result.candidates.double().mean((0, 1))
    rollovers = float(result.rollovers.double().mean())
    metrics = search_metrics(f"rbf{m}x{b}", result, ("rollovers_per_chain", rollovers), per_step)
    line = (
        f"RBF as released, {m} candidates per step and chain, {b} chains from the best of {n0} start noises each, "
        f"{len(items)} held-out items: reward {metrics[f'eval/reward/mean@rbf{m}x{b}']:.4f}; candidates per step and chain "
        f"{' '.join(f'{c:.2f}' for c in per_step.tolist())}; {rollovers:.2f} early moves per chain"
    )
    return SearchOutcome(metrics=metrics, lines=[line], settings={"rbf": m, "chains": b, "init_particles": n0}, samples=result.samples)
