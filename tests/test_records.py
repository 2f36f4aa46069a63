"""Trajectory indexing/concatenation, the SDE window schedule, keyed seeding, atomic writes."""

from __future__ import annotations

import pytest
import torch

from flowrl.atomic_files import atomic_path
from flowrl.samplers.rollout import sde_window
from flowrl.seeding import torch_generator
from flowrl.types import Trajectory


def _traj(b: int, offset: int = 0) -> Trajectory:
    k = 3
    return Trajectory(
        latents=torch.arange(b * (k + 1) * 2, dtype=torch.float32).view(b, k + 1, 2) + offset,
        sigmas=torch.linspace(1, 0, k + 1),
        log_probs=torch.randn(b, k),
        stochastic=torch.tensor([True, True, False]),
        cond={"prompt_embeds": torch.randn(b, 4, 5)},
        prompts=[f"p{i + offset}" for i in range(b)],
        metadata=[{"i": i + offset} for i in range(b)],
        group_ids=torch.arange(b) // 2,
        rewards=torch.randn(b),
        reward_components={"a": torch.randn(b)},
        guidance_scale=3.0,
    )


def test_index_then_cat_round_trips():
    t = _traj(6)
    parts = [t[torch.tensor([0, 1, 2])], t[torch.tensor([3, 4, 5])]]
    back = Trajectory.cat(parts)
    for name in ("latents", "log_probs", "group_ids", "rewards"):
        assert torch.equal(getattr(back, name), getattr(t, name))
    assert torch.equal(back.cond["prompt_embeds"], t.cond["prompt_embeds"])
    assert back.prompts == t.prompts and back.metadata == t.metadata and back.guidance_scale == 3.0
    picked = t[torch.tensor([4, 1])]
    assert picked.prompts == ["p4", "p1"] and torch.equal(picked.reward_components["a"], t.reward_components["a"][[4, 1]])
    assert torch.equal(picked.sigmas, t.sigmas) and len(picked) == 2


def test_sde_window_fixed_and_sliding():
    assert sde_window(5, None).tolist() == [True] * 5
    assert sde_window(5, 2, start=1).tolist() == [False, True, True, False, False]
    # Slides one step every 2 iterations and wraps over the 4 possible starts (0..3 for K=5, size=2).
    starts = [int(torch.nonzero(sde_window(5, 2, 0, 2, it))[0]) for it in range(0, 10, 2)]
    assert starts == [0, 1, 2, 3, 0]


def test_keyed_generators_are_reproducible_and_distinct():
    a = torch.randn(4, generator=torch_generator(0, 7, 0, "rollout"))
    assert torch.equal(a, torch.randn(4, generator=torch_generator(0, 7, 0, "rollout")))
    for other in [(1, 7, 0, "rollout"), (0, 8, 0, "rollout"), (0, 7, 1, "rollout"), (0, 7, 0, "update")]:
        assert not torch.equal(a, torch.randn(4, generator=torch_generator(*other)))


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole" and list(tmp_path.iterdir()) == [target]
