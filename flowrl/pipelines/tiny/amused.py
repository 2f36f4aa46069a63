"""A tiny aMUSEd checkpoint: VQModel, UVit2DModel, a CLIP text encoder with projection and AmusedScheduler (the
embedded digits_masked model's classes), random weights, saved as an AmusedPipeline directory."""

from __future__ import annotations

import torch

CODEBOOK = 16


def build_tiny_amused(directory, seed: int = 0):
    """An AmusedPipeline at tiny size: 8x8 pixels, a VQModel without downsampling (an 8x8 grid of 64 tokens, so the
    cosine schedule commits 1 to 8 tokens a step over aMUSEd's 12 default steps), random weights."""
    from diffusers import AmusedPipeline, VQModel

    from ...data.digits import build_tokenizer
    from ..embedded.masked_digits_models import build_scheduler, build_text_encoder, build_transformer

    torch.manual_seed(seed)
    vqvae = VQModel(
        in_channels=1,
        out_channels=1,
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=4,
        sample_size=8,
        num_vq_embeddings=CODEBOOK,
        norm_num_groups=4,
        mid_block_add_attention=False,
        lookup_from_codebook=True,
    )
    transformer = build_transformer(CODEBOOK, hidden=16, layers=1, text_dim=16)
    transformer.register_to_config(sample_size=8)
    pipe = AmusedPipeline(
        vqvae=vqvae,
        tokenizer=build_tokenizer(),
        text_encoder=build_text_encoder(16),
        transformer=transformer,
        scheduler=build_scheduler(CODEBOOK),
    )
    pipe.save_pretrained(directory)
    return directory
