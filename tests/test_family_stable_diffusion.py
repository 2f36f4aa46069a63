"""Stable Diffusion 1.x/2.x through flowrl: real diffusers classes at tiny size, saved with
``save_pretrained`` and loaded through ``pipeline.pretrained=<dir>``; the shared family checks
(tests/family_tester.py) at SD's settings, then SD's own."""

from __future__ import annotations

import operator

import pytest
import torch

from tests.family_tester import FamilyTesterMixin, tiny_checkpoint
from tests.tiny_components import build_tiny_sd, family_config, rescoring_ratio_is_one, two_iterations_change_every_parameter

pytestmark = pytest.mark.usefixtures("one_thread")


sd_dir = tiny_checkpoint(build_tiny_sd)
sd_v_dir = tiny_checkpoint(build_tiny_sd, prediction_type="v_prediction")


class TestStableDiffusion(FamilyTesterMixin):
    """SD1.x/2.x: a UNet with DDIM's DDPM parametrisation; the configs' "leading" grid with steps_offset 1."""

    name, checkpoint, pipeline_class, denoiser = "stable_diffusion", "sd_dir", "StableDiffusionPipeline", "unet"
    flow, sampler, prediction_type = False, "ddim", "epsilon"
    grpo_overrides = adjoint_matching_overrides = {"rollout.guidance_scale": 3.0}
    # 1000 // 7 = 142: 853, 711, ..., 1; the initial latents are those flowrl's rollout draws from seed 0
    oracle_steps, oracle_guidance_scale, oracle_noise_seed, oracle_bound = 7, 5.0, 0, (operator.le, 1e-4)
    sample_shape = (2, 3, 16, 16)

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        return pipe(
            list(self.prompts), num_inference_steps=steps, guidance_scale=scale, latents=noise.clone(), output_type=output_type
        ).images

    def check_loaded(self, adapter):
        assert adapter.prediction_type == "epsilon" and adapter.sample_size() == (16, 16)
        assert not adapter.text_encoder.training and not any(p.requires_grad for p in adapter.text_encoder.parameters())
        assert not any(p.requires_grad for p in adapter.vae.parameters())

    def check_grid(self, adapter, grid):
        """SD1.x/2.x configs: "leading" spacing with steps_offset 1 (981, 961, ..., 1 at K = 50), the grid of
        StableDiffusionPipeline (and DDPO, which samples through its DDIM scheduler); not flowrl's old trailing grid."""
        assert adapter.schedule.spacing == "leading" and adapter.schedule.steps_offset == 1
        assert adapter.timestep(adapter.schedule.sigmas(50)).tolist() == list(range(981, 0, -20)) + [-1]

    def check_grid_extras(self, adapter, pipe, directory, grid):
        trailing = self.load(directory, sampling_grid="trailing")  # another grid stays selectable
        assert trailing.timestep(trailing.schedule.sigmas(50)).tolist() == list(range(999, 0, -20)) + [-1]


class TestStableDiffusionVPrediction(TestStableDiffusion):
    """The same checkpoint with a v-prediction scheduler config: the sampler and the three objectives."""

    checkpoint, prediction_type = "sd_v_dir", "v_prediction"
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None
    test_lora_round_trip_through_diffusers_load_lora_weights = None
    test_loads_through_flowrl_and_samples = None


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


def test_bad_sources_fail_with_one_sentence(tmp_path):
    from flowrl.config import PipelineConfig
    from flowrl.errors import FlowRLError
    from flowrl.pipelines import build_pipeline

    with pytest.raises(FlowRLError, match="not an existing model directory"):
        build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(tmp_path / "missing")), "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlowRLError, match="could not load"):
        build_pipeline(PipelineConfig(name="stable_diffusion", pretrained=str(tmp_path / "empty")), "cpu")


@pytest.mark.slow
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
