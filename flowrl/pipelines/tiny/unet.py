"""Tiny Stable Diffusion (1.x / 2.x) and SDXL checkpoints: UNet2DConditionModel, AutoencoderKL and CLIP text encoders
at a tiny config (the dummy components of diffusers' own tests), saved as the pipeline's directory."""

from __future__ import annotations

from .components import tiny_clip_text, tiny_tokenizer, tiny_unet, tiny_vae


def tiny_sd_pipeline(prediction_type: str = "epsilon", seed: int = 0):
    """A tiny Stable Diffusion pipeline of the real diffusers classes (UNet, VAE, CLIP text encoder), in memory."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    unet = tiny_unet(
        seed=seed,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=prediction_type,
    )
    return StableDiffusionPipeline(
        vae=tiny_vae(seed=seed),
        text_encoder=tiny_clip_text(seed=seed),
        tokenizer=tiny_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_tiny_sd(directory, prediction_type: str = "epsilon", seed: int = 0):
    """:func:`tiny_sd_pipeline` saved with ``save_pretrained`` (a real pipeline directory with model_index.json)."""
    tiny_sd_pipeline(prediction_type, seed).save_pretrained(directory)
    return directory


def build_tiny_sdxl(
    directory, prediction_type: str = "epsilon", force_zeros_for_empty_prompt: bool = True, force_upcast: bool = True, seed: int = 0
):
    """SDXL base: two CLIP text encoders (the second with a projection), micro-conditioning time ids, Euler's
    "leading" grid with steps_offset 1."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    unet = tiny_unet(
        seed=seed,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32,  # six time ids x 8 + text_encoder_2 projection
        cross_attention_dim=64,
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
        vae=tiny_vae(force_upcast=force_upcast, seed=seed),
        text_encoder=tiny_clip_text(hidden=32, seed=seed),
        text_encoder_2=tiny_clip_text(hidden=32, projection=True, seed=seed + 1),
        tokenizer=tiny_tokenizer(),
        tokenizer_2=tiny_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
        add_watermarker=False,
    )
    pipe.save_pretrained(directory)
    return directory
