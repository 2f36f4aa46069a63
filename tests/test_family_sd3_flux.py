"""SD3/SD3.5 and FLUX.1 through flowrl: real diffusers classes at tiny size, saved with
``save_pretrained`` and loaded through ``pipeline.pretrained=<dir>``; oracle checks against the
diffusers pipelines' own ``__call__``."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.tiny_components import (
    as_adjoint_matching,
    as_diffusion_nft,
    euler_final_latents,
    family_config,
    ode_sample,
    rescoring_ratio_is_one,
    tiny_clip_text,
    tiny_t5,
    tiny_tokenizer,
    tiny_vae,
    two_iterations_change_every_parameter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of a cat", "a dog"]
T5_TOKENS = 8  # pipeline.max_sequence_length of the tiny models


def build_tiny_sd3(directory, with_t5: bool = True):
    """SD3.5-shaped: MMDiT with qk RMS-norm and one dual-attention layer, 16-channel VAE with shift factor."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=96,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    )
    vae = tiny_vae(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=tiny_clip_text(projection=True, seed=1),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_clip_text(projection=True, seed=2),
        tokenizer_2=tiny_tokenizer(),
        text_encoder_3=tiny_t5(d_model=96) if with_t5 else None,
        tokenizer_3=tiny_tokenizer() if with_t5 else None,
    )
    pipe.save_pretrained(directory)
    return directory


def build_tiny_flux(directory, guidance_embeds: bool = True):
    """FLUX.1-shaped: one double- and one single-stream block, guidance embedding (dev) or not (schnell)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
        guidance_embeds=guidance_embeds,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    vae = tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=tiny_clip_text(seed=1),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_t5(d_model=32),
        tokenizer_2=tiny_tokenizer(),
    )
    pipe.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"))


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux"))


def sd3_config(directory, output_dir, **extra):
    return family_config("sd3", directory, output_dir, **{"pipeline.max_sequence_length": T5_TOKENS, **extra})


def flux_config(directory, output_dir, **extra):
    return family_config(
        "flux",
        directory,
        output_dir,
        **{
            "pipeline.max_sequence_length": T5_TOKENS,
            "pipeline.height": 16,
            "pipeline.width": 16,
            "rollout.guidance_mode": "embedded",
            "rollout.guidance_scale": 3.5,
            **extra,
        },
    )


def load(name: str, directory, **kwargs):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    size = {"height": 16, "width": 16} if name == "flux" else {}
    return build_pipeline(
        PipelineConfig(name=name, pretrained=str(directory), device="cpu", max_sequence_length=T5_TOKENS, **size, **kwargs), "cpu"
    )


flowrl_euler = functools.partial(euler_final_latents, prompts=PROMPTS)


# -- SD3 ---------------------------------------------------------------------------------------------


def test_sd3_matches_diffusers_pipeline_with_cfg(sd3_dir):
    """Oracle: the same text encoding, shifted sigmas and CFG Euler steps as StableDiffusion3Pipeline.__call__."""
    from diffusers import StableDiffusion3Pipeline

    adapter, pipe = load("sd3", sd3_dir), StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    assert adapter.sample_size() == (16, 16) and adapter.latent_shape() == (16, 8, 8) and adapter.schedule.shift == 3.0
    embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS)
    cond = adapter.encode(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, 16 + T5_TOKENS, 96)
    torch.testing.assert_close(cond["prompt_embeds"], embeds, atol=1e-5, rtol=0)
    torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled, atol=1e-5, rtol=0)

    steps, scale = 2, 4.0
    noise = adapter.initial_noise(2, torch.Generator().manual_seed(1))
    theirs = pipe(
        prompt=PROMPTS,
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=scale,
        output_type="latent",
        max_sequence_length=T5_TOKENS,
    ).images  # default arguments: the scheduler's own grid
    assert torch.equal(pipe.scheduler.sigmas, adapter.schedule.sigmas(steps))
    ours = flowrl_euler(adapter, noise, steps, scale)
    diff = (ours - theirs).abs().max().item()
    print(f"SD3 oracle (CFG {scale}, {steps} steps): max |flowrl - diffusers| = {diff:.2e}")
    assert diff < 1e-5
    images = adapter.decode(ours)
    assert images.shape == (2, 3, 16, 16) and images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
    assert not any(p.requires_grad for m in adapter.frozen_modules() for p in m.parameters()) and len(adapter.frozen_modules()) == 4


def with_scheduler(directory, tmp_path, scheduler):
    """A copy of a tiny checkpoint with another scheduler config (the models are shared, not rebuilt)."""
    import shutil

    copy = tmp_path / f"{Path(directory).name}_{type(scheduler).__name__}"
    shutil.copytree(directory, copy)
    shutil.rmtree(copy / "scheduler")
    scheduler.save_pretrained(copy / "scheduler")
    return copy


@pytest.mark.parametrize("dynamic", [False, True], ids=["shift3", "dynamic"])
def test_sd3_default_grid_is_the_pipelines_for_k_1_to_50(sd3_dir, tmp_path, dynamic):
    """flowrl's SD3 grid = the sigmas StableDiffusion3Pipeline sets up with its default arguments (no sigmas=), for
    the checkpoint's static shift 3 (SD3.5) and for a dynamic-shift config (mu from the image token count)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from tests.test_family_stable_diffusion import pipeline_default_grid

    directory = with_scheduler(sd3_dir, tmp_path, FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)) if dynamic else sd3_dir
    adapter, pipe = load("sd3", directory), StableDiffusion3Pipeline.from_pretrained(directory)
    assert adapter.schedule.grid == "flow_match" and adapter.schedule.dynamic == dynamic
    for steps in range(1, 51):
        _, sigmas = pipeline_default_grid(pipe, steps, prompt="a cat", guidance_scale=1.0, max_sequence_length=T5_TOKENS)
        assert torch.equal(adapter.schedule.sigmas(steps), sigmas), steps


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


def test_sd3_two_grpo_iterations_full_finetune_with_cfg(sd3_dir, tmp_path):
    trainer = two_iterations_change_every_parameter(sd3_config(sd3_dir, tmp_path / "run", **{"rollout.guidance_scale": 3.0}))
    rescoring_ratio_is_one(trainer)


def test_sd3_two_adjoint_matching_iterations_full_finetune_with_cfg(sd3_dir, tmp_path):
    two_iterations_change_every_parameter(as_adjoint_matching(sd3_config(sd3_dir, tmp_path / "run", **{"rollout.guidance_scale": 3.0})))


def test_sd3_lora_round_trip_through_diffusers_load_lora_weights(sd3_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    lora_round_trip(
        StableDiffusion3Pipeline,
        "sd3",
        sd3_dir,
        tmp_path,
        sd3_config(sd3_dir, tmp_path / "run", **{"pipeline.lora": "{r: 4, alpha: 8}", "rollout.guidance_scale": 3.0}),
        3.0,
    )


def lora_round_trip(pipeline_cls, name: str, directory, tmp_path: Path, overrides: list[str], guidance_scale: float):
    from flowrl.pipelines import build_pipeline

    trainer = two_iterations_change_every_parameter(overrides)
    rescoring_ratio_is_one(trainer)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    ours = ode_sample(trainer.pipeline, PROMPTS, seed=3, guidance_scale=guidance_scale)

    # the user's path: the base checkpoint + load_lora_weights(run checkpoint), nothing of flowrl
    pipe = pipeline_cls.from_pretrained(directory)
    pipe.load_lora_weights(checkpoint)
    from peft.utils import get_peft_model_state_dict

    ours_lora = get_peft_model_state_dict(trainer.pipeline.denoiser)
    theirs_lora = get_peft_model_state_dict(pipe.transformer, adapter_name=next(iter(pipe.transformer.peft_config)))
    assert set(theirs_lora) == set(ours_lora), "diffusers did not load every LoRA tensor"
    assert all(torch.equal(theirs_lora[k].float(), v) for k, v in ours_lora.items())
    plain = trainer.config.pipeline.model_copy(update={"lora": None})
    adapter = build_pipeline(plain, "cpu")
    adapter.guidance_mode = trainer.pipeline.guidance_mode
    base = ode_sample(adapter, PROMPTS, seed=3, guidance_scale=guidance_scale)
    adapter.denoiser = pipe.transformer  # flowrl's sampler around the diffusers-loaded transformer + LoRA
    torch.testing.assert_close(ode_sample(adapter, PROMPTS, seed=3, guidance_scale=guidance_scale), ours, atol=1e-5, rtol=0)
    assert (base - ours).abs().max() > 1e-4, "the LoRA did not change the samples, so the round trip proves nothing"

    # merged export: a plain transformer whose outputs equal base + LoRA
    merged = trainer.pipeline.merged_denoiser()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter.denoiser = merged
    torch.testing.assert_close(ode_sample(adapter, PROMPTS, seed=3, guidance_scale=guidance_scale), ours, atol=1e-4, rtol=0)

    # `flowrl export`: a standalone diffusers directory with the LoRA merged in, and the LoRA file alone
    from flowrl.cli import main

    assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0
    adapter.denoiser = pipeline_cls.from_pretrained(tmp_path / "merged").transformer
    torch.testing.assert_close(ode_sample(adapter, PROMPTS, seed=3, guidance_scale=guidance_scale), ours, atol=1e-4, rtol=0)
    assert main(["export", str(checkpoint), str(tmp_path / "lora"), "--lora-only"]) == 0
    pipe = pipeline_cls.from_pretrained(directory)
    pipe.load_lora_weights(tmp_path / "lora")
    adapter.denoiser = pipe.transformer
    torch.testing.assert_close(ode_sample(adapter, PROMPTS, seed=3, guidance_scale=guidance_scale), ours, atol=1e-5, rtol=0)


# -- FLUX --------------------------------------------------------------------------------------------


def test_flux_matches_diffusers_pipeline_with_embedded_guidance(flux_dir):
    """Oracle: packing, ids, dynamic shift, sigma timestep and the guidance input as FluxPipeline.__call__."""
    from diffusers import FluxPipeline

    from flowrl.pipelines.flux import pack_latents, unpack_latents

    adapter, pipe = load("flux", flux_dir), FluxPipeline.from_pretrained(flux_dir)
    assert adapter.guidance_mode == "embedded" and adapter.latent_shape() == (4, 8, 8)
    embeds, pooled, _ = pipe.encode_prompt(PROMPTS, None, max_sequence_length=T5_TOKENS)
    cond = adapter.encode(PROMPTS)
    torch.testing.assert_close(cond["prompt_embeds"], embeds, atol=1e-5, rtol=0)
    torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled, atol=1e-5, rtol=0)

    steps, scale = 2, 3.5
    noise = adapter.initial_noise(2, torch.Generator().manual_seed(1))
    assert torch.equal(unpack_latents(pack_latents(noise), 8, 8), noise)
    theirs = pipe(
        prompt=PROMPTS,
        latents=pack_latents(noise),
        num_inference_steps=steps,
        height=16,
        width=16,
        guidance_scale=scale,
        output_type="latent",
        max_sequence_length=T5_TOKENS,
    ).images  # default arguments
    assert torch.equal(pipe.scheduler.sigmas, adapter.schedule.sigmas(steps))
    ours = flowrl_euler(adapter, noise, steps, scale)
    diff = (ours - unpack_latents(theirs, 8, 8)).abs().max().item()
    print(f"FLUX oracle (embedded guidance {scale}, {steps} steps): max |flowrl - diffusers| = {diff:.2e}")
    assert diff < 1e-5
    # and decoding equals the pipeline's own (unpack, unscale, shift, VAE)
    images = pipe(
        prompt=PROMPTS,
        latents=pack_latents(noise),
        num_inference_steps=steps,
        height=16,
        width=16,
        guidance_scale=scale,
        output_type="pt",
        max_sequence_length=T5_TOKENS,
    ).images
    torch.testing.assert_close(adapter.decode(ours), images, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dev_dynamic", "schnell_static"])
def test_flux_default_grid_is_the_pipelines_for_k_1_to_50(flux_dir, tmp_path, dynamic):
    """flowrl's FLUX grid = the sigmas FluxPipeline sets up with its default arguments: linspace(1, 1/K, K) shifted by
    the scheduler in float32, with mu from the token count (FLUX.1-dev's dynamic config) or a static shift
    (FLUX.1-schnell's config: shift 1, no dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from tests.test_family_stable_diffusion import pipeline_default_grid

    directory = flux_dir if dynamic else with_scheduler(flux_dir, tmp_path, FlowMatchEulerDiscreteScheduler(shift=1.0))
    adapter, pipe = load("flux", directory), FluxPipeline.from_pretrained(directory)
    assert adapter.schedule.grid == "flux" and adapter.schedule.dynamic == dynamic
    for steps in range(1, 51):
        _, sigmas = pipeline_default_grid(
            pipe, steps, prompt="a cat", height=16, width=16, guidance_scale=3.5, max_sequence_length=T5_TOKENS
        )
        assert torch.equal(adapter.schedule.sigmas(steps), sigmas), steps
    from flowrl.errors import FlowRLError

    with pytest.raises(FlowRLError, match="sampling_grid 'leading' does not apply to flux"):
        build_with_grid("flux", directory, "leading")


def test_flux_embedded_guidance_one_forward_per_step_with_gradient(flux_dir):
    from flowrl.errors import FlowRLError

    adapter = load("flux", flux_dir)
    calls = []
    hook = adapter.denoiser.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0] if args else None))
    try:
        ode_sample(adapter, PROMPTS, steps=3, guidance_scale=3.5)
        assert len(calls) == 3, f"{len(calls)} transformer calls for 3 steps"
        calls.clear()
        x = adapter.initial_noise(2, torch.Generator().manual_seed(0)).requires_grad_(False)
        cond = adapter.encode(PROMPTS)
        out = adapter.predict(x, torch.tensor(0.6), cond, 3.5)
        assert len(calls) == 1
        out.square().mean().backward()
    finally:
        hook.remove()
    grads = [p.grad for p in adapter.denoiser.time_text_embed.guidance_embedder.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads), "no gradient through the guidance embedding"
    with torch.no_grad():  # the scale is a real model input
        assert (adapter.predict(x, torch.tensor(0.6), cond, 1.0) - out).abs().max() > 1e-4
    with pytest.raises(FlowRLError, match="guidance-distilled"):
        adapter.guidance_mode = "cfg"


def test_flux_without_guidance_embeds_refuses_embedded_mode(tmp_path):
    from flowrl.errors import FlowRLError

    adapter = load("flux", build_tiny_flux(tmp_path / "schnell", guidance_embeds=False))
    assert adapter.guidance_mode == "cfg"
    with pytest.raises(FlowRLError, match="no guidance embedding"):
        adapter.guidance_mode = "embedded"
    assert ode_sample(adapter, PROMPTS, steps=2, guidance_scale=2.0).shape == (2, 3, 16, 16)  # true CFG, two branches


def test_flux_two_grpo_iterations_full_finetune(flux_dir, tmp_path):
    trainer = two_iterations_change_every_parameter(
        flux_config(flux_dir, tmp_path / "run", **{"sampler.diffusion": "dance_grpo", "sampler.noise_level": 0.3})
    )
    rescoring_ratio_is_one(trainer)


def test_flux_two_adjoint_matching_iterations_lora(flux_dir, tmp_path):
    """Embedded guidance: base and fine-tuned predictions get the same guidance embedding (one forward each)."""
    two_iterations_change_every_parameter(
        as_adjoint_matching(flux_config(flux_dir, tmp_path / "run", **{"pipeline.lora": "{r: 4, alpha: 8}"}), guidance_mode="embedded")
    )


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_two_diffusion_nft_iterations(request, tmp_path, family):
    """SD3 full fine-tuning, FLUX LoRA (the old policy is a copy of the adapter tensors) with its guidance embedding."""
    directory = request.getfixturevalue(f"{family}_dir")
    if family == "sd3":
        overrides = sd3_config(directory, tmp_path / "run")
    else:
        overrides = flux_config(directory, tmp_path / "run", **{"pipeline.lora": "{r: 4, alpha: 8}"})
    two_iterations_change_every_parameter(as_diffusion_nft(overrides, guidance_scale=3.0 if family == "flux" else 1.0))


def test_flux_lora_round_trip_through_diffusers_load_lora_weights(flux_dir, tmp_path):
    from diffusers import FluxPipeline

    lora_round_trip(
        FluxPipeline, "flux", flux_dir, tmp_path, flux_config(flux_dir, tmp_path / "run", **{"pipeline.lora": "{r: 4, alpha: 8}"}), 3.5
    )


def test_flux_default_guidance_mode_cfg_fails_with_one_sentence(flux_dir, tmp_path):
    from flowrl.config import load_config
    from flowrl.errors import FlowRLError
    from flowrl.trainer import Trainer

    with pytest.raises(FlowRLError, match="rollout.guidance_mode"):
        Trainer(load_config(None, flux_config(flux_dir, tmp_path / "run", **{"rollout.guidance_mode": "cfg"})))


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
    from tests.test_family_stable_diffusion import build_tiny_sd

    assert load("sd3", sd3_dir).schedule.shift != 5.0
    shifted = load("sd3", sd3_dir, flow_shift=5.0)
    assert shifted.schedule.shift == 5.0 and not shifted.schedule.dynamic
    assert torch.equal(shifted.schedule.sigmas(2), FlowSchedule(5.0, shifted.schedule.grid).sigmas(2))
    with pytest.raises(FlowRLError, match="applies to rectified-flow models"):
        load("stable_diffusion", build_tiny_sd(tmp_path / "sd"), flow_shift=5.0)
