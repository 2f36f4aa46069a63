"""SVDD-PM on the embedded model: M = 1 is exactly a plain stochastic rollout under either last step; the kept
candidate is the best look-ahead at every step but the last; the last step is the released code's (masa-ue/SVDD-image,
sd_pipeline.py: the first candidate, no choice) by default and the best finished candidate with ``last_step:
best_of_m``; the final score is the reward of the returned samples; and the CLI."""

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


@pytest.mark.parametrize("last_step", ["plain", "best_of_m"])
def test_one_candidate_is_a_plain_stochastic_rollout(trainer, last_step):
    model, items = _setting(trainer)
    noise = trainer.pipeline.initial_noise(len(items), torch.Generator().manual_seed(5))
    ours = svdd_sample(model, trainer.reward, items, 1, torch.Generator().manual_seed(7), initial_noise=noise, last_step=last_step)
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


class _Recording:
    """The run's reward, every call's samples kept."""

    def __init__(self, reward) -> None:
        self.reward, self.calls = reward, []

    def __call__(self, samples, prompts, metadata):
        self.calls.append(samples.clone())
        return self.reward(samples, prompts, metadata)


def test_the_last_step_is_the_first_candidate_and_best_of_m_keeps_the_best_of_the_same_candidates(trainer):
    model, items = _setting(trainer)
    prompts, metadata, k, m = items.prompts, items.metadata, model.sigmas.shape[0] - 1, 4
    chosen = _Recording(trainer.reward)
    best = svdd_sample(model, chosen, items, m, torch.Generator().manual_seed(0), last_step="best_of_m")
    released = svdd_sample(model, trainer.reward, items, m, torch.Generator().manual_seed(0))
    # every step but the last ran the same: the same candidates, valued the same
    assert best.step_scores.shape == (k, len(prompts), m) and released.step_scores.shape == (k - 1, len(prompts), m)
    torch.testing.assert_close(released.step_scores, best.step_scores[:-1], atol=0, rtol=0)
    # the released last step keeps each item's first final candidate; best_of_m scored the same M and kept the best
    first = chosen.calls[-1][torch.arange(len(prompts)) * m]
    torch.testing.assert_close(released.samples, first, atol=0, rtol=0)
    torch.testing.assert_close(released.scores, best.step_scores[-1][:, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(best.scores, best.step_scores[-1].max(1).values)
    assert (best.scores >= released.scores).all() and (best.scores > released.scores).any()
    for result in (best, released):  # the final score is the reward of the returned samples
        torch.testing.assert_close(trainer.reward(result.samples, prompts, metadata).scores.float(), result.scores, atol=1e-6, rtol=0)
    assert (best.step_scores.max(2).values > best.step_scores.min(2).values).any()  # the candidates differ


def test_deterministic_sampler_is_refused(trainer):
    model, items = _setting(trainer, 2, sampler=trainer.modality.eval_sampler)
    with pytest.raises(FlowRLError, match="deterministic"):
        svdd_sample(model, trainer.reward, items, 2, torch.Generator())


@pytest.mark.slow
def test_cli_svdd(tmp_path, capsys):
    from flowrl.cli import main

    out, run = tmp_path / "svdd.png", f"output_dir={tmp_path / 'run'}"
    overrides = ["eval.samples_per_prompt=1", "eval.num_inference_steps=4", run]
    assert main(["eval", str(GRPO), *overrides, "--svdd", "2", "--out", str(out)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out.is_file() and "eval/reward/mean@svdd2" in last and last["settings"]["sampler"] == "flow_sde"
    assert last["spec"]["method"] == {"name": "svdd", "m": 2, "last_step": "plain"}
    assert last["cost"]["denoiser_rows_per_item"] == 1 + 2 * 3 and last["cost"]["verifier_rows_per_item"] == 2 * 3 + 1
    assert main(["eval", str(GRPO), *overrides, "--svdd", "2", "--svdd-last-step", "best_of_m", "--out", str(out), "--overwrite"]) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert best["spec"]["method"]["last_step"] == "best_of_m" and best["cost"]["verifier_rows_per_item"] == 2 * 4
    assert main(["eval", str(GRPO), "--svdd", "0"]) == 2
    assert main(["eval", str(GRPO), "--svdd", "2", "--svdd-last-step", "best"]) == 2
    assert main(["eval", str(GRPO), "--svdd-last-step", "plain"]) == 2


@pytest.mark.slow
def test_the_inference_scaling_bench_runs_every_method_it_prints(tmp_path):
    """bench/inference_scaling.py end to end at a tiny budget: a row per method and the closing ratio (its loop once
    rebound the name the searches read the reward from, and every search after the first crashed)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    cmd = [sys.executable, str(REPO / "bench" / "inference_scaling.py")]
    cmd += ["eval.samples_per_prompt=1", "eval.num_inference_steps=3", "rollout.num_inference_steps=3", "--budgets", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["best-of-N"], ["zero-order"], ["svdd-pm"])]
    assert [r[0] for r in rows] == ["best-of-N", "zero-order", "svdd-pm"] and all(r[1] == "2" for r in rows)
    assert proc.stdout.strip().splitlines()[-1].startswith("svdd_gain_over_best_of_n=")
