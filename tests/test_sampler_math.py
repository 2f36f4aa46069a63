"""Numerical tests of the sampler math (docs/math.md sections 1-2), against oracles re-derived here.

Conventions: sigma in [0, 1], sigma = 1 is pure noise; a flow state is x_sigma = (1 - sigma) x0 + sigma x1
with x1 ~ N(0, I), the velocity is v = x1 - x0, a step goes sigma -> sigma_next < sigma, dt = sigma_next - sigma.

Every oracle below is written from the formulas, in float64, and never calls the sampler's own mean/std.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from flowrl.samplers.ddim import DDIMSampler
from flowrl.samplers.flow_sde import FlowCPSConfig, FlowMemorylessConfig, FlowSDEConfig, flow_euler_step
from flowrl.samplers.ode import ODESampler
from flowrl.samplers.schedules import DiscreteSchedule, FlowSchedule

SHAPE = (4, 1, 8, 8)
DIMS = (1, 2, 3)
BETAS = torch.linspace(1e-4, 0.02, 1000)


def _schedule() -> DiscreteSchedule:
    return DiscreteSchedule.from_betas(BETAS)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors, loaded CPU: with 2 intra-op threads a 200-step toy chain took ~40 s (threads spin-waiting
    against the background jobs) instead of ~0.1 s with one. Restored after this module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------------------------------


def flow_sde_oracle(v, x, sigma, sigma_next, diffusion, a):
    """Mean / std of the Euler-Maruyama step of the marginal-preserving reverse SDE.

    Forward SDE with the same marginals as the ODE dx = v dsigma:  dx = (v - g^2/2 * score) dsigma + g dW.
    Score from velocity: x1_hat = E[x1 | x] = x + (1 - sigma) v (because x0_hat = x - sigma v and
    x = (1 - sigma) x0_hat + sigma x1_hat), and Tweedie for x = (1 - sigma) x0 + sigma x1 gives
    score = -E[x1 | x] / sigma.  Euler-Maruyama with dt < 0 (the Brownian term has variance -dt):
        mean = x + dt (v - g^2/2 score),  std = g sqrt(-dt).
    Flow-GRPO: g = a sqrt(sigma / (1 - sigma)), at sigma = 1 the 1 - sigma is replaced by 1 - sigma_next.
    DanceGRPO: g = a (constant).
    """
    v, x = v.double(), x.double()
    dt = sigma_next - sigma
    if diffusion == "flow_grpo":
        one_minus = (1 - sigma_next) if sigma >= 1 else (1 - sigma)
        g = a * math.sqrt(sigma / one_minus)
    else:
        g = a
    score = -(x + (1 - sigma) * v) / sigma
    mean = x + dt * (v - 0.5 * g**2 * score)
    std = g * math.sqrt(-dt)
    return mean, torch.tensor(std, dtype=torch.float64), g


def flow_grpo_expanded_mean(v, x, sigma, sigma_next, g):
    """Flow-GRPO's reference writes the same mean expanded in x and v:
    x + dt v + g^2 dt / (2 sigma) (x + (1 - sigma) v)
      = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt."""
    v, x = v.double(), x.double()
    dt = sigma_next - sigma
    return x * (1 + g**2 * dt / (2 * sigma)) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt


def cps_oracle(v, x, sigma, sigma_next, a):
    """Coefficient-preserving step: rebuild x_next = (1 - s') x0_hat + s' (cos(a pi/2) x1_hat + sin(a pi/2) z),
    so the noise coefficient is exactly s' (cos^2 + sin^2 = 1).  x0_hat = x - sigma v, x1_hat = x + (1 - sigma) v.
    mean = (1 - s') x0_hat + s' cos(a pi / 2) x1_hat  (= sqrt(s'^2 - std^2) x1_hat),  std = s' sin(a pi / 2)."""
    v, x = v.double(), x.double()
    x0_hat = x - sigma * v
    x1_hat = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0_hat + sigma_next * math.cos(a * math.pi / 2) * x1_hat
    std = sigma_next * math.sin(a * math.pi / 2)
    return mean, torch.tensor(std, dtype=torch.float64)


def memoryless_oracle(v, x, sigma, sigma_next):
    """The forward chain's posterior in the textbook (VDM) form, with alpha = 1 - sigma and x0 = x0_hat:
    alpha_ts = alpha_t / alpha_s, var_ts = sigma_t^2 - alpha_ts^2 sigma_s^2,
    mean = (alpha_s var_ts / sigma_t^2) x0 + (alpha_ts sigma_s^2 / sigma_t^2) x_t,  var = var_ts sigma_s^2 / sigma_t^2."""
    v, x = v.double(), x.double()
    t, s = sigma, sigma_next
    a_t, a_s = 1 - t, 1 - s
    x0 = x - t * v
    a_ts = a_t / a_s
    var_ts = t**2 - a_ts**2 * s**2
    mean = (a_s * var_ts / t**2) * x0 + (a_ts * s**2 / t**2) * x
    return mean, torch.tensor(math.sqrt(var_ts * s**2 / t**2), dtype=torch.float64)


def alpha_bar_oracle(sigma: float) -> float:
    """sigma = (t + 1) / T for the integer timestep t; t = -1 (sigma = 0) means alpha-bar = 1 (final_alpha_cumprod)."""
    ac = torch.cumprod(1 - BETAS.double(), 0)
    t = round(sigma * len(BETAS)) - 1
    return 1.0 if t < 0 else float(ac[t])


def ddim_oracle(out, x, sigma, sigma_next, prediction_type, eta):
    """DDIM step (Song et al. eq. 12), docs/math.md section 2.
    x_t = sqrt(a) x0 + sqrt(1 - a) eps.  v-prediction: v = sqrt(a) eps - sqrt(1 - a) x0, so (x, v) is a rotation
    of (x0, eps) and eps = sqrt(1 - a) x + sqrt(a) v.  Then x0_hat = (x - sqrt(1 - a) eps) / sqrt(a),
        var  = (1 - a') / (1 - a) (1 - a / a')     (DDPM posterior variance for the jump t -> t'),
        std  = eta sqrt(var),  mean = sqrt(a') x0_hat + sqrt(1 - a' - std^2) eps."""
    out, x = out.double(), x.double()
    a, ap = alpha_bar_oracle(sigma), alpha_bar_oracle(sigma_next)
    eps = out if prediction_type == "epsilon" else math.sqrt(1 - a) * x + math.sqrt(a) * out
    x0 = (x - math.sqrt(1 - a) * eps) / math.sqrt(a)
    var = (1 - ap) / (1 - a) * (1 - a / ap)
    std = eta * math.sqrt(max(var, 0.0))
    mean = math.sqrt(ap) * x0 + math.sqrt(max(1 - ap - std**2, 0.0)) * eps
    return mean, torch.tensor(std, dtype=torch.float64)


# --------------------------------------------------------------------------------------------------
# 1. log-prob equals an independent Gaussian density
# --------------------------------------------------------------------------------------------------

FLOW_PAIRS = [(1.0, 0.9), (0.6, 0.55), (0.1, 0.02)]
DDIM_PAIRS = [(1.0, 0.98), (0.5, 0.45), (0.05, 0.03)]

CASES = [
    ("flow_grpo", FLOW_PAIRS + [(0.05, 0.0)]),
    ("dance_grpo", FLOW_PAIRS + [(0.05, 0.0)]),
    ("cps", FLOW_PAIRS),
    ("memoryless", FLOW_PAIRS),
    ("ddim_eps_eta1", DDIM_PAIRS),
    ("ddim_eps_eta05", DDIM_PAIRS),
    ("ddim_v_eta1", DDIM_PAIRS),
    ("ddim_v_eta05", DDIM_PAIRS),
]
CASE_PARAMS = [pytest.param(name, s, sn, id=f"{name}-{s}-{sn}") for name, pairs in CASES for s, sn in pairs]


def make_sampler(name: str, reduction: str = "mean"):
    if name == "flow_grpo":
        return FlowSDEConfig(noise_level=0.7, diffusion="flow_grpo", reduction=reduction).build()
    if name == "dance_grpo":
        return FlowSDEConfig(noise_level=0.3, diffusion="dance_grpo", reduction=reduction).build()
    if name == "cps":
        return FlowCPSConfig(noise_level=0.7, reduction=reduction).build()
    if name == "memoryless":
        return FlowMemorylessConfig(reduction=reduction).build()
    pred = "epsilon" if "_eps_" in name else "v_prediction"
    eta = 1.0 if name.endswith("eta1") else 0.5
    return DDIMSampler(_schedule(), prediction_type=pred, eta=eta, reduction=reduction, clip_sample=None)


def oracle(name, out, x, sigma, sigma_next):
    if name in ("flow_grpo", "dance_grpo"):
        a = 0.7 if name == "flow_grpo" else 0.3
        mean, std, _ = flow_sde_oracle(out, x, sigma, sigma_next, name, a)
        return mean, std
    if name == "cps":
        return cps_oracle(out, x, sigma, sigma_next, 0.7)
    if name == "memoryless":
        return memoryless_oracle(out, x, sigma, sigma_next)
    pred = "epsilon" if "_eps_" in name else "v_prediction"
    eta = 1.0 if name.endswith("eta1") else 0.5
    return ddim_oracle(out, x, sigma, sigma_next, pred, eta)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    out = torch.randn(SHAPE, generator=g)
    return x, out


@pytest.mark.parametrize("name,sigma,sigma_next", CASE_PARAMS)
def test_log_prob_matches_independent_gaussian(name, sigma, sigma_next):
    x, out = _inputs()
    mean, std = oracle(name, out, x, sigma, sigma_next)
    assert float(std) > 0
    dist = Normal(mean, std)
    s, sn = torch.tensor(sigma), torch.tensor(sigma_next)

    for reduction in ("mean", "sum"):
        sampler = make_sampler(name, reduction)
        reduce = (lambda t: t.mean(DIMS)) if reduction == "mean" else (lambda t: t.sum(DIMS))

        # Sampling: x_next = mean + std * z with z drawn from the generator (float32 N(0, 1)).
        res = sampler.step(out, x, s, sn, generator=torch.Generator().manual_seed(123))
        z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(123))
        assert res.x_next.dtype == torch.float32 and res.log_prob.dtype == torch.float32
        assert res.log_prob.shape == (SHAPE[0],)
        torch.testing.assert_close(res.mean.double(), mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res.std.double(), std, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(res.x_next.double(), mean + std * z.double(), rtol=1e-5, atol=1e-5)
        expected = reduce(dist.log_prob(res.x_next.double()))
        torch.testing.assert_close(res.log_prob.double(), expected, rtol=1e-5, atol=1e-4)

        # Re-scoring the sampled x_next reproduces the rollout's log-prob (one code path).
        again = sampler.step(out, x, s, sn, x_next=res.x_next)
        assert torch.equal(again.x_next, res.x_next)
        torch.testing.assert_close(again.log_prob, res.log_prob, rtol=0, atol=1e-6)

        # Re-scoring an arbitrary x_next: it is returned unchanged and scored by the density.
        other = (mean + 2.0 * std * torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)).double()).float()
        given = sampler.step(out, x, s, sn, x_next=other)
        assert torch.equal(given.x_next, other)
        expected = reduce(dist.log_prob(other.double()))
        torch.testing.assert_close(given.log_prob.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (1.0, 0.5), (0.6, 0.55), (0.1, 0.0)])
def test_flow_grpo_mean_matches_expanded_form(sigma, sigma_next):
    x, v = _inputs(1)
    mean, std, g = flow_sde_oracle(v, x, sigma, sigma_next, "flow_grpo", 0.7)
    expanded = flow_grpo_expanded_mean(v, x, sigma, sigma_next, g)
    torch.testing.assert_close(mean, expanded, rtol=1e-12, atol=1e-12)
    res = FlowSDEConfig(noise_level=0.7).build().step(v, x, torch.tensor(sigma), torch.tensor(sigma_next))
    torch.testing.assert_close(res.mean.double(), expanded, rtol=1e-5, atol=1e-5)
    # sigma = 1: g^2 = a^2 * 1 / (1 - sigma_next), finite.
    if sigma == 1.0:
        assert g == pytest.approx(0.7 / math.sqrt(1 - sigma_next))


def test_python_float_sigmas_accepted():
    x, v = _inputs(2)
    a = FlowSDEConfig().build().step(v, x, 0.6, 0.55, generator=torch.Generator().manual_seed(0))
    b = FlowSDEConfig().build().step(v, x, torch.tensor(0.6), torch.tensor(0.55), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.x_next, b.x_next) and torch.equal(a.log_prob, b.log_prob)


# --------------------------------------------------------------------------------------------------
# 2. Zero noise -> deterministic step; std == 0 -> no log-prob
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("diffusion", ["flow_grpo", "dance_grpo"])
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.55), (0.1, 0.0)])
def test_flow_sde_zero_noise_is_euler(diffusion, sigma, sigma_next):
    x, v = _inputs(3)
    s, sn = torch.tensor(sigma), torch.tensor(sigma_next)
    sampler = FlowSDEConfig(noise_level=0.0, diffusion=diffusion).build()
    res = sampler.step(v, x, s, sn, generator=torch.Generator().manual_seed(0))
    euler = x + (sigma_next - sigma) * v  # probability-flow ODE: dx/dsigma = v
    assert res.log_prob is None
    assert float(res.std) == 0.0
    torch.testing.assert_close(res.x_next, euler, rtol=1e-6, atol=1e-6)
    assert torch.equal(sampler.deterministic_step(v, x, s, sn), res.x_next)
    assert torch.equal(flow_euler_step(v, x, s, sn), res.x_next)


@pytest.mark.parametrize("pred", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("sigma,sigma_next", DDIM_PAIRS + [(0.05, 0.0)])
def test_ddim_eta0_is_deterministic_ddim(pred, sigma, sigma_next):
    x, out = _inputs(4)
    s, sn = torch.tensor(sigma), torch.tensor(sigma_next)
    sampler = DDIMSampler(_schedule(), prediction_type=pred, eta=0.0, clip_sample=None, reduction="mean")
    assert not sampler.stochastic
    res = sampler.step(out, x, s, sn, generator=torch.Generator().manual_seed(0))
    assert res.log_prob is None
    assert torch.equal(res.x_next, sampler.deterministic_step(out, x, s, sn))
    mean, std = ddim_oracle(out, x, sigma, sigma_next, pred, 0.0)
    assert float(std) == 0.0
    torch.testing.assert_close(res.x_next.double(), mean, rtol=1e-5, atol=1e-5)
    # The eta = 1 sampler's deterministic_step is the same eta = 0 step.
    stoch = DDIMSampler(_schedule(), prediction_type=pred, eta=1.0, clip_sample=None, reduction="mean")
    assert torch.equal(stoch.deterministic_step(out, x, s, sn), res.x_next)


@pytest.mark.parametrize(
    "base",
    [
        FlowSDEConfig().build(),
        FlowCPSConfig().build(),
        DDIMSampler(DiscreteSchedule.from_betas(BETAS), prediction_type="epsilon", eta=1.0, clip_sample=None, reduction="mean"),
    ],
    ids=["flow_sde", "cps", "ddim"],
)
def test_ode_sampler_wraps_deterministic_step(base):
    x, out = _inputs(5)
    s, sn = torch.tensor(0.5), torch.tensor(0.45)
    res = ODESampler(base).step(out, x, s, sn)
    assert res.log_prob is None
    assert float(res.std) == 0.0
    assert torch.equal(res.x_next, base.deterministic_step(out, x, s, sn))
    given = x + 0.25
    res2 = ODESampler(base).step(out, x, s, sn, x_next=given)
    assert res2.log_prob is None and torch.equal(res2.x_next, given)


def test_zero_std_steps_have_no_log_prob():
    x, out = _inputs(6)
    # CPS to sigma_next = 0: std = 0 * sin(.) = 0 and mean = x0_hat = x - sigma v.
    res = FlowCPSConfig(noise_level=0.7).build().step(out, x, torch.tensor(0.1), torch.tensor(0.0))
    assert res.log_prob is None and float(res.std) == 0.0
    torch.testing.assert_close(res.x_next, x - 0.1 * out, rtol=1e-6, atol=1e-6)
    # DDIM (eta = 1) to sigma = 0 with final alpha-bar 1: var = (1 - 1) / ... = 0, mean = x0_hat.
    sampler = DDIMSampler(_schedule(), eta=1.0, prediction_type="epsilon", clip_sample=None, reduction="mean")
    res = sampler.step(out, x, torch.tensor(0.05), torch.tensor(0.0))
    assert res.log_prob is None and float(res.std) == 0.0
    a = alpha_bar_oracle(0.05)
    x0 = (x.double() - math.sqrt(1 - a) * out.double()) / math.sqrt(a)
    torch.testing.assert_close(res.x_next.double(), x0, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# 3. bf16 inputs: fp32 step math and fp32 log-prob
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,sigma,sigma_next", [p for p in CASE_PARAMS if p.values[1] in (1.0, 0.5, 0.6)])
def test_bf16_inputs_step_in_fp32(name, sigma, sigma_next):
    x, out = _inputs(8)
    xb, ob = x.bfloat16(), out.bfloat16()
    s, sn = torch.tensor(sigma), torch.tensor(sigma_next)
    sampler = make_sampler(name)
    low = sampler.step(ob, xb, s, sn, generator=torch.Generator().manual_seed(9))
    ref = sampler.step(ob.float(), xb.float(), s, sn, generator=torch.Generator().manual_seed(9))
    for r in (low, ref):
        assert r.x_next.dtype == torch.float32 and r.mean.dtype == torch.float32
        assert r.log_prob.dtype == torch.float32
    assert torch.equal(low.mean, ref.mean)
    assert torch.equal(low.x_next, ref.x_next)
    assert torch.equal(low.log_prob, ref.log_prob)
    # Re-scoring a bf16 x_next: scored as its fp32 upcast.
    xn = ref.x_next.bfloat16()
    low2 = sampler.step(ob, xb, s, sn, x_next=xn)
    ref2 = sampler.step(ob.float(), xb.float(), s, sn, x_next=xn.float())
    assert low2.log_prob.dtype == torch.float32
    assert torch.equal(low2.log_prob, ref2.log_prob)


# --------------------------------------------------------------------------------------------------
# 4. Gaussian toy: the SDE samplers preserve the ODE marginals
# --------------------------------------------------------------------------------------------------

MU, S, D, N = 2.0, 0.5, 2, 20000


def toy_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Exact marginal velocity for x0 ~ N(mu, s^2), x1 ~ N(0, 1), x = (1 - sigma) x0 + sigma x1.

    m = (1 - sigma) mu, var = (1 - sigma)^2 s^2 + sigma^2.  (x0, x1, x) are jointly Gaussian with
    Cov(x1, x) = sigma and Cov(x0, x) = (1 - sigma) s^2, so
        E[x1 | x] = sigma (x - m) / var,
        E[x0 | x] = mu + (1 - sigma) s^2 (x - m) / var,
        v(x, sigma) = E[x1 - x0 | x] = (sigma - (1 - sigma) s^2) (x - m) / var - mu.
    """
    m = (1 - sigma) * MU
    var = (1 - sigma) ** 2 * S**2 + sigma**2
    e1 = sigma * (x - m) / var
    e0 = MU + (1 - sigma) * S**2 * (x - m) / var
    return e1 - e0


def toy_marginal(sigma: float) -> tuple[float, float]:
    return (1 - sigma) * MU, (1 - sigma) ** 2 * S**2 + sigma**2


def run_toy(sampler, num_steps: int, record: float | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen)  # exact marginal at sigma = 1
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
    recorded = None
    for k in range(num_steps):
        s, sn = sigmas[k], sigmas[k + 1]
        res = sampler.step(toy_velocity(x, float(s)), x, s, sn, generator=gen)
        x = res.x_next
        if record is not None and abs(float(sn) - record) < 1e-6:
            recorded = x.clone()
    return x, recorded


def assert_gaussian(x: torch.Tensor, mean: float, var: float, mean_slack: float = 0.03, var_rtol: float = 0.05):
    """Per-dimension sample mean within 4 standard errors (+ discretisation slack) and variance within var_rtol."""
    m, v = x.mean(0), x.var(0)
    se = math.sqrt(var / x.shape[0])
    assert torch.all((m - mean).abs() < 4 * se + mean_slack), (m, mean)
    assert torch.all((v - var).abs() < var_rtol * var), (v, var)


def toy_chain_moments(kind: str, a: float, num_steps: int, stop: float = 0.0) -> tuple[float, float]:
    """Exact (mean, variance) of the *discretised* chain on the toy, from N(0, 1) at sigma = 1 down to ``stop``.

    toy_velocity is affine in x: v = k x + b with k = (sigma - (1 - sigma) s^2) / var, b = -k m - mu. Every step
    is then x' = A x + B + std z, so mean' = A mean + B and var' = A^2 var + std^2, with A, B read off the formulas:
      Euler-Maruyama (g^2 = 0 for the ODE):
        x' = x + dt v + g^2 dt / (2 sigma) (x + (1 - sigma) v),  std^2 = g^2 (-dt);
      CPS (c = cos(a pi/2)):
        x' = (1 - s') (x - sigma v) + s' c (x + (1 - sigma) v),  std = s' sin(a pi/2).
    This separates discretisation bias (deterministic, computed here) from sampling noise (tested below).
    """
    mean, var = 0.0, 1.0
    for i in range(num_steps):
        s, sn = 1 - i / num_steps, 1 - (i + 1) / num_steps
        if s <= stop + 1e-9:
            break
        m_s, var_s = toy_marginal(s)
        k = (s - (1 - s) * S**2) / var_s
        b = -k * m_s - MU
        dt = sn - s
        if kind == "cps":
            c = math.cos(a * math.pi / 2)
            A = (1 - sn) * (1 - s * k) + sn * c * (1 + (1 - s) * k)
            B = -(1 - sn) * s * b + sn * c * (1 - s) * b
            std2 = (sn * math.sin(a * math.pi / 2)) ** 2
        elif kind == "memoryless":  # the same affine form as CPS with c = r = (1 - s) s' / ((1 - s') s), std^2 = s'^2 (1 - r^2)
            r = (1 - s) * sn / ((1 - sn) * s)
            A = (1 - sn) * (1 - s * k) + sn * r * (1 + (1 - s) * k)
            B = -(1 - sn) * s * b + sn * r * (1 - s) * b
            std2 = sn**2 * (1 - r**2)
        else:
            if kind == "flow_grpo":
                g2 = a**2 * s / ((1 - sn) if s >= 1 else (1 - s))
            elif kind == "dance_grpo":
                g2 = a**2
            else:
                g2 = 0.0
            A = 1 + dt * k + g2 * dt / (2 * s) * (1 + (1 - s) * k)
            B = dt * b + g2 * dt / (2 * s) * (1 - s) * b
            std2 = g2 * -dt
        mean, var = A * mean + B, A * A * var + std2
    return mean, var


TOY_SAMPLERS = [
    pytest.param("ode", 0.0, ODESampler(FlowSDEConfig().build()), id="ode_euler"),
    pytest.param("flow_grpo", 0.7, FlowSDEConfig(noise_level=0.7, diffusion="flow_grpo").build(), id="flow_grpo_0.7"),
    pytest.param("dance_grpo", 0.5, FlowSDEConfig(noise_level=0.5, diffusion="dance_grpo").build(), id="dance_grpo_0.5"),
    pytest.param("cps", 0.7, FlowCPSConfig(noise_level=0.7).build(), id="cps_0.7"),
    pytest.param("memoryless", 0.0, FlowMemorylessConfig().build(), id="memoryless"),
]

CPS_BIAS = (
    "CPS (std = s' sin(a pi/2), a fixed fraction of the noise re-drawn every step whatever the step size) does not "
    "preserve the marginals when p(x0 | x) is not a point mass: on this toy the final variance is 0.177 at 200 steps "
    "and tends to ~0.18, not s^2 = 0.25, as steps -> infinity (test_cps_marginal_bias_is_a_property_of_the_formula)"
)


@pytest.mark.parametrize("kind,a,sampler", TOY_SAMPLERS)
def test_gaussian_toy_chain_matches_discretised_moments(kind, a, sampler):
    """The sampled chain has the moments of the exact linear-Gaussian recursion (implementation check)."""
    x, mid = run_toy(sampler, 200, record=0.5)
    for stop, samples in ((0.0, x), (0.5, mid)):
        mean, var = toy_chain_moments(kind, a, 200, stop=stop)
        assert_gaussian(samples, mean, var, mean_slack=0.0, var_rtol=0.05)


@pytest.mark.parametrize(
    "kind,a,sampler",
    TOY_SAMPLERS[:3] + [pytest.param(*TOY_SAMPLERS[3].values, id="cps_0.7", marks=pytest.mark.xfail(strict=True, reason=CPS_BIAS))],
)
def test_gaussian_toy_final_marginal(kind, a, sampler):
    """The samplers reach the data distribution N(mu, s^2)."""
    x, _ = run_toy(sampler, 200)
    assert_gaussian(x, MU, S**2)


def test_memoryless_forgets_the_start_noise():
    """Adjoint Matching's schedule: the sample is independent of the start noise (Flow-GRPO's a = 0.7 is not)."""

    def correlation(sampler):
        gen = torch.Generator().manual_seed(3)
        x0 = torch.randn(N, D, generator=gen)
        x, sigmas = x0, torch.linspace(1.0, 0.0, 21)
        for k in range(20):
            x = sampler.step(toy_velocity(x, float(sigmas[k])), x, sigmas[k], sigmas[k + 1], generator=gen).x_next
        return torch.stack([torch.corrcoef(torch.stack([x0[:, d], x[:, d]]))[0, 1] for d in range(D)])

    assert correlation(FlowMemorylessConfig().build()).abs().max() < 4 / math.sqrt(N)
    assert correlation(FlowSDEConfig(noise_level=0.7).build()).min() > 0.15  # 0.21-0.22 here


@pytest.mark.parametrize("sigma", [0.2, 0.5, 0.8])
def test_memoryless_step_is_the_sde_with_g2_two_sigma_over_one_minus_sigma(sigma):
    """Continuous limit: std^2 / (g^2 |dt|) -> 1 with g^2 = 2 sigma / (1 - sigma), and the mean's drift -> the
    Euler-Maruyama drift of that SDE (Flow-GRPO's step with a = sqrt 2)."""
    x, v = _inputs()
    gaps = []
    for h in (1e-3, 1e-4):
        s, sn = torch.tensor(sigma, dtype=torch.float64), torch.tensor(sigma - h, dtype=torch.float64)
        ours = FlowMemorylessConfig().build().step(v.double(), x.double(), s, sn)
        assert float(ours.std) ** 2 / (2 * sigma / (1 - sigma) * h) == pytest.approx(1.0, rel=5 * h / (sigma * (1 - sigma)))
        em_mean, _, _ = flow_sde_oracle(v, x, sigma, sigma - h, "flow_grpo", math.sqrt(2))
        gaps.append(float((ours.mean.double() - em_mean).abs().max()) / h)  # drift difference
    assert gaps[1] < gaps[0] / 5  # the drifts agree to O(h): the means differ at O(h^2), not O(h)


def test_gaussian_toy_intermediate_marginal_flow_grpo():
    _, mid = run_toy(FlowSDEConfig(noise_level=0.7, diffusion="flow_grpo").build(), 200, record=0.5, seed=1)
    m, var = toy_marginal(0.5)  # (1.0, 0.3125)
    assert_gaussian(mid, m, var)


def test_discretisation_bias_vanishes_except_cps():
    """Deterministic part of the toy error, from the exact recursion (no sampling noise).

    ODE / DanceGRPO: O(1/K) Euler bias, 0.2463 / 0.2477 at K = 200 and -> 0.25.
    Flow-GRPO: the sigma_max trick gives g^2 dt = a^2 sigma / (K (1 - sigma)) ~ a^2 / j on the j-th step from
    sigma = 1, which does not shrink with K: a small K-independent bias (variance 0.2510 at K = 200 and 1000,
    0.319 instead of 0.3125 at sigma = 0.5). Within tolerance; reported, not hidden.
    """
    for kind, a in (("ode", 0.0), ("dance_grpo", 0.5)):
        _, v200 = toy_chain_moments(kind, a, 200)
        _, v1000 = toy_chain_moments(kind, a, 1000)
        assert abs(v1000 - S**2) < abs(v200 - S**2) < 0.02 * S**2
        assert abs(v1000 - S**2) < 0.003 * S**2
    _, v = toy_chain_moments("flow_grpo", 0.7, 1000)
    assert abs(v - S**2) < 0.01 * S**2
    _, vmid = toy_chain_moments("flow_grpo", 0.7, 1000, stop=0.5)
    assert abs(vmid - toy_marginal(0.5)[1]) < 0.03 * toy_marginal(0.5)[1]
    for kind, a in (("ode", 0.0), ("flow_grpo", 0.7), ("dance_grpo", 0.5), ("cps", 0.7), ("memoryless", 0.0)):
        assert toy_chain_moments(kind, a, 200)[0] == pytest.approx(MU, abs=1e-9)  # every chain keeps the mean exactly
    # Memoryless: O(1/K) bias like Euler's, larger constant (it re-draws all the noise): 0.2416 at K = 200,
    # 0.2483 at 1000, 0.2496 at 5000 -> 0.25; its sampled chain matches these moments (test above).
    v200, v1000, v5000 = (toy_chain_moments("memoryless", 0.0, k)[1] for k in (200, 1000, 5000))
    assert abs(v5000 - S**2) < abs(v1000 - S**2) < abs(v200 - S**2) < 0.04 * S**2
    assert abs(v5000 - S**2) < 0.002 * S**2


def test_cps_marginal_bias_is_a_property_of_the_formula():
    """At a fixed sigma (exact marginal N(m, var), k2 = sigma^2 / var, c = cos(a pi/2)), one CPS "step" to the same
    sigma maps x - m -> (x - m)(1 - k2 (1 - c)) + sigma sin(a pi/2) z, so
        var' / var = (1 - k2 (1 - c))^2 + k2 (1 - c^2) = 1 - k2 (1 - k2) (1 - c)^2 < 1   for 0 < k2 < 1:
    the shrink per step does not go to 0 with the step size, so more steps do not remove it."""
    for num_steps in (200, 1000, 5000):
        mean, var = toy_chain_moments("cps", 0.7, num_steps)
        assert mean == pytest.approx(MU, abs=1e-9)
        assert 0.16 < var < 0.19
    sigma, a = 0.5, 0.7
    m, var = toy_marginal(sigma)
    k2, c = sigma**2 / var, math.cos(a * math.pi / 2)
    x = m + math.sqrt(var) * torch.randn(200000, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    res = FlowCPSConfig(noise_level=a).build().step(toy_velocity(x, sigma), x, sigma, sigma, generator=torch.Generator().manual_seed(1))
    ratio = 1 - k2 * (1 - k2) * (1 - c) ** 2  # 0.954 here
    assert float(res.x_next.var()) / var == pytest.approx(ratio, abs=0.01)
    assert ratio < 0.96


# --------------------------------------------------------------------------------------------------
# 5. DDIM / DDPM on a Gaussian toy
# --------------------------------------------------------------------------------------------------


def toy_eps(x: torch.Tensor, a: float) -> torch.Tensor:
    """x_t = sqrt(a) x0 + sqrt(1 - a) eps, x0 ~ N(mu, s^2): Var(x_t) = a s^2 + 1 - a, Cov(eps, x_t) = sqrt(1 - a),
    so E[eps | x_t] = sqrt(1 - a) (x_t - sqrt(a) mu) / (a s^2 + 1 - a)."""
    return math.sqrt(1 - a) * (x - math.sqrt(a) * MU) / (a * S**2 + 1 - a)


def toy_v(x: torch.Tensor, a: float) -> torch.Tensor:
    """v = sqrt(a) eps - sqrt(1 - a) x0 and E[x0 | x_t] = mu + sqrt(a) s^2 (x_t - sqrt(a) mu) / (a s^2 + 1 - a)."""
    e0 = MU + math.sqrt(a) * S**2 * (x - math.sqrt(a) * MU) / (a * S**2 + 1 - a)
    return math.sqrt(a) * toy_eps(x, a) - math.sqrt(1 - a) * e0


def ddim_chain_moments(eta: float, num_steps: int) -> tuple[float, float]:
    """Exact (mean, variance) of the discretised DDIM chain on the toy, started from the exact x_T marginal.

    With the exact eps, eps = ke x + be (ke = sqrt(1 - a) / var_t, be = -ke sqrt(a) mu) and every DDIM step is
    affine: x' = A x + B + std z with A = sqrt(a') kx0 + c ke, B = sqrt(a') bx0 + c be, c = sqrt(1 - a' - std^2),
    x0_hat = kx0 x + bx0 = (x - sqrt(1 - a) eps) / sqrt(a). (The v-prediction chain is the same chain.)
    """
    ac = torch.cumprod(1 - BETAS.double(), 0)
    ts = [round(t) - 1 for t in torch.arange(1000, 0, -1000 / num_steps, dtype=torch.float64).tolist()]
    a0 = float(ac[ts[0]])
    mean, var = math.sqrt(a0) * MU, a0 * S**2 + 1 - a0
    for t, tp in zip(ts, ts[1:] + [-1]):
        a, ap = float(ac[t]), (1.0 if tp < 0 else float(ac[tp]))
        var_t = a * S**2 + 1 - a
        ke = math.sqrt(1 - a) / var_t
        be = -ke * math.sqrt(a) * MU
        kx0, bx0 = (1 - math.sqrt(1 - a) * ke) / math.sqrt(a), -math.sqrt(1 - a) * be / math.sqrt(a)
        std = eta * math.sqrt(max((1 - ap) / (1 - a) * (1 - a / ap), 0.0))
        c = math.sqrt(max(1 - ap - std**2, 0.0))
        A, B = math.sqrt(ap) * kx0 + c * ke, math.sqrt(ap) * bx0 + c * be
        mean, var = A * mean + B, A * A * var + std**2
    return mean, var


def run_ddim_toy(pred: str, eta: float, num_steps: int, seed: int = 0) -> torch.Tensor:
    sched = _schedule()
    sampler = DDIMSampler(sched, prediction_type=pred, eta=eta, clip_sample=None, reduction="mean")
    sigmas = sched.sigmas(num_steps)
    gen = torch.Generator().manual_seed(seed)
    a_T = alpha_bar_oracle(float(sigmas[0]))
    x = math.sqrt(a_T) * MU + math.sqrt(a_T * S**2 + 1 - a_T) * torch.randn(N, D, generator=gen)  # exact x_T
    for k in range(num_steps):
        s, sn = sigmas[k], sigmas[k + 1]
        a = alpha_bar_oracle(float(s))
        out = toy_eps(x, a) if pred == "epsilon" else toy_v(x, a)
        x = sampler.step(out, x, s, sn, generator=gen).x_next
    return x


DDIM_TOY = [("epsilon", 1.0), ("epsilon", 0.0), ("v_prediction", 1.0)]
DDIM_TOY_IDS = ["ddpm_eps", "ddim_eps", "ddpm_v"]


@pytest.mark.parametrize("pred,eta", DDIM_TOY, ids=DDIM_TOY_IDS)
def test_ddim_gaussian_toy_100_steps_matches_discretised_moments(pred, eta):
    """100 trailing steps: the sampled chain has the moments of the exact discretised recursion. These are NOT
    N(mu, s^2): variance 0.2192 (eta = 1) and 0.2357 (eta = 0) instead of 0.25 -- deterministic step-size bias of
    DDPM/DDIM with the exact posterior-mean eps (x0_hat has variance Var(E[x0 | x_t]) < s^2, and the final jump
    t = 9 -> clean returns x0_hat itself), see test_ddim_bias_vanishes_with_steps."""
    x = run_ddim_toy(pred, eta, 100)
    mean, var = ddim_chain_moments(eta, 100)
    assert mean == pytest.approx(MU, abs=1e-9)
    assert_gaussian(x, mean, var, mean_slack=0.0)


@pytest.mark.parametrize("pred,eta", DDIM_TOY, ids=DDIM_TOY_IDS)
@pytest.mark.slow
def test_ddim_gaussian_toy_final_marginal(pred, eta):
    """With every training timestep (1000 steps) DDPM and DDIM reach N(mu, s^2) (bias 1.6% / 0.6% in variance)."""
    x = run_ddim_toy(pred, eta, 1000)
    assert_gaussian(x, MU, S**2)


def test_ddim_bias_vanishes_with_steps():
    for eta in (0.0, 1.0):
        errs = [abs(ddim_chain_moments(eta, k)[1] - S**2) for k in (10, 50, 100, 1000)]
        assert errs == sorted(errs, reverse=True)
        assert errs[-1] < 0.02 * S**2


# --------------------------------------------------------------------------------------------------
# 6. Schedules
# --------------------------------------------------------------------------------------------------


def test_flow_schedule_shift():
    s = torch.linspace(1, 0, 5, dtype=torch.float64)
    expected = 3 * s / (1 + 2 * s)  # SD3: shift s / (1 + (shift - 1) s)
    got = FlowSchedule(shift=3).sigmas(4)
    assert got.dtype == torch.float32 and got.shape == (5,)
    torch.testing.assert_close(got.double(), expected, rtol=1e-7, atol=1e-7)
    assert float(got[0]) == 1.0 and float(got[-1]) == 0.0
    torch.testing.assert_close(FlowSchedule().sigmas(4), torch.linspace(1, 0, 5))


def test_discrete_schedule():
    sched = _schedule()
    sig = sched.sigmas(10)
    assert sig.shape == (11,)
    assert float(sig[0]) == 1.0 and float(sig[-1]) == 0.0
    assert torch.all(sig[1:] < sig[:-1])
    # trailing: t = 999, 899, ..., 99, then -1 (clean data)
    t = sched.timestep(sig)
    assert t.dtype == torch.int64
    assert t.tolist() == [999 - 100 * k for k in range(10)] + [-1]
    # sigma = (t + 1) / T round-trips exactly through the integer timestep
    torch.testing.assert_close(((t + 1).double() / 1000).float(), sig, rtol=0, atol=0)
    ac = torch.cumprod(1 - BETAS.double(), 0)
    assert float(sched.alpha_bar(torch.tensor(1.0))) == pytest.approx(float(ac[-1]), rel=1e-6)
    assert float(sched.alpha_bar(torch.tensor(0.0))) == 1.0
    assert float(sched.alpha_bar(torch.tensor(0.5))) == pytest.approx(float(ac[499]), rel=1e-6)
    # 100 trailing steps: t = 999, 989, ..., 9
    t100 = sched.timestep(sched.sigmas(100))
    assert t100[:-1].tolist() == list(range(999, 8, -10)) and int(t100[-1]) == -1


# --------------------------------------------------------------------------------------------------
# 7. DDIM / DDPM precision: float64 coefficients, every timestep down to t = 0
# --------------------------------------------------------------------------------------------------

SD_BETAS = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2  # Stable Diffusion's scaled_linear


def ddim_float64_reference(betas: torch.Tensor, t: int, t_prev: int, final: float, out, x, x_next, eta: float):
    """std and mean-reduced log-prob of one step t -> t_prev (t_prev = -1: clean data), all in float64 from the
    betas: a = prod(1 - beta), written out here, not read from flowrl's table."""
    ac = torch.cumprod(1 - betas.double(), 0)
    a = float(ac[t])
    ap = float(ac[t_prev]) if t_prev >= 0 else final
    var = (1 - ap) / (1 - a) * (1 - a / ap)
    std = eta * math.sqrt(max(var, 0.0))
    eps = out.double()
    x0 = (x.double() - math.sqrt(1 - a) * eps) / math.sqrt(a)
    mean = math.sqrt(ap) * x0 + math.sqrt(max(1 - ap - std**2, 0.0)) * eps
    if std == 0:
        return std, None
    elem = -((x_next.double() - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return std, elem.mean(DIMS)


@pytest.mark.parametrize(
    "betas,final", [(SD_BETAS, None), (SD_BETAS, 1.0), (BETAS.double(), 1.0)], ids=["sd15_alpha0", "sd_alpha1", "linear_alpha1"]
)
def test_ddim_std_and_log_prob_within_1e6_of_float64_at_every_timestep(betas, final):
    """Every single-timestep step t -> t - 1 (t = 999 .. 0) and Stable Diffusion's 50-step leading grid: std and
    log-prob within 1e-6 relative of the float64 reference. final=None is SD1.5's set_alpha_to_one=False."""
    ac = torch.cumprod(1 - betas, 0)
    final = float(ac[0]) if final is None else final
    sched = DiscreteSchedule(alphas_cumprod=ac, final_alpha_cumprod=final)
    sampler = DDIMSampler(sched, eta=1.0, prediction_type="epsilon", clip_sample=None, reduction="mean")
    x, out = _inputs(11)
    T = 1000
    pairs = [(t, t - 1) for t in range(T - 1, -1, -1)]
    leading = DiscreteSchedule(alphas_cumprod=ac, final_alpha_cumprod=final, spacing="leading", steps_offset=1).timesteps(50).tolist()
    assert leading[0] == 981 and leading[-1] == 1
    pairs += list(zip(leading, leading[1:] + [-1]))
    worst_std = worst_lp = 0.0
    for t, t_prev in pairs:
        sigma, sigma_next = torch.tensor((t + 1) / T), torch.tensor((t_prev + 1) / T)
        res = sampler.step(out, x, sigma, sigma_next, generator=torch.Generator().manual_seed(t))
        std, log_prob = ddim_float64_reference(betas, t, t_prev, final, out, x, res.x_next, 1.0)
        if std == 0:  # into clean data with a_prev = 1 (set_alpha_to_one), or from t = 0 with a_prev = a_0: var = 0
            assert t_prev == -1 and res.log_prob is None and float(res.std) == 0
            continue
        worst_std = max(worst_std, abs(float(res.std) - std) / std)
        worst_lp = max(worst_lp, float(((res.log_prob.double() - log_prob).abs() / log_prob.abs()).max()))
    print(f"worst relative error: std {worst_std:.2e}, log-prob {worst_lp:.2e}")
    assert worst_std <= 1e-6 and worst_lp <= 1e-6

    # the check can fail: with alpha-bar rounded to float32 before 1 - a (flowrl before issue 15) the std of
    # the steps near t = 0 is off by more than 1e-5
    t = torch.arange(1, 60)
    a, ap = ac[t], ac[t - 1]
    std64 = ((1 - ap) / (1 - a) * (1 - a / ap)).sqrt()
    a32, ap32 = a.float(), ap.float()
    std32 = ((1 - ap32) / (1 - a32) * (1 - a32 / ap32)).sqrt().double()
    assert float(((std32 - std64).abs() / std64).max()) > 1e-5


# --------------------------------------------------------------------------------------------------
# 8. Per-sample sigma: a (B,) sigma gives, row by row, the scalar step on that row
# --------------------------------------------------------------------------------------------------

PER_SAMPLE_SAMPLERS = ["flow_grpo", "dance_grpo", "cps", "memoryless", "ddim_eps_eta1", "ddim_v_eta05"]
# one row per regime: the first step from noise (flow_grpo's sigma = 1 branch), the middle, near data, and a
# step into sigma = 0 (deterministic for CPS, memoryless and DDIM: std 0, NaN log-prob in a mixed batch)
FLOW_ROWS = [(1.0, 0.9), (0.6, 0.55), (0.1, 0.02), (0.05, 0.0)]
DDIM_ROWS = [(1.0, 0.98), (0.5, 0.45), (0.05, 0.03), (0.02, 0.0)]


@pytest.mark.parametrize("name", PER_SAMPLE_SAMPLERS)
def test_per_sample_sigma_equals_the_scalar_step_row_by_row(name):
    sampler = make_sampler(name)
    rows = DDIM_ROWS if name.startswith("ddim") else FLOW_ROWS
    x, out = _inputs(12)
    sigma = torch.tensor([s for s, _ in rows])
    sigma_next = torch.tensor([sn for _, sn in rows])
    batch = sampler.step(out, x, sigma, sigma_next, generator=torch.Generator().manual_seed(5))
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    assert batch.std.shape == (4, 1, 1, 1) and batch.log_prob.shape == (4,)
    rescored = sampler.step(out, x, sigma, sigma_next, x_next=batch.x_next)
    deterministic = sampler.deterministic_step(out, x, sigma, sigma_next)
    for i, (s, sn) in enumerate(rows):
        one = sampler.step(out[i : i + 1], x[i : i + 1], torch.tensor(s), torch.tensor(sn), x_next=batch.x_next[i : i + 1])
        assert one.std.ndim == 0
        assert torch.equal(batch.mean[i], one.mean[0]) and torch.equal(batch.std[i].reshape(()), one.std)
        assert torch.equal(batch.x_next[i], (one.mean[0].double() + one.std.double() * z[i].double()).float()) or torch.allclose(
            batch.x_next[i], one.mean[0] + one.std * z[i], rtol=0, atol=1e-6
        )
        if one.log_prob is None:  # a deterministic row: NaN in the batch
            assert float(one.std) == 0 and torch.isnan(batch.log_prob[i]) and torch.isnan(rescored.log_prob[i])
        else:
            assert torch.equal(batch.log_prob[i], one.log_prob[0]) and torch.equal(rescored.log_prob[i], one.log_prob[0])
        assert torch.equal(deterministic[i], sampler.deterministic_step(out[i : i + 1], x[i : i + 1], torch.tensor(s), torch.tensor(sn))[0])
    assert torch.isnan(batch.log_prob).sum() == (1 if name in ("cps", "memoryless") or name.startswith("ddim") else 0)


def test_per_sample_sigma_all_deterministic_rows_have_no_log_prob_and_bad_shapes_fail():
    from flowrl.errors import FlowRLError

    x, out = _inputs(13)
    res = FlowCPSConfig().build().step(out, x, torch.full((4,), 0.1), torch.zeros(4))
    assert res.log_prob is None and res.std.shape == (4, 1, 1, 1)
    same = FlowSDEConfig().build().step(out, x, torch.full((4,), 0.6), torch.full((4,), 0.5), generator=torch.Generator().manual_seed(0))
    scalar = FlowSDEConfig().build().step(out, x, 0.6, 0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(same.x_next, scalar.x_next) and torch.equal(same.log_prob, scalar.log_prob)
    torch.testing.assert_close(
        ODESampler(FlowSDEConfig().build()).step(out, x, torch.full((4,), 0.6), torch.full((4,), 0.5)).x_next,
        flow_euler_step(out, x, 0.6, 0.5),
        rtol=0,
        atol=0,
    )
    with pytest.raises(FlowRLError, match=r"one value per sample, shape \(4,\); got shape \(3,\)"):
        FlowSDEConfig().build().step(out, x, torch.full((3,), 0.6), torch.full((3,), 0.5))
    with pytest.raises(FlowRLError, match="one value per sample"):
        DDIMSampler(_schedule(), prediction_type="epsilon", eta=1.0, clip_sample=None, reduction="mean").step(
            out, x, torch.full((4, 1), 0.6), torch.full((4, 1), 0.5)
        )
