"""Tiny FLUX.2 checkpoints: Flux2Transformer2DModel, the FLUX.2 VAE and the variant's text encoder (FLUX.2-dev: a
30-layer Mistral3; klein: a 27-layer Qwen3, so that the pipelines' default stacked layers exist), each with a
chat-template tokenizer trained in-process."""

from __future__ import annotations

import torch

from .components import CORPUS, flux_dynamic_scheduler

# Chat templates shaped like the real ones (Mistral-Small-3.1's system/[INST] turns with typed content; Qwen3's
# im_start turns with the empty think block that enable_thinking=False adds): both sides call the same template.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = m['content'] | map(attribute='text') | join('') %}{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def chat_tokenizer(kind: str):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained in-process (the system message in its corpus, so that it
    costs few tokens) with a chat template. The real FLUX.2-dev tokenizer is a PixtralProcessor, which needs
    torchvision; its text path is this tokenizer's ``apply_chat_template``."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "dev":
        specials = ["<pad>", "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
        names = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        names = {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = (CORPUS + [SYSTEM_MESSAGE, "user assistant"]) * 4
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=500, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512, **names)
    fast.chat_template = MISTRAL_TEMPLATE if kind == "dev" else QWEN_TEMPLATE
    return fast


def tiny_mistral3(seed: int = 0):
    """Mistral3ForConditionalGeneration (Mistral text model + Pixtral vision tower) with 30 text layers of width 16."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=30, num_attention_heads=2)
    text.update(num_key_value_heads=1, head_dim=8, max_position_embeddings=256, sliding_window=None, pad_token_id=0, bos_token_id=2)
    vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=32)
    vision.update(patch_size=8, num_channels=3, head_dim=8)
    torch.manual_seed(seed)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=10, spatial_merge_size=1)
    return Mistral3ForConditionalGeneration(config).eval()


def tiny_qwen3(seed: int = 0, layers: int = 27):
    """Qwen3ForCausalLM with 27 layers of width 16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_flux2_vae(seed: int = 0):
    """AutoencoderKLFlux2 (4 latent channels, scale factor 2) with non-trivial batch-norm running statistics."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    vae.bn.running_mean.copy_(0.3 * torch.randn(16))  # a fresh BatchNorm's (0, 1) would hide a missing denormalisation
    vae.bn.running_var.copy_(0.5 + torch.rand(16))
    return vae.eval()


def build_tiny_flux2(directory, variant: str = "dev", dynamic: bool = True, is_distilled: bool = False, seed: int = 0):
    """FLUX.2-shaped: one double- and one single-stream block (guidance embedding for dev), the variant's text
    encoder and chat template (``variant``: dev, else klein), the FLUX.2 VAE, a dynamically shifting FlowMatchEuler
    scheduler (or shift 3); a klein model is the step-distilled one when ``is_distilled``, else klein-base."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,  # three stacked hidden states of width 16
        timestep_guidance_channels=256,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=variant == "dev",
    )
    scheduler = flux_dynamic_scheduler() if dynamic else FlowMatchEulerDiscreteScheduler(shift=3.0)
    parts = dict(scheduler=scheduler, vae=tiny_flux2_vae(seed), tokenizer=chat_tokenizer(variant), transformer=transformer)
    if variant == "dev":
        pipe = Flux2Pipeline(text_encoder=tiny_mistral3(seed), **parts)
    else:
        pipe = Flux2KleinPipeline(text_encoder=tiny_qwen3(seed), is_distilled=is_distilled, **parts)
    pipe.save_pretrained(directory)
    return directory
