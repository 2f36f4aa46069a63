"""The LLaDA-style masked-diffusion sampler: schedule, block discipline, exact replay, and the
distributions of its three random choices (Gumbel token sampling, random and Plackett-Luce positions)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from flowrl.samplers.masked import decode_completions, generate, gumbel_sample, shift_logits, transfer_schedule

VOCAB = 16
MASK = VOCAB - 1
EOS = VOCAB - 2


class TinyBidirectional(nn.Module):
    """Token + position embeddings, a 2-layer bidirectional transformer encoder, a linear head."""

    def __init__(self, seed: int = 0, d: int = 32, max_len: int = 32, sharpness: float = 1.0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.tok = nn.Embedding(VOCAB, d)
            # Without positions every masked slot would get identical logits and all choices would tie.
            self.pos = nn.Embedding(max_len, d)
            layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            self.head = nn.Linear(d, VOCAB)
            self.head.weight.data.mul_(sharpness)
        self.eval()

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(self.encoder(h, src_key_padding_mask=~attention_mask.bool()))


class TinyLM:
    """A test-local MaskedLM around any module mapping (ids, attention_mask) -> logits."""

    tokenizer = None
    mask_token_id = MASK
    eos_token_id = EOS

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls = 0

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        return self.model(input_ids, attention_mask)

    def reference(self):
        return contextlib.nullcontext()

    def trainable_parameters(self):
        return list(self.model.parameters())


class ConstantModel(nn.Module):
    """Logits that ignore the input (the same table for every row)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table  # (L, V)

    def forward(self, ids, attention_mask):
        return self.table[: ids.shape[1]].expand(ids.shape[0], -1, -1)


def prompts(batch: int = 3, length: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts (B, P) and their bool mask; row b has b padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, EOS, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b in range(batch):
        mask[b, : min(b, length - 1)] = False
    return torch.where(mask, ids, EOS), mask


def replay_logits(lm: TinyLM, traj, step: int) -> torch.Tensor:
    """Completion logits (B, G, V) the model gives the state before ``step``."""
    state = traj.state_at(step, MASK)
    ids = torch.cat([traj.prompt_ids, state], dim=1)
    attn = torch.cat([traj.prompt_mask, torch.ones_like(state, dtype=torch.bool)], dim=1)
    return lm.logits(ids, attn)[:, traj.prompt_ids.shape[1] :]


# (1) --------------------------------------------------------------------------------------------


def test_transfer_schedule():
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert transfer_schedule(8, 4) == [2, 2, 2, 2]
    assert transfer_schedule(2, 4) == [1, 1, 0, 0]
    for n in range(30):
        for steps in range(1, 9):
            sched = transfer_schedule(n, steps)
            assert len(sched) == steps and sum(sched) == n
            assert sched == sorted(sched, reverse=True) and max(sched) - min(sched) <= 1


# (2) --------------------------------------------------------------------------------------------


def _scorer(logits: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    assert logits.shape[:2] == state.shape and logits.ndim == 3
    return logits.max(dim=-1).values  # any deterministic function of (logits, state)


@pytest.mark.parametrize(
    "remasking,gen_length,block_length,steps",
    [
        ("low_confidence", 12, 4, 6),
        ("random", 12, 4, 6),
        ("policy", 12, 4, 6),
        ("low_confidence", 10, 5, 4),
        ("policy", 10, 5, 4),  # 5 over 2 steps: [3, 2]
        ("random", 8, 8, 3),  # one block, 8 over 3 steps: [3, 3, 2]
    ],
)
def test_block_discipline_and_schedule(remasking, gen_length, block_length, steps):
    lm = TinyLM(TinyBidirectional())
    p_ids, p_mask = prompts()
    traj = generate(
        lm,
        p_ids,
        p_mask,
        gen_length,
        steps,
        block_length,
        temperature=1.0,
        remasking=remasking,
        position_scorer=_scorer,
        generator=torch.Generator().manual_seed(0),
    )
    spb = steps // (gen_length // block_length)
    sched = transfer_schedule(block_length, spb)
    block_of = torch.arange(gen_length) // block_length
    assert traj.completion_ids.shape == (3, gen_length) and (traj.completion_ids != MASK).all()
    assert (traj.unmask_step >= 0).all() and (traj.unmask_step < steps).all()  # each exactly once
    for t in range(steps):
        now = traj.unmask_step == t
        assert (now.sum(dim=1) == sched[t % spb]).all()
        assert (block_of.expand_as(now)[now] == t // spb).all()  # never beyond (or behind) the block
        done_before = traj.unmask_step < t
        assert done_before[:, block_of < t // spb].all()  # earlier blocks complete
    # The global rank is a permutation that respects the step order.
    for b in range(3):
        assert sorted(traj.unmask_rank[b].tolist()) == list(range(gen_length))
        by_rank = traj.unmask_step[b][traj.unmask_rank[b].argsort()]
        assert (by_rank.diff() >= 0).all()


# (3) --------------------------------------------------------------------------------------------


def reference_generate(lm, prompt_ids, prompt_mask, gen_length, steps, block_length):
    """Greedy low-confidence LLaDA, written as a plain loop. Returns (completions, per-row unmask order)."""
    batch, plen = prompt_ids.shape
    x = torch.cat([prompt_ids, torch.full((batch, gen_length), MASK)], dim=1)
    attn = torch.cat([prompt_mask, torch.ones(batch, gen_length, dtype=torch.bool)], dim=1)
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    orders = [[] for _ in range(batch)]
    for blk in range(num_blocks):
        for s in range(per_block):
            k = block_length // per_block + (1 if s < block_length % per_block else 0)
            logits = lm.logits(x, attn)
            probs = torch.softmax(logits.double(), dim=-1)
            for r in range(batch):
                cands = []
                for i in range(plen + blk * block_length, plen + (blk + 1) * block_length):
                    if x[r, i] == MASK:
                        row = logits[r, i].clone()
                        row[MASK] = float("-inf")  # the sampler never emits the mask token
                        tok = int(row.argmax())
                        cands.append((-float(probs[r, i, tok]), i, tok))
                cands.sort()
                for _, i, tok in cands[:k]:
                    x[r, i] = tok
                    orders[r].append(i - plen)
    return x[:, plen:], orders


@pytest.mark.parametrize("gen_length,block_length,steps", [(12, 4, 6), (10, 5, 4)])
def test_greedy_matches_reference_loop(gen_length, block_length, steps):
    lm = TinyLM(TinyBidirectional(seed=1))
    p_ids, p_mask = prompts(seed=1)
    traj = generate(lm, p_ids, p_mask, gen_length, steps, block_length, temperature=0.0)
    ref_tokens, ref_orders = reference_generate(lm, p_ids, p_mask, gen_length, steps, block_length)
    assert torch.equal(traj.completion_ids, ref_tokens)
    for r in range(p_ids.shape[0]):
        assert traj.unmask_rank[r].argsort().tolist() == ref_orders[r]


# (4) --------------------------------------------------------------------------------------------


def test_random_remasking_and_gumbel_are_seeded():
    lm = TinyLM(TinyBidirectional())
    p_ids, p_mask = prompts()

    def run(seed):
        t = generate(lm, p_ids, p_mask, 12, 6, 4, temperature=1.0, remasking="random", generator=torch.Generator().manual_seed(seed))
        return t.completion_ids, t.unmask_step, t.unmask_rank

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[2], c[2])
    logits = torch.randn(64, VOCAB)
    s0 = gumbel_sample(logits, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(s0, gumbel_sample(logits, 1.0, torch.Generator().manual_seed(0)))
    assert not torch.equal(s0, gumbel_sample(logits, 1.0, torch.Generator().manual_seed(1)))
    assert torch.equal(gumbel_sample(logits, 0.0), logits.argmax(-1))


# (5) --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gumbel_frequencies_match_softmax(temperature):
    n = 20000
    logits = torch.tensor([1.0, 0.0, -0.5])
    draws = gumbel_sample(logits.expand(n, 3), temperature, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3).double() / n
    expected = torch.softmax(logits.double() / temperature, dim=0)
    assert torch.allclose(freq, expected, atol=4 * math.sqrt(0.25 / n))


# (6) --------------------------------------------------------------------------------------------


def test_policy_remasking_is_plackett_luce():
    n, scores = 20000, torch.tensor([1.0, 0.2, -0.6])
    lm = TinyLM(ConstantModel(torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))))
    p_ids = torch.zeros(n, 2, dtype=torch.long)
    # One step over a 3-position block: the whole PL permutation is drawn at once.
    traj = generate(
        lm,
        p_ids,
        torch.ones_like(p_ids, dtype=torch.bool),
        3,
        1,
        3,
        temperature=1.0,
        remasking="policy",
        position_scorer=lambda logits, state: scores.expand(state.shape[0], -1),
        generator=torch.Generator().manual_seed(0),
    )
    order = traj.unmask_rank.argsort(dim=1)  # (n, 3) positions in sampling order
    p = torch.softmax(scores.double(), 0)
    first = torch.bincount(order[:, 0], minlength=3).double() / n
    tol = 4 * math.sqrt(0.25 / n)
    assert torch.allclose(first, p, atol=tol)
    for i in range(3):
        for j in range(3):
            if i != j:
                freq = ((order[:, 0] == i) & (order[:, 1] == j)).double().mean()
                assert abs(float(freq) - float(p[i] * p[j] / (1 - p[i]))) < tol


def test_policy_remasking_at_temperature_zero_is_the_plackett_luce_mode():
    """Greedy decoding is greedy in positions too: the highest scores first, one step at a time, no noise."""
    scores = torch.tensor([0.3, 2.0, -1.0, 1.0])
    lm = TinyLM(ConstantModel(torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))))
    p_ids = torch.zeros(5, 2, dtype=torch.long)
    traj = generate(
        lm,
        p_ids,
        torch.ones_like(p_ids, dtype=torch.bool),
        4,
        2,
        4,
        temperature=0.0,
        remasking="policy",
        position_scorer=lambda logits, state: scores.expand(state.shape[0], -1),
        generator=torch.Generator().manual_seed(0),
    )
    assert traj.unmask_rank.tolist() == [[2, 0, 3, 1]] * 5
    assert traj.unmask_step.tolist() == [[1, 0, 1, 0]] * 5


# (7) --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_dynamic_threshold(threshold):
    lm = TinyLM(TinyBidirectional(seed=2, sharpness=8.0))
    p_ids, p_mask = prompts(seed=2)
    gen_length, block_length, steps = 12, 4, 12
    traj = generate(lm, p_ids, p_mask, gen_length, steps, block_length, threshold=threshold)
    passes = lm.calls
    spb = steps // (gen_length // block_length)
    block_of = torch.arange(gen_length) // block_length
    assert (traj.unmask_step >= 0).all() and (traj.completion_ids != MASK).all()
    for t in range(steps):
        state = traj.state_at(t, MASK)
        eligible = (state == MASK) & (block_of == t // spb)
        now = traj.unmask_step == t
        assert not (now & ~eligible).any()
        conf = torch.softmax(replay_logits(lm, traj, t).double(), dim=-1).max(dim=-1).values
        for r in range(p_ids.shape[0]):
            if not now[r].any():
                # A step may only be empty once the row's block is complete (every other row's too).
                assert not eligible[r].any()
                continue
            assert now[r][eligible[r] & (conf[r] > threshold)].all()  # every confident position taken
    per_step = torch.stack([(traj.unmask_step == t).sum(dim=1) for t in range(steps)])  # (steps, B)
    assert per_step.max() > 1  # the regime is non-trivial: some step commits several positions at once
    assert passes < steps  # finished blocks end early
    lm.calls = 0
    generate(lm, p_ids, p_mask, gen_length, steps, block_length, threshold=0.0)
    assert lm.calls == gen_length // block_length  # threshold 0 commits a whole block per pass


# (8) --------------------------------------------------------------------------------------------


class Shifted:
    """Wraps a MaskedLM and shifts its logits itself (what an adapter for Dream might do)."""

    def __init__(self, lm):
        self.lm, self.mask_token_id, self.eos_token_id, self.tokenizer = lm, lm.mask_token_id, lm.eos_token_id, None

    def logits(self, input_ids, attention_mask=None):
        return shift_logits(self.lm.logits(input_ids, attention_mask))


def test_logit_shift():
    x = torch.arange(2 * 4 * 3, dtype=torch.float).reshape(2, 4, 3)
    y = shift_logits(x)
    assert torch.equal(y[:, 0], x[:, 0]) and torch.equal(y[:, 1:], x[:, :-1])
    lm = TinyLM(TinyBidirectional())
    p_ids, p_mask = prompts()
    kw = {"gen_length": 8, "steps": 4, "block_length": 4, "temperature": 1.0}
    a = generate(lm, p_ids, p_mask, logit_shift=True, generator=torch.Generator().manual_seed(0), **kw)
    b = generate(Shifted(lm), p_ids, p_mask, generator=torch.Generator().manual_seed(0), **kw)
    c = generate(lm, p_ids, p_mask, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.unmask_rank, b.unmask_rank)
    assert torch.allclose(a.token_log_probs, b.token_log_probs)
    assert not torch.equal(a.token_log_probs, c.token_log_probs)
    # One greedy step commits every position from the all-masked state: completion position i must be the
    # argmax of the full sequence's logits at P + i - 1 (position 0 from the prompt's last token).
    greedy = generate(lm, p_ids, p_mask, gen_length=8, steps=1, block_length=8, logit_shift=True)
    ids = torch.cat([p_ids, torch.full((3, 8), MASK)], dim=1)
    full = lm.logits(ids, torch.cat([p_mask, torch.ones(3, 8, dtype=torch.bool)], dim=1))
    src = full[:, p_ids.shape[1] - 1 : -1].clone()
    src[..., MASK] = float("-inf")
    assert torch.equal(greedy.completion_ids, src.argmax(-1))


# (9) --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.7},
        {"temperature": 1.0, "remasking": "random"},
        {"threshold": 0.6},
        {"temperature": 1.0, "remasking": "policy", "position_scorer": _scorer},
    ],
)
def test_token_log_probs_replay(kw):
    lm = TinyLM(TinyBidirectional(seed=3, sharpness=4.0))
    p_ids, p_mask = prompts(seed=3)
    traj = generate(lm, p_ids, p_mask, 12, 6, 4, generator=torch.Generator().manual_seed(0), **kw)
    checked = torch.zeros_like(traj.completion_ids, dtype=torch.bool)
    for t in range(traj.num_steps):
        now = traj.unmask_step == t
        if not now.any():
            continue
        log_p = torch.log_softmax(replay_logits(lm, traj, t), dim=-1)
        log_p = log_p.gather(-1, traj.completion_ids[..., None]).squeeze(-1)
        assert torch.allclose(traj.token_log_probs[now], log_p[now], atol=1e-5)
        checked |= now
    assert checked.all()


def test_decode_completions_cuts_at_first_eos():
    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            return "".join("" if skip_special_tokens and i in (EOS, MASK) else chr(ord("a") + i) for i in ids)

    ids = torch.tensor([[0, 1, EOS, 2, EOS], [3, MASK, 4, 5, 6]])
    assert decode_completions(CharTokenizer(), ids, EOS) == ["ab", "defg"]
    assert decode_completions(CharTokenizer(), ids, None) == ["abc", "defg"]


def test_invalid_configurations_are_refused():
    from flowrl.errors import FlowRLError

    lm = TinyLM(TinyBidirectional())
    p_ids, p_mask = prompts()
    for kw in [
        {"gen_length": 10, "steps": 4, "block_length": 4},  # blocks do not tile the completion
        {"gen_length": 12, "steps": 4, "block_length": 4},  # steps not a multiple of the 3 blocks
        {"gen_length": 8, "steps": 4, "block_length": 4, "remasking": "policy"},  # no scorer
        {"gen_length": 8, "steps": 4, "block_length": 4, "remasking": "random", "threshold": 0.5},
    ]:
        with pytest.raises(FlowRLError):
            generate(lm, p_ids, p_mask, **kw)
