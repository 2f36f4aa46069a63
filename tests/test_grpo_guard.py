"""GRPO-Guard: its gradient re-weighting (step_weighting: inverse_dt) against hand-derived numbers, alone and with its
ratio normalisation (ratio_norm); the normalisation's exact per-sample shift against hand values, against Flow-Factory's
form at image-size latents with a drifted policy, and on the real digits model and GRPO objective."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.functional import inverse_dt_step_weights
from flowrl.objectives.policy_gradient import normalised_log_ratio
from flowrl.samplers.branching import branched_rollout
from flowrl.samplers.log_prob import gaussian_log_prob
from flowrl.trainer import Trainer
from flowrl.types import Trajectory

_spec = importlib.util.spec_from_file_location("grpo_guard_shift", Path(__file__).resolve().parents[1] / "bench" / "grpo_guard_shift.py")
shift_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shift_bench)  # guard_case, agreement and Flow-Factory's form: the bench's measurement


def test_inverse_dt_weights_hand_values():
    # grid 1, 3/4, 1/4, 0: |dt| = 1/4, 1/2, 1/4, so 1/|dt| = 4, 2, 4 with mean 10/3: w = 1.2, 0.6, 1.2
    sigmas = torch.tensor([1.0, 0.75, 0.25, 0.0])
    assert inverse_dt_step_weights(sigmas[:-1], sigmas[1:]).tolist() == pytest.approx([1.2, 0.6, 1.2], rel=1e-6)
    # a subset of steps is normalised over itself: steps {0, 1} -> 4, 2 with mean 3
    assert inverse_dt_step_weights(sigmas[:2], sigmas[1:3]).tolist() == pytest.approx([4 / 3, 2 / 3], rel=1e-6)
    # a uniform grid: every weight exactly 1, so the option changes nothing on flowrl's embedded models' grids
    uniform = torch.linspace(1.0, 0.0, 11)
    assert inverse_dt_step_weights(uniform[:-1], uniform[1:]).tolist() == pytest.approx([1.0] * 10, abs=1e-6)


@pytest.fixture(scope="module")
def shifted_rollout(tmp_path_factory):
    """A real 3-step digits rollout on a shift-3 grid (SD3's resolution shift): s = 1, 2/3, 1/3, 0 maps through
    3 s / (1 + 2 s) to sigma = 1, 6/7, 3/5, 0, so |dt| = 1/7, 9/35, 3/5 and 1/|dt| = 7, 35/9, 5/3."""
    torch.set_num_threads(1)
    config = load_config(
        CONFIGS / "digits" / "grpo.yaml",
        fast_overrides(
            tmp_path_factory.mktemp("guard") / "run",
            **{"rollout.num_inference_steps": 3, "objective.timestep_fraction": 1.0, "eval.judge": "null", "log.trackers": "[]"},
        ),
    )
    trainer = Trainer(config)
    trainer.pipeline.schedule = dataclasses.replace(trainer.pipeline.schedule, shift=3.0)
    trainer.objective.ratio_norm = True  # GRPO-Guard's objective: the rollouts record their step means
    try:
        batch = trainer.advantages(trainer.score(trainer.collect(0)))
    finally:
        trainer.objective.ratio_norm = False
    assert batch.sigmas.tolist() == pytest.approx([1.0, 6 / 7, 3 / 5, 0.0], rel=1e-6)
    batch.advantages = torch.ones(len(batch))  # at unchanged weights r = 1: each step's clipped surrogate is -1
    return trainer, batch


@pytest.mark.parametrize("ratio_norm", [False, True])
def test_inverse_dt_scales_each_step_policy_loss(shifted_rollout, ratio_norm):
    trainer, batch = shifted_rollout
    objective = trainer.objective
    inv = [7.0, 35 / 9, 5 / 3]
    hand = [v / (sum(inv) / 3) for v in inv]  # 1.6726, 0.9292, 0.3982
    losses = {}
    try:
        objective.ratio_norm = ratio_norm  # GRPO-Guard in full: ratio_norm + inverse_dt
        for weighting in ("none", "inverse_dt"):
            objective.step_weighting = weighting
            with torch.no_grad():
                losses[weighting] = list(objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(0)))
    finally:
        objective.ratio_norm, objective.step_weighting = False, "none"
    # loss / |S| per step, |S| = 3; the normalised ratio is exp((log r - mean log r) s) = 1 too at r = 1
    assert [o.loss.item() for o in losses["none"]] == pytest.approx([-1 / 3] * 3, rel=1e-5)
    assert [o.loss.item() for o in losses["inverse_dt"]] == pytest.approx([-w / 3 for w in hand], rel=1e-5)
    for out in losses["inverse_dt"]:  # the logged (unweighted) policy loss and the ratio are untouched
        assert out.metrics["loss/policy"].item() == pytest.approx(-1.0, rel=1e-5)
        assert out.metrics["policy/ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)


def test_normalised_log_ratio_hand_values():
    # s = 0.5, mu_old = 0, x_next = (0.5, -0.5) so eps = (1, -1); mu_theta = (0.1, 0.3) so dmu = (0.1, 0.3).
    # Per-dimension mean: log r = mean((x - mu_old)^2 - (x - mu)^2) / (2 s^2) = mean(0.25 - 0.16, 0.25 - 0.64) / 0.5
    # = -0.3; b = mean(0.01, 0.09) / (2 s^2) = 0.1; (log r + b) s = -0.1 = mean(dmu * eps) = mean(0.1, -0.3).
    # Row 2 is at the rollout mean: log r = b = 0. Sum over the dimensions: log r = -0.6, b = 0.2, result -0.2.
    s = torch.tensor(0.5)
    x_next, old_mean = torch.tensor([[0.5, -0.5], [0.5, -0.5]]), torch.zeros(2, 2)
    theta = torch.tensor([[0.1, 0.3], [0.0, 0.0]], requires_grad=True)
    for reduction, value, grad in (("mean", -0.1, [0.5, -0.5]), ("sum", -0.2, [1.0, -1.0])):
        mean = old_mean + theta
        log_p, old_log_p = gaussian_log_prob(x_next, mean, s, reduction), gaussian_log_prob(x_next, old_mean, s, reduction)
        assert (log_p - old_log_p).tolist() == pytest.approx([-0.3 if reduction == "mean" else -0.6, 0.0], abs=1e-6)
        out = normalised_log_ratio(log_p, old_log_p, mean, old_mean, s, reduction)
        assert out.tolist() == pytest.approx([value, 0.0], abs=1e-6)
        # d/dmu_theta = R(eps): the shift's gradient cancels log r's pull towards the rollout mean, -dmu / s (row 1)
        (g,) = torch.autograd.grad(out[0], theta)
        assert g[0].tolist() == pytest.approx(grad, abs=1e-6) and g[1].tolist() == [0.0, 0.0]
    # a per-sample std (B, 1): row 2 with s = 1, x_next - mu_old = (1, -1) and dmu = (0.2, 0.2): mean(dmu * eps) = 0
    std = torch.tensor([[0.5], [1.0]])
    x_next, mean = torch.tensor([[0.5, -0.5], [1.0, -1.0]]), torch.tensor([[0.1, 0.3], [0.2, 0.2]])
    log_p, old_log_p = gaussian_log_prob(x_next, mean, std), gaussian_log_prob(x_next, old_mean, std)
    assert normalised_log_ratio(log_p, old_log_p, mean, old_mean, std, "mean").tolist() == pytest.approx([-0.1, 0.0], abs=1e-6)


@pytest.mark.parametrize("drift", [0.03, 0.1])
def test_exact_shift_equals_flow_factorys_form_at_image_size(drift):
    # 16 x 64 x 64 = 65,536 dimensions (SD3's latent of a 512 px image): the per-sample shift b_b = mean(dmu_b^2) /
    # (2 s^2) grows with the drift squared while the normalised ratio's spread is drift / 256, so a shared estimate
    # of b cannot stand in for it. flowrl's form equals the reference to float32 rounding: every clip decision, and
    # the gradient to 1e-5 of its scale; the approximation it replaced gets most decisions wrong.
    results = shift_bench.guard_case((16, 64, 64), drift)
    same, rel = shift_bench.agreement(results, "exact")
    print(f"drift {drift}: exact {same}/32 clip decisions, gradient max rel diff {rel:.2e}")
    assert same == 32 and rel < 1e-5
    assert 0 < int(results["reference"][0].sum()) < 32  # the clip binds on some samples and not on others
    same, rel = shift_bench.agreement(results, "approximation")
    print(f"drift {drift}: approximation {same}/32 clip decisions, gradient max rel diff {rel:.2e}")
    assert same <= 24 and rel > 0.05


def test_exact_shift_equals_flow_factorys_form_at_256_dimensions():
    results = shift_bench.guard_case((1, 16, 16), 0.1)  # 256 dimensions: the approximation's error is smaller here, not zero
    same, rel = shift_bench.agreement(results, "exact")
    assert same == 32 and rel < 1e-5


def test_rollout_records_the_means_it_sampled_from(shifted_rollout):
    trainer, batch = shifted_rollout
    assert batch.step_means is not None and batch.step_means.shape == (len(batch), 3, *batch.latents.shape[2:])
    for k in range(3):  # each stored log-prob is the density of the next state under the stored mean, bit for bit
        x, x_next = batch.latents[:, k], batch.latents[:, k + 1]
        out = trainer.sampler.step(torch.zeros_like(x), x, batch.sigmas[k], batch.sigmas[k + 1], x_next=x_next)
        assert torch.equal(gaussian_log_prob(x_next, batch.step_mean(k), out.std), batch.log_probs[:, k])
    # B2-DiffuRL's branches: the prefix steps are not stochastic and have no mean; the branches' steps do
    prompts, metadata, groups = batch.prompts, batch.metadata, batch.group_ids
    sigmas, noise = batch.sigmas, batch.latents[:, 0]
    branches = branched_rollout(
        trainer.pipeline, trainer.sampler, prompts, metadata, groups, sigmas, torch.Generator().manual_seed(1), 1, noise, record_means=True
    )
    assert branches.stochastic.tolist() == [False, True, True] and branches.step_means.shape[1] == 2
    for k in (1, 2):
        x, x_next = branches.latents[:, k], branches.latents[:, k + 1]
        std = trainer.sampler.step(torch.zeros_like(x), x, sigmas[k], sigmas[k + 1], x_next=x_next).std
        assert torch.equal(gaussian_log_prob(x_next, branches.step_mean(k), std), branches.log_probs[:, k])
    with pytest.raises(ValueError, match="no recorded rollout mean"):
        branches.step_mean(0)


def test_step_means_follow_rows_through_index_and_cat():
    b, s = 4, (1, 2, 2)
    means = torch.arange(b * 2 * 4, dtype=torch.float32).view(b, 2, *s)
    traj = Trajectory(
        latents=torch.zeros(b, 4, *s),
        sigmas=torch.linspace(1, 0, 4),
        log_probs=torch.zeros(b, 3),
        stochastic=torch.tensor([True, False, True]),
        cond={},
        prompts=["p"] * b,
        metadata=[{}] * b,
        group_ids=torch.arange(b),
        step_means=means,
    )
    assert torch.equal(traj.step_mean(2), means[:, 1])  # step 2 is the second stochastic step
    picked = traj[torch.tensor([3, 1])]
    assert torch.equal(picked.step_mean(0), means[[3, 1], 0])
    assert torch.equal(Trajectory.cat([traj[:2], traj[2:]]).step_means, means)


def test_ratio_norm_at_drifted_weights_on_the_digits_model(shifted_rollout):
    # The objective's normalised ratio against Flow-Factory's form recomputed here in float64 from the stored means, after
    # the weights moved: per step the loss (clip 2e-4, random-sign advantages) and the clip fraction.
    trainer, batch = shifted_rollout
    objective, pipeline, sampler = trainer.objective, trainer.pipeline, trainer.sampler
    params = list(pipeline.trainable_parameters())
    saved = [p.detach().clone() for p in params]
    advantages, clip_range = batch.advantages, objective.clip_range
    batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            for p in params:
                p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
        objective.ratio_norm, objective.clip_range = True, 2e-4
        with torch.no_grad():
            outs = list(objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0)))
            for k, out in enumerate(outs):
                x, x_next = batch.latents[:, k], batch.latents[:, k + 1]
                step = sampler.step(
                    pipeline.predict(x, batch.sigmas[k], batch.cond, batch.guidance_scale),
                    x,
                    batch.sigmas[k],
                    batch.sigmas[k + 1],
                    x_next=x_next,
                )
                s = float(step.std)
                loss, ratio = shift_bench.flow_factory_loss(
                    x_next.double(), step.mean.double(), batch.step_mean(k).double(), s, batch.advantages.double(), 2e-4
                )
                assert out.loss.item() * 3 == pytest.approx(loss.item(), rel=1e-5, abs=1e-9)
                assert out.metrics["policy/clipfrac"].item() == ((ratio - 1).abs() > 2e-4).double().mean().item()
        assert 0 < sum(o.metrics["policy/clipfrac"].item() for o in outs) < 3  # the weights moved enough to clip some
    finally:
        objective.ratio_norm, objective.clip_range, batch.advantages = False, clip_range, advantages
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)


def test_ratio_norm_refuses_a_batch_without_step_means(shifted_rollout):
    trainer, batch = shifted_rollout
    bare = dataclasses.replace(batch, step_means=None)
    trainer.objective.ratio_norm = True
    try:
        with pytest.raises(FlowRLError, match="step means"), torch.no_grad():
            list(trainer.objective.losses(trainer.pipeline, trainer.sampler, bare, torch.Generator().manual_seed(0)))
    finally:
        trainer.objective.ratio_norm = False
