"""TraceRL (objective tracerl) on the embedded masked-diffusion LM (arith_mdlm): the trajectory replay scores each token
from the state it was committed in, so on a rollout at temperature 1 it reproduces the sampler's recorded log-probs;
``steps_per_forward`` groups steps as TraceRL's shrink does (checked against a hand loop); the on-policy loss and its
gradient are the hand-derived step-mean policy gradient over the groups TraceRL keeps; the band, the clip and the
config checks."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import load_config
from flowrl.data.arith import PROMPT_LEN, problems
from flowrl.errors import FlowRLError
from flowrl.objectives.dllm.estimators import TrajectoryReplayEstimator, step_groups
from flowrl.objectives.dllm.tracerl import TraceRLConfig, groups_in_band
from flowrl.pipelines.dllm import EMBEDDED_LMS, load_masked_lm
from flowrl.samplers.masked import generate
from flowrl.sections import BuildContext

G, STEPS = 16, 8  # two tokens committed per step: the step groups are not single tokens
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return load_masked_lm(str(EMBEDDED_LMS["arith_mdlm"]))


@pytest.fixture(scope="module")
def traj(lm):
    """Eight low-confidence rollouts at temperature 1 (two groups of four), with a reward pattern: group 0 has mean 0.25
    (inside TraceRL's 0.2-0.8 band), group 1 mean 1.0 (outside it)."""
    tok = lm.tokenizer
    tok.padding_side = "left"
    enc = tok([p for p, _ in problems("train", 8, seed=3)], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    t = generate(lm, enc.input_ids, enc.attention_mask.bool(), G, STEPS, G, 1.0, generator=torch.Generator().manual_seed(0))
    t.group_ids = torch.arange(8) // 4
    t.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    t.mask_seeds = torch.zeros(8, 1, dtype=torch.long)
    return t


def test_step_groups_rank_a_rows_acting_steps_and_group_k_of_them():
    steps = torch.tensor([[0, 0, 1, 3, 3, 5], [5, 4, 3, 2, 1, 0]])
    assert step_groups(steps, 6, 1).tolist() == [[0, 0, 1, 2, 2, 3], [5, 4, 3, 2, 1, 0]]
    assert step_groups(steps, 6, 2).tolist() == [[0, 0, 0, 1, 1, 1], [2, 2, 1, 1, 0, 0]]


def test_replay_reproduces_the_log_probs_the_sampler_recorded(lm, traj):
    """At temperature 1 the sampler records log softmax(logits)[token] at the commit step; the replay recomputes it from
    the completion alone, so the two agree (the first PPO ratio is 1 by construction, not by copying)."""
    assert (traj.unmask_step.flatten().bincount(minlength=STEPS) == 2 * 8).all()  # every step commits two tokens a row
    with torch.no_grad():
        out = TrajectoryReplayEstimator(1)(lm, traj)
    assert out.token_log_probs.min() < -0.5  # sampled at T = 1: some tokens were far from certain
    torch.testing.assert_close(out.token_log_probs, traj.token_log_probs.float(), atol=2e-5, rtol=0)
    assert (out.weights == 1).all()


def test_shrink_scores_k_steps_from_the_state_before_the_first(lm, traj):
    """steps_per_forward=3 by a hand loop: positions committed at steps 3k..3k+2 read the completion with the tokens of
    steps < 3k written and the rest masked; the step weights are 1 / tokens of the group."""
    with torch.no_grad():
        out = TrajectoryReplayEstimator(steps_per_forward=3, step_weights=True)(lm, traj)
        hand = torch.zeros(8, G)
        for g in range(3):  # steps 0-2, 3-5, 6-7
            state = torch.where(traj.unmask_step < 3 * g, traj.completion_ids, lm.mask_token_id)
            x = torch.cat([traj.prompt_ids, state], 1)
            attn = torch.cat([traj.prompt_mask.long(), torch.ones(8, G, dtype=torch.long)], 1)
            lp = torch.log_softmax(lm.model(input_ids=x, attention_mask=attn).logits[:, PROMPT_LEN:].double(), -1)
            picked = lp.gather(2, traj.completion_ids[..., None]).squeeze(-1).float()
            hand = torch.where(traj.unmask_step // 3 == g, picked, hand)
    torch.testing.assert_close(out.token_log_probs, hand, atol=2e-5, rtol=0)
    expected_weights = torch.where(traj.unmask_step >= 6, 1 / 4, 1 / 6)  # 2 tokens x 2 steps, 2 tokens x 3 steps
    torch.testing.assert_close(out.weights, expected_weights.float())
    torch.testing.assert_close(out.weights.sum(1), torch.full((8,), 3.0))  # each row counts its three groups once


def test_groups_in_band():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1.0, float("nan"), 0, 0])
    kept = groups_in_band(rewards, torch.arange(16) // 4, (0.2, 0.8))
    # means: 0.25 in; 0.5 in; 1.0 out; the NaN row's group 1/3 in
    assert kept.tolist() == [True] * 8 + [False] * 4 + [True] * 4
    assert groups_in_band(rewards, torch.arange(16) // 4, None).all()


def test_on_policy_loss_and_gradient_are_the_step_mean_policy_gradient(lm, traj):
    """At the rollout weights every ratio is 1, so the loss is -sum_b S_b A_b / sum_b S_b over the kept rows (S_b the
    number of step rows, 8 here) and its gradient -sum_b A_b sum_i w_i grad log p_i / sum_b S_b, w_i = 1/2 (two tokens a
    step); A is the z-score with the biased std, and group 1 (all rewards 1, outside the band) is left out."""
    objective = TraceRLConfig().build(BuildContext({}, None, lm))
    batch = objective.prepare(traj)
    objective.old_and_ref(lm, batch)
    r = traj.rewards[:4]
    adv = (r - r.mean()) / r.std(unbiased=False)
    torch.testing.assert_close(batch.advantages[:4].float(), adv, atol=1e-6, rtol=0)
    params = [p for p in lm.model.parameters() if p.requires_grad]
    (loss_output,) = list(objective.losses(lm, None, batch, torch.Generator()))
    grads = torch.autograd.grad(loss_output.loss, params)
    assert abs(float(loss_output.loss.detach()) - float(-(adv * 8).sum() / 32)) < 1e-6  # = -mean(adv) = 0 up to rounding
    lp = TrajectoryReplayEstimator(1)(lm, traj).token_log_probs[:4]
    hand = -(adv[:, None] * 0.5 * lp).sum() / 32
    hand_grads = torch.autograd.grad(hand, params)
    for a, b in zip(grads, hand_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_clip_stops_the_gradient_of_a_token_past_the_range(lm, traj):
    """A positive-advantage row whose ratio is already above 1 + 0.2 contributes nothing: PPO's clip, per token."""
    objective = TraceRLConfig(group_band=None).build(BuildContext({}, None, lm))
    batch = objective.prepare(traj)
    objective.old_and_ref(lm, batch)
    batch.old_log_probs = batch.old_log_probs.clone()
    batch.old_log_probs[0] -= 1.0  # row 0 (A > 0): every ratio e^1 > 1.2
    rest = objective.prepare(traj[1:])
    rest.advantages = batch.advantages[1:]
    rest.old_log_probs = batch.old_log_probs[1:]
    params = [p for p in lm.model.parameters() if p.requires_grad]
    (full,) = list(objective.losses(lm, None, batch, torch.Generator()))
    (without,) = list(objective.losses(lm, None, rest, torch.Generator()))
    g_full = torch.autograd.grad(full.loss, params)
    g_without = torch.autograd.grad(without.loss, params)
    for a, b in zip(g_full, g_without, strict=True):  # row 0 adds no gradient; its constant term only rescales the mean
        torch.testing.assert_close(a * 8, b * 7, atol=1e-6, rtol=1e-4)
    assert float(full.metrics["policy/clipfrac"]) == pytest.approx(16 / (8 * G))


def test_config_checks():
    with pytest.raises(FlowRLError, match="learned unmasking order"):
        load_config(None, ["pipeline.name=dllm", "sampler.name=masked", "sampler.remasking=policy", "objective.name=tracerl"])
    with pytest.raises(FlowRLError, match="low <= high"):
        load_config(None, ["pipeline.name=dllm", "sampler.name=masked", "objective={name: tracerl, group_band: [0.8, 0.2]}"])


def test_replay_follows_a_threshold_samplers_uneven_steps(lm, traj):
    """With a confidence threshold each row commits as many tokens a step as pass it (a block may end early, leaving
    steps unused): the replay still scores every token from its own row's state, equal to the recorded log-probs."""
    t = generate(lm, traj.prompt_ids, traj.prompt_mask, G, STEPS, G, 1.0, threshold=0.5, generator=torch.Generator().manual_seed(1))
    per_row = [len(set(r.tolist())) for r in t.unmask_step]
    assert len(set(per_row)) > 1 and min(per_row) < STEPS  # rows took different numbers of steps
    with torch.no_grad():
        out = TrajectoryReplayEstimator(1)(lm, t)
    torch.testing.assert_close(out.token_log_probs, t.token_log_probs.float(), atol=2e-5, rtol=0)
