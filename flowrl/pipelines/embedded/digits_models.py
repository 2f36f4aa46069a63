"""Architectures of the embedded digits generators: real diffusers/transformers classes at tiny size.

The denoiser is a ``diffusers.UNet2DConditionModel`` with cross-attention on the prompt, the text
encoder a ``transformers.CLIPTextModel``: the same classes as Stable Diffusion, so everything flowrl
does with the embedded model is the code path it takes with a real checkpoint.
"""

from __future__ import annotations

from typing import Any

from ...data.digits import IMAGE_SIZE, MAX_PROMPT_TOKENS, vocabulary

TEXT_DIM = 32


def build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=IMAGE_SIZE,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_DIM,
        attention_head_dim=8,
        norm_num_groups=16,
    )


def text_encoder_config(vocab_size: int | None = None, max_length: int = MAX_PROMPT_TOKENS, text_dim: int = TEXT_DIM, **extra: Any):
    """The embedded generators' CLIP text encoder: two layers of width ``text_dim`` over a word-level prompt vocabulary
    of ``vocab_size`` words (default: the digit prompts') with [PAD] 0, [BOS] 2, [EOS] 3 and prompts of at most
    ``max_length`` tokens; ``extra``: more config fields (aMUSEd's projection)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(vocabulary()) if vocab_size is None else vocab_size,
        hidden_size=text_dim,
        intermediate_size=2 * text_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=max_length,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        **extra,
    )


def build_text_encoder(vocab_size: int | None = None, max_length: int = MAX_PROMPT_TOKENS):
    from transformers import CLIPTextModel

    return CLIPTextModel(text_encoder_config(vocab_size, max_length))
