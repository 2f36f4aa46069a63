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

The log-prob of a step (what GRPO's ratio reads) is

    log pi(x_{t-1} | x_t) := sum over the positions C committed at this step of log softmax(l_j / T)[x_{t-1, j}],

the exact log-probability of the committed tokens given which positions were committed. What it leaves out is the
probability of the choice C itself: it depends on the policy too (through the confidences of the drafted tokens,
including those of positions that stay masked and whose draft is thrown away) and has no closed form, since it
sums over the discarded drafts and the Gumbel noise. flowrl treats C as part of the environment, given the
recorded trajectory: re-scoring a recorded step reads C from (x_t, x_{t-1}) and gives back the rollout's log-prob
exactly (ratio 1 on re-score). This is the same split diffu-GRPO / UniGRPO make for text (the tokens are scored,
the unmasking order is not) and MaskGRPO's image setting; the gradient is that of the committed tokens'
likelihood, not of the order. docs/model_families/amused.md derives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

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


@dataclass
class MaskedImageSampler:
    """AmusedScheduler's unmasking step (see the module docstring); ``mask_token_id`` comes from the model."""

    mask_token_id: int
    masking: MaskingSchedule
    token_temperature: float
    choice_temperature: tuple[float, float]
    name = "masked_image"
    prediction_types = ("masked_tokens",)
    stochastic = True
    reduction = "sum"  # the log-prob is the joint of the committed tokens

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

    def _choose(self, probs: Tensor, draft: Tensor, masked: Tensor, i: int, n: int, noise: Tensor | None) -> Tensor:
        """(B, L) bool: the positions that stay masked after step i of n (``noise``: Gumbel noise, None = greedy)."""
        count = keep_masked(self.masking, i, n, masked.shape[1]).to(probs.device)
        count = torch.max(torch.tensor([1], device=probs.device), torch.min(masked.sum(-1, keepdim=True) - 1, count))
        confidence = probs.gather(-1, draft[..., None])[..., 0]
        confidence = torch.where(masked, confidence, torch.finfo(confidence.dtype).max)  # never re-mask a committed token
        score = torch.log(confidence.clamp(1e-20))
        if noise is not None:
            tau = torch.linspace(*self.choice_temperature, n, device=probs.device)[i]
            score = score + tau * noise
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

    def log_prob(self, logits: Tensor, x: Tensor, x_next: Tensor) -> Tensor:
        """(B,) the summed log softmax(logits / T) of the tokens committed between x and x_next."""
        tokens, nxt = x.long(), x_next.long()
        committed = (tokens == self.mask_token_id) & (nxt != self.mask_token_id)
        scaled = logits.float() if self.token_temperature == 1 else logits.float() / self.token_temperature
        picked = torch.log_softmax(scaled, -1).gather(-1, nxt.clamp_max(logits.shape[-1] - 1)[..., None])[..., 0]
        return torch.where(committed, picked, torch.zeros_like(picked)).sum(-1)

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        """Sample the next token state (``x_next`` None) or re-score the given one; ``model_output``: logits (B, L, V)."""
        if x_next is None:
            with torch.no_grad():
                x_next = self._advance(model_output, x, sigma, sigma_next, generator, greedy=False)
        x_next = x_next.float()
        # a token transition has no Gaussian std: 1 keeps noise-level step weighting and RatioNorm's scale neutral
        return StepOutput(x_next=x_next, log_prob=self.log_prob(model_output, x, x_next), mean=x_next, std=x_next.new_ones(()))

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
    prediction_types: ClassVar[tuple[str, ...]] = ("masked_tokens",)

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
        )
