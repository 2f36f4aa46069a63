"""Counted cost of every search (inference/cost.py): the denoiser and verifier rows and calls that the metered model
and reward count equal each method's formula (best-of-N with and without early stopping, its padding included;
SVDD with either last step; SMC; zero-order noise search; RBF as released and flowrl's rollover variant; and the
diffusion-LM best-of-N, SVDD and SMC), and the seconds add up."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.inference.cost import SearchCost, metered
from flowrl.inference.search import ImageSearchModel, Items, TextSearchModel, TextVerifier

GRPO = CONFIGS / "digits" / "grpo.yaml"
P = 4  # held-out items searched


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from flowrl.trainer import Trainer

    return Trainer(load_config(GRPO, fast_overrides(tmp_path_factory.mktemp("cost"), **{"eval.samples_per_prompt": 1})))


def _setup(trainer, stochastic=False, batch_size=16, meter=True):
    """A counted cost, the run's model (metered) stepping with its rollout sampler when ``stochastic`` (else the plain
    evaluation's), the reward (metered) and the first P held-out items."""
    held = trainer.modality.held_out
    cost = SearchCost()
    pipeline, reward = metered(cost, pipeline=trainer.pipeline, verifiers=[trainer.reward]) if meter else (trainer.pipeline, trainer.reward)
    sampler = trainer.sampler if stochastic else trainer.modality.eval_sampler
    model = ImageSearchModel(pipeline, sampler, held.sigmas, held.guidance_scale, batch_size)
    return cost, model, reward, Items(held.prompts[:P], held.metadata[:P])


def _seconds_add_up(cost: SearchCost) -> None:
    assert cost.denoiser_seconds > 0 and cost.verifier_seconds > 0
    assert cost.wall_seconds >= cost.denoiser_seconds + cost.verifier_seconds
    record = cost.record(P)
    assert record["denoiser_rows_per_item"] == cost.denoiser_rows / P and record["items"] == P
    assert cost.cpu_seconds >= cost.denoiser_cpu_seconds > 0 and cost.verifier_cpu_seconds > 0  # this process's own CPU time


def test_best_of_n_counts_n_rollouts_and_the_padding_of_early_stopped_rounds(trainer):
    from flowrl.inference.best_of_n import best_of_n

    k, n, batch = trainer.modality.held_out.sigmas.numel() - 1, 3, 3
    cost, model, reward, items = _setup(trainer, batch_size=batch)
    with cost:
        best_of_n(model, reward, items, n, torch.Generator().manual_seed(0))
    batches = math.ceil(P / batch)  # 4 items in batches of 3: the second padded to 3 rows
    assert (cost.denoiser_rows, cost.denoiser_calls) == (n * batches * batch * k, n * batches * k)
    assert (cost.verifier_rows, cost.verifier_calls) == (n * P, n * batches)  # padding rows are never scored
    _seconds_add_up(cost)

    _, plain_model, plain_reward, _ = _setup(trainer, batch_size=batch, meter=False)
    full = best_of_n(plain_model, plain_reward, items, n, torch.Generator().manual_seed(0))
    threshold = float(full.scores[:, 0].median())
    cost, model, reward, items = _setup(trainer, batch_size=batch)
    with cost:
        stopped = best_of_n(model, reward, items, n, torch.Generator().manual_seed(0), stop_at=threshold)
    active = [int((stopped.draws > j).sum()) for j in range(n)]  # items still searching in round j
    assert active[0] == P and active[-1] < P
    assert cost.denoiser_rows == k * sum(math.ceil(a / batch) * batch for a in active)
    assert cost.verifier_rows == int(stopped.draws.sum())


@pytest.mark.parametrize("last_step", ["plain", "best_of_m"])
def test_svdd_counts_one_plus_m_times_k_minus_one_forwards(trainer, last_step):
    from flowrl.inference.svdd import svdd_sample

    cost, model, reward, items = _setup(trainer, stochastic=True)
    k, m = model.sigmas.numel() - 1, 3
    with cost:
        svdd_sample(model, reward, items, m, torch.Generator().manual_seed(0), last_step=last_step)
    assert (cost.denoiser_rows, cost.denoiser_calls) == (P * (1 + m * (k - 1)), k)
    # plain: M candidates valued at each of the first K - 1 steps, then the returned samples scored once (reported);
    # best_of_m: the M finished candidates scored at the last step too
    scored = P * (m * (k - 1) + 1) if last_step == "plain" else P * m * k
    assert (cost.verifier_rows, cost.verifier_calls) == (scored, k)
    _seconds_add_up(cost)


def test_smc_counts_n_rollouts_and_n_k_reward_rows(trainer):
    from flowrl.inference.sections import SMCConfig
    from flowrl.inference.smc import smc_sample

    cost, model, reward, items = _setup(trainer, stochastic=True)
    k, n = model.sigmas.numel() - 1, 3
    with cost:
        result = smc_sample(model, reward, items, SMCConfig(n=n, lam=10.0), torch.Generator().manual_seed(0))
    assert cost.denoiser_rows == P * n * k == P * result.denoiser_calls
    assert cost.verifier_rows == P * n * k == P * result.reward_calls
    _seconds_add_up(cost)


def test_noise_search_counts_one_plus_rounds_times_neighbours_rollouts(trainer):
    from flowrl.inference.noise_search import zero_order_search

    cost, model, reward, items = _setup(trainer, batch_size=P)
    k, rounds, neighbors = model.sigmas.numel() - 1, 2, 2
    with cost:
        result = zero_order_search(model, reward, items, rounds, neighbors, 0.5, torch.Generator().manual_seed(0))
    assert result.evaluations == 1 + rounds * neighbors
    assert (cost.denoiser_rows, cost.denoiser_calls) == (result.evaluations * P * k, result.evaluations * k)
    assert (cost.verifier_rows, cost.verifier_calls) == (result.evaluations * P, result.evaluations)
    _seconds_add_up(cost)


@pytest.mark.parametrize(("m", "chains", "init_particles"), [(3, 2, 5), (1, 1, 1), (2, 3, 1)])
def test_rbf_as_released_counts_chains_times_its_nfe_budget(trainer, m, chains, init_particles):
    from flowrl.inference.rbf import rbf_sample
    from flowrl.inference.sections import RBFConfig

    cost, model, reward, items = _setup(trainer, stochastic=True, batch_size=8)
    k = model.sigmas.numel() - 1
    with cost:
        result = rbf_sample(
            model, reward, items, RBFConfig(m=m, chains=chains, init_particles=init_particles), torch.Generator().manual_seed(0)
        )
    # the release's loop on max_nfe = chains (init + M K): init particles first, then one row per chain per round
    # while nfe + chains < max_nfe
    max_nfe, nfe, rounds = chains * (init_particles + m * k), chains * init_particles, 0
    while nfe + chains < max_nfe:
        nfe, rounds = nfe + chains, rounds + 1
    assert rounds == m * k - 1
    assert result.candidates.sum(2).eq(rounds).all()  # every chain draws every round
    assert cost.denoiser_rows == cost.verifier_rows == P * nfe == P * chains * (init_particles + m * k - 1)
    assert torch.equal(result.denoiser_rows, torch.full((P,), nfe)) and torch.equal(result.reward_rows, result.denoiser_rows)
    _seconds_add_up(cost)


def test_rbf_rollover_spends_m_k_candidates_and_counts_its_look_aheads(trainer):
    from flowrl.inference.rbf_rollover import rbf_rollover_sample

    cost, model, reward, items = _setup(trainer, stochastic=True)
    k, m = model.sigmas.numel() - 1, 3
    with cost:
        result = rbf_rollover_sample(model, reward, items, m, torch.Generator().manual_seed(0))
    assert result.candidates.sum(0).eq(m * k).all()  # every item spends its whole budget
    assert torch.equal(result.reward_rows, torch.full((P,), 1 + m * k))  # the start noise's x0_hat and every candidate
    assert torch.equal(result.denoiser_rows, 1 + m * k - result.candidates[-1])  # the last step's candidates need no look-ahead
    assert cost.verifier_rows == int(result.reward_rows.sum()) and cost.denoiser_rows == int(result.denoiser_rows.sum())
    _seconds_add_up(cost)


# ------------------------------------------------------------------ diffusion LMs: the model's forwards, the selection score's rows


@pytest.fixture(scope="module")
def text():
    from flowrl.modalities.text import TextModality
    from flowrl.reward_models import build_reward_from_config

    config = load_config(
        CONFIGS / "dllm" / "diffu_grpo.yaml", [f"prompts.eval_size={P}", "sampler.eval_temperature=1", f"rollout.batch_size={P}"]
    )
    modality = TextModality(config, torch.device("cpu"))
    modality.pipeline.model.eval()
    prompts, metadata = [p for p, _ in modality.eval_pool], [m for _, m in modality.eval_pool]
    return config, modality, build_reward_from_config(config.reward), prompts, metadata


def _text_metered(config, modality):
    """A counted cost, the diffusion LM (metered) at temperature 1 with seed 0 and P items per batch, and the
    likelihood score (metered)."""
    from flowrl.inference.text_candidates import build_scorer

    cost = SearchCost()
    lm, scorer = metered(cost, lm=modality.pipeline, verifiers=[build_scorer("likelihood")])
    return cost, TextSearchModel(lm, config.sampler, config.pipeline.prompt_length, 1.0, 0, P), scorer


def test_text_searches_count_their_forwards_and_scored_rows(text):
    from flowrl.inference.masked_smc import masked_smc_in_batches
    from flowrl.inference.masked_svdd import masked_svdd_in_batches
    from flowrl.inference.sections import SMCConfig
    from flowrl.inference.text_best_of_n import text_best_of_n

    config, modality, grader, prompts, metadata = text
    sc, n = config.sampler, 2
    cost, model, scorer = _text_metered(config, modality)
    with cost:
        text_best_of_n(model, TextVerifier(["likelihood"], [scorer], grader), Items(prompts, metadata), n)
    assert (cost.denoiser_rows, cost.denoiser_calls) == (n * P * sc.steps, n * sc.steps)  # one forward per unmasking step
    assert (cost.verifier_rows, cost.verifier_calls) == (n * P, n)  # the grader measures; it is not counted

    for last_step, scored in (("plain", P * (n * (sc.steps - 1) + 1)), ("best_of_m", P * n * sc.steps)):
        cost, model, scorer = _text_metered(config, modality)
        with cost:
            svdd = masked_svdd_in_batches(model, scorer, prompts, n, last_step=last_step)
        assert cost.denoiser_rows == svdd.forwards == P * (1 + n * (sc.steps - 1))
        assert cost.verifier_rows == scored  # plain: the kept completions scored once at the end, reported

    cost, model, scorer = _text_metered(config, modality)
    with cost:
        smc = masked_smc_in_batches(model, scorer, prompts, SMCConfig(n=n, lam=1.0))
    assert cost.denoiser_rows == P * smc.denoiser_calls and cost.verifier_rows == P * smc.reward_calls == P * n * sc.steps
    assert cost.denoiser_seconds > 0 and cost.wall_seconds >= cost.denoiser_seconds + cost.verifier_seconds
