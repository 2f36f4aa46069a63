"""Rewards score what they claim to: real digits, hand-computed softmax, PIL byte counts, weighted sums."""

from __future__ import annotations

import io
import json
import math
import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from flowrl.errors import FlowRLError
from flowrl.reward_models import REWARD_NAMES, build_reward
from flowrl.reward_models.combine import WeightedSum
from flowrl.reward_models.digit_classifier import DEFAULT_DIR, DigitClassifierReward
from flowrl.reward_models.image_stats import InkReward
from flowrl.reward_models.jpeg import JpegCompressibilityReward, JpegIncompressibilityReward, jpeg_size_kb
from flowrl.reward_models.train_digit_classifier import split_indices, unit_images
from flowrl.types import RewardOutput

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def held_out() -> tuple[torch.Tensor, list[dict]]:
    """The shipped classifier's held-out 20%, as reward inputs: images in [0, 1] and digit metadata."""
    seed = json.loads((DEFAULT_DIR / "training_info.json").read_text())["seed"]
    images, labels = unit_images()
    _, idx = split_indices(images.shape[0], seed)
    return images[idx], [{"digit": int(d)} for d in labels[idx]]


@pytest.fixture(scope="module")
def classifier() -> DigitClassifierReward:
    return DigitClassifierReward()


def test_classifier_reads_held_out_digits(classifier, held_out):
    images, meta = held_out
    out = classifier(images, [""] * len(meta), meta)
    assert out.scores.shape == (len(meta),) and out.scores.dtype == torch.float32
    assert out.extras["accuracy"].mean().item() >= 0.95
    assert out.scores.min().item() >= 0.0 and out.scores.max().item() <= 1.0
    assert out.scores.mean().item() >= 0.9


def test_classifier_score_is_softmax_of_prompted_digit(classifier, held_out):
    images, meta = held_out[0][:16], held_out[1][:16]
    # Ask for a mix of right and wrong digits so both high and low probabilities are checked.
    meta = [{"digit": (m["digit"] + i % 2) % 10} for i, m in enumerate(meta)]
    out = classifier(images, [""] * 16, meta)
    logits = classifier.model(images)
    expected = torch.stack([torch.exp(logits[i, m["digit"]]) / torch.exp(logits[i]).sum() for i, m in enumerate(meta)])
    torch.testing.assert_close(out.scores, expected, rtol=1e-5, atol=1e-6)
    argmax_ok = torch.tensor([float(logits[i].argmax() == m["digit"]) for i, m in enumerate(meta)])
    torch.testing.assert_close(out.extras["accuracy"], argmax_ok)


def test_classifier_and_ink_pass_gradients_to_samples(classifier, held_out):
    for reward in (classifier, InkReward()):
        assert reward.differentiable
        samples = held_out[0][:8].clone().requires_grad_(True)
        reward(samples, [""] * 8, held_out[1][:8]).scores.sum().backward()
        assert samples.grad is not None and samples.grad.abs().sum().item() > 0
    assert not any(p.requires_grad for p in classifier.model.parameters())
    assert not classifier.model.training


def test_classifier_first_called_in_inference_mode_stays_differentiable(held_out):
    reward = DigitClassifierReward()
    with torch.inference_mode():
        reward(held_out[0][:2], ["", ""], held_out[1][:2])
    samples = held_out[0][:2].clone().requires_grad_(True)
    reward(samples, ["", ""], held_out[1][:2]).scores.sum().backward()
    assert samples.grad.abs().sum().item() > 0


def test_classifier_is_nan_without_a_digit(classifier, held_out):
    meta = [{"digit": 3}, {}, {"digit": None}, {"other": 1}]
    out = classifier(held_out[0][:4], [""] * 4, meta)
    assert not math.isnan(out.scores[0].item())
    assert torch.isnan(out.scores[1:]).all() and torch.isnan(out.extras["accuracy"][1:]).all()


def test_classifier_reads_rgb_as_gray(classifier, held_out):
    gray, meta = held_out[0][:4], held_out[1][:4]
    rgb = gray.expand(-1, 3, -1, -1)
    torch.testing.assert_close(classifier(rgb, [""] * 4, meta).scores, classifier(gray, [""] * 4, meta).scores)


def test_corrupt_or_missing_weights_raise_flowrl_error(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x00\x13not a safetensors file at all" * 10)
    for path in (bad, tmp_path):  # the file itself, and the directory holding it
        with pytest.raises(FlowRLError, match=re.escape(str(bad))):
            DigitClassifierReward(path)(torch.zeros(1, 1, 8, 8), [""], [{"digit": 0}])
    mismatched = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(mismatched))
    with pytest.raises(FlowRLError, match=re.escape(str(mismatched))):
        DigitClassifierReward(mismatched)(torch.zeros(1, 1, 8, 8), [""], [{"digit": 0}])
    missing = tmp_path / "nowhere"
    with pytest.raises(FlowRLError, match=re.escape(str(missing))):
        DigitClassifierReward(missing)(torch.zeros(1, 1, 8, 8), [""], [{"digit": 0}])


def test_ink_is_mean_intensity():
    samples = torch.stack([torch.zeros(1, 8, 8), torch.ones(1, 8, 8), torch.eye(8)[None]])
    torch.testing.assert_close(InkReward()(samples, [""] * 3, [{}] * 3).scores, torch.tensor([0.0, 1.0, 1 / 8]))


def pil_kb(pixels: np.ndarray) -> float:
    """JPEG size in kB of a uint8 (H, W) or (H, W, 3) array, encoded here independently of flowrl."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    return len(buf.getvalue()) / 1000


@pytest.mark.parametrize("channels,upscale", [(1, 1), (1, 4), (3, 1), (3, 4)])
def test_jpeg_size_matches_independent_pil_encode(channels, upscale):
    gen = torch.Generator().manual_seed(channels * 10 + upscale)
    samples = torch.rand(3, channels, 8, 8, generator=gen)
    sizes = jpeg_size_kb(samples, upscale=upscale)
    for img, size in zip(samples, sizes):
        pixels = (img * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        pixels = np.kron(pixels, np.ones((upscale, upscale, 1), dtype=np.uint8))
        assert size.item() == pytest.approx(pil_kb(pixels[:, :, 0] if channels == 1 else pixels))


@pytest.mark.parametrize("channels", [1, 3])
def test_jpeg_flat_image_is_more_compressible_than_noise(channels):
    flat = torch.full((1, channels, 8, 8), 0.5)
    noise = torch.rand(1, channels, 8, 8, generator=torch.Generator().manual_seed(0))
    samples = torch.cat([flat, noise])
    comp = JpegCompressibilityReward(upscale=4)(samples, ["", ""], [{}, {}])
    incomp = JpegIncompressibilityReward(upscale=4)(samples, ["", ""], [{}, {}])
    assert comp.scores[0] > comp.scores[1]
    assert (comp.scores < 0).all()
    torch.testing.assert_close(incomp.scores, -comp.scores)


class Fixed:
    """A stub reward returning fixed scores and one extra."""

    def __init__(self, name: str, scores: list[float], differentiable: bool = True) -> None:
        self.name, self.scores, self.differentiable = name, torch.tensor(scores), differentiable

    def __call__(self, samples, prompts, metadata) -> RewardOutput:
        return RewardOutput(scores=self.scores.clone(), extras={"double": 2 * self.scores})


def test_weighted_sum_math_and_logging():
    a, b = Fixed("a", [1.0, 2.0, 3.0]), Fixed("b", [0.5, -1.0, 4.0], differentiable=False)
    out = WeightedSum({"a": a, "b": b}, {"a": 2.0, "b": -0.5})(torch.zeros(3, 1, 8, 8), [""] * 3, [{}] * 3)
    torch.testing.assert_close(out.scores, torch.tensor([2 * 1 - 0.5 * 0.5, 2 * 2 + 0.5 * 1, 2 * 3 - 0.5 * 4]))
    assert set(out.extras) == {"a", "b", "a/double", "b/double"}
    torch.testing.assert_close(out.extras["b"], torch.tensor([0.5, -1.0, 4.0]))
    torch.testing.assert_close(out.extras["a/double"], torch.tensor([2.0, 4.0, 6.0]))
    assert not WeightedSum({"a": a, "b": b}, {"a": 1.0, "b": 1.0}).differentiable
    assert WeightedSum({"a": a}, {"a": 1.0}).differentiable


def test_weighted_sum_propagates_nan():
    a, b = Fixed("a", [1.0, math.nan, 3.0]), Fixed("b", [1.0, 1.0, math.nan])
    out = WeightedSum({"a": a, "b": b}, {"a": 1.0, "b": 1.0})(torch.zeros(3, 1, 8, 8), [""] * 3, [{}] * 3)
    assert out.scores[0].item() == 2.0 and torch.isnan(out.scores[1:]).all()
    # A weight-0 component is logged only, so its NaN does not void the total.
    out = WeightedSum({"a": a, "b": b}, {"a": 0.0, "b": 1.0})(torch.zeros(3, 1, 8, 8), [""] * 3, [{}] * 3)
    assert out.scores[:2].tolist() == [1.0, 1.0] and torch.isnan(out.scores[2])


def test_weighted_sum_rejects_mismatched_weights():
    with pytest.raises(FlowRLError, match="one weight per component"):
        WeightedSum({"a": Fixed("a", [1.0])}, {"b": 1.0})


def test_build_reward_by_name():
    required = {"openai_judge": {"model": "a-judge"}}  # the served model's name has no default
    for name in REWARD_NAMES:
        assert build_reward(name, **required.get(name, {})).name == name
    assert build_reward("jpeg_compressibility", upscale=4).upscale == 4


def test_unknown_reward_name_is_a_flowrl_error():
    with pytest.raises(FlowRLError, match="unknown reward 'clip_magic'; choose one of: digit_classifier, "):
        build_reward("clip_magic")
