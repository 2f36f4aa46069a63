"""DMD2 (flowrl/objectives/dmd2.py) on the real families' tiny random-weight checkpoints (flowrl/pipelines/tiny/):
SD3.5 (the teacher with CFG), the step-distilled FLUX.2-klein and Z-Image-Turbo (no CFG), with the student and the
fake score as two LoRA adapters on one base and the teacher the base with adapters off.

One iteration of each through the real Trainer (four minibatches of one row: the fake score steps on each, the
student on the 2nd and 4th), then: each role's adapter moved and the base did not; the teacher's forward (adapters
off) equals a fresh load of the same checkpoint bit for bit; ``flowrl export CKPT OUT --lora-only`` writes the
student's LoRA alone, which diffusers' ``load_lora_weights`` loads into the family's pipeline built from the tiny
checkpoint, whose own ``__call__`` from the same noise and steps gives flowrl's few-step sample; the model card names
the base, the student's step count and the method. The learning rate is raised to 1e-2 so that the student's LoRA
changes the sample by far more than the comparison's tolerance (at the presets' 1e-5 it would not)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flowrl.objectives.dmd2 import FAKE_SCORE, guided_velocity
from flowrl.pipelines.tiny import tiny_checkpoint
from flowrl.pipelines.tiny.runs import RUNS, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPTS = ["a fox", "a red car"]


@dataclass(frozen=True)
class Family:
    run: str  # the tiny run of flowrl/pipelines/tiny/runs.py whose overrides size the model
    extra: tuple[str, ...]  # what turns it into this DMD2 run
    diffusers_guidance: float  # the student's guidance 1 (none) in the pipeline's convention
    pipeline_class: str


# SD3.5 has no DMD2 preset: its GRPO preset's tiny run turned into Flow-Factory's SD3.5 DMD2 recipe (the student
# unguided, the teacher with CFG 4; X-GenGroup/Flow-Factory, examples/dmd2/lora/sd3_5/ocr.yaml)
SD3_DMD2 = (
    "sampler={name: ode}",
    "objective={name: dmd2, fake_steps_per_student_step: 2, real_guidance_scale: 4.0}",
    "rollout.guidance_scale=1.0",
    "train.batch_size=1",
)
FAMILIES = {
    "sd3": Family("sd3/flow_grpo_pickscore", SD3_DMD2, 1.0, "StableDiffusion3Pipeline"),
    "flux2_klein": Family("flux2/dmd2_klein", (), 1.0, "Flux2KleinPipeline"),  # is_distilled: guidance ignored
    "z_image_turbo": Family("z_image/dmd2_turbo", (), 0.0, "ZImagePipeline"),  # diffusers' 0 = flowrl's 1
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, tmp_path_factory):
    """(family key, trainer after one DMD2 iteration, its base checkpoint, adapters and base weights before)."""
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    family = FAMILIES[request.param]
    run = RUNS[family.run]
    root = tmp_path_factory.mktemp(request.param)
    base = tiny_checkpoint(run.family, root / "base", run.variant)
    overrides = [*tiny_overrides(family.run, base, root / "run"), *family.extra, "train.learning_rate=1e-2", "log.checkpoint_every=1"]
    AcceleratorState._reset_state(True)
    trainer = Trainer(load_config(run.preset, overrides))
    model = trainer.pipeline.denoiser
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    summary = trainer.fit()
    assert summary["status"] == "completed", summary
    return request.param, trainer, base, before


def test_each_role_adapter_trains_and_the_base_does_not(trained):
    key, trainer, _, before = trained
    assert trainer.config.objective.name == "dmd2"
    assert trainer.roles.names() == ["policy", FAKE_SCORE] and [f.name for f in trainer.roles.frozen] == ["teacher"]
    after = dict(trainer.pipeline.denoiser.named_parameters())
    student = [n for n in after if "lora_" in n and ".default." in n]
    fake = [n for n in after if "lora_" in n and f".{FAKE_SCORE}." in n]
    base = [n for n in after if "lora_" not in n]
    assert student and len(student) == len(fake) and base
    moved = {n for n in after if not torch.equal(before[n], after[n].detach())}
    # every tensor of both adapters (the fake score stepped 4 times, the student twice: each lora_A's first gradient
    # comes on its second step), no base tensor: the teacher is the base, unchanged
    assert set(student) <= moved and set(fake) <= moved, (key, sorted(set(student + fake) - moved)[:3])
    assert not moved & set(base), (key, sorted(moved & set(base))[:3])
    assert trainer.objective.minibatches == 4
    print(key, "adapter tensors moved: student", len(student), "fake score", len(fake), "; base tensors", len(base), "unchanged")


def _fresh_base(trainer):
    """The same tiny checkpoint loaded again, without any adapter."""
    from flowrl.pipelines import build_pipeline

    plain = build_pipeline(trainer.config.pipeline.model_copy(update={"lora": None}), "cpu")
    plain.guidance_mode = trainer.pipeline.guidance_mode
    assert not any("lora_" in n for n, _ in plain.denoiser.named_parameters())
    return plain


def test_the_teacher_is_the_base_model_exactly(trained):
    """The DM loss's real score (the base with adapters off, at the run's real_guidance_scale: SD3 with CFG 4) equals
    a fresh load of the checkpoint bit for bit, at a noise level per row; the student's and the fake score's differ."""
    key, trainer, _, _ = trained
    pipeline, plain = trainer.pipeline, _fresh_base(trainer)
    scale = trainer.objective.real_guidance_scale
    g = torch.Generator().manual_seed(5)
    x = pipeline.initial_noise(2, g)
    sigma = torch.tensor([0.9, 0.35])
    with torch.no_grad():
        want = guided_velocity(plain, x, sigma, plain.encode(PROMPTS), scale)
        with pipeline.reference():
            teacher = guided_velocity(pipeline, x, sigma, pipeline.encode(PROMPTS), scale)
        student = guided_velocity(pipeline, x, sigma, pipeline.encode(PROMPTS), scale)
        with pipeline.use_adapter(FAKE_SCORE):
            fake = guided_velocity(pipeline, x, sigma, pipeline.encode(PROMPTS), scale)
    gaps = ((student - want).abs().max().item(), (fake - want).abs().max().item())
    print(key, f"teacher vs fresh base: max |diff| = {(teacher - want).abs().max().item()} (guidance {scale}); student, fake score: {gaps}")
    assert torch.equal(teacher, want)
    assert min(gaps) > 1e-4  # the adapters are trained and back on after the block


def test_the_exported_student_lora_reproduces_the_few_step_sample_in_diffusers(trained, tmp_path):
    """``flowrl export --lora-only``: the student's adapter alone; ``load_lora_weights`` into the family's diffusers
    pipeline from the tiny checkpoint; its ``__call__`` (its own grid, from flowrl's noise, the student's steps)
    equals flowrl's ODE sample of the trained student. The model card names base, steps and method."""
    import diffusers

    from flowrl.cli import main
    from flowrl.config import ODEConfig
    from flowrl.samplers import build_sampler
    from flowrl.samplers.rollout import rollout

    key, trainer, base, _ = trained
    family = FAMILIES[key]
    pipeline, config = trainer.pipeline, trainer.config
    steps = config.rollout.num_inference_steps
    checkpoint = Path(config.output_dir) / "checkpoints" / "step_000001"
    out = tmp_path / "student"
    assert main(["export", str(checkpoint), str(out), "--lora-only"]) == 0
    assert {p.name for p in out.iterdir()} >= {"README.md", "pytorch_lora_weights.safetensors"}
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert len(keys) == len(pipeline.adapter_state_dict("default")) and not any(FAKE_SCORE in k for k in keys)

    noise = pipeline.initial_noise(len(PROMPTS), torch.Generator().manual_seed(7))

    def flowrl_sample(p) -> torch.Tensor:
        with torch.no_grad():
            traj = rollout(
                p,
                build_sampler(ODEConfig(), p),
                PROMPTS,
                [{} for _ in PROMPTS],
                torch.arange(len(PROMPTS)),
                p.schedule.sigmas(steps),
                torch.Generator().manual_seed(0),
                config.rollout.guidance_scale,
                initial_noise=noise,
                decode=False,
            )
        latents = traj.latents[:, -1]
        return p.denormalize(latents) if key == "flux2_klein" else latents  # Flux2KleinPipeline returns VAE latents

    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)

    def diffusers_sample() -> torch.Tensor:
        p = config.pipeline
        call = {"num_inference_steps": steps, "height": p.height, "width": p.width, "max_sequence_length": p.max_sequence_length}
        with torch.no_grad():
            images = pipe(
                prompt=list(PROMPTS), latents=noise.clone(), guidance_scale=family.diffusers_guidance, output_type="latent", **call
            )
        return images.images

    base_theirs = diffusers_sample()
    pipe.load_lora_weights(out)
    assert torch.equal(pipe.scheduler.sigmas, pipeline.schedule.sigmas(steps))  # the same grid, the student's steps
    theirs, ours = diffusers_sample(), flowrl_sample(pipeline)
    base_ours = flowrl_sample(_fresh_base(trainer))
    diff, effect = (theirs - ours).abs().max().item(), (base_theirs - theirs).abs().max().item()
    print(key, f"{steps}-step student: max |diffusers + exported LoRA - flowrl| = {diff:.2e}; the LoRA's effect {effect:.3f}")
    assert diff < 1e-5 and (base_theirs - base_ours).abs().max() < 1e-5
    assert effect > 1e-3  # the student differs from the teacher's own few-step sample: the comparison proves something

    card = (out / "README.md").read_text()
    assert f"`{base}` (a local model directory)" in card  # the base
    assert f"a {steps}-step student distilled from `{base}` (a local model directory) by distribution matching distillation (DMD2)" in card
    assert "objective `dmd2`" in card and f"`num_inference_steps={steps}`" in card and "- distillation" in card


def test_a_step_distilled_teacher_refuses_cfg(tmp_path):
    """FLUX.2-klein (is_distilled) runs without guidance: a teacher CFG scale is refused in one sentence at start-up,
    before the DM loss's teacher call would refuse it mid-run."""
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.errors import FlowRLError
    from flowrl.trainer import Trainer

    base = tiny_checkpoint("flux2", tmp_path / "base", "klein")
    overrides = [*tiny_overrides("flux2/dmd2_klein", base, tmp_path / "run"), "objective.real_guidance_scale=4.0"]
    AcceleratorState._reset_state(True)
    with pytest.raises(FlowRLError, match=r"step-distilled .* set objective\.real_guidance_scale to 1 \(got 4\.0\)\.$"):
        Trainer(load_config("flux2/dmd2_klein", overrides))


def test_the_teachers_guidance_is_the_familys_own_on_qwen_image(tmp_path):
    """Qwen-Image guides with a norm rescale (each token's guided velocity scaled to its conditional's norm,
    verl-omni's ``layer_norm``): the DM loss's real score at a noise level per row is the family's own guided
    velocity, row by row, and not the plain ``u + s (c - u)`` (which differs from it by a measurable amount)."""
    from flowrl.config import load_config
    from flowrl.pipelines import build_pipeline

    base = tiny_checkpoint("qwen_image", tmp_path / "base")
    run = next(r for r in RUNS.values() if r.family == "qwen_image")
    config = load_config(run.preset, tiny_overrides(run.preset, base, tmp_path / "run"))
    pipeline = build_pipeline(config.pipeline, "cpu")
    cond = pipeline.encode(PROMPTS)
    x = torch.randn(2, *pipeline.latent_shape(), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        got = guided_velocity(pipeline, x, sigma, cond, 4.0)
        rows = [pipeline.predict(x[i : i + 1], sigma[i], {k: v[i : i + 1] for k, v in cond.items()}, 4.0) for i in range(2)]
        c = pipeline.predict(x, sigma, cond, 1.0)
        u = pipeline.predict(x, sigma, pipeline.unconditional(2, cond), 1.0)
    torch.testing.assert_close(got, torch.cat(rows), rtol=0, atol=1e-5)
    assert (got - (u + 4.0 * (c - u))).abs().max() > 1e-3  # the rescale is there to be dropped
