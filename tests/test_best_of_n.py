"""Best-of-N on the embedded model: best-of-1 is the plain evaluation, the chosen candidate is each item's
argmax, the scaling curve is nested (monotone), non-finite rewards are never chosen, early stopping at a reward
(its degenerate settings, and each item's candidates unchanged by the others stopping), and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.inference.search import ImageSearchModel, Items
from flowrl.types import RewardOutput

GRPO = CONFIGS / "digits" / "grpo.yaml"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from flowrl.trainer import Trainer

    return Trainer(load_config(GRPO, fast_overrides(tmp_path_factory.mktemp("bon"), **{"eval.samples_per_prompt": 2})))


def _model(trainer, batch_size=None) -> ImageSearchModel:
    """The run's model with the plain evaluation's sampler and time grid, as ``flowrl eval --best-of`` searches it."""
    held = trainer.modality.held_out
    return ImageSearchModel(
        trainer.pipeline, trainer.modality.eval_sampler, held.sigmas, held.guidance_scale, batch_size or trainer.config.eval.batch_size
    )


def _best_of(trainer, n, stop_at=None):
    """Best-of-N on the run's held-out setting, as ``flowrl eval --best-of`` calls it."""
    from flowrl.inference.best_of_n import best_of_n

    held = trainer.modality.held_out
    return best_of_n(_model(trainer), trainer.reward, Items(held.prompts, held.metadata), n, held.generator(), stop_at=stop_at)


@pytest.mark.slow
def test_best_of_one_is_the_plain_evaluation(trainer):
    metrics, grid = trainer.evaluate(return_samples=True)
    result = _best_of(trainer, 1)
    assert result.scaling_curve()[1] == pytest.approx(metrics["eval/reward/mean"], abs=1e-6)
    torch.testing.assert_close(result.samples[: len(grid)], grid, atol=1e-6, rtol=0)
    assert result.best.eq(0).all()


@pytest.mark.slow
def test_chosen_candidate_is_the_argmax_and_the_curve_is_nested(trainer):
    result = _best_of(trainer, 5)
    scores = result.scores
    assert scores.shape == (len(result.best), 5) and torch.isfinite(scores).all()
    torch.testing.assert_close(scores.gather(1, result.best[:, None]).squeeze(1), scores.max(1).values)
    curve = result.scaling_curve()
    assert list(curve) == [1, 2, 4, 5]
    assert all(curve[a] <= curve[b] for a, b in zip(list(curve), list(curve)[1:]))
    assert curve[5] == pytest.approx(float(scores.max(1).values.mean()))
    assert curve[5] > curve[1]  # the candidates differ, so selection helps
    # The chosen samples really are the best: re-scoring them gives each row's maximum.
    held = trainer.modality.held_out
    rescored = trainer.reward(result.samples, held.prompts, held.metadata).scores
    torch.testing.assert_close(rescored.float(), scores.max(1).values, atol=1e-5, rtol=0)


class _FailsEverySecondCall:
    """The ink reward (mean intensity), but all NaN on every second call (a flaky verifier)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, samples, prompts, metadata):
        self.calls += 1
        ink = samples.float().flatten(1).mean(1)
        return RewardOutput(scores=ink if self.calls % 2 else torch.full_like(ink, float("nan")), extras={})


def test_nonfinite_rewards_are_never_chosen(trainer):
    from flowrl.inference.best_of_n import best_of_n

    held = trainer.modality.held_out
    items = Items(held.prompts[:3], held.metadata[:3])
    with pytest.warns(UserWarning, match="NaN or infinite"):  # one call per round of 3 prompts: rounds 1 and 3 fail
        result = best_of_n(_model(trainer, batch_size=4), _FailsEverySecondCall(), items, 4, held.generator()[:3])
    assert torch.isnan(result.scores[:, 1::2]).all() and torch.isfinite(result.scores[:, 0::2]).all()
    assert set(result.best.tolist()) <= {0, 2}
    torch.testing.assert_close(result.scores.gather(1, result.best[:, None]).squeeze(1), result.scores[:, 0::2].max(1).values)


@pytest.mark.slow
def test_cli_best_of(tmp_path):
    from flowrl.cli import main

    out = tmp_path / "best.png"
    overrides = ["eval.samples_per_prompt=1", f"output_dir={tmp_path / 'run'}"]
    assert main(["eval", str(GRPO), *overrides, "--best-of", "2", "--out", str(out)]) == 0
    assert out.is_file()
    assert main(["eval", str(GRPO), *overrides, "--best-of", "0"]) == 2
    assert main(["eval", str(CONFIGS / "dllm" / "diffu_grpo.yaml"), "--best-of", "2"]) == 2


@pytest.mark.slow
def test_cli_best_of_prints_the_curve(tmp_path, capsys):
    from flowrl.cli import main

    main(
        [
            "eval",
            str(GRPO),
            "eval.samples_per_prompt=1",
            f"output_dir={tmp_path / 'run'}",
            "--best-of",
            "3",
            "--out",
            str(tmp_path / "b.png"),
        ]
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"eval/reward/mean@1", "eval/reward/mean@2", "eval/reward/mean@3", "eval/reward/ink@3"} <= set(last)


@pytest.mark.slow
def test_stopping_at_a_reward_draws_each_items_candidates_until_one_reaches_it(trainer):
    full = _best_of(trainer, 4)
    n_items = len(full.best)
    never = _best_of(trainer, 4, stop_at=float("inf"))  # never reached: plain best-of-N, bit for bit
    assert torch.equal(never.samples, full.samples) and torch.equal(never.scores, full.scores) and never.draws.eq(4).all()
    first = _best_of(trainer, 4, stop_at=float("-inf"))  # reached at once: the plain evaluation's candidate
    assert first.draws.eq(1).all() and first.best.eq(0).all() and torch.equal(first.scores[:, 0], full.scores[:, 0])
    assert torch.isnan(first.scores[:, 1:]).all()
    threshold = float(full.scores[:, 0].median())  # about half the items stop after their first candidate
    stopped = _best_of(trainer, 4, stop_at=threshold)
    running = full.scores.cummax(1).values
    expected = torch.tensor([next((j + 1 for j in range(4) if running[i, j] >= threshold), 4) for i in range(n_items)])
    assert torch.equal(stopped.draws, expected) and 0 < int((expected == 1).sum()) < n_items
    for i in range(n_items):  # an item's candidates do not depend on which other items were still searching
        k = int(expected[i])
        assert torch.equal(stopped.scores[i, :k], full.scores[i, :k]) and torch.isnan(stopped.scores[i, k:]).all()
        assert int(stopped.best[i]) == int(full.scores[i, :k].argmax())


@pytest.mark.slow
def test_cli_stop_at(tmp_path, capsys):
    from flowrl.cli import main

    overrides = ["eval.samples_per_prompt=1", f"output_dir={tmp_path / 'run'}"]
    assert main(["eval", str(GRPO), *overrides, "--best-of", "2", "--stop-at", "1.3", "--out", str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr().out
    record = json.loads(out.strip().splitlines()[-1])
    assert "candidates drawn per item" in out and 1 <= record["eval/best_of2/draws_per_item"] <= 2
    assert record["spec"]["method"] == {"name": "best_of", "n": 2, "stop_at": 1.3}
    assert main(["eval", str(GRPO), "--stop-at", "1.3"]) == 2
    assert "give --best-of N" in capsys.readouterr().err
