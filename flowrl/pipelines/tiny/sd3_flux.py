"""Tiny SD3.5, FLUX.1 and FLUX.1 Kontext checkpoints: MMDiT / FLUX transformers with CLIP + T5 text encoders and a
VAE with the family's scaling and shift factors, saved as the pipeline's directory."""

from __future__ import annotations

import torch

from .components import tiny_clip_text, tiny_flux_components, tiny_t5, tiny_tokenizer, tiny_vae, write_source_prompts


def build_tiny_sd3(directory, with_t5: bool = True, seed: int = 0):
    """SD3.5-shaped: MMDiT with qk RMS-norm and one dual-attention layer, 16-channel VAE with shift factor."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
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
    vae = tiny_vae(
        latent_channels=16, seed=seed, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=tiny_clip_text(projection=True, seed=seed + 1),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_clip_text(projection=True, seed=seed + 2),
        tokenizer_2=tiny_tokenizer(),
        text_encoder_3=tiny_t5(d_model=96, seed=seed) if with_t5 else None,
        tokenizer_3=tiny_tokenizer() if with_t5 else None,
    )
    pipe.save_pretrained(directory)
    return directory


def build_tiny_flux(directory, guidance_embeds: bool = True, seed: int = 0):
    """FLUX.1-shaped: one double- and one single-stream block, guidance embedding (dev) or not (schnell)."""
    from diffusers import FluxPipeline

    FluxPipeline(**tiny_flux_components(guidance_embeds, seed)).save_pretrained(directory)
    return directory


def build_tiny_kontext(directory, seed: int = 0, prompts: bool = False):
    """FLUX.1-Kontext-dev-shaped: one double- and one single-stream block, guidance embedding, FLUX.1-dev's dynamic
    shift, a 4-channel VAE with FLUX's scaling and shift factors; ``prompts``: with a prompt file of source images."""
    from diffusers import FluxKontextPipeline

    FluxKontextPipeline(**tiny_flux_components(guidance_embeds=True, seed=seed)).save_pretrained(directory)
    if prompts:
        write_source_prompts(directory, seed)
    return directory
