"""The clipped policy-gradient update over denoising steps, shared by GRPO and DDPO.

An objective here is (an advantage estimator) + (this per-step PPO loss). GRPO and DDPO differ only in
how advantages are computed, so they are two advantage estimators plugged into one class rather than
two copies of the loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.log_prob import Reduction
from ..sections import ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .advantages import clip_advantages
from .functional import best_worst_subset, clipped_surrogate, gaussian_kl, inverse_dt_step_weights, masked_mean, noise_level_step_weights

KLForm = Literal["gaussian", "flow_grpo"]
TimestepOrder = Literal["random", "first"]
# none: every step alike; noise_level: TempFlow-GRPO's credit by transition std; inverse_dt: GRPO-Guard's gradient
# re-weighting by 1/|dt| (with ratio_norm: GRPO-Guard in full); both normalised to mean 1 over the trained steps
StepWeighting = Literal["none", "noise_level", "inverse_dt"]


class AdvantageEstimator(Protocol):
    """Advantages (B,) of a scored batch; stateful estimators (DDPO's per-prompt buffers) save their state."""

    def __call__(self, batch: Trajectory) -> Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def choose_train_steps(stochastic: Tensor, fraction: float, order: Literal["random", "first"], generator: torch.Generator) -> list[int]:
    """Pick ``max(1, int(fraction * n))`` of the n stochastic steps: a random subset (DanceGRPO) or the
    first ones in sampling order (Flow-GRPO)."""
    steps = torch.nonzero(stochastic).flatten()
    n = max(1, int(fraction * steps.numel()))
    if order == "random":
        steps = steps[torch.randperm(steps.numel(), generator=generator)]
    return sorted(steps[:n].tolist())


def timestep_fraction_option() -> Any:
    """The ``timestep_fraction`` field of a section whose objective trains a subset of the steps (``choose_train_steps``)."""
    return Field(1.0, gt=0, le=1, description="Fraction of the stochastic steps trained per minibatch.")


def timestep_order_option() -> Any:
    """The ``timestep_order`` field that goes with ``timestep_fraction_option``."""
    return Field(
        "random", description="Which steps timestep_fraction keeps: random ones per minibatch (DanceGRPO) or the first ones (Flow-GRPO)."
    )


def step_ratio_stats(log_ratio: Tensor, valid: Tensor | None, k: int) -> dict[str, Tensor]:
    """The importance ratio's mean and spread (std over the minibatch's samples) at denoising step ``k``:
    GRPO-Guard's diagnostic. Logged as ``policy/ratio_mean/step_kk`` and ``policy/ratio_std/step_kk``
    (plus ``policy/ratio_std``, over every trained step); both are 1 and 0 before the weights move."""
    ratio = torch.exp(log_ratio.float())
    if valid is not None:
        ratio = ratio[valid.to(ratio.device)]
    std = ratio.std(unbiased=False) if ratio.numel() else ratio.new_tensor(float("nan"))
    mean = ratio.mean() if ratio.numel() else ratio.new_tensor(float("nan"))
    return {f"policy/ratio_mean/step_{k:02d}": mean, f"policy/ratio_std/step_{k:02d}": std, "policy/ratio_std": std}


def normalised_log_ratio(
    log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor, reduction: Reduction
) -> Tensor:
    """GRPO-Guard's RatioNorm on one step, as Flow-Factory's ``GRPOGuardTrainer`` computes it. For a Gaussian
    transition with std s, dmu = mu_theta - mu_old and eps = (x_next - mu_old) / s, the log-ratio is
    log r = R(dmu * eps) / s - b, with R the sampler's reduction over the state's dimensions (per-dimension mean by
    default) and b = R(dmu^2) / (2 s^2) >= 0 the sample's left shift (the KL between its two transitions). The
    normalised log-ratio is (log r + b) * s = R(dmu * eps): centred at 0, with a spread that does not depend on s.
    b is each sample's own, from ``mean`` (mu_theta, with its graph) and ``old_mean`` (the rollout's, stored with the
    trajectory), and keeps its gradient as in Flow-Factory, so the gradient is that of R(dmu * eps) alone.
    log_prob, old_log_prob: (B,); mean, old_mean: (B, *S); std: 0-dim or (B, 1, ..., 1). Returns (B,)."""
    shift = gaussian_kl(mean, old_mean.to(mean.device), std, reduction)
    s = std.detach().float().to(shift.device)
    return (log_prob - old_log_prob + shift) * (s.reshape(-1) if s.ndim else s)


def rollout_mean(batch: Trajectory, k: int) -> Tensor:
    """The mean the rollout sampled step ``k`` from (``Trajectory.step_mean``); a clear error when it was not recorded."""
    if batch.step_means is None:
        raise FlowRLError(
            "objective.ratio_norm needs the rollout's step means (Trajectory.step_means), and this batch has none; "
            "collect it with rollout(..., record_means=True), as the trainer does for an objective with needs_step_means."
        )
    return batch.step_mean(k)


def transition_stds(sampler: Sampler, batch: Trajectory, steps: list[int]) -> Tensor:
    """The rollout's transition std at each of ``steps``, (len(steps),). Every stochastic sampler's std is a
    function of (sigma, sigma_next) alone, so the sampler's own step is read on one row with a zero model output:
    no denoiser call, and the std is the one the log-probs were scored with."""
    stds = []
    for k in steps:
        x = batch.latents[:1, k]
        out = sampler.step(torch.zeros_like(x), x, batch.sigmas[k], batch.sigmas[k + 1], x_next=batch.latents[:1, k + 1])
        stds.append(torch.as_tensor(out.std, dtype=torch.float32).reshape(-1).mean())
    return torch.stack(stds)


@dataclass
class PolicyGradientObjective:
    """Clipped surrogate on each trained denoising step, optional KL to the frozen reference.

    KL (``beta > 0``): ``kl_form="gaussian"`` adds ``beta * KL(N(mean_theta, std^2) || N(mean_ref, std^2))``
    per step, reduced like the log-prob (per-dimension mean). ``kl_form="flow_grpo"`` reproduces
    Flow-GRPO's term, which divides by the diffusion coefficient g^2 instead of the transition variance
    g^2 |dt|, i.e. equals the Gaussian KL times |dt|; use it to carry Flow-GRPO's beta values over.

    Step weighting (``step_weighting="noise_level"``, TempFlow-GRPO's noise-aware weighting): the minibatch loss is
    ``(1/|S|) sum_{k in S} (w_k policy_k + beta kl_k)`` with ``w_k = s_k / mean_{j in S} s_j`` over the trained steps
    S and s_k the transition std (functional.noise_level_step_weights); ``"inverse_dt"`` (GRPO-Guard's gradient
    re-weighting) is ``w_k = (1/|dt_k|) / mean_{j in S} (1/|dt_j|)`` (functional.inverse_dt_step_weights); "none"
    is w_k = 1. Only the policy term is weighted (the KL is a regulariser, not credit); ratios and their statistics are untouched.
    """

    name: str
    advantage_estimator: AdvantageEstimator
    clip_range: float
    adv_clip_max: float | None
    beta: float
    kl_form: KLForm
    timestep_fraction: float
    timestep_order: TimestepOrder
    best_worst_k: int | None
    ratio_norm: bool
    step_weighting: StepWeighting
    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=True, init=False)
    minibatch_unit: int = field(default=1, init=False)
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    @property
    def reference(self) -> ReferenceModel:
        return "initial" if self.beta > 0 else "none"  # the KL term compares with the initial model

    @property
    def needs_step_means(self) -> bool:
        """GRPO-Guard's exact shift reads the rollout's step means, so the rollouts record them (Trajectory.step_means)."""
        return self.ratio_norm

    def prepare(self, batch: Trajectory) -> Trajectory:
        batch.advantages = clip_advantages(self.advantage_estimator(batch), self.adv_clip_max)
        if self.best_worst_k is not None:
            batch = batch[best_worst_subset(batch.rewards, batch.group_ids, self.best_worst_k)]
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        steps = choose_train_steps(batch.stochastic, self.timestep_fraction, self.timestep_order, generator)
        advantages = batch.advantages.to(batch.latents.device)
        valid = torch.isfinite(batch.rewards) if batch.rewards is not None else None
        weights = self._step_weights(sampler, batch, steps)
        for i, k in enumerate(steps):
            x, x_next = batch.latents[:, k], batch.latents[:, k + 1]
            sigma, sigma_next = batch.sigmas[k], batch.sigmas[k + 1]
            model_output = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
            out = sampler.step(model_output, x, sigma, sigma_next, x_next=x_next)
            old_log_prob = batch.log_probs[:, k]
            if self.ratio_norm:  # GRPO-Guard: (log r + b) * s, b from the rollout's stored mean; the ratio is exp of that
                old_mean = rollout_mean(batch, k)
                log_prob = normalised_log_ratio(out.log_prob, old_log_prob, out.mean, old_mean, out.std, sampler.reduction)
                old_log_prob = torch.zeros_like(old_log_prob)
            else:
                log_prob = out.log_prob
            policy_loss, stats = clipped_surrogate(log_prob, old_log_prob, advantages, self.clip_range, valid)
            loss = policy_loss if weights is None else weights[i].to(policy_loss.device) * policy_loss
            metrics = {
                "loss/policy": policy_loss.detach(),
                **{f"policy/{n}": v for n, v in stats.items()},
                **step_ratio_stats(log_prob.detach() - old_log_prob, valid, k),
            }
            if self.beta > 0:
                kl = self._kl(pipeline, sampler, batch, k, out.mean, out.std, valid)
                loss = loss + self.beta * kl
                metrics["loss/kl"] = kl.detach()
            yield LossOutput(loss=loss / len(steps), metrics=metrics)

    def _step_weights(self, sampler: Sampler, batch: Trajectory, steps: list[int]) -> Tensor | None:
        """Each trained step's policy-term weight (mean 1 over ``steps``), or None for ``step_weighting: none``."""
        if self.step_weighting == "noise_level":
            return noise_level_step_weights(transition_stds(sampler, batch, steps))
        if self.step_weighting == "inverse_dt":
            index = torch.tensor(steps)
            return inverse_dt_step_weights(batch.sigmas.cpu()[index], batch.sigmas.cpu()[index + 1])
        return None

    def _kl(self, pipeline, sampler, batch: Trajectory, k: int, mean: Tensor, std: Tensor, valid: Tensor | None) -> Tensor:
        x, sigma, sigma_next = batch.latents[:, k], batch.sigmas[k], batch.sigmas[k + 1]
        with torch.no_grad(), pipeline.reference():
            ref_output = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
        ref_mean = sampler.step(ref_output, x, sigma, sigma_next, x_next=batch.latents[:, k + 1]).mean
        kl = gaussian_kl(mean, ref_mean, std, sampler.reduction)  # stochastic samplers declare their reduction
        if self.kl_form == "flow_grpo":
            kl = kl * (sigma - sigma_next).abs()
        return masked_mean(kl, None if valid is None else valid.float())

    def state_dict(self) -> dict[str, Any]:
        return {"advantage_estimator": self.advantage_estimator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.advantage_estimator.load_state_dict(state.get("advantage_estimator", {}))


class PolicyGradientConfig(ObjectiveSection):
    """The knobs GRPO and DDPO share: the per-step clipped surrogate, its KL term and which steps are trained."""

    clip_range: float = Field(
        1e-4, gt=0, description="PPO's clip epsilon of the per-step ratio (tiny: each step's log-prob is a mean over many dimensions)."
    )
    beta: float = Field(0.0, ge=0, description="Weight of the KL to the frozen initial model; 0: no KL term (docs/objectives/grpo.md).")
    kl_form: KLForm = Field(
        "gaussian",
        description="gaussian: the true KL of the two Gaussian transitions; flow_grpo: Flow-GRPO's term (the true KL times |dt|).",
    )
    timestep_fraction: float = timestep_fraction_option()
    timestep_order: TimestepOrder = timestep_order_option()
    # Wang et al. 2025; docs/instruments.md
    ratio_norm: bool = Field(
        False,
        description=(
            "GRPO-Guard: each step's log-ratio plus its sample's exact shift (the KL to the rollout's stored step mean), "
            "times the transition std, centring the ratio at 1."
        ),
    )
    supports_branching: ClassVar[bool] = True  # B2-DiffuRL's branches train a policy-gradient objective

    def policy_gradient(
        self,
        estimator: AdvantageEstimator,
        adv_clip_max: float | None,
        best_worst_k: int | None = None,
        step_weighting: StepWeighting = "none",
    ) -> PolicyGradientObjective:
        """The objective with this section's shared knobs and the estimator and options of the concrete one."""
        shared = {k: getattr(self, k) for k in PolicyGradientConfig.model_fields}  # name and the knobs above
        return PolicyGradientObjective(
            **shared, advantage_estimator=estimator, adv_clip_max=adv_clip_max, best_worst_k=best_worst_k, step_weighting=step_weighting
        )
