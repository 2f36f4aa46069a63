"""Sequential Monte Carlo (particle) sampling toward the reward-tilted distribution p_base(x) exp(lambda r(x)) / Z.

A Feynman-Kac / twisted SMC sampler for diffusion and flow models, as in TDS ("Practical and asymptotically exact
conditional sampling in diffusion models", Wu et al. 2023) and FK steering ("A general framework for inference-time
scaling and steering of diffusion models", Singhal et al. 2025). What is taken from them: particles propagated with a
proposal, weighted by the ratio of successive intermediate potentials built from the reward of each particle's
predicted clean sample, and resampled when the weights degenerate; with the proposal equal to the base model's own
transition (FK steering's choice; TDS also twists the proposal, which needs reward gradients, not done here) the
incremental weight is just the potential ratio. The tempering schedule, the resampling scheme and the bookkeeping
below are flowrl's choices.

The model. K steps on the time grid ``sigmas`` (K + 1 values, 1 -> 0); state j is x_j (x_0 the start noise, x_K the
sample). Every item gets N particles, each with its own start noise; each moves with the run's stochastic sampler
(``sampler.step``: the base policy itself is the proposal). After step j each particle is valued by the reward of its
predicted clean sample x0_hat(x_j) (the sampler's deterministic step to sigma = 0, as SVDD does; at j = K the sample
itself), and the potential is

    G_j(x_j) = exp(lambda_j r(x0_hat(x_j))),   lambda_0 = 0 -> lambda_K = lambda  (the tempering schedule)

A particle's log-weight grows by log G_j(x_j) - log G_{j-1}(x_{j-1}) (its ancestor's potential after resampling), so
along any ancestral line the product telescopes to G_K(x_K) = exp(lambda r(x_K)): the weighted particle set targets
p_base(x_K) exp(lambda r(x_K)) / Z exactly as N grows, whatever the intermediate potentials are (they only steer where
the particles go, which sets the variance). That needs the final potential to be exact: lambda_K = lambda on the
reward of the final sample, which is why r at j = K is the reward of x_K itself.

Tempering (``tempering``): ``"linear"`` (default) lambda_j = lambda j / K; ``"final"`` lambda_j = 0 for j < K (plain
self-normalised importance sampling of N base samples, no steering, no intermediate reward calls); or the K + 1 values
themselves (lambda_0 = 0, lambda_K = lambda).

Resampling: after reweighting at state j < K, an item whose effective sample size ESS = (sum w)^2 / sum w^2 falls
below ``ess_threshold * N`` is resampled, and its weights reset to uniform. ``"systematic"`` (default: one uniform per
item, lower variance than multinomial) or ``"multinomial"`` (N independent draws). The final weighting (j = K) is not
followed by a resampling: the result keeps the weighted set.

Output: ``particles`` (P, N, *S) and their normalised ``log_weights`` (P, N), the weighted set (what the 2-D toy checks
against the closed-form tilted target); and ``samples`` (P, *S), one particle per item *drawn by its final weight*
(not the highest-weight one: a draw makes the returned sample itself (asymptotically) a sample of the tilted
target, which is what SMC is for; the argmax is ``log_weights.argmax(1)``, a selection rule like best-of-N).

Randomness. Particle b of item i draws its start noise and every step's noise in turn from item i's stream (``rows_of``
with the item index repeated N times, as SVDD draws its candidates), then the item's resampling uniforms and, last, the
uniform that draws the returned particle, all from the same stream. With N = 1 nothing is reweighted into a choice,
an item never resamples (ESS / N = 1) and the result is exactly a plain stochastic rollout with the same streams
(tested, bit for bit).

Work, per item: denoiser rows N K (the model output that valued x_j is the one that moves it next, so valuing costs
nothing extra: exactly N plain rollouts), reward rows N x (the number of states j in 1..K with lambda_j != 0, and
always the final state): N K for the linear schedule, N for ``"final"``. Counted, not assumed (``denoiser_calls``,
``reward_calls``). A particle whose reward is NaN or infinite gets weight 0 (never resampled, never drawn while a
particle with a finite reward exists).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.rollout import keyed_noise, padded_rows, rows_of
from ..seeding import RowGenerators
from ..types import Pipeline, Sampler
from .svdd import _repeat

TEMPERINGS = ("linear", "final")
RESAMPLINGS = ("systematic", "multinomial")


@dataclass
class SMCResult:
    samples: Tensor  # (P, *S) decoded: one particle per item, drawn by its final weight
    chosen: Tensor  # (P,) which particle that is
    scores: Tensor  # (P,) its reward
    components: dict[str, Tensor]  # reward component -> (P,) its value for the drawn particle
    particles: Tensor  # (P, N, *S) every final particle, decoded
    log_weights: Tensor  # (P, N) float64 final log-weights, normalised per item (logsumexp over N = 0)
    rewards: Tensor  # (P, N) float32 every final particle's reward (NaN where the reward failed)
    ess: Tensor  # (K, P) float64 effective sample size after the reweighting at each state 1..K, before any resampling
    resampled: Tensor  # (K, P) bool: whether the item was resampled after that reweighting (never at the last state)
    lambdas: Tensor  # (K + 1,) float64 the tempering schedule lambda_0 = 0 .. lambda_K = lambda
    denoiser_calls: int  # rows through pipeline.predict per item (one row = one particle through the model once)
    reward_calls: int  # rows scored by the reward per item

    @property
    def n(self) -> int:
        return self.log_weights.shape[1]

    @property
    def resample_count(self) -> Tensor:
        """(P,) how many times each item was resampled."""
        return self.resampled.sum(0)

    @property
    def weights(self) -> Tensor:
        """(P, N) normalised weights (each row sums to 1)."""
        return self.log_weights.exp()

    def weighted_reward(self) -> Tensor:
        """(P,) the self-normalised estimate of E_target[r] for each item: sum_b w_b r_b over its finite rewards."""
        return _weighted_mean(self.log_weights, self.rewards.double())


def _weighted_mean(log_weights: Tensor, values: Tensor) -> Tensor:
    ok = torch.isfinite(values) & torch.isfinite(log_weights)
    w = torch.where(ok, log_weights.exp(), torch.zeros_like(log_weights))
    return (w * torch.where(ok, values, torch.zeros_like(values))).sum(1) / w.sum(1)


def tempering_schedule(tempering: str | Sequence[float], lam: float, num_steps: int) -> Tensor:
    """(K + 1,) float64 lambda_0 .. lambda_K: ``"linear"`` (lambda j / K), ``"final"`` (0 until lambda_K = lambda), or the
    values themselves (lambda_0 must be 0 and lambda_K must be ``lam``: the final potential defines the target)."""
    if not math.isfinite(lam):
        raise FlowRLError(f"the SMC lambda must be a finite number, got {lam}.")
    if isinstance(tempering, str):
        if tempering == "linear":
            return lam * torch.arange(num_steps + 1, dtype=torch.float64) / num_steps
        if tempering == "final":
            out = torch.zeros(num_steps + 1, dtype=torch.float64)
            out[-1] = lam
            return out
        raise FlowRLError(f"unknown SMC tempering '{tempering}'; use {', '.join(TEMPERINGS)} or a list of K + 1 values.")
    out = torch.tensor([float(v) for v in tempering], dtype=torch.float64)
    if out.shape != (num_steps + 1,) or not torch.isfinite(out).all():
        raise FlowRLError(f"an SMC tempering schedule needs K + 1 = {num_steps + 1} finite values, got {len(out)}.")
    if out[0] != 0 or out[-1] != lam:
        raise FlowRLError(f"an SMC tempering schedule starts at 0 and ends at lambda = {lam}; got {out[0]:g} ... {out[-1]:g}.")
    return out


def check_smc_arguments(n: int, ess_threshold: float, resampling: str) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= ess_threshold <= 1:
        raise FlowRLError(f"the SMC ESS threshold is a fraction of the particles, in [0, 1]; got {ess_threshold}.")
    if resampling not in RESAMPLINGS:
        raise FlowRLError(f"unknown SMC resampling '{resampling}'; use {' or '.join(RESAMPLINGS)}.")


def potential(lam: float, values: Tensor) -> Tensor:
    """log G = lambda r in float64; a NaN or infinite r is weight 0 (-inf) unless lambda is 0 (no reward in the potential)."""
    values = values.double()
    if lam == 0:
        return torch.zeros_like(values)
    return torch.where(torch.isfinite(values), lam * values, torch.full_like(values, float("-inf")))


def reweight(log_w: Tensor, phi_old: Tensor, phi_new: Tensor) -> Tensor:
    """log w + log G_j - log G_{j-1}; a particle already at weight 0 (its old potential -inf) stays there."""
    inc = torch.where(torch.isfinite(phi_old), phi_new - phi_old, torch.zeros_like(phi_new))
    return log_w + inc


def effective_sample_size(log_w: Tensor) -> Tensor:
    """(P,) (sum w)^2 / sum w^2 of (P, N) log-weights; 0 for an item whose every weight is 0."""
    top = log_w.max(1, keepdim=True).values
    w = torch.where(torch.isfinite(top), (log_w - top).exp(), torch.zeros_like(log_w))
    sq = (w**2).sum(1)
    return torch.where(sq > 0, w.sum(1) ** 2 / sq.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(sq))


def normalise(log_w: Tensor) -> Tensor:
    """(P, N) log-weights with logsumexp 0 per item; an item whose every weight is 0 gets uniform weights."""
    dead = ~torch.isfinite(log_w).any(1, keepdim=True) | torch.isneginf(log_w).all(1, keepdim=True)
    log_w = torch.where(dead, torch.zeros_like(log_w), log_w)
    return log_w - torch.logsumexp(log_w, 1, keepdim=True)


def item_uniforms(generator: torch.Generator | RowGenerators, items: Sequence[int]) -> Tensor:
    """float64 U(0, 1), one per item in ``items``, from each item's own stream (or, in turn, from one generator)."""
    if isinstance(generator, RowGenerators):
        return generator[list(items)].rand((len(items),), dtype=torch.float64)
    return torch.rand(len(items), generator=generator, dtype=torch.float64, device=generator.device).cpu()


def _searchsorted(log_w: Tensor, positions: Tensor) -> Tensor:
    """For each row, the index of the particle whose cumulative weight interval holds each position in [0, 1)."""
    cdf = normalise(log_w).exp().cumsum(1)
    cdf = cdf / cdf[:, -1:]  # exactly 1 at the last particle with weight; positions < 1 never fall past it
    return torch.searchsorted(cdf, positions, right=True).clamp(max=log_w.shape[1] - 1)


def resample_indices(log_w: Tensor, items: Sequence[int], generator: torch.Generator | RowGenerators, method: str = "systematic") -> Tensor:
    """(len(items), N) ancestor indices for the rows ``log_w`` (len(items), N), drawn from the items' streams.
    Systematic: positions (u + b) / N, b = 0..N-1, one uniform u per item; multinomial: N independent draws."""
    n = log_w.shape[1]
    if method == "systematic":
        u = item_uniforms(generator, items)
        positions = (u[:, None] + torch.arange(n, dtype=torch.float64)) / n
        return _searchsorted(log_w.cpu(), positions)
    probs = normalise(log_w.cpu()).exp()
    if isinstance(generator, RowGenerators):
        return torch.stack(
            [torch.multinomial(p, n, replacement=True, generator=g) for p, g in zip(probs, generator[list(items)].generators)]
        )
    return torch.multinomial(probs, n, replacement=True, generator=generator)


def draw_one(log_w: Tensor, generator: torch.Generator | RowGenerators) -> Tensor:
    """(P,) one particle per item drawn by its weight, one uniform from each item's stream."""
    u = item_uniforms(generator, range(log_w.shape[0]))
    return _searchsorted(log_w.cpu(), u[:, None]).squeeze(1)


@torch.no_grad()
def smc_sample(
    pipeline: Pipeline,
    sampler: Sampler,
    reward,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    n: int,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float = 1.0,
    lam: float = 1.0,
    ess_threshold: float = 0.5,
    tempering: str | Sequence[float] = "linear",
    resampling: str = "systematic",
    initial_noise: Tensor | None = None,
    live: int | None = None,
) -> SMCResult:
    """SMC with ``n`` particles per prompt toward p_base exp(``lam`` r) (module docstring); batch = prompts x n rows.

    ``generator``: one stream per prompt (``RowGenerators``, the held-out evaluation's) or one generator for all.
    ``initial_noise``: (P * n, *S) particle-major within an item; default drawn from the streams. ``live``: only the
    first ``live`` items are real (the rest pad a batch to a fixed size): the others are never decoded or scored."""
    check_smc_arguments(n, ess_threshold, resampling)
    if not sampler.stochastic:
        raise FlowRLError(f"SMC propagates particles with a stochastic transition; sampler '{sampler.name}' is deterministic.")
    num_steps = sigmas.shape[0] - 1
    lambdas = tempering_schedule(tempering, lam, num_steps)
    p = len(prompts)
    live = p if live is None else live
    rows = torch.arange(p).repeat_interleave(n)  # particle b of item i is row i n + b
    streams = rows_of(generator, rows)  # item i's particles draw in turn from item i's stream
    cond = pipeline.encode(list(prompts), list(metadata)) if getattr(pipeline, "needs_metadata", False) else pipeline.encode(list(prompts))
    cond_n = _repeat(cond, n)
    live_rows = live * n
    prompts_n = [q for q in prompts[:live] for _ in range(n)]
    metadata_n = [d for d in metadata[:live] for _ in range(n)]
    if initial_noise is None:
        initial_noise = keyed_noise(pipeline, streams) if isinstance(streams, RowGenerators) else pipeline.initial_noise(p * n, streams)
    x = initial_noise.float()
    predict_rows = reward_rows = 0

    def predict(x: Tensor, sigma: Tensor) -> Tensor:
        nonlocal predict_rows
        predict_rows += x.shape[0]
        return pipeline.predict(x, sigma, cond_n, guidance_scale)

    def score(x0_hat: Tensor):
        nonlocal reward_rows
        reward_rows += live_rows
        out = reward(pipeline.decode(x0_hat[:live_rows]), prompts_n, metadata_n)
        values = torch.zeros(p * n)
        values[:live_rows] = out.scores.float().cpu()
        return values.view(p, n), out

    log_w = torch.zeros(p, n, dtype=torch.float64)
    phi = torch.zeros(p, n, dtype=torch.float64)  # log G of each particle's current state
    ess, resampled = [], []
    output = predict(x, sigmas[0])
    values, out = torch.zeros(p, n), None
    for k in range(num_steps):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        j = k + 1  # the state this step reaches
        x = sampler.step(output, x, sigma, sigma_next, generator=streams).x_next
        last = j == num_steps
        # the model output at x_j values it (its x0_hat) and moves it next; at x_K only a grid ending above 0 needs one
        output = predict(x, sigma_next) if not last or float(sigma_next) > 0 else None
        if lambdas[j] != 0 or last:
            x0_hat = sampler.deterministic_step(output, x, sigma_next, torch.zeros_like(sigma_next)) if output is not None else x
            values, out = score(x0_hat)
        phi_new = potential(float(lambdas[j]), values.double())
        log_w = reweight(log_w, phi, phi_new)
        phi = phi_new
        ess.append(effective_sample_size(log_w))
        low = (ess[-1] < ess_threshold * n) & (torch.arange(p) < live) if not last and n > 1 else torch.zeros(p, dtype=torch.bool)
        resampled.append(low)
        if low.any():
            items = low.nonzero().squeeze(1).tolist()
            ancestors = resample_indices(log_w[items], items, generator, resampling)  # (R, N)
            take = torch.arange(p * n).view(p, n)
            take[items] = torch.tensor(items)[:, None] * n + ancestors
            take = take.flatten().to(x.device)
            x = x[take]
            if output is not None:
                output = output[take]
            phi = phi.flatten()[take.cpu()].view(p, n)
            values = values.flatten()[take.cpu()].view(p, n)
            log_w[items] = 0.0
    if live < p:
        log_w[live:] = 0.0
    log_w = normalise(log_w)
    dead = (~torch.isfinite(values[:live])).all(1)
    if dead.any():
        warnings.warn(
            f"{int(dead.sum())} item(s) got no finite reward on any particle; their particles are weighted equally.", stacklevel=2
        )
    chosen = draw_one(log_w, generator)
    particles = pipeline.decode(x[:live_rows]).cpu()
    particles = particles.view(live, n, *particles.shape[1:])
    components = {key: v.float().cpu().view(live, n) for key, v in out.extras.items()} if out is not None else {}
    ch = chosen[:live]
    return SMCResult(
        samples=particles[torch.arange(live), ch],
        chosen=ch,
        scores=values[:live].gather(1, ch[:, None]).squeeze(1),
        components={key: v.gather(1, ch[:, None]).squeeze(1) for key, v in components.items()},
        particles=particles,
        log_weights=log_w[:live],
        rewards=values[:live].clone(),
        ess=torch.stack(ess)[:, :live],
        resampled=torch.stack(resampled)[:, :live],
        lambdas=lambdas,
        denoiser_calls=predict_rows // p,
        reward_calls=reward_rows // max(live, 1),
    )


def smc_in_batches(
    pipeline: Pipeline,
    sampler: Sampler,
    reward,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    n: int,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float,
    batch_size: int,
    lam: float = 1.0,
    ess_threshold: float = 0.5,
    tempering: str | Sequence[float] = "linear",
    resampling: str = "systematic",
    progress=None,
) -> SMCResult:
    """:func:`smc_sample` over many prompts, ``max(1, batch_size // n)`` prompts (x ``n`` particles) at a time. The last
    chunk is padded with copies of its last item (with throw-away streams, never scored) so every denoiser call has
    the same rows (``batch_size`` when ``n`` divides it): an item's particles do not depend on how many items are
    evaluated beside it. Prompt i draws from ``generator``'s stream i. ``progress``: called with the items done."""
    check_smc_arguments(n, ess_threshold, resampling)
    chunk = max(1, batch_size // n)
    parts = []
    for start in range(0, len(prompts), chunk):
        idx = list(range(start, min(start + chunk, len(prompts))))
        padded, streams = padded_rows(idx, chunk, generator)
        parts.append(
            smc_sample(
                pipeline,
                sampler,
                reward,
                [prompts[i] for i in padded],
                [metadata[i] for i in padded],
                n,
                sigmas,
                streams,
                guidance_scale,
                lam,
                ess_threshold,
                tempering,
                resampling,
                live=len(idx),
            )
        )
        if progress is not None:
            progress(len(idx))
    first = parts[0]
    return SMCResult(
        samples=torch.cat([r.samples for r in parts]),
        chosen=torch.cat([r.chosen for r in parts]),
        scores=torch.cat([r.scores for r in parts]),
        components={k: torch.cat([r.components[k] for r in parts]) for k in first.components},
        particles=torch.cat([r.particles for r in parts]),
        log_weights=torch.cat([r.log_weights for r in parts]),
        rewards=torch.cat([r.rewards for r in parts]),
        ess=torch.cat([r.ess for r in parts], 1),
        resampled=torch.cat([r.resampled for r in parts], 1),
        lambdas=first.lambdas,
        denoiser_calls=first.denoiser_calls,  # the same for every item
        reward_calls=first.reward_calls,
    )


# -------------------------------------------------------------------- the weighted set against a closed-form target


def weighted_toy_comparison(points: Tensor, weights: Tensor, target):
    """Per-component weight, mean and per-coordinate std of a *weighted* point set (M, d) with weights (M,) (summing to
    anything positive) against a :class:`~flowrl.pipelines.toy2d.GaussianMixture` ``target``: the weighted analogue of
    :func:`flowrl.evaluation.toy2d.compare_to_target` (same assignment to the target's most responsible component, same
    error measures; the std is the weighted population std). Returns its :class:`ToyComparison`."""
    from ..evaluation.toy2d import ToyComparison

    pi, m, s = target._tensors(torch.device("cpu"))
    x = points.detach().double().cpu()
    w = weights.detach().double().cpu()
    w = w / w.sum()
    log_n = -((x[:, None, :] - m[None]) ** 2).sum(-1) / (2 * s**2) - target.dim * torch.log(s)
    label = (torch.log(pi) + log_n).argmax(1)
    mode_w, means, stds = [], [], []
    for c in range(len(target.weights)):
        wc = w * (label == c)
        total = wc.sum()
        mode_w.append(total)
        if total > 0:
            mean = (wc[:, None] * x).sum(0) / total
            var = (wc[:, None] * (x - mean) ** 2).sum(0) / total
            means.append(mean)
            stds.append(var.sqrt())
        else:
            means.append(torch.full((target.dim,), math.nan, dtype=torch.float64))
            stds.append(torch.full((target.dim,), math.nan, dtype=torch.float64))
    mode_w_t, means_t, stds_t = torch.stack(mode_w), torch.stack(means), torch.stack(stds)
    tw = torch.tensor(target.weights, dtype=torch.float64)
    tm = torch.tensor(target.means, dtype=torch.float64)
    ts = torch.tensor(target.stds, dtype=torch.float64)[:, None]
    ess = float(1 / (w**2).sum())
    stats = {
        "n": int(x.shape[0]),
        "ess": round(ess, 1),
        "weights": [round(float(v), 4) for v in mode_w_t],
        "target_weights": [round(float(v), 4) for v in tw],
        "means": [[round(float(v), 4) for v in r] for r in means_t],
        "target_means": [[round(float(v), 4) for v in r] for r in tm],
        "stds": [[round(float(v), 4) for v in r] for r in stds_t],
        "target_stds": [round(float(v), 4) for v in ts[:, 0]],
    }
    return ToyComparison(
        weight_error=float((mode_w_t - tw).abs().max()),
        mean_error=float((means_t - tm).abs().max()),
        std_relative_error=float((stds_t / ts - 1).abs().max()),
        stats=stats,
    )


def weighted_set(result: SMCResult) -> tuple[Tensor, Tensor]:
    """Every item's weighted particles pooled: points (P N, *S) and weights (P N,) summing to 1 (each item 1 / P), the
    estimate of the tilted target that averages the P independent SMC runs."""
    p, n = result.log_weights.shape
    return result.particles.reshape(p * n, *result.particles.shape[2:]), (result.weights / p).reshape(-1)


__all__: Sequence[str] = [
    "RESAMPLINGS",
    "TEMPERINGS",
    "SMCResult",
    "effective_sample_size",
    "resample_indices",
    "smc_in_batches",
    "smc_sample",
    "tempering_schedule",
    "weighted_set",
    "weighted_toy_comparison",
]
