"""Adjoint Matching against closed forms and autograd oracles, the 2-D toy's exact base and tilted targets,
reward gradients through a pipeline's decode, and the refusal of non-differentiable rewards."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from flowrl.errors import FlowRLError
from flowrl.objectives.adjoint_matching import (
    AdjointMatchingConfig,
    adjoint_matching_residual,
    ddpm_memoryless_variance,
    ema_update,
    memoryless_flow_diffusion_sq,
    memoryless_step_weight,
    output_weight,
    score_depends_on_model,
    score_difference,
    stratified_steps,
)
from flowrl.pipelines.toy2d import TWO_MODES, GaussianMixture, Toy2DPipeline, mode_statistics, tilt_linear, tilted_target
from flowrl.reward_models.combine import RewardEnsemble, WeightedSum
from flowrl.reward_models.digit_classifier import DigitClassifierReward
from flowrl.reward_models.gradients import require_differentiable, reward_and_gradient
from flowrl.reward_models.image_stats import InkReward
from flowrl.reward_models.jpeg import JpegCompressibilityReward
from flowrl.reward_models.toy2d import LinearReward2D, QuadraticReward2D
from flowrl.samplers import DDIMSampler, DiscreteSchedule, FlowMemorylessConfig
from flowrl.samplers.rollout import rollout
from flowrl.types import Trajectory

GAUSSIAN = GaussianMixture(weights=(1.0,), means=((0.3, -0.2),), stds=(0.7,))


@pytest.fixture(autouse=True)
def one_thread():
    """Every tensor here is tiny: a second intra-op thread only adds synchronisation (10x slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TiltedVelocity(nn.Module):
    """The exact optimal fine-tuned part of a toy model: velocity of the tilted target minus the base's."""

    def __init__(self, base: GaussianMixture, target: GaussianMixture) -> None:
        super().__init__()
        self.base, self.target = base, target

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return (self.target.velocity(x, sigma) - self.base.velocity(x, sigma)).float()


class GaussianDDPMPipeline:
    """A DDPM model that is exact for Gaussian data N(mean, std^2 I) under x = sqrt(abar) x0 + sqrt(1 - abar) eps:
    E[eps | x] = sqrt(1 - abar) (x - sqrt(abar) mean) / D, E[x0 | x] = mean + sqrt(abar) std^2 (x - sqrt(abar) mean) / D,
    D = abar std^2 + 1 - abar. Outside ``reference()`` it is the exact model of N(tuned_mean, std^2 I)."""

    def __init__(self, schedule: DiscreteSchedule, prediction_type: str, mean, std: float, tuned_mean) -> None:
        self.schedule, self.prediction_type, self.std = schedule, prediction_type, std
        self.mean, self.tuned_mean = torch.tensor(mean, dtype=torch.float64), torch.tensor(tuned_mean, dtype=torch.float64)
        self.denoiser = nn.Identity()
        self._ref = False

    @contextlib.contextmanager
    def reference(self):
        self._ref = True
        try:
            yield self
        finally:
            self._ref = False

    def encode(self, prompts):
        return {"prompt": torch.zeros(len(prompts), 1)}

    def initial_noise(self, batch, generator):
        return torch.randn(batch, 2, generator=generator)

    def decode(self, x):
        return x.float()

    def predict(self, x, sigma, cond, guidance_scale=1.0):
        mean = self.mean if self._ref else self.tuned_mean
        a = self.schedule.alpha_bar(torch.as_tensor(sigma)).double()
        d = a * self.std**2 + 1 - a
        centred = x.double() - a.sqrt() * mean
        eps = (1 - a).sqrt() * centred / d
        if self.prediction_type == "epsilon":
            return eps.float()
        x0 = mean + a.sqrt() * self.std**2 * centred / d
        return (a.sqrt() * eps - (1 - a).sqrt() * x0).float()


def _score(trajectory: Trajectory, reward, lam: float = 1.0) -> Trajectory:
    out, grads = reward_and_gradient(reward, lambda x: x.float(), trajectory.latents[:, -1], trajectory.prompts, trajectory.metadata)
    trajectory.rewards, trajectory.reward_grads = out.scores, grads
    return trajectory


def _rollout(pipeline, sampler, n: int, steps: int, seed: int = 0) -> Trajectory:
    return rollout(
        pipeline,
        sampler,
        [""] * n,
        [{}] * n,
        torch.arange(n),
        pipeline.schedule.sigmas(steps),
        torch.Generator().manual_seed(seed),
        same_noise_in_group=False,
    )


def _step_losses(objective, pipeline, sampler, batch) -> tuple[list[float], list[float]]:
    losses, targets = [], []
    for out in objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0)):
        losses.append(float(out.metrics["loss/adjoint_matching"]))
        targets.append(float(out.metrics["adjoint/target_norm"]))
    return losses, targets


# ---------------------------------------------------------------------------------------------
# The lean adjoint
# ---------------------------------------------------------------------------------------------


def _noise_fixed_rollout(pipeline, sampler, sigmas, x0, noises):
    """The base chain x_{k+1} = m_k(x_k) + s_k z_k with given z_k, in one autograd graph."""
    states, stochastic = [x0], []
    x = x0
    for k in range(len(sigmas) - 1):
        with pipeline.reference():
            out = pipeline.predict(x, sigmas[k], {})
        step = sampler.step(out, x, sigmas[k], sigmas[k + 1], x_next=x.detach())
        x = step.mean + step.std * noises[k]
        stochastic.append(bool(step.std > 0))
        states.append(x)
    return states, torch.tensor(stochastic)


@pytest.mark.parametrize("reward", [LinearReward2D((0.5, -1.0)), QuadraticReward2D((0.5, 1.0), 1.5)], ids=["linear", "quadratic"])
def test_lean_adjoint_equals_autograd_through_the_noise_fixed_base_rollout(reward):
    """a_k = -lambda d r(x_K) / d x_k through the whole base rollout with the noise held fixed (mixture base: nonlinear)."""
    torch.manual_seed(0)
    pipeline, sampler, lam, K, B = Toy2DPipeline(), FlowMemorylessConfig().build(), 1.7, 6, 32
    sigmas = pipeline.schedule.sigmas(K)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(B, 2, generator=g).requires_grad_(True)
    states, stochastic = _noise_fixed_rollout(pipeline, sampler, sigmas, x0, torch.randn(K, B, 2, generator=g))
    for s in states[1:]:
        s.retain_grad()
    (lam * reward(states[-1], [""] * B, [{}] * B).scores).sum().backward()
    batch = Trajectory(
        latents=torch.stack([s.detach() for s in states], 1),
        sigmas=sigmas,
        log_probs=torch.zeros(B, K),
        stochastic=stochastic,
        cond={},
        prompts=[""] * B,
        metadata=[{}] * B,
        group_ids=torch.arange(B),
    )
    _score(batch, reward)
    adjoint, _ = AdjointMatchingConfig(reward_multiplier=lam).build().adjoints(pipeline, sampler, batch, list(range(K)))
    for k in range(K):
        expected = -(x0.grad if k == 0 else states[k].grad)
        assert torch.allclose(adjoint[k], expected, rtol=1e-4, atol=1e-5), k


def test_lean_adjoint_on_a_linear_drift_is_the_closed_form_tweedie_slope():
    """Gaussian base N(m, s^2 I): every exact step mean is affine, so a_k = -lambda (d E[x0 | x_k] / d x_k) w
    = -lambda (1 - sigma_k) s^2 / D_k w with D_k = (1 - sigma_k)^2 s^2 + sigma_k^2, whatever the trajectory."""
    pipeline, sampler, lam, K = Toy2DPipeline(base=GAUSSIAN), FlowMemorylessConfig().build(), 2.0, 8
    w = torch.tensor([0.5, -1.0])
    batch = _score(_rollout(pipeline, sampler, 16, K), LinearReward2D(w.tolist()))
    adjoint, _ = AdjointMatchingConfig(reward_multiplier=lam).build().adjoints(pipeline, sampler, batch, list(range(K)))
    s2 = GAUSSIAN.stds[0] ** 2
    for k in range(K):
        sigma = float(batch.sigmas[k])
        slope = (1 - sigma) * s2 / ((1 - sigma) ** 2 * s2 + sigma**2)
        assert torch.allclose(adjoint[k], (-lam * slope * w).expand(16, 2), atol=2e-6), k
    assert torch.all(adjoint[0] == 0)  # the memoryless step from sigma = 1 forgets its start


# ---------------------------------------------------------------------------------------------
# The loss at the known optimum
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_weighting", ["memoryless", "output"])
def test_loss_is_zero_at_the_closed_form_optimal_velocity_of_a_gaussian(loss_weighting):
    """Gaussian base, linear reward: the optimal fine-tuned model is the flow velocity of the tilted Gaussian
    N(m + lambda s^2 w, s^2 I). Its per-step loss is zero (to float precision) on every step; the base is not.
    The same under either step weighting: a weight per noise level does not move the fixed point."""
    lam, reward = 1.5, LinearReward2D((0.5, -1.0))
    target = tilt_linear(GAUSSIAN, reward.weights, lam)
    sampler, objective = (
        FlowMemorylessConfig().build(),
        AdjointMatchingConfig(reward_multiplier=lam, num_trained_steps=None, clip_quantile=None, loss_weighting=loss_weighting).build(),
    )
    tuned = Toy2DPipeline(base=GAUSSIAN, net=TiltedVelocity(GAUSSIAN, target))
    losses, targets = _step_losses(objective, tuned, sampler, _score(_rollout(tuned, sampler, 64, 10), reward))
    assert len(losses) == 9  # every step but the one from sigma = 1, the deterministic last step included
    assert max(loss / t for loss, t in zip(losses, targets)) < 1e-9
    base = Toy2DPipeline(base=GAUSSIAN)  # zero MLP: the base itself
    losses, targets = _step_losses(objective, base, sampler, _score(_rollout(base, sampler, 64, 10), reward))
    assert min(loss / t for loss, t in zip(losses, targets)) > 0.99  # no control: the loss is the whole target


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_loss_is_zero_at_the_optimum_of_a_gaussian_ddpm_on_ddim_eta_1(prediction_type):
    """The same statement for a DDPM model on DDIM eta = 1 (its memoryless sampler), in flowrl's DiscreteSchedule
    conventions: the exact model of the tilted Gaussian has zero loss, the base has the whole target."""
    schedule = DiscreteSchedule.from_betas(torch.linspace(1e-4, 0.02, 1000))
    lam, w, mean, std = 1.5, (0.5, -1.0), (0.3, -0.2), 0.7
    tuned_mean = tuple(m + lam * std**2 * wi for m, wi in zip(mean, w))
    sampler = DDIMSampler(schedule, prediction_type=prediction_type, eta=1.0, clip_sample=None, reduction="mean")
    objective = AdjointMatchingConfig(reward_multiplier=lam, num_trained_steps=None, clip_quantile=None).build()
    for tuned, expect_zero in ((tuned_mean, True), (mean, False)):
        pipeline = GaussianDDPMPipeline(schedule, prediction_type, mean, std, tuned)
        losses, targets = _step_losses(objective, pipeline, sampler, _score(_rollout(pipeline, sampler, 64, 10), LinearReward2D(w)))
        assert len(losses) == 10  # every step: a DDPM model's score depends on it at every noise level
        ratios = [loss / t for loss, t in zip(losses, targets)]
        assert (max(ratios) < 1e-8) if expect_zero else (min(ratios) > 0.99)


# ---------------------------------------------------------------------------------------------
# Schedules, step choice, clipping
# ---------------------------------------------------------------------------------------------


def test_step_weights_are_the_integral_of_the_memoryless_diffusion():
    grid = torch.linspace(0.3, 0.7, 20001, dtype=torch.float64)
    numeric = torch.trapezoid(memoryless_flow_diffusion_sq(grid), grid)
    assert float(memoryless_step_weight(torch.tensor(0.7), torch.tensor(0.3), "flow")) == pytest.approx(float(numeric), rel=1e-6)
    assert math.isinf(float(memoryless_step_weight(torch.tensor(1.0), torch.tensor(0.9), "flow")))
    schedule = DiscreteSchedule.from_betas(torch.linspace(1e-4, 0.02, 1000))
    s, sn = torch.tensor(0.5), torch.tensor(0.499)  # one training timestep apart
    a, an = schedule.alpha_bar(s).double(), schedule.alpha_bar(sn).double()
    std = (
        DDIMSampler(schedule, eta=1.0, prediction_type="epsilon", clip_sample=None, reduction="mean")
        .step(torch.zeros(1, 2), torch.zeros(1, 2), s, sn, x_next=torch.zeros(1, 2))
        .std
    )
    assert float(ddpm_memoryless_variance(a, an)) == pytest.approx(float(std) ** 2, rel=1e-4)
    # DDIM eta = 1 injects, over a small step, the variance the memoryless (DDPM) SDE would (the step's weight),
    # to first order: 1 - a / a' = log(a' / a) - log(a' / a)^2 / 2 + ..., a relative gap of beta_t / 2 = 0.5% here
    assert float(ddpm_memoryless_variance(a, an)) == pytest.approx(float(memoryless_step_weight(s, sn, "epsilon", schedule)), rel=1e-2)


def test_output_weighting_is_uniform_in_the_model_output():
    """loss_weighting "output": w ||dscore + a||^2 = h ||dout + a / c||^2 with dscore = c dout. Hand values: a flow
    step 0.8 -> 0.75 has h = 0.05, c = (1 - 0.8) / 0.8 = 0.25, w = 0.05 / 0.0625 = 0.8 (the paper's weight there is
    2 log(0.25 / 0.2) - 0.1 = 0.3463); an epsilon DDPM step has c = 1 / sqrt(1 - abar), w = h (1 - abar)."""
    s, sn = torch.tensor(0.8), torch.tensor(0.75)
    assert float(output_weight(s, sn, "flow")) == pytest.approx(0.8, rel=1e-6)
    assert float(memoryless_step_weight(s, sn, "flow")) == pytest.approx(2 * math.log(1.25) - 0.1, rel=1e-6)
    dout, a = torch.tensor([[0.3, -0.2]]), torch.tensor([[0.1, 0.4]])
    dscore = score_difference(dout, torch.zeros_like(dout), s, "flow")
    expected = 0.05 * ((dout + a / ((1 - 0.8) / 0.8 * -1)) ** 2).sum()  # c = -(1 - sigma) / sigma for a flow
    assert float(adjoint_matching_residual(dscore, a, output_weight(s, sn, "flow"))) == pytest.approx(float(expected), rel=1e-5)
    schedule = DiscreteSchedule.from_betas(torch.linspace(1e-4, 0.02, 1000))
    abar = float(schedule.alpha_bar(s))
    assert float(output_weight(s, sn, "epsilon", schedule)) == pytest.approx(0.05 * (1 - abar), rel=1e-5)


def test_steps_without_signal_are_not_trained():
    """alpha = 0 (a flow at sigma = 1, a zero-terminal-SNR DDPM's first step, as CogVideoX's rescaled betas
    give): the score is the same for every model and the step weight is infinite, so no loss is put there."""
    assert not score_depends_on_model(torch.tensor(1.0), "flow") and score_depends_on_model(torch.tensor(0.99), "flow")
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)
    abar[-1] = 0.0  # zero terminal SNR
    schedule = DiscreteSchedule(abar)
    first, second = schedule.sigmas(4)[:2]
    assert float(first) == 1.0 and not score_depends_on_model(first, "v_prediction", schedule)
    assert math.isinf(float(memoryless_step_weight(first, second, "v_prediction", schedule)))
    assert score_depends_on_model(second, "v_prediction", schedule)
    assert score_depends_on_model(first, "epsilon", DiscreteSchedule.from_betas(torch.linspace(1e-4, 0.02, 1000)))


def test_stratified_steps_draw_half_from_each_part():
    trainable = torch.ones(20, dtype=torch.bool)
    trainable[0] = False  # a flow's sigma = 1 step
    for seed in range(5):
        steps = stratified_steps(trainable, 4, 0.6, torch.Generator().manual_seed(seed))
        assert len(steps) == 4 and 0 not in steps and steps == sorted(set(steps))
        assert sum(s <= 11 for s in steps) == 2  # the first round(0.6 * 19) = 11 trainable steps are 1..11
    assert stratified_steps(trainable, None, 0.6, torch.Generator()) == list(range(1, 20))
    assert stratified_steps(trainable, 3, 0.1, torch.Generator().manual_seed(0)).__len__() == 3  # short stratum


def test_clipping_threshold_is_an_ema_of_the_quantile_and_resumes_exactly():
    assert ema_update(None, 0, 5.0, 0.9) == 5.0
    assert ema_update(5.0, 1, 3.0, 0.9) == pytest.approx(4.0)  # plain average while updates < 1 / decay
    assert ema_update(4.0, 2, 2.0, 0.9) == pytest.approx(0.9 * 4.0 + 0.1 * 2.0)
    pipeline, sampler = Toy2DPipeline(), FlowMemorylessConfig().build()
    batch = _score(_rollout(pipeline, sampler, 64, 6), LinearReward2D())
    objective = AdjointMatchingConfig(num_trained_steps=None, clip_quantile=0.5).build()
    first = [out.metrics for out in objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0))]
    assert all(float(m["adjoint/clipped_fraction"]) == 0 for m in first)  # nothing to clip with before the first EMA
    state = objective.state_dict()
    assert state["clip_updates"] == 1 and state["clip_ema"] > 0
    resumed = AdjointMatchingConfig(num_trained_steps=None, clip_quantile=0.5).build()
    resumed.load_state_dict(state)
    again = [out.metrics for out in objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0))]
    replay = [out.metrics for out in resumed.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0))]
    assert [float(m["loss/adjoint_matching"]) for m in again] == [float(m["loss/adjoint_matching"]) for m in replay]
    clipped = sum(float(m["adjoint/clipped_fraction"]) for m in again) / len(again)
    assert 0.2 < clipped < 0.8  # the median threshold clips about half the rows
    assert objective.state_dict() == resumed.state_dict()


def test_missing_reward_gradients_are_refused():
    pipeline, sampler = Toy2DPipeline(), FlowMemorylessConfig().build()
    batch = _rollout(pipeline, sampler, 4, 4)
    with pytest.raises(FlowRLError, match="reward_grads"):
        next(AdjointMatchingConfig().build().losses(pipeline, sampler, batch, torch.Generator()))


# ---------------------------------------------------------------------------------------------
# The toy model
# ---------------------------------------------------------------------------------------------


def test_toy_base_velocity_matches_monte_carlo_and_its_endpoints():
    """E[eps - x0 | x_sigma = x] by self-normalised importance sampling over exact draws of x0."""
    g = torch.Generator().manual_seed(0)
    x0 = TWO_MODES.sample(400_000, g)
    x = torch.tensor([[-1.5, 0.3], [0.2, -0.4], [1.1, 0.9]], dtype=torch.float64)
    for sigma in (0.3, 0.6, 0.9):
        log_w = -((x[:, None, :] - (1 - sigma) * x0[None]) ** 2).sum(-1) / (2 * sigma**2)
        w = torch.softmax(log_w, dim=1)
        v = (x[:, None, :] - (1 - sigma) * x0[None]) / sigma - x0[None]  # eps - x0 given x
        mc = (w[:, :, None] * v).sum(1)
        assert torch.allclose(TWO_MODES.velocity(x, sigma), mc, atol=0.03), sigma
    assert torch.allclose(TWO_MODES.velocity(x, 1.0), x - torch.tensor([0.0, 0.0], dtype=torch.float64))  # noise minus data mean
    assert torch.allclose(TWO_MODES.velocity(x, 0.0), -x)  # E[eps | x0] = 0


def test_toy_base_ode_reproduces_the_mixture():
    pipeline = Toy2DPipeline()
    sigmas = pipeline.schedule.sigmas(40).double()
    x = torch.randn(10000, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad(), pipeline.reference():
        for k in range(40):  # Heun
            h = sigmas[k + 1] - sigmas[k]
            v1 = pipeline.base.velocity(x, sigmas[k])
            v2 = pipeline.base.velocity(x + h * v1, sigmas[k + 1])
            x = x + h * (v1 + v2) / 2
    stats = mode_statistics(x, TWO_MODES)
    assert torch.allclose(stats.weights, torch.tensor([0.5, 0.5], dtype=torch.float64), atol=0.015)  # 3 standard errors
    assert torch.allclose(stats.means, torch.tensor(TWO_MODES.means, dtype=torch.float64), atol=0.03)
    assert torch.allclose(stats.stds, torch.full((2, 2), 0.5, dtype=torch.float64), rtol=0.04)


@pytest.mark.parametrize(
    "reward,lam", [(LinearReward2D((0.5, 0.5)), 1.0), (QuadraticReward2D((0.0, 1.0), 1.0), 2.0)], ids=["linear", "quadratic"]
)
def test_tilted_targets_match_numerical_integration(reward, lam):
    """p_base(x) exp(lambda r(x)) normalised on a fine grid: density, and each half-plane's mass, mean and std."""
    target = tilted_target(TWO_MODES, reward, lam)
    h = 0.02
    g1, g2 = torch.meshgrid(torch.arange(-7, 7, h, dtype=torch.float64), torch.arange(-6, 7, h, dtype=torch.float64), indexing="ij")
    pts = torch.stack([g1.flatten(), g2.flatten()], 1)
    log_tilt = TWO_MODES.log_prob(pts) + lam * reward(pts, [], []).scores.double()
    p = torch.softmax(log_tilt, 0)  # grid weights of the normalised tilt
    assert torch.allclose(p / h**2, target.log_prob(pts).exp(), atol=1e-6)
    for j, side in enumerate((pts[:, 0] < 0, pts[:, 0] >= 0)):
        mass = p[side].sum()
        mean = (p[side, None] * pts[side]).sum(0) / mass
        var = (p[side, None] * (pts[side] - mean) ** 2).sum(0) / mass
        assert float(mass) == pytest.approx(target.weights[j], abs=1e-4)
        assert torch.allclose(mean, torch.tensor(target.means[j], dtype=torch.float64), atol=1e-3)
        # the half-plane cuts the quadratic target's modes 3.3 stds from their means: 0.15% less std there
        assert torch.allclose(var.sqrt(), torch.full((2,), target.stds[j], dtype=torch.float64), rtol=3e-3)
    if isinstance(reward, LinearReward2D):
        assert target.weights[0] == pytest.approx(1 / (1 + math.e**2)) and target.means[1] == pytest.approx((2.125, 0.125))
    else:
        assert target.means[0] == pytest.approx((-4 / 3, 1 / 3)) and target.stds[0] == pytest.approx(0.5 / math.sqrt(1.5))


@pytest.mark.slow
def test_toy_adjoint_matching_moves_the_mode_weights_toward_the_tilted_target():
    """Reduced convergence (about 5 CPU seconds): 60 iterations of 256 rollouts on 8 memoryless steps. The right
    mode's weight moves from the base's 0.5 to near the target 0.881 and the mean reward from ~0 toward
    E_p*[r] = 0.887 (seeds 0-3 give 0.84-0.88 and 0.83-0.94). The full-size settings are in the docs."""
    torch.manual_seed(0)
    reward, lam = LinearReward2D((0.5, 0.5)), 1.0
    target = tilted_target(TWO_MODES, reward, lam)
    pipeline, sampler = Toy2DPipeline(), FlowMemorylessConfig().build()
    objective = AdjointMatchingConfig(reward_multiplier=lam, num_trained_steps=None, clip_quantile=None).build()
    optimizer = torch.optim.AdamW(pipeline.trainable_parameters(), lr=5e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    sigmas = pipeline.schedule.sigmas(8)

    def right_mode_weight_and_reward() -> tuple[float, float]:
        final = _rollout(pipeline, sampler, 4000, 40, seed=123).latents[:, -1]
        return float(mode_statistics(final, target).weights[1]), float(reward(final, [], []).scores.mean())

    weight_before, reward_before = right_mode_weight_and_reward()
    for _ in range(60):
        batch = rollout(pipeline, sampler, [""] * 256, [{}] * 256, torch.arange(256), sigmas, g, same_noise_in_group=False)
        out, grads = reward_and_gradient(reward, pipeline.decode, batch.latents[:, -1], batch.prompts, batch.metadata)
        batch.rewards, batch.reward_grads = out.scores, grads
        optimizer.zero_grad()
        for loss in objective.losses(pipeline, sampler, batch, g):
            loss.loss.backward()
        optimizer.step()
    weight_after, reward_after = right_mode_weight_and_reward()
    assert abs(weight_before - 0.5) < 0.03 and abs(reward_before) < 0.1
    assert 0.78 < weight_after < 0.95
    assert 0.7 < reward_after < 1.0


# ---------------------------------------------------------------------------------------------
# Reward gradients
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_decode():
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    return build_pipeline(PipelineConfig(name="digits", pretrained="digits_flow", device="cpu"), "cpu").decode


def test_reward_gradients_through_the_digits_decode_match_finite_differences(digits_decode):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, 8, 8, generator=g) * 1.6 - 0.8  # inside the decode's clamp
    prompts, metadata = ["a handwritten three"] * 4, [{"digit": 3}, {"digit": 7}, {"digit": 0}, {"digit": 5}]
    out, grads = reward_and_gradient(InkReward(), digits_decode, x, prompts, metadata)
    assert torch.allclose(grads, torch.full_like(x, 1 / (2 * 64)))  # mean of (x + 1) / 2 over 64 pixels
    reward = WeightedSum({"ink": InkReward(), "digit_classifier": DigitClassifierReward()}, {"ink": 0.5, "digit_classifier": 1.0})
    out, grads = reward_and_gradient(reward, digits_decode, x, prompts, metadata)
    assert not out.scores.requires_grad and set(out.extras) == {"ink", "digit_classifier", "digit_classifier/accuracy"}
    direction = torch.randn(x.shape, generator=g)
    eps = 1e-2
    with torch.no_grad():
        plus = reward(digits_decode(x + eps * direction), prompts, metadata).scores
        minus = reward(digits_decode(x - eps * direction), prompts, metadata).scores
    fd = (plus - minus) / (2 * eps)
    assert torch.allclose((grads * direction).flatten(1).sum(1), fd, rtol=2e-2, atol=2e-4)
    # a sample without a digit has no classifier score: NaN reward, zero gradient; the others are unchanged
    out2, grads2 = reward_and_gradient(reward, digits_decode, x, prompts, metadata[:3] + [{}])
    assert torch.isnan(out2.scores[3]) and torch.all(grads2[3] == 0) and torch.allclose(grads2[:3], grads[:3])


def test_combiners_declare_differentiability_and_non_differentiable_rewards_are_refused():
    ink, classifier, jpeg = InkReward(), DigitClassifierReward(), JpegCompressibilityReward()
    differentiable = WeightedSum({"ink": ink, "digit_classifier": classifier}, {"ink": 1.0, "digit_classifier": 1.0})
    assert differentiable.differentiable
    require_differentiable(differentiable)
    mixed = WeightedSum({"ink": ink, "jpeg_compressibility": jpeg}, {"ink": 1.0, "jpeg_compressibility": 0.5})
    assert not mixed.differentiable
    with pytest.raises(
        FlowRLError, match=r"^reward 'jpeg_compressibility' is not differentiable; adjoint_matching needs a reward gradient"
    ):
        require_differentiable(mixed)
    ensemble = WeightedSum({"both": RewardEnsemble([ink, jpeg], "mean", 1.0, "variance", name="both")}, {"both": 1.0})
    assert not ensemble.differentiable
    with pytest.raises(FlowRLError, match="reward 'jpeg_compressibility' is not differentiable"):
        require_differentiable(ensemble)


def test_toy_rewards_and_pipeline_registry():
    from flowrl.config import load_config
    from flowrl.pipelines import FAMILIES
    from flowrl.pipelines.toy2d import Toy2DConfig
    from flowrl.reward_models import build_reward

    assert FAMILIES.section("toy2d") is Toy2DConfig and isinstance(Toy2DConfig().build("cpu"), Toy2DPipeline)
    assert build_reward("quadratic2d", center=[0.0, 1.0], scale=2.0)(torch.tensor([[0.0, 3.0]]), [""], [{}]).scores.item() == -4.0
    assert build_reward("linear2d", weights=[0.5, 0.5])(torch.tensor([[2.0, 4.0]]), [""], [{}]).scores.item() == 3.0
    config = load_config(
        None,
        [
            "pipeline.name=toy2d",
            "objective.name=adjoint_matching",
            "objective.reward_multiplier=2",
            "reward.components={quadratic2d: 1.0}",
            "sampler.name=flow_memoryless",
        ],
    )
    assert config.objective.reward_multiplier == 2 and config.objective.clip_quantile == 0.9
    with pytest.raises(FlowRLError, match="unknown config key 'objective.clip'"):
        load_config(None, ["objective.name=adjoint_matching", "objective.clip=1"])
    # the initial model is the base: the MLP's output layer starts at zero
    pipeline = Toy2DPipeline()
    x = torch.randn(5, 2)
    with pipeline.reference():
        base = pipeline.predict(x, torch.tensor(0.4), {})
    assert torch.equal(pipeline.predict(x, torch.tensor(0.4), {}), base)


def test_a_sampler_that_is_not_memoryless_is_refused_unless_asked_for():
    from flowrl.config import load_config

    for sampler in (["sampler.name=flow_sde"], ["sampler.name=ode"], ["sampler.name=ddim", "sampler.eta=0.5"]):
        with pytest.raises(FlowRLError, match=r"^adjoint_matching needs a memoryless sampler .* sampler.name is '(flow_sde|ode|ddim)'"):
            load_config(None, ["objective.name=adjoint_matching", *sampler])
    assert load_config(None, ["objective.name=adjoint_matching", "sampler.name=flow_memoryless"]).objective.name == "adjoint_matching"
    assert load_config(None, ["objective.name=adjoint_matching", "sampler.name=ddim", "sampler.eta=1.0"]).sampler.eta == 1.0
    assert (
        load_config(None, ["objective.name=adjoint_matching", "sampler.name=flow_sde", "objective.allow_non_memoryless=true"]).sampler.name
        == "flow_sde"
    )


def test_toy_check_passes_exact_target_samples_and_fails_shifted_ones():
    from flowrl.evaluation.toy2d import compare_to_target

    target = tilt_linear(TWO_MODES, (0.5, 0.5), 1.0)
    exact = target.sample(20000, torch.Generator().manual_seed(0))
    result = compare_to_target(exact, target)
    assert result.passed and result.weight_error < 0.01 and result.mean_error < 0.03 and result.std_relative_error < 0.04
    assert not compare_to_target(exact + torch.tensor([0.1, 0.0], dtype=torch.float64), target).passed  # a mean 0.1 off
    assert not compare_to_target(exact * 1.1, target).passed  # 10% wider (and means moved)
    with pytest.raises(FlowRLError, match="NaN"):
        compare_to_target(exact * float("nan"), target)


def test_learning_rate_schedules():
    from flowrl.trainer import lr_factor

    assert [lr_factor("constant", i, 5) for i in range(5)] == [1.0] * 5
    assert [lr_factor("linear", i, 5, 0.2) for i in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert (
        lr_factor("cosine", 0, 11) == 1.0
        and lr_factor("cosine", 5, 11) == pytest.approx(0.5)
        and lr_factor("cosine", 10, 11) == pytest.approx(0.0, abs=1e-12)
    )
    assert lr_factor("linear", 0, 1) == 1.0  # a one-iteration run trains at the full rate


@pytest.mark.parametrize("reward", ["jpeg_compressibility", "ocr"])
def test_training_with_a_non_differentiable_reward_is_refused_before_anything_is_written(tmp_path, capsys, reward):
    """The real command: one sentence naming the reward, exit 1, no run directory."""
    from flowrl.cli import main

    out = tmp_path / "run"
    code = main(
        ["train", "configs/toy/adjoint_matching_linear.yaml", f"reward.components={{linear2d: 1.0, {reward}: 0.5}}", f"output_dir={out}"]
    )
    err = capsys.readouterr().err
    assert code != 0 and f"reward '{reward}' is not differentiable; adjoint_matching needs a reward gradient" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_toy_targets_of_the_shipped_configs():
    from flowrl.evaluation.toy2d import target_of

    linear, lam = target_of("configs/toy/adjoint_matching_linear.yaml")
    assert lam == 1.0 and linear.weights[1] == pytest.approx(math.e**2 / (1 + math.e**2))
    quadratic, lam = target_of("configs/toy/adjoint_matching_quadratic.yaml")
    assert lam == 2.0 and quadratic.means[1] == pytest.approx((4 / 3, 1 / 3)) and quadratic.stds[0] == pytest.approx(0.5 / math.sqrt(1.5))
    grpo, lam = target_of("configs/toy/grpo_kl_linear.yaml")  # KL weight beta = 1: the same tilt
    assert lam == 1.0 and grpo == linear
    with pytest.raises(FlowRLError, match="not a run of the 2-D toy"):
        target_of("configs/digits/grpo.yaml")
