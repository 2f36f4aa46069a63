"""The tiny parts the families' checkpoints share: a tokenizer trained in-process, CLIP and T5 text encoders, VAEs,
a UNet, FLUX.1's transformer and scheduler, all real diffusers / transformers classes at a tiny config, seeded (the
way diffusers' own tests build dummy components), and prompt files with source images for the image-conditioned
families."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "a photo of a cat",
    "a painting of a dog sitting on a bench",
    "an astronaut riding a horse on the moon",
    "the digit seven",
    "a red apple on a wooden table",
    "a city at night with neon lights",
    "",
    "a small boat moving left across a lake",
    "a bird flying up into the sky",
    "one two three four five six",
]


def tiny_tokenizer(max_length: int = 16):
    """A real byte-pair ``PreTrainedTokenizerFast`` trained in-process on a tiny corpus (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    tok.train_from_iterator(
        CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    bos, eos = tok.token_to_id("[BOS]"), tok.token_to_id("[EOS]")
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]", special_tokens=[("[BOS]", bos), ("[EOS]", eos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]", model_max_length=max_length
    )


def tiny_clip_text(hidden: int = 32, projection: bool = False, seed: int = 0, vocab_size: int = 512):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        hidden_size=hidden,
        intermediate_size=37,
        layer_norm_eps=1e-5,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        projection_dim=hidden,
        max_position_embeddings=64,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def tiny_t5(d_model: int = 32, seed: int = 0, umt5: bool = False, vocab_size: int = 512):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**kwargs)).eval()
    return T5EncoderModel(T5Config(**kwargs)).eval()


def tiny_vae(latent_channels: int = 4, seed: int = 0, **kwargs):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        block_out_channels=[8, 16],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        **kwargs,
    ).eval()


def tiny_causal_vae(cls_name: str = "AutoencoderKLWan", base_dim: int = 4, dim_mult=(1, 1, 1, 1), seed: int = 0):
    """A causal 3-D VAE of Wan's design (``AutoencoderKLWan``; Qwen-Image's ``AutoencoderKLQwenImage`` is one too) at
    tiny size: 4 latent channels with a non-trivial latents_mean / latents_std, so the normalisation is exercised."""
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, cls_name)(
        base_dim=base_dim,
        z_dim=4,
        dim_mult=list(dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    ).eval()


def tiny_flux_vae(seed: int = 0):
    """The 4-channel VAE of the FLUX-shaped tiny models (FLUX.1, Kontext, Z-Image): FLUX's scaling and shift factors."""
    return tiny_vae(
        latent_channels=4, seed=seed, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False
    )


def tiny_unet(seed: int = 0, **kwargs):
    """A seeded UNet2DConditionModel at tiny size (two blocks of 8 and 16 channels, 4 latent channels); ``kwargs``:
    the family's block types and conditioning."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4, norm_num_groups=4, **kwargs
    )


def tiny_flux_transformer(guidance_embeds: bool = True, seed: int = 0):
    """FLUX.1-shaped: one double- and one single-stream block, a guidance embedding (dev, Kontext) or not (schnell)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
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


def tiny_flux_components(guidance_embeds: bool = True, seed: int = 0) -> dict:
    """The components of a FLUX.1-shaped pipeline (FluxPipeline, FluxKontextPipeline): the transformer, FLUX.1-dev's
    dynamic scheduler, the FLUX VAE, CLIP and T5 with their tokenizers."""
    return dict(
        transformer=tiny_flux_transformer(guidance_embeds, seed=seed),
        scheduler=flux_dynamic_scheduler(),
        vae=tiny_flux_vae(seed=seed),
        text_encoder=tiny_clip_text(seed=seed + 1),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_t5(d_model=32, seed=seed),
        tokenizer_2=tiny_tokenizer(),
    )


def flux_dynamic_scheduler():
    """FLUX.1-dev's FlowMatchEulerDiscreteScheduler config: shift from the image token count (mu)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )


SOURCE_PROMPTS = ["make the cat red", "add a hat to the dog"]
PROMPT_FOLDER = "prompts"  # inside a checkpoint of an image-conditioned family: its prompt file and source images


def write_source_prompts(directory, seed: int = 0, size: tuple[int, int] = (24, 24)) -> Path:
    """``directory/prompts/``: two random source images and ``prompts.jsonl``, one ``{"prompt", "image"}`` line each
    (image paths relative to the file), the prompt file an editing or image-to-video family reads its images from."""
    import numpy as np
    from PIL import Image

    folder = Path(directory) / PROMPT_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i, prompt in enumerate(SOURCE_PROMPTS):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / f"source{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"source{i}.png"}) + "\n")
    (folder / "prompts.jsonl").write_text("".join(lines))
    return folder / "prompts.jsonl"
