"""DiffusionOPD (arXiv:2605.15055): on-policy distillation of several single-task teachers into one student, with the
closed-form KL between the student's and the routed teacher's Gaussian transition at every step of the student's own
trajectory. Paper-derived where noted; checked against the released code, ali-vilab/DiffusionOPD
(``scripts/train_sd3_opd.py``: ``compute_student_step``, ``compute_teacher_step_mean``, the per-step loss of the
training loop; read in the public copy adventurermanilla817/DiffusionOPD at abecb69, the original repository could
not be fetched here) and against Flow-Factory's port (X-GenGroup/Flow-Factory PR #170, ``trainer_type: diffusion-opd``,
read from its description: the merged code is not in the snapshot flowrl could fetch).

The recipe's stage 1 trains one teacher per task with RL on that task's reward alone (on digits: flowrl's GRPO preset
on one reward each, bench/diffusion_opd_digits.py); stage 2 is this objective. Each rollout row is routed to one
teacher by its prompt (``route_key``: the prompt metadata's value, e.g. the digit; the released code routes a whole
sampling batch by the prompt file it came from, Flow-Factory a sample by its ``source`` data set: the same map, a
task per prompt). At every step k of the student's rollout, at the student's own state x_k (on-policy: the states the
student visits, not the teacher's), the student's transition mean ``mu_S`` (with gradient) and the teacher's ``mu_T``
(no gradient, the teacher's own ``guidance_scale``) come from one step of the run's sampler, and the loss is

* SDE (a stochastic step of std s, the same for both: it depends on the time grid alone):
  ``KL(N(mu_S, s^2) || N(mu_T, s^2)) = ||mu_S - mu_T||^2 / (2 s^2)``, per element, averaged (``gaussian_kl`` in
  objectives/functional.py, the GRPO KL term's math);
* ODE (a deterministic step, ``sampler.name: ode`` or a sampler's deterministic steps): ``0.5 ||mu_S - mu_T||^2``
  per element, averaged: the paper's ODE form, the released code's ``noise_level <= 0`` branch (``gaussian_kl`` with
  s = 1).

Averaged over the rows and the trajectory's steps (one LossOutput per step, backpropagated as it comes, so memory does
not grow with the steps: the released loop's per-step backward with accumulation over the steps). No reward and no
advantage enters the loss: the reward is only measured.

Matches the released code: the teacher evaluated at the student's visited states x_k with the rollout's own step
(``prev_sample=next_latents``), the same step function for both, the per-element mean of ``delta^2 / (2 std^2)``
(SDE) and of ``0.5 delta^2`` (ODE), one teacher per prompt, the teacher's own CFG scale, every trajectory step
trained from the first. Differs: ``s`` is the sampler's true transition std (Flow-GRPO's ``g sqrt(-dt)``), so the
SDE loss is the exact Gaussian KL; the released code divides by ``std_dev_t^2`` without the ``-dt`` (Flow-GRPO's
KL-term convention, the exact KL times |dt|), Flow-Factory by ``std_dev_t^2 (-dt)`` like flowrl. With a uniform grid
the two differ by the constant factor |dt| (a learning-rate scale); with a shifted grid also in how steps are weighted.
Teachers are full copies of the policy's model with each teacher checkpoint's weights (flowrl checkpoints of the same
model: its LoRA adapter or the whole denoiser), not adapters on one backbone (the released code's ``teacher_<name>``
PEFT adapters): the same forward, more memory (on digits a copy is 3.2 MB). The released MOPD loop gives each teacher
whole sampling batches in turn (round-robin); here a batch mixes tasks and each row goes to its teacher (Flow-Factory's
per-sample routing); no EMA of the student.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..errors import FlowRLError
from ..sections import BuildContext, ObjectiveSection, Section
from ..types import FrozenRole, LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .functional import gaussian_kl


@contextlib.contextmanager
def teacher_model(pipeline: Pipeline, module: torch.nn.Module) -> Iterator[Pipeline]:
    """Inside the block ``pipeline.predict`` runs ``module`` (a teacher: a frozen copy of the policy's denoiser with
    its own weights) through the pipeline's own forward (timestep conversion, guidance); the policy comes back after."""
    policy = pipeline.denoiser
    pipeline.denoiser = module
    try:
        yield pipeline
    finally:
        pipeline.denoiser = policy


def step_mean(sampler: Sampler, model_output: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor, x_next: Tensor, stochastic: bool):
    """The transition mean and std of one step at state ``x``: the sampler's Gaussian step (SDE) or its deterministic
    step with std 1 (ODE: the KL form becomes 0.5 ||delta||^2)."""
    if stochastic:
        out = sampler.step(model_output, x, sigma, sigma_next, x_next=x_next)
        return out.mean, out.std
    return sampler.deterministic_step(model_output, x, sigma, sigma_next), torch.ones((), device=x.device)


def step_kl(student_mean: Tensor, teacher_mean: Tensor, std: Tensor) -> Tensor:
    """DiffusionOPD's per-step loss of each row, (B,): the mean over elements of ||mu_S - mu_T||^2 / (2 std^2)."""
    return gaussian_kl(student_mean, teacher_mean.detach(), std, "mean")


def route(metadata: list[dict[str, Any]], key: str, routes: dict[str, str]) -> list[str]:
    """The teacher of each row: ``routes[str(metadata[key])]``; a row no teacher takes is one sentence."""
    names = []
    for m in metadata:
        value = m.get(key)
        if value is None or str(value) not in routes:
            raise FlowRLError(
                f"diffusion_opd routes each prompt by its metadata '{key}', and no teacher takes the value {value!r}; "
                f"give some teacher that value in objective.teachers[*].route (taken: {', '.join(sorted(routes))})."
            )
        names.append(routes[str(value)])
    return names


@dataclass
class DiffusionOPDObjective:
    teachers: dict[str, torch.nn.Module]  # name -> frozen teacher model
    routes: dict[str, str]  # str(metadata[route_key]) -> teacher name
    route_key: str
    guidance_scales: dict[str, float | None]  # name -> the teacher's CFG scale; None: the rollout's
    name: str = field(default="diffusion_opd", init=False)
    trains_on: TrainingData = field(default="rollouts", init=False)  # the student's own trajectories: on-policy
    needs_log_probs: bool = field(default=False, init=False)
    reference: ReferenceModel = field(default="none", init=False)  # the teachers are the declared frozen roles below
    minibatch_unit: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        for name, module in self.teachers.items():
            setattr(self, _attribute(name), module)  # a frozen role is the objective's attribute (training/roles.py)

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(FrozenRole(f"teacher_{n}", "attribute", attribute=_attribute(n)) for n in self.teachers)

    def prepare(self, batch: Trajectory) -> Trajectory:
        return batch  # no advantages: the reward is only measured

    def teacher_means(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, k: int, rows: dict[str, Tensor]) -> Tensor:
        """Every row's routed teacher's transition mean at step k of the student's trajectory (no gradient)."""
        x, x_next = batch.latents[:, k], batch.latents[:, k + 1]
        sigma, sigma_next, stochastic = batch.sigmas[k], batch.sigmas[k + 1], bool(batch.stochastic[k])
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        with torch.no_grad():
            for name, index in rows.items():
                scale = self.guidance_scales[name]
                module = getattr(self, _attribute(name))
                with teacher_model(pipeline, module):
                    v = pipeline.predict(x[index], sigma, _rows(batch.cond, index), batch.guidance_scale if scale is None else scale)
                out[index] = step_mean(sampler, v, x[index], sigma, sigma_next, x_next[index], stochastic)[0].float()
        return out

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        names = route(list(batch.metadata), self.route_key, self.routes)
        device = batch.latents.device
        rows = {n: torch.tensor([i for i, m in enumerate(names) if m == n], device=device) for n in self.teachers if n in names}
        steps = batch.num_steps
        for k in range(steps):
            x, x_next = batch.latents[:, k], batch.latents[:, k + 1]
            sigma, sigma_next, stochastic = batch.sigmas[k], batch.sigmas[k + 1], bool(batch.stochastic[k])
            teacher = self.teacher_means(pipeline, sampler, batch, k, rows)
            v = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
            mean, std = step_mean(sampler, v, x, sigma, sigma_next, x_next, stochastic)
            kl = step_kl(mean, teacher, std)
            metrics = {"loss/opd_kl": kl.mean().detach(), f"opd/kl_step_{k}": kl.mean().detach()}
            metrics.update({f"opd/kl_{n}": kl[index].mean().detach() for n, index in rows.items()})
            yield LossOutput(loss=kl.mean() / steps, metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _attribute(name: str) -> str:
    return f"teacher_{name}"


def _rows(cond: Any, index: Tensor) -> Any:
    """The condition of the rows ``index``: each per-row tensor of the encoded prompts indexed, anything else kept."""
    return {k: v[index.to(v.device)] if torch.is_tensor(v) and v.ndim > 0 else v for k, v in cond.items()}


class TeacherSection(Section):
    """One task teacher of DiffusionOPD: a flowrl checkpoint of the same model, and the prompts routed to it."""

    name: str = Field(description="The teacher's name (its frozen role is teacher_<name>; its metric opd/kl_<name>).")
    checkpoint: str = Field(
        description="A flowrl checkpoint directory (runs/<run>/checkpoints/step_N) of the same model and pipeline settings, "
        "trained on this teacher's task (stage 1)."
    )
    route: list[int | str] = Field(
        min_length=1, description="The values of the prompt metadata's objective.route_key whose prompts this teacher supervises."
    )
    guidance_scale: float | None = Field(
        None,
        ge=1.0,
        description="The teacher's classifier-free guidance scale (the released code's per-teacher CFG); unset: the rollout's.",
    )


class DiffusionOPDConfig(ObjectiveSection):
    """DiffusionOPD: distil task teachers (flowrl checkpoints, one per task) into the policy by the closed-form per-step
    KL of the two Gaussian steps (SDE) or the squared mean difference (ODE) along the student's own rollouts."""

    name: str = "diffusion_opd"
    learns_from_reward_differences: ClassVar[bool] = False  # it reads no reward: the loop's flat-reward stop is off
    distillation: ClassVar[str] = "on-policy distillation from task teachers (DiffusionOPD)"  # the model card's words
    teachers: list[TeacherSection] = Field(
        default_factory=list,
        description="The task teachers: each a checkpoint and the prompts (route values) it supervises (a run needs one at least).",
    )
    route_key: str = Field(
        "digit", description="The prompt metadata key whose value picks a prompt's teacher (digits: the digit asked for)."
    )

    @model_validator(mode="after")
    def _one_teacher_per_value(self) -> DiffusionOPDConfig:
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"objective.teachers names must be unique (got {', '.join(names)})")
        values = [str(v) for t in self.teachers for v in t.route]
        if len(set(values)) != len(values):
            raise ValueError("objective.teachers route one value to two teachers; each prompt has one teacher")
        return self

    def check_run(self, config: Any) -> None:
        if not self.teachers:
            raise ValueError(
                "objective.teachers is empty: diffusion_opd distils task teachers, so name one at least (a checkpoint and its route)"
            )

    def build(self, context: BuildContext | None = None) -> DiffusionOPDObjective:
        pipeline = getattr(context, "pipeline", None)
        if pipeline is None:
            raise FlowRLError("objective 'diffusion_opd' loads its teachers into copies of the run's model; build it inside a run.")
        if getattr(pipeline, "prediction_type", "flow") != "flow":
            raise FlowRLError(f"objective 'diffusion_opd' distils rectified-flow models; this model predicts '{pipeline.prediction_type}'.")
        teachers = {t.name: load_teacher(pipeline, Path(t.checkpoint)) for t in self.teachers}
        return DiffusionOPDObjective(
            teachers=teachers,
            routes={str(v): t.name for t in self.teachers for v in t.route},
            route_key=self.route_key,
            guidance_scales={t.name: t.guidance_scale for t in self.teachers},
        )


def load_teacher(pipeline: Pipeline, checkpoint: Path) -> torch.nn.Module:
    """A frozen copy of the policy's model holding ``checkpoint``'s trained weights (its LoRA adapter or the whole
    denoiser), loaded by the run's own checkpoint reader; a checkpoint of another model is one sentence."""
    from ..training.checkpoint import load_checkpoint_weights

    if not Path(checkpoint).is_dir():
        raise FlowRLError(f"diffusion_opd teacher checkpoint '{checkpoint}' does not exist (train the teachers first).")
    module = copy.deepcopy(getattr(pipeline.denoiser, "module", pipeline.denoiser))
    with teacher_model(pipeline, module):
        load_checkpoint_weights(pipeline, checkpoint)
    return module.requires_grad_(False).eval()


__all__ = ["DiffusionOPDConfig", "DiffusionOPDObjective", "load_teacher", "route", "step_kl", "step_mean", "teacher_model"]
