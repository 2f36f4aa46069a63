"""ImageReward v1.0 (Xu et al. 2023, THUDM): a BLIP ViT-L/16 + BERT cross-encoder with an MLP head,
trained on 137k expert comparisons. Rebuilt here on transformers' BLIP classes, so the ``image-reward``
package (which pins timm / fairscale and imports torchvision) is not needed.

Architecture, as ``ImageReward/ImageReward.py`` (``ImageReward.score``) runs it:

1. Image: ``_transform(224)`` = Resize(224, bicubic) on the shortest side, CenterCrop(224), OpenAI CLIP
   mean / std; then BLIP's ViT-L/16 (``blip.visual_encoder``): the full normalised token sequence.
2. Prompt: ``bert-base-uncased`` tokenizer plus BLIP's added ``[DEC]`` / ``[ENC]`` tokens, padded to 35
   tokens; BLIP's BERT (``blip.text_encoder``, med.py) reads it with cross-attention to every image
   token (an all-ones image mask), bidirectionally.
3. Head: the [CLS] hidden state -> ``MLP(768)`` (768-1024-128-64-16-1, dropouts, no activations: the
   same module as the aesthetic predictor's) -> ``(r - 0.16717362830052426) / 1.0333394966054072``.

Mapping onto transformers: ``BlipVisionModel`` is the same ViT as BLIP's timm-style one under other
names (``convert_visual_keys``), with BLIP's LayerNorm eps 1e-6; ``BlipTextModel`` is transformers'
port of med.py and keeps its module names, so ``blip.text_encoder.*`` keys load as they are. The head
keys ``mlp.layers.*`` are unchanged.

Weights: the hub repo ``THUDM/ImageReward`` (``ImageReward.pt`` + ``med_config.json``), or a local
directory holding those two files (``ImageReward.safetensors`` with the same keys also works), or the
path of the checkpoint file itself with ``med_config.json`` beside it. The tokenizer comes from
``tokenizer`` (default ``bert-base-uncased``: hub id or local directory).

Verified here (tests/test_model_rewards.py, tiny random configs): the vision key mapping reproduces a
BLIP-style timm ViT implemented independently in the test, bit for bit up to float error; every
parameter of the rebuilt model is filled from an ImageReward-layout state dict; the score equals the
head and normalisation applied by hand to the text tower's [CLS] state; gradients reach the images.
Not verified: numbers against the released ``ImageReward.pt`` (no hub access here), and the text tower
against med.py itself (med.py imports transformers internals that 5.x removed; the equivalence rests
on transformers' port keeping med.py's structure and names).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.errors import FlowRLError
from flowrl.hub import download_files
from flowrl.reward_models.aesthetic import AestheticHead
from flowrl.reward_models.clip_common import (
    ClipPreprocess,
    PretrainedReward,
    as_rgb,
    check_batch,
    from_pretrained,
    looks_local,
    processor_pixel_values,
    read_state_dict,
)
from flowrl.types import RewardOutput

DEFAULT_REPO = "THUDM/ImageReward"
DEFAULT_TOKENIZER = "bert-base-uncased"
CHECKPOINT_FILES = ("ImageReward.safetensors", "ImageReward.pt")
MED_CONFIG = "med_config.json"
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
MAX_PROMPT_TOKENS = 35
IMAGE_SIZE = 224
BLIP_VIT_LAYER_NORM_EPS = 1e-6  # BLIP's vit.py: partial(nn.LayerNorm, eps=1e-6)


def convert_visual_keys(state: Mapping[str, Tensor], prefix: str = "blip.visual_encoder.") -> dict[str, Tensor]:
    """BLIP timm-style ViT keys -> ``BlipVisionModel`` keys (the renames of transformers'
    ``convert_blip_original_pytorch_to_hf.py``)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        k = key[len(prefix) :]
        if k == "cls_token":
            k = "embeddings.class_embedding"
        elif k == "pos_embed":
            k = "embeddings.position_embedding"
        elif k.startswith("patch_embed.proj."):
            k = "embeddings.patch_embedding." + k[len("patch_embed.proj.") :]
        elif k.startswith("norm."):
            k = "post_layernorm." + k[len("norm.") :]
        elif k.startswith("blocks."):
            k = "encoder.layers." + k[len("blocks.") :]
            k = k.replace(".norm1.", ".layer_norm1.").replace(".norm2.", ".layer_norm2.")
            k = k.replace(".attn.qkv.", ".self_attn.qkv.").replace(".attn.proj.", ".self_attn.projection.")
        else:
            continue
        out[k] = value
    return out


def convert_checkpoint(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An ImageReward.pt state dict -> the state dict of ``ImageRewardModel`` (unused keys such as
    ``blip.vision_proj`` / ``blip.text_proj`` and the ``position_ids`` buffer are dropped)."""
    out = {f"vision.{k}": v for k, v in convert_visual_keys(state).items()}
    for key, value in state.items():
        if key.startswith("blip.text_encoder.") and not key.endswith("embeddings.position_ids"):
            out["text." + key[len("blip.text_encoder.") :]] = value
        elif key.startswith("mlp.layers."):
            out[key] = value
    return out


def vision_config_from_state(state: Mapping[str, Tensor], num_heads: int | None = None):
    """A ``BlipVisionConfig`` read off the checkpoint's shapes (heads: width / 64 unless given)."""
    from transformers import BlipVisionConfig

    p = "blip.visual_encoder."
    try:
        width = int(state[p + "cls_token"].shape[-1])
        patch = int(state[p + "patch_embed.proj.weight"].shape[-1])
        positions = int(state[p + "pos_embed"].shape[1])
        inter = int(state[p + "blocks.0.mlp.fc1.weight"].shape[0])
    except KeyError as e:
        raise FlowRLError(f"the ImageReward checkpoint has no BLIP vision encoder weight {e.args[0]}.") from e
    depth = len({m.group(1) for k in state if (m := re.match(re.escape(p) + r"blocks\.(\d+)\.", k))})
    side = round((positions - 1) ** 0.5)
    if num_heads is None:
        if width % 64:
            raise FlowRLError(f"cannot infer the ViT head count for width {width}; pass vision_num_heads.")
        num_heads = width // 64  # BLIP ViT-B (768 / 12) and ViT-L (1024 / 16) both use 64-d heads
    return BlipVisionConfig(
        hidden_size=width,
        intermediate_size=inter,
        num_hidden_layers=depth,
        num_attention_heads=num_heads,
        image_size=side * patch,
        patch_size=patch,
        hidden_act="gelu",
        layer_norm_eps=BLIP_VIT_LAYER_NORM_EPS,
        attention_dropout=0.0,
    )


def text_config_from_med(med: Mapping[str, Any], encoder_width: int):
    """A ``BlipTextConfig`` from BLIP's med_config.json (a BertConfig with cross-attention)."""
    from transformers import BlipTextConfig

    return BlipTextConfig(
        vocab_size=int(med["vocab_size"]),
        hidden_size=int(med["hidden_size"]),
        encoder_hidden_size=int(encoder_width),
        intermediate_size=int(med["intermediate_size"]),
        num_hidden_layers=int(med["num_hidden_layers"]),
        num_attention_heads=int(med["num_attention_heads"]),
        max_position_embeddings=int(med["max_position_embeddings"]),
        hidden_act=str(med.get("hidden_act", "gelu")),
        layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)),
        hidden_dropout_prob=float(med.get("hidden_dropout_prob", 0.0)),
        attention_probs_dropout_prob=float(med.get("attention_probs_dropout_prob", 0.0)),
        pad_token_id=int(med.get("pad_token_id", 0)),
        bos_token_id=None,
        eos_token_id=None,
        sep_token_id=None,
        is_decoder=True,  # builds the cross-attention layers; forward runs bidirectionally (is_decoder=False)
    )


class ImageRewardModel(nn.Module):
    """BLIP vision tower + BLIP text cross-encoder + MLP head; ``forward`` returns the raw head output."""

    def __init__(self, vision_config: Any, text_config: Any) -> None:
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        self.vision = BlipVisionModel(vision_config)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.mlp = AestheticHead(text_config.hidden_size)

    def text_features(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, hidden) [CLS] state of the text encoder cross-attending to the image tokens."""
        image_embeds = self.vision(pixel_values=pixel_values).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        out = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
            is_decoder=False,
        )
        return out.last_hidden_state[:, 0, :].float()

    def forward(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.mlp(self.text_features(pixel_values, input_ids, attention_mask))


def _read_state(file: Path) -> dict[str, Tensor]:
    return read_state_dict(file, "ImageReward checkpoint weights")


def resolve_files(pretrained: str) -> tuple[Path, Path]:
    """(checkpoint, med_config.json) from a file, a directory or a hub repo."""
    if looks_local(pretrained):
        p = Path(pretrained).expanduser()
        if p.is_file():
            ckpt, med = p, p.parent / MED_CONFIG
        elif p.is_dir():
            found = [p / f for f in CHECKPOINT_FILES if (p / f).is_file()]
            if not found:
                raise FlowRLError(f"no ImageReward checkpoint ({' or '.join(CHECKPOINT_FILES)}) in {p}.")
            ckpt, med = found[0], p / MED_CONFIG
        else:
            raise FlowRLError(f"ImageReward path {p} does not exist; pass the directory holding ImageReward.pt and {MED_CONFIG}.")
        if not med.is_file():
            raise FlowRLError(f"{MED_CONFIG} not found at {med}; download it from the hub repo {DEFAULT_REPO}.")
        return ckpt, med
    ckpt, med = download_files(pretrained, ["ImageReward.pt", MED_CONFIG], "download them while online and pass their directory")
    return ckpt, med


def load_image_reward_model(pretrained: str, vision_num_heads: int | None = None) -> ImageRewardModel:
    """Build ``ImageRewardModel`` from an ImageReward checkpoint; every parameter must be filled."""
    ckpt, med_file = resolve_files(pretrained)
    try:
        med = json.loads(med_file.read_text())
    except (OSError, ValueError) as e:
        raise FlowRLError(f"{med_file} is not a readable JSON config ({e}).") from e
    state = _read_state(ckpt)
    vision_config = vision_config_from_state(state, vision_num_heads)
    text_config = text_config_from_med(med, vision_config.hidden_size)
    model = ImageRewardModel(vision_config, text_config)
    converted = convert_checkpoint(state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(converted))
    if missing:
        raise FlowRLError(
            f"ImageReward checkpoint at {ckpt} lacks {len(missing)} weights of the model (first: {missing[0]}); "
            "is it the ImageReward.pt of THUDM/ImageReward?"
        )
    wrong = [k for k in expected if tuple(converted[k].shape) != tuple(expected[k].shape)]
    if wrong:
        raise FlowRLError(
            f"ImageReward checkpoint at {ckpt} does not fit {MED_CONFIG}: {wrong[0]} has shape "
            f"{tuple(converted[wrong[0]].shape)}, the model expects {tuple(expected[wrong[0]].shape)}."
        )
    model.load_state_dict({k: converted[k] for k in expected}, strict=True)
    model.eval()
    model.requires_grad_(False)
    return model


def load_blip_tokenizer(source: str) -> Any:
    """BLIP's ``init_tokenizer``: a BERT tokenizer with ``[DEC]`` as bos and ``[ENC]`` added."""
    from transformers import BertTokenizer

    tok = from_pretrained(BertTokenizer.from_pretrained, source, "BERT tokenizer")
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


def normalize_scores(raw: Tensor) -> Tensor:
    """ImageReward's published normalisation of the head output."""
    return (raw - SCORE_MEAN) / SCORE_STD


@dataclass(eq=False, repr=False)
class ImageRewardReward(PretrainedReward):
    """ImageReward score (normalised head output, roughly standard normal over its training set).

    ``extras["raw"]`` is the head output before normalisation.

    Args:
        pretrained: hub repo (default THUDM/ImageReward) or a directory holding its checkpoint.
        tokenizer: the BERT tokenizer of the prompts (a hub id or a directory).
        differentiable: preprocess in torch (gradients reach the images); false: transformers'
            CLIPImageProcessor with ImageReward's settings (PIL bicubic 224, crop 224) under no_grad.
        vision_num_heads: attention heads of the ViT; None: inferred from the checkpoint's width.
    """

    name = "image_reward"

    pretrained: str = DEFAULT_REPO
    tokenizer: str = DEFAULT_TOKENIZER
    differentiable: bool = True
    vision_num_heads: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tokenizer_source = self.tokenizer
        self.differentiable = bool(self.differentiable)
        self.preprocess = ClipPreprocess.openai(IMAGE_SIZE)
        self._tokenizer: Any = None
        self._image_processor: Any = None

    def _load(self) -> None:
        try:  # transformers 5.x: the PIL backend by name (ImageReward resizes PIL images)
            from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as CLIPImageProcessor
        except ImportError:  # transformers 4.x: CLIPImageProcessor is the PIL one
            from transformers import CLIPImageProcessor

        tokenizer = load_blip_tokenizer(self.tokenizer_source)
        model = load_image_reward_model(self.pretrained, self.vision_num_heads)
        if model.vision.config.image_size != IMAGE_SIZE:
            self.preprocess = ClipPreprocess.openai(model.vision.config.image_size)
        side = self.preprocess.crop[0] if self.preprocess.crop else IMAGE_SIZE
        self._image_processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        # The towers run in the requested dtype; the head stays float32 as in ImageReward (.float()).
        model.vision.to(self.dtype)
        model.text.to(self.dtype)
        self._tokenizer = tokenizer
        self._model = model

    def tokenize(self, prompts: Sequence[str], device: torch.device) -> tuple[Tensor, Tensor]:
        tokens = self._tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt")
        return tokens["input_ids"].to(device), tokens["attention_mask"].to(device)

    def pixel_values(self, samples: Tensor, device: torch.device) -> Tensor:
        if self.differentiable:
            return self.preprocess(samples.to(device))
        return processor_pixel_values(self._image_processor, samples).to(device)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        check_batch(samples, prompts)
        as_rgb(samples)
        model = self.model_on(samples.device)
        device = next(model.parameters()).device
        input_ids, attention_mask = self.tokenize(prompts, device)
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            pixels = self.pixel_values(samples, device).to(self.dtype)
            raw = model(pixels, input_ids, attention_mask)
        return RewardOutput(
            scores=normalize_scores(raw).float().to(samples.device), extras={"raw": raw.detach().float().to(samples.device)}
        )
