"""Reward-hacking instruments (issue #17, item 3): held-out judge, per-step importance ratio, seed diversity,
instruments.png; all in metrics.jsonl of a real digits run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.data.digits import load_digit_images
from flowrl.evaluation.diversity import seed_diversity
from flowrl.objectives.policy_gradient import step_ratio_stats
from flowrl.reward_models import build_reward
from flowrl.trainer import Trainer

GRPO = CONFIGS / "digits" / "grpo.yaml"


def test_seed_diversity_against_hand_computed_value():
    # prompt A: (0,0), (3,4), (0,0): pairwise distances 5, 0, 5; prompt B: three equal points: 0, 0, 0
    samples = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert seed_diversity(samples, 3) == pytest.approx((10 / 3 + 0) / 2)
    assert seed_diversity(samples.reshape(6, 1, 1, 2), 3) == pytest.approx(5 / 3)  # images are flattened
    assert math.isnan(seed_diversity(samples, 1))  # one seed per prompt: nothing to compare


def test_digit_realism_judge_scores_real_digits_one_and_inverted_digits_low():
    judge = build_reward("digit_realism")
    images, labels = load_digit_images()
    x, meta = (images[:100] + 1) / 2, [{"digit": int(d)} for d in labels[:100]]
    assert torch.allclose(judge(x, [""] * 100, meta).scores, torch.ones(100))  # each is its own nearest real digit
    assert judge(1 - x, [""] * 100, meta).scores.mean() < 0.4  # inverted: a white background is far from every digit
    assert judge(x, [""] * 100, [{}] * 100).scores.min() == 1  # no digit in the prompt: nearest of any digit


def test_step_ratio_stats_hand_values():  # the ratio normalisation's: tests/test_grpo_guard.py
    stats = step_ratio_stats(torch.tensor([0.0, math.log(2.0), math.log(4.0)]), torch.tensor([True, True, False]), 3)
    assert float(stats["policy/ratio_mean/step_03"]) == pytest.approx(1.5)
    assert float(stats["policy/ratio_std/step_03"]) == pytest.approx(0.5)  # of the valid rows only


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_digits_run_logs_every_instrument_and_draws_the_picture(tmp_path):
    # one minibatch per iteration: the update re-scores the rollout at unchanged weights, so every ratio is 1, spread 0
    over = {"eval.every": 1, "eval.samples_per_prompt": 2, "train.batch_size": 8}
    Trainer(load_config(GRPO, fast_overrides(tmp_path / "judge", **over))).fit()
    records = _records(tmp_path / "judge")
    for r in records:
        assert {"eval/judge/mean", "eval/judge/digit_realism", "eval/diversity"} <= set(r)
        assert 0 < r["eval/judge/mean"] <= 1 and r["eval/diversity"] > 0 and "eval/judge/is_eval_reward" not in r
    for r in records[1:]:
        steps = [k for k in r if k.startswith("policy/ratio_mean/step_")]
        assert steps and all(k.replace("mean", "std") in r for k in steps)
        assert all(abs(r[k] - 1) < 1e-5 for k in steps) and abs(r["policy/ratio_std"]) < 1e-5
        assert "reward/mean" in r  # the training reward beside the judge
    assert (tmp_path / "judge" / "instruments.png").stat().st_size > 10_000

    # no judge configured: the held-out reward stands in for it, flagged; GRPO-Guard's ratio norm runs
    over.update({"train.iterations": 1, "eval.judge": "null", "objective.ratio_norm": "true"})
    Trainer(load_config(GRPO, fast_overrides(tmp_path / "plain", **over))).fit()
    records = _records(tmp_path / "plain")
    assert all(r["eval/judge/mean"] == r["eval/reward/mean"] and r["eval/judge/is_eval_reward"] == 1 for r in records)
    assert all(abs(r["policy/ratio_mean"] - 1) < 1e-6 for r in records[1:])
    assert (tmp_path / "plain" / "instruments.png").is_file()
