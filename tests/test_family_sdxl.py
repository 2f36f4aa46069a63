"""Stable Diffusion XL through flowrl: the real StableDiffusionXLPipeline at tiny size (the dummy
components of diffusers' own SDXL tests), saved with ``save_pretrained`` and loaded through
``pipeline.pretrained=<dir>``; the conditioning is checked against the diffusers pipeline itself."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_components import (
    as_adjoint_matching,
    as_diffusion_nft,
    family_config,
    ode_sample,
    rescoring_ratio_is_one,
    tiny_clip_text,
    tiny_tokenizer,
    tiny_vae,
    two_iterations_change_every_parameter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of a cat", "a dog"]


def build_tiny_sdxl(directory, prediction_type: str = "epsilon", force_zeros_for_empty_prompt: bool = True, force_upcast: bool = True):
    from diffusers import (
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32,  # six time ids x 8 + text_encoder_2 projection
        cross_attention_dim=64,
        norm_num_groups=4,
    )  # 64 = 32 (text_encoder) + 32 (text_encoder_2)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
        prediction_type=prediction_type,
    )
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(force_upcast=force_upcast),
        text_encoder=tiny_clip_text(hidden=32, seed=0),
        text_encoder_2=tiny_clip_text(hidden=32, projection=True, seed=1),
        tokenizer=tiny_tokenizer(),
        tokenizer_2=tiny_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
        add_watermarker=False,
    )
    pipe.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sdxl_dir(tmp_path_factory):
    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl"))


@pytest.fixture(scope="module")
def sdxl_v_dir(tmp_path_factory):
    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl_v"), prediction_type="v_prediction")


def _adapter(directory, **kwargs):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    return build_pipeline(PipelineConfig(name="sdxl", pretrained=str(directory), device="cpu", **kwargs), "cpu")


def test_loads_through_flowrl_and_samples(sdxl_dir):
    from flowrl.pipelines.sdxl import SDXLAdapter

    pipe = _adapter(sdxl_dir)
    assert isinstance(pipe, SDXLAdapter) and pipe.prediction_type == "epsilon" and pipe.sample_size() == (16, 16)
    assert pipe.force_zeros_for_empty_prompt
    images = ode_sample(pipe, PROMPTS, guidance_scale=3.0)
    assert images.shape == (2, 3, 16, 16) and 0 <= images.min() and images.max() <= 1
    for encoder in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        assert not encoder.training and not any(p.requires_grad for p in encoder.parameters())
    cached = pipe.encode(["a dog", "a photo of a cat"])
    fresh = pipe._encode_prompts(["a dog", "a photo of a cat"])
    assert cached.keys() == fresh.keys() == {"prompt_embeds", "pooled_prompt_embeds"}
    assert all(torch.equal(cached[k], fresh[k]) for k in fresh)
    assert cached["prompt_embeds"].shape == (2, 16, 64) and cached["pooled_prompt_embeds"].shape == (2, 32)


def test_oracle_conditioning_and_cfg_prediction_equal_diffusers(sdxl_dir):
    """Our prompt/pooled embeddings, time_ids, unconditional branch and guided UNet output equal what
    StableDiffusionXLPipeline computes (encode_prompt, _get_add_time_ids, its CFG with zero negatives)."""
    from diffusers import StableDiffusionXLPipeline

    ref = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    pipe = _adapter(sdxl_dir)
    with torch.no_grad():
        pe, npe, pooled, npooled = ref.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=True)
    ours = pipe.encode(PROMPTS)
    diffs = {
        "prompt_embeds": (ours["prompt_embeds"] - pe).abs().max().item(),
        "pooled_prompt_embeds": (ours["pooled_prompt_embeds"] - pooled).abs().max().item(),
    }
    uncond = pipe.unconditional(2)
    assert torch.equal(uncond["prompt_embeds"], npe) and torch.equal(uncond["pooled_prompt_embeds"], npooled)
    assert not npe.any()  # force_zeros_for_empty_prompt: diffusers' negative branch is exact zeros

    h, w = pipe.sample_size()
    time_ids = ref._get_add_time_ids(
        (h, w), (0, 0), (h, w), dtype=pe.dtype, text_encoder_projection_dim=ref.text_encoder_2.config.projection_dim
    )
    assert torch.equal(pipe.time_ids(2), time_ids.repeat(2, 1))

    # the guided prediction at one noise level, against the pipeline's own UNet call and CFG formula
    x = torch.randn(2, *pipe.latent_shape(), generator=torch.Generator().manual_seed(0))
    sigma = pipe.schedule.sigmas(3)[1]
    t = pipe.timestep(sigma)
    scale = 4.0
    with torch.no_grad():
        out = ref.unet(
            torch.cat([x, x]),
            t,
            encoder_hidden_states=torch.cat([npe, pe]),
            added_cond_kwargs={"text_embeds": torch.cat([npooled, pooled]), "time_ids": torch.cat([time_ids, time_ids]).repeat(2, 1)},
        ).sample
        uncond_out, cond_out = out.chunk(2)
        expected = uncond_out + scale * (cond_out - uncond_out)
        got = pipe.predict(x, sigma, ours, scale)
    diffs["cfg_prediction"] = (got - expected).abs().max().item()
    print("oracle max |diff|:", diffs)
    assert max(diffs.values()) <= 1e-5, diffs
    assert (cond_out - uncond_out).abs().max() > 1e-3  # the two branches differ, so the CFG comparison means something


def test_default_grid_is_the_sdxl_pipelines_for_k_1_to_50(sdxl_dir):
    """SDXL base's EulerDiscreteScheduler config: "leading" with steps_offset 1. flowrl's grid equals the timesteps
    StableDiffusionXLPipeline sets up with its default arguments, and DDIMScheduler.from_config of the same file."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline

    from tests.test_family_stable_diffusion import assert_ddpm_grid_is_the_pipelines

    adapter = _adapter(sdxl_dir)
    assert (adapter.schedule.spacing, adapter.schedule.steps_offset) == ("leading", 1)
    ref = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    assert_ddpm_grid_is_the_pipelines(adapter, ref, prompt="a cat", guidance_scale=1.0)
    ddim = DDIMScheduler.from_config(ref.scheduler.config)
    for steps in (1, 7, 50):
        ddim.set_timesteps(steps)
        assert torch.equal(adapter.timestep(adapter.schedule.sigmas(steps))[:-1], ddim.timesteps)


def test_euler_config_without_spacing_reads_as_euler_does():
    """A missing timestep_spacing key means what the checkpoint's own scheduler class defaults to: "linspace" for
    EulerDiscreteScheduler, "leading" for DDIM / PNDM (flowrl then rounds Euler's fractional timesteps as DDIM does)."""
    from flowrl.samplers.schedules import config_default

    assert config_default({"_class_name": "EulerDiscreteScheduler"}, "timestep_spacing", "leading") == "linspace"
    assert config_default({"_class_name": "PNDMScheduler"}, "timestep_spacing", "trailing") == "leading"
    assert config_default({"_class_name": "DDIMScheduler", "timestep_spacing": "trailing"}, "timestep_spacing", "leading") == "trailing"
    assert config_default({"_class_name": "NoSuchScheduler"}, "steps_offset", 0) == 0


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_oracle_full_pipeline_call_equals_flowrl_ode(sdxl_dir, sdxl_v_dir, prediction):
    """End to end: StableDiffusionXLPipeline.__call__ with DDIMScheduler.from_config of the checkpoint's scheduler
    config (its leading grid, eta=0, CFG with its zero negatives) from the same initial noise gives flowrl's
    deterministic samples, latents and images."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline

    from flowrl.config import ODEConfig
    from flowrl.samplers import build_sampler
    from flowrl.samplers.rollout import rollout

    directory = sdxl_dir if prediction == "epsilon" else sdxl_v_dir
    pipe = _adapter(directory)
    steps, scale = 4, 5.0  # leading + 1: 751, 501, 251, 1
    traj = rollout(
        pipe,
        build_sampler(ODEConfig(), pipe),
        PROMPTS,
        [{}, {}],
        torch.arange(2),
        pipe.schedule.sigmas(steps),
        torch.Generator().manual_seed(0),
        scale,
        same_noise_in_group=False,
    )

    ref = StableDiffusionXLPipeline.from_pretrained(directory)
    # DDIM stands in for the Euler scheduler's step on the same grid; Euler never clips x0 (DDIM's default would)
    ref.scheduler = DDIMScheduler.from_config(ref.scheduler.config, clip_sample=False)
    ref.set_progress_bar_config(disable=True)
    h, w = pipe.sample_size()
    kwargs = {
        "prompt": PROMPTS,
        "height": h,
        "width": w,
        "num_inference_steps": steps,
        "guidance_scale": scale,
        "eta": 0.0,
        "latents": traj.latents[:, 0].clone(),
    }
    with torch.no_grad():
        latents = ref(**kwargs, output_type="latent").images
        images = ref(**kwargs, output_type="pt").images
    assert torch.equal(pipe.timestep(traj.sigmas)[:-1], ref.scheduler.timesteps)
    diffs = {"latents": (latents - traj.latents[:, -1]).abs().max().item(), "images": (images - traj.samples).abs().max().item()}
    print(f"full-pipeline oracle ({prediction}) max |diff|:", diffs)
    assert diffs["latents"] <= 1e-4 and diffs["images"] <= 1e-4, diffs
    with torch.no_grad():  # the comparison is sensitive: without guidance diffusers lands elsewhere
        unguided = ref(**{**kwargs, "guidance_scale": 1.0}, output_type="latent").images
    assert (unguided - traj.latents[:, -1]).abs().max() > 1e-3


def test_unconditional_without_force_zeros_is_the_encoding_of_empty(tmp_path):
    from diffusers import StableDiffusionXLPipeline

    directory = build_tiny_sdxl(tmp_path / "sdxl", force_zeros_for_empty_prompt=False, force_upcast=False)
    pipe = _adapter(directory, dtype="bfloat16")
    assert not pipe.force_zeros_for_empty_prompt and pipe.vae.dtype == torch.bfloat16  # no force_upcast: the VAE follows dtype
    ref = StableDiffusionXLPipeline.from_pretrained(directory)
    with torch.no_grad():
        _, npe, _, npooled = ref.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=True)
    uncond = pipe.unconditional(2)
    assert npe.abs().max() > 0
    torch.testing.assert_close(uncond["prompt_embeds"], npe.float(), atol=2e-2, rtol=0)  # bf16 text encoders here
    torch.testing.assert_close(uncond["pooled_prompt_embeds"], npooled.float(), atol=2e-2, rtol=0)


def test_force_upcast_vae_decodes_in_float32(sdxl_dir):
    pipe = _adapter(sdxl_dir, dtype="bfloat16")
    assert pipe.vae.config.force_upcast and pipe.vae.dtype == torch.float32
    assert pipe.text_encoder.dtype == torch.bfloat16
    images = pipe.decode(torch.randn(1, *pipe.latent_shape()))
    assert images.dtype == torch.float32 and images.shape == (1, 3, 16, 16)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_two_grpo_iterations_full_finetune(sdxl_dir, sdxl_v_dir, tmp_path, prediction):
    directory = sdxl_dir if prediction == "epsilon" else sdxl_v_dir
    trainer = two_iterations_change_every_parameter(
        family_config("sdxl", directory, tmp_path / "run", sampler="ddim", **{"rollout.guidance_scale": 3.0})
    )
    assert trainer.pipeline.prediction_type == prediction
    rescoring_ratio_is_one(trainer)


def test_two_adjoint_matching_iterations_full_finetune(sdxl_dir, tmp_path):
    two_iterations_change_every_parameter(
        as_adjoint_matching(family_config("sdxl", sdxl_dir, tmp_path / "run", **{"rollout.guidance_scale": 3.0}), flow=False)
    )


def test_two_diffusion_nft_iterations_full_finetune(sdxl_dir, tmp_path):
    two_iterations_change_every_parameter(as_diffusion_nft(family_config("sdxl", sdxl_dir, tmp_path / "run")))


def test_lora_round_trip_through_diffusers_load_lora_weights(sdxl_dir, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    from flowrl.pipelines import build_pipeline

    trainer = two_iterations_change_every_parameter(
        family_config(
            "sdxl", sdxl_dir, tmp_path / "run", sampler="ddim", **{"pipeline.lora": "{r: 4, alpha: 8}", "rollout.guidance_scale": 3.0}
        )
    )
    rescoring_ratio_is_one(trainer)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    ours = ode_sample(trainer.pipeline, PROMPTS, seed=3, guidance_scale=3.0)

    # the user's path: the base checkpoint + load_lora_weights(run checkpoint), nothing of flowrl
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    pipe.load_lora_weights(checkpoint)
    base_config = trainer.config.pipeline.model_copy(update={"lora": None})
    adapter = build_pipeline(base_config, "cpu")
    base = ode_sample(adapter, PROMPTS, seed=3, guidance_scale=3.0)
    adapter.denoiser = pipe.unet  # flowrl's sampler around the diffusers-loaded UNet + LoRA
    theirs = ode_sample(adapter, PROMPTS, seed=3, guidance_scale=3.0)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (base - ours).abs().max() > 1e-4, "the LoRA did not change the samples, so the round trip proves nothing"

    # merged export: a plain UNet whose outputs equal base + LoRA
    merged = trainer.pipeline.merged_denoiser()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter.denoiser = merged
    torch.testing.assert_close(ode_sample(adapter, PROMPTS, seed=3, guidance_scale=3.0), ours, atol=1e-4, rtol=0)


def test_not_an_sdxl_unet_fails_with_one_sentence(tmp_path):
    from flowrl.errors import FlowRLError
    from tests.tiny_components import build_tiny_sd

    directory = build_tiny_sd(tmp_path / "sd")
    with pytest.raises(FlowRLError, match="not an SDXL base checkpoint"):
        _adapter(directory)


def test_documented_real_checkpoint_overrides_validate():
    """docs/model_families/sdxl.md: the SD 1.5 DDPO preset with the SDXL overrides loads (no weights)."""
    from pathlib import Path

    from flowrl.config import load_config

    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs" / "model_families" / "sdxl.md").read_text()
    command = doc.split("```bash")[1].split("```")[0].replace("\\\n", " ").split()
    start = command.index("train") + 1
    config = load_config(repo / command[start], command[start + 1 :])
    assert config.pipeline.name == "sdxl" and config.pipeline.pretrained == "stabilityai/stable-diffusion-xl-base-1.0"
    assert config.pipeline.dtype == "bfloat16" and config.train.mixed_precision == "bf16" and config.pipeline.lora is not None
    assert (config.pipeline.height, config.pipeline.width) == (1024, 1024)
