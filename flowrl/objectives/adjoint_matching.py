"""Adjoint Matching (Domingo-Enrich, Drozdzal, Karrer, Chen, ICLR 2025), in flowrl's time convention.

Goal: fine-tune so that the model samples the tilted distribution p*(x) ∝ p_base(x) exp(lambda r(x)).
Stochastic optimal control: the fine-tuned reverse process adds a control u to the base drift; with the
*memoryless* noise schedule (start noise independent of the sample) the optimal control makes the model's
samples exactly p*, and the optimal fine-tuned model is the base model's own kind of predictor for p*.

Time. flowrl runs sigma from 1 (noise) to 0 (data); the paper's generation time is t = 1 - sigma, so
d/dt = -d/dsigma. A step k goes from sigma_k to sigma_{k+1} < sigma_k; h_k = sigma_k - sigma_{k+1} > 0 is
the paper's dt.

Noising: x_sigma = alpha x0 + beta eps (flow: alpha = 1 - sigma, beta = sigma; DDPM: alpha = sqrt(abar),
beta = sqrt(1 - abar), abar from DiscreteSchedule). The memoryless reverse SDE is the time reversal of the
forward noising SDE: diffusion g(sigma)^2 = 2 beta (beta' - beta alpha' / alpha) per unit sigma, i.e.
2 sigma / (1 - sigma) for a flow (:func:`memoryless_flow_diffusion_sq`) and -d log abar / dsigma for a DDPM
(:func:`memoryless_vp_diffusion_sq`), and sigma-drift ``dx/dsigma = f_fwd - g^2 score``; for a flow that is
``2 v + x / (1 - sigma)`` (:func:`memoryless_flow_drift`). flowrl samples it with exact posterior steps
(``flow_memoryless``; ``ddim`` with eta = 1, whose variance is :func:`ddpm_memoryless_variance`).

Control. Only the score term of the drift depends on the model, so the control (drift difference over g,
the paper's u = (b_ft - b_base) / sigma(t)) is

    u = g (score_ft - score_base) = g dscore,     score = -(x - alpha x0_hat) / beta^2   (:func:`score_difference`)

(flow: dscore = -(1 - sigma) dv / sigma, so u = -2 dv / g; epsilon: dscore = -deps / beta).

Lean adjoint. a_K = -lambda grad r(x_K) (the reward gradient through decode), then backwards along the
*base* dynamics with the noise held fixed: a_k = (d m_k / d x_k)^T a_{k+1}, one vector-Jacobian product of
the base model's step mean m_k per step (:func:`lean_adjoint_step`; the paper's a + VJP(dt b_base), as
m = x + dt b). It equals -grad_{x_k} lambda r(x_K) through the noise-fixed base rollout (tested against
autograd). In sigma: da/dsigma = -(df/dx)^T a, the paper's da/dt = -(db/dx)^T a with both signs flipped
(dsigma = -dt, f = -b). flowrl's steps use the exact conditional mean m_k(x) = E[x_{k+1} | x_k = x] (no
Euler singularity at sigma = 1), which makes a_k exact for a Gaussian base.

Loss, per trained step k and sample (summed over the state's dimensions, as the authors do):

    L_k = w_k || dscore(x_k) + a_k ||^2,   w_k = integral of g^2 over the step   (:func:`memoryless_step_weight`)

i.e. the paper's ||u + sigma(t) a||^2 dt with g^2 integrated over the step instead of frozen at its start
(finite at both ends of a DDPM schedule and at sigma -> 0 for a flow). The control at x_k is matched to the
adjoint at x_k, as in the authors' code. Its fixed point is dscore(x) = -E[a_k | x_k = x] = grad log h(x),
h = E[exp(lambda r(x0)) | x_sigma = x] under the base: by Tweedie, exactly the score of p* noised to sigma,
so the fixed point is the same whatever the step count or the loss weights, and the fine-tuned model can be
sampled with any sampler. For a Gaussian base and a linear reward a_k is deterministic and the loss is
exactly zero at the closed-form velocity of the tilted Gaussian (tested). (Regressing the scaled difference of
two discrete step means instead, as the authors' DDIM code does, targets the optimum of the *discrete* chain:
with flowrl's exact posterior steps on 20 steps that control is 4x smaller than the continuous one at
sigma = 0.1, so a model trained that way is only right under that very sampler.)

Which steps are trained: every step whose score depends on the model (a flow's sigma = 1 step and a
zero-terminal-SNR DDPM's first step do not: alpha = 0 there, the score is -x for any model and g is infinite), including the deterministic last step into sigma = 0.
``num_trained_steps`` of them per minibatch (the same for every row), stratified as in the authors' code:
half (rounded down) from the first ``early_fraction`` of the steps (noise side), the rest from the later
ones near the data, which are therefore sampled more densely.

Normalisation and clipping (the authors' code): the minibatch loss is the mean of L over (rows x trained
steps), with rows whose sqrt(L) is at or above a threshold counted as zero. The threshold is an EMA (decay
``clip_ema_decay``; the first updates are plain averages) of the ``clip_quantile`` quantile of sqrt(L) over the
minibatch's rows and trained steps. flowrl backpropagates one step at a time (memory flat in the number of
trained steps), so a minibatch is clipped with the EMA of the *previous* minibatches and then folded into it;
the first minibatch is not clipped (the authors' threshold includes the current batch with weight
1 - decay). The EMA is per process and is in ``state_dict``, so a resumed run is exact. Rows whose reward
is not finite are left out of the mean (flowrl's convention for dropped samples).

Classifier-free guidance, as the authors recommend ("fine-tuning with CFG trajectories"): guided rollouts,
while the base model of the adjoint and both scores of the control are unguided. In flowrl that is
``rollout.guidance_mode: cfg_rollout_only``, under which the loop hands the objective
``batch.guidance_scale = 1``; this objective uses ``batch.guidance_scale`` for the base and the fine-tuned
predictions alike, so ``guidance_mode: cfg`` is the authors' "full CFG fine-tuning" (the target is then the
tilt of the guided distribution; they found the adjoint blows up). The authors' optional prompt dropout of
the control is not implemented (their published models used 0).

Memory: the adjoint pass keeps one step's graph at a time (one base forward + one VJP per step, freed before
the next), so beyond the stored trajectory memory does not grow with the number of steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory

# -----------------------------------------------------------------------------------------------
# Pure math
# -----------------------------------------------------------------------------------------------


def memoryless_flow_diffusion_sq(sigma: Tensor) -> Tensor:
    """g(sigma)^2 = 2 sigma / (1 - sigma), per unit sigma: the memoryless schedule of a rectified flow.

    With alpha = 1 - sigma, beta = sigma: g^2 = 2 beta (beta' - beta alpha' / alpha) = 2 sigma (1 + sigma / (1 - sigma))
    (the paper's sigma(t)^2 = 2 eta_t at t = 1 - sigma). Infinite at sigma = 1, which is why flowrl steps it
    as the exact posterior (FlowMemorylessSampler) rather than by Euler-Maruyama.
    """
    return 2 * sigma / (1 - sigma)


def memoryless_flow_drift(v: Tensor, x: Tensor, sigma: Tensor) -> Tensor:
    """dx/dsigma of the memoryless reverse SDE of a flow model with velocity v (= dx/dsigma of the ODE).

    Forward noising in sigma: dx = -x / (1 - sigma) dsigma + g dW; its reversal has drift
    -x / (1 - sigma) - g^2 score, score = -(x + (1 - sigma) v) / sigma, which with g^2 = 2 sigma / (1 - sigma) is
    2 v + x / (1 - sigma). The paper's drift in t = 1 - sigma is its negative.
    """
    return 2 * v + x / (1 - sigma)


def memoryless_vp_diffusion_sq(alpha_bar: Tensor, dalpha_bar_dsigma: Tensor) -> Tensor:
    """g(sigma)^2 = -d log abar / dsigma: the memoryless schedule of a DDPM (variance-preserving) model.

    alpha = sqrt(abar), beta = sqrt(1 - abar) in 2 beta (beta' - beta alpha' / alpha) gives
    -abar' - (1 - abar) abar' / abar = -abar' / abar: the forward VP SDE's own beta(sigma), i.e. DDPM's reverse SDE.
    """
    return -dalpha_bar_dsigma / alpha_bar


def ddpm_memoryless_variance(alpha_bar: Tensor, alpha_bar_next: Tensor) -> Tensor:
    """Variance of DDIM's eta = 1 step (DDPM's posterior), (1 - a') / (1 - a) (1 - a / a'), a = abar(sigma_k),
    a' = abar(sigma_{k+1}). For small steps ~ log(a' / a) = integral of g^2 (:func:`memoryless_vp_diffusion_sq`):
    DDIM with eta = 1 is the memoryless schedule of a DDPM model."""
    return (1 - alpha_bar_next) / (1 - alpha_bar) * (1 - alpha_bar / alpha_bar_next)


def _alpha_bar(schedule: Any, sigma: Tensor, device: torch.device) -> Tensor:
    return schedule.alpha_bar(torch.as_tensor(sigma)).to(device=device, dtype=torch.float32)


def score_difference(out_ft: Tensor, out_base: Tensor, sigma: Tensor, prediction_type: str, schedule: Any = None) -> Tensor:
    """score_ft - score_base at (x, sigma) from two model outputs; x cancels (every score is affine in the output).

    flow:         score = -(x + (1 - sigma) v) / sigma                 -> -(1 - sigma) dv / sigma
    epsilon:      score = -eps / sqrt(1 - abar)                       -> -deps / sqrt(1 - abar)
    v_prediction: eps = sqrt(abar) v + sqrt(1 - abar) x               -> -sqrt(abar) dv / sqrt(1 - abar)
    """
    diff = out_ft.float() - out_base.float()
    if prediction_type == "flow":
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=diff.device)
        return -(1 - sigma) / sigma * diff
    abar = _alpha_bar(schedule, sigma, diff.device)
    if prediction_type == "epsilon":
        return -diff / (1 - abar).sqrt()
    if prediction_type == "v_prediction":
        return -(abar.sqrt() / (1 - abar).sqrt()) * diff
    raise FlowRLError(f"adjoint_matching does not know prediction type '{prediction_type}'.")


def memoryless_step_weight(sigma: Tensor, sigma_next: Tensor, prediction_type: str, schedule: Any = None) -> Tensor:
    """The integral of g^2 over [sigma_next, sigma]: the weight of a step's loss (the paper's sigma(t)^2 dt).

    flow: 2 log((1 - sigma_next) / (1 - sigma)) - 2 (sigma - sigma_next) (infinite from sigma = 1);
    DDPM: log(abar(sigma_next) / abar(sigma)).
    """
    if prediction_type == "flow":
        s, sn = (torch.as_tensor(v, dtype=torch.float64) for v in (sigma, sigma_next))
        return (2 * torch.log((1 - sn) / (1 - s)) - 2 * (s - sn)).float()
    device = torch.device("cpu")
    return torch.log(_alpha_bar(schedule, sigma_next, device).double() / _alpha_bar(schedule, sigma, device).double()).float()


def output_weight(sigma: Tensor, sigma_next: Tensor, prediction_type: str, schedule: Any = None) -> Tensor:
    """A step weight that makes the loss uniform in the model's output units per unit sigma: (sigma - sigma_next) / c^2,
    where dscore = c * (out_ft - out_base) (:func:`score_difference`), so that w ||dscore + a||^2 =
    (sigma - sigma_next) ||dout + a / c||^2. ``loss_weighting: output``: flowrl's option (docs/objectives/adjoint_matching.md).
    Any positive weight per noise level leaves the fixed point where it is (the loss is a regression at each x_k);
    this one moves effort toward high noise, where the paper's weight, in velocity units 2 h (1 - sigma) / sigma for a
    flow, all but vanishes and an ODE sampler still runs through the model."""
    h = torch.as_tensor(sigma, dtype=torch.float64) - torch.as_tensor(sigma_next, dtype=torch.float64)
    if prediction_type == "flow":
        s = torch.as_tensor(sigma, dtype=torch.float64)
        c = (1 - s) / s
    else:
        abar = _alpha_bar(schedule, sigma, torch.device("cpu")).double()
        c = 1 / (1 - abar).sqrt() if prediction_type == "epsilon" else abar.sqrt() / (1 - abar).sqrt()
    return (h / c**2).float()


def score_depends_on_model(sigma: Tensor, prediction_type: str, schedule: Any = None) -> bool:
    """False where the signal is gone (alpha = 0): a flow at sigma = 1, or a zero-terminal-SNR DDPM
    (CogVideoX, rescaled betas) at its first step, where abar = 0. There every model has the same score
    (-x for unit noise) and the step's weight, the integral of g^2, is infinite."""
    if prediction_type == "flow":
        return float(sigma) < 1.0
    return float(_alpha_bar(schedule, sigma, torch.device("cpu"))) > 0.0


def lean_adjoint_step(base_step: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor, a_next: Tensor) -> tuple[Tensor, Tensor]:
    """One backward step of the lean adjoint: a_k = (d m(x_k) / d x_k)^T a_{k+1}.

    ``base_step`` maps x_k to (the base transition mean m_k(x_k) with zero noise, the base model's output).
    Returns (a_k, base output), detached: the step's graph is freed here, so memory does not grow with the
    number of steps. Runs with gradients whatever the caller's grad / inference mode.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x = x.detach().clone().requires_grad_(True)
        mean, output = base_step(x)
        (a,) = torch.autograd.grad(mean, x, grad_outputs=a_next.to(mean.dtype))
    return a.detach(), output.detach()


def adjoint_matching_residual(dscore: Tensor, a: Tensor, weight: Tensor) -> Tensor:
    """Per-sample weight * ||dscore + a||^2 (B,), summed over every non-batch dimension."""
    return weight * ((dscore.float() + a.float()) ** 2).flatten(1).sum(1)


def ema_update(value: float | None, updates: int, new: float, decay: float) -> float:
    """The authors' EMA: the first value as is, a plain average while updates < 1 / decay, then
    ``decay * value + (1 - decay) * new``."""
    if value is None or updates == 0:
        return new
    if updates < 1 / decay:
        return new / (updates + 1) + (1 - 1 / (updates + 1)) * value
    return decay * value + (1 - decay) * new


def stratified_steps(trainable: Tensor, num: int | None, early_fraction: float, generator: torch.Generator) -> list[int]:
    """Pick ``num`` of the trainable steps (bool (K,)): ``num // 2`` from the first ``early_fraction`` of them
    (noise side), the rest from the later ones (data side); all of them when num is None or too large."""
    steps = torch.nonzero(trainable).flatten()
    n = steps.numel()
    if num is None or num >= n:
        return steps.tolist()
    split = min(max(round(n * early_fraction), 1), n - 1)
    early, late = steps[:split], steps[split:]
    n_early = min(num // 2, early.numel())
    n_late = min(num - n_early, late.numel())
    n_early = min(num - n_late, early.numel())  # a short stratum's share goes to the other one
    pick = torch.cat(
        [
            early[torch.randperm(early.numel(), generator=generator)[:n_early]],
            late[torch.randperm(late.numel(), generator=generator)[:n_late]],
        ]
    )
    return sorted(pick.tolist())


# -----------------------------------------------------------------------------------------------
# The objective
# -----------------------------------------------------------------------------------------------


@dataclass
class AdjointMatchingObjective:
    """Adjoint Matching on reward-gradient rollouts (module docstring for the math and every choice).

    reward_multiplier: lambda; the target is p_base(x) exp(lambda r(x)).
    num_trained_steps: steps per minibatch that get a loss (None: every trainable step).
    early_fraction: where the stratified step draw splits the trainable steps (authors: 0.6).
    clip_quantile: per-sample clipping at the EMA'd quantile of sqrt(loss) (None: no clipping).
    clip_ema_decay: decay of that EMA.
    loss_weighting: "memoryless" (the paper's integral of g^2) or "output" (:func:`output_weight`).
    """

    reward_multiplier: float
    num_trained_steps: int | None
    early_fraction: float
    clip_quantile: float | None
    clip_ema_decay: float
    loss_weighting: str
    name: str = field(default="adjoint_matching", init=False)
    trains_on: TrainingData = field(default="reward_gradient_rollouts", init=False)
    needs_log_probs: bool = field(default=False, init=False)
    reference: ReferenceModel = field(default="initial", init=False)  # the base drift of the adjoint and of the control
    minibatch_unit: int = field(default=1, init=False)
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone
    _clip_ema: float | None = field(default=None, init=False, repr=False)
    _clip_updates: int = field(default=0, init=False, repr=False)

    def prepare(self, batch: Trajectory) -> Trajectory:
        if batch.reward_grads is None:
            raise FlowRLError(
                "objective 'adjoint_matching' needs the reward gradient of every sample (Trajectory.reward_grads); "
                "the loop must collect reward_gradient_rollouts."
            )
        if batch.reward_grads.shape != batch.latents[:, -1].shape:
            raise FlowRLError(
                f"reward_grads has shape {tuple(batch.reward_grads.shape)} but the final states have shape "
                f"{tuple(batch.latents[:, -1].shape)}."
            )
        return batch

    def trainable_steps(self, pipeline: Pipeline, batch: Trajectory) -> Tensor:
        """(K,) bool: the steps whose score depends on the model."""
        schedule = getattr(pipeline, "schedule", None)
        return torch.tensor([score_depends_on_model(s, pipeline.prediction_type, schedule) for s in batch.sigmas[:-1]], dtype=torch.bool)

    # -- the two passes -----------------------------------------------------------------------------
    def _base_step(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, k: int) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
        """x_k -> (the base model's transition mean of step k, its output). The mean is the rollout's step
        with zero noise (its deterministic step outside an SDE window)."""
        sigma, sigma_next = batch.sigmas[k], batch.sigmas[k + 1]

        def step(x: Tensor) -> tuple[Tensor, Tensor]:
            with pipeline.reference():
                out = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
            if bool(batch.stochastic[k]):
                return sampler.step(out, x, sigma, sigma_next, x_next=x.detach()).mean, out  # x_next given: no noise drawn
            return sampler.deterministic_step(out, x, sigma, sigma_next), out

        return step

    def adjoints(
        self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, steps: list[int]
    ) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """For each step k in ``steps``: (a_k, the base model's output at x_k), both detached.

        Integrates the lean adjoint from a_K = -lambda * reward_grads down to a_{min(steps)}: one base VJP
        per step, each graph freed before the next.
        """
        a = -self.reward_multiplier * batch.reward_grads.float().to(batch.latents.device)
        adjoint: dict[int, Tensor] = {}
        base_out: dict[int, Tensor] = {}
        wanted = set(steps)
        for k in range(batch.num_steps - 1, min(steps) - 1, -1):
            a, out = lean_adjoint_step(self._base_step(pipeline, sampler, batch, k), batch.latents[:, k], a)
            if k in wanted:
                adjoint[k], base_out[k] = a, out
        return adjoint, base_out

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        self.prepare(batch)
        steps = stratified_steps(self.trainable_steps(pipeline, batch), self.num_trained_steps, self.early_fraction, generator)
        if not steps:
            raise FlowRLError("objective 'adjoint_matching' found no step to train: the time grid has no step below sigma = 1.")
        adjoint, base_out = self.adjoints(pipeline, sampler, batch, steps)
        device = batch.latents.device
        valid = (
            torch.isfinite(batch.rewards.to(device))
            if batch.rewards is not None
            else torch.ones(len(batch), dtype=torch.bool, device=device)
        )
        n_valid = valid.sum().clamp(min=1)
        threshold = self._clip_ema if self.clip_quantile is not None else None
        schedule = getattr(pipeline, "schedule", None)
        seen: list[Tensor] = []
        for k in steps:
            x, sigma, sigma_next = batch.latents[:, k], batch.sigmas[k], batch.sigmas[k + 1]
            weigh = output_weight if self.loss_weighting == "output" else memoryless_step_weight
            weight = weigh(sigma, sigma_next, pipeline.prediction_type, schedule).to(device)
            out = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
            dscore = score_difference(out, base_out[k], sigma, pipeline.prediction_type, schedule)
            per_sample = adjoint_matching_residual(dscore, adjoint[k], weight)
            root = per_sample.detach().sqrt()
            keep = valid if threshold is None else valid & (root < threshold)
            loss = (per_sample * keep).sum() / n_valid
            seen.append(root[valid])
            with torch.no_grad():
                vf = valid.float()
                metrics = {
                    "loss/adjoint_matching": loss.detach(),
                    "adjoint/control_norm": (weight * (dscore.detach() ** 2).flatten(1).sum(1) * vf).sum() / n_valid,
                    "adjoint/target_norm": (weight * (adjoint[k] ** 2).flatten(1).sum(1) * vf).sum() / n_valid,
                    "adjoint/clipped_fraction": (valid & ~keep).float().sum() / n_valid,
                }
                if threshold is not None:
                    metrics["adjoint/clip_threshold"] = torch.tensor(threshold)
            yield LossOutput(loss=loss / len(steps), metrics=metrics)
        if self.clip_quantile is not None:
            values = torch.cat(seen)
            if values.numel():
                self._clip_ema = ema_update(
                    self._clip_ema, self._clip_updates, float(torch.quantile(values.double(), self.clip_quantile)), self.clip_ema_decay
                )
                self._clip_updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"clip_ema": self._clip_ema, "clip_updates": self._clip_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._clip_ema = state.get("clip_ema")
        self._clip_updates = int(state.get("clip_updates", 0))


class AdjointMatchingConfig(ObjectiveSection):
    """Adjoint Matching: regress the control onto the lean adjoint of the reward gradient (needs a differentiable
    reward and a memoryless sampler: flow_memoryless for flow models, ddim with eta 1 for diffusion models)."""

    name: str = "adjoint_matching"
    learns_from_reward_differences: ClassVar[bool] = False  # it regresses onto the reward's gradient
    reward_multiplier: float = Field(
        1.0, gt=0, description="lambda: the target is p_base(x) exp(lambda r(x)) (the authors use 100 with ImageReward)."
    )
    num_trained_steps: int | None = Field(4, ge=1, description="Steps per minibatch with a loss; None: every step below sigma = 1.")
    early_fraction: float = Field(
        0.6, gt=0, lt=1, description="Stratified draw: half the trained steps come from this first fraction of the steps."
    )
    clip_quantile: float | None = Field(
        0.9, gt=0, le=1, description="Clip each sample's loss at this quantile (an EMA of it); None: no clipping."
    )
    clip_ema_decay: float = Field(0.9, ge=0, lt=1, description="Decay of the EMA of the clipping quantile.")
    # "output" has the same fixed point, more weight at high noise, where an ODE sampler needs the model
    loss_weighting: Literal["memoryless", "output"] = Field(
        "memoryless",
        description="memoryless: the paper's weight, the integral of g^2 over the step; output: uniform in output units per sigma.",
    )
    # The tilt p_base exp(lambda r) is the fixed point only on a memoryless schedule (docs/objectives/adjoint_matching.md)
    allow_non_memoryless: bool = Field(
        False, description="Run with a sampler that is not memoryless anyway, to measure the bias it leaves."
    )

    def check_run(self, config: Any) -> None:
        s = config.sampler
        if not s.memoryless and not self.allow_non_memoryless:
            eta = f" with eta {s.eta}" if s.name == "ddim" else ""
            raise ValueError(
                f"adjoint_matching needs a memoryless sampler (flow_memoryless, or ddim with eta 1) but sampler.name is "
                f"'{s.name}'{eta}; on another schedule its fixed point is not p_base exp(lambda r) (set "
                f"objective.allow_non_memoryless=true to run it anyway)"
            )

    def build(self, context: BuildContext | None = None) -> AdjointMatchingObjective:
        kwargs = self.target_kwargs()
        del kwargs["allow_non_memoryless"]  # a rule for check_run, not a knob of the objective
        return AdjointMatchingObjective(**kwargs)


__all__ = [
    "AdjointMatchingObjective",
    "AdjointMatchingConfig",
    "lean_adjoint_step",
    "adjoint_matching_residual",
    "score_difference",
    "memoryless_step_weight",
    "output_weight",
    "score_depends_on_model",
    "memoryless_flow_diffusion_sq",
    "memoryless_flow_drift",
    "memoryless_vp_diffusion_sq",
    "ddpm_memoryless_variance",
    "ema_update",
    "stratified_steps",
]
