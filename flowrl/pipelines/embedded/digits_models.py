"""Architectures of the embedded digits generators: real diffusers/transformers classes at tiny size.

The denoiser is a ``diffusers.UNet2DConditionModel`` with cross-attention on the prompt, the text
encoder a ``transformers.CLIPTextModel``: the same classes as Stable Diffusion, so everything flowrl
does with the embedded model is the code path it takes with a real checkpoint.
"""

from __future__ import annotations

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


def build_text_encoder():
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(vocabulary()),
        hidden_size=TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_PROMPT_TOKENS,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    return CLIPTextModel(config)
