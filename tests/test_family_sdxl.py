"""Stable Diffusion XL through flowrl: the real StableDiffusionXLPipeline at tiny size (the dummy
components of diffusers' own SDXL tests), saved with ``save_pretrained`` and loaded through
``pipeline.pretrained=<dir>``; the conditioning is checked against the diffusers pipeline itself."""

from __future__ import annotations

import operator

import pytest
import torch

from flowrl.pipelines.tiny.unet import build_tiny_sdxl
from tests.family_tester import FamilyTesterMixin, tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of a cat", "a dog"]


sdxl_dir = tiny_checkpoint(build_tiny_sdxl)
sdxl_v_dir = tiny_checkpoint(build_tiny_sdxl, prediction_type="v_prediction")


def _adapter(directory, **kwargs):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    return build_pipeline(PipelineConfig(name="sdxl", pretrained=str(directory), device="cpu", **kwargs), "cpu")


class TestSDXL(FamilyTesterMixin):
    """SDXL base: two CLIP text encoders, pooled embeddings and time ids, CFG with zero negatives; the Euler
    scheduler's "leading" grid with steps_offset 1."""

    name, checkpoint, pipeline_class, denoiser = "sdxl", "sdxl_dir", "StableDiffusionXLPipeline", "unet"
    flow, sampler, prediction_type = False, "ddim", "epsilon"
    grpo_overrides = adjoint_matching_overrides = {"rollout.guidance_scale": 3.0}
    lora_overrides, lora_guidance_scale = {"pipeline.lora": "{r: 4, alpha: 8}", "rollout.guidance_scale": 3.0}, 3.0
    # leading + 1: 751, 501, 251, 1; the initial latents are those flowrl's rollout draws from seed 0
    oracle_steps, oracle_guidance_scale, oracle_noise_seed = 4, 5.0, 0
    oracle_bound, oracle_decode_atol = (operator.le, 1e-4), 1e-4
    sample_shape, sample_guidance_scale = (2, 3, 16, 16), 3.0

    def oracle_pipeline(self):
        """StableDiffusionXLPipeline with DDIMScheduler.from_config of the checkpoint's scheduler config (its leading
        grid, eta=0, CFG with its zero negatives): DDIM stands in for the Euler scheduler's step on the same grid;
        Euler never clips x0 (DDIM's default would)."""
        from diffusers import DDIMScheduler

        pipe = self.diffusers_pipeline()
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)
        return pipe

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        call = {"prompt": list(self.prompts), "height": 16, "width": 16, "num_inference_steps": steps, "guidance_scale": scale}
        return pipe(**call, eta=0.0, latents=noise.clone(), output_type=output_type).images

    def check_oracle(self, adapter, pipe, noise, ours, case):
        # the comparison is sensitive: without guidance diffusers lands elsewhere
        unguided = self.pipeline_call(pipe, noise, self.oracle_steps, 1.0, "latent", case)
        assert (unguided - ours).abs().max() > 1e-3

    def check_loaded(self, adapter):
        from flowrl.pipelines.sdxl import SDXLAdapter

        assert isinstance(adapter, SDXLAdapter) and adapter.prediction_type == "epsilon" and adapter.sample_size() == (16, 16)
        assert adapter.force_zeros_for_empty_prompt
        for encoder in (adapter.text_encoder, adapter.text_encoder_2, adapter.vae):
            assert not encoder.training and not any(p.requires_grad for p in encoder.parameters())
        cached = adapter.encode(["a dog", "a photo of a cat"])
        assert cached.keys() == {"prompt_embeds", "pooled_prompt_embeds"}
        assert cached["prompt_embeds"].shape == (2, 16, 64) and cached["pooled_prompt_embeds"].shape == (2, 32)

    def check_grid(self, adapter, grid):
        """SDXL base's EulerDiscreteScheduler config: "leading" with steps_offset 1."""
        assert (adapter.schedule.spacing, adapter.schedule.steps_offset) == ("leading", 1)

    def check_grid_extras(self, adapter, pipe, directory, grid):
        """... and DDIMScheduler.from_config of the same file sets up the same grid."""
        from diffusers import DDIMScheduler

        ddim = DDIMScheduler.from_config(pipe.scheduler.config)
        for steps in (1, 7, 50):
            ddim.set_timesteps(steps)
            assert torch.equal(adapter.timestep(adapter.schedule.sigmas(steps))[:-1], ddim.timesteps)


class TestSDXLVPrediction(TestSDXL):
    """The same checkpoint with a v-prediction scheduler config: the sampler oracle and GRPO."""

    checkpoint, prediction_type = "sdxl_v_dir", "v_prediction"
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None
    test_two_adjoint_matching_iterations = None
    test_two_diffusion_nft_iterations = None
    test_lora_round_trip_through_diffusers_load_lora_weights = None
    test_loads_through_flowrl_and_samples = None


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


def test_euler_config_without_spacing_reads_as_euler_does():
    """A missing timestep_spacing key means what the checkpoint's own scheduler class defaults to: "linspace" for
    EulerDiscreteScheduler, "leading" for DDIM / PNDM (flowrl then rounds Euler's fractional timesteps as DDIM does)."""
    from flowrl.samplers.schedules import config_default

    assert config_default({"_class_name": "EulerDiscreteScheduler"}, "timestep_spacing", "leading") == "linspace"
    assert config_default({"_class_name": "PNDMScheduler"}, "timestep_spacing", "trailing") == "leading"
    assert config_default({"_class_name": "DDIMScheduler", "timestep_spacing": "trailing"}, "timestep_spacing", "leading") == "trailing"
    assert config_default({"_class_name": "NoSuchScheduler"}, "steps_offset", 0) == 0


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
