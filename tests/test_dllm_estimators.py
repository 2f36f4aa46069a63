"""dLLM log-likelihood estimators and DCoLT's Plackett-Luce action log-prob (docs/math.md section 6).

Oracles: a CONTEXT-FREE toy masked LM (each position's logits depend only on the position) has the exact
log-likelihood ``sum_i log p_i(x_i)`` and, whatever is masked, each masked position predicts with p_i, so
the estimators' expectations are known in closed form:
- ELBO (every MC term, at any mask count l): ``E[(G/l) sum_{i in M} lp_i] = sum_i lp_i`` = exact.
- Coupled (weights 1/(2t), 1/(2(1-t))): E = exact.
- AnswerMask (mean over masked tokens): E = exact / G (a per-token average).
- OneStep and TrajectoryReplay: deterministic and equal to exact.
A small seeded bidirectional transformer checks the determinism contract (same seed -> identical output,
ratio exactly 1) and a test-only DCoLT sampler checks the exact replay of recorded action log-probs.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from flowrl.errors import FlowRLError
from flowrl.objectives.dllm.estimators import (
    AnswerMaskEstimator,
    CoupledEstimator,
    ELBOEstimator,
    OneStepEstimator,
    TrajectoryReplayEstimator,
)
from flowrl.objectives.dllm.plackett_luce import dcolt_log_probs, plackett_luce_log_prob
from flowrl.types import TokenTrajectory

P, G, V = 5, 12, 10  # prompt length, completion length, vocabulary incl. the mask token
PAD, EOS, MASK = 0, 1, V - 1  # the LMs below output V - 1 classes: the mask token is never a target
OUT = V - 1


class ContextFreeLM(nn.Module):
    """Logits at position j are a table row: p(x | anything) = prod_i p_i(x_i) exactly."""

    mask_token_id = MASK

    def __init__(self, seed: int = 0, eos_token_id: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(1.5 * torch.randn(P + G, OUT, generator=g))
        self.model, self.tokenizer, self.eos_token_id = self, None, eos_token_id
        self.inputs: list[torch.Tensor] = []

    def logits(self, input_ids, attention_mask=None):
        self.inputs.append(input_ids.clone())
        return self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)

    def exact(self, completion_ids):
        lp = torch.log_softmax(self.table[P:].double(), -1)
        return lp[torch.arange(G), completion_ids].sum(-1)  # (B,)


class TinyMaskedLM(nn.Module):
    """A seeded 2-layer bidirectional transformer implementing MaskedLM. Kept in train mode with dropout 0:
    eval mode would switch nn.TransformerEncoder to its fused fast path under no_grad only, i.e. a
    different kernel for the old (no_grad) and new (grad) policy, exactly the r != 1 cause docs/math.md section 3 lists."""

    mask_token_id, eos_token_id = MASK, EOS

    def __init__(self, seed: int = 0, d: int = 32):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.emb, self.pos = nn.Embedding(V, d), nn.Parameter(0.5 * torch.randn(P + G, d))
            layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, OUT)
        self.model, self.tokenizer = self, None

    def logits(self, input_ids, attention_mask=None):
        h = self.emb(input_ids) + self.pos[: input_ids.shape[1]]
        pad = None if attention_mask is None else attention_mask == 0
        return self.head(self.encoder(h, src_key_padding_mask=pad))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: intra-op threads only add synchronisation (100x slower on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_traj(B: int, seed: int, num_steps: int = 4, num_seeds: int = 3, eos_tail: bool = False) -> TokenTrajectory:
    """Random left-padded prompts, random completions and unmasking orders, random mask seeds."""
    g = torch.Generator().manual_seed(seed)
    n_pad = torch.randint(0, P - 1, (B,), generator=g)
    prompt_mask = torch.arange(P)[None] >= n_pad[:, None]
    prompt_ids = torch.where(prompt_mask, torch.randint(2, OUT, (B, P), generator=g), PAD)
    completion = torch.randint(2, OUT, (B, G), generator=g)
    if eos_tail:  # LLaDA-style EOS filler after a random length
        length = torch.randint(1, G, (B,), generator=g)
        completion = torch.where(torch.arange(G)[None] >= length[:, None], EOS, completion)
    order = torch.stack([torch.randperm(G, generator=g) for _ in range(B)])
    rank = order.argsort(1)
    return TokenTrajectory(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion,
        unmask_step=rank * num_steps // G,
        unmask_rank=rank,
        token_log_probs=torch.zeros(B, G),
        num_steps=num_steps,
        prompts=[""] * B,
        metadata=[{}] * B,
        group_ids=torch.arange(B),
        mask_seeds=torch.randint(0, 2**62, (B, num_seeds), generator=g),
    )


def z_score(estimates: torch.Tensor, target: torch.Tensor) -> float:
    d = estimates.detach().double() - target.detach().double()
    assert d.std() > 0, "a stochastic estimator returned a constant: the test would prove nothing"
    return float(d.mean() / (d.std() / math.sqrt(d.numel())))


# ------------------------------------------------------------------ expectations in the context-free toy

N_ROWS = 2000  # rows are iid draws (one mask seed each), so the row mean is a 2000-sample MC average


@pytest.mark.parametrize("stratified", [True, False])
def test_elbo_is_unbiased_for_context_free_model(stratified):
    lm, traj = ContextFreeLM(), make_traj(N_ROWS, seed=1)
    est = ELBOEstimator(num_samples=4, stratified=stratified)
    with torch.no_grad():
        seq = est(lm, traj, 0).sequence_log_prob()
        terms = list(est.terms(lm, traj, 0))
    exact = lm.exact(traj.completion_ids)
    assert abs(z_score(seq, exact)) < 4
    term_seq = torch.stack([t.sequence_log_prob() for t in terms])  # (n, B)
    torch.testing.assert_close(term_seq.mean(0), seq, atol=1e-4, rtol=1e-5)
    for j, t in enumerate(terms):  # every single MC term is unbiased on its own
        assert abs(z_score(term_seq[j], exact)) < 4
        count = (t.weights > 0).sum(1)
        torch.testing.assert_close(t.weights.sum(1), torch.full((N_ROWS,), float(G)))  # l * (G / l)
        if stratified:  # l_j = ceil(G (j + u) / n) lies in stratum j
            assert (count >= max(1, math.ceil(G * j / 4))).all() and (count <= math.ceil(G * (j + 1) / 4)).all()


def test_coupled_is_unbiased_and_answer_mask_estimates_the_per_token_mean():
    lm, traj = ContextFreeLM(), make_traj(N_ROWS, seed=2)
    exact = lm.exact(traj.completion_ids)
    with torch.no_grad():
        coupled = CoupledEstimator()(lm, traj, 0)
        answer = AnswerMaskEstimator(0.1, 0.9)(lm, traj, 0)
    assert (coupled.weights > 0).all()  # every token is scored once, by the pass that masked it
    assert abs(z_score(coupled.sequence_log_prob(), exact)) < 4
    torch.testing.assert_close(answer.weights.sum(1), torch.ones(N_ROWS))  # a mean over the masked tokens
    masked_frac = (answer.weights > 0).float().mean(1)
    assert abs(float(masked_frac.mean()) - 0.5) < 0.02 and masked_frac.min() > 0  # r ~ U[0.1, 0.9], >= 1
    assert abs(z_score(answer.sequence_log_prob(), exact / G)) < 4


def test_one_step_and_replay_are_exact_for_context_free_model():
    lm, traj = ContextFreeLM(), make_traj(8, seed=3)
    exact = lm.exact(traj.completion_ids).float()
    with torch.no_grad():
        for est in (OneStepEstimator(0.15), TrajectoryReplayEstimator(1)):
            torch.testing.assert_close(est(lm, traj, 0).sequence_log_prob(), exact)


# ------------------------------------------------------------------ determinism contract (real transformer)

ESTIMATORS = [
    OneStepEstimator(0.15),
    AnswerMaskEstimator(0.1, 0.9),
    CoupledEstimator(),
    ELBOEstimator(num_samples=3),
    TrajectoryReplayEstimator(1),
]


@pytest.mark.parametrize("est", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_same_seed_identical_and_ratio_exactly_one(est):
    lm, traj = TinyMaskedLM(), make_traj(6, seed=4, eos_tail=True)
    with torch.no_grad():  # old policy, scored right after the rollout
        old = est(lm, traj, 1)
    new = est(lm, traj, 1)  # new policy at unchanged weights, with grad
    assert old.token_log_probs.dtype == old.weights.dtype == torch.float32
    assert torch.equal(old.weights, new.weights) and torch.equal(old.token_log_probs, new.token_log_probs.detach())
    assert torch.equal(torch.exp(new.token_log_probs - old.token_log_probs), torch.ones(6, G))
    assert torch.equal(torch.exp(new.sequence_log_prob() - old.sequence_log_prob()), torch.ones(6))
    new.sequence_log_prob().sum().backward()
    assert lm.head.weight.grad.abs().sum() > 0
    if not isinstance(est, TrajectoryReplayEstimator):  # the only deterministic one
        other = est(lm, traj, 2)
        assert not (torch.equal(other.weights, new.weights) and torch.equal(other.token_log_probs, new.token_log_probs))
    with torch.no_grad():  # a row's masks do not depend on the batch it is scored in
        sub = est(lm, traj[[1, 4]], 1)
    assert torch.equal(sub.weights, old.weights[[1, 4]])
    torch.testing.assert_close(sub.token_log_probs, old.token_log_probs[[1, 4]], atol=1e-5, rtol=1e-5)


def test_elbo_terms_backpropagated_one_at_a_time_match_the_average():
    """BGPO: backpropagating each MC term on its own gives the averaged estimator's gradient."""
    traj = make_traj(4, seed=5)
    lm_a, lm_b = TinyMaskedLM(), TinyMaskedLM()
    est = ELBOEstimator(num_samples=3)
    est(lm_a, traj, 0).sequence_log_prob().sum().backward()
    for term in est.terms(lm_b, traj, 0):
        (term.sequence_log_prob().sum() / est.num_samples).backward()
    for pa, pb in zip(lm_a.parameters(), lm_b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-5, rtol=1e-4)


def test_missing_or_out_of_range_seeds_raise():
    lm, traj = ContextFreeLM(), make_traj(2, seed=6)
    with pytest.raises(FlowRLError):
        AnswerMaskEstimator(0.1, 0.9)(lm, traj, 3)
    traj.mask_seeds = None
    with pytest.raises(FlowRLError):
        ELBOEstimator()(lm, traj, 0)


# ------------------------------------------------------------------ d1 masking


def test_d1_masks_whole_completion_and_15_percent_of_real_prompt_tokens():
    lm, traj = ContextFreeLM(), make_traj(N_ROWS, seed=7)
    with torch.no_grad():
        OneStepEstimator(0.15)(lm, traj, 0)
    (seen,) = lm.inputs
    prompt_seen, completion_seen = seen[:, :P], seen[:, P:]
    assert (completion_seen == MASK).all()
    assert (prompt_seen[~traj.prompt_mask] == PAD).all()  # padding is never masked
    real = traj.prompt_mask
    assert (prompt_seen[real & (prompt_seen != MASK)] == traj.prompt_ids[real & (prompt_seen != MASK)]).all()
    rate, n = float((prompt_seen[real] == MASK).float().mean()), int(real.sum())
    assert abs(rate - 0.15) < 4 * math.sqrt(0.15 * 0.85 / n)


def test_d1_pad_after_eos_weights():
    lm, traj = ContextFreeLM(eos_token_id=EOS), make_traj(2, seed=8)
    traj.completion_ids[0, 3:] = EOS  # row 0: EOS at 3 then filler; row 1: no EOS at all
    traj.completion_ids[1] = traj.completion_ids[1].clamp(min=2)
    with torch.no_grad():
        out = OneStepEstimator(0.15)(lm, traj, 0)
        full = OneStepEstimator(0.15, pad_after_eos=False)(lm, traj, 0)
    assert out.weights[0].tolist() == [1.0] * 4 + [0.0] * (G - 4) and (out.weights[1] == 1).all()
    assert (out.token_log_probs[0, 4:] == 0).all() and (full.weights == 1).all()


# ------------------------------------------------------------------ Plackett-Luce


def _by_hand(scores: list[float], order: tuple[int, ...], pool: list[int]) -> float:
    """Product of sequential softmax probabilities (drawing without replacement)."""
    p, left = 1.0, list(pool)
    for c in order:
        p *= math.exp(scores[c]) / sum(math.exp(scores[j]) for j in left)
        left.remove(c)
    return p


@pytest.mark.parametrize("pool", [[0, 1, 2, 3], [0, 2, 3, 5]])
def test_plackett_luce_equals_sequential_sampling_without_replacement(pool):
    s = torch.randn(6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    eligible = torch.zeros(6, dtype=torch.bool)
    eligible[pool] = True
    for k in (1, 2, 3, 4):
        orders = list(itertools.permutations(pool, k))
        lp = plackett_luce_log_prob(s.expand(len(orders), -1), torch.tensor(orders), eligible.expand(len(orders), -1))
        assert lp.dtype == torch.float64 and abs(float(lp.exp().sum()) - 1) < 1e-12
        hand = torch.tensor([_by_hand(s.tolist(), o, pool) for o in orders], dtype=torch.float64)
        torch.testing.assert_close(lp.exp(), hand, atol=1e-13, rtol=1e-12)


def test_plackett_luce_padding_and_invalid_choices():
    s = torch.randn(2, 5, generator=torch.Generator().manual_seed(10), requires_grad=True)
    eligible = torch.ones(2, 5, dtype=torch.bool)
    padded = plackett_luce_log_prob(s, torch.tensor([[3, -1], [-1, -1]]), eligible)
    torch.testing.assert_close(padded[0], plackett_luce_log_prob(s[:1], torch.tensor([[3]]), eligible[:1])[0])
    assert padded[1] == 0
    padded.sum().backward()
    assert torch.isfinite(s.grad).all() and (s.grad[1] == 0).all()
    with pytest.raises(ValueError):
        plackett_luce_log_prob(s, torch.tensor([[1, 1], [0, 2]]), eligible)  # chosen twice
    with pytest.raises(ValueError):
        plackett_luce_log_prob(s, torch.tensor([[1], [0]]), eligible & (torch.arange(5) != 1))  # not eligible


def test_plackett_luce_matches_gumbel_top_k_frequencies():
    g = torch.Generator().manual_seed(11)
    s, n = torch.randn(4, generator=g, dtype=torch.float64), 20000
    gumbel = -torch.log(-torch.log(torch.rand(n, 4, generator=g, dtype=torch.float64).clamp(min=1e-300)))
    top = (s + gumbel).topk(3, dim=1).indices  # ordered: an exact Plackett-Luce draw
    eligible = torch.ones(1, 4, dtype=torch.bool)
    for k in (2, 3):
        codes = (top[:, :k] * torch.tensor([4**i for i in range(k)])).sum(1)
        freq = torch.bincount(codes, minlength=4**k).double() / n
        for order in itertools.permutations(range(4), k):
            p = float(plackett_luce_log_prob(s[None], torch.tensor([order]), eligible).exp())
            code = sum(c * 4**i for i, c in enumerate(order))
            assert abs(float(freq[code]) - p) < 4.5 * math.sqrt(p * (1 - p) / n), (order, float(freq[code]), p)


# ------------------------------------------------------------------ DCoLT replay of a recorded trajectory


class ToyScorer(nn.Module):
    """An unmasking policy: confidence, a per-position bias and the step."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(G, generator=torch.Generator().manual_seed(12)))
        self.a = nn.Parameter(torch.tensor(3.0))

    def forward(self, state, logits, step):
        return self.a * logits.float().softmax(-1).max(-1).values + self.bias + 0.1 * step


@torch.no_grad()
def sample_dcolt(lm, scorer, traj, block_length=4, per_step=2):
    """A test-only DCoLT sampler: Gumbel-top-k positions in the current block, tokens from the softmax.
    Returns the recorded trajectory and each step's action log-prob computed by hand while sampling."""
    B, g, steps = traj.prompt_ids.shape[0], torch.Generator().manual_seed(13), G // per_step
    rows, state = torch.arange(B), torch.full((B, G), MASK)
    step_of, rank_of = torch.zeros(B, G, dtype=torch.long), torch.zeros(B, G, dtype=torch.long)
    token_lp, step_lp = torch.zeros(B, G), torch.zeros(B, steps)
    attn = torch.cat([traj.prompt_mask.long(), torch.ones(B, G, dtype=torch.long)], 1)
    for s in range(steps):
        logits = lm.logits(torch.cat([traj.prompt_ids, state], 1), attn)[:, P:]
        scores = scorer(state, logits, s)
        available = (state == MASK) & (torch.arange(G) // block_length == s * per_step // block_length)[None]
        noisy = scores - torch.log(-torch.log(torch.rand(B, G, generator=g).clamp(min=1e-20)))
        for j, c in enumerate(noisy.masked_fill(~available, float("-inf")).topk(per_step, dim=1).indices.T):
            step_lp[:, s] += scores.masked_fill(~available, float("-inf")).softmax(1)[rows, c].log()
            available[rows, c] = False
            probs = logits[rows, c].float().softmax(-1)
            tok = torch.multinomial(probs, 1, generator=g).squeeze(1)
            token_lp[rows, c] = probs[rows, tok].log()
            step_lp[:, s] += token_lp[rows, c]
            state[rows, c], step_of[rows, c], rank_of[rows, c] = tok, s, s * per_step + j
    traj.completion_ids, traj.unmask_step, traj.unmask_rank = state, step_of, rank_of
    traj.token_log_probs, traj.num_steps = token_lp, steps
    return traj, step_lp


def test_dcolt_replay_reproduces_the_sampled_action_log_probs():
    lm, scorer = TinyMaskedLM(), ToyScorer()
    traj, recorded = sample_dcolt(lm, scorer, make_traj(5, seed=14))
    replayed = dcolt_log_probs(lm, scorer, traj, block_length=4)
    assert replayed.shape == (5, traj.num_steps)
    torch.testing.assert_close(replayed, recorded, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(dcolt_log_probs(lm, scorer, traj, block_length=None), recorded, atol=1e-3)
    tokens = TrajectoryReplayEstimator(1)(lm, traj, 0)  # the token half alone is TraceRL's replay
    torch.testing.assert_close(tokens.token_log_probs, traj.token_log_probs, atol=1e-5, rtol=1e-5)
    replayed.sum().backward()
    assert scorer.bias.grad.abs().sum() > 0 and lm.head.weight.grad.abs().sum() > 0
