"""Policy-gradient objectives for masked-diffusion LMs: diffu-GRPO, UniGRPO, DCoLT, BGPO.

They share GRPO's group advantages and PPO clipping and differ in how they estimate the policy's
log-likelihood (``estimators.py``), which is the extension point:

- diffu-GRPO (d1, arXiv:2504.12216): one forward, completion fully masked, prompt masked at 15%;
  per-token ratios; advantages r - mean (no std); clip 0.5; k3 KL (beta 0.04 in d1); the loss is ONE mean over
  every completion token of the minibatch (``loss_aggregation: token_mean``, d1's
  ``diffu_grpo_trainer.py::compute_loss``), so a longer completion weighs more.
- UniGRPO (MMaDA, arXiv:2505.15809; PAPER-DERIVED: no training code was released, see docs/objectives/dllm.md
  for what flowrl assumed; not arXiv:2603.23500's UniGRPO, a joint GRPO over a reasoning chain and the image it
  conditions, which flowrl does not implement): prompt never masked, answer tokens masked at a ratio ~ U[0.1, 0.9] (the paper:
  U[0, 1]); mean log-prob over the masked tokens; clip 0.2; z-scored advantages; each completion's mean over
  its masked tokens, then the mean over completions (``loss_aggregation: sequence_mean``, GRPO's form).
- DCoLT (LLaDOU, arXiv:2505.10446): the per-step action log-prob of the recorded trajectory (Plackett-Luce
  probability of the ordered unmasked positions under a trainable unmasking-policy head, plus the chosen
  tokens' log-probs; no position term at a step that completes its block, as LLaDOU); PPO per denoising step;
  advantages (r - mean) / (unbiased std + 1e-4); the per-sequence means summed and divided by the number of
  rows with a non-zero advantage (``loss_aggregation: nonzero_advantage_mean``), as LLaDOU's
  ``networks/lladou_v0.py::logprob_loss`` and ``training/training_loop_fsdp.py``.
- BGPO (arXiv:2510.11683): ELBO-based GRPO whose surrogate is replaced by a bound linear in the Monte
  Carlo samples: for A >= 0, exp(d) >= 1 + d (tangent) with d = mean_j d_j; for A < 0, Jensen:
  exp(mean_j d_j) <= mean_j exp(d_j). Both are sums over j, so each MC sample is backpropagated on its
  own (memory flat in the number of samples), and on-policy (d = 0) value and gradient equal the
  ELBO objective's. ``naive=True`` is plain ELBO-GRPO (all samples in one graph) for comparison. One ratio
  per completion, so no token aggregation: the mean over completions.

Mask seeds are stored with the rollout; inner epoch e uses seed ``e % num_mask_seeds`` for both the
old log-probs (computed in prepare, before any update) and the new ones, so the first ratio is exactly 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from ...sections import BuildContext, ObjectiveSection
from ...types import LossOutput, ReferenceModel, Role, TokenTrajectory, TrainedRole, TrainingData
from ..advantages import GroupAdvantages, MultiRewardOption, std_eps_option, std_option
from ..functional import StdConvention, clipped_surrogate_terms, k3_kl, masked_mean
from ..stateless import Stateless
from .estimators import AnswerMaskEstimator, EstimatorOutput, OneStepEstimator, elbo_terms
from .plackett_luce import DCoLTStepLogProb, dcolt_log_probs

# How the per-token terms of a minibatch become one loss (TRL's GRPOConfig.loss_type names in brackets):
#   token_mean:    sum over every counted token of every valid row / their number (d1; TRL "bnpo")
#   sequence_mean: each row's mean over its counted tokens, then the mean over the valid rows (GRPO; TRL "grpo")
LossAggregation = Literal["token_mean", "sequence_mean"]
# DCoLT's per-step terms: each row's mean over its acting steps, then
#   nonzero_advantage_mean: summed over the rows and divided by the number with a non-zero advantage (LLaDOU)
#   sequence_mean:          averaged over the valid rows
DCoLTLossAggregation = Literal["nonzero_advantage_mean", "sequence_mean"]


def _weighted_token_mean(values: Tensor, weights: Tensor) -> Tensor:
    """(B,) sum_i w_i v_i / sum_i w_i: d1's mean over completion tokens, UniGRPO's mean over masked ones."""
    return (weights * values).sum(-1) / weights.sum(-1).clamp(min=1e-8)


def ratio_metrics(loss: Tensor, ratio: Tensor, log_ratio: Tensor | None, counted: Tensor, clip_range: float) -> dict[str, Tensor]:
    """The minibatch's policy loss and its PPO ratio's statistics over the ``counted`` entries (tokens or steps): the mean
    ratio, the fraction outside the clip range and DDPO's approx_kl 0.5 mean (log r)^2 (left out when ``log_ratio`` is None)."""
    metrics = {
        "loss/policy": loss.detach(),
        "policy/ratio_mean": ratio[counted].mean().detach(),
        "policy/clipfrac": ((ratio[counted] - 1).abs() > clip_range).float().mean(),
    }
    if log_ratio is not None:
        metrics["policy/approx_kl"] = (0.5 * log_ratio[counted] ** 2).mean().detach()
    return metrics


@dataclass
class _DLLMBase(Stateless):
    name: str
    clip_range: float
    beta: float
    num_mask_seeds: int
    std: StdConvention
    std_eps: float
    component_weights: dict[str, float] | None = field(default=None, kw_only=True)  # multi_reward per_reward / gdpo
    batch_normalise: bool = field(default=False, kw_only=True)  # multi_reward gdpo
    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=True, init=False)
    minibatch_unit: int = field(default=1, init=False)

    @property
    def reference(self) -> ReferenceModel:
        return "initial" if self.beta > 0 else "none"  # the KL term compares with the initial model

    @property
    def roles(self) -> tuple[Role, ...]:
        return ()  # the language model alone (DCoLT adds its unmasking-policy head)

    @property
    def position_scorer(self) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The sampler's unmasking-order policy (logits, state) -> position scores; None: the sampler's own rule."""
        return None

    def advantages(self, batch: TokenTrajectory) -> Tensor:
        return GroupAdvantages(self.std, self.std_eps, self.component_weights, self.batch_normalise)(batch)

    def _valid(self, batch: TokenTrajectory) -> Tensor:
        return torch.isfinite(batch.rewards).float().to(batch.completion_ids.device)


@dataclass
class TokenPolicyObjective(_DLLMBase):
    """Per-token clipped ratios under a single-pass estimator (diffu-GRPO, UniGRPO)."""

    estimator: Any = None
    loss_aggregation: LossAggregation = field(kw_only=True)

    def prepare(self, batch: TokenTrajectory) -> TokenTrajectory:
        batch.advantages = self.advantages(batch)
        return batch

    def row_weights(self, weights: Tensor, valid: Tensor) -> Tensor:
        """(B,) each row's weight in the loss: its number of counted tokens (token_mean) or 1 (sequence_mean).
        With per-sequence means m_b, token_mean's sum_b n_b m_b / sum_b n_b is the plain mean over all counted
        tokens when a row's token weights are equal (d1: 1 per token through EOS; UniGRPO: 1/|M| on the mask)."""
        if self.loss_aggregation == "token_mean":
            return valid * (weights > 0).sum(-1)
        return valid

    def old_and_ref(self, lm, batch: TokenTrajectory) -> None:
        """Old (and reference) token log-probs for every stored seed, before any update: (B, N, G)."""
        with torch.no_grad():
            batch.old_log_probs = torch.stack([self.estimator(lm, batch, s).token_log_probs for s in range(self.num_mask_seeds)], 1)
            if self.beta > 0:
                with lm.reference():
                    batch.ref_log_probs = torch.stack([self.estimator(lm, batch, s).token_log_probs for s in range(self.num_mask_seeds)], 1)

    def losses(self, lm, sampler, batch: TokenTrajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        s = batch.inner_epoch % self.num_mask_seeds
        out: EstimatorOutput = self.estimator(lm, batch, s)
        adv = batch.advantages.to(out.token_log_probs.device)[:, None]
        log_ratio = out.token_log_probs - batch.old_log_probs[:, s]
        ratio = torch.exp(log_ratio)
        per_seq = _weighted_token_mean(clipped_surrogate_terms(ratio, adv, self.clip_range), out.weights)
        rows = self.row_weights(out.weights, self._valid(batch))
        loss = masked_mean(per_seq, rows)
        metrics = ratio_metrics(loss, ratio, log_ratio, out.weights > 0, self.clip_range)
        if self.beta > 0:
            kl = masked_mean(_weighted_token_mean(k3_kl(out.token_log_probs, batch.ref_log_probs[:, s]), out.weights), rows)
            loss = loss + self.beta * kl
            metrics["loss/kl"] = kl.detach()
        yield LossOutput(loss, metrics)


@dataclass
class BGPOObjective(_DLLMBase):
    """ELBO-GRPO with BGPO's linear bound: one backward per Monte Carlo sample (or ``naive``: one graph)."""

    num_mc_samples: int = field(kw_only=True)
    naive: bool = field(kw_only=True)

    def prepare(self, batch: TokenTrajectory) -> TokenTrajectory:
        batch.advantages = self.advantages(batch)
        return batch

    def _terms(self, lm, batch: TokenTrajectory, s: int) -> Iterator[Tensor]:
        for term in elbo_terms(lm, batch, s, self.num_mc_samples):
            yield term.sequence_log_prob()  # (B,)

    def old_and_ref(self, lm, batch: TokenTrajectory) -> None:
        with torch.no_grad():  # (B, N, n): every MC term of every seed at the rollout weights
            batch.old_log_probs = torch.stack([torch.stack(list(self._terms(lm, batch, s)), 1) for s in range(self.num_mask_seeds)], 1)

    def losses(self, lm, sampler, batch: TokenTrajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        s = batch.inner_epoch % self.num_mask_seeds
        adv = batch.advantages.to(batch.completion_ids.device)
        valid, old = self._valid(batch), batch.old_log_probs[:, s]
        n = self.num_mc_samples
        if self.naive:  # ratio of the averaged ELBO; every sample's graph is alive until backward
            delta = torch.stack(list(self._terms(lm, batch, s)), 1).sub(old).mean(1)
            loss = masked_mean(clipped_surrogate_terms(torch.exp(delta), adv, self.clip_range), valid)
            yield LossOutput(loss, {"loss/policy": loss.detach(), "policy/ratio_mean": torch.exp(delta).mean().detach()})
            return
        for j, term in enumerate(self._terms(lm, batch, s)):
            delta = term - old[:, j]
            # A >= 0: tangent bound 1 + d_j; A < 0: Jensen bound exp(d_j); each is 1/n of the total.
            bound = torch.where(adv >= 0, 1 + delta, torch.exp(delta))
            loss = masked_mean(-adv * bound, valid) / n
            yield LossOutput(loss, {"loss/policy": loss.detach() * n, "policy/ratio_mean": torch.exp(delta).mean().detach()})


class UnmaskingPolicyHead(nn.Module):
    """DCoLT's unmasking policy, kept small: scores each completion position from the LM's own view of it
    (top log-prob, entropy, whether it is masked) and its relative position. LLaDOU reads the LM's last
    hidden layer instead; these features make the head model-agnostic (any MaskedLM exposes logits).

    ``confidence_prior`` c > 0 starts the policy at LLaDA's low-confidence order: the score is
    c * (top log-prob) + net(features) with net's output layer zero-initialised, so the initial
    Plackett-Luce policy unmasks position i with probability proportional to confidence_i ** c (c -> inf:
    exactly low-confidence remasking). RL then adjusts the order from the decoding the LM was trained and
    evaluated with, instead of from an arbitrary one (c = 0: a random head).
    """

    def __init__(self, confidence_prior: float, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.confidence_prior = confidence_prior
        if confidence_prior:
            nn.init.zeros_(self.net[-1].weight)
            nn.init.zeros_(self.net[-1].bias)

    def forward(self, state: Tensor, logits: Tensor, step: int | None = None, mask_token_id: int | None = None) -> Tensor:
        logp = torch.log_softmax(logits.float(), -1)
        top = logp.max(-1).values
        entropy = -(logp.exp() * logp).sum(-1)
        masked = (state == mask_token_id).float() if mask_token_id is not None else torch.ones_like(top)
        pos = torch.linspace(0, 1, state.shape[1], device=state.device).expand_as(top)
        return self.confidence_prior * top + self.net(torch.stack([top, entropy, masked, pos], -1)).squeeze(-1)


@dataclass
class DCoLTObjective(_DLLMBase):
    """PPO on the exact per-step action log-probs of the recorded unmasking trajectory."""

    block_length: int | None = None
    mask_token_id: int | None = None
    head_lr_scale: float = 1.0  # the head's learning rate relative to the LM's (config: scorer_lr_scale)
    head: UnmaskingPolicyHead = field(kw_only=True)
    block_end_order_term: bool = field(kw_only=True)
    loss_aggregation: DCoLTLossAggregation = field(kw_only=True)

    @property
    def roles(self) -> tuple[Role, ...]:
        """The unmasking-policy head: a trained role of its own, small and called at every step of a trajectory inside
        one backward pass, so every process keeps it whole (not sharded); clipped with the language model, with which it
        forms the one policy LLaDOU trains; stored under ``objective.`` in the checkpoint, as since DCoLT landed."""
        return (
            TrainedRole(
                "unmasking_head",
                attribute="head",
                lr_scale=self.head_lr_scale,
                sharded=False,
                clip_with="policy",
                checkpoint_prefix="objective.",
            ),
        )

    @property
    def position_scorer(self) -> Callable[[Tensor, Tensor], Tensor]:
        return self._score_positions

    def _score_positions(self, logits: Tensor, state: Tensor) -> Tensor:
        """The sampler's view of the head (it passes logits first)."""
        return self.head(state, logits, mask_token_id=self.mask_token_id)

    def _scorer(self, state: Tensor, logits: Tensor, step: int) -> Tensor:
        return self.head(state, logits, step, self.mask_token_id)

    def prepare(self, batch: TokenTrajectory) -> TokenTrajectory:
        batch.advantages = self.advantages(batch)
        return batch

    def _log_probs(self, lm, batch: TokenTrajectory) -> Tensor:
        """(B, S) per-step action log-probs of the recorded trajectory."""
        return dcolt_log_probs(lm, self._scorer, batch, self.block_length, DCoLTStepLogProb(self.block_end_order_term))

    def old_and_ref(self, lm, batch: TokenTrajectory) -> None:
        with torch.no_grad():
            batch.old_log_probs = self._log_probs(lm, batch)  # (B, S)

    def row_weights(self, advantages: Tensor, valid: Tensor) -> Tensor:
        """(B,) the rows the loss averages over: those with a non-zero advantage (LLaDOU) or every valid row."""
        if self.loss_aggregation == "nonzero_advantage_mean":
            return valid * (advantages != 0)
        return valid

    def losses(self, lm, sampler, batch: TokenTrajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        new = self._log_probs(lm, batch)  # (B, S), with grad
        acted = batch.unmask_step.new_zeros(batch.old_log_probs.shape, dtype=torch.bool)
        acted.scatter_(1, batch.unmask_step.clamp(max=acted.shape[1] - 1), True)  # steps that unmasked something
        ratio = torch.exp(new - batch.old_log_probs)
        adv = batch.advantages.to(new.device)
        per_seq = (clipped_surrogate_terms(ratio, adv[:, None], self.clip_range) * acted).sum(1) / acted.sum(1).clamp(min=1)
        loss = masked_mean(per_seq, self.row_weights(adv, self._valid(batch)))
        yield LossOutput(loss, ratio_metrics(loss, ratio, None, acted, self.clip_range))


# -- config sections (objective.name) -------------------------------------------------------------------------
class DLLMObjectiveConfig(ObjectiveSection, MultiRewardOption):
    """What the diffusion-LM objectives share: PPO clipping, the k3 KL and the estimator's stored mask seeds."""

    clip_range: float = Field(0.2, gt=0, description="PPO's clip epsilon of the token ratio.")
    beta: float = Field(0.0, ge=0, description="Weight of the k3 KL to the reference (LoRA disabled, or the initial weights); 0: no KL.")
    num_mask_seeds: int = Field(
        1, ge=1, description="Mask seeds stored per rollout; inner epoch e estimates its log-probs with seed e % num_mask_seeds."
    )
    # common random numbers: see modalities/text.py::draw_mask_seeds
    group_shared_masks: bool = Field(True, description="The completions of one prompt share their estimator masks.")
    modality: ClassVar[str] = "text"

    def _common(self, context: BuildContext | None = None) -> dict[str, Any]:
        common = dict(name=self.name, clip_range=self.clip_range, beta=self.beta, num_mask_seeds=self.num_mask_seeds, std=self.std)
        return common | self.multi_reward_kwargs(context)


def loss_aggregation_option(default: LossAggregation) -> Any:
    """The ``loss_aggregation`` field of the per-token objectives' sections (``LossAggregation``)."""
    return Field(
        default,
        description="token_mean: one mean over every completion token of the minibatch; sequence_mean: per completion, then over them.",
    )


class TokenPolicyConfig(DLLMObjectiveConfig):
    """What diffu-GRPO and UniGRPO build: per-token clipped ratios under the single-pass estimator each one names."""

    def estimator(self) -> Any:
        """The single-pass log-likelihood estimator (``estimators.py``) this objective scores completions with."""
        raise NotImplementedError(f"{type(self).__name__} does not say which estimator it uses")

    def build(self, context: BuildContext | None = None) -> TokenPolicyObjective:
        return TokenPolicyObjective(
            **self._common(context), std_eps=1e-8, estimator=self.estimator(), loss_aggregation=self.loss_aggregation
        )


class DiffuGRPOConfig(TokenPolicyConfig):
    """d1: one-pass estimator (completion masked, prompt masked at prompt_mask_prob), r - mean advantages,
    one mean over all completion tokens of the minibatch."""

    name: str = "diffu_grpo"
    clip_range: float = Field(0.5, gt=0)
    prompt_mask_prob: float = Field(
        0.15, ge=0, lt=1, description="Probability each prompt token is masked in the one-pass estimator (d1: 0.15)."
    )
    std: StdConvention = std_option("none", "d1: none")
    # d1's compute_loss: (per_token_loss * completion_mask).sum() / completion_mask.sum() (TRL's "bnpo").
    loss_aggregation: LossAggregation = loss_aggregation_option("token_mean")

    def estimator(self) -> OneStepEstimator:
        return OneStepEstimator(self.prompt_mask_prob)


class UniGRPOConfig(TokenPolicyConfig):
    """MMaDA's UniGRPO (arXiv:2505.15809), paper-derived (no released training code): answer-only masking at a ratio
    ~ U[low, high], z-scored advantages, each completion's mean over its masked tokens then the mean over completions.
    Not the UniGRPO of arXiv:2603.23500 (one GRPO over a reasoning chain and the image it conditions), which flowrl
    does not implement."""

    name: str = "unigrpo"
    mask_low: float = Field(
        0.1, gt=0, lt=1, description="Lowest answer-masking ratio (ratio ~ U[low, high]; the paper U[0, 1], 0.1 / 0.9 are dLLM-RL's)."
    )
    mask_high: float = Field(0.9, gt=0, le=1, description="Highest answer-masking ratio.")
    std: StdConvention = std_option("biased", "z-scored")
    # GRPO's form, as flowrl reads the paper's objective: each completion's mean, then over the G (TRL's "grpo").
    loss_aggregation: LossAggregation = loss_aggregation_option("sequence_mean")

    def estimator(self) -> AnswerMaskEstimator:
        return AnswerMaskEstimator(self.mask_low, self.mask_high)


class DCoLTConfig(DLLMObjectiveConfig):
    """DCoLT: per-step action log-probs (Plackett-Luce unmasking policy + token log-probs), as LLaDOU computes
    them: no position term at a step that completes its block, advantages over the unbiased std, the loss
    divided by the number of rows with a non-zero advantage."""

    name: str = "dcolt"
    std: StdConvention = std_option("unbiased", "LLaDOU: torch's rewards.std()")
    std_eps: float = std_eps_option(1e-4)
    scorer_lr_scale: float = Field(1.0, gt=0, description="The unmasking-policy head's learning rate as a multiple of train.learning_rate.")
    confidence_prior: float = Field(
        0.0, ge=0, description="The head starts as prior * log(confidence): LLaDA's low-confidence order as it grows; 0: a random head."
    )
    block_end_order_term: bool = Field(
        False, description="Also score the order of the positions taken at a block's last step (forced: it takes all that remain)."
    )
    loss_aggregation: DCoLTLossAggregation = Field(
        "nonzero_advantage_mean",
        description="nonzero_advantage_mean: divide by the rows with a non-zero advantage (LLaDOU); sequence_mean: by all rows.",
    )

    def build(self, context: BuildContext | None = None) -> DCoLTObjective:
        block_length = context.sampler.block_length if context is not None else None
        mask_token_id = context.pipeline.mask_token_id if context is not None and context.pipeline is not None else None
        return DCoLTObjective(
            **self._common(context),
            std_eps=self.std_eps,
            block_length=block_length,
            mask_token_id=mask_token_id,
            head_lr_scale=self.scorer_lr_scale,
            head=UnmaskingPolicyHead(confidence_prior=self.confidence_prior),
            block_end_order_term=self.block_end_order_term,
            loss_aggregation=self.loss_aggregation,
        )


class BGPOConfig(DLLMObjectiveConfig):
    """BGPO: linear lower bound of ELBO-GRPO, one backward per Monte Carlo sample."""

    name: str = "bgpo"
    num_mc_samples: int = Field(4, ge=1, description="Monte Carlo samples of the ELBO, one backward each.")
    std: StdConvention = std_option("biased", "z-scored")
    naive: bool = Field(False, description="The plain ELBO-GRPO baseline: all MC samples in one graph (for comparison).")

    def build(self, context: BuildContext | None = None) -> BGPOObjective:
        return BGPOObjective(**self._common(context), std_eps=1e-4, num_mc_samples=self.num_mc_samples, naive=self.naive)
