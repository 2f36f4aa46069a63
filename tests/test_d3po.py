"""D3PO: the pair loss and labels against hand-derived values, pairing, the log 2 invariant and the gradient
on the embedded model, pair-preserving minibatches, and a two-iteration run."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import two_iterations_change_every_parameter

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.d3po import D3POConfig
from flowrl.objectives.functional import d3po_pair_loss, pair_preferences
from flowrl.types import Trajectory

D3PO = CONFIGS / "digits" / "d3po.yaml"


def test_pair_loss_hand_values_and_clamp():
    # log r_w = 0.05, log r_l = -0.02 (inside [log 0.9, log 1.1]), beta = 0.1: z = 0.1 * 0.07 = 0.007,
    # loss = -log sigmoid(0.007) = log(1 + exp(-0.007)).
    lw, ll = torch.tensor([0.05], requires_grad=True), torch.tensor([-0.02], requires_grad=True)
    loss = d3po_pair_loss(lw, ll, beta=0.1, clip_range=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.007)), abs=1e-7)
    loss.sum().backward()
    # d/dz -log sigmoid(z) = -(1 - sigmoid(z)); dz/dlw = beta, dz/dll = -beta.
    g = -(1 - 1 / (1 + math.exp(-0.007))) * 0.1
    assert lw.grad.item() == pytest.approx(g) and ll.grad.item() == pytest.approx(-g)
    # Clamped: log r_w = 0.5 counts as log 1.1 and gives no gradient; equal ratios give exactly log 2.
    lw = torch.tensor([0.5], requires_grad=True)
    loss = d3po_pair_loss(lw, torch.zeros(1), beta=0.1, clip_range=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.1 * math.log(1.1))), abs=1e-7)
    loss.sum().backward()
    assert lw.grad.item() == 0.0
    assert d3po_pair_loss(torch.zeros(3), torch.zeros(3), 0.1, 0.1).tolist() == pytest.approx([math.log(2)] * 3)


def test_pair_preferences_reward_pareto_and_nonfinite():
    rewards = torch.tensor([1.0, 0.5, 0.2, 0.2, float("nan"), 3.0, 1.0, 1.0])
    first, second = torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])
    assert pair_preferences(rewards, None, first, second, "reward").tolist() == [1.0, 0.0, 0.0, 0.0]
    assert pair_preferences(rewards, None, second, first, "reward").tolist() == [-1.0, 0.0, 0.0, 0.0]
    # Pareto over (a, b): pair 0 dominates, pair 1 dominated, pair 3 trades off -> 0; pair 2 has a NaN -> 0.
    comps = {"a": torch.tensor([2.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 1.0]), "b": torch.tensor([1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0])}
    assert pair_preferences(rewards, comps, first, second, "pareto").tolist() == [1.0, -1.0, 0.0, 0.0]


def _batch(rewards: list[float], groups: list[int]) -> Trajectory:
    b = len(rewards)
    return Trajectory(
        latents=torch.arange(b, dtype=torch.float32).view(b, 1, 1).expand(b, 2, 1).clone(),
        sigmas=torch.tensor([1.0, 0.0]),
        log_probs=torch.zeros(b, 1),
        stochastic=torch.ones(1, dtype=torch.bool),
        cond={},
        prompts=[str(g) for g in groups],
        metadata=[{}] * b,
        group_ids=torch.tensor(groups),
        rewards=torch.tensor(rewards),
    )


def test_prepare_pairs_consecutive_samples_of_a_group_winner_first():
    # Group 0: samples 0, 2, 4, 5 (interleaved with group 1: 1, 3) -> pairs (0, 2), (4, 5); group 1 -> (1, 3).
    batch = D3POConfig().build().prepare(_batch([0.1, 5.0, 0.9, 5.0, 0.7, 0.3], [0, 1, 0, 1, 0, 0]))
    order = batch.latents[:, 0, 0].long().tolist()
    assert order == [2, 0, 4, 5, 1, 3]  # winners first; the tie (1, 3) keeps its order
    assert batch.advantages.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # the tie is masked out of the loss


def test_first_loss_is_log2_and_gradient_is_the_pairs_log_prob_difference(tmp_path):
    """At the rollout weights the policy equals the reference: every step's loss is log 2, and the gradient
    is -(beta / 2) * mean over decisive pairs of grad(log p(winner) - log p(loser)) / trained steps."""
    from flowrl.trainer import Trainer

    trainer = Trainer(load_config(D3PO, fast_overrides(tmp_path, **{"objective.timestep_fraction": 0.5})))
    traj = trainer.score(trainer.collect(0))
    batch = trainer.objective.prepare(traj)
    decisive = batch.advantages[0::2].bool()
    assert decisive.any()
    pipe, sampler, params = trainer.pipeline, trainer.sampler, trainer.trainable_parameters()
    outs = list(trainer.objective.losses(pipe, sampler, batch, torch.Generator().manual_seed(0)))
    steps = len(outs)
    grads = [torch.zeros_like(p) for p in params]
    for out in outs:
        assert out.metrics["loss/policy"].item() == pytest.approx(math.log(2), abs=1e-6)
        for g, gi in zip(grads, torch.autograd.grad(out.loss, params, allow_unused=True)):
            g += 0 if gi is None else gi
    # Hand-derived gradient, step by step, from the sampler's log-probs alone.
    from flowrl.objectives.policy_gradient import choose_train_steps

    chosen = choose_train_steps(batch.stochastic, 0.5, "random", torch.Generator().manual_seed(0))
    expected = [torch.zeros_like(p) for p in params]
    for k in chosen:
        x, xn = batch.latents[:, k], batch.latents[:, k + 1]
        lp = sampler.step(
            pipe.predict(x, batch.sigmas[k], batch.cond, batch.guidance_scale), x, batch.sigmas[k], batch.sigmas[k + 1], x_next=xn
        ).log_prob
        surrogate = -(0.1 / 2) * ((lp[0::2] - lp[1::2]) * decisive).sum() / decisive.sum() / steps
        for e, gi in zip(expected, torch.autograd.grad(surrogate, params, allow_unused=True)):
            e += 0 if gi is None else gi
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-9, rtol=1e-5)
    assert any(g.abs().max() > 0 for g in grads)


def test_minibatches_keep_pairs_together(tmp_path):
    from flowrl.trainer import Trainer

    trainer = Trainer(
        load_config(
            D3PO,
            fast_overrides(
                tmp_path, **{"train.prompts_per_iteration": 4, "train.num_generations": 2, "train.batch_size": 2, "train.inner_epochs": 2}
            ),
        )
    )
    seen = []
    trainer.loop.step = lambda batch, gen: seen.append(batch.group_ids.tolist()) or {}
    trainer.update(trainer.advantages(trainer.score(trainer.collect(0))), 0)
    assert len(seen) == 8 and all(len(set(g)) == 1 and len(g) == 2 for g in seen)  # each minibatch is one pair


def test_pairs_need_even_sizes_and_pareto_needs_two_rewards(tmp_path):
    from flowrl.trainer import Trainer

    with pytest.raises(FlowRLError, match="trains pairs of samples"):
        Trainer(load_config(D3PO, fast_overrides(tmp_path / "a", **{"train.num_generations": 3})))
    with pytest.raises(FlowRLError, match="objective.preference=pareto compares reward components: reward.components needs at least two"):
        load_config(None, ["objective.name=d3po", "objective.preference=pareto"])


@pytest.mark.slow
def test_two_d3po_iterations_change_every_parameter(tmp_path, one_thread):
    trainer = two_iterations_change_every_parameter(fast_overrides(tmp_path, **{"train.learning_rate": 1e-3}), D3PO)
    rows = trainer.logger.records()
    assert {"d3po/pair_accuracy", "d3po/decisive_fraction", "loss/policy"} <= set(rows[1])
