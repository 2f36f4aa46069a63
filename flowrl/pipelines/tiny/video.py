"""Tiny video checkpoints: Wan2.1 (T2V, I2V with its CLIP image encoder), Wan2.2 (T2V / I2V-A14B's two experts,
TI2V-5B's 48-channel VAE) and CogVideoX, the real diffusers classes at tiny size, saved as the pipeline's directory."""

from __future__ import annotations

import torch

from .components import tiny_causal_vae, tiny_t5, tiny_tokenizer, write_source_prompts

BOUNDARY = 0.875  # Wan2.2 T2V-A14B's boundary_ratio


def tiny_wan_transformer(in_channels: int = 4, image_dim: int | None = None, seed: int = 0, out_channels: int = 4):
    """A tiny WanTransformer3DModel (Wan2.2's two experts are two of them that differ only by their seed)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=image_dim,
    )


def _text_parts(seed: int) -> dict:
    """Wan's text side: a UMT5 encoder and its tokenizer."""
    return dict(tokenizer=tiny_tokenizer(), text_encoder=tiny_t5(umt5=True, seed=seed))


def build_tiny_wan(directory, expand_timesteps: bool = False, seed: int = 0):
    """Wan2.1 T2V-shaped (``expand_timesteps``: one timestep per token, as Wan2.2 TI2V-5B)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    WanPipeline(
        **_text_parts(seed),
        vae=tiny_causal_vae(seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_transformer(seed=seed),
        expand_timesteps=expand_timesteps,
    ).save_pretrained(directory)
    return directory


def build_tiny_wan_i2v(directory, seed: int = 0, prompts: bool = False):
    """Wan2.1 I2V-shaped: latents + mask + first-frame channels in, a CLIP image encoder; ``prompts``: with a prompt
    file of first frames."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    clip = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=8, projection_dim=8, num_hidden_layers=2, num_attention_heads=2, image_size=8, intermediate_size=16, patch_size=2
        )
    ).eval()
    WanImageToVideoPipeline(
        **_text_parts(seed),
        vae=tiny_causal_vae(seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_transformer(in_channels=12, image_dim=8, seed=seed),
        image_encoder=clip,
        image_processor=CLIPImageProcessor(crop_size=8, size=8),
    ).save_pretrained(directory)
    if prompts:
        write_source_prompts(directory, seed, size=(24, 40))
    return directory


def build_tiny_wan22(
    directory,
    i2v: bool = False,
    boundary_ratio: float | None = BOUNDARY,
    transformer_2: bool = True,
    seed: int = 0,
    prompts: bool = False,
):
    """Wan2.2 A14B at tiny size: two experts; I2V-A14B style (``i2v``): latents + mask + first-frame channels in, no
    CLIP image encoder (Wan2.2 I2V has none); ``prompts``: with a prompt file of first frames."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

    channels = 12 if i2v else 4
    parts = dict(
        **_text_parts(seed),
        vae=tiny_causal_vae(seed=seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_transformer(channels, seed=seed),
        transformer_2=tiny_wan_transformer(channels, seed=seed + 1) if transformer_2 else None,
        boundary_ratio=boundary_ratio,
    )
    (WanImageToVideoPipeline if i2v else WanPipeline)(**parts).save_pretrained(directory)
    if prompts:
        write_source_prompts(directory, seed, size=(24, 40))
    return directory


def tiny_wan22_vae(seed: int = 0):
    """Wan2.2's VAE shape at tiny width: z_dim 48, residual blocks, 2x2 patchified pixels, 16x spatial / 4x temporal."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=6,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.05 * (i % 7 - 3) for i in range(48)],  # non-trivial, so the normalisation is exercised
        latents_std=[0.8 + 0.05 * (i % 9) for i in range(48)],
    ).eval()


def build_tiny_ti2v(directory, seed: int = 0, prompts: bool = False):
    """Wan2.2 TI2V-5B at tiny size: one 48-channel transformer, expand_timesteps (saved as the hub's WanPipeline);
    ``prompts``: with a prompt file of first frames (its image-to-video use, ``pipeline.name=wan_i2v``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    WanPipeline(
        **_text_parts(seed),
        vae=tiny_wan22_vae(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=tiny_wan_transformer(48, seed=seed + 2, out_channels=48),
        expand_timesteps=True,
    ).save_pretrained(directory)
    if prompts:
        write_source_prompts(directory, seed, size=(24, 40))
    return directory


def build_tiny_cogvideox(directory, rotary: bool = True, seed: int = 0):
    """CogVideoX-shaped: a 3-D VAE with 4x temporal compression, a transformer with rotary (CogVideoX-5b) or sinusoidal
    (``rotary=False``, CogVideoX-2b) positions, CogVideoX-2b's v-prediction DDIM scheduler."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline, CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    ).eval()
    torch.manual_seed(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=32,
        num_layers=2,
        sample_width=4,
        sample_height=4,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=16,
        use_rotary_positional_embeddings=rotary,
    )
    CogVideoXPipeline(
        tokenizer=tiny_tokenizer(), text_encoder=tiny_t5(seed=seed), vae=vae, transformer=transformer, scheduler=_cogvideox_scheduler()
    ).save_pretrained(directory)
    return directory


def _cogvideox_scheduler():
    """CogVideoX-2b's scheduler: v-prediction, SNR shift 3, zero terminal SNR, trailing spacing."""
    from diffusers import CogVideoXDDIMScheduler

    return CogVideoXDDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=3.0,
        timestep_spacing="trailing",
    )
