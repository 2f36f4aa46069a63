"""JustGRPO (objective just_grpo) on the embedded masked-diffusion LM (arith_mdlm): rollouts are left to right and record
the exact per-token log-probs, which equal a hand-written loop over positions of log-softmax on [prompt ; y_<t ;
masks]; the re-score gives ratio 1; the loss equals a clipped GRPO loss computed by hand on fixed ratios and
advantages; on policy its gradient is the policy gradient; evaluation keeps the parallel sampler."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS

from flowrl.config import load_config
from flowrl.data.arith import PROMPT_LEN, problems
from flowrl.errors import FlowRLError
from flowrl.objectives.dllm.just_grpo import JustGRPOConfig, left_to_right_states
from flowrl.pipelines.dllm import EMBEDDED_LMS, load_masked_lm
from flowrl.samplers.masked import MaskedSamplerConfig, generate
from flowrl.sections import BuildContext

G = 16
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return load_masked_lm(str(EMBEDDED_LMS["arith_mdlm"]))


def _rollout(lm, objective, n=8):
    """Completions by the objective's rollout sampler (left to right), with a reward pattern over two groups of 4."""
    tok = lm.tokenizer
    tok.padding_side = "left"
    enc = tok([p for p, _ in problems("train", n, seed=3)], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    s = objective.rollout_sampler(MaskedSamplerConfig())
    traj = generate(
        lm, enc.input_ids, enc.attention_mask.bool(), s.gen_length, s.steps, s.block_length, 1.0, generator=torch.Generator().manual_seed(0)
    )
    traj.group_ids = torch.arange(n) // 4
    traj.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])[:n]
    traj.mask_seeds = torch.zeros(n, 1, dtype=torch.long)
    return traj


def _by_hand(lm, traj) -> torch.Tensor:
    """(B, G) log p(y_t | prompt, y_<t, masks) by a loop over t: the BERT's own forward, log_softmax, the token's entry."""
    B = traj.completion_ids.shape[0]
    out = torch.zeros(B, G, dtype=torch.float64)
    for t in range(G):
        x = torch.cat([traj.prompt_ids, traj.completion_ids[:, :t], torch.full((B, G - t), lm.mask_token_id)], 1)
        attn = torch.cat([traj.prompt_mask.long(), torch.ones(B, G, dtype=torch.long)], 1)
        logits = lm.model(input_ids=x, attention_mask=attn).logits[:, PROMPT_LEN + t].double()
        out[:, t] = torch.log_softmax(logits, -1)[torch.arange(B), traj.completion_ids[:, t]]
    return out


def test_rollout_sampler_is_left_to_right_and_evaluation_keeps_the_run_sampler():
    run = MaskedSamplerConfig(gen_length=16, steps=8, block_length=16, threshold=0.9)
    s = JustGRPOConfig().build().rollout_sampler(run)
    assert (s.block_length, s.steps, s.remasking, s.threshold, s.gen_length) == (1, 16, "low_confidence", None, 16)
    assert (run.block_length, run.steps, run.threshold) == (16, 8, 0.9)  # the run's (evaluation's) sampler unchanged


def test_states_mask_from_each_position_on():
    y = torch.tensor([[5, 6, 7]])
    assert left_to_right_states(y, torch.tensor([0, 2]), 9).tolist() == [[9, 9, 9], [5, 6, 9]]


def test_exact_left_to_right_log_likelihood_equals_the_hand_loop(lm):
    """Each step commits the leftmost masked position; the sampler's recorded log-probs, the objective's batched
    log-probs (whole and in groups of 3 positions) and the hand loop agree: the likelihood of the order is exact."""
    objective = JustGRPOConfig().build(BuildContext({}, MaskedSamplerConfig(), lm))
    traj = _rollout(lm, objective, n=4)
    assert (traj.unmask_step == torch.arange(G)).all() and (traj.unmask_rank == torch.arange(G)).all()
    with torch.no_grad():
        hand = _by_hand(lm, traj)
        whole = objective.log_probs(lm, traj).double()
        grouped = JustGRPOConfig(positions_per_forward=3).build().log_probs(lm, traj).double()
    assert hand.max() < 0 and hand.sum(1).min() < -1  # real, non-trivial probabilities
    assert torch.allclose(whole, hand, atol=1e-5)
    assert torch.allclose(grouped, hand, atol=1e-5)
    assert torch.allclose(traj.token_log_probs.double(), hand, atol=1e-5)


def test_first_ratio_is_one_and_on_policy_gradient_is_the_policy_gradient(lm):
    """Re-scored at the rollout weights the ratio is exactly 1 and nothing is clipped; the gradient of the loss summed
    over its position groups is that of -sum_b A_b sum_t log p_bt / (G * #{A != 0}) (the policy gradient)."""
    objective = JustGRPOConfig(positions_per_forward=5).build()
    traj = _rollout(lm, objective, n=4)
    objective.old_and_ref(lm, traj)
    traj = objective.prepare(traj)
    params = [p for p in lm.model.parameters() if p.requires_grad]
    lm.model.zero_grad(set_to_none=True)
    outs = list(objective.losses(lm, None, traj, torch.Generator()))
    assert len(outs) == 4  # positions 0-4, 5-9, 10-14, 15
    for out in outs:
        assert float(out.metrics["policy/ratio_mean"]) == 1.0 and float(out.metrics["policy/clipfrac"]) == 0.0
        out.loss.backward()
    got = [p.grad.clone() for p in params]
    lm.model.zero_grad(set_to_none=True)
    nonzero = int((traj.advantages != 0).sum())
    (-(traj.advantages[:, None] * objective.log_probs(lm, traj)).sum() / (G * nonzero)).backward()
    want = [p.grad.clone() for p in params]
    lm.model.zero_grad(set_to_none=True)
    assert sum(float(g.abs().sum()) for g in want) > 0
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)


def test_advantages_over_the_unbiased_std():
    """Group [1, 0, 0, 0]: mean 1/4, unbiased std sqrt(1/4 * 3 / 3)... = 0.5, so A = (r - 0.25) / (0.5 + 1e-4)."""
    objective = JustGRPOConfig().build()
    traj = type("T", (), {})()
    traj.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    traj.group_ids = torch.zeros(4, dtype=torch.long)
    traj.reward_components = {}
    adv = objective.advantages(traj)
    assert adv.tolist() == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001], rel=1e-6)


@pytest.mark.parametrize("aggregation", ["nonzero_advantage_mean", "sequence_mean"])
def test_loss_equals_the_clipped_grpo_loss_by_hand(lm, aggregation):
    """Fixed log-ratios (old = new - d) and fixed advantages, one row with A = 0 and one with a non-finite reward: the
    loss is sum over valid rows and positions of max(-A r, -A clip(r, 0.8, 1.2)), over G times the number of rows with
    A != 0 (JustGRPO) or of valid rows, written out in Python floats."""
    objective = JustGRPOConfig(loss_aggregation=aggregation, positions_per_forward=7).build()
    traj = _rollout(lm, objective, n=4)
    with torch.no_grad():
        new = objective.log_probs(lm, traj)
    d = (torch.arange(4 * G, dtype=torch.float32).reshape(4, G) % 7 - 3) * 0.1  # log-ratios -0.3 .. 0.3
    traj.old_log_probs = new - d
    traj.advantages = torch.tensor([1.5, -0.5, 0.0, 2.0])
    traj.rewards = torch.tensor([1.0, 0.0, 1.0, float("nan")])  # row 3 invalid
    total = sum(float(out.loss.detach()) for out in objective.losses(lm, None, traj, torch.Generator()))

    hand = 0.0
    for b in range(3):  # the valid rows
        A = [1.5, -0.5, 0.0][b]
        for t in range(G):
            r = math.exp(float(d[b, t]))
            hand += max(-A * r, -A * min(max(r, 0.8), 1.2))
    rows = 2 if aggregation == "nonzero_advantage_mean" else 3
    assert total == pytest.approx(hand / (G * rows), rel=1e-4, abs=1e-7)
    assert hand != 0


def test_block_diffusion_model_is_refused():
    bd = load_masked_lm(str(EMBEDDED_LMS["arith_bd3lm"]))
    with pytest.raises(FlowRLError, match="block_elbo"):
        JustGRPOConfig().build(BuildContext({}, MaskedSamplerConfig(block_length=4, steps=16), bd))


def test_trainer_rolls_out_left_to_right_and_evaluates_in_parallel(tmp_path):
    """Through the Trainer: the collected rollout is left to right (one position per step, in order) while the
    evaluation path decodes with the preset's sampler (8 steps of 2 positions)."""
    from flowrl.trainer import Trainer

    overrides = [f"output_dir={tmp_path}", "train.prompts_per_iteration=2", "train.num_generations=4", "prompts.eval_size=8"]
    trainer = Trainer(load_config(CONFIGS / "dllm" / "just_grpo.yaml", overrides + ["log.progress=false"]))
    (chunk,) = list(trainer.modality.collector.collect(0, 0, 1))  # the old log-probs come after the hand-over
    assert (chunk.batch.unmask_step == torch.arange(G)).all() and chunk.batch.old_log_probs.shape == (8, G)
    assert torch.allclose(chunk.batch.old_log_probs, chunk.batch.token_log_probs, atol=1e-5)
    evaluated = trainer.modality.generate(["ann has 3 apples. she buys 4 more. how many apples?"] * 2, 0.0, torch.Generator())
    assert evaluated.num_steps == 8 and sorted(evaluated.unmask_step[0].tolist()) == sorted(list(range(8)) * 2)


@pytest.mark.slow
def test_preset_trains_two_iterations(tmp_path):
    """configs/dllm/just_grpo.yaml through the Trainer, small: the weights move and the usual metrics are logged."""
    import json

    from flowrl.trainer import Trainer

    overrides = [f"output_dir={tmp_path}", "train.iterations=2", "train.prompts_per_iteration=2", "train.num_generations=4"]
    overrides += ["train.batch_size=8", "prompts.eval_size=8", "eval.every=0", "log.checkpoint_every=0", "log.progress=false"]
    trainer = Trainer(load_config(CONFIGS / "dllm" / "just_grpo.yaml", overrides + ["train.learning_rate=1e-3"]))
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    assert trainer.fit()["iterations_completed"] == 2
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.module.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss/policy", "policy/ratio_mean", "policy/clipfrac", "reward/mean"} <= set(rows[-1])
    assert "eval/reward/mean" in rows[0]
