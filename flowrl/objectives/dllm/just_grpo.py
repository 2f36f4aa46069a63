"""JustGRPO (Ni et al. 2026, "The Flexibility Trap", arXiv:2601.15165; code github.com/LeapLabTHU/JustGRPO): plain GRPO
on a masked-diffusion LM rolled out in LEFT-TO-RIGHT order, with the exact likelihood of that order.

``objective.name: just_grpo``. Training rollouts unmask one token per step, always the leftmost masked position: the
rollout sampler is the run's sampler with ``block_length 1`` and ``steps = gen_length`` (``rollout_sampler``; JustGRPO's
``grpo.py::sample`` calls LLaDA's ``generate`` with ``block_length=1``). Evaluation keeps the run's own sampler, the
usual parallel decoding (the paper's point: train in AR order, decode in parallel).

In that order the policy's probability of a completion y is exact and factorises over positions:

    log pi(y | q) = sum_t log p_theta(y_t | q, y_<t, [MASK] * (G - t))

each factor from one forward of the prompt, the clean prefix and a fully masked suffix (``left_to_right_log_probs``;
JustGRPO's ``logprob_loss`` builds the same input). These are exactly the log-probs the rollout sampler records when
it commits position t. The loss is GRPO's per-token PPO clip on them: advantages (r - mean) / (unbiased std + 1e-4)
over the group, every position of the completion counted (LLaDA's EOS filler included, as JustGRPO), each completion's
sum over its G positions divided by G, summed over completions and divided by the number with a non-zero advantage
(``loss_aggregation: nonzero_advantage_mean``, JustGRPO's ``scale = gain / gen_length / valid_samples``).

Cost: G forwards per completion for the old log-probs and G more (with backward) per update, against one for d1's
estimator; ``positions_per_forward`` groups positions into one batched forward and backpropagates each group on its own
(JustGRPO: one position per forward and backward), so memory is bounded by a group whatever G.

Bidirectional masked-diffusion models only (the embedded arith_mdlm, LLaDA, MMaDA, Dream): a block-diffusion model's
sampler must decode its own block length, so it cannot roll out one token per block; ``block_elbo`` is for those.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from ...errors import FlowRLError
from ...sections import BuildContext
from ...types import LossOutput, MaskedLM, TokenTrajectory
from ..advantages import std_eps_option, std_option
from ..functional import StdConvention, clipped_surrogate_terms, k3_kl
from .estimators import token_log_probs
from .policy import DLLMObjectiveConfig, _DLLMBase, ratio_metrics

# nonzero_advantage_mean: sum over completions of (sum over positions / G), divided by the completions with A != 0
#                         (JustGRPO's grpo.py::logprob_loss with train.py's valid_samples)
# sequence_mean:          the same sum divided by every valid completion (GRPO's mean over completions)
JustGRPOLossAggregation = Literal["nonzero_advantage_mean", "sequence_mean"]


def left_to_right_states(completion_ids: Tensor, positions: Tensor, mask_token_id: int) -> Tensor:
    """(B * n, G) the completion as the left-to-right sampler saw it before committing each of ``positions`` (n,):
    row ``b * n + j`` holds completion b's tokens before position ``positions[j]`` and the mask token from it on."""
    B, G = completion_ids.shape
    before = torch.arange(G, device=completion_ids.device)[None, :] < positions.to(completion_ids.device)[:, None]  # (n, G)
    states = torch.where(before[None], completion_ids[:, None, :], torch.full_like(completion_ids, mask_token_id)[:, None, :])
    return states.reshape(B * len(positions), G)


def left_to_right_log_probs(lm: MaskedLM, traj: TokenTrajectory, positions: Tensor) -> Tensor:
    """(B, n) float32 ``log p(y_t | prompt, y_<t, masks)`` for each t in ``positions``: the exact per-token log-probs of
    the completion in left-to-right order, at temperature 1, from one batched forward of B * n rows."""
    B, G = traj.completion_ids.shape
    n = len(positions)
    states = left_to_right_states(traj.completion_ids, positions, lm.mask_token_id)
    prompt = traj.prompt_ids.repeat_interleave(n, 0)
    attn = torch.cat([traj.prompt_mask.long().repeat_interleave(n, 0), torch.ones_like(states, dtype=torch.long)], 1)
    logits = lm.logits(torch.cat([prompt, states.to(prompt.device)], 1), attn)[:, prompt.shape[1] :]  # (B n, G, V)
    at = positions.to(logits.device).repeat(B)  # row b * n + j reads position positions[j]
    picked = logits[torch.arange(B * n, device=logits.device), at]  # (B n, V)
    targets = traj.completion_ids.to(logits.device).gather(1, positions.to(logits.device)[None].expand(B, n)).reshape(B * n)
    return token_log_probs(picked[:, None], targets[:, None]).reshape(B, n)


@dataclass
class JustGRPOObjective(_DLLMBase):
    """GRPO on the exact left-to-right per-token log-probs of completions rolled out left to right."""

    positions_per_forward: int | None = field(kw_only=True)
    loss_aggregation: JustGRPOLossAggregation = field(kw_only=True)

    def rollout_sampler(self, sampler: Any) -> Any:
        """The run's sampler turned left to right: blocks of one token, one step each (the leftmost masked position is
        the only one a step may commit), no confidence threshold, no cache. Evaluation keeps ``sampler`` itself."""
        return sampler.model_copy(update={"block_length": 1, "steps": sampler.gen_length, "remasking": "low_confidence", "threshold": None})

    def prepare(self, batch: TokenTrajectory) -> TokenTrajectory:
        batch.advantages = self.advantages(batch)
        return batch

    def _chunks(self, G: int) -> list[Tensor]:
        size = G if self.positions_per_forward is None else min(self.positions_per_forward, G)
        return list(torch.arange(G).split(size))

    def log_probs(self, lm: MaskedLM, batch: TokenTrajectory) -> Tensor:
        """(B, G) every position's exact left-to-right log-prob (the policy's log-likelihood is their sum)."""
        return torch.cat([left_to_right_log_probs(lm, batch, c) for c in self._chunks(batch.completion_ids.shape[1])], 1)

    def old_and_ref(self, lm: MaskedLM, batch: TokenTrajectory) -> None:
        """The rollout weights' left-to-right log-probs (B, G), by the same forwards training uses (the first ratio is
        exactly 1), and the reference's when ``beta`` > 0."""
        with torch.no_grad():
            batch.old_log_probs = self.log_probs(lm, batch)
            if self.beta > 0:
                with lm.reference():
                    batch.ref_log_probs = self.log_probs(lm, batch)

    def row_weights(self, advantages: Tensor, valid: Tensor) -> Tensor:
        """(B,) the completions the loss is divided among: those with a non-zero advantage (JustGRPO) or every valid one."""
        if self.loss_aggregation == "nonzero_advantage_mean":
            return valid * (advantages != 0)
        return valid

    def losses(self, lm, sampler, batch: TokenTrajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        """One loss per group of positions (``positions_per_forward``), each backpropagated on its own; their sum is
        ``sum_b valid_b sum_t term_bt / (G * sum_b rows_b)`` with term_bt the clipped PPO term of token t."""
        G = batch.completion_ids.shape[1]
        chunks = self._chunks(G)
        adv = batch.advantages.to(batch.completion_ids.device)
        valid = self._valid(batch)
        denominator = G * self.row_weights(adv, valid).sum().clamp(min=1)
        for positions in chunks:
            new = left_to_right_log_probs(lm, batch, positions)  # (B, n) with grad
            old = batch.old_log_probs[:, positions.to(batch.old_log_probs.device)]
            log_ratio = new - old
            ratio = torch.exp(log_ratio)
            terms = clipped_surrogate_terms(ratio, adv[:, None], self.clip_range)
            loss = (valid[:, None] * terms).sum() / denominator
            counted = valid[:, None].bool().expand_as(ratio)
            metrics = ratio_metrics(loss * len(chunks), ratio, log_ratio, counted, self.clip_range)  # the loader averages chunks
            if self.beta > 0:
                ref = batch.ref_log_probs[:, positions.to(batch.ref_log_probs.device)]
                kl = (valid[:, None] * k3_kl(new, ref)).sum() / denominator
                loss = loss + self.beta * kl
                metrics["loss/kl"] = kl.detach() * len(chunks)
            yield LossOutput(loss, metrics)


class JustGRPOConfig(DLLMObjectiveConfig):
    """JustGRPO (arXiv:2601.15165): rollouts left to right (one token per step, the leftmost masked position), GRPO on the
    exact per-token log-probs of that order; evaluation with the run's own parallel sampler."""

    name: str = "just_grpo"
    clip_range: float = Field(0.2, gt=0, description="PPO's clip epsilon of the per-token ratio (JustGRPO: 0.2).")
    std: StdConvention = std_option("unbiased", "JustGRPO: torch's rewards.std()")
    std_eps: float = std_eps_option(1e-4)
    positions_per_forward: int | None = Field(
        None,
        ge=1,
        description="Completion positions scored in one batched forward and backpropagated together (JustGRPO: 1); None: all.",
    )
    loss_aggregation: JustGRPOLossAggregation = Field(
        "nonzero_advantage_mean",
        description="nonzero_advantage_mean: divide by the completions with a non-zero advantage (JustGRPO); sequence_mean: by all.",
    )

    def check_run(self, config: Any) -> None:
        if config.sampler.name != "masked":
            raise ValueError(
                f"objective just_grpo rolls out with the masked sampler turned left to right, not sampler '{config.sampler.name}'"
            )
        if config.sampler.kv_cache != "none":
            raise ValueError(
                "objective just_grpo rolls out one token per block, which a block-diffusion model's cache (sampler.kv_cache=exact) cannot; use block_elbo for one"
            )

    def build(self, context: BuildContext | None = None) -> JustGRPOObjective:
        lm = context.pipeline if context is not None else None
        if getattr(lm, "block_length", None) is not None:
            raise FlowRLError(
                f"objective just_grpo rolls out one token per block, but this block-diffusion model decodes blocks of {lm.block_length}; use objective.name=block_elbo."
            )
        return JustGRPOObjective(
            **self._common(context),
            std_eps=self.std_eps,
            positions_per_forward=self.positions_per_forward,
            loss_aggregation=self.loss_aggregation,
        )
