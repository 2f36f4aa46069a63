"""bench/adjoint_matching_released_loss.py's re-implementation of the authors' released Adjoint Matching loss
(microsoft/soc-fine-tuning-sd at 489f904a) against hand-derived values and against flowrl's lean adjoint."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from flowrl.objectives.adjoint_matching import AdjointMatchingConfig, adjoint_matching_residual, memoryless_step_weight, score_difference
from flowrl.pipelines.toy2d import Toy2DPipeline
from flowrl.reward_models.gradients import reward_and_gradient
from flowrl.reward_models.toy2d import QuadraticReward2D
from flowrl.samplers import FlowMemorylessConfig
from flowrl.samplers.rollout import rollout

_spec = importlib.util.spec_from_file_location(
    "adjoint_matching_released_loss", Path(__file__).resolve().parents[1] / "bench" / "adjoint_matching_released_loss.py"
)
released = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(released)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: the tensors here are tiny


def _batch(K: int, B: int, lam: float = 2.0):
    pipeline, sampler = Toy2DPipeline(), FlowMemorylessConfig().build()
    batch = rollout(
        pipeline, sampler, [""] * B, [{}] * B, torch.arange(B), pipeline.schedule.sigmas(K), torch.Generator().manual_seed(3),
        same_noise_in_group=False,
    )  # fmt: skip
    out, grads = reward_and_gradient(QuadraticReward2D(), lambda x: x.float(), batch.latents[:, -1], batch.prompts, batch.metadata)
    batch.rewards, batch.reward_grads = out.scores, grads
    return pipeline, sampler, batch


def test_released_adjoint_equals_flowrl_lean_adjoint():
    """a_k = a_{k+1} + grad <m_k(x) - x, a_{k+1}> (the released form) is (d m_k / d x)^T a_{k+1} (flowrl's) on the
    two-mode base, whose steps are nonlinear."""
    pipeline, sampler, batch = _batch(K=6, B=32)
    mine, base = released.released_adjoints(pipeline, sampler, batch, 2.0)
    theirs, base_ref = AdjointMatchingConfig(reward_multiplier=2.0).build().adjoints(pipeline, sampler, batch, list(range(6)))
    for k in range(6):
        assert torch.allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-6), k
        assert torch.equal(base[k], base_ref[k]), k
    assert float(mine[0].abs().max()) < 1e-6  # nothing of x survives the step from sigma = 1 (a - a up to rounding)


def test_released_control_on_the_memoryless_flow_step_by_hand():
    """sigma 0.5 -> 0.25: r = (1 - s) s' / ((1 - s') s) = 1/3, std = s' sqrt(1 - r^2) = sqrt(2) / 6, and the mean moves
    with v by -(1 - s')(1 - r^2) s = -1/3, so (m_ft - m_base) / std = -sqrt(2) dv."""
    sampler = FlowMemorylessConfig().build()
    x = torch.tensor([[0.3, -1.2], [2.0, 0.5]])
    base = torch.tensor([[0.1, 0.4], [-0.7, 1.1]])
    dv = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    control, std = released.released_control(sampler, base + dv, base, x, torch.tensor(0.5), torch.tensor(0.25))
    assert float(std) == pytest.approx(math.sqrt(2) / 6, rel=1e-6)
    assert torch.allclose(control, -math.sqrt(2) * dv, rtol=1e-5)


def test_released_fixed_point_is_a_sixth_of_the_continuous_one_on_a_coarse_step():
    """Zero released residual: -(sqrt 2) dv + std a = 0, dv = a / 6 (= s'^2 / ((1 - s') s) a); zero flowrl residual:
    dscore = -(1 - s) / s dv = -a, dv = s / (1 - s) a = a. Same adjoint, a control 6x smaller on this step."""
    sampler = FlowMemorylessConfig().build()
    s, sn = torch.tensor(0.5), torch.tensor(0.25)
    x, base = torch.tensor([[0.3, -1.2]]), torch.tensor([[0.1, 0.4]])
    a = torch.tensor([[0.8, -0.6]])
    control, std = released.released_control(sampler, base + a / 6, base, x, s, sn)
    assert float(released.released_residual(control, a, std)) == pytest.approx(0.0, abs=1e-10)
    w = memoryless_step_weight(s, sn, "flow")
    assert float(adjoint_matching_residual(score_difference(base + a, base, s, "flow"), a, w)) == pytest.approx(0.0, abs=1e-10)
    assert float(released.released_residual(released.released_control(sampler, base + a, base, x, s, sn)[0], a, std)) > 0.1


def test_released_ema_and_quantile_clip_by_hand():
    """EMA_update: the first value, then a plain average while updates < 1 / 0.9, then 0.9 / 0.1; the mask uses the EMA
    after the current batch is folded in: sqrt(loss) = 1, 2, 3, 4 has median 2.5, so 9 and 16 count as zero."""
    ema = released.ReleasedEMA(0.9)
    assert [ema(v) for v in (2.0, 4.0, 6.0)] == pytest.approx([2.0, 3.0, 0.9 * 3.0 + 0.1 * 6.0])
    loss, keep = released.released_minibatch_loss(torch.tensor([[1.0, 4.0], [9.0, 16.0]]), 0.5, released.ReleasedEMA(0.9))
    assert float(loss) == pytest.approx((1 + 4) / 4)
    assert keep.tolist() == [[True, True], [False, False]]
    loss, keep = released.released_minibatch_loss(torch.tensor([[1.0, 4.0], [9.0, 16.0]]), None, released.ReleasedEMA(0.9))
    assert float(loss) == pytest.approx(30 / 4) and bool(keep.all())


def test_released_objective_trains_every_step_with_noise_and_means_over_rows_and_steps():
    """At the base model (the MLP's output layer is zero) the control is zero, so each row's loss is std_k^2 |a_k|^2:
    the objective's loss is their mean over rows and the steps 0 .. K-2 (the step into sigma = 0 has std 0)."""
    K, B = 5, 16
    pipeline, sampler, batch = _batch(K=K, B=B)
    objective = released.ReleasedAdjointMatching(2.0, None)
    (out,) = list(objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0)))
    adjoint, _ = released.released_adjoints(pipeline, sampler, batch, 2.0)
    sig = batch.sigmas
    stds = [sig[k + 1] * torch.sqrt(1 - ((1 - sig[k]) * sig[k + 1] / ((1 - sig[k + 1]) * sig[k])) ** 2) for k in range(K - 1)]
    expected = torch.stack([stds[k] ** 2 * adjoint[k].pow(2).sum(1) for k in range(K - 1)], 1).mean()
    assert float(out.loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert out.loss.requires_grad
