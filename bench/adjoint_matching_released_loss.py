"""Adjoint Matching's released loss against flowrl's on the quadratic 2-D toy, at the preset's budget.

The released loss is that of microsoft/soc-fine-tuning-sd (the paper's authors' code), read at commit
489f904a824fa3f6f2700f3b9a36826318f4d2ac (2025-05-15) and re-implemented below in this file's own words (none of it
is copied; the file names the lines each piece follows):

* lean adjoint: ``src/trainers/am_trainer.py`` ``grad_inner_product`` (lines 33-108) and ``compute_adjoints``
  (110-176): a_K = -lambda grad r(x_K); going back, a_k = a_{k+1} + grad_x <m_k(x) - x, a_{k+1}> at x = x_k, where
  m_k is the base model's scheduler step with the noise set to zero (``variance_noise=zeros``);
* control: ``src/trainers/soc_trainer.py`` ``control_from_noise_preds`` / ``evaluate_controls`` (193-432) with
  ``src/SOC_DDIM_scheduler.py`` ``step`` (101-287): the difference of the fine-tuned and the base model's step means
  at x_k (same zero noise), divided by the step's noise std (DDIM with eta = 1, i.e. DDPM's posterior);
* loss: ``am_trainer.py`` ``compute_loss`` (246-374): per row and trained step, the sum over dimensions of
  (control + std * a_k)^2; rows whose sqrt(loss) is at or above an EMA of the 0.9-quantile of sqrt(loss) (over the
  minibatch's rows x steps, the current minibatch folded into the EMA *before* the mask, ``EMA_update`` 178-187,
  decay 0.9) count as zero; the mean over rows x trained steps.

On the toy that scheduler step is flowrl's ``flow_memoryless`` step, the exact posterior of the forward chain at
x0_hat (the flow form of DDIM with eta = 1), whose step into sigma = 0 has no noise: the released control divides by
the std, so that step cannot carry the released loss and is not trained (the authors' grid never reaches the data:
``soc_trainer.py`` line 91 sets the last step's target abar halfway to 1). Every other step is trained, the one from
sigma = 1 included (the released code trains every grid step; flowrl's loss skips sigma = 1, where no model changes
the score, and trains the step into sigma = 0).

Same budget for every arm: configs/toy/adjoint_matching_quadratic.yaml as it is (1200 iterations of 1024 rollouts
on 20 memoryless steps, every trainable step in one minibatch, AdamW 5e-3 decaying linearly to 1e-4, the seed per
run); only the objective differs. Arms: ``flowrl`` (the preset's objective), ``released`` (the released loss with
its 0.9-quantile clipping, as its configs) and ``released_noclip`` (its quantile set off, as the preset sets
flowrl's). Each trained model is sampled with the ODE and with the memoryless SDE (200 steps, 20000 samples, seed 0,
what ``flowrl sample`` draws) and compared with the closed-form tilted target (flowrl/evaluation/toy2d.py); its
velocity error against the tilted flow's is printed at a few noise levels.

    python bench/adjoint_matching_released_loss.py --arms flowrl released --seeds 0 1 2 --out runs.jsonl
    python bench/adjoint_matching_released_loss.py --table runs.jsonl

One JSON line per (arm, seed) run; ``--table`` prints the markdown table of the collected lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.evaluation.toy2d import compare_to_target  # noqa: E402
from flowrl.objectives.adjoint_matching import AdjointMatchingObjective  # noqa: E402
from flowrl.pipelines.toy2d import TWO_MODES, tilted_target  # noqa: E402
from flowrl.reward_models.toy2d import QuadraticReward2D  # noqa: E402
from flowrl.types import LossOutput, Trajectory  # noqa: E402

PRESET = REPO / "configs" / "toy" / "adjoint_matching_quadratic.yaml"
REFERENCE = "microsoft/soc-fine-tuning-sd@489f904a824fa3f6f2700f3b9a36826318f4d2ac"
LAMBDA = 2.0  # the preset's reward_multiplier
SIGMAS = (0.999, 0.95, 0.9, 0.8, 0.7, 0.6, 0.4, 0.2, 0.05)


# -- the released loss, on flowrl's objects ------------------------------------------------------------------------
def zero_noise_step(sampler, out: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
    """(the step's mean with zero noise, its std): the scheduler step the released code calls with zero noise."""
    st = sampler.step(out, x, sigma, sigma_next, x_next=x.detach())
    return st.mean, st.std


def released_adjoints(pipeline, sampler, batch: Trajectory, lam: float) -> tuple[list[Tensor], list[Tensor]]:
    """Every step's adjoint a_k and base output at x_k (compute_adjoints): a_k = a_{k+1} + grad <m_k(x) - x, a_{k+1}>."""
    a = -lam * batch.reward_grads.float()
    adjoint: list[Tensor] = [a] * batch.num_steps
    base: list[Tensor] = [a] * batch.num_steps
    for k in range(batch.num_steps - 1, -1, -1):
        sigma, sigma_next = batch.sigmas[k], batch.sigmas[k + 1]
        with torch.inference_mode(False), torch.enable_grad():
            x = batch.latents[:, k].detach().clone().requires_grad_(True)
            with pipeline.reference():
                out = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
            mean, _ = zero_noise_step(sampler, out, x, sigma, sigma_next)
            (grad,) = torch.autograd.grad(((mean - x) * a).sum(), x)
        a = a + grad
        adjoint[k], base[k] = a.detach(), out.detach()
    return adjoint, base


def released_control(sampler, out_ft: Tensor, out_base: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor) -> tuple[Tensor, Tensor]:
    """(control_times_sqrt_dt, std_dev_t) of evaluate_controls: (m_ft(x) - m_base(x)) / std."""
    mean_ft, std = zero_noise_step(sampler, out_ft, x, sigma, sigma_next)
    mean_base, _ = zero_noise_step(sampler, out_base, x, sigma, sigma_next)
    return (mean_ft - mean_base) / std, std


def released_residual(control: Tensor, adjoint: Tensor, std: Tensor) -> Tensor:
    """compute_loss's loss_evals for one step: sum over dimensions of (control + std * a)^2, (B,)."""
    return ((control + adjoint * std) ** 2).flatten(1).sum(1)


class ReleasedEMA:
    """EMA_update with its counter: the first value, plain averages while updates < 1 / decay, then the EMA."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay, self.updates, self.value = decay, 0, -1.0

    def __call__(self, new: float) -> float:
        if self.updates == 0:
            self.value = new
        elif self.updates < 1 / self.decay:
            self.value = new / (self.updates + 1) + (1 - 1 / (self.updates + 1)) * self.value
        else:
            self.value = self.decay * self.value + (1 - self.decay) * new
        self.updates += 1
        return self.value


def released_minibatch_loss(loss_evals: Tensor, quantile: float | None, ema: ReleasedEMA) -> tuple[Tensor, Tensor]:
    """(the minibatch loss, the kept mask) from loss_evals (B, T): the quantile of sqrt over all of it folded into
    the EMA first, then rows at or above the EMA count as zero; the mean over B x T (compute_loss 343-370)."""
    if quantile is None:
        return loss_evals.mean(), torch.ones_like(loss_evals, dtype=torch.bool)
    root = loss_evals.detach().sqrt()
    threshold = ema(float(torch.quantile(root, quantile)))
    keep = root < threshold
    return (loss_evals * keep).mean(), keep


class ReleasedAdjointMatching(AdjointMatchingObjective):
    """The released loss in flowrl's objective interface (trained steps: every step whose std is positive)."""

    def __init__(self, reward_multiplier: float, clip_quantile: float | None) -> None:
        super().__init__(reward_multiplier, None, 0.6, clip_quantile, 0.9, "memoryless")
        self.ema = ReleasedEMA(0.9)

    def losses(self, pipeline, sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        self.prepare(batch)
        adjoint, base = released_adjoints(pipeline, sampler, batch, self.reward_multiplier)
        evals, steps = [], []
        for k in range(batch.num_steps):
            x, sigma, sigma_next = batch.latents[:, k], batch.sigmas[k], batch.sigmas[k + 1]
            out = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
            control, std = released_control(sampler, out, base[k], x, sigma, sigma_next)
            if float(std.max()) > 0:
                evals.append(released_residual(control, adjoint[k], std))
                steps.append(k)
        loss, keep = released_minibatch_loss(torch.stack(evals, 1), self.clip_quantile, self.ema)
        metrics = {"loss/adjoint_matching": loss.detach(), "adjoint/clipped_fraction": 1 - keep.float().mean()}
        yield LossOutput(loss=loss, metrics=metrics)


# -- training and measuring -----------------------------------------------------------------------------------------
def build_trainer(arm: str, seed: int, iterations: int | None, out_dir: str):
    from flowrl.trainer import Trainer

    overrides = [f"seed={seed}", f"output_dir={out_dir}", "log.progress=false", "train.num_threads=1"]
    if iterations is not None:
        overrides.append(f"train.iterations={iterations}")
    trainer = Trainer(PRESET, overrides)
    if arm != "flowrl":
        objective = ReleasedAdjointMatching(trainer.objective.reward_multiplier, 0.9 if arm == "released" else None)
        trainer.modality.objective = trainer.loop.objective = trainer.objective = objective
    return trainer


def velocity_errors(pipeline, target) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x0, eps = target.sample(20000, gen), torch.randn(20000, 2, generator=gen)
    errors = {}
    with torch.no_grad():
        for s in SIGMAS:
            xs = ((1 - s) * x0 + s * eps).float()
            err = pipeline.predict(xs, torch.tensor(s), None) - target.velocity(xs, s).float()
            errors[str(s)] = round(err.pow(2).sum(1).mean().sqrt().item(), 4)
    return errors


def measure(trainer, target) -> dict:
    result = {}
    for name, sampler in (("ode", "ode"), ("sde", "rollout")):
        samples = trainer.sample("toy", 20000, seed=0, sampler=sampler, num_inference_steps=200)
        c = compare_to_target(samples.double(), target).as_dict()
        result[name] = {k: c[k] for k in ("weight_error", "mean_error", "std_relative_error", "passed", "weights", "means", "stds")}
    result["velocity_rms_error"] = velocity_errors(trainer.pipeline, target)
    return result


def run(arm: str, seed: int, iterations: int | None) -> dict:
    target = tilted_target(TWO_MODES, QuadraticReward2D(), LAMBDA)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(arm, seed, iterations, tmp)
        start, last = time.perf_counter(), {}
        for it in range(trainer.config.train.iterations):
            last = trainer.train_iteration(it)
        seconds = time.perf_counter() - start
        return {"arm": arm, "seed": seed, "iterations": trainer.config.train.iterations, "train_s": round(seconds, 1),
                "final_loss": round(last.get("loss/adjoint_matching", float("nan")), 5), **measure(trainer, target),
                "reference": REFERENCE}  # fmt: skip


# -- the table ----------------------------------------------------------------------------------------------------------
def _cell(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(lines: list[dict]) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in lines))
    rows = ["| loss | sampler | seeds | weight error | mean error | std error | passed |", "|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = [r for r in lines if r["arm"] == arm]
        for s in ("ode", "sde"):
            w, m, d = ([r[s][k] for r in runs] for k in ("weight_error", "mean_error", "std_relative_error"))
            passed = sum(r[s]["passed"] for r in runs)
            seeds = ", ".join(str(r["seed"]) for r in runs)
            rows.append(
                f"| {arm} | {s} | {seeds} | {_cell(w, '.3f')} | {_cell(m, '.3f')} | {_cell([100 * v for v in d], '.1f')}% | {passed}/{len(runs)} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", choices=("flowrl", "released", "released_noclip"), default=["flowrl", "released"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--iterations", type=int, default=None, help="default: the preset's 1200")
    p.add_argument("--out", type=Path, default=None, help="append each run's JSON line here too")
    p.add_argument("--table", nargs="+", type=Path, default=None, help="print the table of these JSON-lines files and stop")
    args = p.parse_args()
    if args.table:
        print(table([json.loads(line) for f in args.table for line in f.read_text().splitlines() if line.strip()]))
        return
    torch.set_num_threads(1)
    for seed in args.seeds:
        for arm in args.arms:
            line = json.dumps(run(arm, seed, args.iterations))
            print(line, flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
