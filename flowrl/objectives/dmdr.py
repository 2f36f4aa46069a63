"""DMDR (Jiang et al. 2025, arXiv:2511.13649, "Distribution Matching Distillation Meets Reinforcement Learning"): RL
on a few-step student with DMD's distribution-matching loss as the regulariser, in place of a KL to a reference.
Checked against the released code, vvvvvjdy/dmdr (``train_cc/sit/train_sitxl_refl_deepspeed.py``: the SiT-XL
ImageNet demo, the only training code released).

The student's loss is DMD2's (:mod:`flowrl.objectives.dmd2`, whose math this reuses: the student's x0 prediction at
a step of its own trajectory, the real-minus-fake gradient, the fake-score adapter trained on the student's samples,
the two-time-scale update) plus the reward, the released code's ``loss_gen = dmd_loss + dino_loss_weight *
reward_loss``::

    L_student = dm_weight * L_DM(x0) + reward_weight * L_RL(x0),   L_RL = -(1/B) sum_i <g_i, x0_i>

``L_RL`` is ReFL (the released RL: a differentiable reward on the student's one-step x0 prediction, backpropagated
into the student): ``g_i = d r / d x_final`` is the reward's gradient at row i's final sample (the loop's
``reward_gradient_rollouts``, as Adjoint Matching's), so d L_RL / d x0_i = -g_i / B. On rows trained at the last step
the x0 prediction is the final sample itself (the rollout's last Euler step, same weights), so the gradient is
ReFL's exactly; on a row trained at an earlier step the gradient at the final sample stands in for the gradient at
that step's x0 prediction (the released 1-step SiT has only the one).

The teacher (the real score): ``teacher`` names a model of the pipeline's family (an embedded name or a directory),
loaded frozen (a ``FrozenRole`` of source ``attribute``) and run with the pipeline's own conditioning
(``use_denoiser``). This is how RL on an already distilled student works: the student is ``pipeline.pretrained``
(its weights the base of the policy's and the fake score's LoRA adapters), the regulariser pulls it towards the
many-step teacher's distribution, as in DMDR where the real score is the pretrained multi-step SiT. Unset: the base
with the adapters off, as DMD2 (distillation and RL at once, from the teacher's weights).

Matches vvvvvjdy/dmdr: the loss sum and its weights (DM 1, reward ``dino_loss_weight``), the reward on the student's
x0 prediction at a step drawn from its own trajectory (backward simulation), the DM gradient and normalisation
(dmd2.py), the fake score updated every minibatch and the student every ``ratio_update``-th (5), no guidance for the
fake score. Differs: the reward's gradient on earlier-step rows (above); the fake score is a LoRA on the student's
weights, not on the teacher's (the released guidance model is the teacher with a LoRA; here the student is the
pipeline's base, so the fake adapter starts as the student's network and is trained on its samples from the first
iteration on: ``fake_warmup_steps`` gives it student turns of its own before the student moves, the role of the
released cold start, whose 20000 DMD-only steps distil the student and train the fake score); the real score's
"dynamic distribution guidance" (a decaying share of the fake LoRA in the real score, ``lora_scale_r``) and the
"dynamic renoise sampling" of the times act during that cold start only (``dynamic_step`` < ``cold_start_iter``) and
are left out; the times are uniform in [min_sigma, max_sigma] (the released: logit-normal, ``gui_a/gui_b``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..sections import BuildContext
from ..types import FrozenRole, Pipeline, Role, TrainedRole, TrainingData, Trajectory
from .dmd2 import FAKE_SCORE, DMD2Config, DMD2Objective


def refl_loss(x0: Tensor, reward_grads: Tensor) -> Tensor:
    """ReFL's loss through a fixed reward gradient: ``-(1/B) sum_i <g_i, x0_i>``, whose gradient w.r.t. x0_i is
    ``-g_i / B`` (minus the mean reward's gradient when ``g_i`` is the reward's gradient at ``x0_i``)."""
    return -(reward_grads.detach().float() * x0.float()).flatten(1).sum(1).mean()


@dataclass
class DMDRObjective(DMD2Objective):
    reward_weight: float
    dm_weight: float
    fake_warmup_steps: int
    teacher_model: torch.nn.Module | None = None  # None: the base with the adapters off
    name: str = field(default="dmdr", init=False)
    trains_on: TrainingData = field(default="reward_gradient_rollouts", init=False)

    @property
    def roles(self) -> tuple[Role, ...]:
        teacher = FrozenRole("teacher", "initial") if self.teacher_model is None else FrozenRole("teacher", "attribute", "teacher_model")
        return (TrainedRole(FAKE_SCORE, adapter=FAKE_SCORE, lr_scale=self.fake_lr_scale), teacher)

    def prepare(self, batch: Trajectory) -> Trajectory:
        if self.reward_weight > 0 and (batch.reward_grads is None or batch.reward_grads.shape != batch.latents[:, -1].shape):
            raise FlowRLError(
                "objective 'dmdr' needs the reward gradient of every final sample; the loop must collect reward_gradient_rollouts."
            )
        return batch

    def teacher(self, pipeline: Pipeline) -> AbstractContextManager:
        return pipeline.reference() if self.teacher_model is None else pipeline.use_denoiser(self.teacher_model)

    def student_turn(self) -> bool:
        warm = self.minibatches > self.fake_warmup_steps * self.fake_steps_per_student_step  # its first turns skipped
        return warm and super().student_turn()

    def student_loss(
        self, pipeline: Pipeline, x0: Tensor, batch: Trajectory, steps: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, dict[str, Tensor]]:
        loss = x0.new_zeros(())
        metrics: dict[str, Tensor] = {}
        if self.dm_weight > 0:  # zero: no teacher or fake-score call, the RL objective alone
            dm, metrics = self._dm_loss(pipeline, x0, batch.cond, generator)
            loss = loss + self.dm_weight * dm
        if self.reward_weight > 0:
            rl = refl_loss(x0, batch.reward_grads.to(x0.device))
            loss = loss + self.reward_weight * rl
            metrics["loss/refl"] = rl.detach()
            metrics["dmdr/last_step_rows"] = (steps == batch.num_steps - 1).float().mean()
        return loss, metrics


class DMDRConfig(DMD2Config):
    """DMDR: RL (ReFL on a differentiable reward) on a few-step student, regularised by DMD2's distribution matching
    towards a teacher (needs pipeline.lora, a flow model, sampler.name: ode and a differentiable reward)."""

    name: str = "dmdr"
    # the model card says "fine-tuned with reinforcement learning": the base is the student, not the teacher
    distillation: ClassVar[str | None] = None
    reward_weight: float = Field(
        1.0, ge=0, description="Weight of the ReFL reward loss against the DM loss (released: dino_loss_weight 0.05; 0 = DMD2)."
    )
    dm_weight: float = Field(
        1.0, ge=0, description="Weight of the distribution-matching regulariser (released: 1; 0 = ReFL alone, no teacher call)."
    )
    teacher: str | None = Field(
        None,
        description="The real score: a model of the pipeline's family (embedded name or directory), loaded frozen; None: the base with the adapters off.",
    )
    fake_warmup_steps: int = Field(
        0,
        ge=0,
        description="The student's first steps skipped, the fake score training alone meanwhile (one student step per iteration when "
        "train.batch_size is 1/fake_steps_per_student_step of the rollouts; released: the cold start).",
    )

    def check_run(self, config: Any) -> None:
        super().check_run(config)
        if self.reward_weight == 0 and self.dm_weight == 0:
            raise ValueError("objective.reward_weight and objective.dm_weight are both 0: dmdr would train the student on nothing")

    def build(self, context: BuildContext | None = None) -> DMDRObjective:
        pipeline = getattr(context, "pipeline", None)
        self.check_model(pipeline)  # DMD2's
        kwargs = self.target_kwargs()
        teacher = kwargs.pop("teacher")
        model = None if teacher is None or pipeline is None else load_teacher(pipeline, teacher)
        return DMDRObjective(**kwargs, teacher_model=model)


def load_teacher(pipeline: Pipeline, teacher: str) -> torch.nn.Module:
    """The denoiser of ``teacher`` (a model of ``pipeline``'s family), frozen, on the pipeline's device."""
    if not hasattr(pipeline, "use_denoiser"):
        raise FlowRLError(
            f"objective.teacher needs an image or video pipeline that can run another denoiser; {type(pipeline).__name__} cannot."
        )
    section = pipeline.config.model_copy(update={"pretrained": teacher, "lora": None})
    loaded = section.build(pipeline.device)  # the family's own section builds the family's adapter
    if loaded.prediction_type != pipeline.prediction_type:  # run under the student's conventions, it would mean nothing
        raise FlowRLError(
            f"objective.teacher '{teacher}' predicts '{loaded.prediction_type}', but the student predicts "
            f"'{pipeline.prediction_type}'; the teacher must be a model of the same kind."
        )
    return loaded.denoiser.requires_grad_(False).eval()


__all__ = ["DMDRConfig", "DMDRObjective", "load_teacher", "refl_loss"]
