"""Architectures of the embedded masked-token digits generator: aMUSEd's own classes at tiny size.

A ``diffusers.VQModel`` turns an 8x8 digit into a 4x4 grid of codebook tokens and back, a
``diffusers.UVit2DModel`` predicts the codebook logits of masked tokens from the prompt (a
``transformers.CLIPTextModelWithProjection``: its projected pooled output and its penultimate hidden states,
as ``AmusedPipeline`` reads them), and an ``AmusedScheduler`` config names the mask token. The same classes
as ``amused/amused-256``, so ``pipelines/amused.py`` loads the embedded model and a hub checkpoint one way.
"""

from __future__ import annotations

from ...data.digits import IMAGE_SIZE
from .digits_models import text_encoder_config

CODEBOOK_SIZE = 64  # 4x4 tokens of 64 codes: each token carries a 2x2 patch (17 grey levels each in the data)
TOKEN_GRID = IMAGE_SIZE // 2
TEXT_DIM = 32
# AmusedPipeline's default micro-conditioning (width, height, crop top, crop left, aesthetic score), which the
# model is trained with so the pipeline's defaults are its own.
MICRO_CONDS = (IMAGE_SIZE, IMAGE_SIZE, 0, 0, 6)


def build_vqvae(codebook_size: int = CODEBOOK_SIZE, channels: int = 16, latent_channels: int = 4):
    from diffusers import VQModel

    return VQModel(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),  # one downsampling: 8x8 -> 4x4 tokens
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(channels, channels),
        layers_per_block=1,
        latent_channels=latent_channels,
        sample_size=IMAGE_SIZE,
        num_vq_embeddings=codebook_size,
        norm_num_groups=8,
        mid_block_add_attention=False,
        lookup_from_codebook=True,  # AmusedPipeline decodes token ids with force_not_quantize=True
    )


def build_transformer(codebook_size: int = CODEBOOK_SIZE, hidden: int = 64, layers: int = 2, text_dim: int = TEXT_DIM):
    from diffusers import UVit2DModel

    return UVit2DModel(
        hidden_size=hidden,
        cond_embed_dim=text_dim,
        micro_cond_encode_dim=8,
        micro_cond_embed_dim=5 * 8,  # five micro-conditions, each a sinusoidal embedding of micro_cond_encode_dim
        encoder_hidden_size=text_dim,
        vocab_size=codebook_size + 1,  # the codebook and the mask token, the last id
        codebook_size=codebook_size,
        in_channels=hidden,
        block_out_channels=hidden,
        num_res_blocks=1,
        block_num_heads=2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        sample_size=TOKEN_GRID,
    )


def build_text_encoder(text_dim: int = TEXT_DIM):
    """The digit generators' text encoder with a projection of its pooled output (AmusedPipeline reads
    hidden_states[-2], the output of the first of its two layers, and the projected pooled text)."""
    from transformers import CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(text_encoder_config(text_dim=text_dim, projection_dim=text_dim))


def build_scheduler(codebook_size: int = CODEBOOK_SIZE):
    from diffusers import AmusedScheduler

    return AmusedScheduler(mask_token_id=codebook_size, masking_schedule="cosine")
