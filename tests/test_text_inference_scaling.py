"""Inference-time scaling on the embedded masked-diffusion LM (arith_mdlm), real model and real sampler:
best-of-N with verifier-free selection (majority, likelihood, a reward) and SVDD per unmasking step.

Pinned: every rule at N = 1 is the plain held-out evaluation at the same seed; majority and pass@N equal
their definitions recomputed from the recorded candidates; pass@N bounds every rule; the likelihood is the
sampler's record; gold graders never select and a selection reward never sees the metadata; SVDD with
M = 1 is the plain generation and its denoiser forwards are counted exactly, 1 + M (K - 1) per item; its last step
keeps the best of the finished candidates (the default, as the discrete-diffusion release selects there too) or, with
``last_step: plain``, the first of the same candidates (as the image release).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import CONFIGS

from flowrl.config import RewardConfig, load_config
from flowrl.errors import FlowRLError
from flowrl.inference.masked_svdd import masked_svdd, masked_svdd_in_batches
from flowrl.inference.search import Items, TextSearchModel, TextVerifier
from flowrl.inference.text_best_of_n import ORACLE, text_best_of_n
from flowrl.inference.text_candidates import RewardScorer, answer_key, build_scorer, build_scorers, majority_choice
from flowrl.reward_models import build_reward_from_config
from flowrl.reward_models.math_answer import extract_answer
from flowrl.samplers.text_generation import candidate_streams, generate_texts
from flowrl.types import RewardOutput

CONFIG = CONFIGS / "dllm" / "diffu_grpo.yaml"
# 12 held-out items in batches of 8 (the second short): every batch reseeds the generator, as the evaluation does
OVERRIDES = ["prompts.eval_size=12", "sampler.eval_temperature=1", "rollout.batch_size=8"]
N = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This tiny model runs fastest on one thread (2-core machines are shared); restored for the other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    from flowrl.modalities.text import TextModality

    config = load_config(CONFIG, OVERRIDES)
    modality = TextModality(config, torch.device("cpu"))
    modality.pipeline.model.eval()
    grader = build_reward_from_config(config.reward)
    prompts, metadata = [p for p, _ in modality.eval_pool], [m for _, m in modality.eval_pool]
    return config, modality, grader, prompts, metadata


def _model(setup, temperature=None, batch_size=None, prompt_length=...) -> TextSearchModel:
    """The run's diffusion LM as ``flowrl eval`` searches it (its eval temperature, seed and rollout batch size)."""
    config, modality, *_ = setup
    return TextSearchModel(
        modality.pipeline,
        config.sampler,
        config.pipeline.prompt_length if prompt_length is ... else prompt_length,
        config.sampler.eval_temperature if temperature is None else temperature,
        config.eval.seed,
        batch_size or config.rollout.batch_size,
    )


@pytest.fixture(scope="module")
def best(setup):
    config, modality, grader, prompts, metadata = setup
    verifier = TextVerifier(["likelihood", "format"], [build_scorer("likelihood"), build_scorer("format")], grader)
    return text_best_of_n(_model(setup), verifier, Items(prompts, metadata), N)


@pytest.fixture(scope="module")
def plain(setup):
    config, modality, grader, *_ = setup
    return modality.evaluate(grader, 0, 1)


@pytest.mark.slow
def test_best_of_one_is_the_plain_evaluation_for_every_rule(setup, best, plain):
    metrics, rows = plain
    assert [r["completion"] for r in rows] == [c[0] for c in best.completions]
    for rule in ("majority", "likelihood", "format"):
        assert best.accuracy(rule, 1) == pytest.approx(metrics["eval/reward/mean"], abs=1e-12)
    assert best.pass_at(1) == pytest.approx(metrics["eval/reward/mean"], abs=1e-12)
    # the candidates differ (T = 1) and are exactly what the keyed generators give
    config, modality, *_ = setup
    j2 = generate_texts(
        modality.pipeline,
        setup[3][:8],
        config.sampler,
        config.pipeline.prompt_length,
        1.0,
        candidate_streams(config.eval.seed, setup[3][:8], 2),
    )
    assert j2.completions == [c[2] for c in best.completions[:8]]
    assert any(len(set(c)) > 1 for c in best.completions)


def test_majority_and_pass_at_n_match_their_definitions(best):
    for k in range(1, N + 1):
        chosen = best.choose("majority", k)
        for i, answers in enumerate(best.answers):
            keys = [answer_key(a) for a in answers[:k]]
            counts = Counter(x for x in keys if x is not None)
            if counts:  # a most frequent answer, the earliest among tied ones
                top = max(counts.values())
                assert keys[int(chosen[i])] == next(x for x in keys if x is not None and counts[x] == top)
        assert best.accuracy("majority", k) == pytest.approx(float(best.graded.gather(1, chosen[:, None]).double().mean()), abs=1e-12)
        assert best.pass_at(k) == pytest.approx(float((best.graded[:, :k] == 1).any(1).double().mean()), abs=1e-12)
    assert best.answers == [[extract_answer(c) for c in row] for row in best.completions]


def test_pass_at_n_is_an_upper_bound_on_every_rule(best):
    curves = best.curves(["majority", "likelihood", "format"])
    ks = best.ks()
    assert ks == [1, 2, 4]
    for k in ks:
        for rule in ("majority", "likelihood", "format"):
            assert curves[rule][k] <= curves[ORACLE][k] + 1e-12
    assert all(curves[ORACLE][a] <= curves[ORACLE][b] for a, b in zip(ks, ks[1:]))
    assert curves[ORACLE][N] > curves[ORACLE][1]  # T = 1 candidates do get different answers right
    assert best.sample_accuracy() == pytest.approx(float(best.graded.double().mean()), abs=1e-12)


def test_likelihood_rule_is_the_recorded_log_likelihood_and_picks_its_argmax(setup, best):
    config, modality, _, prompts, _ = setup
    traj = generate_texts(
        modality.pipeline,
        prompts[:8],
        config.sampler,
        config.pipeline.prompt_length,
        1.0,
        candidate_streams(config.eval.seed, prompts[:8], 1),
    )
    torch.testing.assert_close(best.scores["likelihood"][:8, 1], traj.token_log_probs.double().sum(1), atol=0, rtol=0)
    assert torch.equal(best.choose("likelihood", N), best.scores["likelihood"].argmax(1))
    # every arith completion is tagged "<answer> .. </answer>": the format reward ties, and a tie keeps candidate 0
    assert torch.equal(best.scores["format"], torch.full_like(best.scores["format"], 0.5))
    assert torch.equal(best.choose("format", N), torch.zeros(len(prompts), dtype=torch.long))


def test_answer_keys_and_majority_choice():
    assert [answer_key(a) for a in ("12", "12.0", " $12$ ", "12.", "1,200", "0.5", "x + 1", None)] == [
        "12",
        "12",
        "12",
        "12",
        "1200",
        "0.5",
        "x + 1",
        None,
    ]
    assert majority_choice(["3", "4", "4", "3"]) == 0  # tie 2-2: the answer seen first
    assert majority_choice(["3", "4", "4", None]) == 1
    assert majority_choice([None, None]) == 0
    assert majority_choice([None, "7"]) == 1


class _SeesMetadata:
    """A verifier-free reward that records the metadata handed to it."""

    def __init__(self):
        self.seen = []

    def __call__(self, samples, prompts, metadata):
        self.seen += list(metadata)
        return RewardOutput(scores=torch.tensor([float(len(s)) for s in samples]))


def test_gold_graders_never_select_and_rewards_never_see_the_gold_answer(setup):
    config, modality, grader, prompts, metadata = setup
    with pytest.raises(FlowRLError, match="gold answer"):
        build_scorer("math_answer")
    with pytest.raises(FlowRLError, match="reads the gold answer"):
        build_scorers(["majority", "reward"], config.reward)
    fmt_only = RewardConfig(components={"format": 1.0})
    assert [s.name for s in build_scorers(["majority", "reward", "likelihood", "format"], fmt_only)] == ["reward", "likelihood", "format"]
    probe = _SeesMetadata()
    verifier = TextVerifier(["len"], [RewardScorer("len", probe)], grader)
    result = text_best_of_n(_model(setup, 1.0, 8), verifier, Items(prompts[:4], metadata[:4]), 2)
    assert probe.seen == [{}] * 8 and all("answer" in m for m in metadata[:4])
    assert torch.equal(
        result.scores["len"], torch.tensor([[float(len(c)) for c in row] for row in result.completions], dtype=torch.float64)
    )
    # a reward that needs the metadata cannot select
    with pytest.raises(FlowRLError, match="no finite score"):
        RewardScorer("math_answer", grader)(["1 + 1 = 2 . <answer> 2 </answer>"], ["q"], torch.zeros(1))
    with pytest.raises(FlowRLError, match="identical completions"):
        text_best_of_n(_model(setup, 0.0, 8), TextVerifier([], [], grader), Items(prompts, metadata), 2)


class _CountRows:
    """Counts the rows the masked LM is run on, as bench/inference_scaling.py counts the image denoiser's."""

    def __init__(self, lm):
        self.rows, self._logits, self.lm = 0, lm.logits, lm
        lm.logits = self

    def __call__(self, input_ids, attention_mask=None):
        self.rows += input_ids.shape[0]
        return self._logits(input_ids, attention_mask=attention_mask)

    def restore(self):
        del self.lm.logits


def test_svdd_with_one_candidate_is_the_plain_evaluation(setup, plain):
    config, modality, _, prompts, _ = setup
    counter = _CountRows(modality.pipeline)
    try:
        result = masked_svdd_in_batches(_model(setup, 1.0), build_scorer("likelihood"), prompts, 1)
    finally:
        counter.restore()
    assert result.completions == [r["completion"] for r in plain[1]]
    assert result.forwards == counter.rows == len(prompts) * config.sampler.steps  # the plain sampler's work exactly


def test_svdd_counts_its_forwards_and_keeps_the_best_look_ahead(setup):
    config, modality, grader, prompts, metadata = setup
    m, k, likelihood = 3, config.sampler.steps, build_scorer("likelihood")
    counter = _CountRows(modality.pipeline)
    try:
        result = masked_svdd(_model(setup, 1.0), likelihood, prompts[:6], m, torch.Generator().manual_seed(3))  # best_of_m
    finally:
        counter.restore()
    assert result.forwards == counter.rows == 6 * (1 + m * (k - 1))  # first step's forward + M look-aheads on all but the last step
    assert len(result.step_scores) == k and all(s.shape == (6, m) for s in result.step_scores)
    torch.testing.assert_close(result.scores, result.step_scores[-1].max(1).values, atol=0, rtol=0)
    assert result.completion_ids.ne(modality.pipeline.mask_token_id).all()
    # the image release's plain last step: the same candidates up to it, then each item's first, with its own value
    released = masked_svdd(_model(setup, 1.0), likelihood, prompts[:6], m, torch.Generator().manual_seed(3), last_step="plain")
    assert released.forwards == result.forwards and len(released.step_scores) == k - 1
    for a, b in zip(released.step_scores, result.step_scores):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(released.scores, result.step_scores[-1][:, 0], atol=0, rtol=0)
    assert (result.scores >= released.scores).all() and (result.scores > released.scores).any()
    # choosing by the model's likelihood raises the likelihood of what comes out over M = 1 from the same generator
    one = masked_svdd(_model(setup, 1.0), likelihood, prompts[:6], 1, torch.Generator().manual_seed(3))
    assert float(result.scores.mean()) > float(one.scores.mean())
    with pytest.raises(FlowRLError, match="majority"):
        masked_svdd(_model(setup, 1.0, prompt_length=None), type("M", (), {"name": "majority"})(), prompts[:2], 2, torch.Generator())


@pytest.mark.slow
def test_cli_best_of_n_and_svdd_on_a_dllm_config(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "curve.png"
    assert (
        main(
            ["eval", str(CONFIG), *OVERRIDES, "prompts.eval_size=8", "--best-of", "2", "--select", "majority,likelihood", "--out", str(out)]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out.stat().st_size > 0 and (tmp_path / "curve.jsonl").read_text().count("\n") == 8
    assert line["eval/reward/mean@1/majority"] == line["eval/reward/mean@1/likelihood"] == line["eval/oracle_pass@1"]
    assert max(line["eval/reward/mean@2/majority"], line["eval/reward/mean@2/likelihood"]) <= line["eval/oracle_pass@2"]
    assert line["settings"]["temperature"] == 1.0 and line["settings"]["select"] == ["majority", "likelihood"]
    assert main(["eval", str(CONFIG), *OVERRIDES, "prompts.eval_size=8", "--svdd", "2", "--out", str(tmp_path / "svdd.png")]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["denoiser_forwards_per_item"] == 1 + 2 * 7 and 0 <= line["eval/reward/mean@svdd2/likelihood"] <= 1
    # unset, the last step is the discrete release's (a best-of-M of finished completions), and the spec says so
    assert line["settings"]["svdd_last_step"] == "best_of_m" and line["spec"]["method"]["last_step"] == "best_of_m"
    assert line["cost"]["verifier_rows_per_item"] == 2 * 8
    refused = tmp_path / "refused.png"
    assert main(["eval", str(CONFIG), *OVERRIDES, "--best-of", "2", "--select", "math_answer", "--out", str(refused)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowrl: error: 'math_answer' grades against the gold answer") and len(err.splitlines()) == 1
