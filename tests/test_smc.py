"""SMC / particle sampling toward p_base(x) exp(lambda r(x)) (flowrl/inference/smc.py, masked_smc.py).

Pinned: one particle is exactly a plain stochastic rollout (flow SDE and DDIM) or the plain masked generation, with the
same streams, bit for bit; the denoiser and reward rows the functions count are the rows the model and the reward
actually saw, and equal N K (and 1 + N (K - 1) forwards for the masked LM); resampling keeps N particles and never
picks a particle of weight 0; on the 2-D toy the weighted particles match the closed-form tilted target at N = 64
and miss it at N = 4 (the self-normalised weights' O(1/N) bias), and lambda = 0 is the base; ``flowrl eval --smc``
prints a spec that ``flowrl eval --spec`` reproduces bit for bit.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CONFIGS

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.evaluation.toy2d import MEAN_TOLERANCE, STD_RELATIVE_TOLERANCE, WEIGHT_TOLERANCE
from flowrl.inference.candidates import sample_and_score
from flowrl.inference.search import ImageSearchModel, Items, TextSearchModel
from flowrl.inference.sections import SMCConfig
from flowrl.inference.smc import (
    effective_sample_size,
    resample_indices,
    smc_in_batches,
    smc_sample,
    tempering_schedule,
    weighted_set,
    weighted_toy_comparison,
)
from flowrl.pipelines.toy2d import TWO_MODES, Toy2DPipeline, tilted_target
from flowrl.reward_models import build_reward
from flowrl.samplers.flow_sde import FlowSDEConfig
from flowrl.samplers.rollout import keyed_noise, rollout, start_noise
from flowrl.seeding import RowGenerators

GRPO = CONFIGS / "digits" / "grpo.yaml"
DDPM = CONFIGS / "digits" / "ddpo_ddpm.yaml"
TEXT = CONFIGS / "dllm" / "diffu_grpo.yaml"
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _digits(path):
    from flowrl.eval_command import image_model

    config = load_config(path, ["eval.samples_per_prompt=1", f"rollout.num_inference_steps={STEPS}", "train.num_threads=1"])
    parts, reward, held = image_model(config, None)
    return config, parts, reward, held


@pytest.fixture(scope="module")
def flow():
    return _digits(GRPO)


def _smc(parts, held, reward, p, generator, sampler=None, **settings):
    """``smc_sample`` on the first ``p`` held-out items with the rollout sampler (or ``sampler``); ``settings``: the SMC
    section's (n 1, lambda 10 unless given)."""
    model = ImageSearchModel(parts.pipeline, sampler or parts.sampler, held.sigmas, held.guidance_scale)
    return smc_sample(model, reward, Items(held.prompts[:p], held.metadata[:p]), SMCConfig(**{"n": 1, "lam": 10.0, **settings}), generator)


class _Count:
    """Counts the rows a callable is run on (the first argument's length)."""

    def __init__(self, fn):
        self.rows, self.fn = 0, fn

    def __call__(self, x, *args, **kwargs):
        self.rows += len(x)
        return self.fn(x, *args, **kwargs)


# ------------------------------------------------------------------ N = 1 is plain sampling


@pytest.mark.parametrize("path", [GRPO, DDPM], ids=["flow_sde", "ddim_eta1"])
def test_one_particle_is_a_plain_stochastic_rollout(path, flow):
    config, parts, reward, held = flow if path == GRPO else _digits(path)
    pipe, sampler, p = parts.pipeline, parts.sampler, 6
    prompts, metadata = held.prompts[:p], held.metadata[:p]
    # per-item streams (the held-out evaluation's): item i's start noise, then its steps' noise, from stream i
    gen = held.generator()[:p]
    noise = keyed_noise(pipe, gen)
    plain = rollout(pipe, sampler, prompts, metadata, torch.arange(p), held.sigmas, gen, held.guidance_scale, initial_noise=noise)
    ours = _smc(parts, held, reward, p, held.generator()[:p])
    torch.testing.assert_close(ours.samples, plain.samples, atol=0, rtol=0)
    assert ours.particles.shape == (p, 1, *plain.samples.shape[1:]) and (ours.log_weights == 0).all()
    assert not ours.resampled.any() and (ours.ess == 1).all()
    torch.testing.assert_close(ours.scores, reward(plain.samples, prompts, metadata).scores.float(), atol=0, rtol=0)
    # one generator for the whole batch: the same draws in the same order
    plain = rollout(pipe, sampler, prompts, metadata, torch.arange(p), held.sigmas, torch.Generator().manual_seed(3), held.guidance_scale)
    ours = _smc(parts, held, reward, p, torch.Generator().manual_seed(3), lam=1.0)
    torch.testing.assert_close(ours.samples, plain.samples, atol=0, rtol=0)


def test_one_particle_in_batches_is_the_plain_evaluation_with_the_rollout_sampler(flow):
    """What ``flowrl eval --smc 1`` runs: padded batches of eval.batch_size rows, item i from stream i."""
    config, parts, reward, held = flow
    p, batch = 7, 4  # two batches, the second padded
    prompts, metadata = held.prompts[:p], held.metadata[:p]
    gen = held.generator()[:p]
    model, items = ImageSearchModel(parts.pipeline, parts.sampler, held.sigmas, 1.0, batch), Items(prompts, metadata)
    plain = sample_and_score(model, reward, items, start_noise(parts.pipeline, p, gen), gen)
    ours = smc_in_batches(model, reward, items, SMCConfig(n=1, lam=1.0), held.generator()[:p])
    torch.testing.assert_close(ours.samples, plain.samples, atol=0, rtol=0)
    torch.testing.assert_close(ours.scores, plain.scores, atol=0, rtol=0)


# ------------------------------------------------------------------ counted work, resampling


@pytest.mark.parametrize("tempering", ["linear", "final"])
def test_counted_calls_are_the_rows_run_and_equal_their_formulas(flow, tempering):
    config, parts, reward, held = flow
    p, n, k = 5, 3, STEPS
    pipe = parts.pipeline
    predict, score = _Count(pipe.predict), _Count(reward)
    pipe.predict = predict
    try:
        result = _smc(parts, held, score, p, held.generator()[:p], n=n, lam=30.0, tempering=tempering)
    finally:
        del pipe.predict
    assert result.denoiser_calls == n * k and predict.rows == p * n * k  # N plain rollouts: the valuing output is the next step's
    assert result.reward_calls == (n * k if tempering == "linear" else n) and score.rows == p * result.reward_calls
    assert result.ess.shape == (k, p) and result.resampled.shape == (k, p) and not result.resampled[-1].any()
    assert result.lambdas.tolist() == tempering_schedule(tempering, 30.0, k).tolist()
    assert result.lambdas[0] == 0 and result.lambdas[-1] == 30.0


def test_resampling_keeps_the_particle_count_and_never_picks_a_dead_particle(flow):
    config, parts, reward, held = flow
    p, n = 4, 4
    result = _smc(parts, held, reward, p, held.generator()[:p], n=n, lam=100.0, ess_threshold=1.0)
    assert result.resampled[:-1].all() and result.resample_count.tolist() == [STEPS - 1] * p  # ESS < N at every step but the last
    assert result.particles.shape == (p, n, 1, 8, 8) and result.samples.shape == (p, 1, 8, 8)
    torch.testing.assert_close(result.weights.sum(1), torch.ones(p, dtype=torch.float64))
    torch.testing.assert_close(result.samples, result.particles[torch.arange(p), result.chosen], atol=0, rtol=0)
    torch.testing.assert_close(reward(result.samples, held.prompts[:p], held.metadata[:p]).scores.float(), result.scores, atol=1e-6, rtol=0)
    # the schemes themselves: N ancestors per item, zero weight never chosen, systematic's counts within 1 of N w
    log_w = torch.log(torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64))
    streams = RowGenerators([torch.Generator().manual_seed(i) for i in range(3)])
    for method in ("systematic", "multinomial"):
        idx = resample_indices(log_w, [0, 1, 2], streams, method)
        assert idx.shape == (3, 4) and not (log_w.gather(1, idx) == float("-inf")).any()
    counts = torch.stack([torch.bincount(r, minlength=4) for r in resample_indices(log_w, [0, 1, 2], streams, "systematic")])
    expected = 4 * log_w.exp()
    assert ((counts - expected).abs() < 1).all() and counts[1].tolist() == [0, 0, 4, 0]
    assert effective_sample_size(log_w).tolist() == pytest.approx([1 / 0.38, 1.0, 1 / 0.3])


def test_bad_arguments_are_refused(flow):
    from flowrl.inference import search_section

    config, parts, reward, held = flow
    with pytest.raises(FlowRLError, match="deterministic"):
        _smc(parts, held, reward, 2, torch.Generator(), sampler=parts.eval_sampler, n=2)
    with pytest.raises(FlowRLError, match="ends at lambda"):
        _smc(parts, held, reward, 2, torch.Generator(), n=2, lam=2.0, tempering=[0.0] * (STEPS + 1))
    # the section's bounds, one sentence naming the setting
    with pytest.raises(FlowRLError, match=r"^search 'smc': ess_threshold must be in \[0, 1\], got 1\.5\.$"):
        search_section({"name": "smc", "n": 2, "ess_threshold": 1.5})
    with pytest.raises(FlowRLError, match=r"^search 'smc': resampling is invalid: input should be 'systematic' or 'multinomial'"):
        search_section({"name": "smc", "n": 2, "resampling": "stratified"})


# ------------------------------------------------------------------ the 2-D toy: the weights are right

TOY_STEPS, BUDGET = 50, 16384  # flow-SDE steps (the base sampler is then within 1.5% of the base); particles per run


def _toy(reward_name: str, lam: float, n: int, seed: int = 0):
    pipe, reward = Toy2DPipeline(), build_reward(reward_name)
    p = BUDGET // n
    sigmas = pipe.schedule.sigmas(TOY_STEPS)
    model, items = ImageSearchModel(pipe, FlowSDEConfig().build(), sigmas), Items([""] * p, [{}] * p)
    result = smc_sample(model, reward, items, SMCConfig(n=n, lam=lam), torch.Generator().manual_seed(seed))
    points, weights = weighted_set(result)
    return result, weighted_toy_comparison(points, weights, tilted_target(TWO_MODES, reward, lam))


def _within(c) -> bool:
    return c.weight_error <= WEIGHT_TOLERANCE and c.mean_error <= MEAN_TOLERANCE and c.std_relative_error <= STD_RELATIVE_TOLERANCE


def test_toy_lambda_zero_weights_nothing_and_samples_the_base():
    result, comparison = _toy("linear2d", 0.0, 16)
    assert (result.log_weights == -math.log(16)).all() and not result.resampled.any() and result.reward_calls == 16
    assert _within(comparison), comparison.as_dict()


@pytest.mark.parametrize(("reward_name", "lam"), [("linear2d", 1.0), ("quadratic2d", 2.0)])
def test_toy_weighted_particles_approach_the_tilted_target_as_n_grows(reward_name, lam):
    """The same 16384 particles per run, as 4096 items x 4 or 256 x 64: at N = 4 the self-normalised weights' bias
    (linear: the rare mode over-weighted; quadratic: means pulled toward the base) is outside the tolerances of the
    Adjoint Matching check, at N = 64 every component's weight, mean and std is inside."""
    _, small = _toy(reward_name, lam, 4)
    _, large = _toy(reward_name, lam, 64)
    assert not _within(small), small.as_dict()
    assert _within(large), large.as_dict()
    assert large.weight_error + large.mean_error < small.weight_error + small.mean_error


# ------------------------------------------------------------------ masked-diffusion text


@pytest.fixture(scope="module")
def text():
    from flowrl.modalities.text import TextModality
    from flowrl.reward_models import build_reward_from_config

    config = load_config(TEXT, ["prompts.eval_size=8", "sampler.eval_temperature=1", "rollout.batch_size=8"])
    modality = TextModality(config, torch.device("cpu"))
    modality.pipeline.model.eval()
    return config, modality, build_reward_from_config(config.reward), [p for p, _ in modality.eval_pool]


def test_masked_smc_one_particle_is_the_plain_evaluation_and_counts_its_rows(text):
    from flowrl.inference.masked_smc import masked_smc, masked_smc_in_batches
    from flowrl.inference.text_candidates import build_scorer

    config, modality, grader, prompts = text
    lm, k = modality.pipeline, config.sampler.steps
    _, plain = modality.evaluate(grader, 0, 1)
    model = TextSearchModel(lm, config.sampler, config.pipeline.prompt_length, 1.0, config.eval.seed, 8)
    one = masked_smc_in_batches(model, build_scorer("likelihood"), prompts, SMCConfig(n=1, lam=1.0))
    assert one.completions == [r["completion"] for r in plain]
    assert one.denoiser_calls == k and one.reward_calls == k
    logits, scorer = _Count(lm.logits), _Count(build_scorer("likelihood"))
    scorer.name = "likelihood"
    lm.logits = logits
    try:
        n, p = 4, 6
        model = TextSearchModel(lm, config.sampler, None, 1.0, config.eval.seed, 8)
        result = masked_smc(model, scorer, prompts[:p], SMCConfig(n=n, lam=1.0, ess_threshold=1.0), torch.Generator().manual_seed(3))
    finally:
        del lm.logits
    assert result.denoiser_calls == 1 + n * (k - 1) and logits.rows == p * result.denoiser_calls  # as SVDD with M = N
    assert result.reward_calls == n * k and scorer.rows == p * n * k
    assert result.particle_ids.shape == (p, n, config.sampler.gen_length) and result.resample_count.sum() > 0
    assert result.lambdas[-1] == 1.0 and len(result.particles) == p and all(len(r) == n for r in result.particles)
    assert result.particle_ids.ne(lm.mask_token_id).all()
    torch.testing.assert_close(result.log_weights.exp().sum(1), torch.ones(p, dtype=torch.float64))


# ------------------------------------------------------------------ the command line and its spec


@pytest.mark.slow
def test_cli_smc_prints_a_spec_that_reruns_bit_for_bit(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "smc.png"
    assert main(["eval", str(GRPO), "eval.samples_per_prompt=1", f"output_dir={tmp_path / 'run'}", "--smc", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = json.loads(printed.strip().splitlines()[-1])
    assert out.is_file() and "SMC, 2 particles per item" in printed
    assert line["spec"]["method"] == {
        "name": "smc",
        "n": 2,
        "lambda": 10.0,
        "ess_threshold": 0.5,
        "tempering": "linear",
        "resampling": "systematic",
    }
    assert (
        line["denoiser_calls_per_item"] == 2 * 10 and line["reward_calls_per_item"] == 2 * 10 and line["settings"]["sampler"] == "flow_sde"
    )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(line))
    assert main(["eval", "--spec", str(spec), "--out", str(tmp_path / "again.png")]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["reproduction"]["bit_for_bit"] and again["reproduction"]["differing_fields"] == []
    assert again["spec"]["result"] == line["spec"]["result"]
    for bad in (["--smc", "0"], ["--smc", "2", "--svdd", "2"], ["--smc", "2", "--smc-ess-threshold", "1.5"], ["--smc-lambda", "3"]):
        assert main(["eval", str(GRPO), *bad]) == 2
    assert main(["eval", "--spec", str(spec), "--smc", "2"]) == 2


def test_cli_smc_on_a_diffusion_lm_reruns_bit_for_bit(tmp_path, capsys):
    from flowrl.cli import main

    args = ["eval", str(TEXT), "prompts.eval_size=4", "sampler.eval_temperature=1", f"output_dir={tmp_path / 'run'}"]
    assert main([*args, "--smc", "2", "--out", str(tmp_path / "smc.png")]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["spec"]["method"]["select"] == "likelihood" and line["spec"]["method"]["lambda"] == 1.0
    assert line["denoiser_calls_per_item"] == 1 + 2 * 7 and line["reward_calls_per_item"] == 2 * 8
    rows = [json.loads(r) for r in (tmp_path / "smc.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["particles"]) == 2 and r["completion"] in r["particles"] for r in rows)
    (tmp_path / "spec.json").write_text(json.dumps(line))
    assert main(["eval", "--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "again.png")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reproduction"]["bit_for_bit"]
    assert main([*args[:-2], "--smc", "2", "--out", str(tmp_path / "x.png")]) == 2  # temperature 0: identical particles
