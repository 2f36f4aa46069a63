"""DMDR (flowrl/objectives/dmdr.py) on the real families' tiny random-weight checkpoints (flowrl/pipelines/tiny/): SD3.5
(the teacher with CFG 4), the step-distilled FLUX.2-klein and Z-Image-Turbo, with the student and the fake score as
two LoRA adapters on one base and the teacher a separate frozen load (``objective.teacher``: here the same checkpoint
directory, so that its forward can be compared with a fresh load bit for bit).

One iteration of each through the real Trainer (DMD2's tiny runs of test_dmd2_families.py with ``objective.name=dmdr``
and the tiny runs' differentiable reward ``ink``, whose gradient reaches the student through the family's VAE
decoder), then: both adapters moved, neither the base nor the teacher did; the logged ReFL and DM losses are finite
and the ReFL loss is not zero; the teacher's forward through ``use_denoiser`` equals a fresh load's, with CFG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.objectives.dmd2 import FAKE_SCORE, guided_velocity
from flowrl.pipelines.tiny import tiny_checkpoint
from flowrl.pipelines.tiny.runs import RUNS, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

DMDR = ("objective.name=dmdr", "objective.reward_weight=1.0", "objective.fake_warmup_steps=0")
SD3 = ("sampler={name: ode}", "objective={name: dmdr, fake_steps_per_student_step: 2, real_guidance_scale: 4.0}")
FAMILIES = {  # key -> (tiny run, what turns it into this DMDR run)
    "sd3": ("sd3/flow_grpo_pickscore", (*SD3, "rollout.guidance_scale=1.0", "train.batch_size=1")),
    "flux2_klein": ("flux2/dmd2_klein", ()),
    "z_image_turbo": ("z_image/dmd2_turbo", ()),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, tmp_path_factory):
    """(family key, trainer after one DMDR iteration, its checkpoint, the denoiser's and the teacher's weights before)."""
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    name, extra = FAMILIES[request.param]
    run = RUNS[name]
    root = tmp_path_factory.mktemp(request.param)
    base = tiny_checkpoint(run.family, root / "base", run.variant)
    overrides = [*tiny_overrides(name, base, root / "run"), *extra, *DMDR, f"objective.teacher={base}", "train.learning_rate=1e-2"]
    AcceleratorState._reset_state(True)
    trainer = Trainer(load_config(run.preset, overrides))
    before = {n: p.detach().clone() for n, p in trainer.pipeline.denoiser.named_parameters()}
    teacher = {n: p.detach().clone() for n, p in trainer.objective.teacher_model.named_parameters()}
    summary = trainer.fit()
    assert summary["status"] == "completed", summary
    return request.param, trainer, base, before, teacher


def test_both_adapters_train_and_neither_the_base_nor_the_teacher_does(trained):
    key, trainer, _, before, teacher = trained
    assert trainer.config.objective.name == "dmdr"
    assert trainer.roles.names() == ["policy", FAKE_SCORE] and [f.name for f in trainer.roles.frozen] == ["teacher"]
    after = dict(trainer.pipeline.denoiser.named_parameters())
    student = [n for n in after if "lora_" in n and ".default." in n]
    fake = [n for n in after if "lora_" in n and f".{FAKE_SCORE}." in n]
    moved = {n for n in after if not torch.equal(before[n], after[n].detach())}
    assert student and fake and set(fake) <= moved and set(student) & moved, key
    assert not any("lora_" not in n for n in moved), key  # the student's base is unchanged
    now = dict(trainer.objective.teacher_model.named_parameters())
    assert all(torch.equal(v, now[n]) for n, v in teacher.items())
    rows = [json.loads(line) for line in (Path(trainer.config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "loss/refl" in r]
    assert all(torch.isfinite(torch.tensor(row[k])) for k in ("loss/refl", "loss/dm", "loss/fake_score"))
    assert row["loss/refl"] != 0.0  # the reward's gradient reached the student's loss through the decoder
    print(key, "student tensors moved", len(set(student) & moved), "of", len(student), "; refl", row["loss/refl"], "dm", row["loss/dm"])


def test_the_separate_teacher_is_a_fresh_load_exactly(trained):
    key, trainer, _, _, _ = trained
    from flowrl.pipelines import build_pipeline

    pipeline = trainer.pipeline
    plain = build_pipeline(trainer.config.pipeline.model_copy(update={"lora": None}), "cpu")
    plain.guidance_mode = pipeline.guidance_mode
    scale = trainer.objective.real_guidance_scale
    x, sigma = pipeline.initial_noise(2, torch.Generator().manual_seed(5)), torch.tensor([0.9, 0.35])
    prompts = ["a fox", "a red car"]
    with torch.no_grad():
        want = guided_velocity(plain, x, sigma, plain.encode(prompts), scale)
        with trainer.objective.teacher(pipeline):
            got = guided_velocity(pipeline, x, sigma, pipeline.encode(prompts), scale)
        student = guided_velocity(pipeline, x, sigma, pipeline.encode(prompts), scale)
    assert torch.equal(got, want), key
    assert (student - want).abs().max() > 1e-4  # the student's trained adapter is back on after the block
