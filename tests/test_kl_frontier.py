"""bench/kl_frontier.py's KL to the base model (path_kl) against a closed form on the real digits model."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "kl_frontier.py"


def _bench():
    spec = importlib.util.spec_from_file_location("kl_frontier", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from flowrl.trainer import Trainer

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    bench = _bench()
    tiny = {"rollout.num_inference_steps": 3, "train.prompts_per_iteration": 2, "train.num_generations": 4, "eval.samples_per_prompt": 1}
    config = bench.method_config("grpo_clip", 1, 0, str(tmp_path_factory.mktemp("frontier") / "run"), tiny)
    yield bench, Trainer(config)
    torch.set_num_threads(previous)


def test_path_kl_is_zero_at_the_base_and_matches_a_constant_velocity_shift(trainer):
    bench, trainer = trainer
    params = list(trainer.pipeline.trainable_parameters())
    base = [p.detach().clone() for p in params]
    assert bench.path_kl(trainer, base) == 0.0  # the same weights: every step's two means are the same bits
    # Add delta to the UNet's last bias: the velocity of every pixel moves by delta whatever the input, so each
    # Flow-SDE step's mean x + dt (v + g^2 (x + (1 - s) v) / (2 s)) moves by delta dt c, c = 1 + g^2 (1 - s) / (2 s),
    # the same on every trajectory. With the shared std g sqrt(|dt|), a step's KL is D (delta dt c)^2 / (2 g^2 |dt|)
    # = D delta^2 |dt| c^2 / (2 g^2) over the D pixels. Grid 1, 2/3, 1/3, 0 (|dt| = 1/3), a = 0.7,
    # g = a sqrt(s / (1 - s)) (at s = 1: 1 - s_next): g^2 = 1.47, 0.98, 0.245; c = 1, 1.245, 1.245.
    delta = 0.01
    with torch.no_grad():
        trainer.pipeline.denoiser.conv_out.bias += delta
    try:
        kl = bench.path_kl(trainer, base)
    finally:
        with torch.no_grad():
            for p, b in zip(params, base):
                p.copy_(b)
    dims = math.prod(trainer.pipeline.latent_shape())  # 1 x 8 x 8
    per_dim = sum(delta**2 / 3 * c**2 / (2 * g2) for g2, c in [(1.47, 1.0), (0.98, 1.245), (0.245, 1.245)])
    assert kl == pytest.approx(dims * per_dim, rel=2e-3)
