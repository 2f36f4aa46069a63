"""Model-based image rewards (CLIP score, PickScore, aesthetic, HPSv2, ImageReward) on real photographs.

No hub access here: every model is the real transformers class at a tiny config with random weights,
saved with ``save_pretrained`` (with a real CLIP image processor and a real BPE / WordPiece tokenizer
built from a small vocabulary) and loaded back through flowrl's loading code. The numbers that depend
on the released weights are not checked here; the code paths, math and preprocessing are.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flowrl.errors import FlowRLError
from flowrl.reward_models import build_reward
from flowrl.reward_models.aesthetic import AestheticHead, AestheticReward, load_aesthetic_head
from flowrl.reward_models.clip_common import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ClipPreprocess,
    processor_pixel_values,
    to_uint8_images,
)
from flowrl.reward_models.clip_score import ClipScoreReward
from flowrl.reward_models.hpsv2 import HPSv2Reward, hps_scores
from flowrl.reward_models.image_reward import SCORE_MEAN, SCORE_STD, ImageRewardReward
from flowrl.reward_models.pickscore import PickScoreReward

PROJ = 16  # tiny CLIP projection size (the aesthetic head's input in these tests)
WORDS = ["a", "photo", "of", "the", "an", "astronaut", "cup", "coffee", "cat", "red", "flower", "temple", "in", "china"]
PROMPTS = [
    "a photo of an astronaut",
    "a cup of coffee",
    "a photo of the cat",
    "a temple in china",
    "a red flower",
]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ images


def _photo_arrays() -> list[np.ndarray]:
    """Real photographs as uint8 (H, W, 3): scikit-learn's two always, scikit-image's three when installed."""
    from sklearn.datasets import load_sample_images

    china, flower = load_sample_images().images
    try:
        import skimage.data as skd
    except ImportError:  # scikit-image is a test extra; sklearn's photos alone still exercise everything
        return [china, flower]
    return [skd.astronaut(), skd.coffee(), skd.chelsea(), china, flower]


def _to_tensor(arr: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.array(arr)).float().div(255.0)
    return t.permute(2, 0, 1)[None] if t.ndim == 3 else t[None, None]


@pytest.fixture(scope="module")
def photos() -> tuple[torch.Tensor, list[str]]:
    """A batch of real photos center-cropped (no resampling) to 300 x 420, with matching prompts."""
    arrays = _photo_arrays()
    crops = []
    for a in arrays:
        top, left = (a.shape[0] - 300) // 2, (a.shape[1] - 420) // 2
        crops.append(_to_tensor(a[top : top + 300, left : left + 420]))
    batch = torch.cat(crops)
    prompts = PROMPTS if len(arrays) == 5 else PROMPTS[3:]
    return batch, prompts


# ------------------------------------------------------------------------------------- tiny models


def _byte_alphabet() -> list[str]:
    # GPT-2 / CLIP byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _write_clip_bpe(directory) -> None:
    """A real CLIP BPE vocabulary: every byte (alone and word-final) plus merges spelling WORDS."""
    vocab: dict[str, int] = {}
    for c in _byte_alphabet():
        vocab.setdefault(c, len(vocab))
    for c in _byte_alphabet():
        vocab.setdefault(c + "</w>", len(vocab))
    merges: list[str] = []
    for w in WORDS:
        parts = list(w)
        parts[-1] += "</w>"
        while len(parts) > 1:
            merge = f"{parts[0]} {parts[1]}"
            if merge not in merges:
                merges.append(merge)
            vocab.setdefault(parts[0] + parts[1], len(vocab))
            parts = [parts[0] + parts[1]] + parts[2:]
    vocab.setdefault("<|startoftext|>", len(vocab))
    vocab.setdefault("<|endoftext|>", len(vocab))
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def _clip_image_processor():
    try:  # transformers 5.x without torchvision: the PIL backend, explicitly (no fallback warning)
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as cls
    except ImportError:  # transformers 4.x: CLIPImageProcessor is the PIL one
        from transformers import CLIPImageProcessor as cls
    return cls()  # defaults: shortest edge 224 bicubic, crop 224, OpenAI mean / std


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny CLIPModel + CLIPProcessor (real image processor and BPE tokenizer) saved with save_pretrained."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer

    d = tmp_path_factory.mktemp("tiny_clip")
    _write_clip_bpe(d)
    tokenizer = CLIPTokenizer.from_pretrained(str(d))
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            **ids,
        ),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=224, patch_size=32),
        projection_dim=PROJ,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(str(d))
    CLIPProcessor(image_processor=_clip_image_processor(), tokenizer=tokenizer).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def reference(clip_dir):
    """The same model and processor loaded independently of flowrl, for the reference computations."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    return model, AutoProcessor.from_pretrained(str(clip_dir))


def _feats(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _reference_cosine(reference, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """cos(image, prompt) computed straight from get_image_features / get_text_features on processor inputs."""
    model, processor = reference
    with torch.no_grad():
        pixels = processor(images=to_uint8_images(images), return_tensors="pt")["pixel_values"]
        text = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        img = _feats(model.get_image_features(pixel_values=pixels))
        txt = _feats(model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"]))
    img = img / img.norm(dim=-1, keepdim=True)
    txt = txt / txt.norm(dim=-1, keepdim=True)
    return (img * txt).sum(-1)


def _check_output(scores: torch.Tensor, batch: int) -> None:
    assert scores.shape == (batch,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()


def _check_grad(reward, images: torch.Tensor, prompts: list[str]) -> None:
    x = images.clone().requires_grad_(True)
    out = reward(x, prompts, [{}] * len(prompts))
    assert out.scores.requires_grad
    out.scores.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (x.grad.abs().flatten(1).sum(1) > 0).all()  # every image gets a gradient


# ---------------------------------------------------------------------------------- preprocessing


def test_normalisation_constants_are_openai_clip():
    from transformers.image_utils import OPENAI_CLIP_MEAN as HF_MEAN
    from transformers.image_utils import OPENAI_CLIP_STD as HF_STD

    assert OPENAI_CLIP_MEAN == (0.48145466, 0.4578275, 0.40821073)
    assert OPENAI_CLIP_STD == (0.26862954, 0.26130258, 0.27577711)
    assert tuple(HF_MEAN) == OPENAI_CLIP_MEAN and tuple(HF_STD) == OPENAI_CLIP_STD
    pre = ClipPreprocess.from_image_processor(_clip_image_processor())
    assert pre == ClipPreprocess(size=224, crop=(224, 224), mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)


def test_torch_preprocessing_matches_the_clip_image_processor():
    """The differentiable torch path against transformers' CLIPImageProcessor (PIL) on real photos at
    their native sizes (downsampling, square and not), a 64 px one (upsampling) and a grayscale one.

    PIL resizes separably with a uint8 round + clip after each pass, and reads uint8 input; the torch
    path reproduces the same kernel and the intermediate clip but stays in float, so the difference is
    bounded by about one uint8 step: 1/255 / std(0.26) = 0.015 after normalisation. (A single 2-D torch
    resize with one final clamp would differ by up to 0.07 here, 0.28 when upsampling.)
    """
    ip = _clip_image_processor()
    pre = ClipPreprocess.from_image_processor(ip)
    arrays = _photo_arrays()
    arrays += [arrays[0][::8, ::8], arrays[0].mean(axis=2).round().astype(np.uint8)]
    for a in arrays:
        x = _to_tensor(a)
        ours, theirs = pre(x), processor_pixel_values(ip, x)
        assert ours.shape == theirs.shape == (1, 3, 224, 224)
        diff = (ours - theirs).abs()
        assert diff.max().item() < 0.02, (a.shape, diff.max().item())
        assert diff.mean().item() < 0.006, (a.shape, diff.mean().item())
    gray = _to_tensor(arrays[-1])
    assert torch.equal(pre(gray), pre(gray.repeat(1, 3, 1, 1)))


# ------------------------------------------------------------------------------------- CLIP score


def test_clip_score_processor_path_equals_independent_cosine(clip_dir, reference, photos):
    images, prompts = photos
    reward = ClipScoreReward(str(clip_dir), differentiable=False)
    out = reward(images, prompts, [{}] * len(prompts))
    _check_output(out.scores, len(prompts))
    expected = _reference_cosine(reference, images, prompts)
    assert torch.allclose(out.scores, expected, atol=1e-5, rtol=0)
    assert torch.allclose(out.extras["cosine"], expected, atol=1e-5, rtol=0)
    assert not out.scores.requires_grad


def test_clip_score_torch_path_is_the_same_cosine_and_differentiable(clip_dir, reference, photos):
    images, prompts = photos
    model, _ = reference
    reward = ClipScoreReward(str(clip_dir))
    assert reward.differentiable
    out = reward(images, prompts, [{}] * len(prompts))
    _check_output(out.scores, len(prompts))
    # Same math on the torch-preprocessed pixels, computed here with the independently loaded model.
    pixels = ClipPreprocess.from_image_processor(_clip_image_processor())(images)
    with torch.no_grad():
        img = F.normalize(_feats(model.get_image_features(pixel_values=pixels)), dim=-1)
    txt_cos_ref = _reference_cosine(reference, images, prompts)  # text side shared with the processor path
    assert torch.allclose(out.scores.detach(), txt_cos_ref, atol=0.05)  # preprocessing paths agree closely
    tok = reference[1](text=prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        txt = F.normalize(_feats(model.get_text_features(**tok)), dim=-1)
    assert torch.allclose(out.scores.detach(), (img * txt).sum(-1), atol=1e-5, rtol=0)
    _check_grad(reward, images, prompts)

    clipscore = ClipScoreReward(str(clip_dir), scale=2.5, clip_negative=True)
    cs = clipscore(images, prompts, [{}] * len(prompts)).scores.detach()
    assert torch.allclose(cs, 2.5 * out.scores.detach().clamp(min=0), atol=1e-5)


def test_prompts_in_a_group_share_one_text_embedding(clip_dir, photos):
    images, _ = photos
    reward = ClipScoreReward(str(clip_dir), differentiable=False)
    same = reward(images[:2], ["a red flower"] * 2, [{}, {}]).scores
    each = torch.stack([reward(images[i : i + 1], ["a red flower"], [{}]).scores[0] for i in range(2)])
    assert torch.allclose(same, each, atol=1e-6)
    with pytest.raises(FlowRLError, match="one prompt per image"):
        reward(images[:2], ["a red flower"], [{}])


# -------------------------------------------------------------------------------------- PickScore


def test_pickscore_is_logit_scale_times_cosine(clip_dir, reference, photos):
    images, prompts = photos
    model, _ = reference
    scale = model.logit_scale.exp().item()
    assert scale == pytest.approx(1 / 0.07, rel=1e-4)  # CLIP's initial temperature in the tiny model
    for differentiable in (False, True):
        reward = PickScoreReward(str(clip_dir), processor=str(clip_dir), differentiable=differentiable)
        out = reward(images, prompts, [{}] * len(prompts))
        _check_output(out.scores, len(prompts))
        cos = ClipScoreReward(str(clip_dir), differentiable=differentiable)(images, prompts, [{}] * len(prompts)).scores
        assert torch.allclose(out.scores.detach(), scale * cos.detach(), atol=1e-4, rtol=0)
        if not differentiable:
            assert torch.allclose(out.scores, scale * _reference_cosine(reference, images, prompts), atol=1e-4, rtol=0)
    normalized = PickScoreReward(str(clip_dir), processor=str(clip_dir), normalize=True)
    norm_out = normalized(images, prompts, [{}] * len(prompts))
    assert torch.allclose(norm_out.scores.detach(), norm_out.extras["raw"] / 26.0, atol=1e-6)
    _check_grad(normalized, images, prompts)


# -------------------------------------------------------------------------------------- aesthetic


def _known_head(input_dim: int) -> AestheticHead:
    """A head with deterministic, non-trivial weights (no randomness)."""
    head = AestheticHead(input_dim)
    with torch.no_grad():
        for i, layer in enumerate(m for m in head.layers if isinstance(m, nn.Linear)):
            n = layer.weight.numel()
            k = torch.arange(n, dtype=torch.float32)
            # (k % 7) breaks the rank-2 structure a plain sin(a k + c) matrix would have.
            layer.weight.copy_(torch.sin(k * 0.37 + (k % 7) * 1.3 + i).view_as(layer.weight) / math.sqrt(layer.in_features))
            layer.bias.copy_(torch.cos(torch.arange(layer.out_features, dtype=torch.float32) + i) * 0.1)
    return head.eval()


def test_aesthetic_head_is_the_reference_linear_chain():
    head = _known_head(PROJ)
    keys = [k for k in head.state_dict()]
    assert keys == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    shapes = [tuple(head.state_dict()[f"layers.{i}.weight"].shape) for i in (0, 2, 4, 6, 7)]
    assert shapes == [(1024, PROJ), (128, 1024), (64, 128), (16, 64), (1, 16)]
    x = F.normalize(torch.linspace(-1, 1, 3 * PROJ).view(3, PROJ) ** 2 + 0.1, dim=-1)
    # By hand: five affine maps in a row, nothing in between (the reference's ReLUs are commented out).
    h = x.double()
    for i in (0, 2, 4, 6, 7):
        w, b = head.state_dict()[f"layers.{i}.weight"].double(), head.state_dict()[f"layers.{i}.bias"].double()
        h = h @ w.T + b
    assert torch.allclose(head(x).double(), h.squeeze(-1), atol=1e-5)
    # ... which is one affine map: W = W7 W6 W4 W2 W0.
    sd = {k: v.double() for k, v in head.state_dict().items()}
    W = sd["layers.7.weight"] @ sd["layers.6.weight"] @ sd["layers.4.weight"] @ sd["layers.2.weight"] @ sd["layers.0.weight"]
    b = sd["layers.0.bias"]
    for i in (2, 4, 6, 7):
        b = sd[f"layers.{i}.weight"] @ b + sd[f"layers.{i}.bias"]
    assert torch.allclose(head(x).double(), (x.double() @ W.T + b).squeeze(-1), atol=1e-5)


def test_aesthetic_reward_loads_pth_and_safetensors_heads(clip_dir, reference, photos, tmp_path):
    from safetensors.torch import save_file

    images, prompts = photos
    head = _known_head(PROJ)
    pth, st = tmp_path / "head.pth", tmp_path / "head.safetensors"
    torch.save(head.state_dict(), pth)  # the original release format: a plain state dict
    save_file(head.state_dict(), str(st))
    model, processor = reference
    with torch.no_grad():
        pixels = processor(images=to_uint8_images(images), return_tensors="pt")["pixel_values"]
        emb = F.normalize(_feats(model.get_image_features(pixel_values=pixels)), dim=-1)
        expected = head(emb)
    for path in (pth, st):
        reward = AestheticReward(str(clip_dir), head_path=str(path), head_input_dim=PROJ, differentiable=False)
        out = reward(images, prompts, [{}] * len(prompts))
        _check_output(out.scores, len(prompts))
        assert torch.allclose(out.scores, expected, atol=1e-5, rtol=0)
    reward = AestheticReward(str(clip_dir), head_path=str(pth), head_input_dim=PROJ)
    assert reward.differentiable and reward.name == "aesthetic"
    assert torch.allclose(reward(images, prompts, [{}] * len(prompts)).scores.detach(), expected, atol=0.05)
    _check_grad(reward, images, prompts)


def test_aesthetic_head_errors(clip_dir, tmp_path, photos):
    images, prompts = photos
    with pytest.raises(FlowRLError, match="head_path"):
        AestheticReward(str(clip_dir), head_input_dim=PROJ)(images[:1], prompts[:1], [{}])
    with pytest.raises(FlowRLError, match=str(tmp_path / "nope.pth").replace("+", r"\+")):
        load_aesthetic_head(tmp_path / "nope.pth", PROJ)
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(FlowRLError, match="corrupt"):
        load_aesthetic_head(bad, PROJ)
    torch.save(_known_head(PROJ).state_dict(), tmp_path / "h16.pth")
    with pytest.raises(FlowRLError, match="head_input_dim"):
        load_aesthetic_head(tmp_path / "h16.pth", 768)
    torch.save(_known_head(8).state_dict(), tmp_path / "h8.pth")
    with pytest.raises(FlowRLError, match="embeds into 16 dimensions"):
        AestheticReward(str(clip_dir), head_path=str(tmp_path / "h8.pth"), head_input_dim=8)(images[:1], prompts[:1], [{}])


# ---------------------------------------------------------------------------------- loading errors


@pytest.mark.parametrize("cls", [ClipScoreReward, PickScoreReward, AestheticReward])
def test_missing_directory_names_the_path(cls, tmp_path, photos):
    images, prompts = photos
    missing = tmp_path / "no_such_model"
    kwargs = {"processor": str(missing)} if cls is PickScoreReward else {}
    reward = cls(str(missing), **kwargs)  # building loads nothing
    if cls is AestheticReward:
        torch.save(_known_head(PROJ).state_dict(), tmp_path / "h.pth")
        reward = cls(str(missing), head_path=str(tmp_path / "h.pth"), head_input_dim=PROJ)
    with pytest.raises(FlowRLError, match=str(missing)):
        reward(images[:1], prompts[:1], [{}])


def test_corrupt_directory_is_a_flowrl_error(clip_dir, tmp_path, photos):
    import shutil

    images, prompts = photos
    broken = tmp_path / "broken"
    shutil.copytree(clip_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(FlowRLError, match=f"{broken}.*missing files or corrupt"):
        ClipScoreReward(str(broken))(images[:1], prompts[:1], [{}])
    (broken / "config.json").unlink()
    with pytest.raises(FlowRLError, match=str(broken)):
        ClipScoreReward(str(broken))(images[:1], prompts[:1], [{}])


def test_registry_builds_each_model_reward_without_loading(tmp_path):
    missing = str(tmp_path / "never_loaded")
    for name, differentiable in [("aesthetic", True), ("clip_score", True), ("pickscore", True), ("hpsv2", True), ("image_reward", True)]:
        reward = build_reward(name, pretrained=missing, dtype="bfloat16")
        assert reward.name == name and reward.differentiable is differentiable
        assert build_reward(name, differentiable=False).differentiable is False
    with pytest.raises(FlowRLError, match="dtype"):
        build_reward("clip_score", dtype="float64")


# ----------------------------------------------------------------------------------------- HPSv2


def test_hps_score_math_on_given_embeddings():
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(4, 8, generator=g) * 3, torch.randn(4, 8, generator=g)
    # hpsv2/img_score.py: normalised features, logits_per_image = img @ txt.T, score = diagonal.
    logits = (img / img.norm(dim=-1, keepdim=True)) @ (txt / txt.norm(dim=-1, keepdim=True)).T
    assert torch.allclose(hps_scores(img, txt), torch.diagonal(logits), atol=1e-6)
    assert torch.allclose(hps_scores(img, txt, scale=100.0), 100 * torch.diagonal(logits), atol=1e-4)
    assert torch.allclose(hps_scores(img, img), torch.ones(4), atol=1e-6)
    with pytest.raises(FlowRLError, match="one shape"):
        hps_scores(img, txt[:3])


def test_hpsv2_without_open_clip_names_the_extra(monkeypatch, photos):
    images, prompts = photos
    monkeypatch.setitem(sys.modules, "open_clip", None)  # makes `import open_clip` raise ImportError
    reward = HPSv2Reward()
    with pytest.raises(FlowRLError, match=r"flowrl\[hps\]"):
        reward(images[:1], prompts[:1], [{}])


# ------------------------------------------------------------------------------------- ImageReward


class _TimmStyleViT(nn.Module):
    """BLIP's vision encoder as BLIP's models/vit.py writes it (timm names: cls_token, pos_embed,
    patch_embed.proj, blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}, norm;
    LayerNorm eps 1e-6, exact GELU), implemented here independently of transformers."""

    def __init__(self, width: int, depth: int, heads: int, patch: int, image: int) -> None:
        super().__init__()
        self.heads = heads
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, width, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            blk = nn.Module()
            blk.norm1, blk.norm2 = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
            blk.attn = nn.Module()
            blk.attn.qkv, blk.attn.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            blk.mlp = nn.Module()
            blk.mlp.fc1, blk.mlp.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.blocks.append(blk)
        self.norm = nn.LayerNorm(width, eps=1e-6)
        with torch.no_grad():  # non-trivial LayerNorm parameters, so eps and naming errors would show
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed[:, : x.shape[1]]
        for blk in self.blocks:
            h = blk.norm1(x)
            B, N, C = h.shape
            q, k, v = blk.attn.qkv(h).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            attn = ((q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5).softmax(-1)
            x = x + blk.attn.proj((attn @ v).transpose(1, 2).reshape(B, N, C))
            x = x + blk.mlp.fc2(F.gelu(blk.mlp.fc1(blk.norm2(x))))
        return self.norm(x)


@pytest.fixture(scope="module")
def image_reward_dir(tmp_path_factory):
    """An ImageReward-layout checkpoint (blip.visual_encoder.* in timm names, blip.text_encoder.* in
    med.py names, mlp.layers.*, plus keys ImageReward carries but does not use), med_config.json and a
    real WordPiece tokenizer, at tiny sizes."""
    from transformers import BertTokenizer, BlipTextConfig, BlipTextModel

    d = tmp_path_factory.mktemp("tiny_image_reward")
    tok_dir = d / "tokenizer"
    tok_dir.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"]
    (tok_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(tok_dir))
    med = {  # BLIP's med_config.json fields at tiny sizes; +2 for the [DEC] / [ENC] tokens BLIP adds
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": 64,
        "model_type": "bert",
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": len(vocab) + 2,
        "encoder_width": 24,
        "add_cross_attention": True,
    }
    (d / "med_config.json").write_text(json.dumps(med))
    torch.manual_seed(1)
    vit = _TimmStyleViT(width=24, depth=2, heads=2, patch=32, image=224).eval()
    text = BlipTextModel(
        BlipTextConfig(
            vocab_size=len(vocab) + 2,
            hidden_size=32,
            encoder_hidden_size=24,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            sep_token_id=None,
            is_decoder=True,
        ),
        add_pooling_layer=False,
    )
    with torch.no_grad():  # transformers' init (std 0.02) makes a tiny model nearly input-independent
        for _name, p in text.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
    head = _known_head(32)
    state = {f"blip.visual_encoder.{k}": v for k, v in vit.state_dict().items()}
    state |= {f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()}
    state["blip.text_encoder.embeddings.position_ids"] = torch.arange(64)[None]  # old med.py buffer
    state |= {f"mlp.{k}": v for k, v in head.state_dict().items()}
    state |= {"blip.vision_proj.weight": torch.zeros(8, 24), "blip.text_proj.weight": torch.zeros(8, 32)}
    torch.save(state, d / "ImageReward.pt")
    return d, vit, text, head


def test_image_reward_vision_mapping_matches_a_blip_vit(image_reward_dir, photos):
    d, vit, _, _ = image_reward_dir
    images, prompts = photos
    reward = ImageRewardReward(str(d), tokenizer=str(d / "tokenizer"), vision_num_heads=2)
    model = reward.model_on(images.device)
    pixels = reward.preprocess(images)
    with torch.no_grad():
        ours = model.vision(pixel_values=pixels).last_hidden_state
        theirs = vit(pixels)
    assert ours.shape == theirs.shape == (len(prompts), 50, 24)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_image_reward_score_is_normalised_head_of_cls(image_reward_dir, photos):
    d, vit, text, head = image_reward_dir
    images, prompts = photos
    reward = ImageRewardReward(str(d), tokenizer=str(d / "tokenizer"), vision_num_heads=2)
    out = reward(images, prompts, [{}] * len(prompts))
    _check_output(out.scores, len(prompts))
    # By hand, from the modules that wrote the checkpoint: ViT tokens -> text [CLS] -> head -> normalise.
    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(str(d / "tokenizer"))
    t = tok(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert t["input_ids"][:, 0].eq(tok.cls_token_id).all()
    with torch.no_grad():
        tokens = vit(reward.preprocess(images))
        cls = text.eval()(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            encoder_hidden_states=tokens,
            encoder_attention_mask=torch.ones(tokens.shape[:2], dtype=torch.long),
        ).last_hidden_state[:, 0]
        raw = head(cls)
    assert torch.allclose(out.extras["raw"], raw, atol=1e-5)
    assert torch.allclose(out.scores.detach(), (raw - SCORE_MEAN) / SCORE_STD, atol=1e-5)
    # The text encoder really reads the image: other images change the [CLS] state of the same prompts.
    ids, mask = reward.tokenize(prompts, images.device)
    with torch.no_grad():
        cls_here = reward._model.text_features(reward.preprocess(images), ids, mask)
        cls_flipped = reward._model.text_features(reward.preprocess(images.flip(0)), ids, mask)
    assert torch.allclose(cls_here, cls, atol=1e-5)
    assert (cls_here - cls_flipped).abs().mean() > 0.01
    pil = ImageRewardReward(str(d), tokenizer=str(d / "tokenizer"), vision_num_heads=2, differentiable=False)
    assert torch.allclose(pil(images, prompts, [{}] * len(prompts)).scores, out.scores.detach(), atol=0.05)
    _check_grad(reward, images, prompts)


def test_image_reward_loading_errors(image_reward_dir, tmp_path, photos):
    d, _, _, _ = image_reward_dir
    images, prompts = photos
    missing = tmp_path / "no_image_reward"
    with pytest.raises(FlowRLError, match=str(missing)):
        ImageRewardReward(str(missing), tokenizer=str(d / "tokenizer"))(images[:1], prompts[:1], [{}])
    partial = tmp_path / "partial"
    partial.mkdir()
    state = torch.load(d / "ImageReward.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if not k.startswith("mlp.")}, partial / "ImageReward.pt")
    (partial / "med_config.json").write_text((d / "med_config.json").read_text())
    with pytest.raises(FlowRLError, match="lacks 10 weights"):
        ImageRewardReward(str(partial), tokenizer=str(d / "tokenizer"), vision_num_heads=2)(images[:1], prompts[:1], [{}])


# ------------------------------------------------------------------------------------- edit rewards


def test_source_preservation_is_one_minus_the_mean_absolute_change_outside_the_mask(tmp_path):
    """Hand-derived: an 8x8 grey source, the edit whitens a 4x4 patch (16 of 64 pixels by 0.5): 1 - 16 * 0.5 / 64 =
    0.875 everywhere, 1.0 with the patch masked as the edit region; the source is read from a PNG path, resized to
    the sample's size; the gradient is -sign(change) / area."""
    from PIL import Image

    from flowrl.reward_models.edit import SourcePreservationReward

    Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(tmp_path / "source.png")  # 128 / 255, resized to 8x8
    mask = np.zeros((8, 8), np.uint8)
    mask[:4, :4] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    grey = 128 / 255
    edited = torch.full((2, 3, 8, 8), grey)
    edited[:, :, :4, :4] = grey + 0.5
    edited.requires_grad_(True)
    reward = build_reward("source_preservation")
    assert isinstance(reward, SourcePreservationReward) and reward.differentiable
    meta = [{"image": str(tmp_path / "source.png")}, {"image": str(tmp_path / "source.png"), "mask": str(tmp_path / "mask.png")}]
    out = reward(edited, ["make the corner white"] * 2, meta)
    assert out.scores.tolist() == pytest.approx([0.875, 1.0], abs=1e-6)
    assert out.extras["preserved_fraction"].tolist() == pytest.approx([1.0, 0.75])
    out.scores[0].backward()
    assert edited.grad[0, :, :4, :4].unique().tolist() == pytest.approx([-1 / 192])  # d(1 - sum|d| / (3*64)) / dx
    with pytest.raises(FlowRLError, match="source image of every prompt"):
        reward(edited.detach(), ["x", "y"], [{}, {}])
    with pytest.raises(FlowRLError, match="could not read the source image"):
        reward(edited.detach()[:1], ["x"], [{"image": str(tmp_path / "missing.png")}])


def test_clip_directional_is_the_cosine_of_the_image_and_text_changes(clip_dir, reference, photos):
    """Against the same CLIP loaded independently: cos(E_img(edited) - E_img(source), E_txt(target) - E_txt(source
    caption)), with the prompt as the default target caption and the empty string as the default source caption."""
    images, prompts = photos
    sources = images.flip(0)  # each photo's 'source' is another photo
    meta = [{"image": s, "source_caption": "a photo"} for s in sources]
    meta[0] = {"image": sources[0], "target_caption": "a red flower", "source_caption": "a cup of coffee"}
    out = build_reward("clip_directional", pretrained=str(clip_dir), differentiable=False)(images, prompts, meta)
    model, processor = reference

    def img_feats(x):
        pixels = processor(images=to_uint8_images(x), return_tensors="pt")["pixel_values"]
        return F.normalize(_feats(model.get_image_features(pixel_values=pixels)), dim=-1)

    def txt_feats(texts):
        tok = processor(text=texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        return F.normalize(_feats(model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])), dim=-1)

    with torch.no_grad():
        d_img = img_feats(images) - img_feats(sources)
        targets = ["a red flower"] + prompts[1:]
        originals = ["a cup of coffee"] + ["a photo"] * (len(prompts) - 1)
        d_txt = torch.cat([txt_feats([t]) for t in targets]) - torch.cat([txt_feats([o]) for o in originals])
    expected = F.cosine_similarity(d_img, d_txt, dim=-1)
    assert torch.allclose(out.scores, expected, atol=1e-5, rtol=0)
    x = images.clone().requires_grad_(True)  # the torch preprocessing path carries a gradient to the edited image
    scores = build_reward("clip_directional", pretrained=str(clip_dir))(x, prompts, meta).scores
    scores.sum().backward()
    assert (x.grad.abs().flatten(1).sum(1) > 0).all() and (scores - expected).abs().max() < 0.05
