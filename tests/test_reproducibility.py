"""Reproducible by contract. A held-out sample's noise is keyed by its prompt's content and its sample index,
so a subset, a superset or a reordering of the held-out prompts gives bit-identical samples for the prompts
they share (images, and a diffusion LM sampled at temperature 1); the searches start from exactly those
samples."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.seeding import RowGenerators, content_key

GRPO = CONFIGS / "digits" / "grpo.yaml"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from flowrl.trainer import Trainer

    overrides = {"eval.samples_per_prompt": 2, "eval.batch_size": 4, "log.grid_prompts": 100}
    trainer = Trainer(load_config(GRPO, fast_overrides(tmp_path_factory.mktemp("keyed"), **overrides)))
    held = trainer.modality.held_out  # the first 3 prompts' 2 samples each: enough items, and quick
    trainer.modality.held_out = dataclasses.replace(
        held, prompts=held.prompts[:6], metadata=held.metadata[:6], sample_index=held.sample_index[:6]
    )
    return trainer


def _evaluate_items(trainer, items: list[int]) -> torch.Tensor:
    """The real held-out evaluation, run on the held-out items ``items`` (in that order)."""
    modality = trainer.modality
    full = modality.held_out
    modality.held_out = dataclasses.replace(
        full,
        prompts=[full.prompts[i] for i in items],
        metadata=[full.metadata[i] for i in items],
        sample_index=[full.sample_index[i] for i in items],
    )
    try:
        _, samples = modality.evaluate(trainer.reward, 0, 1)
    finally:
        modality.held_out = full
    return samples


def test_content_key_reads_the_prompt_and_plain_metadata_only():
    assert content_key("a 3", {"digit": 3}) == content_key("a 3", {"digit": 3, "image": object()})  # not plain JSON: left out
    assert content_key("a 3", {"digit": 3}) != content_key("a 3", {"digit": 4}) != content_key("a 4", {"digit": 4})
    assert content_key("a 3", {"b": 1, "a": 2}) == content_key("a 3", {"a": 2, "b": 1})  # key order does not matter
    streams = RowGenerators.by_content(0, ["x", "y", "x"], [{}, {}, {}], [0, 0, 1])
    draws = streams.randn((3, 4))
    assert not torch.equal(draws[0], draws[2])  # the same prompt's second sample draws its own noise
    assert torch.equal(RowGenerators.by_content(0, ["y"], [{}], [0]).randn((1, 4))[0], draws[1])


def test_a_subset_superset_or_reordering_of_the_held_out_prompts_gives_the_same_samples(trainer):
    full = trainer.modality.held_out
    n = len(full)
    assert n >= 6 and full.sample_index[:4] == [0, 1, 0, 1]
    everything = _evaluate_items(trainer, list(range(n)))
    assert len(everything) == n
    subset = [5, 0, 3]  # a reordered subset, the second sample of a prompt without its first
    torch.testing.assert_close(_evaluate_items(trainer, subset), everything[subset], atol=0, rtol=0)
    superset = [*range(n), 0, 2]  # the superset repeats items: each repeat is the item's own sample again
    torch.testing.assert_close(_evaluate_items(trainer, superset), everything[superset], atol=0, rtol=0)
    # the second sample of each prompt is not its first: the sample index is part of the key
    assert not torch.equal(everything[0], everything[1])


def test_best_of_n_and_noise_search_start_from_the_plain_evaluation_samples(trainer):
    from flowrl.inference.best_of_n import best_of_n
    from flowrl.inference.noise_search import zero_order_search
    from flowrl.inference.search import ImageSearchModel, Items

    held = trainer.modality.held_out
    plain = _evaluate_items(trainer, list(range(len(held))))
    size = trainer.config.eval.batch_size  # the contract: the same rows per denoiser call as the evaluation
    model = ImageSearchModel(trainer.pipeline, trainer.modality.eval_sampler, held.sigmas, held.guidance_scale, size)
    items = Items(held.prompts, held.metadata)
    assert len(held) % size != 0  # so the last batch is padded, in both
    bon = best_of_n(model, trainer.reward, items, 3, held.generator())
    # candidate 0 of every item is the plain evaluation's sample
    first = best_of_n(model, trainer.reward, items, 1, held.generator())
    torch.testing.assert_close(first.samples, plain, atol=0, rtol=0)
    torch.testing.assert_close(bon.scores[:, 0], first.scores[:, 0], atol=0, rtol=0)
    # with per-item streams, one round of fresh neighbours is still exactly best-of-(1 + neighbours)
    zo = zero_order_search(model, trainer.reward, items, 1, 2, 1.0, held.generator())
    torch.testing.assert_close(zo.samples, bon.samples, atol=0, rtol=0)


def test_a_diffusion_lm_completion_does_not_depend_on_the_other_prompts_or_the_batching():
    from flowrl.modalities.text import TextModality
    from flowrl.reward_models import build_reward_from_config

    config = load_config(
        CONFIGS / "dllm" / "diffu_grpo.yaml", ["prompts.eval_size=6", "sampler.eval_temperature=1", "rollout.batch_size=4"]
    )
    modality = TextModality(config, torch.device("cpu"))
    reward = build_reward_from_config(config.reward)
    pool = modality.eval_pool

    def completions(order: list[int], batch: int) -> list[str]:
        modality.eval_pool, config.rollout.batch_size = [pool[i] for i in order], batch
        try:
            return [r["completion"] for r in modality.evaluate(reward, 0, 1)[1]]
        finally:
            modality.eval_pool, config.rollout.batch_size = pool, 4

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        everything = completions(list(range(6)), 4)
        assert len(set(everything)) > 1
        assert completions([4, 1, 2], 2) == [everything[i] for i in (4, 1, 2)]
        assert completions([5, 4, 3, 2, 1, 0], 6) == everything[::-1]
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ the evaluation spec


def _printed_record(capsys) -> tuple[dict, str]:
    import json

    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]), err


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from flowrl.trainer import Trainer

    run = tmp_path_factory.mktemp("spec") / "run"
    overrides = {"eval.samples_per_prompt": 1, "eval.batch_size": 8}
    Trainer(load_config(GRPO, fast_overrides(run, **overrides))).fit()
    return run


@pytest.mark.slow
def test_training_records_a_complete_spec_that_flowrl_eval_reproduces_bit_for_bit(trained_run, tmp_path, capsys):
    import json

    from flowrl.cli import main

    summary = json.loads((trained_run / "summary.json").read_text())
    spec = summary["eval_spec"]
    assert spec["format"] == "flowrl.eval_spec" and spec["version"] == 1 and spec["method"] == {"name": "plain"}
    assert spec["model"]["checkpoint"] == str((trained_run / "checkpoints" / "step_000002").resolve())
    assert len(spec["model"]["weights_sha256"]) == 64 and spec["sampler"] == {"name": "ode"}
    assert spec["generation"]["steps"] == 4 and spec["generation"]["sample_shape"] == [1, 8, 8]
    assert spec["seeds"]["eval_seed"] == 1234 and spec["prompts"]["count"] == 20 and len(spec["prompts"]["sha256"]) == 64
    assert set(spec["reward"]["components"]) == {"ink", "digit_classifier"} and spec["judge"]["components"] == {
        "digit_realism": spec["judge"]["components"]["digit_realism"]
    }
    assert {"flowrl", "torch", "diffusers", "transformers"} <= set(spec["environment"]["versions"])
    assert (
        spec["result"]["eval/reward/mean"] == summary["eval_reward_final"]
        or abs(spec["result"]["eval/reward/mean"] - summary["eval_reward_final"]) < 1e-6
    )

    # re-run from summary.json: the same numbers, every bit
    assert main(["eval", "--spec", str(trained_run / "summary.json"), "--out", str(tmp_path / "x.png")]) == 0
    record, err = _printed_record(capsys)
    assert record["reproduction"]["bit_for_bit"] and record["reproduction"]["moved"] == {}
    assert record["spec"]["result"] == spec["result"] and record["spec"]["model"]["weights_sha256"] == spec["model"]["weights_sha256"]
    assert "reproduced bit for bit" in err

    # flowrl eval's own output line is a spec too; a changed environment is named, a moved number exits 1
    assert main(["eval", str(trained_run / "checkpoints" / "step_000002")]) == 0
    line, _ = _printed_record(capsys)
    assert line["spec"]["result"] == spec["result"]
    line["spec"]["environment"]["versions"]["torch"] = "0.0.1"
    line["spec"]["result"]["eval/reward/mean"] += 1e-9
    edited = tmp_path / "edited.jsonl"
    edited.write_text("some text flowrl printed\n" + json.dumps(line) + "\n")
    assert main(["eval", "--spec", str(edited)]) == 1
    record, err = _printed_record(capsys)
    assert list(record["reproduction"]["moved"]) == ["eval/reward/mean"]
    assert any(d.startswith('environment.versions.torch: "0.0.1" -> ') for d in record["reproduction"]["differing_fields"])
    assert "NOT reproduced: 1 of" in err and "differs: environment.versions.torch" in err


@pytest.mark.slow
def test_best_of_n_records_its_spec_and_reproduces(trained_run, tmp_path, capsys):
    from flowrl.cli import main

    ckpt = trained_run / "checkpoints" / "step_000002"
    assert main(["eval", str(ckpt), "--best-of", "2", "--out", str(tmp_path / "b.png")]) == 0
    record, _ = _printed_record(capsys)
    assert record["spec"]["method"] == {"name": "best_of", "n": 2} and set(record["spec"]["result"]) >= {
        "eval/reward/mean@1",
        "eval/reward/mean@2",
    }
    (tmp_path / "spec.json").write_text(__import__("json").dumps(record["spec"]))
    assert main(["eval", "--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "b2.png")]) == 0
    again, _ = _printed_record(capsys)
    assert again["reproduction"]["bit_for_bit"] and again["reproduction"]["differing_fields"] == []


@pytest.mark.slow
def test_a_spec_recorded_with_relative_paths_re_runs_from_another_directory(trained_run, tmp_path, capsys, monkeypatch):
    import json

    from flowrl.cli import main

    monkeypatch.chdir(trained_run.parent)
    assert main(["eval", "run/checkpoints/step_000002", "--out", str(tmp_path / "a.png")]) == 0
    record, _ = _printed_record(capsys)
    assert record["spec"]["model"]["checkpoint"] == str((trained_run / "checkpoints" / "step_000002").resolve())
    (tmp_path / "spec.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)  # elsewhere: every path the spec names is absolute
    assert main(["eval", "--spec", "spec.json", "--out", "b.png"]) == 0
    again, _ = _printed_record(capsys)
    assert again["reproduction"]["bit_for_bit"]


def test_config_paths_in_a_spec_are_absolute_when_they_name_a_file(tmp_path, monkeypatch):
    from flowrl.evaluation.spec import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("a seven\n")
    (tmp_path / "model").mkdir()
    tree = {
        "pipeline": {"name": "digits", "pretrained": "model"},
        "prompts": {"dataset": "file", "train_file": "prompts.txt", "eval_file": "missing.txt"},
        "resume_from": "latest",
        "output_dir": "runs/x",
    }
    assert absolute_paths(tree) == {
        "pipeline": {"name": "digits", "pretrained": str(tmp_path / "model")},
        "prompts": {"dataset": "file", "train_file": str(tmp_path / "prompts.txt"), "eval_file": "missing.txt"},
        "resume_from": "latest",  # a keyword, not a path here
        "output_dir": "runs/x",  # where a run writes: not read by a re-run
    }
    assert absolute_paths("digits_flow", "pretrained") == "digits_flow"  # an embedded model's name


def test_a_diffusion_lm_evaluation_spec_reproduces(tmp_path, capsys):
    from flowrl.cli import main

    assert main(["eval", str(CONFIGS / "dllm" / "diffu_grpo.yaml"), "prompts.eval_size=4", f"output_dir={tmp_path / 'run'}"]) == 0
    record, _ = _printed_record(capsys)
    spec = record["spec"]
    assert spec["sampler"]["name"] == "masked" and spec["generation"]["gen_length"] == spec["config"]["sampler"]["gen_length"]
    assert spec["model"]["checkpoint"] is None and spec["prompts"]["count"] == 4
    (tmp_path / "spec.json").write_text(__import__("json").dumps(record))
    assert main(["eval", "--spec", str(tmp_path / "spec.json")]) == 0
    again, _ = _printed_record(capsys)
    assert again["reproduction"]["bit_for_bit"]


def test_bad_spec_files_are_one_sentence(tmp_path, capsys):
    from flowrl.cli import main

    (tmp_path / "none.json").write_text('{"a": 1}')
    assert main(["eval", "--spec", str(tmp_path / "none.json")]) == 2
    assert "holds no flowrl evaluation spec" in capsys.readouterr().err
    assert main(["eval", "--spec", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(GRPO), "--spec", str(tmp_path / "none.json")]) == 2
    assert "give it alone" in capsys.readouterr().err


# ------------------------------------------------------------------ deterministic mode


@pytest.mark.slow
def test_deterministic_mode_gives_bit_identical_weights_run_to_run(tmp_path):
    import os

    from flowrl.trainer import Trainer

    before = torch.are_deterministic_algorithms_enabled()
    try:
        weights = []
        for name in ("a", "b"):  # two runs in one process: their own trainers, the same config
            trainer = Trainer(load_config(GRPO, fast_overrides(tmp_path / name, **{"train.deterministic": True})))
            assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"]
            assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
            initial = {k: v.detach().clone() for k, v in trainer.pipeline.denoiser.state_dict().items()}
            for iteration in range(2):  # the training iterations themselves (collect, score, update)
                trainer.train_iteration(iteration)
            weights.append({k: v.detach().clone() for k, v in trainer.pipeline.denoiser.state_dict().items()})
        assert weights[0].keys() == weights[1].keys()
        for key in weights[0]:
            assert torch.equal(weights[0][key], weights[1][key]), key
        assert any(not torch.equal(initial[k], weights[1][k]) for k in initial)  # the updates changed the weights
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cudnn.deterministic = False
