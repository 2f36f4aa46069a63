"""DMD2 (Yin et al., NeurIPS 2024, arXiv:2405.14867): distribution matching distillation of a many-step teacher
into a few-step student, with a fake-score model trained alongside the student. Checked against the released
code, tianweiy/DMD2 (``main/sd_guidance.py``, ``main/sd_unified_model.py``, ``main/train_sd.py``), and against
verl-omni's DMD2 runtime (verl-project/verl-omni at 39221191, PRs #546/#611: ``workers/engine/fsdp/dmd_impl.py``,
``trainer/diffusion/distillation/utils.py``): the same DM gradient, loss, fake-score loss, update ratio and LoRA
roles on one base, the teacher being the base with adapters off, and the teacher's guidance the family's own (on
Qwen-Image with its norm rescale: verl-omni's ``layer_norm``). It differs in shifted score times, an EMA adapter and a
1e-6 normaliser floor (docs/objectives/dmd2.md, "Against verl-omni's runtime").

Conventions: sigma in [0, 1], 1 = noise, 0 = data; a rectified flow ``x_sigma = (1 - sigma) x0 + sigma eps`` with
velocity ``v = eps - x0``, and the data estimate of a velocity ``u`` is ``x0_hat = x_sigma - sigma u``.

Three models, all one denoiser: the **student** (the policy: its LoRA adapter), the **fake score** (a second LoRA
adapter on the same base, the role ``"fake_score"``: the score of the student's own output distribution) and the
**teacher** (the base with adapters off, ``pipeline.reference()``: the frozen role ``"teacher"``, the real score, with
its classifier-free guidance ``real_guidance_scale``). Both adapters start at zero, so both start as the teacher.

The student is a K-step sampler on the rollout's fixed time grid (``rollout.num_inference_steps``, 1 or 2 here): the
Euler steps of the flow ODE, exactly what ``flowrl eval`` / ``sample`` run on the student. The loop's rollouts (ODE
sampler, no gradient) are the student's own trajectories; a trained row picks one of the K steps k, takes the
rollout's state x_k there (**backward simulation**: the state the student itself reaches, not the teacher's noised
data) and predicts, with gradient, ``x0 = x_k - sigma_k v_student(x_k)``. The losses:

* **distribution matching** (the student's): noise ``x0`` to ``x_t`` at ``t ~ U[min_sigma, max_sigma]`` with fresh
  noise; with no gradient ``real = x0_hat(teacher, CFG)``, ``fake = x0_hat(fake score)``,
  ``grad = ((x0 - real) - (x0 - fake)) / mean|x0 - real|`` (mean over each sample's elements) and
  ``L_DM = 0.5 * mean((x0 - sg(x0 - grad))^2)``, whose gradient w.r.t. x0 is ``(fake - real) / mean|x0 - real| / N``
  (N the number of elements of the minibatch's x0), the reverse-KL gradient of DMD;
* **fake score** (the fake score's): flow matching on the student's samples, ``mean((v_fake(x_t) - (eps - x0))^2)``
  at ``t`` uniform over the training times, the x0 being the same step-k predictions (detached).

Two-time-scale update: every minibatch steps the fake score; the student's loss is yielded on every
``fake_steps_per_student_step``-th minibatch only (DMD2's ``dfake_gen_update_ratio``: 5 for SDXL, 10 for SD 1.5), so
the fake score tracks the student's current distribution. With ``train.batch_size`` a 1/ratio share of the iteration's
rollouts, the student steps once per iteration, on its last minibatch.

Matches tianweiy/DMD2: the DM gradient and its normalisation (``p_real = x0 - real``, ``p_fake = x0 - fake``,
``(p_real - p_fake) / |p_real|.mean(dim=[1,2,3])``, ``nan_to_num``), the loss ``0.5 * mse(x0, sg(x0 - grad),
mean)``, the DM times in [0.02, 0.98] of the range (``min_step_percent`` / ``max_step_percent``), the fake score's
times over the whole range, no guidance for the fake score (``fake_guidance_scale == 1``), the teacher's CFG
(``real_guidance_scale``), the fake-to-student update ratio, backward simulation, separate AdamW per model.
Differs: the GAN term (DMD2's classifier head on the fake UNet, ``gen_cls_loss``) is left out; multi-step states are
the student's ODE states (re-noised with the ODE's own predicted noise, as flowrl's evaluation samples), where DMD2
re-noises each x0 prediction with fresh noise; the step k is drawn per row (DMD2's backward simulation draws one per
batch); times are continuous sigma (DMD2: integer DDPM steps); the fake score regresses the flow's velocity (DMD2:
epsilon, the SD teachers' target); the student and fake score are LoRA adapters on one base (DMD2: full UNets;
its SDXL LoRA run adapts the generator alone, the fake score staying a full UNet). docs/objectives/dmd2.md has the measured numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.forward_process import noised_and_target, training_sigmas
from ..sections import BuildContext, ObjectiveSection
from ..types import FrozenRole, LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainedRole, TrainingData, Trajectory

FAKE_SCORE = "fake_score"


def _per_row(sigma: Tensor, like: Tensor) -> Tensor:
    return sigma.view((-1,) + (1,) * (like.ndim - 1))


def flow_x0(x_t: Tensor, sigma: Tensor, velocity: Tensor) -> Tensor:
    """The data estimate of a flow velocity: ``x_t - sigma v``."""
    return x_t - _per_row(sigma, x_t) * velocity


def guided_velocity(pipeline: Pipeline, x: Tensor, sigma: Tensor, cond: Any, scale: float) -> Tensor:
    """The family's own guided velocity at a noise level per row (DMD2's ``predict_noise`` with the teacher's CFG):
    ``pipeline.predict`` at ``scale``, so the real score is the teacher ``flowrl sample`` runs at that scale, with
    what the family adds to ``uncond + scale (cond - uncond)`` (Qwen-Image's norm rescale, Wan2.2's per-expert scales,
    FLUX.1-dev's embedded guidance)."""
    return pipeline.predict(x, sigma, cond, scale).float()


def dm_gradient(x0: Tensor, real_x0: Tensor, fake_x0: Tensor) -> Tensor:
    """DMD2's distribution-matching gradient: ``(p_real - p_fake) / mean|p_real|`` with ``p = x0 - x0_hat`` (the mean
    over each sample's elements), non-finite values zeroed; no gradient flows through it."""
    p_real, p_fake = x0 - real_x0, x0 - fake_x0
    dims = tuple(range(1, x0.ndim))
    return torch.nan_to_num((p_real - p_fake) / p_real.abs().mean(dim=dims, keepdim=True)).detach()


def dm_loss(x0: Tensor, grad: Tensor) -> Tensor:
    """``0.5 * mean((x0 - sg(x0 - grad))^2)``: its gradient w.r.t. x0 is ``grad / x0.numel()``."""
    return 0.5 * F.mse_loss(x0.float(), (x0 - grad).detach().float(), reduction="mean")


def fake_score_loss(pipeline: Pipeline, x0: Tensor, noise: Tensor, sigma: Tensor, cond: Any) -> Tensor:
    """Flow matching of the fake-score adapter on the (detached) student samples ``x0``: the mean over the batch of
    ``mean((v_fake(x_sigma) - (noise - x0))^2)``, without guidance (DMD2's fake score has none)."""
    x_t, target = noised_and_target(pipeline, x0.detach(), noise, sigma)
    with pipeline.use_adapter(FAKE_SCORE):
        pred = pipeline.predict(x_t, sigma, cond, 1.0).float()
    return (pred - target).pow(2).flatten(1).mean(1).mean()


@dataclass
class DMD2Objective:
    fake_steps_per_student_step: int
    real_guidance_scale: float
    min_sigma: float
    max_sigma: float
    fake_lr_scale: float
    name: str = field(default="dmd2", init=False)
    trains_on: TrainingData = field(default="rollouts", init=False)  # the student's own ODE trajectories
    needs_log_probs: bool = field(default=False, init=False)
    reference: ReferenceModel = field(default="none", init=False)  # the teacher is the declared frozen role below
    minibatch_unit: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        self.minibatches = 0  # minibatches trained so far: every ratio-th is also the student's

    @property
    def roles(self) -> tuple[Role, ...]:
        return (
            TrainedRole(FAKE_SCORE, adapter=FAKE_SCORE, lr_scale=self.fake_lr_scale),
            FrozenRole("teacher", "initial"),  # the base with the adapters disabled
        )

    def prepare(self, batch: Trajectory) -> Trajectory:
        return batch  # no advantages: DMD2 does not read the reward

    def student_turn(self) -> bool:
        """Whether the minibatch now being trained also steps the student (after ``losses`` counted it)."""
        return self.minibatches % self.fake_steps_per_student_step == 0

    def teacher(self, pipeline: Pipeline) -> AbstractContextManager:
        """Where ``predict`` runs the real score: the base with the adapters off (DMDR may name another model)."""
        return pipeline.reference()

    def student_loss(
        self, pipeline: Pipeline, x0: Tensor, batch: Trajectory, steps: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The student's loss on its x0 predictions ``x0``, row i's made at its step ``steps[i]`` (DMDR adds its reward)."""
        return self._dm_loss(pipeline, x0, batch.cond, generator)

    def _dm_loss(self, pipeline: Pipeline, x0: Tensor, cond: Any, generator: torch.Generator) -> tuple[Tensor, dict[str, Tensor]]:
        n, device = len(x0), x0.device
        with torch.no_grad():
            sigma = (self.min_sigma + (self.max_sigma - self.min_sigma) * torch.rand(n, generator=generator)).to(device)
            noise = torch.randn(x0.shape, generator=generator).to(device)
            x_t, _ = noised_and_target(pipeline, x0.detach(), noise, sigma)
            with pipeline.use_adapter(FAKE_SCORE):
                fake_x0 = flow_x0(x_t, sigma, pipeline.predict(x_t, sigma, cond, 1.0).float())
            with self.teacher(pipeline):
                real_x0 = flow_x0(x_t, sigma, guided_velocity(pipeline, x_t, sigma, cond, self.real_guidance_scale))
            grad = dm_gradient(x0.detach(), real_x0, fake_x0)
        loss = dm_loss(x0, grad)
        return loss, {
            "loss/dm": loss.detach(),
            "dmd2/grad_norm": grad.norm(),  # DMD2's dmtrain_gradient_norm
            "dmd2/fake_real_gap": (fake_x0 - real_x0).abs().mean(),
        }

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        self.minibatches += 1
        student = self.student_turn()
        n, steps = len(batch), batch.num_steps
        sigmas = batch.sigmas.float().cpu()
        k = torch.randint(0, steps, (n,), generator=generator)  # backward simulation: the step each row trains
        x_k = batch.latents[torch.arange(n), k].float()
        device = x_k.device
        s_k = sigmas[k].to(device)
        if student:
            x0 = flow_x0(x_k, s_k, pipeline.predict(x_k, s_k, batch.cond, batch.guidance_scale).float())
            loss, metrics = self.student_loss(pipeline, x0, batch, k, generator)
            yield LossOutput(loss, metrics, role="policy")
            x0 = x0.detach()
        else:
            with torch.no_grad():
                x0 = flow_x0(x_k, s_k, pipeline.predict(x_k, s_k, batch.cond, batch.guidance_scale).float())
        sigma = training_sigmas(pipeline, n, generator).to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        loss = fake_score_loss(pipeline, x0, noise, sigma, batch.cond)
        yield LossOutput(loss, {"loss/fake_score": loss.detach()}, role=FAKE_SCORE)

    def state_dict(self) -> dict[str, Any]:
        return {"minibatches": self.minibatches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.minibatches = int(state.get("minibatches", 0))


class DMD2Config(ObjectiveSection):
    """DMD2: distil the teacher (the base model) into a few-step student (the policy's LoRA) by distribution matching,
    with a fake-score LoRA adapter trained alongside (needs pipeline.lora, a flow model and sampler.name: ode)."""

    name: str = "dmd2"
    learns_from_reward_differences: ClassVar[bool] = False  # it reads no reward: the loop's flat-reward stop is off
    distillation: ClassVar[str] = "distribution matching distillation (DMD2)"  # the model card's words (model_card.py)
    fake_steps_per_student_step: int = Field(
        5,
        ge=1,
        description="Two-time-scale update: minibatches (fake-score steps) per student step (DMD2's dfake_gen_update_ratio: 5 SDXL, 10 SD 1.5).",
    )
    real_guidance_scale: float = Field(
        1.0, ge=1.0, description="Classifier-free guidance of the teacher, the real score (DMD2: 1.75 SD 1.5, 8 SDXL; 1 = none)."
    )
    min_sigma: float = Field(0.02, ge=0, lt=1, description="Lowest noise level of the distribution-matching loss (DMD2: 0.02).")
    max_sigma: float = Field(0.98, gt=0, le=1, description="Highest noise level of the distribution-matching loss (DMD2: 0.98).")
    fake_lr_scale: float = Field(
        1.0, gt=0, description="The fake score's learning rate relative to train.learning_rate (DMD2: equal rates)."
    )

    def check_run(self, config: Any) -> None:
        if self.min_sigma >= self.max_sigma:
            raise ValueError(f"objective.min_sigma ({self.min_sigma}) must be below objective.max_sigma ({self.max_sigma})")
        if config.sampler.name != "ode":
            raise ValueError(
                f"dmd2 trains a few-step student on its own ODE steps, so sampler.name must be 'ode' (is '{config.sampler.name}')"
            )
        if config.pipeline.lora is None:
            raise ValueError("dmd2 trains the student and the fake score as two LoRA adapters on the teacher's base; set pipeline.lora")

    def build(self, context: BuildContext | None = None) -> DMD2Objective:
        self.check_model(getattr(context, "pipeline", None))
        return DMD2Objective(**self.target_kwargs())

    def check_model(self, pipeline: Pipeline | None) -> None:
        """Refuse, in one sentence, a model DMD2 cannot distil (or None: not known yet)."""
        if pipeline is not None and getattr(pipeline, "prediction_type", "flow") != "flow":
            raise FlowRLError(f"objective 'dmd2' distils rectified-flow models; this model predicts '{pipeline.prediction_type}'.")
        if pipeline is not None and getattr(pipeline, "step_distilled", False) and self.real_guidance_scale != 1.0:
            # a teacher CFG would run on a model distilled to run without it (FLUX.2-klein)
            raise FlowRLError(
                f"this checkpoint is step-distilled (is_distilled: true) and runs without guidance, so its teacher has no "
                f"CFG: set objective.real_guidance_scale to 1 (got {self.real_guidance_scale})."
            )


__all__ = ["DMD2Config", "DMD2Objective", "dm_gradient", "dm_loss", "fake_score_loss", "flow_x0", "guided_velocity"]
