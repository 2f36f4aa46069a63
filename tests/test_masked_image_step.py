"""The masked-image step's log-prob (``sampler.name: masked_image``, AmusedScheduler's rule) against the enumerated true
probability of a step's outcome on a tiny vocabulary: every draft vector summed over, the Gumbel choice as its
Plackett-Luce law (the top-m set of Gumbel-perturbed logits is drawn without replacement in proportion to exp(w),
summed over the orders of the set), so the reference shares no code with the sampler's 1-D integral. The sampler's own
draws (the pipeline's rule, bit for bit AmusedPipeline's: tests/test_family_amused.py) land on the outcomes at those
frequencies; the former score (the committed tokens alone) does not describe them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flowrl.samplers import masked_image
from flowrl.samplers.masked_image import MaskedImageSampler, keep_masked

pytestmark = pytest.mark.usefixtures("one_thread")

V = 3
MASK = V  # the mask token id sits after the vocabulary, as aMUSEd's does


def sampler(choice_temperature=(2.0, 0.0), score="step") -> MaskedImageSampler:
    return MaskedImageSampler(MASK, "cosine", 1.0, choice_temperature, score=score)


def tiny_step(length: int, unmasked: int, steps: int, i: int, seed: int):
    """Random logits (1, L, V), a state with the first ``unmasked`` positions already committed, and step i of N."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(1, length, V, generator=gen)
    x = torch.full((1, length), float(MASK))
    x[0, :unmasked] = torch.randint(V, (unmasked,), generator=gen).float()
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    return logits, x, sigmas[i], sigmas[i + 1]


def plackett_luce_set(w: torch.Tensor, chosen: tuple[int, ...]) -> torch.Tensor:
    """P(the top-|chosen| of w + Gumbel is the set ``chosen``) for each row of w (D, M): sum over its orders of
    prod exp(w_pick) / sum over the not yet picked exp(w)."""
    total = torch.zeros(w.shape[0], dtype=w.dtype)
    for order in itertools.permutations(chosen):
        left, prob = list(range(w.shape[1])), torch.ones(w.shape[0], dtype=w.dtype)
        for j in order:
            prob = prob * w[:, j].exp() / w[:, left].exp().sum(-1)
            left.remove(j)
        total = total + prob
    return total


def enumerated_outcomes(logits: torch.Tensor, x: torch.Tensor, steps: int, i: int, tau: float) -> dict:
    """{(committed positions, their tokens): probability}: every draft of every masked position, the choice's law."""
    log_p = logits[0].double().log_softmax(-1)
    masked = [j for j in range(x.shape[1]) if x[0, j] == MASK]
    count = int(keep_masked("cosine", i, steps, x.shape[1]).clamp(1, len(masked) - 1))
    commit = len(masked) - count
    drafts = torch.tensor(list(itertools.product(range(V), repeat=len(masked))))  # (V^M, M)
    lp = log_p[masked][torch.arange(len(masked)), drafts]  # (V^M, M) log p of each drafted token
    prob_drafts = lp.sum(-1).exp()
    outcomes: dict = {}
    for chosen in itertools.combinations(range(len(masked)), commit):
        if tau > 0:
            p_choice = plackett_luce_set(lp / tau, chosen)
        else:  # the plain ranking: C is the m most confident drafts
            p_choice = (lp.argsort(-1, descending=True)[:, :commit].sort(-1).values == torch.tensor(chosen)).all(-1).double()
        for d in range(len(drafts)):
            key = (tuple(masked[c] for c in chosen), tuple(int(drafts[d, c]) for c in chosen))
            outcomes[key] = outcomes.get(key, 0.0) + prob_drafts[d] * p_choice[d]
    return outcomes


def outcome_states(x: torch.Tensor, keys) -> torch.Tensor:
    nxt = x.repeat(len(keys), 1)
    for row, (positions, tokens) in enumerate(keys):
        nxt[row, list(positions)] = torch.tensor(tokens, dtype=nxt.dtype)
    return nxt


CASES = [  # (L, already unmasked, N, i, choice temperature): 2 of 6, 1 of 5, 3 of 4, 1 of 4 and 2 of 6 committed
    (6, 0, 4, 1, (2.0, 0.0)),
    (5, 0, 8, 0, (2.0, 0.0)),
    (5, 1, 4, 2, (2.0, 0.0)),
    (6, 2, 6, 2, (0.6, 0.1)),
    (6, 0, 4, 1, (0.0, 0.0)),
]


@pytest.mark.parametrize("length, unmasked, steps, i, temps", CASES)
def test_recorded_log_prob_is_the_enumerated_probability_of_the_outcome(length, unmasked, steps, i, temps):
    """Every possible outcome of the step: the recorded log-prob (sampling and re-scoring share it) equals the log of
    its enumerated probability, and those probabilities sum to 1."""
    logits, x, sigma, sigma_next = tiny_step(length, unmasked, steps, i, seed=length + 10 * i + unmasked)
    tau = float(torch.linspace(*temps, steps)[i])
    outcomes = enumerated_outcomes(logits, x, steps, i, tau)
    assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-12)
    keys = [k for k, p in outcomes.items() if p > 0]
    nxt = outcome_states(x, keys)
    recorded = sampler(temps).log_prob(logits.expand(len(keys), -1, -1), x.expand(len(keys), -1), nxt, sigma, sigma_next)
    truth = torch.stack([outcomes[k] for k in keys]).log()
    assert torch.allclose(recorded.double(), truth, atol=2e-5), (recorded.double() - truth).abs().max()


def test_gradient_is_the_enumerated_probabilitys():
    """The policy gradient reads d log pi / d logits: the sampler's (autograd through the integral) equals the
    enumerated probability's, for a committed set and for the tokens."""
    logits, x, sigma, sigma_next = tiny_step(6, 0, 4, 1, seed=3)
    tau = float(torch.linspace(2.0, 0.0, 4)[1])
    exact = logits.double().requires_grad_()
    outcomes = enumerated_outcomes(exact, x, 4, 1, tau)
    key = max(outcomes, key=lambda k: float(outcomes[k].detach()))
    (want,) = torch.autograd.grad(outcomes[key].log(), exact)
    mine = logits.clone().requires_grad_()
    (got,) = torch.autograd.grad(sampler().log_prob(mine, x, outcome_states(x, [key]), sigma, sigma_next).sum(), mine)
    assert want.abs().max() > 0.1 and torch.allclose(got.double(), want, atol=2e-5)


def test_node_chunks_do_not_change_the_value_or_the_gradient(monkeypatch):
    """The integral evaluated a few nodes at a time (recomputed in backward, for aMUSEd's large vocabulary) is the
    same number and gradient as in one piece."""
    logits, x, sigma, sigma_next = tiny_step(6, 0, 4, 1, seed=5)
    nxt = outcome_states(x, [((1, 4), (0, 2))])

    def value_and_grad():
        leaf = logits.clone().requires_grad_()
        value = sampler().log_prob(leaf, x, nxt, sigma, sigma_next)
        return value.detach(), torch.autograd.grad(value.sum(), leaf)[0]

    whole = value_and_grad()
    monkeypatch.setattr(masked_image, "NODE_CHUNK_ELEMENTS", 6 * V * 7)  # 7 nodes a chunk
    chunked = value_and_grad()
    assert torch.allclose(whole[0], chunked[0], atol=1e-6) and torch.allclose(whole[1], chunked[1], atol=1e-6)


def test_the_pipelines_rule_draws_outcomes_at_the_enumerated_frequencies():
    """40,000 draws of the step by the sampler's own rule (AmusedScheduler's): every outcome's frequency is within 5
    standard errors of its enumerated probability. The former score, which takes C as given and the committed tokens
    as softmax draws, misses the frequencies of the tokens given C by many standard errors."""
    logits, x, sigma, sigma_next = tiny_step(6, 0, 4, 1, seed=7)
    outcomes = enumerated_outcomes(logits, x, 4, 1, float(torch.linspace(2.0, 0.0, 4)[1]))
    n = 40_000
    draws = sampler()._advance(logits.expand(n, -1, -1), x.expand(n, -1), sigma, sigma_next, torch.Generator().manual_seed(0), False)
    committed = (draws != MASK).nonzero()
    keys = [(tuple(p.tolist()), tuple(int(draws[r, c]) for c in p)) for r, p in enumerate(committed[:, 1].view(n, 2))]
    counts: dict = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(outcomes)
    z = [abs(counts.get(k, 0) / n - float(p)) / math.sqrt(float(p) * (1 - float(p)) / n) for k, p in outcomes.items() if p > 1e-4]
    assert max(z) < 5.0
    former, listed = sampler(score="committed_tokens"), list(outcomes)
    nxt = outcome_states(x, listed)
    tokens_only = former.log_prob(logits.expand(len(nxt), -1, -1), x.expand(len(nxt), -1), nxt, sigma, sigma_next).double().exp()
    worst = 0.0
    for positions in {k[0] for k in outcomes}:
        rows = [r for r, k in enumerate(listed) if k[0] == positions]
        seen = sum(counts.get(listed[r], 0) for r in rows)
        for r in rows:  # P(x_C | C) as the former score reads it (the softmax) against the draws given C
            p = float(tokens_only[r])
            worst = max(worst, abs(counts.get(listed[r], 0) / seen - p) / math.sqrt(p * (1 - p) / seen))
    assert worst > 10.0


def test_last_step_and_former_score_are_the_committed_tokens():
    """The last step commits every masked position (P(C) = 1): its log-prob is the tokens' alone under both scores;
    ``score='committed_tokens'`` is that sum at every step."""
    logits, x, _, _ = tiny_step(5, 1, 4, 3, seed=11)
    nxt = x.clone()
    nxt[0, 1:] = torch.tensor([2.0, 0.0, 1.0, 1.0])
    by_hand = logits[0].double().log_softmax(-1)[torch.arange(1, 5), nxt[0, 1:].long()].sum()
    sigmas = torch.linspace(1.0, 0.0, 5)
    for score in ("step", "committed_tokens"):
        assert float(sampler(score=score).log_prob(logits, x, nxt, sigmas[3], sigmas[4])) == pytest.approx(float(by_hand), abs=1e-5)
    mid = x.clone()
    mid[0, 2] = 1.0
    former = sampler(score="committed_tokens").log_prob(logits, x, mid, sigmas[1], sigmas[2])
    assert float(former) == pytest.approx(float(logits[0, 2].double().log_softmax(-1)[1]), abs=1e-6)
    assert float(sampler().log_prob(logits, x, mid, sigmas[1], sigmas[2])) < float(former)  # log P(C | x_C) < 0
