"""Stable Diffusion 1.x/2.x through flowrl: real diffusers classes at tiny size, saved with
``save_pretrained`` and loaded through ``pipeline.pretrained=<dir>``."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_components import (
    as_adjoint_matching,
    as_diffusion_nft,
    build_tiny_sd,
    family_config,
    ode_sample,
    rescoring_ratio_is_one,
    two_iterations_change_every_parameter,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    return build_tiny_sd(tmp_path_factory.mktemp("tiny_sd"))


@pytest.fixture(scope="module")
def sd_v_dir(tmp_path_factory):
    return build_tiny_sd(tmp_path_factory.mktemp("tiny_sd_v"), prediction_type="v_prediction")


def pipeline_default_grid(pipe, steps: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(timesteps, sigmas) a diffusers pipeline sets up for ``num_inference_steps=steps`` with its default
    arguments (no ``sigmas=`` / ``timesteps=``): the real ``__call__``, interrupted after its first step so that
    K = 1..50 stays cheap (``set_timesteps`` has run by then; the interrupt only skips the remaining steps)."""

    def stop(pipeline, i, t, callback_kwargs):
        pipeline._interrupt = True
        return callback_kwargs

    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pipe(num_inference_steps=steps, output_type="latent", callback_on_step_end=stop, **kwargs)
    sigmas = getattr(pipe.scheduler, "sigmas", None)
    return pipe.scheduler.timesteps.clone(), None if sigmas is None else sigmas.clone()


def assert_ddpm_grid_is_the_pipelines(adapter, pipe, **kwargs) -> None:
    """For K = 1..50 flowrl's grid, mapped through the adapter's timestep(), is the pipeline's own timesteps
    (then -1: clean data)."""
    for steps in range(1, 51):
        theirs, _ = pipeline_default_grid(pipe, steps, **kwargs)
        ours = adapter.timestep(adapter.schedule.sigmas(steps))
        assert ours[-1] == -1 and torch.equal(ours[:-1], theirs.to(torch.int64)), (steps, ours, theirs)
        assert torch.equal(theirs.to(torch.int64).double(), theirs.double())  # integer timesteps: nothing was rounded away


def test_default_grid_is_stable_diffusion_pipelines_for_k_1_to_50(sd_dir):
    """SD1.x/2.x configs: "leading" spacing with steps_offset 1 (981, 961, ..., 1 at K = 50), the grid of
    StableDiffusionPipeline (and DDPO, which samples through its DDIM scheduler); not flowrl's old trailing grid."""
    from diffusers import StableDiffusionPipeline

    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    adapter = build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(sd_dir), device="cpu"), "cpu")
    assert adapter.schedule.spacing == "leading" and adapter.schedule.steps_offset == 1
    assert adapter.timestep(adapter.schedule.sigmas(50)).tolist() == list(range(981, 0, -20)) + [-1]
    pipe = StableDiffusionPipeline.from_pretrained(sd_dir)
    assert_ddpm_grid_is_the_pipelines(adapter, pipe, prompt="a cat", guidance_scale=1.0)
    # another grid stays selectable
    trailing = build_pipeline(
        PipelineConfig(name="stable_diffusion", pretrained=str(sd_dir), device="cpu").model_copy(update={"sampling_grid": "trailing"}),
        "cpu",
    )
    assert trailing.timestep(trailing.schedule.sigmas(50)).tolist() == list(range(999, 0, -20)) + [-1]


def test_pndm_checkpoint_samples_on_ddim_s_grid_of_its_config(sd_dir, tmp_path):
    """SD1.5 ships a PNDMScheduler config (no timestep_spacing key, steps_offset 1, set_alpha_to_one false): flowrl's
    grid is what DDIMScheduler.from_config of that file gives, as in DDPO (PLMS repeats one timestep; flowrl does not)."""
    import shutil

    from diffusers import DDIMScheduler, PNDMScheduler

    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    directory = tmp_path / "sd15_like"
    shutil.copytree(sd_dir, directory)
    shutil.rmtree(directory / "scheduler")
    PNDMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1
    ).save_pretrained(directory / "scheduler")
    adapter = build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(directory), device="cpu"), "cpu")
    ddim = DDIMScheduler.from_pretrained(directory, subfolder="scheduler")
    assert adapter.schedule.final_alpha_cumprod == float(ddim.alphas_cumprod[0])  # set_alpha_to_one=False
    for steps in range(1, 51):
        ddim.set_timesteps(steps)
        assert torch.equal(adapter.timestep(adapter.schedule.sigmas(steps))[:-1], ddim.timesteps), steps


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_ode_equals_stable_diffusion_pipeline_with_default_arguments(sd_dir, sd_v_dir, prediction):
    """End to end: StableDiffusionPipeline.__call__ with its defaults (its DDIM scheduler, eta 0, the config's
    leading grid, CFG) from the same initial latents gives flowrl's deterministic samples."""
    from diffusers import StableDiffusionPipeline

    from flowrl.config import ODEConfig, PipelineConfig
    from flowrl.pipelines import build_pipeline
    from flowrl.samplers import build_sampler
    from flowrl.samplers.rollout import rollout

    directory = sd_dir if prediction == "epsilon" else sd_v_dir
    adapter = build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(directory), device="cpu"), "cpu")
    steps, scale, prompts = 7, 5.0, ["a photo of a cat", "a dog"]  # 1000 // 7 = 142: 853, 711, ..., 1
    traj = rollout(
        adapter,
        build_sampler(ODEConfig(), adapter),
        prompts,
        [{}, {}],
        torch.arange(2),
        adapter.schedule.sigmas(steps),
        torch.Generator().manual_seed(0),
        scale,
        same_noise_in_group=False,
    )
    pipe = StableDiffusionPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        theirs = pipe(
            prompts, num_inference_steps=steps, guidance_scale=scale, latents=traj.latents[:, 0].clone(), output_type="latent"
        ).images
    assert torch.equal(adapter.timestep(traj.sigmas)[:-1], pipe.scheduler.timesteps)
    diff = float((theirs - traj.latents[:, -1]).abs().max())
    print(f"StableDiffusionPipeline oracle ({prediction}): max |diff| {diff:.2e}")
    assert diff <= 1e-4


def test_loads_through_flowrl_and_samples(sd_dir):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    pipe = build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(sd_dir), device="cpu"), "cpu")
    assert pipe.prediction_type == "epsilon" and pipe.sample_size() == (16, 16)
    images = ode_sample(pipe, ["a photo of a cat", "a dog"])
    assert images.shape == (2, 3, 16, 16) and 0 <= images.min() and images.max() <= 1
    assert not pipe.text_encoder.training and not any(p.requires_grad for p in pipe.text_encoder.parameters())
    assert not any(p.requires_grad for p in pipe.vae.parameters())
    # the prompt cache returns exactly what the text encoder gives
    cached = pipe.encode(["a dog", "a photo of a cat"])["prompt_embeds"]
    fresh = pipe._encode_prompts(["a dog", "a photo of a cat"])["prompt_embeds"]
    assert torch.equal(cached, fresh)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_two_grpo_iterations_full_finetune(sd_dir, sd_v_dir, tmp_path, prediction):
    directory = sd_dir if prediction == "epsilon" else sd_v_dir
    trainer = two_iterations_change_every_parameter(
        family_config("stable_diffusion", directory, tmp_path / "run", sampler="ddim", **{"rollout.guidance_scale": 3.0})
    )
    assert trainer.pipeline.prediction_type == prediction
    rescoring_ratio_is_one(trainer)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_two_adjoint_matching_iterations_full_finetune(sd_dir, sd_v_dir, tmp_path, prediction):
    directory = sd_dir if prediction == "epsilon" else sd_v_dir
    two_iterations_change_every_parameter(
        as_adjoint_matching(family_config("stable_diffusion", directory, tmp_path / "run", **{"rollout.guidance_scale": 3.0}), flow=False)
    )


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_two_diffusion_nft_iterations_full_finetune(sd_dir, sd_v_dir, tmp_path, prediction):
    """DiffusionNFT on DDPM parametrisations: ODE (DDIM eta 0) rollouts, the forward-process loss in x0 space."""
    directory = sd_dir if prediction == "epsilon" else sd_v_dir
    two_iterations_change_every_parameter(as_diffusion_nft(family_config("stable_diffusion", directory, tmp_path / "run")))


def test_lora_round_trip_through_diffusers_load_lora_weights(sd_dir, tmp_path):
    from diffusers import StableDiffusionPipeline

    from flowrl.pipelines import build_pipeline

    trainer = two_iterations_change_every_parameter(
        family_config("stable_diffusion", sd_dir, tmp_path / "run", sampler="ddim", **{"pipeline.lora": "{r: 4, alpha: 8}"})
    )
    rescoring_ratio_is_one(trainer)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    ours = ode_sample(trainer.pipeline, ["a photo of a cat", "a dog"], seed=3)

    # the user's path: the base checkpoint + load_lora_weights(run checkpoint), nothing of flowrl
    pipe = StableDiffusionPipeline.from_pretrained(sd_dir)
    pipe.load_lora_weights(checkpoint)
    adapter = build_pipeline(trainer.config.pipeline.model_copy(update={"lora": None}), "cpu")
    adapter.denoiser = pipe.unet  # flowrl's sampler around the diffusers-loaded UNet + LoRA
    theirs = ode_sample(adapter, ["a photo of a cat", "a dog"], seed=3)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    base = ode_sample(
        build_pipeline(trainer.config.pipeline.model_copy(update={"lora": None}), "cpu"), ["a photo of a cat", "a dog"], seed=3
    )
    assert (base - ours).abs().max() > 1e-4, "the LoRA did not change the samples, so the round trip proves nothing"

    # merged export: a plain UNet whose outputs equal base + LoRA
    merged = trainer.pipeline.merged_denoiser()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter.denoiser = merged
    torch.testing.assert_close(ode_sample(adapter, ["a photo of a cat", "a dog"], seed=3), ours, atol=1e-4, rtol=0)

    # `flowrl export`: a standalone diffusers directory with the LoRA merged in, and the LoRA file alone
    from flowrl.cli import main

    assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0
    exported = StableDiffusionPipeline.from_pretrained(tmp_path / "merged")
    adapter.denoiser = exported.unet
    torch.testing.assert_close(ode_sample(adapter, ["a photo of a cat", "a dog"], seed=3), ours, atol=1e-4, rtol=0)
    assert main(["export", str(checkpoint), str(tmp_path / "lora"), "--lora-only"]) == 0
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert main(["export", str(checkpoint), str(tmp_path / "lora")]) == 2  # exists: refused, nothing touched


def test_bad_sources_fail_with_one_sentence(tmp_path):
    from flowrl.config import PipelineConfig
    from flowrl.errors import FlowRLError
    from flowrl.pipelines import build_pipeline

    with pytest.raises(FlowRLError, match="not an existing model directory"):
        build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(tmp_path / "missing")), "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlowRLError, match="could not load"):
        build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(tmp_path / "empty")), "cpu")


def test_bf16_lora_with_autocast_keeps_fp32_step_math(sd_dir, tmp_path):
    """bf16 base weights + fp32 LoRA + bf16 autocast: trains, log-probs are fp32, re-scoring ratio == 1."""
    trainer = two_iterations_change_every_parameter(
        family_config(
            "stable_diffusion",
            sd_dir,
            tmp_path / "run",
            sampler="ddim",
            **{"pipeline.lora": "{r: 4, alpha: 4}", "pipeline.dtype": "bfloat16", "train.mixed_precision": "bf16"},
        )
    )
    pipe = trainer.pipeline
    assert pipe.text_encoder.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16
    lora = [p for n, p in pipe.denoiser.named_parameters() if "lora" in n]
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora)
    assert all(p.dtype == torch.bfloat16 for n, p in pipe.denoiser.named_parameters() if "lora" not in n)
    traj = trainer.collect(0)
    assert traj.log_probs.dtype == torch.float32 and traj.latents.dtype == torch.float32
    rescoring_ratio_is_one(trainer)


def test_gradient_checkpointing_gives_the_same_gradients(sd_dir):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    grads = []
    for checkpointing in (False, True):
        pipe = build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(sd_dir), gradient_checkpointing=checkpointing), "cpu")
        pipe.denoiser.train()
        assert pipe.denoiser.is_gradient_checkpointing == checkpointing
        x = torch.randn(2, *pipe.latent_shape(), generator=torch.Generator().manual_seed(0))
        pipe.predict(x, torch.tensor(0.5), pipe.encode(["a cat", "a dog"]), 2.0).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in pipe.denoiser.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_xformers_missing_is_one_sentence(sd_dir):
    import importlib.util

    from flowrl.config import PipelineConfig
    from flowrl.errors import FlowRLError
    from flowrl.pipelines import build_pipeline

    if importlib.util.find_spec("xformers") is not None:
        pytest.skip("xformers is installed here")
    with pytest.raises(FlowRLError, match="needs the xformers package"):
        build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(sd_dir), attention="xformers"), "cpu")
