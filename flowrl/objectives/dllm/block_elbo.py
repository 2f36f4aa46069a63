"""Block-level ELBO policy optimisation for block-diffusion LMs: LLaDA2.1's EBPO (Bie et al. 2026, "LLaDA2.1: Speeding
Up Text Diffusion via Token Editing", arXiv:2602.08676, section 3, eqs. 4-5). PAPER-DERIVED: no EBPO training code has
been released (the report says it extends AReaL; inclusionAI's dFactory holds supervised training only), so what
flowrl assumed is listed in docs/objectives/dllm.md, "block_elbo: paper-derived".

``objective.name: block_elbo``. A block-diffusion model (block-causal attention, the embedded arith_bd3lm, SDAR / TraDo
style; ``lm.block_length`` set) generates block after block, each block given the CLEAN blocks before it. Its
log-likelihood of a completion y = (y^1 .. y^K) is therefore a sum of per-block terms, each bounded by the block's
masked-diffusion ELBO given the clean prefix. EBPO estimates it on a grid of N timesteps t_n with weights w_n:

    log pi(y | x) >= ELBO(y) ~ sum_n w_n sum_b sum_{i in b, masked at t_n} log p_theta(y_i | x, y^{<b}, y^b_{t_n})

and computes every block's term at timestep n in ONE forward over the composite input ``z_n = [x ; y_{t_n} ; y_0]``
(noised completion beside the clean one) under the block-causal training mask, in which a noised block attends to
itself and the clean blocks before it (BD3-LM's vectorised training; ``block_attention.block_diffusion_training_mask``,
``MaskedDiffusionLM.block_diffusion_logits``): the "vectorised likelihood". ``per_block_elbo_terms`` computes the same
terms with one forward per block (the prompt, the clean earlier blocks and the noised block); the two agree to float
tolerance (tests/test_block_elbo.py), and ``likelihood: per_block`` trains with it.

The objective is PPO's clip on the sequence-level ratio r = exp(ELBO_theta(y) - ELBO_old(y)) (eq. 4, with
eps_low / eps_high), both ELBOs from the same masks (stored seeds, as every flowrl dLLM estimator), so the first ratio is
exactly 1; group advantages; the mean over completions.

Assumptions (the paper leaves them open): the grid is the midpoints t_n = (n - 1/2) / N with w_n = 1 / (N t_n), the
1/t weight of the masked-diffusion ELBO under a midpoint quadrature in t; every completion token is masked
independently with probability t_n (the forward process), the same t_n for every block; the log-ratio is the plain sum
(``log_ratio: sum``, eq. 5) or, optionally, divided by the completion length (``per_token``, as GSPO / ESPO normalise).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ...errors import FlowRLError
from ...sections import BuildContext
from ...types import LossOutput, MaskedLM, TokenTrajectory
from ..advantages import std_eps_option, std_option
from ..functional import StdConvention, k3_kl, masked_mean
from .estimators import row_generators, token_log_probs
from .policy import DLLMObjectiveConfig, _DLLMBase, ratio_metrics

Likelihood = Literal["vectorised", "per_block"]
LogRatio = Literal["sum", "per_token"]


def timestep_grid(num_timesteps: int) -> tuple[Tensor, Tensor]:
    """(N,) timesteps t_n = (n - 1/2) / N and (N,) weights w_n = 1 / (N t_n): the midpoint rule for the ELBO's integral
    over t of (1/t) E[sum of the masked tokens' log-probs]."""
    t = (torch.arange(num_timesteps, dtype=torch.float32) + 0.5) / num_timesteps
    return t, 1.0 / (num_timesteps * t)


def elbo_masks(traj: TokenTrajectory, seed_index: int, num_timesteps: int) -> Tensor:
    """(N, B, G) bool: at timestep n each completion token is masked with probability t_n, drawn from the row's stored
    mask seed ``seed_index`` (so the old and the new policy see the same masks)."""
    t, _ = timestep_grid(num_timesteps)
    G = traj.completion_ids.shape[1]
    masks = torch.stack([torch.rand(num_timesteps, G, generator=g) < t[:, None] for g in row_generators(traj, seed_index)], 1)
    return masks.to(traj.completion_ids.device)


def _block_sums(values: Tensor, block_length: int) -> Tensor:
    """(B, G) -> (B, K): each block's sum."""
    B, G = values.shape
    return values.reshape(B, G // block_length, block_length).sum(-1)


def _check_block_model(lm: MaskedLM, G: int) -> int:
    L = getattr(lm, "block_length", None)
    if L is None:
        raise FlowRLError(
            "objective block_elbo needs a block-diffusion model (block-causal attention, config diffusion_block_length, e.g. arith_bd3lm); this one attends bidirectionally."
        )
    if G % L:
        raise FlowRLError(f"objective block_elbo needs the completion length ({G}) to be a multiple of the model's block length ({L}).")
    return L


def block_token_log_probs(lm: MaskedLM, traj: TokenTrajectory, mask: Tensor) -> Tensor:
    """(B, G) float32 log p(y_i | prompt, y^{<b(i)}, block b(i) noised by ``mask`` (B, G)) for every completion position,
    from ONE forward of the composite input ``[prompt ; noised ; clean]`` under the block-causal training mask."""
    y = traj.completion_ids
    noised = torch.where(mask.to(y.device), lm.mask_token_id, y)
    logits = lm.block_diffusion_logits(traj.prompt_ids, traj.prompt_mask, noised.to(traj.prompt_ids.device), y.to(traj.prompt_ids.device))
    return token_log_probs(logits, y.to(logits.device))


def vectorised_elbo_terms(lm: MaskedLM, traj: TokenTrajectory, masks: Tensor) -> Tensor:
    """(B, N, K) every block's weighted ELBO term at every timestep: per timestep n ONE forward of the composite input
    ``[prompt ; y_{t_n} ; y_0]`` under the block-causal training mask (every block at once)."""
    L = _check_block_model(lm, traj.completion_ids.shape[1])
    _, w = timestep_grid(masks.shape[0])
    terms = []
    for n, mask in enumerate(masks):
        lp = block_token_log_probs(lm, traj, mask)
        terms.append(_block_sums(torch.where(mask.to(lp.device), lp, 0.0), L) * float(w[n]))
    return torch.stack(terms, 1)


def per_block_elbo_terms(lm: MaskedLM, traj: TokenTrajectory, masks: Tensor) -> Tensor:
    """(B, N, K) the same terms as ``vectorised_elbo_terms`` with one forward per block and timestep: block b's input is
    ``[prompt ; y^{<b} ; y^b_{t_n}]`` (clean earlier blocks, the noised block last) with the model's block-causal
    attention, exactly the context the sampler gives block b while it denoises it."""
    L = _check_block_model(lm, traj.completion_ids.shape[1])
    _, w = timestep_grid(masks.shape[0])
    y = traj.completion_ids
    B, G = y.shape
    P = traj.prompt_ids.shape[1]
    terms = torch.zeros(B, masks.shape[0], G // L, device=y.device)
    for n, mask in enumerate(masks):
        noised = torch.where(mask, lm.mask_token_id, y)
        for b in range(G // L):
            lo, hi = b * L, (b + 1) * L
            ids = torch.cat([traj.prompt_ids, y[:, :lo].to(traj.prompt_ids.device), noised[:, lo:hi].to(traj.prompt_ids.device)], 1)
            attn = torch.cat([traj.prompt_mask.long(), torch.ones(B, hi, dtype=torch.long, device=traj.prompt_ids.device)], 1)
            logits = lm.logits(ids, attn)[:, P + lo :]
            lp = token_log_probs(logits, y[:, lo:hi].to(logits.device))
            terms[:, n, b] = torch.where(mask[:, lo:hi].to(lp.device), lp, 0.0).sum(-1) * float(w[n])
    return terms


@dataclass
class BlockELBOObjective(_DLLMBase):
    """PPO clip on the sequence ratio exp(ELBO_new - ELBO_old), the ELBO a sum of block terms (LLaDA2.1's EBPO)."""

    num_timesteps: int = field(kw_only=True)
    clip_range_high: float | None = field(kw_only=True)
    likelihood: Likelihood = field(kw_only=True)
    log_ratio: LogRatio = field(kw_only=True)

    def prepare(self, batch: TokenTrajectory) -> TokenTrajectory:
        batch.advantages = self.advantages(batch)
        return batch

    def block_terms(self, lm: MaskedLM, batch: TokenTrajectory, seed_index: int) -> Tensor:
        """(B, N, K) the weighted ELBO terms of every block at every timestep, masks from stored seed ``seed_index``."""
        masks = elbo_masks(batch, seed_index, self.num_timesteps)
        compute = vectorised_elbo_terms if self.likelihood == "vectorised" else per_block_elbo_terms
        return compute(lm, batch, masks)

    def _sequence(self, terms: Tensor, G: int) -> Tensor:
        """(B,) the ELBO the ratio is taken of: the sum of the block terms (``sum``) or that over the length (``per_token``)."""
        total = terms.sum((1, 2))
        return total / G if self.log_ratio == "per_token" else total

    def old_and_ref(self, lm: MaskedLM, batch: TokenTrajectory) -> None:
        """(B, S, N, K) the rollout weights' block terms for every stored seed (and the reference's), before any update."""
        seeds = range(self.num_mask_seeds)
        with torch.no_grad():
            batch.old_log_probs = torch.stack([self.block_terms(lm, batch, s) for s in seeds], 1)
            if self.beta > 0:
                with lm.reference():
                    batch.ref_log_probs = torch.stack([self.block_terms(lm, batch, s) for s in seeds], 1)

    def surrogate_terms(self, ratio: Tensor, advantages: Tensor) -> Tensor:
        """Elementwise max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (eq. 4)."""
        high = self.clip_range if self.clip_range_high is None else self.clip_range_high
        return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - self.clip_range, 1.0 + high))

    def losses(self, lm, sampler, batch: TokenTrajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        s = batch.inner_epoch % self.num_mask_seeds
        G = batch.completion_ids.shape[1]
        terms = self.block_terms(lm, batch, s)  # (B, N, K), with grad through N forwards
        new = self._sequence(terms, G)
        log_ratio = new - self._sequence(batch.old_log_probs[:, s], G)
        ratio = torch.exp(log_ratio)
        adv = batch.advantages.to(ratio.device)
        valid = self._valid(batch)
        loss = masked_mean(self.surrogate_terms(ratio, adv), valid)
        high = self.clip_range if self.clip_range_high is None else self.clip_range_high
        metrics = ratio_metrics(loss, ratio, log_ratio, valid.bool(), self.clip_range)
        metrics["policy/clipfrac"] = ((ratio[valid.bool()] < 1 - self.clip_range) | (ratio[valid.bool()] > 1 + high)).float().mean()
        metrics["policy/elbo_per_token"] = (terms.detach().sum((1, 2)) / G).mean()
        if self.beta > 0:
            kl = masked_mean(k3_kl(new, self._sequence(batch.ref_log_probs[:, s], G)), valid)
            loss = loss + self.beta * kl
            metrics["loss/kl"] = kl.detach()
        yield LossOutput(loss, metrics)


class BlockELBOConfig(DLLMObjectiveConfig):
    """block_elbo: LLaDA2.1's EBPO for block-diffusion models (paper-derived): the sequence ELBO as a sum of block terms,
    every block's term at a timestep from one block-causal forward of [prompt ; noised ; clean], PPO clip on its ratio."""

    name: str = "block_elbo"
    clip_range: float = Field(0.2, gt=0, description="PPO's lower clip epsilon (eps_low) of the sequence ELBO ratio.")
    clip_range_high: float | None = Field(
        None, gt=0, description="PPO's upper clip epsilon (eps_high) of the ratio; None: clip_range (symmetric)."
    )
    num_timesteps: int = Field(
        2, ge=1, description="Timesteps N of the ELBO's grid t_n = (n - 1/2) / N (weights 1 / (N t_n)): N forwards per estimate."
    )
    likelihood: Likelihood = Field(
        "vectorised",
        description="vectorised: one forward per timestep for every block (EBPO); per_block: one per block and timestep (same values).",
    )
    log_ratio: LogRatio = Field(
        "sum", description="sum: the ratio of the summed block ELBOs (the paper's eq. 5); per_token: that log-ratio over the length."
    )
    std: StdConvention = std_option("biased", "z-scored")
    std_eps: float = std_eps_option(1e-4)

    @model_validator(mode="after")
    def _clip(self):
        if self.clip_range >= 1:
            raise ValueError(f"objective.clip_range ({self.clip_range}) must be below 1 (the ratio's lower clip is 1 - clip_range)")
        return self

    def check_run(self, config: Any) -> None:
        if config.sampler.name != "masked":
            raise ValueError(f"objective block_elbo scores completions of the masked (block) sampler, not sampler '{config.sampler.name}'")

    def build(self, context: BuildContext | None = None) -> BlockELBOObjective:
        lm = context.pipeline if context is not None else None
        if lm is not None and getattr(lm, "block_length", None) is None:
            raise FlowRLError(
                "objective block_elbo needs a block-diffusion model (block-causal attention, config diffusion_block_length, e.g. arith_bd3lm); use just_grpo, diffu_grpo or bgpo for a bidirectional one."
            )
        return BlockELBOObjective(
            **self._common(context),
            std_eps=self.std_eps,
            num_timesteps=self.num_timesteps,
            clip_range_high=self.clip_range_high,
            likelihood=self.likelihood,
            log_ratio=self.log_ratio,
        )
