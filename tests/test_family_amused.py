"""aMUSEd (masked-token images) through flowrl: the real diffusers / transformers classes (VQModel, UVit2DModel,
CLIPTextModelWithProjection, AmusedScheduler) at tiny size, saved as an AmusedPipeline with ``save_pretrained`` and
loaded through ``pipeline.name=amused, pipeline.pretrained=<dir>``; oracle checks against ``AmusedPipeline.__call__``
with its defaults."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowrl.pipelines.tiny.amused import CODEBOOK, build_tiny_amused  # noqa: F401
from tests.family_tester import FamilyTesterMixin, tiny_checkpoint
from tests.tiny_components import family_config, two_iterations_change_every_parameter

pytestmark = pytest.mark.usefixtures("one_thread")

amused_dir = tiny_checkpoint(build_tiny_amused)


@pytest.fixture(scope="module")
def adapter(amused_dir):
    from flowrl.pipelines import build_pipeline
    from flowrl.pipelines.amused import AmusedConfig

    return build_pipeline(AmusedConfig(pretrained=str(amused_dir), device="cpu"), "cpu")


@pytest.fixture(scope="module")
def sampler(adapter):
    from flowrl.samplers.masked_image import MaskedImageConfig

    return MaskedImageConfig().build(adapter)


def flowrl_rollout(adapter, sampler, prompts, steps, guidance, generator):
    from flowrl.samplers.rollout import rollout

    return rollout(
        adapter,
        sampler,
        prompts,
        [{} for _ in prompts],
        torch.arange(len(prompts)),
        adapter.schedule.sigmas(steps),
        generator,
        guidance,
        initial_noise=adapter.initial_noise(len(prompts), None),
    )


def test_sampler_is_amused_pipeline_with_default_arguments(amused_dir, adapter, sampler):
    """End to end: AmusedPipeline.__call__ with its defaults (12 steps, guidance 10, cosine schedule, choice
    temperature 2 -> 0, the empty negative prompt) and a seeded generator gives exactly flowrl's tokens and images
    from a generator with the same seed: the same random draws, in the same order, to the bit."""
    from diffusers import AmusedPipeline

    pipe = AmusedPipeline.from_pretrained(amused_dir)
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a handwritten seven", "digit 3", "the digit zero"]
    tokens = pipe(prompts, generator=torch.Generator().manual_seed(1), output_type="latent").images
    images = pipe(prompts, generator=torch.Generator().manual_seed(1), output_type="pt").images
    traj = flowrl_rollout(adapter, sampler, prompts, 12, 10.0, torch.Generator().manual_seed(1))
    assert torch.equal(traj.latents[:, -1].long().view(3, 8, 8), tokens)
    assert torch.equal(traj.samples, images)
    assert len(torch.unique(tokens)) > 3  # not a degenerate sample
    # the cosine schedule's masked counts after each step: floor(64 cos(pi/2 (i+1)/12)) in float32 (AmusedScheduler's
    # arithmetic: after step 8, 64 cos(pi/3) = 31.99999 leaves 31 masked, not 32), at least 1, then 0 after the last
    masked = (traj.latents == adapter.mask_token_id).sum(-1)
    cosine = [math.floor(64 * float(torch.cos(torch.tensor((i + 1) / 12) * math.pi / 2))) for i in range(11)]
    assert cosine[7] == 31
    assert masked.tolist() == [[64] + [max(1, c) for c in cosine] + [0]] * 3


def test_step_log_prob_is_the_committed_tokens_and_the_choice(adapter, sampler):
    """A step's log-prob on the real model: the committed tokens' log softmax(logits) summed over exactly the positions
    it unmasked (by hand), plus log P(C | x_C), the choice's probability (< 0 before the last step, 0 at it; its
    value against enumeration: tests/test_masked_image_step.py); ``score='committed_tokens'`` records the first part
    alone; re-scoring every recorded step at unchanged weights gives it back (ratio 1)."""
    from flowrl.samplers.masked_image import MaskedImageConfig

    traj = flowrl_rollout(adapter, sampler, ["digit 5", "a handwritten two"], 4, 3.0, torch.Generator().manual_seed(2))
    former = flowrl_rollout(
        adapter,
        MaskedImageConfig(score="committed_tokens").build(adapter),
        ["digit 5", "a handwritten two"],
        4,
        3.0,
        torch.Generator().manual_seed(2),
    )
    assert torch.equal(former.latents, traj.latents)  # the score changes nothing that is drawn
    assert traj.stochastic.all() and torch.isfinite(traj.log_probs).all()
    mask = adapter.mask_token_id
    with torch.no_grad():
        for k in range(4):
            x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
            logits = adapter.predict(x, traj.sigmas[k], traj.cond, 3.0)
            committed = (x == mask) & (x_next != mask)
            by_hand = torch.stack(
                [torch.log_softmax(logits[b].double(), -1)[committed[b], x_next[b][committed[b]].long()].sum() for b in range(2)]
            )
            assert torch.allclose(former.log_probs[:, k].double(), by_hand, atol=1e-5)
            choice = traj.log_probs[:, k] - former.log_probs[:, k]
            assert (choice < -0.1).all() if k < 3 else (choice == 0).all()
            rescored = sampler.step(logits, x, traj.sigmas[k], traj.sigmas[k + 1], x_next=x_next).log_prob
            assert torch.equal(rescored, traj.log_probs[:, k])
            assert (x_next[x != mask] == x[x != mask]).all()  # committed tokens are never re-masked or changed


class TestAmused(FamilyTesterMixin):
    """aMUSEd's token steps: GRPO through the decoder-read ink reward changes every transformer weight, and the first
    ratio is exactly 1 (a token's log-prob is recomputed bit for bit). The sampler oracle, the LoRA round trip (into
    a UVit2DModel) and the masked-token refusals are this module's own checks."""

    name, checkpoint, sampler, prediction_type = "amused", "amused_dir", "masked_image", "masked_tokens"
    grpo_overrides = {"rollout.guidance_scale": 3.0, "objective.clip_range": 10.0, "objective.name": "grpo"}
    ratio_atol = 0.0
    test_sampler_equals_the_diffusers_pipeline = None
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None
    test_two_adjoint_matching_iterations = None
    test_two_diffusion_nft_iterations = None
    test_lora_round_trip_through_diffusers_load_lora_weights = None
    test_loads_through_flowrl_and_samples = None

    def check_grpo_run(self, trainer, worst):
        assert trainer.objective.name == self.grpo_overrides["objective.name"]
        assert worst == 0.0  # a token's log-prob is recomputed bit for bit


class TestAmusedDDPO(TestAmused):
    """The same with DDPO's objective."""

    grpo_overrides = {**TestAmused.grpo_overrides, "objective.name": "ddpo"}


@pytest.mark.slow
def test_two_grpo_iterations_lora(amused_dir, tmp_path):
    """LoRA on the transformer's attention: every adapter tensor moves, the base stays, and the checkpoint's
    diffusers-format adapter loads back into a fresh UVit2DModel with load_lora_adapter."""
    pytest.importorskip("peft")
    from diffusers import UVit2DModel

    trainer = two_iterations_change_every_parameter(
        family_config(
            "amused",
            amused_dir,
            tmp_path / "run",
            sampler="masked_image",
            **{"rollout.guidance_scale": 3.0, "objective.clip_range": 10.0, "pipeline.lora": "{r: 4, alpha: 4}", "log.checkpoint_every": 2},
        )
    )
    trained = {n: p for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trained and all("lora" in n for n in trained)
    fresh = UVit2DModel.from_pretrained(amused_dir, subfolder="transformer")
    fresh.load_lora_adapter(
        str(tmp_path / "run" / "checkpoints" / "step_000002"), prefix=None, weight_name="pytorch_lora_weights.safetensors"
    )
    (loaded_name,) = fresh.peft_config  # the adapter's name in the fresh model
    state = fresh.state_dict()
    for name, p in trained.items():
        assert torch.equal(state[name.replace(".default.", f".{loaded_name}.")], p.detach()), name


def test_config_refuses_what_token_steps_cannot_train(amused_dir, adapter, tmp_path):
    from flowrl.config import load_config
    from flowrl.errors import FlowRLError
    from flowrl.samplers import FlowSDEConfig, build_sampler

    base = family_config("amused", amused_dir, tmp_path / "run", sampler="masked_image")
    with pytest.raises((FlowRLError, ValueError), match="grpo or ddpo"):
        load_config(None, [o for o in base if not o.startswith("objective.")] + ["objective.name=diffusion_nft"])
    with pytest.raises((FlowRLError, ValueError), match="objective.beta=0"):
        load_config(None, base + ["objective.beta=0.1"])
    with pytest.raises(FlowRLError, match="masked_image"):
        build_sampler(FlowSDEConfig(), adapter)  # a Gaussian step cannot step token logits


PRESET = Path(__file__).resolve().parents[1] / "flowrl" / "configs" / "digits" / "masked_grpo.yaml"


def preset_overrides(amused_dir, output_dir) -> list[str]:
    """The shipped preset on the tiny random model: 20 held-out items, 4 steps."""
    return [f"pipeline.pretrained={amused_dir}", f"output_dir={output_dir}", "eval.samples_per_prompt=1", "rollout.num_inference_steps=4"]


@pytest.fixture(scope="module")
def trainer(amused_dir, tmp_path_factory):
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)
    return Trainer(load_config(PRESET, preset_overrides(amused_dir, tmp_path_factory.mktemp("amused_eval"))))


def test_best_of_one_is_the_plain_evaluation(trainer):
    """flowrl eval --best-of on a masked-token model: candidate 0 of every item is the plain evaluation's sample (its
    per-item stream, drawn in the same order), so best-of-1 is the evaluation; further candidates continue the
    item's stream and differ (the all-masked start holds no randomness: the steps' draws make the candidates)."""
    from flowrl.inference.best_of_n import best_of_n
    from flowrl.inference.search import ImageSearchModel, Items

    metrics, grid = trainer.evaluate(return_samples=True)
    held = trainer.modality.held_out
    assert trainer.modality.eval_sampler is trainer.sampler

    model = ImageSearchModel(
        trainer.pipeline, trainer.modality.eval_sampler, held.sigmas, held.guidance_scale, trainer.config.eval.batch_size
    )

    def best(n):
        return best_of_n(model, trainer.reward, Items(held.prompts, held.metadata), n, held.generator())

    one, three = best(1), best(3)
    assert one.scaling_curve()[1] == pytest.approx(metrics["eval/reward/mean"], abs=1e-6)
    assert torch.equal(one.samples[: len(grid)], grid)
    assert torch.equal(three.scores[:, 0], one.scores[:, 0])
    assert (three.scores[:, 1] != three.scores[:, 0]).any()
    assert three.scaling_curve()[3] > three.scaling_curve()[1]


def test_svdd_with_one_candidate_is_a_plain_rollout(trainer):
    """SVDD on image tokens: M = 1 is exactly the stochastic rollout with the same generator (the look-ahead is the
    greedy fill of every masked token, which selects nothing at M = 1); with M = 3 and ``last_step: best_of_m`` the
    kept final candidate is each item's best and its reward is that of the returned samples."""
    from flowrl.inference.search import ImageSearchModel, Items
    from flowrl.inference.svdd import svdd_sample
    from flowrl.samplers.rollout import rollout

    held = trainer.modality.held_out
    prompts, metadata = held.prompts[:4], held.metadata[:4]
    pipeline, sampler, reward = trainer.pipeline, trainer.sampler, trainer.reward
    model, items = ImageSearchModel(pipeline, sampler, held.sigmas, held.guidance_scale), Items(prompts, metadata)
    ours = svdd_sample(model, reward, items, 1, torch.Generator().manual_seed(7))
    plain = rollout(
        pipeline,
        sampler,
        prompts,
        metadata,
        torch.arange(4),
        held.sigmas,
        torch.Generator().manual_seed(7),
        held.guidance_scale,
        initial_noise=pipeline.initial_noise(4, None),
    )
    assert torch.equal(ours.samples, plain.samples)
    three = svdd_sample(model, reward, items, 3, torch.Generator().manual_seed(7), last_step="best_of_m")
    assert torch.equal(three.scores, three.step_scores[-1].max(1).values)
    torch.testing.assert_close(reward(three.samples, prompts, metadata).scores.float(), three.scores, atol=1e-6, rtol=0)


def test_cli_best_of_and_svdd(amused_dir, tmp_path, capsys):
    """flowrl eval --best-of / --svdd on the preset: the JSON line names the masked-token sampler."""
    import json

    from flowrl.cli import main

    overrides = preset_overrides(amused_dir, tmp_path / "run")
    assert main(["eval", str(PRESET), *overrides, "--best-of", "2", "--out", str(tmp_path / "b.png")]) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert best["settings"]["sampler"] == "masked_image" and "eval/reward/mean@2" in best
    assert main(["eval", str(PRESET), *overrides, "--svdd", "2", "--out", str(tmp_path / "s.png")]) == 0
    svdd = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert svdd["settings"]["sampler"] == "masked_image"


def test_embedded_digits_masked_is_an_amused_pipeline_that_draws_the_prompted_digit():
    """The shipped digits_masked is an AmusedPipeline directory: diffusers' own __call__ (defaults: 12 steps, guidance
    10) and flowrl's sampler give the same tokens; its samples are the digit the prompt asks for."""
    from diffusers import AmusedPipeline

    from flowrl.pipelines import build_pipeline
    from flowrl.pipelines.amused import AmusedConfig
    from flowrl.pipelines.embedded_adapter import ASSETS
    from flowrl.reward_models.digit_classifier import DigitClassifierReward
    from flowrl.samplers.masked_image import MaskedImageConfig

    pipe = AmusedPipeline.from_pretrained(ASSETS / "digits_masked")
    pipe.set_progress_bar_config(disable=True)
    adapter = build_pipeline(AmusedConfig(pretrained="digits_masked", device="cpu"), "cpu")
    prompts = [f"handwritten digit {d}" for d in range(10)]
    tokens = pipe(prompts, generator=torch.Generator().manual_seed(3), output_type="latent").images
    traj = flowrl_rollout(adapter, MaskedImageConfig().build(adapter), prompts, 12, 10.0, torch.Generator().manual_seed(3))
    assert torch.equal(traj.latents[:, -1].long().view(10, 4, 4), tokens)
    # 40 samples at guidance 3 and 8 steps: the classifier gives the prompted digit 0.99 on average (0.97 at guidance 1)
    prompts = prompts * 4
    traj = flowrl_rollout(adapter, MaskedImageConfig().build(adapter), prompts, 8, 3.0, torch.Generator().manual_seed(3))
    prob = DigitClassifierReward()(traj.samples, prompts, [{"digit": d} for d in range(10)] * 4).scores
    assert float(prob.mean()) > 0.9, prob


def test_cli_sample_the_embedded_model_by_name(tmp_path):
    """flowrl sample digits_masked: a masked-token model has no ODE, so it samples with its own sampler."""
    from flowrl.cli import main

    out = tmp_path / "three.npy"
    assert main(["sample", "digits_masked", "--prompt", "digit 3", "-n", "2", "--steps", "8", "--out", str(out)]) == 0
    samples = torch.from_numpy(__import__("numpy").load(out))
    assert samples.shape == (2, 1, 8, 8) and 0 <= float(samples.min()) and float(samples.max()) <= 1
    assert not torch.equal(samples[0], samples[1])  # two draws, not one greedy image
