"""Wan2.2 through flowrl: the two-expert checkpoints (T2V-A14B / I2V-A14B: ``transformer`` for high noise,
``transformer_2`` for low noise, switched at ``boundary_ratio``) and TI2V-5B (``expand_timesteps``, the 48-channel
VAE with 16x spatial compression, first-frame conditioning). The real diffusers classes at tiny size, saved with
``save_pretrained``, loaded through ``pipeline.pretrained=<dir>`` and compared with WanPipeline /
WanImageToVideoPipeline's own ``__call__``; training on the ``motion_quality`` reward with 3 steps, of which the
first (t = 1000) is the high-noise expert's and the other two (t = 751, 9) the low-noise one's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flowrl.pipelines.tiny.video import BOUNDARY, build_tiny_ti2v, build_tiny_wan22, tiny_wan22_vae  # noqa: F401
from tests.conftest import CONFIGS
from tests.family_tester import plain_adapter, tiny_checkpoint
from tests.test_family_video import (  # noqa: F401 (prompt_files: a fixture)
    PROMPTS,
    SIZE,
    VideoTester,
    prompt_files,
    tiny_wan_transformer,
    video_config,
)
from tests.tiny_components import (
    ode_sample,
    rescoring_ratio_is_one,
    two_iterations_change_every_parameter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

wan22_dir = tiny_checkpoint(build_tiny_wan22)
wan22_i2v_dir = tiny_checkpoint(build_tiny_wan22, i2v=True)
ti2v_dir = tiny_checkpoint(build_tiny_ti2v)


TI2V_SIZE = {"pipeline.height": 64, "pipeline.width": 64, "pipeline.num_frames": 5}  # latents (48, 2, 4, 4)


def load(name, directory, **overrides):
    from flowrl.pipelines import FAMILIES, build_pipeline

    size = {k.split(".", 1)[1]: v for k, v in SIZE.items()}
    return build_pipeline(FAMILIES.section(name)(pretrained=str(directory), device="cpu", **{**size, **overrides}), "cpu")


def experts_of(pipe, boundary_timestep: float = BOUNDARY * 1000):
    from flowrl.pipelines.wan import WanExperts

    return WanExperts(pipe.transformer, pipe.transformer_2, boundary_timestep)


def rollout_ode(pipe, prompts, metadata, noise, steps, scale):
    from flowrl.samplers import FlowSDEConfig
    from flowrl.samplers.rollout import rollout

    return rollout(
        pipe,
        FlowSDEConfig(noise_level=0.0).build(),
        prompts,
        metadata,
        torch.arange(len(prompts)),
        pipe.schedule.sigmas(steps),
        torch.Generator().manual_seed(1),
        scale,
        initial_noise=noise,
    )


def record_experts(model) -> list[str]:
    """Which expert of ``model`` (a WanExperts or a diffusers pipeline) runs each call, in order."""
    calls: list[str] = []
    for name in ("transformer", "transformer_2"):
        getattr(model, name).register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    return calls


# -- two experts: exactness against diffusers ------------------------------------------------------------


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v_a14b", "i2v_a14b"])
def test_two_expert_ode_equals_the_diffusers_pipeline(request, prompt_files, i2v):  # noqa: F811
    """flowrl's Euler ODE with CFG 4.0 on the high-noise expert and guidance_scale_2 = 2.0 on the low-noise one =
    WanPipeline / WanImageToVideoPipeline (default arguments: its own grid) from the same latents: the same expert
    at every step (recorded by hooks on both sides) and the same final latents."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    directory = request.getfixturevalue("wan22_i2v_dir" if i2v else "wan22_dir")
    pipe, steps = load("wan_i2v" if i2v else "wan", directory, guidance_scale_2=2.0), 4
    assert pipe.two_experts and pipe.boundary_timestep == 875.0 and pipe.trained_experts == ("transformer", "transformer_2")
    ours_calls = record_experts(pipe.denoiser)
    noise = torch.randn(2, *pipe.latent_shape(), generator=torch.Generator().manual_seed(0))
    image = str(prompt_files / "frame0.png")
    metadata = [{"image": image}] * 2 if i2v else [{}, {}]
    traj = rollout_ode(pipe, PROMPTS, metadata, noise, steps, 4.0)

    reference = (WanImageToVideoPipeline if i2v else WanPipeline).from_pretrained(directory)
    theirs_calls = record_experts(reference)
    # WanPipeline's text encoding (diffusers 0.42.1's I2V prompt_clean needs ftfy, which is not installed here)
    embeds = WanPipeline._get_t5_prompt_embeds(reference, PROMPTS, max_sequence_length=16, device="cpu")
    empty = WanPipeline._get_t5_prompt_embeds(reference, ["", ""], max_sequence_length=16, device="cpu")
    extra = {"image": Image.open(image).convert("RGB")} if i2v else {}
    theirs = reference(
        prompt_embeds=embeds,
        negative_prompt_embeds=empty,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=steps,
        guidance_scale=4.0,
        guidance_scale_2=2.0,
        latents=noise.clone(),
        max_sequence_length=16,
        output_type="latent",
        **extra,
    ).frames
    assert torch.equal(reference.scheduler.sigmas, pipe.schedule.sigmas(steps))
    # t = 1000 | 858, 602, 9; diffusers calls the expert twice per step (conditional, unconditional), flowrl once (batched)
    assert ours_calls == theirs_calls[::2] == theirs_calls[1::2] == ["transformer"] + ["transformer_2"] * 3
    diff = float((traj.latents[:, -1] - theirs).abs().max())
    print(f"two-expert oracle ({'i2v' if i2v else 't2v'}) max |diff| {diff:.2e}")
    assert diff < 1e-5, f"flowrl's two-expert ODE differs from diffusers by {diff}"
    # guidance_scale_2 matters: the same run with the low-noise expert at 4.0 ends elsewhere
    same = rollout_ode(load("wan_i2v" if i2v else "wan", directory), PROMPTS, metadata, noise, steps, 4.0)
    assert (same.latents[:, -1] - traj.latents[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("flow_shift, boundary", [(12.0, 0.875), (5.0, 0.9), (3.0, 0.5)], ids=["t2v_a14b", "i2v_a14b", "other"])
def test_expert_switch_is_the_pipelines_for_k_1_to_50(wan22_dir, tmp_path, flow_shift, boundary):
    """With the hub's UniPC scheduler (int64 timesteps; T2V-A14B: flow_shift 12, boundary 0.875; I2V-A14B: 5,
    0.9) flowrl gives each of K = 1..50 steps to the expert WanPipeline gives it (``t >= boundary_ratio * 1000``
    on the scheduler's own timesteps), and its grid is the pipeline's."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from flowrl.pipelines.wan import high_noise_rows

    directory = tmp_path / "unipc"
    shutil.copytree(wan22_dir, directory)
    shutil.rmtree(directory / "scheduler")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift).save_pretrained(
        directory / "scheduler"
    )
    index = json.loads((directory / "model_index.json").read_text())
    index.update(scheduler=["diffusers", "UniPCMultistepScheduler"], boundary_ratio=boundary)
    (directory / "model_index.json").write_text(json.dumps(index))
    pipe, reference = load("wan", directory), WanPipeline.from_pretrained(directory)
    assert pipe.integer_timesteps and pipe.boundary_timestep == boundary * 1000
    switches = set()
    for steps in range(1, 51):
        reference.scheduler.set_timesteps(steps)
        theirs = [
            bool(t >= reference.config.boundary_ratio * reference.scheduler.config.num_train_timesteps)
            for t in reference.scheduler.timesteps
        ]
        sigmas = pipe.schedule.sigmas(steps)
        assert torch.equal(sigmas[1:], reference.scheduler.sigmas[1:]), steps  # UniPC starts at 1 - 1e-6, flowrl at 1
        ours = high_noise_rows(pipe.timestep(sigmas[:-1]), pipe.boundary_timestep, pipe.integer_timesteps).tolist()
        assert ours == theirs, steps
        switches.add(sum(ours))
    assert len(switches) > 10  # the boundary falls in many different places across K


def test_experts_route_mixed_rows_exactly(wan22_dir):
    """A batch of per-sample timesteps on both sides of the boundary (DiffusionNFT's, Adjoint Matching's training
    draws) gives each row exactly its own expert's output, in the caller's row order; a batch at one noise level
    runs one expert only."""
    pipe = load("wan", wan22_dir)
    model = pipe.denoiser
    x, text = torch.randn(3, *pipe.latent_shape()), torch.randn(3, 16, 32)
    t = torch.tensor([200.0, 990.0, 875.0])  # low, high, high (t >= 875 is the high-noise expert's, as in diffusers)
    with torch.no_grad():
        mixed = model(hidden_states=x, timestep=t, encoder_hidden_states=text)[0]
        for i, expert in enumerate([model.transformer_2, model.transformer, model.transformer]):
            alone = expert(hidden_states=x[i : i + 1], timestep=t[i : i + 1], encoder_hidden_states=text[i : i + 1], return_dict=False)[0]
            torch.testing.assert_close(mixed[i : i + 1], alone, atol=1e-6, rtol=0)
    calls = record_experts(model)
    with torch.no_grad():
        model(hidden_states=x, timestep=torch.full((3,), 874.9), encoder_hidden_states=text)
    assert calls == ["transformer_2"]


# -- two experts: training --------------------------------------------------------------------------------


def wan22_config(directory, run_dir, prompts, **extra):
    return video_config("wan", directory, run_dir, prompts, **{"rollout.guidance_scale": 3.0, "pipeline.guidance_scale_2": 2.0, **extra})


@pytest.mark.slow
def test_two_grpo_iterations_train_both_experts_and_load_back_in_diffusers(wan22_dir, prompt_files, tmp_path):  # noqa: F811
    """LoRA on both experts: every LoRA tensor of both moves; re-scoring gives ratio 1; each step's log-prob is the
    expert's that ran it (a change to one expert's LoRA moves only its own steps' log-probs, bit for bit); the
    checkpoint's two diffusers LoRA files, loaded with WanPipeline.load_lora_weights (the second with
    load_into_transformer_2=True), reproduce flowrl's samples; the merged export loads with from_pretrained."""
    import argparse

    from diffusers import WanPipeline

    from flowrl.cli import _export
    from flowrl.pipelines.wan import LORA_FILES

    trainer = two_iterations_change_every_parameter(wan22_config(wan22_dir, tmp_path / "run", prompt_files))
    names = [n for n, p in trainer.module.named_parameters() if p.requires_grad]
    assert any(n.startswith("transformer.") for n in names) and any(n.startswith("transformer_2.") for n in names)
    assert all("lora" in n for n in names)
    rescoring_ratio_is_one(trainer)

    # log-probs through the expert that ran each step: step 0 is the high-noise expert's, steps 1-2 the low-noise one's
    traj = trainer.collect(0)
    assert traj.stochastic.tolist() == [True, True, True]
    pipe, sampler = trainer.pipeline, trainer.sampler

    def log_probs():
        with torch.no_grad():
            return torch.stack(
                [
                    sampler.step(
                        pipe.predict(traj.latents[:, k], traj.sigmas[k], traj.cond, traj.guidance_scale),
                        traj.latents[:, k],
                        traj.sigmas[k],
                        traj.sigmas[k + 1],
                        x_next=traj.latents[:, k + 1],
                    ).log_prob
                    for k in range(3)
                ],
                dim=1,
            )

    before = log_probs()
    for name, steps_moved in (("transformer_2", [1, 2]), ("transformer", [0])):
        lora = [p for n, p in trainer.module.named_parameters() if n.startswith(f"{name}.") and "lora_B" in n]
        kept = [p.detach().clone() for p in lora]
        with torch.no_grad():
            for p in lora:
                p.add_(0.05)
        after = log_probs()
        with torch.no_grad():
            for p, q in zip(lora, kept):
                p.copy_(q)
        moved = [k for k in range(3) if not torch.equal(after[:, k], before[:, k])]
        assert moved == steps_moved, (name, moved)

    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert all((checkpoint / f).is_file() for f in LORA_FILES.values())
    ours = ode_sample(pipe, PROMPTS, seed=3, guidance_scale=3.0)
    user = WanPipeline.from_pretrained(wan22_dir)  # the user's path: nothing of flowrl
    user.load_lora_weights(checkpoint)
    user.load_lora_weights(checkpoint, weight_name=LORA_FILES["transformer_2"], load_into_transformer_2=True)
    torch.testing.assert_close(
        ode_sample(plain_adapter(trainer, experts_of(user)), PROMPTS, seed=3, guidance_scale=3.0), ours, atol=1e-5, rtol=0
    )
    base = ode_sample(plain_adapter(trainer, experts_of(WanPipeline.from_pretrained(wan22_dir))), PROMPTS, seed=3, guidance_scale=3.0)
    assert (base - ours).abs().max() > 1e-4, "the LoRAs did not change the samples, so the round trip proves nothing"
    # each expert's LoRA matters on its own: the high-noise one alone gives neither the base nor the trained samples
    half = WanPipeline.from_pretrained(wan22_dir)
    half.load_lora_weights(checkpoint)
    alone = ode_sample(plain_adapter(trainer, experts_of(half)), PROMPTS, seed=3, guidance_scale=3.0)
    assert (alone - ours).abs().max() > 1e-4 and (alone - base).abs().max() > 1e-4

    # `flowrl export`: both experts merged, written as transformer/ and transformer_2/ of a standalone pipeline
    out = tmp_path / "export"
    _export(argparse.Namespace(checkpoint=str(checkpoint), out=out, lora_only=False, push_to_hub=None, license=None, private=False))
    exported = WanPipeline.from_pretrained(out)
    assert not any("lora" in n for n, _ in exported.transformer_2.named_parameters())
    torch.testing.assert_close(
        ode_sample(plain_adapter(trainer, experts_of(exported)), PROMPTS, seed=3, guidance_scale=3.0), ours, atol=1e-4, rtol=0
    )


@pytest.mark.slow
def test_an_expert_without_a_trained_step_stays_bit_for_bit(wan22_dir, prompt_files, tmp_path):  # noqa: F811
    """Both experts carry a LoRA, but only step 0 (the high-noise expert's) is stochastic: the low-noise expert's
    LoRA gets no gradient (None, not zeros), so AdamW, weight decay 0.1 included, leaves it exactly as it was and
    keeps no state for it."""
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)
    config = wan22_config(
        wan22_dir, tmp_path / "run", prompt_files, **{"rollout.sde_window_size": 1, "train.weight_decay": 0.1, "log.checkpoint_every": 0}
    )
    trainer = Trainer(load_config(None, config))
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if p.requires_grad}
    trainer.fit()
    after = dict(trainer.module.named_parameters())
    low = [n for n in before if n.startswith("transformer_2.")]
    high = [n for n in before if n.startswith("transformer.")]
    assert low and high
    assert all(torch.equal(before[n], after[n]) for n in low), "the low-noise expert moved without a single step of its own"
    assert all(not torch.equal(before[n], after[n]) for n in high)
    assert all(after[n].grad is None for n in low)
    assert not any(after[n] in trainer.optimizer.optimizer.state for n in low)


@pytest.mark.slow
def test_training_one_expert_leaves_the_other_untouched(wan22_dir, prompt_files, tmp_path):  # noqa: F811
    """train_experts: [low] with LoRA: only the low-noise expert gets an adapter (and one diffusers file); full
    fine-tuning of [low] with a KL reference: only transformer_2's weights train and are checkpointed, the
    high-noise expert is bit-for-bit the checkpoint's."""
    from safetensors.torch import load_file

    from flowrl.pipelines.wan import LORA_FILES

    trainer = two_iterations_change_every_parameter(
        wan22_config(wan22_dir, tmp_path / "lora", prompt_files, **{"pipeline.train_experts": "[low]"})
    )
    names = [n for n, p in trainer.module.named_parameters() if p.requires_grad]
    assert names and all(n.startswith("transformer_2.") and "lora" in n for n in names)
    assert not any("lora" in n for n, _ in trainer.module.transformer.named_parameters())
    checkpoint = tmp_path / "lora" / "checkpoints" / "step_000002"
    assert (checkpoint / LORA_FILES["transformer_2"]).is_file() and not (checkpoint / LORA_FILES["transformer"]).exists()

    full = wan22_config(
        wan22_dir,
        tmp_path / "full",
        prompt_files,
        **{"pipeline.train_experts": "[low]", "pipeline.lora": "null", "objective.beta": 0.01, "train.learning_rate": 1e-4},
    )
    trainer = two_iterations_change_every_parameter(full)
    from diffusers import WanTransformer3DModel

    base = WanTransformer3DModel.from_pretrained(wan22_dir, subfolder="transformer")
    for (n, p), (_, q) in zip(trainer.module.transformer.named_parameters(), base.named_parameters()):
        assert not p.requires_grad and torch.equal(p, q), n
    stored = load_file(tmp_path / "full" / "checkpoints" / "step_000002" / "denoiser.safetensors")
    assert stored and all(k.startswith("transformer_2.") for k in stored)
    assert trainer.pipeline._reference is not None  # the KL reference (a frozen copy) ran through the same routing


def test_bf16_experts_with_gradient_checkpointing_backpropagate(wan22_dir):
    """bf16 experts, fp32 LoRA on both, gradient checkpointing, CFG with two scales, a per-sample sigma on both
    sides of the boundary: finite gradients, and on both experts; the reference (adapters off) differs."""
    from flowrl.config import LoraConfig

    pipe = load("wan", wan22_dir, dtype="bfloat16", lora=LoraConfig(r=4, alpha=8), gradient_checkpointing=True, guidance_scale_2=2.0)
    assert pipe.denoiser.is_gradient_checkpointing and pipe.model_dtype == torch.bfloat16
    pipe.denoiser.train()
    x = torch.randn(2, *pipe.latent_shape())
    cond = pipe.encode(PROMPTS)
    out = pipe.predict(x, torch.tensor([0.95, 0.3]), cond, guidance_scale=4.0)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    out.square().mean().backward()
    for name in ("transformer", "transformer_2"):
        grads = [p.grad for n, p in pipe.denoiser.named_parameters() if n.startswith(f"{name}.") and p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)
    with torch.no_grad():  # a trained-looking adapter (LoRA B starts at 0, so a fresh adapter changes nothing)
        for p in pipe.trainable_parameters():
            p.add_(0.05)
        moved = pipe.predict(x, torch.tensor([0.95, 0.3]), cond, guidance_scale=4.0)
        with pipe.reference():  # the base model: both experts' adapters off
            ref = pipe.predict(x, torch.tensor([0.95, 0.3]), cond, guidance_scale=4.0)
    assert torch.equal(ref, out.detach()) and (moved - ref)[0].abs().max() > 1e-3 and (moved - ref)[1].abs().max() > 1e-3


def test_two_expert_configs_fail_with_one_sentence(wan22_dir, tmp_path):
    from flowrl.errors import FlowRLError
    from tests.test_family_video import build_tiny_wan

    single = build_tiny_wan(tmp_path / "wan21")
    with pytest.raises(FlowRLError, match="pipeline.train_experts applies to Wan2.2's two-expert"):
        load("wan", single, train_experts=["low"])
    with pytest.raises(FlowRLError, match="pipeline.guidance_scale_2 applies"):
        load("wan", single, guidance_scale_2=3.0)
    assert not load("wan", single, train_experts=["high"]).two_experts
    broken = build_tiny_wan22(tmp_path / "no_transformer_2", transformer_2=False)
    with pytest.raises(FlowRLError, match="has no transformer_2"):
        load("wan", broken)
    ignored = build_tiny_wan22(tmp_path / "no_boundary", boundary_ratio=None)  # WanPipeline never runs transformer_2 then
    assert not load("wan", ignored).two_experts


# -- TI2V-5B -----------------------------------------------------------------------------------------------


def test_ti2v_text_and_image_to_video_equal_the_diffusers_pipelines(ti2v_dir, prompt_files):  # noqa: F811
    """TI2V-5B's 48-channel latents at 16x compression: text-to-video = WanPipeline, image-to-video =
    WanImageToVideoPipeline (expand_timesteps: the image's latents as the first latent frame, its tokens at
    timestep 0), from the same latents with CFG 5.0; the final latents (the pipeline pastes the image latents into
    the first frame, flowrl's trajectory lands on them) and the decoded videos agree. A batch mixing one prompt
    with an image and one without gives each row its own result."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    size = {k.split(".", 1)[1]: v for k, v in TI2V_SIZE.items()}
    pipe, steps, scale = load("wan", ti2v_dir, **size), 3, 5.0
    assert pipe.expand_timesteps and pipe.needs_metadata and pipe.latent_shape() == (48, 2, 4, 4)
    image = str(prompt_files / "frame0.png")
    noise = torch.randn(2, *pipe.latent_shape(), generator=torch.Generator().manual_seed(0))
    t2v = rollout_ode(pipe, PROMPTS, [{}, {}], noise, steps, scale)
    i2v = rollout_ode(pipe, PROMPTS, [{"image": image}] * 2, noise, steps, scale)
    mixed = rollout_ode(pipe, PROMPTS, [{"image": image}, {}], noise, steps, scale)
    assert (t2v.latents[:, -1] - i2v.latents[:, -1]).abs().max() > 1e-2  # the image conditions the video

    common = dict(height=64, width=64, num_frames=5, num_inference_steps=steps, guidance_scale=scale, max_sequence_length=16)
    reference = WanPipeline.from_pretrained(ti2v_dir)
    embeds = WanPipeline._get_t5_prompt_embeds(reference, PROMPTS, max_sequence_length=16, device="cpu")
    empty = WanPipeline._get_t5_prompt_embeds(reference, ["", ""], max_sequence_length=16, device="cpu")
    texts = dict(prompt_embeds=embeds, negative_prompt_embeds=empty)
    theirs_t2v = reference(**texts, **common, latents=noise.clone(), output_type="latent").frames
    i2v_reference = WanImageToVideoPipeline.from_pretrained(ti2v_dir)
    assert i2v_reference.config.expand_timesteps
    pil = Image.open(image).convert("RGB")
    theirs_i2v = i2v_reference(image=pil, **texts, **common, latents=noise.clone(), output_type="latent").frames
    for ours, theirs, what in ((t2v, theirs_t2v, "t2v"), (i2v, theirs_i2v, "i2v")):
        diff = float((ours.latents[:, -1] - theirs).abs().max())
        print(f"TI2V {what} oracle max |diff| {diff:.2e}")
        assert diff < 1e-5, (what, diff)
    assert torch.allclose(mixed.latents[0, -1], i2v.latents[0, -1], atol=1e-5) and torch.allclose(
        mixed.latents[1, -1], t2v.latents[1, -1], atol=1e-5
    )
    # the given frame: its tokens at timestep 0 and its latents the image's, in every model input
    cond = pipe.encode(PROMPTS, [{"image": image}, {}])
    t = pipe._timesteps(torch.tensor(0.5), noise, cond)
    assert t.shape == (2, 8) and (t[0, :4] == 0).all() and (t[0, 4:] == 500).all() and (t[1] == 500).all()
    torch.testing.assert_close(i2v.latents[:, -1, :, :1], cond["first_frame"][:1].expand(2, -1, -1, -1, -1), atol=1e-5, rtol=0)
    # decoding (the 48-channel VAE, 2x2 patchified pixels) = the pipelines' output_type="pt" frames
    frames = i2v_reference(image=pil, **texts, **common, latents=noise.clone(), output_type="pt").frames
    torch.testing.assert_close(i2v.samples, frames.permute(0, 2, 1, 3, 4), atol=5e-5, rtol=0)


class TestWan22(VideoTester):
    """Wan2.2 T2V-A14B's two experts (LoRA on both, CFG 3 on the high-noise one, 2 on the low-noise one):
    DiffusionNFT draws a timestep per sample, so a training batch straddles the boundary and both experts' LoRAs
    move. The rest of the two experts' checks are this module's own."""

    name, checkpoint, pipeline_class = "wan", "wan22_dir", "WanPipeline"
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None
    test_two_adjoint_matching_iterations = None
    test_lora_round_trip_through_diffusers_load_lora_weights = None

    def config(self, **extra):
        return wan22_config(self.directory, self.run_dir, self.fixture("prompt_files"), **extra)


class TestTI2V(VideoTester):
    """Wan2.2 TI2V-5B's image-to-video training (`wan_i2v`, images from the .jsonl prompts): the pinned first frame's
    transition does not depend on the weights, and the LoRA loads into WanImageToVideoPipeline."""

    name, checkpoint, pipeline_class, suffix = "wan_i2v", "ti2v_dir", "WanImageToVideoPipeline", "jsonl"
    run_settings, load_options = TI2V_SIZE, {k.split(".", 1)[1]: v for k, v in TI2V_SIZE.items()}
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None
    test_two_adjoint_matching_iterations = None
    test_two_diffusion_nft_iterations = None

    def check_lora_run(self, trainer):
        traj = trainer.collect(0)
        assert traj.samples.shape == (4, 3, 5, 64, 64) and set(traj.cond) == {"prompt_embeds", "first_frame", "first_frame_given"}
        with torch.no_grad():
            out = trainer.pipeline.predict(traj.latents[:, 1], traj.sigmas[1], traj.cond, 3.0)
            x0_first = traj.latents[:, 1, :, :1] - traj.sigmas[1] * out[:, :, :1]
        torch.testing.assert_close(x0_first, traj.cond["first_frame"], atol=1e-5, rtol=0)


def test_ti2v_needs_an_image_only_for_wan_i2v(ti2v_dir):
    from flowrl.errors import FlowRLError

    size = {k.split(".", 1)[1]: v for k, v in TI2V_SIZE.items()}
    text_only = load("wan", ti2v_dir, **size).encode(PROMPTS)  # plain text-to-video: no image, flag 0
    assert (text_only["first_frame_given"] == 0).all() and (text_only["first_frame"] == 0).all()
    with pytest.raises(FlowRLError, match="conditioning image"):
        load("wan_i2v", ti2v_dir, **size).encode(PROMPTS, [{}, {}])


# -- presets -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["wan22_t2v_a14b_grpo.yaml", "wan22_ti2v_5b_grpo.yaml"])
def test_wan22_presets_validate(preset):
    from flowrl.config import load_config
    from flowrl.prompts import prompt_pool

    config = load_config(CONFIGS / "wan" / preset, [])
    p = config.pipeline
    assert p.name in ("wan", "wan_i2v") and p.pretrained.startswith("Wan-AI/Wan2.2-")
    assert p.dtype == "bfloat16" and config.train.mixed_precision == "bf16" and p.lora is not None and p.gradient_checkpointing
    assert (p.num_frames - 1) % 4 == 0 and p.height % 32 == 0 and p.width % 32 == 0
    assert config.sampler.name == "flow_sde"
    if "a14b" in preset:
        assert p.train_experts == ["high", "low"] and p.guidance_scale_2 == 3.0 and config.rollout.guidance_scale == 4.0
    assert prompt_pool(config.prompts.dataset, "train", file=config.prompts.train_file)
