"""Advantage Weighted Matching: the loss and its gradient against hand-derived values for each weighting, the
advantages (global std, clip), the time sampling, and two iterations on the embedded model through the real Trainer
with ODE rollouts and with SDE rollouts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import two_iterations_change_every_parameter

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives import OBJECTIVES
from flowrl.objectives.awm import AWMConfig, awm_loss

AWM = CONFIGS / "digits" / "awm.yaml"


def test_loss_hand_values_for_each_weighting():
    # Two samples, two dims, target (eps - x0) = 0 so the error is the prediction itself:
    #   sample 0: pred (4, 4)  -> l0 = mean(16, 16) = 16;   sample 1: pred (1, -1) -> l1 = mean(1, 1) = 1.
    # A = (1, -2), sigma = (0.5, 0.25). Per sample A w(l, sigma), the loss their mean:
    #   uniform: w = l:        (16, -2)                                       -> mean 7
    #   t:       w = sigma l:  (8, -0.5)                                      -> mean 3.75
    #   ghuber (p = 1/4, c = 1e-10^(1/4)): w = sigma ((l + 1e-10)^p - c) / p:
    #            w0 = 0.5 (2 - c) 4 = 4 - 2c,  w1 = 0.25 (1 - c) 4 = 1 - c    -> (4 - 2c, -2 + 2c), mean 1 (c cancels)
    pred, target = torch.tensor([[4.0, 4.0], [1.0, -1.0]]), torch.zeros(2, 2)
    adv, sigma = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    c = 1e-10**0.25
    assert awm_loss(pred, target, adv, sigma, "uniform", 0.25).tolist() == pytest.approx([16.0, -2.0])
    assert awm_loss(pred, target, adv, sigma, "t", 0.25).tolist() == pytest.approx([8.0, -0.5])
    assert awm_loss(pred, target, adv, sigma, "ghuber", 0.25).tolist() == pytest.approx([4 - 2 * c, -2 + 2 * c], abs=1e-6)
    assert awm_loss(pred, target, adv, sigma, "ghuber", 0.25).mean().item() == pytest.approx(1.0, abs=1e-6)
    # Gradient of the uniform mean loss: d/dpred [A mean_d (pred - target)^2] / B = A 2 (pred - target) / (D B), D = B = 2:
    #   sample 0: 1 * (4, 4) / 2 = (2, 2);   sample 1: -2 * (1, -1) / 2 = (-1, 1)
    p = pred.clone().requires_grad_(True)
    awm_loss(p, target, adv, sigma, "uniform", 0.25).mean().backward()
    assert p.grad.flatten().tolist() == pytest.approx([2.0, 2.0, -1.0, 1.0])
    # a gradient step on a positive advantage moves the prediction to the target (the sample); a negative one away
    stepped = pred - 0.1 * p.grad
    err_before, err_after = pred.pow(2).mean(1), stepped.pow(2).mean(1)
    assert err_after[0] < err_before[0] and err_after[1] > err_before[1]


def test_zero_advantage_group_gives_no_gradient():
    p = torch.randn(3, 1, 8, 8, requires_grad=True)
    awm_loss(p, torch.randn(3, 1, 8, 8), torch.zeros(3), torch.rand(3), "uniform", 0.25).mean().backward()
    assert p.grad.abs().max().item() == 0.0


def test_advantages_global_std_and_clip():
    # One group of rewards (0, 0, 0, 100): mean 25, std over the batch (biased) sqrt((3 * 25^2 + 75^2) / 4) = sqrt(1875);
    # A = (-25, -25, -25, 75) / (sqrt(1875) + 1e-4) = (-0.577, ..., 1.732); clipped to +-1: the last becomes 1.
    obj = AWMConfig(adv_clip_max=1.0).build()
    batch = SimpleNamespace(rewards=torch.tensor([0.0, 0.0, 0.0, 100.0]), group_ids=torch.zeros(4, dtype=torch.long))
    a = -25 / (math.sqrt(1875) + 1e-4)
    assert obj.prepare(batch).advantages.tolist() == pytest.approx([a, a, a, 1.0], abs=1e-6)


def test_grid_times_are_interior_grid_points_distinct_per_sample():
    obj = AWMConfig(time_sampling="grid", num_times=2).build()
    batch = type("Batch", (), {"sigmas": torch.linspace(1, 0, 5), "__len__": lambda self: 6})()  # 6 samples, 4 steps
    flow = SimpleNamespace(prediction_type="flow", schedule=None)
    times = obj._times(flow, batch, torch.Generator().manual_seed(0))
    assert times.shape == (2, 6)
    assert set(times.flatten().tolist()) <= {0.75, 0.5, 0.25}  # neither sigma = 1 (pure noise) nor 0 (data)
    assert all(times[0, j] != times[1, j] for j in range(6))
    uniform = AWMConfig(num_times=3).build()._times(flow, batch, torch.Generator().manual_seed(0))
    assert uniform.shape == (3, 6) and bool(((uniform > 0) & (uniform <= 1)).all())


@pytest.mark.slow
def test_two_iterations_with_ode_rollouts(tmp_path, one_thread):
    trainer = two_iterations_change_every_parameter(
        fast_overrides(tmp_path, **{"train.learning_rate": 1e-3, "objective.num_times": 2, "objective.beta": 0.0}), AWM
    )
    assert trainer.sampler.name == "ode" and not trainer.sampler.stochastic and not trainer.objective.needs_log_probs
    rows = trainer.logger.records()
    assert {"loss/policy", "awm/matching_mse"} <= set(rows[1]) and "loss/kl" not in rows[1]


@pytest.mark.slow
def test_two_iterations_with_sde_rollouts_grid_times_ghuber_and_reference(tmp_path, one_thread):
    extra = {
        "train.learning_rate": 1e-3,
        "sampler": "{name: flow_sde, noise_level: 0.7}",
        "objective.num_times": 2,
        "objective.time_sampling": "grid",
        "objective.weighting": "ghuber",
        "objective.beta": 0.01,
    }
    trainer = two_iterations_change_every_parameter(fast_overrides(tmp_path / "sde", **extra), AWM)
    assert trainer.sampler.name == "flow_sde" and trainer.objective.reference == "initial"
    assert {"loss/policy", "loss/kl"} <= set(trainer.logger.records()[1])


def test_registered_and_config_refuses_bad_values():
    assert "awm" in OBJECTIVES.builtin_names()
    assert load_config(AWM).objective.name == "awm" and AWMConfig().beta == 0.0  # plain AWM by default
    with pytest.raises(FlowRLError, match="objective.weighting"):
        load_config(AWM, ["objective.weighting=huber2"])
    with pytest.raises(FlowRLError, match="objective.num_times"):
        load_config(AWM, ["objective.num_times=0"])
