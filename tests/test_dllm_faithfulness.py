"""The dLLM objectives against their papers' released code, on numbers derived by hand (issue #33, items 3-5).

- diffu-GRPO's loss is ONE mean over every completion token of the minibatch, as d1's
  ``diffu-grpo/diffu_grpo_trainer.py::compute_loss`` (``(per_token_loss * completion_mask).sum() /
  completion_mask.sum()``); UniGRPO keeps GRPO's mean per completion, then over completions. Both are
  ``objective.loss_aggregation`` (``token_mean`` / ``sequence_mean``).
- DCoLT follows LLaDOU (``networks/lladou_v0.py::logprob_loss``, ``training/training_loop_fsdp.py``): no
  Plackett-Luce term at a step that completes its block, advantages over the unbiased std, the loss divided by
  the number of rows with a non-zero advantage.

Every expected value below is written out from the per-token (per-step) terms, not computed by flowrl.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIGS
from torch import nn

from flowrl.config import DCoLTConfig, DiffuGRPOConfig, MaskedSamplerConfig, UniGRPOConfig, load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.dllm.estimators import EstimatorOutput
from flowrl.objectives.dllm.plackett_luce import ORDERED_DRAW, DCoLTStepLogProb, dcolt_log_probs
from flowrl.samplers.masked import generate
from flowrl.sections import BuildContext


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------ token objectives: aggregation

# Four completions of one prompt, 3, 6, 2 and 5 tokens long (G = 6), rewards 1, 0, 1, 0: d1's advantages
# r - mean are +0.5, -0.5, +0.5, -0.5. Per-token ratios (1 where not listed); clip 0.5 (d1's epsilon):
#   row 0 (A = +0.5): r = [2.0, 1, 1]          terms -A min(r, 1.5)           -0.75, -0.5, -0.5      sum -1.75
#   row 1 (A = -0.5): r = [1, 0.25, 1, 1, 1, 1] terms max(0.5 r, 0.5 clip(r)) 0.5, 0.25, 0.5 x 4     sum  2.75
#   row 2 (A = +0.5): r = [1.2, 1]                                           -0.6, -0.5             sum -1.1
#   row 3 (A = -0.5): r = [1, 1, 1, 1, 1.8]                                  0.5 x 4, 0.9           sum  2.9
# token mean:    (-1.75 + 2.75 - 1.1 + 2.9) / (3 + 6 + 2 + 5)     = 2.8 / 16                   =  0.175
# sequence mean: (-1.75 / 3 + 2.75 / 6 - 1.1 / 2 + 2.9 / 5) / 4   = -0.095 / 4                 = -0.02375
# The two disagree in sign: the long losing completions (6 and 5 tokens) outweigh the short winners.
LENGTHS = [3, 6, 2, 5]
RATIOS = {(0, 0): 2.0, (1, 1): 0.25, (2, 0): 1.2, (3, 4): 1.8}
ADVANTAGES = torch.tensor([0.5, -0.5, 0.5, -0.5])
TOKEN_MEAN, SEQUENCE_MEAN = 2.8 / 16, -0.095 / 4


class FixedEstimator:
    """Returns the same per-token log-probs and weights whatever the model (the contract: 0 where weight is 0)."""

    def __init__(self, log_probs: torch.Tensor, weights: torch.Tensor):
        self.log_probs, self.weights = log_probs, weights

    def __call__(self, lm, batch, seed_index):
        return EstimatorOutput(torch.where(self.weights > 0, self.log_probs, 0.0), self.weights)


def _token_batch(weights_of_row, lengths=LENGTHS):
    """The four completions above: weights per row from ``weights_of_row(counted)``, new log-probs = old + log r."""
    counted = torch.arange(6)[None] < torch.tensor(lengths)[:, None]
    old = torch.where(counted, -1.0 - 0.1 * torch.arange(24.0).view(4, 6), 0.0)
    log_ratio = torch.zeros(4, 6)
    for (b, i), r in RATIOS.items():
        log_ratio[b, i] = math.log(r)
    new = (old + log_ratio).requires_grad_(True)
    batch = SimpleNamespace(
        inner_epoch=0,
        advantages=ADVANTAGES.clone(),
        old_log_probs=old[:, None],
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        completion_ids=torch.zeros(4, 6, dtype=torch.long),
    )
    return batch, new, weights_of_row(counted)


def _loss(config, batch, new, weights, beta_ref=None):
    objective = config.build()
    objective.estimator = FixedEstimator(new, weights)
    if beta_ref is not None:
        batch.ref_log_probs = beta_ref[:, None]
    (out,) = objective.losses(None, None, batch, torch.Generator())
    return out


def test_diffu_grpo_default_is_d1s_mean_over_all_completion_tokens():
    batch, new, weights = _token_batch(lambda counted: counted.float())  # d1: weight 1 per token through EOS
    out = _loss(DiffuGRPOConfig(), batch, new, weights)
    assert out.loss.item() == pytest.approx(TOKEN_MEAN, abs=1e-6)  # 0.175
    out.loss.backward()
    # d loss / d lp = -A r / 16 where unclipped, 0 where clipped (row 0 token 0, row 1 token 1)
    assert new.grad[0, 0] == 0 and new.grad[1, 1] == 0
    assert float(new.grad[0, 1]) == pytest.approx(-0.5 / 16, abs=1e-7)
    assert float(new.grad[3, 4]) == pytest.approx(0.5 * 1.8 / 16, abs=1e-7)
    assert float(new.grad[2, 0]) == pytest.approx(-0.5 * 1.2 / 16, abs=1e-7)

    batch, new, weights = _token_batch(lambda counted: counted.float())
    out = _loss(DiffuGRPOConfig(loss_aggregation="sequence_mean"), batch, new, weights)
    assert out.loss.item() == pytest.approx(SEQUENCE_MEAN, abs=1e-6)  # -0.02375
    out.loss.backward()
    assert float(new.grad[1, 0]) == pytest.approx(0.5 / 6 / 4, abs=1e-7)  # 1/4 per row, 1/6 per token of row 1


def test_equal_lengths_give_the_same_loss_either_way():
    """With every completion 6 tokens long the two aggregations are one number: (sum of the 24 terms) / 24."""
    values = []
    for aggregation in ("token_mean", "sequence_mean"):
        batch, new, weights = _token_batch(lambda counted: counted.float(), lengths=[6, 6, 6, 6])
        values.append(_loss(DiffuGRPOConfig(loss_aggregation=aggregation), batch, new, weights).loss.item())
    # row sums: -0.75 - 0.5 x 5 = -3.25; 2.75; -0.6 - 0.5 x 5 = -3.1; 0.5 x 5 + 0.9 = 3.4  ->  -0.2 / 24
    assert values[0] == pytest.approx(-0.2 / 24, abs=1e-6) and values[1] == pytest.approx(values[0], abs=1e-7)


def test_the_kl_term_is_aggregated_like_the_policy_term():
    """d1 adds beta * k3 to each token's loss before its one token mean. Row 0's tokens sit ln 2 above their
    reference (k3 = exp(d) - d - 1 with d = ref - lp = -ln 2: 0.5 + ln 2 - 1 = 0.193147), the others on it:
    token mean 3 x 0.193147 / 16 = 0.0362151, sequence mean 0.193147 / 4 = 0.0482868."""
    k3 = 0.5 + math.log(2) - 1
    for aggregation, expected in (("token_mean", 3 * k3 / 16), ("sequence_mean", k3 / 4)):
        batch, new, weights = _token_batch(lambda counted: counted.float())
        ref = new.detach().clone()
        ref[0] -= math.log(2)
        out = _loss(DiffuGRPOConfig(beta=0.1, loss_aggregation=aggregation), batch, new, weights, beta_ref=ref)
        assert float(out.metrics["loss/kl"]) == pytest.approx(expected, abs=1e-6)
        policy = TOKEN_MEAN if aggregation == "token_mean" else SEQUENCE_MEAN
        assert out.loss.item() == pytest.approx(policy + 0.1 * expected, abs=1e-6)


def test_unigrpo_default_is_the_mean_per_completion_over_its_masked_tokens():
    """UniGRPO's estimator weighs each masked token 1/|M| (the mean log-prob over the mask). The same terms as
    above, the counted tokens now being the masked ones: sequence_mean (the default) averages each completion's
    masked tokens, then the completions; token_mean pools the 16 masked tokens (it counts tokens, not weights).
    Clip 0.5 here (UniGRPO's default is 0.2) so that the terms are those worked out above."""
    masked_mean_weights = lambda counted: counted.float() / counted.sum(1, keepdim=True)  # noqa: E731
    batch, new, weights = _token_batch(masked_mean_weights)
    assert _loss(UniGRPOConfig(clip_range=0.5), batch, new, weights).loss.item() == pytest.approx(SEQUENCE_MEAN, abs=1e-6)
    batch, new, weights = _token_batch(masked_mean_weights)
    assert _loss(UniGRPOConfig(clip_range=0.5, loss_aggregation="token_mean"), batch, new, weights).loss.item() == pytest.approx(
        TOKEN_MEAN, abs=1e-6
    )


def test_each_objective_defaults_to_its_papers_aggregation():
    assert DiffuGRPOConfig().loss_aggregation == "token_mean"  # d1's compute_loss
    assert UniGRPOConfig().loss_aggregation == "sequence_mean"  # MMaDA's objective: 1/G sum_i of a per-completion mean
    dcolt = DCoLTConfig()
    assert (dcolt.loss_aggregation, dcolt.std, dcolt.block_end_order_term) == ("nonzero_advantage_mean", "unbiased", False)
    for name, expected in (("diffu_grpo", "token_mean"), ("unigrpo", "sequence_mean"), ("dcolt", "nonzero_advantage_mean")):
        assert load_config(CONFIGS / "dllm" / f"{name}.yaml").objective.loss_aggregation == expected
    with pytest.raises(FlowRLError, match="loss_aggregation"):
        load_config(CONFIGS / "dllm" / "dcolt.yaml", ["objective.loss_aggregation=token_mean"])


# ------------------------------------------------------------------------------------- DCoLT: normalisation

# Two prompts of four completions. Rewards [1, 0, 0, 0]: mean 0.25, unbiased std
# sqrt((0.75^2 + 3 x 0.25^2) / 3) = 0.5, so A = 0.75 / 0.5001 = 1.49970006 and -0.25 / 0.5001 = -0.49990002
# (the biased std, 0.4330, would give 1.7316 and -0.5772). Rewards [2, 0, 1, 1]: mean 1, unbiased std
# sqrt(2 / 3) = 0.816497, A = +-1 / 0.816597 = +-1.22459 and exactly 0 for the two rewards at the mean.
A_POS, A_NEG = 0.75 / 0.5001, -0.25 / 0.5001
A_TWO = 1 / (math.sqrt(2 / 3) + 1e-4)


def _dcolt_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0])
    return SimpleNamespace(
        rewards=rewards,
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        completion_ids=torch.zeros(8, 4, dtype=torch.long),
        unmask_step=torch.tensor([[0, 0, 1, 1]]).expand(8, -1),  # two steps, both act in every row
    )


def test_dcolt_advantages_use_the_unbiased_std_as_lladou():
    batch = _dcolt_batch()
    adv = DCoLTConfig().build().advantages(batch)
    expected = [A_POS, A_NEG, A_NEG, A_NEG, A_TWO, -A_TWO, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv[6] == 0 and adv[7] == 0  # exactly: these rows leave the denominator below
    # LLaDOU's training_loop_fsdp.py, transcribed: (rewards - mean) / (rewards.std() + 1e-4) per prompt
    grouped = batch.rewards.view(2, 4)
    lladou = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    torch.testing.assert_close(adv, lladou)
    biased = DCoLTConfig(std="biased").build().advantages(batch)
    assert float(biased[0]) == pytest.approx(0.75 / (math.sqrt(0.1875) + 1e-4), abs=1e-6)  # 1.7316, the old default


def test_dcolt_loss_is_divided_by_the_rows_with_a_non_zero_advantage(monkeypatch):
    """Per-step ratios 1 except row 0 step 0 (1.1, inside clip 0.2) and row 1 step 1 (0.5, clipped to 0.8).
    Per-row means over the 2 steps of -A r (clipped as PPO):
      row 0: (-1.1 A_pos - A_pos) / 2 = -1.05 A_pos     row 1: (-A_neg - 0.8 A_neg) / 2 = -0.9 A_neg
      rows 2, 3: -A_neg                                  rows 4, 5: -A_two, +A_two (cancel); rows 6, 7: 0
    LLaDOU divides the sum by the 6 rows whose advantage is non-zero; sequence_mean by all 8."""
    total = -1.05 * A_POS - 0.9 * A_NEG - 2 * A_NEG  # -1.574685 + 0.449910 + 0.999800 = -0.124975
    for aggregation, count in (("nonzero_advantage_mean", 6), ("sequence_mean", 8)):
        objective = DCoLTConfig(loss_aggregation=aggregation).build()
        batch = objective.prepare(_dcolt_batch())
        batch.old_log_probs = torch.full((8, 2), -3.0)
        new = batch.old_log_probs.clone()
        new[0, 0] += math.log(1.1)
        new[1, 1] += math.log(0.5)
        monkeypatch.setattr(objective, "_log_probs", lambda lm, b, new=new: new)
        (out,) = objective.losses(None, None, batch, torch.Generator())
        assert out.loss.item() == pytest.approx(total / count, abs=1e-6)
    assert total / 6 == pytest.approx(-0.0208292, abs=1e-6)
    # LLaDOU's logprob_loss, transcribed: sum_b sum_s -min(r A, clip(r) A) / steps / valid_samples
    adv = torch.tensor([A_POS, A_NEG, A_NEG, A_NEG, A_TWO, -A_TWO, 0.0, 0.0])
    r = torch.exp(new - batch.old_log_probs)
    terms = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None])
    assert float((terms / 2 / (adv != 0).sum()).sum()) == pytest.approx(total / 6, abs=1e-6)


# --------------------------------------------------------------------------------- DCoLT: the block's last step

SCORES = torch.tensor([[0.0, 1.0, 2.0, 3.0]])


def _step(chosen, eligible, block_end_order_term, vocabulary=3):
    """One step's log-prob under SCORES; uniform token logits, so every chosen token adds log(1 / vocabulary)."""
    logits, targets = torch.zeros(1, 4, vocabulary), torch.zeros(1, 4, dtype=torch.long)
    return float(DCoLTStepLogProb(block_end_order_term)(logits, SCORES, targets, chosen, eligible))


def test_a_step_that_completes_its_block_has_no_order_term():
    """Positions 2 and 3 remain in the block and the step takes both, 3 first. LLaDOU: the step's log-prob is its
    two tokens', 2 log(1/3) = -2.197225; with a one-word vocabulary (token log-probs exactly 0) it is exactly 0.
    The ordered draw adds 3 - log(e^2 + e^3) + 0 = -log(1 + e^-1) = -0.313262 for an order the step does not act on."""
    chosen, eligible = torch.tensor([[3, 2]]), torch.tensor([[False, False, True, True]])
    assert _step(chosen, eligible, False, vocabulary=1) == 0.0
    assert _step(chosen, eligible, True, vocabulary=1) == pytest.approx(-math.log(1 + math.exp(-1)), abs=1e-6)
    assert _step(chosen, eligible, False) == pytest.approx(2 * math.log(1 / 3), abs=1e-6)
    assert _step(chosen, eligible, True) == pytest.approx(2 * math.log(1 / 3) - math.log(1 + math.exp(-1)), abs=1e-6)
    # A step that leaves positions masked keeps its Plackett-Luce term either way:
    # 3 - log(1 + e + e^2 + e^3) + 2 - log(1 + e + e^2) = -0.440190 - 0.407606
    partial = torch.tensor([[True, True, True, True]])
    expected = 3 - math.log(sum(math.exp(k) for k in range(4))) + 2 - math.log(sum(math.exp(k) for k in range(3)))
    assert expected == pytest.approx(-0.847796, abs=1e-6)
    for keep in (False, True):
        assert _step(chosen, partial, keep, vocabulary=1) == pytest.approx(expected, abs=1e-6)


def test_the_order_term_flowrl_used_to_add_at_a_block_end_is_log_one_over_k_factorial():
    """With 8 positions left and equal scores, the recorded order of the 8 has probability 1 / 8!: -10.6046 nats."""
    logits, targets = torch.zeros(1, 8, 3), torch.zeros(1, 8, dtype=torch.long)
    chosen, eligible = torch.tensor([[5, 2, 7, 0, 1, 6, 3, 4]]), torch.ones(1, 8, dtype=torch.bool)
    tokens = 8 * math.log(1 / 3)
    assert float(ORDERED_DRAW(logits, torch.zeros(1, 8), targets, chosen, eligible)) == pytest.approx(tokens - math.log(40320), abs=1e-5)
    assert float(DCoLTStepLogProb(False)(logits, torch.zeros(1, 8), targets, chosen, eligible)) == pytest.approx(tokens, abs=1e-6)


class TableLM(nn.Module):
    """Context-free masked LM: position j's logits are row j of a table, whatever the input."""

    mask_token_id, eos_token_id = 5, None

    def __init__(self, P: int = 3, G: int = 8):
        super().__init__()
        self.table = nn.Parameter(torch.randn(P + G, 6, generator=torch.Generator().manual_seed(0)))
        self.table.data[:, 5] = -30.0  # the mask token is never a target

    def logits(self, input_ids, attention_mask=None):
        return self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)


def test_objective_replays_sampled_trajectories_without_the_block_end_order_term():
    """A real rollout (8 tokens, 4 steps, blocks of 4: steps 1 and 3 finish a block) under a fixed-score head.
    The objective's log-probs equal the exact ordered-draw log-probs at steps 0 and 2, and at steps 1 and 3
    equal the two tokens' log-probs alone (their order term is gone); the difference there is the hand order term."""
    lm, P, G = TableLM(), 3, 8
    fixed = torch.tensor([0.3, -1.0, 2.0, 0.5, 1.5, 0.0, -0.5, 1.0])
    traj = generate(
        lm,
        torch.zeros(6, P, dtype=torch.long),
        torch.ones(6, P, dtype=torch.bool),
        G,
        4,
        4,
        temperature=1.0,
        remasking="policy",
        position_scorer=lambda logits, state: fixed.expand(state.shape[0], -1),
        generator=torch.Generator().manual_seed(3),
    )
    objective = DCoLTConfig().build(BuildContext({}, MaskedSamplerConfig(gen_length=G, steps=4, block_length=4, remasking="policy"), lm))
    objective.head = lambda state, logits, step=None, mask_token_id=None: fixed.expand(state.shape[0], -1)
    with torch.no_grad():
        ours = objective._log_probs(lm, traj)
        exact = dcolt_log_probs(lm, objective._scorer, traj, block_length=4)
    torch.testing.assert_close(ours[:, [0, 2]], exact[:, [0, 2]])
    token_lp = torch.log_softmax(lm.table[P:].detach(), -1)[torch.arange(G), traj.completion_ids]  # (B, G)
    for s in (1, 3):
        here = traj.unmask_step == s
        torch.testing.assert_close(ours[:, s], (token_lp * here).sum(1))
        for b in range(6):  # the two positions of the step, in draw order: s_a - log(e^s_a + e^s_b)
            first, second = sorted(here[b].nonzero().flatten().tolist(), key=lambda j: int(traj.unmask_rank[b, j]))
            sa, sb = float(fixed[first]), float(fixed[second])
            order_term = sa - math.log(math.exp(sa) + math.exp(sb))
            assert float(exact[b, s] - ours[b, s]) == pytest.approx(order_term, abs=1e-5)
