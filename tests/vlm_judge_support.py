"""A tiny LLaVA vision-language model built offline, for testing the VLM-judge reward against a real server.

``build_tiny_llava(path, words)`` saves, with ``save_pretrained``, a real ``LlavaForConditionalGeneration``
(a 2-layer CLIP vision tower, a 2-layer Llama) with random weights, a word-level tokenizer made with the
``tokenizers`` library whose only answer words are ``words``, a CLIP image processor from its class
defaults (at 32 x 32 pixels) and a chat template: everything ``transformers serve`` needs to load the
directory as a vision-language model, and nothing from the hub. Every other token the model could emit
is special (skipped when decoding) and suppressed in its generation config, so each greedy answer is
exactly ``max_new_tokens`` of ``words``: with digits, every answer is a number; with "maybe" or "cat", not a
verdict. Two weights are set by hand so that the answer depends on the image (see the comment there).

``expected_answer`` runs the same saved model in-process with transformers' ``generate`` (greedy, the same
chat template and the same images decoded from PNG bytes) to know what the server must answer.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import torch

IMAGE_SIZE = 32  # the processor's input resolution: 4 x 4 patches of 8 pixels
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]
# Role and frame markers the chat template writes; they are special tokens, so nothing decodes them.
MARKERS = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ ' ' + part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tiny_llava(path: Path, words: Sequence[str], seed: int = 1) -> Path:
    """Save a tiny random-weight LLaVA whose greedy answers are made of ``words`` only; returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    vocab = {token: i for i, token in enumerate(SPECIALS + MARKERS + list(words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
        additional_special_tokens=MARKERS,
    )
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=vocab["<image>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        # Template words (all <unk> here) and markers get zero embeddings, so they add nothing to the attention and
        # the answer is decided by the image features and the answer words (the prompt's digits, say): with random
        # weights everywhere, a long template would otherwise drown the image and every image would get one answer.
        model.get_input_embeddings().weight[[vocab[t] for t in SPECIALS + MARKERS]] = 0.0
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    # Only the answer words may be generated: every answer is exactly max_new_tokens words.
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        suppress_tokens=[vocab[t] for t in SPECIALS + MARKERS],
    )
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def png_image(pixels: torch.Tensor):
    """A (C, H, W) tensor in [0, 1] as the PIL image a server decodes from its PNG (RGB, 8 bits)."""
    from PIL import Image

    array = (pixels.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array).save(buffer, format="PNG")
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def expected_answer(path: Path, images: Sequence[torch.Tensor], text: str, max_new_tokens: int) -> str:
    """The greedy answer of the saved model to one user message (the images, then the text), in-process."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    content = [{"type": "image", "image": png_image(image)} for image in images] + [{"type": "text", "text": text}]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[-1] :], skip_special_tokens=True)


def judge_images(n: int, channels: int = 3, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, seed: int = 0) -> torch.Tensor:
    """(n, C, H, W) images in [0, 1] that differ a lot: a random colour along a ramp, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    colour = torch.rand(n, channels, 1, 1, generator=g)
    ramp = torch.linspace(0, 1, width).view(1, 1, 1, width)
    return (colour * ramp + 0.2 * torch.rand(n, channels, height, width, generator=g)).clamp(0, 1)
