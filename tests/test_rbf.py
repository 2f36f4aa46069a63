"""Rollover budget forcing (inference/rbf.py) on the embedded model: M = 1 is exactly a plain stochastic rollout; the
budget moves as the rule says (a verifier that never improves spends M at every step, one that always improves takes
every first candidate and rolls the rest to the last step; on the real reward every step's allowance is M plus the
previous step's leftover); the final score is the reward of the returned samples; and the CLI with its spec."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.inference.rbf import rbf_sample
from flowrl.inference.search import ImageSearchModel, Items
from flowrl.samplers.rollout import rollout
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
    return rbf_sample(model, reward or trainer.reward, items, m, torch.Generator().manual_seed(seed), **kwargs)


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
        rbf_sample(model, trainer.reward, items, 2, torch.Generator())


@pytest.mark.slow
def test_cli_rbf_prints_its_cost_and_a_spec_that_reruns_bit_for_bit(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "rbf.png"
    overrides = ["eval.samples_per_prompt=1", "eval.num_inference_steps=4", f"output_dir={tmp_path / 'run'}"]
    assert main(["eval", str(GRPO), *overrides, "--rbf", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = json.loads(printed.strip().splitlines()[-1])
    assert out.is_file() and "RBF, 2 candidates per step" in printed and line["spec"]["method"] == {"name": "rbf", "m": 2}
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
    for bad in (["--rbf", "0"], ["--rbf", "2", "--svdd", "2"]):
        assert main(["eval", str(GRPO), *bad]) == 2
    assert main(["eval", str(CONFIGS / "dllm" / "diffu_grpo.yaml"), "--rbf", "2"]) == 2
