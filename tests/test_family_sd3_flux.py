"""SD3/SD3.5 and FLUX.1 through flowrl: real diffusers classes at tiny size, saved with
``save_pretrained`` and loaded through ``pipeline.pretrained=<dir>``; oracle checks against the
diffusers pipelines' own ``__call__``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.pipelines.tiny.sd3_flux import build_tiny_flux, build_tiny_sd3
from tests.family_tester import EmbeddedGuidanceTesterMixin, FamilyTesterMixin, Grid, flow_match, tiny_checkpoint
from tests.tiny_components import ode_sample

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of a cat", "a dog"]
T5_TOKENS = 8  # pipeline.max_sequence_length of the tiny models


sd3_dir = tiny_checkpoint(build_tiny_sd3)
flux_dir = tiny_checkpoint(build_tiny_flux)


def load(name: str, directory, **kwargs):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    size = {"height": 16, "width": 16} if name == "flux" else {}
    return build_pipeline(
        PipelineConfig(name=name, pretrained=str(directory), device="cpu", max_sequence_length=T5_TOKENS, **size, **kwargs), "cpu"
    )


class TestSD3(FamilyTesterMixin):
    """SD3.5: MMDiT, three text encoders (CLIP, CLIP, T5), true CFG; FlowMatchEuler with the checkpoint's shift 3."""

    name, checkpoint, pipeline_class = "sd3", "sd3_dir", "StableDiffusion3Pipeline"
    run_settings, load_options = {"pipeline.max_sequence_length": T5_TOKENS}, {"max_sequence_length": T5_TOKENS}
    grpo_overrides = adjoint_matching_overrides = {"rollout.guidance_scale": 3.0}
    lora_overrides, lora_guidance_scale = {"pipeline.lora": "{r: 4, alpha: 8}", "rollout.guidance_scale": 3.0}, 3.0
    oracle_decode_atol, frozen_modules = 1e-4, 4
    grids = {"shift3": Grid(), "dynamic": Grid(flow_match(use_dynamic_shifting=True))}
    grid_call = {"prompt": "a cat", "guidance_scale": 1.0, "max_sequence_length": T5_TOKENS}
    test_loads_through_flowrl_and_samples = None

    def check_conditioning(self, adapter, pipe, case):
        """The same text encoding (CLIP pair + T5, pooled) as StableDiffusion3Pipeline.encode_prompt."""
        assert adapter.sample_size() == (16, 16) and adapter.latent_shape() == (16, 8, 8) and adapter.schedule.shift == 3.0
        embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS)
        cond = adapter.encode(PROMPTS)
        assert cond["prompt_embeds"].shape == (2, 16 + T5_TOKENS, 96)
        torch.testing.assert_close(cond["prompt_embeds"], embeds, atol=1e-5, rtol=0)
        torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled, atol=1e-5, rtol=0)

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        call = {"num_inference_steps": steps, "guidance_scale": scale, "max_sequence_length": T5_TOKENS}
        return pipe(prompt=PROMPTS, latents=noise.clone(), output_type=output_type, **call).images

    def check_oracle(self, adapter, pipe, noise, ours, case):
        images = adapter.decode(ours)
        assert images.shape == (2, 3, 16, 16) and images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1

    def check_grid(self, adapter, grid):
        """The checkpoint's static shift 3 (SD3.5) and a dynamic-shift config (mu from the image token count)."""
        assert adapter.schedule.grid == "flow_match" and adapter.schedule.dynamic == (grid == "dynamic")


class TestFlux(EmbeddedGuidanceTesterMixin, FamilyTesterMixin):
    """FLUX.1-dev: packed latents, the guidance embedding (one forward a step), FLUX.1-dev's dynamic shift."""

    name, checkpoint, pipeline_class = "flux", "flux_dir", "FluxPipeline"
    size = {"max_sequence_length": T5_TOKENS, "height": 16, "width": 16}
    load_options = size
    run_settings = {f"pipeline.{k}": v for k, v in size.items()} | {"rollout.guidance_mode": "embedded", "rollout.guidance_scale": 3.5}
    grpo_overrides = {"sampler.diffusion": "dance_grpo", "sampler.noise_level": 0.3}
    # Adjoint Matching with embedded guidance: base and fine-tuned predictions get the same guidance embedding
    adjoint_matching_overrides, adjoint_matching_guidance_mode = {"pipeline.lora": "{r: 4, alpha: 8}"}, "embedded"
    # DiffusionNFT on the LoRA (the old policy is a copy of the adapter tensors) with the guidance embedding
    diffusion_nft_overrides, diffusion_nft_guidance_scale = {"pipeline.lora": "{r: 4, alpha: 8}"}, 3.0
    lora_guidance_scale = 3.5
    oracle_guidance_scale, oracle_decode_atol = 3.5, 1e-4
    grids = {"dev_dynamic": Grid(), "schnell_static": Grid(flow_match(shift=1.0))}
    grid_call = {"prompt": "a cat", "height": 16, "width": 16, "guidance_scale": 3.5, "max_sequence_length": T5_TOKENS}
    guidance_embedder, embedded_guidance_scale = "time_text_embed.guidance_embedder", 3.5
    test_loads_through_flowrl_and_samples = None

    def check_conditioning(self, adapter, pipe, case):
        assert adapter.guidance_mode == "embedded" and adapter.latent_shape() == (4, 8, 8)
        embeds, pooled, _ = pipe.encode_prompt(PROMPTS, None, max_sequence_length=T5_TOKENS)
        cond = adapter.encode(PROMPTS)
        torch.testing.assert_close(cond["prompt_embeds"], embeds, atol=1e-5, rtol=0)
        torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled, atol=1e-5, rtol=0)

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        """FluxPipeline.__call__: packing, ids, dynamic shift, sigma timestep and the guidance input."""
        from flowrl.pipelines.flux import pack_latents

        call = {"num_inference_steps": steps, "height": 16, "width": 16, "guidance_scale": scale, "max_sequence_length": T5_TOKENS}
        return pipe(prompt=PROMPTS, latents=pack_latents(noise), output_type=output_type, **call).images

    def pipeline_latents(self, adapter, ours):
        from flowrl.pipelines.flux import pack_latents

        return pack_latents(ours)

    def check_oracle(self, adapter, pipe, noise, ours, case):
        from flowrl.pipelines.flux import pack_latents, unpack_latents

        assert torch.equal(unpack_latents(pack_latents(noise), 8, 8), noise)

    def check_grid(self, adapter, grid):
        """linspace(1, 1/K, K) shifted by the scheduler in float32, with mu from the token count (FLUX.1-dev's
        dynamic config) or a static shift (FLUX.1-schnell's config: shift 1, no dynamic shifting)."""
        assert adapter.schedule.grid == "flux" and adapter.schedule.dynamic == (grid == "dev_dynamic")

    def check_grid_extras(self, adapter, pipe, directory, grid):
        from flowrl.errors import FlowRLError

        with pytest.raises(FlowRLError, match="sampling_grid 'leading' does not apply to flux"):
            build_with_grid("flux", directory, "leading")


# -- SD3 ---------------------------------------------------------------------------------------------


def test_sd3_default_grid_ends_near_data_so_flow_grpo_rollouts_end_clean(sd3_dir):
    """Issue 15: on shift(linspace(1, 0, 11)) the last nonzero sigma is 0.25, and the Flow-GRPO step (a = 0.7) into
    sigma = 0 leaves noise of std 0.20 in the final latent; on the pipeline's grid it is 0.0089 and std < 0.01."""
    from flowrl.samplers import FlowSDEConfig
    from flowrl.samplers.schedules import FlowSchedule

    adapter = load("sd3", sd3_dir)
    linspace = FlowSchedule(shift=3.0, grid="linspace").sigmas(10)
    sampler = FlowSDEConfig(noise_level=0.7).build()

    def last_std(sigmas):
        sigma, sigma_next = sigmas[-2], sigmas[-1]
        return float(sampler.diffusion_coefficient(sigma, sigma_next) * (sigma - sigma_next).sqrt())

    sigmas = adapter.schedule.sigmas(10)
    assert float(sigmas[-2]) == pytest.approx(0.0089, abs=5e-5) and float(linspace[-2]) == pytest.approx(0.25)
    assert last_std(sigmas) < 0.01 and last_std(linspace) == pytest.approx(0.202, abs=1e-3)
    # the other grid stays selectable
    chosen = build_with_grid("sd3", sd3_dir, "linspace")
    assert chosen.schedule.grid == "linspace" and torch.equal(chosen.schedule.sigmas(10), linspace)


def build_with_grid(name: str, directory, grid: str):
    """The adapter with ``pipeline.sampling_grid`` set."""
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    size = {"height": 16, "width": 16} if name == "flux" else {}
    config = PipelineConfig(name=name, pretrained=str(directory), device="cpu", max_sequence_length=T5_TOKENS, **size)
    return build_pipeline(config.model_copy(update={"sampling_grid": grid}), "cpu")


def test_sd3_without_t5_uses_zeros_like_diffusers(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    directory = build_tiny_sd3(tmp_path / "no_t5", with_t5=False)
    adapter = load("sd3", directory)
    pipe = StableDiffusion3Pipeline.from_pretrained(directory, text_encoder_3=None, tokenizer_3=None)
    assert adapter.text_encoder_3 is None and len(adapter.frozen_modules()) == 3
    embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS)
    cond = adapter.encode(PROMPTS)
    torch.testing.assert_close(cond["prompt_embeds"], embeds, atol=1e-5, rtol=0)
    torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled, atol=1e-5, rtol=0)
    assert cond["prompt_embeds"][:, 16:].abs().max() == 0
    assert ode_sample(adapter, PROMPTS, steps=2).shape == (2, 3, 16, 16)


# -- FLUX --------------------------------------------------------------------------------------------


def test_flux_without_guidance_embeds_refuses_embedded_mode(tmp_path):
    from flowrl.errors import FlowRLError

    adapter = load("flux", build_tiny_flux(tmp_path / "schnell", guidance_embeds=False))
    assert adapter.guidance_mode == "cfg"
    with pytest.raises(FlowRLError, match="no guidance embedding"):
        adapter.guidance_mode = "embedded"
    assert ode_sample(adapter, PROMPTS, steps=2, guidance_scale=2.0).shape == (2, 3, 16, 16)  # true CFG, two branches


# -- real-checkpoint configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["configs/sd3/flow_grpo_pickscore.yaml", "configs/flux/dance_grpo_hpsv2.yaml"])
def test_real_configs_validate(path):
    from flowrl.config import load_config
    from flowrl.prompts import prompt_pool

    config = load_config(Path(__file__).resolve().parents[1] / path, [])
    pc = config.prompts
    assert len(prompt_pool(pc.dataset, pc.train_split, file=pc.train_file)) > 10
    assert len(prompt_pool(pc.dataset, pc.eval_split, pc.eval_size, file=pc.eval_file)) > 1
    assert config.pipeline.dtype == "bfloat16" and config.train.mixed_precision == "bf16"
    assert config.pipeline.lora is not None and config.pipeline.gradient_checkpointing
    if "flux" in path:
        assert config.pipeline.name == "flux" and config.rollout.guidance_mode == "embedded" and config.sampler.diffusion == "dance_grpo"
    else:
        assert config.pipeline.name == "sd3" and config.reward.components == {"pickscore": 1.0}


def test_flow_shift_overrides_the_checkpoint(sd3_dir, tmp_path):
    from flowrl.errors import FlowRLError
    from flowrl.samplers.schedules import FlowSchedule
    from tests.tiny_components import build_tiny_sd

    assert load("sd3", sd3_dir).schedule.shift != 5.0
    shifted = load("sd3", sd3_dir, flow_shift=5.0)
    assert shifted.schedule.shift == 5.0 and not shifted.schedule.dynamic
    assert torch.equal(shifted.schedule.sigmas(2), FlowSchedule(5.0, shifted.schedule.grid).sigmas(2))
    with pytest.raises(FlowRLError, match="applies to rectified-flow models"):
        load("stable_diffusion", build_tiny_sd(tmp_path / "sd"), flow_shift=5.0)
