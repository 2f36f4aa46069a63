"""DGPO: the group loss and its gradient against hand-derived values and against the authors' surrogate, the PPO-style
clip, the timestep clip, whole groups per minibatch, and two iterations on the embedded model through the real Trainer
(ODE rollouts; SDE rollouts with the clip, the KL term and per-sample noise)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import two_iterations_change_every_parameter

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives import OBJECTIVES
from flowrl.objectives.dgpo import DGPOConfig, clipped_denoising_loss, dgpo_loss

DGPO = CONFIGS / "digits" / "dgpo.yaml"


def test_loss_hand_values_and_gradient():
    # Two groups of two, beta = 2. S_g = beta * (1 / n_g) * sum_i A_i (err_i - ref_err_i), loss_g = -log sigmoid(-S_g) / beta:
    #   group 0: A = (1, -1), err - ref = (1 - 2, 3 - 2) = (-1, 1):   sum = -1 - 1 = -2,      S = 2 * -2 / 2 = -2
    #            loss = log(1 + e^-2) / 2 = 0.126928 / 2 = 0.063464
    #   group 1: A = (0.5, -0.5), err - ref = (0, 1):                  sum = -0.5,           S = 2 * -0.5 / 2 = -0.5
    #            loss = log(1 + e^-0.5) / 2 = 0.474077 / 2 = 0.237039
    err = torch.tensor([1.0, 3.0, 2.0, 2.0], requires_grad=True)
    ref_err = torch.tensor([2.0, 2.0, 2.0, 1.0])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    groups = torch.tensor([0, 0, 1, 1])
    per_group = dgpo_loss(err, ref_err, adv, groups, beta=2.0)
    assert per_group.tolist() == pytest.approx([math.log1p(math.exp(-2)) / 2, math.log1p(math.exp(-0.5)) / 2], abs=1e-6)
    assert per_group.tolist() == pytest.approx([0.063464, 0.237039], abs=1e-6)
    # d(mean_g loss_g)/d err_i = sigmoid(S_g) A_i / n_g / (number of groups): beta cancels.
    #   sigmoid(-2) = 0.119203, sigmoid(-0.5) = 0.377541 -> (0.119203 / 4, -0.119203 / 4, 0.377541 / 8, -0.377541 / 8)
    per_group.mean().backward()
    expected = [0.119203 / 4, -0.119203 / 4, 0.377541 / 8, -0.377541 / 8]
    assert err.grad.tolist() == pytest.approx(expected, abs=1e-6)
    # The authors' code (train_sd3_dgpo.py) writes the loss as mean_B sg(sigmoid(S_g)) A_i err_i: the same gradient.
    surrogate_err = err.detach().clone().requires_grad_(True)
    weights = torch.sigmoid(torch.tensor([-2.0, -2.0, -0.5, -0.5]))
    (weights * adv * surrogate_err).mean().backward()
    assert surrogate_err.grad.tolist() == pytest.approx(err.grad.tolist(), abs=1e-7)


def test_loss_is_log2_over_beta_at_the_reference_and_falls_when_the_good_sample_fits_better():
    adv, groups = torch.tensor([1.0, -1.0]), torch.zeros(2, dtype=torch.long)
    ref_err = torch.tensor([0.5, 0.5])
    at_ref = dgpo_loss(ref_err.clone(), ref_err, adv, groups, beta=10.0)
    assert at_ref.item() == pytest.approx(math.log(2) / 10)
    better = dgpo_loss(torch.tensor([0.4, 0.6]), ref_err, adv, groups, beta=10.0)  # the winner fits better, the loser worse
    worse = dgpo_loss(torch.tensor([0.6, 0.4]), ref_err, adv, groups, beta=10.0)
    assert better.item() < at_ref.item() < worse.item()
    # a group with all advantages 0 (a constant reward) has S = 0: no gradient, whatever the errors
    err = torch.tensor([3.0, 0.1], requires_grad=True)
    dgpo_loss(err, ref_err, torch.zeros(2), groups, beta=10.0).sum().backward()
    assert err.grad.abs().max().item() == 0.0


def test_ppo_style_clip_of_the_denoising_loss():
    # r = exp(old - err), c = 0.05: row 0 r = e^0.1 = 1.105 > 1.05 with A > 0 -> clipped; row 1 r = e^-0.1 = 0.905 < 0.95
    # with A < 0 -> clipped; row 2 r = e^0.01 = 1.01 (A > 0) and row 3 r = e^0.2 = 1.22 (A < 0) stay.
    err = torch.ones(4, requires_grad=True)
    old = torch.tensor([1.1, 0.9, 1.01, 1.2])
    out, clipped = clipped_denoising_loss(err, old, torch.tensor([1.0, -1.0, 1.0, -1.0]), 0.05)
    assert clipped.tolist() == [True, True, False, False]
    assert out.tolist() == [1.0, 1.0, 1.0, 1.0]
    out.sum().backward()
    assert err.grad.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_timestep_clip_keeps_the_noisy_grid_times():
    obj = DGPOConfig(min_sigma=0.5).build()
    assert obj._grid(torch.linspace(1, 0, 5)).tolist() == [1.0, 0.75, 0.5]  # sigma = 0.25 and the data (0) left out
    with pytest.raises(FlowRLError, match="objective.min_sigma"):
        DGPOConfig(min_sigma=0.9).build()._grid(torch.tensor([0.8, 0.4, 0.0]))


@pytest.mark.slow
def test_two_iterations_with_ode_rollouts_whole_groups(tmp_path, one_thread):
    trainer = two_iterations_change_every_parameter(
        fast_overrides(tmp_path, **{"train.learning_rate": 1e-3, "objective.num_times": 2, "train.batch_size": 4}), DGPO
    )
    obj = trainer.objective
    assert trainer.sampler.name == "ode" and not obj.needs_log_probs and obj.reference == "initial"
    assert obj.minibatch_unit == 4  # train.num_generations: the trainer never splits a group
    row = trainer.logger.records()[1]
    assert {"loss/policy", "dgpo/group_weight", "dgpo/margin", "dgpo/matching_mse"} <= set(row) and "loss/kl" not in row


@pytest.mark.slow
def test_two_iterations_with_sde_rollouts_clip_kl_and_per_sample_noise(tmp_path, one_thread):
    extra = {
        "train.learning_rate": 1e-3,
        "train.prompts_per_iteration": 2,
        "train.batch_size": 4,
        "sampler": "{name: flow_sde, noise_level: 0.7}",
        "objective.num_times": 2,
        "objective.clip_range": 0.01,
        "objective.kl_weight": 0.01,
        "objective.min_sigma": 0.5,
        "objective.shared_noise": False,
        "objective.multi_reward": "gdpo",
    }
    trainer = two_iterations_change_every_parameter(fast_overrides(tmp_path / "sde", **extra), DGPO)
    assert {"loss/policy", "loss/kl", "dgpo/clipped"} <= set(trainer.logger.records()[1])


def test_registered_and_config_refuses_split_groups():
    assert "dgpo" in OBJECTIVES.builtin_names()
    assert load_config(DGPO).objective.name == "dgpo" and DGPOConfig().clip_range is None  # the paper's loss by default
    with pytest.raises(FlowRLError, match="whole prompt groups"):
        load_config(DGPO, ["train.batch_size=12"])
    with pytest.raises(FlowRLError, match="objective.beta"):
        load_config(DGPO, ["objective.beta=0"])
