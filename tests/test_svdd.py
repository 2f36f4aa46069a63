"""SVDD-PM on the embedded model: M = 1 is exactly a plain stochastic rollout, the kept candidate is the best
look-ahead at every step, the final score is the reward of the returned samples, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.inference.search import ImageSearchModel, Items
from flowrl.inference.svdd import svdd_sample
from flowrl.samplers.rollout import rollout

GRPO = CONFIGS / "digits" / "grpo.yaml"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from flowrl.trainer import Trainer

    return Trainer(load_config(GRPO, fast_overrides(tmp_path_factory.mktemp("svdd"), **{"eval.samples_per_prompt": 1})))


def _setting(trainer, n=6, sampler=None):
    """The run's model stepping with its rollout sampler (or ``sampler``), and its first ``n`` held-out items."""
    held = trainer.modality.held_out
    model = ImageSearchModel(trainer.pipeline, sampler or trainer.sampler, held.sigmas, held.guidance_scale)
    return model, Items(held.prompts[:n], held.metadata[:n])


def test_one_candidate_is_a_plain_stochastic_rollout(trainer):
    model, items = _setting(trainer)
    noise = trainer.pipeline.initial_noise(len(items), torch.Generator().manual_seed(5))
    ours = svdd_sample(model, trainer.reward, items, 1, torch.Generator().manual_seed(7), initial_noise=noise)
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


def test_best_lookahead_is_kept_and_the_final_score_is_the_samples_reward(trainer):
    model, items = _setting(trainer)
    prompts, metadata = items.prompts, items.metadata
    result = svdd_sample(model, trainer.reward, items, 4, torch.Generator().manual_seed(0))
    assert result.step_scores.shape == (model.sigmas.shape[0] - 1, len(prompts), 4)
    # At the last step the candidates are final samples, so the kept one carries its row's best score,
    # and re-scoring the returned samples gives exactly that score.
    torch.testing.assert_close(result.scores, result.step_scores[-1].max(1).values)
    torch.testing.assert_close(trainer.reward(result.samples, prompts, metadata).scores.float(), result.scores, atol=1e-6, rtol=0)
    assert (result.step_scores.max(2).values > result.step_scores.min(2).values).any()  # the candidates differ


def test_deterministic_sampler_is_refused(trainer):
    model, items = _setting(trainer, 2, sampler=trainer.modality.eval_sampler)
    with pytest.raises(FlowRLError, match="deterministic"):
        svdd_sample(model, trainer.reward, items, 2, torch.Generator())


@pytest.mark.slow
def test_cli_svdd(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "svdd.png"
    assert main(["eval", str(GRPO), "eval.samples_per_prompt=1", f"output_dir={tmp_path / 'run'}", "--svdd", "2", "--out", str(out)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out.is_file() and "eval/reward/mean@svdd2" in last and last["settings"]["sampler"] == "flow_sde"
    assert main(["eval", str(GRPO), "--svdd", "0"]) == 2
