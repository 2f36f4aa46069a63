"""A tiny Z-Image checkpoint: ZImageTransformer2DModel, a Qwen3 text encoder with a chat-template tokenizer trained
in-process, FLUX's 4-channel VAE and Z-Image-Turbo's scheduler."""

from __future__ import annotations

import torch

from .components import CORPUS, tiny_flux_vae

# Qwen3's template, reduced to what ZImagePipeline uses: one user turn, the generation prompt, and the thinking switch
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def qwen_tokenizer():
    """A real byte-level BPE ``PreTrainedTokenizerFast`` with Qwen's special tokens (no BOS, pad = <|endoftext|>) and a
    chat template, trained in-process on the tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", model_max_length=64)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_z_image(directory, scheduler=None, seed: int = 0):
    """Z-Image-shaped: one main and one refiner layer of each kind with qk norm, a 2-layer Qwen3 (GQA) text encoder,
    a 4-channel VAE with FLUX's scaling and shift factors; Z-Image-Turbo's scheduler (static shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=128,
        )
    ).eval()
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,
        axes_dims=[4, 4, 8],
        axes_lens=[256, 32, 32],
    )
    pipe = ZImagePipeline(
        scheduler=scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_flux_vae(seed),
        text_encoder=text_encoder,
        tokenizer=qwen_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(directory)
    return directory
