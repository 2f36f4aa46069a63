"""Masked-token image sampling (aMUSEd / MaskGIT): ``AmusedScheduler``'s step as a policy with exact per-step log-probs.

The state is the grid of image tokens, flattened to (B, L) and held as float32 token ids (exact below 2^24), so a
rollout rides in a :class:`~flowrl.types.Trajectory` like any latent; ``mask_token_id`` marks the masked ones. The
time grid is uniform in the schedule's time, ``sigma_k = 1 - k / N`` (1 = all masked, 0 = the image), so a step
knows its index ``i`` and the step count ``N`` from (sigma, sigma_next) alone.

One step from x_t, with logits l (B, L, V) for every position (classifier-free guidance already applied):

1. draft: a token for every position, x0_hat_j ~ softmax(l_j / T) (``torch.multinomial``; T = ``token_temperature``,
   1 in aMUSEd); positions already unmasked keep their token;
2. choice: ``n = floor(L cos(pi/2 (i + 1) / N))`` positions stay masked (the cosine schedule; linear: 1 - (i + 1) / N),
   at least 1 and at most (masked - 1), so every step commits a token and the last step commits the rest. They are
   the masked positions of lowest confidence log p_j(x0_hat_j) + tau_i g_j, g_j standard Gumbel noise and tau_i
   the choice temperature ``linspace(tau_0, tau_1, N)[i]`` (aMUSEd: 2 -> 0); the others take their draft tokens.

With a plain ``torch.Generator`` the draws are made with exactly AmusedScheduler's calls in its order (one
multinomial over every position of the batch, then one uniform per position), so the sampler reproduces
``AmusedPipeline``'s tokens and images bit for bit from the same generator (tests/test_family_amused.py); with
:class:`~flowrl.seeding.RowGenerators` each row draws from its own stream.

The log-prob of a step (what GRPO's ratio reads) is the exact log-probability of its outcome under this rule:
which set C of masked positions was committed and which tokens x_C they took (K: the positions that stay masked),

    log pi(x_{t-1} | x_t) = sum_{j in C} log p_j(x_j) + log P(C | x_C),   p_j = softmax(l_j / T),

    P(C | x_C) = integral dt  [-d/dt prod_{j in C} (1 - exp(-e^{w_j - t}))]  prod_{k in K} sum_v p_k(v) exp(-e^{w_k(v) - t}),

with w = log p / tau_i. The choice commits C when the smallest Gumbel-perturbed score w_j + g_j over C exceeds the
largest over K; the first factor is the density of that smallest score, the second the probability that every
position of K (its draft summed over, it is thrown away) scores below it, so the discarded drafts and the noise are
summed over exactly. A 1-D integral, computed by the trapezoid rule on ``QUADRATURE_NODES`` points in t (the
integrand is smooth on the scale of 1: the error is below 1e-8, tests/test_masked_image_step.py against
Plackett-Luce enumeration); at tau_i = 0 the choice is the plain ranking and P(C | x_C) =
prod_{k in K} P(p_k(x0_hat_k) < min_{j in C} p_j(x_j)). Re-scoring a recorded step reads C from (x_t, x_{t-1}) and
gives back the rollout's value exactly (ratio 1). ``score="committed_tokens"`` (``MaskedImageConfig.score``) keeps
flowrl's former score, the first sum alone: the committed tokens as if C were fixed, which omits the policy's
probability of C given the drafts, so its policy gradient is biased (docs/model_families/amused.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..sections import SamplerSection
from ..seeding import RowGenerators
from ..types import StepOutput

MaskingSchedule = Literal["cosine", "linear"]


@dataclass(frozen=True)
class MaskSchedule:
    """The time grid of a masked-token model: ``sigmas(N)`` = 1 - k / N, k = 0..N (the fraction of time left)."""

    masking: MaskingSchedule

    def sigmas(self, num_steps: int) -> Tensor:
        return torch.linspace(1.0, 0.0, num_steps + 1)


def step_position(sigma: Tensor | float, sigma_next: Tensor | float) -> tuple[int, int]:
    """(i, N): the step's index and the step count of the uniform grid sigma_k = 1 - k / N it lies on."""
    s, s_next = float(sigma), float(sigma_next)
    n = round(1.0 / (s - s_next))
    return round((1.0 - s) * n), n


def keep_masked(masking: MaskingSchedule, i: int, n: int, length: int) -> Tensor:
    """floor(L * mask_ratio) after step i of n, written with AmusedScheduler's float32 operations (so the count
    matches it exactly): ratio = (i + 1) / N, mask_ratio = cos(ratio pi / 2) or 1 - ratio."""
    ratio = (torch.tensor([[i]]) + 1) / n
    mask_ratio = torch.cos(ratio * math.pi / 2) if masking == "cosine" else 1 - ratio
    return (length * mask_ratio).floor()


def _gumbel(uniform: Tensor) -> Tensor:
    """AmusedScheduler's Gumbel noise from uniforms (its clamps included)."""
    return -torch.log((-torch.log(uniform.clamp(1e-20))).clamp(1e-20))


QUADRATURE_NODES = 128  # trapezoid points in t for P(C | x_C); the spacing stays below ~0.5, the error below 1e-8
NODE_CHUNK_ELEMENTS = 1 << 24  # (rows x nodes x positions x vocabulary) evaluated at once; chunks are recomputed in backward
CommitScore = Literal["step", "committed_tokens"]


def _log1mexp_of_exp(lx: Tensor) -> Tensor:
    """log(1 - exp(-e^lx)), stable at both ends and with finite gradients (the Gumbel CDF's complement in log space)."""
    small = lx < -20
    exact = torch.log(-torch.expm1(-lx.clamp(min=-20).exp()))
    return torch.where(small, lx - lx.exp() / 2, exact)


def _log_min_density(w: Tensor, committed: Tensor, t: Tensor) -> Tensor:
    """(B, Q) log density at t of min_{j in C} (w_j + g_j), g standard Gumbel: -d/dt prod_j (1 - exp(-e^{w_j - t}))."""
    lx = (w[:, None, :] - t[:, :, None]).clamp(max=60.0)  # beyond 60 every term has saturated
    survive = _log1mexp_of_exp(lx)
    inside = committed[:, None, :]
    log_survival = torch.where(inside, survive, 0.0).sum(-1)
    hazard = torch.where(inside, lx - lx.exp() - survive, -torch.inf)  # log of x e^-x / (1 - e^-x), x = e^(w - t)
    return log_survival + torch.logsumexp(hazard, -1)


def _log_max_cdf_chunk(log_p: Tensor, stay: Tensor, t: Tensor, tau: float) -> Tensor:
    """(B, q) log P(max_{k in K} (w_k(x0_hat_k) + g_k) < t), each draft x0_hat_k ~ p_k summed over."""
    a = (log_p[:, None] / tau - t[:, :, None, None]).clamp(max=60.0)
    per_position = torch.logsumexp(log_p[:, None] - a.exp(), -1)
    return torch.where(stay[:, None, :], per_position, 0.0).sum(-1)


def _log_max_cdf(log_p: Tensor, stay: Tensor, t: Tensor, tau: float) -> Tensor:
    """:func:`_log_max_cdf_chunk` over node chunks, recomputed in backward (aMUSEd-512's 1024 x 8192 logits)."""
    b, length, v = log_p.shape
    step = max(1, NODE_CHUNK_ELEMENTS // (b * length * v))
    if step >= t.shape[1]:  # one piece (the digits model): nothing to save by recomputing
        return _log_max_cdf_chunk(log_p, stay, t, tau)
    parts = []
    for start in range(0, t.shape[1], step):
        chunk = t[:, start : start + step]
        if torch.is_grad_enabled() and log_p.requires_grad:
            parts.append(checkpoint(_log_max_cdf_chunk, log_p, stay, chunk, tau, use_reentrant=False))
        else:
            parts.append(_log_max_cdf_chunk(log_p, stay, chunk, tau))
    return torch.cat(parts, 1)


def commit_log_prob(log_p: Tensor, x_next: Tensor, committed: Tensor, stay: Tensor, tau: float) -> Tensor:
    """(B,) log P(C | x_C): the probability that the Gumbel-perturbed confidence choice commits exactly the positions
    C (``committed``) rather than those of K (``stay``), given the tokens x_C drafted at C, every draft of K summed
    over (the module docstring's integral). 0 for a row with C or K empty (nothing to choose)."""
    lp = log_p.gather(-1, x_next.long().clamp(0, log_p.shape[-1] - 1)[..., None])[..., 0]
    choose = committed.any(-1) & stay.any(-1)
    if tau == 0:
        return torch.where(choose, _ranked_commit_log_prob(log_p, lp, committed, stay), 0.0)
    w = lp / tau
    w_min = torch.where(choose, torch.where(committed, w, torch.inf).amin(-1), 0.0)
    lo = w_min - 4.0  # min_C (w + g) lies below with probability < |C| exp(-e^4)
    hi = torch.maximum(w_min, torch.log(stay.sum(-1) + 1.0)) + 30.0  # ... and above with probability < e^-30
    grid = torch.linspace(0.0, 1.0, QUADRATURE_NODES, device=log_p.device, dtype=log_p.dtype)
    t = lo[:, None] + (hi - lo)[:, None] * grid
    ends = torch.where((grid == 0) | (grid == 1), math.log(0.5), 0.0)
    log_weight = torch.log((hi - lo) / (QUADRATURE_NODES - 1))[:, None] + ends
    safe = committed | ~choose[:, None]  # a row with nothing to choose is computed on dummies, then dropped
    integrand = _log_min_density(w, safe, t) + _log_max_cdf(log_p, stay, t, tau)
    return torch.where(choose, torch.logsumexp(integrand + log_weight, -1), 0.0)


def _ranked_commit_log_prob(log_p: Tensor, lp: Tensor, committed: Tensor, stay: Tensor) -> Tensor:
    """tau = 0: C is committed when every draft of K is less confident than every token of C (ties, of probability
    zero for distinct real logits, ignored): sum_{k in K} log sum_{v: p_k(v) < min_C p_j(x_j)} p_k(v); -inf when no
    such draft exists (the outcome is impossible under the rule)."""
    floor = torch.where(committed, lp, torch.inf).amin(-1)
    below = log_p < floor[:, None, None]
    lse = torch.logsumexp(torch.where(below, log_p, -1e30), -1)  # a finite filler keeps backward free of NaN
    per_position = torch.where(below.any(-1), lse, -torch.inf)
    return torch.where(stay, per_position, 0.0).sum(-1)


@dataclass
class MaskedImageSampler:
    """AmusedScheduler's unmasking step (see the module docstring); ``mask_token_id`` comes from the model."""

    mask_token_id: int
    masking: MaskingSchedule
    token_temperature: float
    choice_temperature: tuple[float, float]
    score: CommitScore  # MaskedImageConfig.score holds the default
    name = "masked_image"
    prediction_types = ("masked_tokens",)
    stochastic = True
    reduction = "sum"  # the log-prob is the step's joint: the committed set and its tokens

    def _probs(self, logits: Tensor) -> Tensor:
        return logits.softmax(-1) if self.token_temperature == 1 else (logits / self.token_temperature).softmax(-1)

    def _draft(self, probs: Tensor, generator: torch.Generator | RowGenerators | None) -> Tensor:
        """Tokens (B, L) drawn from probs (B, L, V): one multinomial over every position (AmusedScheduler's call)."""
        b, length, v = probs.shape
        if isinstance(generator, RowGenerators):
            return torch.stack([torch.multinomial(probs[r].cpu(), 1, generator=g)[:, 0] for r, g in enumerate(generator.generators)]).to(
                probs.device
            )
        flat = probs.to(generator.device) if generator is not None else probs
        return torch.multinomial(flat.reshape(-1, v), 1, generator=generator)[:, 0].view(b, length).to(probs.device)

    def _uniform(self, like: Tensor, generator: torch.Generator | RowGenerators | None) -> Tensor:
        if isinstance(generator, RowGenerators):
            return generator.rand(tuple(like.shape)).to(like.device)
        device = generator.device if generator is not None else like.device
        return torch.zeros_like(like, device=device).uniform_(0, 1, generator=generator).to(like.device)

    def _tau(self, i: int, n: int, device: torch.device | None = None) -> Tensor:
        """tau_i: the Gumbel scale on the confidences at step i of n, linear from the first to the last step."""
        return torch.linspace(*self.choice_temperature, n, device=device)[i]

    def _choose(self, probs: Tensor, draft: Tensor, masked: Tensor, i: int, n: int, noise: Tensor | None) -> Tensor:
        """(B, L) bool: the positions that stay masked after step i of n (``noise``: Gumbel noise, None = greedy)."""
        count = keep_masked(self.masking, i, n, masked.shape[1]).to(probs.device)
        count = torch.max(torch.tensor([1], device=probs.device), torch.min(masked.sum(-1, keepdim=True) - 1, count))
        confidence = probs.gather(-1, draft[..., None])[..., 0]
        confidence = torch.where(masked, confidence, torch.finfo(confidence.dtype).max)  # never re-mask a committed token
        score = torch.log(confidence.clamp(1e-20))
        if noise is not None:
            score = score + self._tau(i, n, probs.device) * noise
        cut_off = torch.sort(score, dim=-1).values.gather(1, count.long())
        return score < cut_off

    def _advance(self, logits: Tensor, x: Tensor, sigma, sigma_next, generator, greedy: bool) -> Tensor:
        tokens = x.long()
        masked = tokens == self.mask_token_id
        probs = self._probs(logits.float())
        draft = probs.argmax(-1) if greedy else self._draft(probs, generator)
        draft = torch.where(masked, draft, tokens)
        if float(sigma_next) <= 0:  # the last step (AmusedScheduler's timestep 0): every masked position takes its draft
            return draft.float()
        i, n = step_position(sigma, sigma_next)
        noise = None if greedy else _gumbel(self._uniform(probs[..., 0], generator))
        stay = self._choose(probs, draft, masked, i, n, noise)
        return torch.where(stay, self.mask_token_id, draft).float()

    def log_prob(self, logits: Tensor, x: Tensor, x_next: Tensor, sigma=None, sigma_next=None) -> Tensor:
        """(B,) the step's log-prob (module docstring): the committed tokens' summed log softmax(logits / T), plus
        log P(C | x_C) under ``score="step"`` (the step's place, ``sigma`` -> ``sigma_next``, gives tau_i)."""
        tokens, nxt = x.long(), x_next.long()
        masked = tokens == self.mask_token_id
        committed = masked & (nxt != self.mask_token_id)
        scaled = logits.float() if self.token_temperature == 1 else logits.float() / self.token_temperature
        log_p = torch.log_softmax(scaled, -1)
        picked = log_p.gather(-1, nxt.clamp_max(logits.shape[-1] - 1)[..., None])[..., 0]
        tokens_part = torch.where(committed, picked, torch.zeros_like(picked)).sum(-1)
        if self.score == "committed_tokens" or sigma_next is None or float(sigma_next) <= 0:
            return tokens_part  # the last step commits every masked position: P(C) = 1
        i, n = step_position(sigma, sigma_next)
        return tokens_part + commit_log_prob(log_p, nxt, committed, masked & ~committed, float(self._tau(i, n)))

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        """Sample the next token state (``x_next`` None) or re-score the given one; ``model_output``: logits (B, L, V)."""
        if x_next is None:
            with torch.no_grad():
                x_next = self._advance(model_output, x, sigma, sigma_next, generator, greedy=False)
        x_next = x_next.float()
        # a token transition has no Gaussian std: 1 keeps noise-level step weighting and RatioNorm's scale neutral
        return StepOutput(
            x_next=x_next, log_prob=self.log_prob(model_output, x, x_next, sigma, sigma_next), mean=x_next, std=x_next.new_ones(())
        )

    @torch.no_grad()
    def deterministic_step(self, model_output, x, sigma, sigma_next) -> Tensor:
        """Greedy: the argmax token everywhere, the most confident positions committed (a step to sigma = 0 commits
        every masked position: SVDD's look-ahead estimate of the clean tokens)."""
        return self._advance(model_output, x, sigma, sigma_next, None, greedy=True)


class MaskedImageConfig(SamplerSection):
    """``sampler.name: masked_image``: AmusedScheduler's confidence-based unmasking over image tokens (aMUSEd,
    the embedded digits_masked model); its defaults are AmusedPipeline's."""

    name: str = "masked_image"
    token_temperature: float = Field(
        1.0, gt=0, description="Temperature T of softmax(logits / T) the tokens are drawn from (aMUSEd samples at 1)."
    )
    choice_temperature: tuple[float, float] = Field(
        (2.0, 0.0), description="Gumbel scale on the confidences that choose the kept tokens, linear from first to last step."
    )
    score: CommitScore = Field(
        "step",
        description="The step's log-prob: 'step' = the exact probability of its outcome (the committed positions and "
        "their tokens, the discarded drafts and the Gumbel noise summed over); 'committed_tokens' = the committed "
        "tokens' softmax alone, flowrl's former score, which omits the choice's probability (biased gradient).",
    )
    prediction_types: ClassVar[tuple[str, ...]] = ("masked_tokens",)

    @field_validator("choice_temperature")
    @classmethod
    def _non_negative(cls, value: tuple[float, float]) -> tuple[float, float]:
        if min(value) < 0:
            raise ValueError(f"choice_temperature is a Gumbel scale, at least 0 at both ends; got {tuple(value)}")
        return value

    def check_run(self, config: Any) -> None:
        objective = config.objective
        if objective.name not in ("grpo", "ddpo"):
            raise ValueError(
                f"sampler 'masked_image' steps over discrete image tokens: it trains with grpo or ddpo (per-step log-probs), "
                f"not objective '{objective.name}'"
            )
        if getattr(objective, "beta", 0) > 0:
            raise ValueError("objective.beta > 0 adds a Gaussian KL per step, which image-token steps do not have; set objective.beta=0")

    def build(self, pipeline: Any) -> MaskedImageSampler:
        return MaskedImageSampler(
            mask_token_id=pipeline.mask_token_id,
            masking=pipeline.schedule.masking,
            token_temperature=self.token_temperature,
            choice_temperature=tuple(self.choice_temperature),
            score=self.score,
        )
