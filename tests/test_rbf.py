"""Rollover budget forcing on the embedded model, both forms.

flowrl's rollover variant (inference/rbf_rollover.py, ``--rbf-rollover``; flowrl's ``rbf`` before issue #41): M = 1 is
exactly a plain stochastic rollout; the budget moves as the rule says (a verifier that never improves spends M at every
step, one that always improves takes every first candidate and rolls the rest to the last step; on the real reward
every step's allowance is M plus the previous step's leftover); the final score is the reward of the returned samples;
and the CLI with its spec.

FlowRBF as released (inference/rbf.py, ``--rbf``), pinned against the authors' loop (KAIST-Visual-AI-Group/
Flow-Inference-Time-Scaling at b65bb07, rbf/rbf.py): one chain, one start noise and M = 1 is K - 1 steps of the
stochastic sampler and then x0_hat, bit for bit (the chain stops advancing at step K - 2); a verifier that never
improves spends M at each of the first K - 2 steps and 2M - 1 at step K - 2 (the budget's M K - 1 candidates), none at
the last, one that always improves moves on after one candidate per step; the returned sample is the x0_hat of the best
candidate at the final step over the item's chains, as scored; a budget of one round (M K = 1) returns the first
chain's best start x0_hat; an item's draws do not depend on the items beside it; and the CLI with its spec."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.inference.rbf import rbf_sample
from flowrl.inference.rbf_rollover import rbf_rollover_sample
from flowrl.inference.search import ImageSearchModel, Items
from flowrl.inference.sections import RBFConfig
from flowrl.samplers.rollout import rollout
from flowrl.seeding import RowGenerators
from flowrl.types import RewardOutput

GRPO = CONFIGS / "digits" / "grpo.yaml"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from flowrl.trainer import Trainer

    return Trainer(load_config(GRPO, fast_overrides(tmp_path_factory.mktemp("rbf"), **{"eval.samples_per_prompt": 1})))


def _setting(trainer, n=4, sampler=None):
    """The run's model stepping with its rollout sampler (or ``sampler``), and its first ``n`` held-out items."""
    held = trainer.modality.held_out
    model = ImageSearchModel(trainer.pipeline, sampler or trainer.sampler, held.sigmas, held.guidance_scale)
    return model, Items(held.prompts[:n], held.metadata[:n])


def _rbf(trainer, m, reward=None, seed=3, **kwargs):
    model, items = _setting(trainer)
    return rbf_rollover_sample(model, reward or trainer.reward, items, m, torch.Generator().manual_seed(seed), **kwargs)


def test_one_candidate_per_step_is_a_plain_stochastic_rollout(trainer):
    model, items = _setting(trainer)
    noise = trainer.pipeline.initial_noise(len(items), torch.Generator().manual_seed(5))
    ours = _rbf(trainer, 1, seed=7, initial_noise=noise)
    plain = rollout(
        trainer.pipeline,
        trainer.sampler,
        items.prompts,
        items.metadata,
        torch.arange(len(items)),
        model.sigmas,
        torch.Generator().manual_seed(7),
        model.guidance_scale,
        initial_noise=noise,
    )
    torch.testing.assert_close(ours.samples, plain.samples, atol=0, rtol=0)
    assert ours.candidates.eq(1).all()


class _Counting:
    """A verifier whose every call scores higher than the last (``rising``) or that scores everything the same."""

    def __init__(self, rising: bool) -> None:
        self.rising, self.calls = rising, 0

    def __call__(self, samples, prompts, metadata):
        self.calls += 1
        return RewardOutput(scores=torch.full((samples.shape[0],), float(self.calls if self.rising else 0.0)), extras={})


def test_the_budget_rolls_over_as_the_rule_says(trainer):
    k, m = _setting(trainer)[0].sigmas.numel() - 1, 3
    flat = _rbf(trainer, m, reward=_Counting(rising=False))  # nothing ever beats the start: M at every step
    assert flat.candidates.eq(m).all() and not flat.rolled_over.any()
    rising = _rbf(trainer, m, reward=_Counting(rising=True))  # every first candidate beats all before it
    assert rising.candidates[:-1].eq(1).all() and rising.rolled_over[:-1].all() and not rising.rolled_over[-1].any()
    assert rising.candidates[-1].eq(m * k - (k - 1)).all()  # the last step spends everything rolled over to it
    assert torch.equal(rising.denoiser_rows, torch.full((4,), 1 + (k - 1)))

    real = _rbf(trainer, m)  # the digits reward: each step's allowance is M plus the previous step's leftover
    for i in range(4):
        allowance = m
        for s in range(k):
            used = int(real.candidates[s, i])
            assert 1 <= used <= allowance
            assert bool(real.rolled_over[s, i]) or used == allowance
            allowance = m + allowance - used
    assert real.rolled_over.any() and (real.candidates > m).any()  # the budget moved on the real reward
    items = _setting(trainer)[1]
    rescored = trainer.reward(real.samples, items.prompts, items.metadata).scores.float()
    torch.testing.assert_close(rescored, real.scores, atol=1e-5, rtol=0)


def test_deterministic_sampler_is_refused(trainer):
    model, items = _setting(trainer, 2, sampler=trainer.modality.eval_sampler)
    with pytest.raises(FlowRLError, match="deterministic"):
        rbf_rollover_sample(model, trainer.reward, items, 2, torch.Generator())


@pytest.mark.slow
def test_cli_rbf_rollover_prints_its_cost_and_a_spec_that_reruns_bit_for_bit(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "rbf.png"
    overrides = ["eval.samples_per_prompt=1", "eval.num_inference_steps=4", f"output_dir={tmp_path / 'run'}"]
    assert main(["eval", str(GRPO), *overrides, "--rbf-rollover", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = json.loads(printed.strip().splitlines()[-1])
    assert out.is_file() and "RBF with rollover to the last step, 2 candidates per step" in printed
    assert line["spec"]["method"] == {"name": "rbf_rollover", "m": 2} and "eval/reward/mean@rbf2" in line["spec"]["result"]
    k = line["settings"]["steps"]
    cost = line["cost"]
    assert cost["verifier_rows_per_item"] == 1 + 2 * k and k <= cost["denoiser_rows_per_item"] <= 1 + 2 * (k - 1)
    assert cost["wall_seconds"] >= cost["denoiser_seconds"] + cost["verifier_seconds"] > 0
    assert not any("seconds" in key for key in line["spec"]["result"])  # timings are never compared
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(line))
    assert main(["eval", "--spec", str(spec), "--out", str(tmp_path / "again.png")]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["reproduction"]["bit_for_bit"] and again["reproduction"]["differing_fields"] == []
    for bad in (["--rbf-rollover", "0"], ["--rbf-rollover", "2", "--rbf", "2"]):
        assert main(["eval", str(GRPO), *bad]) == 2
    assert main(["eval", str(CONFIGS / "dllm" / "diffu_grpo.yaml"), "--rbf-rollover", "2"]) == 2


# ------------------------------------------------------------------ FlowRBF as released (rbf.py)

P = 4


class _Recording:
    """The run's reward, every call's decoded samples and scores kept (or every score set to ``fixed``, or to the call's
    number when ``rising``)."""

    def __init__(self, reward, fixed=None, rising=False) -> None:
        self.reward, self.fixed, self.rising, self.calls = reward, fixed, rising, []

    def __call__(self, samples, prompts, metadata):
        out = self.reward(samples, prompts, metadata)
        if self.rising or self.fixed is not None:
            value = float(len(self.calls) + 1) if self.rising else self.fixed
            out = RewardOutput(scores=torch.full((samples.shape[0],), value), extras={})
        self.calls.append((samples.clone(), out.scores.float().clone()))
        return out


def test_one_chain_one_start_one_candidate_is_k_minus_one_sde_steps_then_x0_hat(trainer):
    model, items = _setting(trainer)
    sigmas, k = model.sigmas, model.sigmas.numel() - 1
    ours = rbf_sample(model, trainer.reward, items, RBFConfig(m=1, chains=1, init_particles=1), torch.Generator().manual_seed(7))
    generator, pipeline, cond = torch.Generator().manual_seed(7), trainer.pipeline, trainer.pipeline.encode(list(items.prompts))
    x = pipeline.initial_noise(P, generator).float()
    v = pipeline.predict(x, sigmas[0], cond, model.guidance_scale)
    for s in range(k - 1):  # steps 0 .. K - 2; the last step, to sigma = 0, is never taken
        x = trainer.sampler.step(v, x, sigmas[s], sigmas[s + 1], generator=generator).x_next
        v = pipeline.predict(x, sigmas[s + 1], cond, model.guidance_scale)
    x0_hat = trainer.sampler.deterministic_step(v, x, sigmas[k - 1], torch.zeros_like(sigmas[k - 1]))
    torch.testing.assert_close(ours.samples, pipeline.decode(x0_hat), atol=0, rtol=0)
    assert ours.candidates.eq(torch.tensor([1] * (k - 1) + [0])).all() and ours.chain.eq(0).all()
    torch.testing.assert_close(ours.scores, trainer.reward(ours.samples, items.prompts, items.metadata).scores.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("m", [1, 3])
def test_the_budget_moves_as_the_released_loop_moves_it(trainer, m):
    model, items = _setting(trainer)
    k = model.sigmas.numel() - 1
    flat = rbf_sample(
        model, _Recording(trainer.reward, fixed=0.0), items, RBFConfig(m=m, init_particles=3), torch.Generator().manual_seed(0)
    )
    # nothing beats the start (0 < 0 is false): M at each of steps 0 .. K - 3, the remaining M K - 1 - (K - 2) M = 2M - 1
    # at step K - 2, none at the last; ties return the first chain
    assert flat.candidates.eq(torch.tensor([m] * (k - 2) + [2 * m - 1, 0])).all()
    assert flat.rollovers.eq(0).all() and flat.chain.eq(0).all()
    rising = rbf_sample(
        model, _Recording(trainer.reward, rising=True), items, RBFConfig(m=m, init_particles=3), torch.Generator().manual_seed(0)
    )
    # every candidate beats all before it: one per step up to step K - 2, which gets all that is left
    assert rising.candidates.eq(torch.tensor([1] * (k - 2) + [m * k - 1 - (k - 2), 0])).all()
    assert rising.rollovers.eq(k - 2).all()


def test_the_returned_sample_is_the_x0_hat_of_the_best_final_candidate_over_the_chains(trainer):
    model, items = _setting(trainer)
    k, chains, init = model.sigmas.numel() - 1, 3, 2
    reward = _Recording(trainer.reward)
    result = rbf_sample(model, reward, items, RBFConfig(m=2, chains=chains, init_particles=init), torch.Generator().manual_seed(1))
    rounds = reward.calls[-(2 * k - 1) :]  # after the start noises' calls: one call per round, one row per chain
    assert len(reward.calls) == -(-P * chains * init // model.batch_size) + len(rounds)
    assert all(samples.shape[0] == P * chains for samples, _ in rounds)
    for i in range(P):
        best, image = float("-inf"), None
        for b in range(chains):
            row, spent = i * chains + b, int(result.candidates[i, b, k - 2])  # the chain's last rounds, at step K - 2
            for samples, scores in rounds[len(rounds) - spent :]:
                if scores[row] > best:  # ties: the earlier candidate, then the first chain
                    best, image = float(scores[row]), samples[row]
        assert float(result.scores[i]) == best
        torch.testing.assert_close(result.samples[i], image, atol=0, rtol=0)
    assert (result.candidates[:, :, k - 2] >= 2 * 2 - 1).all() and result.candidates[:, :, k - 1].eq(0).all()


def test_a_budget_of_one_round_returns_the_first_chains_best_start(trainer):
    model, items = _setting(trainer)
    model = dataclasses.replace(model, sigmas=torch.tensor([1.0, 0.0]), batch_size=P * 6)  # K = 1, M = 1: M K - 1 = 0 rounds
    result = rbf_sample(model, trainer.reward, items, RBFConfig(m=1, init_particles=3), torch.Generator().manual_seed(2))
    pipeline, sigma = trainer.pipeline, torch.tensor(1.0)
    noise = pipeline.initial_noise(P * 6, torch.Generator().manual_seed(2)).float()  # item i: chain 0's 3, then chain 1's 3
    cond = pipeline.encode([q for q in items.prompts for _ in range(6)])
    x0_hat = trainer.sampler.deterministic_step(pipeline.predict(noise, sigma, cond, model.guidance_scale), noise, sigma, torch.zeros(()))
    scores = trainer.reward(
        pipeline.decode(x0_hat), [q for q in items.prompts for _ in range(6)], [d for d in items.metadata for _ in range(6)]
    )
    first_chain = scores.scores.float().view(P, 6)[:, :3]
    picked = torch.arange(P) * 6 + first_chain.argmax(1)
    torch.testing.assert_close(result.samples, pipeline.decode(x0_hat[picked]), atol=0, rtol=0)
    torch.testing.assert_close(result.scores, first_chain.max(1).values, atol=1e-6, rtol=0)
    assert result.candidates.eq(0).all() and result.chain.eq(0).all() and result.denoiser_rows.eq(6).all()


def test_an_items_result_does_not_depend_on_the_items_beside_it(trainer):
    model, items = _setting(trainer)
    streams = RowGenerators.by_content(0, items.prompts, items.metadata, [0] * P)
    together = rbf_sample(model, trainer.reward, items, RBFConfig(m=2, init_particles=2), streams)
    alone_streams = RowGenerators.by_content(0, items.prompts[2:], items.metadata[2:], [0, 0])
    alone = rbf_sample(model, trainer.reward, items.take([2, 3]), RBFConfig(m=2, init_particles=2), alone_streams)
    # the same draws; the model's rows may round differently in batches of other sizes (chains at a step run together)
    torch.testing.assert_close(alone.samples, together.samples[2:])
    assert torch.equal(alone.candidates, together.candidates[2:])


def test_released_refuses_a_deterministic_sampler_and_empty_settings(trainer):
    model, items = _setting(trainer, 2, sampler=trainer.modality.eval_sampler)
    with pytest.raises(FlowRLError, match="deterministic"):
        rbf_sample(model, trainer.reward, items, RBFConfig(m=2), torch.Generator())
    for bad in ({"m": 0}, {"m": 2, "chains": 0}, {"m": 2, "init_particles": 0}):
        with pytest.raises(FlowRLError, match="must be at least 1"):
            RBFConfig.validated({"name": "rbf", **bad})


@pytest.mark.slow
def test_cli_rbf_prints_its_cost_and_a_spec_that_reruns_bit_for_bit(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "rbf.png"
    overrides = ["eval.samples_per_prompt=1", "eval.num_inference_steps=4", f"output_dir={tmp_path / 'run'}"]
    assert main(["eval", str(GRPO), *overrides, "--rbf", "2", "--rbf-init-particles", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = json.loads(printed.strip().splitlines()[-1])
    assert out.is_file() and "RBF as released, 2 candidates per step and chain, 2 chains from the best of 3" in printed
    assert line["spec"]["method"] == {"name": "rbf", "m": 2, "chains": 2, "init_particles": 3}
    k = line["settings"]["steps"]
    assert line["cost"]["verifier_rows_per_item"] == line["cost"]["denoiser_rows_per_item"] == 2 * (3 + 2 * k - 1)
    assert "eval/reward/mean@rbf2x2" in line["spec"]["result"]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(line))
    assert main(["eval", "--spec", str(spec), "--out", str(tmp_path / "again.png")]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["reproduction"]["bit_for_bit"] and again["reproduction"]["differing_fields"] == []
    for bad in (["--rbf", "0"], ["--rbf", "2", "--rbf-chains", "0"], ["--rbf-chains", "2"], ["--rbf", "2", "--svdd", "2"]):
        assert main(["eval", str(GRPO), *bad]) == 2
    assert main(["eval", str(CONFIGS / "dllm" / "diffu_grpo.yaml"), "--rbf", "2"]) == 2
