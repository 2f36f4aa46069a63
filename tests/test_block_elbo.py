"""Block-level ELBO optimisation (objective block_elbo, LLaDA2.1's EBPO) on the shipped block-diffusion LM (arith_bd3lm):
the vectorised likelihood (one forward per timestep over [prompt ; noised ; clean]) equals the per-block computation
(one forward per block) to float tolerance; a fully masked block's term reads the sampler's own context; the first
ratio is 1; the clipped ELBO-ratio loss equals a hand computation on fixed numbers; on policy its gradient is
-mean_b A_b grad ELBO_b."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.data.arith import PROMPT_LEN, problems
from flowrl.errors import FlowRLError
from flowrl.objectives.dllm.block_elbo import (
    BlockELBOConfig,
    block_token_log_probs,
    elbo_masks,
    per_block_elbo_terms,
    timestep_grid,
    vectorised_elbo_terms,
)
from flowrl.pipelines.dllm import EMBEDDED_LMS, load_masked_lm
from flowrl.samplers.masked import MaskedSamplerConfig, generate
from flowrl.sections import BuildContext

G, L = 16, 4
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return load_masked_lm(str(EMBEDDED_LMS["arith_bd3lm"]))


@pytest.fixture(scope="module")
def rollout(lm):
    """8 cached rollouts at T = 1 (left-padded prompts of different lengths), two groups of 4, two mask seeds."""
    tok = lm.tokenizer
    tok.padding_side = "left"
    enc = tok([p for p, _ in problems("train", 8, seed=3)], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    assert len(set(enc.attention_mask.sum(1).tolist())) > 1
    traj = generate(
        lm, enc.input_ids, enc.attention_mask.bool(), G, G, L, 1.0, generator=torch.Generator().manual_seed(0), kv_cache="exact"
    )
    traj.group_ids = torch.arange(8) // 4
    traj.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    traj.mask_seeds = torch.randint(0, 2**62, (8, 2), generator=torch.Generator().manual_seed(1))
    return traj


def test_timestep_grid_is_the_midpoint_rule():
    t, w = timestep_grid(4)
    assert t.tolist() == [0.125, 0.375, 0.625, 0.875]
    assert w.tolist() == pytest.approx([2.0, 2 / 3, 0.4, 2 / 7])


def test_vectorised_likelihood_equals_the_per_block_computation(lm, rollout):
    """Every block's term at every one of 3 timesteps: one forward per timestep against one per block and timestep."""
    masks = elbo_masks(rollout, 0, 3)
    assert 0.1 < masks[0].float().mean() < 0.3 and 0.7 < masks[2].float().mean() < 0.95  # t = 1/6, 1/2, 5/6
    with torch.no_grad():
        vec = vectorised_elbo_terms(lm, rollout, masks)
        ref = per_block_elbo_terms(lm, rollout, masks)
    assert vec.shape == (8, 3, G // L) and vec.abs().max() > 1
    assert (vec - ref).abs().max() < 1e-5
    # the block terms are the masked tokens' log-probs times w_n, block by block
    lp = block_token_log_probs(lm, rollout, masks[1])
    _, w = timestep_grid(3)
    assert torch.allclose(vec[:, 1], (torch.where(masks[1], lp, 0.0) * w[1]).reshape(8, G // L, L).sum(-1), atol=1e-6)


def test_fully_masked_block_reads_the_samplers_context(lm, rollout):
    """With a whole completion masked, each block is predicted from the clean blocks before it and a fully masked
    block: the context of the block's first sampling step, so the position committed there has the log-prob the
    cached sampler recorded."""
    with torch.no_grad():
        lp = block_token_log_probs(lm, rollout, torch.ones(8, G, dtype=torch.bool))
    first = rollout.unmask_step % L == 0  # one position per step: the first step of each block
    assert int(first.sum()) == 8 * G // L
    assert torch.allclose(lp[first], rollout.token_log_probs[first], atol=1e-5)


def test_first_ratio_is_one_for_every_seed(lm, rollout):
    objective = BlockELBOConfig(num_mask_seeds=2, num_timesteps=2).build(BuildContext({}, MaskedSamplerConfig(), lm))
    traj = rollout[torch.arange(8)]
    objective.old_and_ref(lm, traj)
    assert traj.old_log_probs.shape == (8, 2, 2, G // L)
    traj = objective.prepare(traj)
    for epoch in range(2):
        traj.inner_epoch = epoch
        (out,) = objective.losses(lm, None, traj, torch.Generator())
        assert float(out.metrics["policy/ratio_mean"]) == 1.0 and float(out.metrics["policy/clipfrac"]) == 0.0


@pytest.mark.parametrize("log_ratio", ["sum", "per_token"])
def test_clipped_elbo_ratio_loss_equals_the_hand_computation(lm, rollout, log_ratio):
    """Old block terms = new - d_b (on one block), fixed advantages, eps_low 0.2 / eps_high 0.3, one non-finite reward:
    loss = mean over the valid rows of max(-A r, -A clip(r, 0.8, 1.3)), r = exp(d_b) (or exp(d_b / G)), in floats."""
    objective = BlockELBOConfig(num_timesteps=2, clip_range=0.2, clip_range_high=0.3, log_ratio=log_ratio).build()
    traj = rollout[torch.arange(8)]
    traj.inner_epoch = 0
    with torch.no_grad():
        new = objective.block_terms(lm, traj, 0)
    d = [0.5, -0.5, 0.1, -0.1, 0.25, -0.25, 2.0, 0.0]
    old = new.clone()
    old[:, 1, 2] -= torch.tensor(d) * (G if log_ratio == "per_token" else 1)
    traj.old_log_probs = old[:, None]
    A = [1.0, 1.0, -1.0, -1.0, 0.5, -2.0, 1.0, 3.0]
    traj.advantages = torch.tensor(A)
    traj.rewards = torch.tensor([1.0] * 7 + [float("nan")])
    (out,) = objective.losses(lm, None, traj, torch.Generator())
    hand = [max(-a * math.exp(x), -a * min(max(math.exp(x), 0.8), 1.3)) for a, x in zip(A[:7], d[:7])]
    assert float(out.loss.detach()) == pytest.approx(sum(hand) / 7, rel=1e-5)
    # rows 0 (r = 1.65 > 1.3, A > 0), 1 (0.61 < 0.8), 5 (0.78 < 0.8) and 6 (7.4) are outside the clip range
    assert float(out.metrics["policy/clipfrac"]) == pytest.approx(4 / 7)


def test_on_policy_gradient_is_minus_mean_advantage_times_elbo_gradient(lm, rollout):
    objective = BlockELBOConfig(num_timesteps=2).build()
    traj = objective.prepare(rollout[torch.arange(8)])
    objective.old_and_ref(lm, traj)
    params = [p for p in lm.model.parameters() if p.requires_grad]
    lm.model.zero_grad(set_to_none=True)
    (out,) = objective.losses(lm, None, traj, torch.Generator())
    out.loss.backward()
    got = [p.grad.clone() for p in params]
    lm.model.zero_grad(set_to_none=True)
    (-(traj.advantages * objective.block_terms(lm, traj, 0).sum((1, 2))).mean()).backward()
    want = [p.grad.clone() for p in params]
    lm.model.zero_grad(set_to_none=True)
    assert sum(float(g.abs().sum()) for g in want) > 0
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)


def test_bidirectional_model_is_refused():
    mdlm = load_masked_lm(str(EMBEDDED_LMS["arith_mdlm"]))
    with pytest.raises(FlowRLError, match="block-diffusion model"):
        BlockELBOConfig().build(BuildContext({}, MaskedSamplerConfig(), mdlm))


@pytest.mark.slow
def test_preset_trains_two_iterations(tmp_path):
    """configs/dllm/block_elbo.yaml through the Trainer, small: the weights move, the ELBO and ratio are logged."""
    import json

    from conftest import CONFIGS

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    overrides = [f"output_dir={tmp_path}", "train.iterations=2", "train.prompts_per_iteration=2", "train.num_generations=4"]
    overrides += ["train.batch_size=8", "prompts.eval_size=8", "eval.every=0", "log.checkpoint_every=0", "log.progress=false"]
    trainer = Trainer(load_config(CONFIGS / "dllm" / "block_elbo.yaml", overrides + ["train.learning_rate=1e-3"]))
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    assert trainer.fit()["iterations_completed"] == 2
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.module.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss/policy", "policy/ratio_mean", "policy/elbo_per_token", "reward/mean"} <= set(rows[-1])
