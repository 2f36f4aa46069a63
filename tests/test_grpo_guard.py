"""GRPO-Guard's gradient re-weighting (step_weighting: inverse_dt) against hand-derived numbers, alone and with its
ratio normalisation (ratio_norm), on the real digits model and GRPO objective."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.objectives.functional import inverse_dt_step_weights
from flowrl.trainer import Trainer


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
    batch = trainer.advantages(trainer.score(trainer.collect(0)))
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
