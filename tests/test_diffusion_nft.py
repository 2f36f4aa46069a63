"""DiffusionNFT: the loss and the optimality probability against hand-derived values, the fixed point at r = 1/2,
the direction of a positive / negative reward, the x0-space scale of DDPM parametrisations, the old policy's
soft update, and two iterations on the embedded model with ODE rollouts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import two_iterations_change_every_parameter

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.diffusion_nft import (
    DiffusionNFTConfig,
    nft_loss,
    optimality_probability,
    swapped_weights,
    x0_error_scale,
)

NFT = CONFIGS / "digits" / "diffusion_nft.yaml"


def test_loss_hand_value():
    # One flow sample, two dimensions, sigma = 0.5 (x0-space scale c = 0.5), beta = 0.5, r = 0.75.
    # v_old = (0, 0), v_theta = (1, 0), target v = eps - x0 = (0.5, 2).
    # v_plus  = 0.5 v_old + 0.5 v_theta = (0.5, 0):   e = c (v_plus - v) = (0, -1):      mean e^2 / mean|e| = 0.5 / 0.5 = 1
    # v_minus = 1.5 v_old - 0.5 v_theta = (-0.5, 0):  e = (-0.5, -1):  mean e^2 = 0.625, mean|e| = 0.75:    l = 5/6
    # loss = (0.75 * 1 + 0.25 * 5/6) / 0.5 = 23/12
    out = torch.tensor([[1.0, 0.0]], requires_grad=True)
    loss = nft_loss(out, torch.zeros(1, 2), torch.tensor([[0.5, 2.0]]), torch.tensor([0.5]), torch.tensor([0.75]), beta=0.5)
    assert loss.item() == pytest.approx(23 / 12, abs=1e-6)
    loss.sum().backward()
    # With the weights held fixed (stop-gradient): d/dv_theta of r e+^2/w+ + (1 - r) e-^2/w-, averaged over the 2 dims, / beta;
    # e+ depends on v_theta through +c beta, e- through -c beta:
    # dim 0: (0.75 * 2 * 0 * 0.25 / 0.5 + 0.25 * 2 * (-0.5) * (-0.25) / 0.75) / 2 / 0.5 = 1/12
    # dim 1: (0.75 * 2 * (-1) * 0.25 / 0.5 + 0.25 * 2 * (-1) * (-0.25) / 0.75) / 2 / 0.5 = -0.75 + 1/6
    assert out.grad[0].tolist() == pytest.approx([1 / 12, -0.75 + 1 / 6], abs=1e-6)


def test_optimality_probability_hand_values():
    # rewards 1, 2 | 3, 4 in two groups; global std (biased) = sqrt(1.25); advantages -+0.5 / (sqrt(1.25) + 1e-4);
    # r = 1/2 + A / (2 * 5); a NaN reward gets A = 0 (r = 1/2) and is left out of the loss.
    obj = DiffusionNFTConfig().build()
    batch = SimpleNamespace(rewards=torch.tensor([1.0, 2.0, 3.0, 4.0, float("nan")]), group_ids=torch.tensor([0, 0, 1, 1, 1]))
    r = obj.prepare(batch).advantages
    d = 0.05 / (math.sqrt(1.25) + 1e-4)
    assert r.tolist() == pytest.approx([0.5 - d, 0.5 + d, 0.5 - d, 0.5 + d, 0.5], abs=1e-6)
    assert optimality_probability(torch.tensor([-7.0, -5.0, 0.0, 2.5, 9.0]), 5.0).tolist() == [0.0, 0.0, 0.5, 0.75, 1.0]


def test_half_everywhere_has_its_minimum_at_the_old_velocity():
    torch.manual_seed(0)
    old, target = torch.randn(3, 4, 4), torch.randn(3, 4, 4)
    half, scale = torch.full((3,), 0.5), torch.tensor([0.2, 0.5, 0.9])
    out = old.clone().requires_grad_(True)
    nft_loss(out, old, target, scale, half, beta=0.7).sum().backward()
    assert out.grad.abs().max().item() < 1e-7  # stationary at v_theta = v_old
    for _ in range(3):  # and from anywhere else the gradient points back towards v_old
        delta = 0.3 * torch.randn_like(old)
        away = (old + delta).requires_grad_(True)
        nft_loss(away, old, target, scale, half, beta=0.7).sum().backward()
        assert (away.grad * delta).sum().item() > 0


@pytest.mark.parametrize("r, closer", [(1.0, True), (0.0, False)])
def test_positive_reward_moves_the_velocity_towards_the_sample(r, closer):
    torch.manual_seed(1)
    old, target = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)  # target = eps - x0 of the rollout's sample
    out = old.clone().requires_grad_(True)
    nft_loss(out, old, target, torch.tensor([0.6, 0.3]), torch.full((2,), r), beta=1.0).sum().backward()
    stepped = old - 0.01 * out.grad
    before, after = (old - target).flatten(1).norm(dim=1), (stepped - target).flatten(1).norm(dim=1)
    assert bool((after < before).all()) == closer and bool((after > before).all()) != closer


def test_x0_scale_of_each_parametrisation():
    # x0_hat - x0 = -c (u - target): flow c = sigma; epsilon c = sqrt((1 - a) / a); v c = sqrt(1 - a).
    a = torch.tensor([0.64, 0.0], dtype=torch.float64)
    schedule = SimpleNamespace(alpha_bar64=lambda sigma: a)
    sigma = torch.tensor([0.3, 1.0])
    assert x0_error_scale(SimpleNamespace(prediction_type="flow"), sigma).tolist() == pytest.approx([0.3, 1.0])
    eps = x0_error_scale(SimpleNamespace(prediction_type="epsilon", schedule=schedule), sigma)
    assert eps[0].item() == pytest.approx(0.75) and math.isinf(eps[1].item())  # zero-terminal SNR: no x0 estimate, not trained
    assert x0_error_scale(SimpleNamespace(prediction_type="v_prediction", schedule=schedule), sigma).tolist() == pytest.approx([0.6, 1.0])
    # the epsilon form really is the x0 error: x0_hat = (x - sqrt(1 - a) e) / sqrt(a)
    x, e_true, e_pred, x0 = torch.tensor(0.9), torch.tensor(0.2), torch.tensor(0.5), (0.9 - 0.6 * 0.2) / 0.8
    assert ((x - 0.6 * e_pred) / 0.8 - x0).item() == pytest.approx(-0.75 * (e_pred - e_true).item())
    obj = DiffusionNFTConfig().build()
    with pytest.raises(FlowRLError, match="no time of the rollout grid"):
        obj._times(
            SimpleNamespace(
                prediction_type="epsilon", schedule=SimpleNamespace(alpha_bar64=lambda s: torch.zeros_like(s, dtype=torch.float64))
            ),
            torch.tensor([1.0, 0.0]),
        )


def test_old_policy_soft_update_and_swap():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    obj = DiffusionNFTConfig(old_decay_rate=0.1, old_decay_max=0.25).build()
    obj._update_old([p])  # first: a copy
    with torch.no_grad():
        p.add_(1.0)  # theta = (2, 3)
    obj.optimizer_steps = 2  # eta = min(0.2, 0.25)
    obj._update_old([p])
    assert obj._old[0].tolist() == pytest.approx([0.2 * 1 + 0.8 * 2, 0.2 * 2 + 0.8 * 3])
    obj.optimizer_steps = 10  # eta capped at 0.25
    obj._update_old([p])
    assert obj._old[0].tolist() == pytest.approx([0.25 * 1.8 + 0.75 * 2, 0.25 * 2.8 + 0.75 * 3])
    with swapped_weights([p], obj._old):
        assert p.tolist() == pytest.approx([1.95, 2.95])
    assert p.tolist() == [2.0, 3.0]
    on_policy = DiffusionNFTConfig().build()  # old_decay_rate = 0: the old policy is exactly the current weights
    on_policy.optimizer_steps = 50
    on_policy._update_old([p])
    assert torch.equal(on_policy._old[0], p.detach()) and on_policy._old[0].data_ptr() != p.data_ptr()


@pytest.mark.slow
def test_two_iterations_with_ode_rollouts_change_every_parameter(tmp_path, one_thread):
    trainer = two_iterations_change_every_parameter(fast_overrides(tmp_path, **{"train.learning_rate": 1e-3}), NFT)
    assert trainer.sampler.name == "ode" and not trainer.sampler.stochastic
    rows = trainer.logger.records()
    assert {"loss/policy", "nft/r_mean", "nft/old_deviation"} <= set(rows[1])
    assert rows[1]["nft/old_deviation"] > 0  # within an iteration theta leaves the old (rollout) policy
    assert trainer.objective.optimizer_steps == 4  # 2 iterations x 8 samples / batch 4


@pytest.mark.slow
def test_soft_updated_old_policy_trains(tmp_path, one_thread):
    trainer = two_iterations_change_every_parameter(
        fast_overrides(tmp_path, **{"train.learning_rate": 1e-3, "objective.old_decay_rate": 0.2, "objective.timestep_fraction": 0.3}), NFT
    )
    current = trainer.pipeline.trainable_parameters()
    assert any(not torch.equal(o, p.detach()) for o, p in zip(trainer.objective._old, current))  # theta_old trails theta


def test_config_refuses_bad_values():
    with pytest.raises(FlowRLError, match="objective.beta"):
        load_config(NFT, ["objective.beta=0"])
    with pytest.raises(FlowRLError, match="unknown config key 'objective.clip_range'"):
        load_config(NFT, ["objective.clip_range=0.1"])


def test_deterministic_rollouts_from_one_group_noise_are_refused(tmp_path):
    from flowrl.trainer import Trainer

    with pytest.raises(FlowRLError, match="set rollout.same_noise_in_group=false"):
        Trainer(load_config(NFT, fast_overrides(tmp_path, **{"rollout.same_noise_in_group": "true"})))
