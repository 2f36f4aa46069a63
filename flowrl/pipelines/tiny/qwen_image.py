"""Tiny Qwen-Image checkpoints (text-to-image, Edit, Edit-Plus): QwenImageTransformer2DModel, AutoencoderKLQwenImage,
Qwen2_5_VLForConditionalGeneration and a Qwen2Tokenizer trained in-process; the edit models saved as on the hub, with
``processor/`` (the tokenizer and Qwen2.5-VL's image processor)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .components import tiny_causal_vae, write_source_prompts

PROMPTS = ["a photo of a cat", "a red apple on a wooden table in the sun"]  # the tokenizer's corpus, with the templates
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen/Qwen-Image's scheduler_config.json (dynamic shift from the token count, terminal sigma 0.02)
QWEN_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)


def tiny_qwen_tokenizer():
    """A real Qwen2Tokenizer (byte-level BPE with Qwen's pre-tokenizer) trained in-process so that the templates'
    words are single tokens: the text-to-image template's prefix is 34 tokens and the edit one's 64, as with the
    real tokenizer, so the pipelines' dropped prefixes drop exactly the system prompt here too."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from ..qwen_image import EDIT_PLUS_PICTURE, EDIT_PLUS_TEMPLATE, EDIT_TEMPLATE, T2I_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    corpus = [T2I_TEMPLATE.format(p) for p in PROMPTS] + [EDIT_TEMPLATE.format("make it red"), EDIT_PLUS_TEMPLATE.format(EDIT_PLUS_PICTURE)]
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], additional_special_tokens=SPECIAL[1:])


def tiny_qwen_vl(tokenizer, hidden: int = 32, seed: int = 0):
    """Qwen2_5_VLForConditionalGeneration at a tiny config (2 text layers with multimodal RoPE, a 2-block vision
    tower with window and full attention), its special token ids those of ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIAL}
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 512,
            "hidden_size": hidden,
            "intermediate_size": 37,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1000000.0},
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": hidden,
            "intermediate_size": 37,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [1],
            "window_size": 56,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen_transformer(seed: int = 0, **kwargs):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(8, 4, 4),
        **kwargs,
    )


def _qwen_parts(tokenizer, seed: int) -> dict:
    """What every Qwen-Image pipeline holds but its transformer: the scheduler, the VAE (8x spatial compression, as
    the real one) and the Qwen2.5-VL text encoder with its tokenizer."""
    return dict(
        scheduler=_scheduler(),
        vae=tiny_causal_vae("AutoencoderKLQwenImage", base_dim=8, dim_mult=(1, 2, 2, 2), seed=seed),
        text_encoder=tiny_qwen_vl(tokenizer, seed=seed),
        tokenizer=tokenizer,
    )


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)


def build_tiny_qwen_image(directory, seed: int = 0):
    from diffusers import QwenImagePipeline

    QwenImagePipeline(**_qwen_parts(tiny_qwen_tokenizer(), seed), transformer=tiny_qwen_transformer(seed)).save_pretrained(directory)
    return directory


def tiny_image_processor():
    """Qwen2.5-VL's image processor (14-pixel patches, 2x2 merge) with a small pixel budget: 56^2 to 112^2 pixels,
    i.e. 4 to 16 vision tokens an image. The PIL implementation: the default one needs torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})


def build_tiny_qwen_edit(directory, plus: bool = False, seed: int = 0, zero_cond_t: bool | None = None, prompts: bool = False):
    """QwenImageEditPipeline (or QwenImageEditPlusPipeline, whose transformer has Qwen-Image-Edit-2511's zero_cond_t
    unless ``zero_cond_t`` says otherwise: 2509 has none) saved as on the hub: ``processor/`` holds the tokenizer files
    and the image processor's preprocessor_config.json, model_index.json names Qwen2VLProcessor; ``prompts``: with a
    prompt file of source images."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    tokenizer = tiny_qwen_tokenizer()
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    transformer = tiny_qwen_transformer(seed, zero_cond_t=plus if zero_cond_t is None else zero_cond_t)
    cls(**_qwen_parts(tokenizer, seed), processor=None, transformer=transformer).save_pretrained(directory)
    tokenizer.save_pretrained(Path(directory) / "processor")
    tiny_image_processor().save_pretrained(Path(directory) / "processor")
    index_file = Path(directory) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2))
    if prompts:
        write_source_prompts(directory, seed)
    return directory
