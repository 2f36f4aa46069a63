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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.rollout import keyed_noise, padded_rows, rows_of
from ..seeding import RowGenerators
from .batching import PER_ITEM, SHARED, STEPS, in_batches, joined
from .search import ImageSearchModel, Items, SearchOutcome
from .svdd import _repeat

TEMPERINGS = ("linear", "final")


@dataclass
class SMCResult:
    samples: Tensor  # (P, *S) decoded: one particle per item, drawn by its final weight
    chosen: Tensor  # (P,) which particle that is
    scores: Tensor  # (P,) its reward
    components: dict[str, Tensor]  # reward component -> (P,) its value for the drawn particle
    particles: Tensor  # (P, N, *S) every final particle, decoded
    log_weights: Tensor  # (P, N) float64 final log-weights, normalised per item (logsumexp over N = 0)
    rewards: Tensor  # (P, N) float32 every final particle's reward (NaN where the reward failed)
    ess: Tensor = joined(STEPS)  # (K, P) float64 ESS after the reweighting at each state 1..K, before any resampling
    resampled: Tensor = joined(STEPS)  # (K, P) bool: whether the item was resampled after that reweighting (never at the last)
    lambdas: Tensor = joined(SHARED)  # (K + 1,) float64 the tempering schedule lambda_0 = 0 .. lambda_K = lambda
    denoiser_calls: int = joined(PER_ITEM)  # rows through pipeline.predict per item (one row = one particle through the model once)
    reward_calls: int = joined(PER_ITEM)  # rows scored by the reward per item

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


@dataclass
class ParticleWeights:
    """Every item's N particles' log-weights, their potentials log G and values (the scores G was built from), and
    what each reweighting did: the ESS after it and which items it resampled. What image and text SMC share."""

    log_w: Tensor  # (P, N) float64
    phi: Tensor  # (P, N) float64: log G of each particle's current state
    values: Tensor  # (P, N) the score each particle's potential was built from
    ess: list[Tensor] = field(default_factory=list)
    resampled: list[Tensor] = field(default_factory=list)

    @classmethod
    def start(cls, p: int, n: int, dtype: torch.dtype) -> ParticleWeights:
        zeros = torch.zeros(p, n, dtype=torch.float64)
        return cls(log_w=zeros, phi=zeros.clone(), values=torch.zeros(p, n, dtype=dtype))

    def reweight(self, lam: float, values: Tensor | None, threshold: float | None, live: int | None = None) -> Tensor:
        """Weigh by the potential lambda_j ``values`` (None: the particles' current values, when lambda_j needs no new
        score); returns (P,) bool, the items whose ESS fell below ``threshold`` N (None: never, the last state), among
        the first ``live``."""
        if values is not None:
            self.values = values
        phi_new = potential(lam, self.values.double())
        self.log_w = reweight(self.log_w, self.phi, phi_new)
        self.phi = phi_new
        self.ess.append(effective_sample_size(self.log_w))
        p, n = self.log_w.shape
        low = torch.zeros(p, dtype=torch.bool)
        if threshold is not None and n > 1:
            low = (self.ess[-1] < threshold * n) & (torch.arange(p) < (p if live is None else live))
        self.resampled.append(low)
        return low

    def resample(self, low: Tensor, generator: torch.Generator | RowGenerators, method: str) -> Tensor:
        """Resample the items ``low`` (their weights reset to uniform); returns (P N,) the row each particle now
        continues, which the caller applies to its particles' states."""
        p, n = self.log_w.shape
        items = low.nonzero().squeeze(1).tolist()
        ancestors = resample_indices(self.log_w[items], items, generator, method)  # (R, N)
        take = torch.arange(p * n).view(p, n)
        take[items] = torch.tensor(items)[:, None] * n + ancestors
        take = take.flatten()
        self.phi = self.phi.flatten()[take].view(p, n)
        self.values = self.values.flatten()[take].view(p, n)
        self.log_w[items] = 0.0
        return take

    def history(self, p: int) -> tuple[Tensor, Tensor]:
        """(S, P) the ESS and the resampling flags of the first ``p`` items at each executed step (S may be 0)."""
        if not self.ess:
            return torch.zeros(0, p, dtype=torch.float64), torch.zeros(0, p, dtype=torch.bool)
        return torch.stack(self.ess)[:, :p], torch.stack(self.resampled)[:, :p]


class _ImageParticles:
    """The particles of one SMC batch: their states and model outputs, their condition, and the counted rows."""

    def __init__(self, model: ImageSearchModel, reward, items: Items, n: int, generator, live: int) -> None:
        self.model, self.reward, self.n, self.live = model, reward, n, live
        p = len(items)
        self.streams = rows_of(generator, torch.arange(p).repeat_interleave(n))  # item i's particles draw from stream i
        self.cond = _repeat(model.encode(items), n)  # particle b of item i is row i n + b
        self.prompts = [q for q in items.prompts[:live] for _ in range(n)]
        self.metadata = [d for d in items.metadata[:live] for _ in range(n)]
        self.predict_rows = self.reward_rows = 0
        self.out = None

    def start_noise(self, p: int) -> Tensor:
        if isinstance(self.streams, RowGenerators):
            return keyed_noise(self.model.pipeline, self.streams)
        return self.model.pipeline.initial_noise(p * self.n, self.streams)

    def predict(self, x: Tensor, sigma: Tensor) -> Tensor:
        self.predict_rows += x.shape[0]
        return self.model.pipeline.predict(x, sigma, self.cond, self.model.guidance_scale)

    def score(self, x0_hat: Tensor, p: int) -> Tensor:
        """(P, N) the reward of the live items' particles' x0_hat (0 for the padding)."""
        rows = self.live * self.n
        self.reward_rows += rows
        self.out = self.reward(self.model.pipeline.decode(x0_hat[:rows]), self.prompts, self.metadata)
        values = torch.zeros(p * self.n)
        values[:rows] = self.out.scores.float().cpu()
        return values.view(p, self.n)


@torch.no_grad()
def smc_sample(
    model: ImageSearchModel,
    reward,
    items: Items,
    smc,
    generator: torch.Generator | RowGenerators,
    initial_noise: Tensor | None = None,
    live: int | None = None,
) -> SMCResult:
    """SMC with ``smc.n`` particles per item toward p_base exp(``smc.lam`` r) (module docstring; ``smc``: an
    :class:`~flowrl.inference.sections.SMCConfig`, its lambda given) on ``model.sampler``; batch = items x n rows.

    ``generator``: one stream per item (``RowGenerators``, the held-out evaluation's) or one generator for all.
    ``initial_noise``: (P * n, *S) particle-major within an item; default drawn from the streams. ``live``: only the
    first ``live`` items are real (the rest pad a batch to a fixed size): the others are never decoded or scored."""
    model.require_stochastic("SMC propagates particles with", smc.n)
    sampler, sigmas, n = model.sampler, model.sigmas, smc.n
    num_steps = sigmas.shape[0] - 1
    lambdas = tempering_schedule(smc.tempering, smc.lam, num_steps)
    p = len(items)
    live = p if live is None else live
    particles = _ImageParticles(model, reward, items, n, generator, live)
    x = (initial_noise if initial_noise is not None else particles.start_noise(p)).float()
    weights = ParticleWeights.start(p, n, torch.float32)
    output = particles.predict(x, sigmas[0])
    for k in range(num_steps):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        last = k + 1 == num_steps  # the state this step reaches is x_K
        x = sampler.step(output, x, sigma, sigma_next, generator=particles.streams).x_next
        # the model output at x_j values it (its x0_hat) and moves it next; at x_K only a grid ending above 0 needs one
        output = particles.predict(x, sigma_next) if not last or float(sigma_next) > 0 else None
        values = None
        if lambdas[k + 1] != 0 or last:
            x0_hat = sampler.deterministic_step(output, x, sigma_next, torch.zeros_like(sigma_next)) if output is not None else x
            values = particles.score(x0_hat, p)
        low = weights.reweight(float(lambdas[k + 1]), values, None if last else smc.ess_threshold, live)
        if low.any():
            take = weights.resample(low, generator, smc.resampling).to(x.device)
            x, output = x[take], output[take] if output is not None else None
    return _smc_result(particles, weights, x, lambdas, generator, p)


def _smc_result(particles: _ImageParticles, weights: ParticleWeights, x: Tensor, lambdas: Tensor, generator, p: int) -> SMCResult:
    """The weighted particles of the live items, and one of each drawn by its final weight."""
    live, n = particles.live, particles.n
    if live < p:
        weights.log_w[live:] = 0.0
    log_w = normalise(weights.log_w)
    values = weights.values
    dead = (~torch.isfinite(values[:live])).all(1)
    if dead.any():
        warnings.warn(
            f"{int(dead.sum())} item(s) got no finite reward on any particle; their particles are weighted equally.", stacklevel=3
        )
    chosen = draw_one(log_w, generator)
    decoded = particles.model.pipeline.decode(x[: live * n]).cpu()
    decoded = decoded.view(live, n, *decoded.shape[1:])
    out = particles.out
    components = {key: v.float().cpu().view(live, n) for key, v in out.extras.items()} if out is not None else {}
    ch = chosen[:live]
    ess, resampled = weights.history(live)
    return SMCResult(
        samples=decoded[torch.arange(live), ch],
        chosen=ch,
        scores=values[:live].gather(1, ch[:, None]).squeeze(1),
        components={key: v.gather(1, ch[:, None]).squeeze(1) for key, v in components.items()},
        particles=decoded,
        log_weights=log_w[:live],
        rewards=values[:live].clone(),
        ess=ess,
        resampled=resampled,
        lambdas=lambdas,
        denoiser_calls=particles.predict_rows // p,
        reward_calls=particles.reward_rows // max(live, 1),
    )


def smc_in_batches(
    model: ImageSearchModel, reward, items: Items, smc, generator: torch.Generator | RowGenerators, progress=None
) -> SMCResult:
    """:func:`smc_sample` over many items, ``max(1, model.batch_size // n)`` items (x ``n`` particles) at a time. The
    last chunk is padded with copies of its last item (with throw-away streams, never scored) so every denoiser call
    has the same rows (``batch_size`` when ``n`` divides it): an item's particles do not depend on how many items are
    evaluated beside it. Item i draws from ``generator``'s stream i. ``progress``: called with the items done."""
    chunk = max(1, model.batch_size // smc.n)

    def run(rows: list[int]) -> SMCResult:
        padded, streams = padded_rows(rows, chunk, generator)
        return smc_sample(model, reward, items.take(padded), smc, streams, live=len(rows))

    return in_batches(len(items), chunk, run, progress)


def smc_summary(smc, items: int, resamples: float, calls: tuple[int, int], measured: str) -> str:
    """The line ``flowrl eval --smc`` prints, image or text."""
    return (
        f"SMC, {smc.n} particles per item toward p_base exp({smc.lam:g} r), {items} held-out items: {measured}; "
        f"{resamples:.2f} resamplings per item; per item {calls[0]} denoiser and {calls[1]} reward rows"
    )


def smc_search(section, model: ImageSearchModel, reward, items: Items) -> SearchOutcome:
    """``flowrl eval --smc N`` on an image / video model: the reward of the drawn particles and the weighted estimate."""
    n, lam, threshold = section.n, float(section.lam), float(section.ess_threshold)
    result = smc_in_batches(model, reward, items, section, items.streams)  # item i's particles, resamplings, draw: stream i
    finite = result.scores[torch.isfinite(result.scores)]
    weighted = result.weighted_reward()
    metrics = {
        f"eval/reward/mean@smc{n}": float(finite.mean()),
        **{f"eval/reward/{k}@smc{n}": float(v.nanmean()) for k, v in result.components.items()},
        f"eval/smc{n}/weighted_reward": float(weighted[torch.isfinite(weighted)].mean()),
        f"eval/smc{n}/resamples_per_item": float(result.resample_count.double().mean()),
        f"eval/smc{n}/final_ess_fraction": float(result.ess[-1].mean() / n),
    }
    calls = (result.denoiser_calls, result.reward_calls)
    drawn, weighted_mean = metrics[f"eval/reward/mean@smc{n}"], metrics[f"eval/smc{n}/weighted_reward"]
    measured = f"reward of the drawn particles {drawn:.4f}, weighted {weighted_mean:.4f}"
    line = smc_summary(section, len(items), metrics[f"eval/smc{n}/resamples_per_item"], calls, measured)
    return SearchOutcome(
        metrics=metrics,
        lines=[line],
        cost_line_at=0,  # the counted cost first, then the summary
        extra={"denoiser_calls_per_item": calls[0], "reward_calls_per_item": calls[1]},
        settings={"smc": n, "lambda": lam, "ess_threshold": threshold},
        samples=result.samples,
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
    "TEMPERINGS",
    "ParticleWeights",
    "SMCResult",
    "effective_sample_size",
    "resample_indices",
    "smc_in_batches",
    "smc_sample",
    "tempering_schedule",
    "weighted_set",
    "weighted_toy_comparison",
]
