"""Zero-order noise search on the embedded model: one round with step 1 is Best-of-N on the same draws, the
pivot's reward never decreases, round 0 is the plain evaluation, and the neighbour proposal keeps N(0, I)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.inference.best_of_n import best_of_n
from flowrl.inference.noise_search import _neighbors, zero_order_search
from flowrl.inference.search import ImageSearchModel, Items
from flowrl.samplers.rollout import start_noise


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from flowrl.trainer import Trainer

    return Trainer(
        load_config(CONFIGS / "digits" / "grpo.yaml", fast_overrides(tmp_path_factory.mktemp("zo"), **{"eval.samples_per_prompt": 1}))
    )


def _model(trainer, batch_size=16):
    """The run's model with the plain evaluation's (ODE) sampler and time grid."""
    held = trainer.modality.held_out
    return ImageSearchModel(trainer.pipeline, trainer.modality.eval_sampler, held.sigmas, held.guidance_scale, batch_size)


@pytest.mark.slow
def test_one_round_of_fresh_neighbours_is_best_of_n(trainer):
    held = trainer.modality.held_out
    items = Items(held.prompts[:8], held.metadata[:8])
    zo = zero_order_search(_model(trainer), trainer.reward, items, 1, 3, 1.0, torch.Generator().manual_seed(4))
    bon = best_of_n(_model(trainer), trainer.reward, items, 4, torch.Generator().manual_seed(4))
    torch.testing.assert_close(zo.scores, bon.scores.max(1).values)
    torch.testing.assert_close(zo.samples, bon.samples)
    assert zo.evaluations == 4


@pytest.mark.slow
def test_pivot_reward_never_decreases_and_round_zero_is_the_evaluation(trainer):
    metrics = trainer.evaluate()
    held = trainer.modality.held_out  # the search starts from the noise the plain evaluation draws
    gen = held.generator()
    noise = start_noise(trainer.pipeline, len(held), gen)
    model = _model(trainer, trainer.config.rollout.batch_size)
    result = zero_order_search(model, trainer.reward, Items(held.prompts, held.metadata), 3, 2, 0.5, gen, initial_noise=noise)
    assert result.history[0].mean().item() == pytest.approx(metrics["eval/reward/mean"], abs=1e-6)
    assert (result.history[1:] >= result.history[:-1]).all()
    assert result.history[-1].mean() > result.history[0].mean()
    rescored = trainer.reward(result.samples, held.prompts, held.metadata).scores.float()
    torch.testing.assert_close(rescored, result.scores, atol=1e-5, rtol=0)


def test_neighbour_proposal_keeps_the_standard_normal():
    pivot = torch.randn(20000, 4, generator=torch.Generator().manual_seed(0))
    cand = _neighbors(pivot, 1, 0.5, torch.Generator().manual_seed(1))[0]
    assert cand.var(0).sub(1).abs().max() < 0.05 and cand.mean(0).abs().max() < 4 / math.sqrt(20000)
    corr = torch.corrcoef(torch.stack([pivot[:, 0], cand[:, 0]]))[0, 1]
    assert corr.item() == pytest.approx(math.sqrt(1 - 0.25), abs=0.02)  # a local move: correlation sqrt(1 - step^2)


@pytest.mark.slow
def test_cli_noise_search_prints_its_cost_and_a_spec_that_reruns_bit_for_bit(tmp_path, capsys):
    import json

    from flowrl.cli import main

    config = str(CONFIGS / "digits" / "grpo.yaml")
    overrides = ["eval.samples_per_prompt=1", "eval.num_inference_steps=4", f"output_dir={tmp_path / 'run'}"]
    assert main(["eval", config, *overrides, "--noise-search", "1", "--noise-neighbors", "2", "--out", str(tmp_path / "ns.png")]) == 0
    printed = capsys.readouterr().out
    line = json.loads(printed.strip().splitlines()[-1])
    assert line["spec"]["method"] == {"name": "noise_search", "rounds": 1, "neighbors": 2, "step": 0.5}
    # round 0 (what --noise-search 0 returns) is the plain evaluation's samples (test above)
    assert line["eval/noise1x2/reward_after_round1"] >= line["eval/noise1x2/reward_after_round0"]
    assert line["cost"]["verifier_rows_per_item"] == 3 and line["cost"]["denoiser_rows_per_item"] >= 3 * 4 and "cost per item" in printed
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(line))
    assert main(["eval", "--spec", str(spec), "--out", str(tmp_path / "again.png")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reproduction"]["bit_for_bit"]
    for bad in (
        ["--noise-search", "-1"],
        ["--noise-search", "1", "--noise-step", "1.5"],
        ["--noise-neighbors", "2"],
        ["--noise-search", "1", "--rbf", "2"],
    ):
        assert main(["eval", config, *bad]) == 2
