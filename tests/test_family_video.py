"""Wan2.1 T2V, Wan2.1 I2V and CogVideoX through flowrl: the real diffusers pipeline classes at tiny size,
saved with ``save_pretrained`` and loaded through ``pipeline.pretrained=<dir>``; rewards from the video
motion reward (``motion_quality``, OpenCV optical flow) on 5-frame 32x32 clips."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flowrl.pipelines.tiny.video import build_tiny_cogvideox, build_tiny_wan, build_tiny_wan_i2v, tiny_wan_transformer  # noqa: F401
from tests.conftest import CONFIGS
from tests.family_tester import FamilyTesterMixin, Grid, tiny_checkpoint
from tests.tiny_components import family_config

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = {"pipeline.height": 32, "pipeline.width": 32, "pipeline.num_frames": 5, "pipeline.max_sequence_length": 16}
PROMPTS = ["a small boat moving left across a lake", "a bird flying up into the sky"]


wan_dir = tiny_checkpoint(build_tiny_wan)
wan_expand_dir = tiny_checkpoint(build_tiny_wan, expand_timesteps=True)  # Wan2.2 TI2V-5B style: one timestep per token
wan_i2v_dir = tiny_checkpoint(build_tiny_wan_i2v)
cogvideox_dir = tiny_checkpoint(build_tiny_cogvideox)
cogvideox_sincos_dir = tiny_checkpoint(build_tiny_cogvideox, rotary=False)  # CogVideoX-2b style: sinusoidal positions, no rotary embeddings


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """Train/eval .txt prompt files, and .jsonl ones whose "image" is a first frame (for image-to-video)."""
    from PIL import Image

    d = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(d / f"frame{i}.png")  # resized to 32x32
    (d / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (d / "eval.txt").write_text(PROMPTS[0] + "\n")
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f"frame{i}.png"}) + "\n" for i, p in enumerate(PROMPTS)))
    (d / "eval.jsonl").write_text(json.dumps({"prompt": PROMPTS[1], "image": "frame1.png"}) + "\n")
    return d


def video_config(name, directory, run_dir, prompts, suffix: str = "txt", sampler: str = "flow_sde", **extra):
    return family_config(
        name,
        directory,
        run_dir,
        sampler=sampler,
        **{
            "reward.components": "{motion_quality: 1.0}",
            "prompts.dataset": "file",
            "prompts.train_file": str(prompts / f"train.{suffix}"),
            "prompts.eval_file": str(prompts / f"eval.{suffix}"),
            "pipeline.lora": "{r: 4, alpha: 8}",
            **SIZE,
            **extra,
        },
    )


def load(name, directory, **overrides):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    size = {k.split(".", 1)[1]: v for k, v in SIZE.items()}
    return build_pipeline(PipelineConfig(name=name, pretrained=str(directory), device="cpu", **{**size, **overrides}), "cpu")


def unipc():
    """The scheduler the hub's Wan2.1 checkpoints ship: UniPCMultistepScheduler with flow sigmas, shift 3."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000)


class VideoTester(FamilyTesterMixin):
    """What the video families share: 5-frame 32x32 clips, the motion reward (OpenCV optical flow) on prompt files,
    LoRA in every run, the LoRA round trip at CFG 3 (its GRPO run is the family's GRPO check)."""

    prompts, suffix = tuple(PROMPTS), "txt"
    load_options = {k.split(".", 1)[1]: v for k, v in SIZE.items()}
    grpo_overrides = lora_overrides = adjoint_matching_overrides = {"rollout.guidance_scale": 3.0}
    lora_guidance_scale = 3.0
    grid_call = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 5, "guidance_scale": 1.0, "max_sequence_length": 16}
    test_sampler_equals_the_diffusers_pipeline = None
    test_two_grpo_iterations = None
    test_loads_through_flowrl_and_samples = None

    def config(self, **extra):
        files = self.fixture("prompt_files")
        return video_config(self.name, self.directory, self.run_dir, files, self.suffix, self.sampler, **{**self.run_settings, **extra})

    def metadata(self):
        if self.suffix == "txt":
            return None
        return [{"image": str(self.fixture("prompt_files") / f"frame{i}.png")} for i in range(2)]


class TestWan(VideoTester):
    """Wan2.1 text-to-video: FlowMatchEuler (or the hub's UniPC) with shift 3, CFG against the empty prompt."""

    name, checkpoint, pipeline_class = "wan", "wan_dir", "WanPipeline"
    grids = {"flow_match": Grid(), "unipc": Grid(unipc)}

    def check_lora_run(self, trainer):
        traj = trainer.collect(0)
        assert traj.latents.shape[2:] == (4, 2, 4, 4) and traj.samples.shape == (4, 3, 5, 32, 32)
        assert torch.isfinite(trainer.score(traj).rewards).all()

    def check_grid(self, adapter, grid):
        """The sigmas WanPipeline sets up for the checkpoint's scheduler: FlowMatchEulerDiscreteScheduler(shift=3) or
        the hub's UniPCMultistepScheduler(flow_shift=3)."""
        assert adapter.schedule.grid == grid and adapter.shift == 3.0

    def compare_grid(self, adapter, steps, timesteps, sigmas, grid):
        """UniPC alone starts at 1 - 1e-6 (for its log(1 - sigma)); flowrl starts at 1, every later sigma is equal."""
        ours = adapter.schedule.sigmas(steps)
        if grid == "unipc":
            assert float(ours[0]) == 1.0 and float(sigmas[0]) == pytest.approx(1 - 1e-6, abs=1e-7)
            ours, sigmas = ours[1:], sigmas[1:]
        assert torch.equal(ours, sigmas), steps

    def check_grid_extras(self, adapter, pipe, directory, grid):
        """DanceGRPO's grid, shift(linspace(1, 0, K + 1)), stays selectable."""
        from flowrl.samplers.schedules import shift_sigmas

        chosen = self.load(directory, sampling_grid="linspace")
        assert torch.equal(chosen.schedule.sigmas(20), shift_sigmas(torch.linspace(1, 0, 21, dtype=torch.float64), 3.0).float())


class TestWanI2V(VideoTester):
    """Wan2.1 image-to-video: the first frame of each prompt's metadata (CLIP embeds, VAE latents + mask)."""

    name, checkpoint, pipeline_class, suffix = "wan_i2v", "wan_i2v_dir", "WanImageToVideoPipeline", "jsonl"
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None
    test_two_diffusion_nft_iterations = None

    def check_lora_run(self, trainer):  # re-scoring used the trajectory's stored image condition
        from flowrl.errors import FlowRLError

        with pytest.raises(FlowRLError, match="conditioning image"):
            trainer.pipeline.encode(PROMPTS, [{}, {}])


class TestCogVideoX(VideoTester):
    """CogVideoX: DDIM over the zero-terminal-SNR v-prediction table with 9 frames (the zero-terminal-SNR
    sigma = 1 has x0_hat = -v and is trained); CogVideoX-2b's "trailing" grid."""

    name, checkpoint, pipeline_class = "cogvideox", "cogvideox_dir", "CogVideoXPipeline"
    flow, sampler, run_settings = False, "ddim", {"pipeline.num_frames": 9}
    load_options = {**VideoTester.load_options, "num_frames": 9}
    grid_call = {**VideoTester.grid_call, "num_frames": 9}

    def check_grid(self, adapter, grid):
        """CogVideoX-2b's CogVideoXDDIMScheduler config says "trailing" (999, ..., from pure noise)."""
        assert adapter.schedule.spacing == "trailing"


# -- Wan2.1 text-to-video -------------------------------------------------------------------------


def test_wan_loads_encodes_like_wan_pipeline_and_decodes_video(wan_dir):
    from diffusers import WanPipeline

    pipe = load("wan", wan_dir)
    assert pipe.shift == 3.0 and pipe.prediction_type == "flow"
    assert pipe.latent_shape() == (4, 2, 4, 4)  # T_lat = (5 - 1) // 4 + 1, 32 / 8
    ours = pipe.encode(["a cat", "an astronaut riding a horse on the moon"])["prompt_embeds"]
    reference = WanPipeline.from_pretrained(wan_dir)._get_t5_prompt_embeds(
        ["a cat", "an astronaut riding a horse on the moon"], max_sequence_length=16, device="cpu"
    )
    torch.testing.assert_close(ours, reference.float(), atol=1e-5, rtol=0)  # float noise only (same weights, same class)
    n = len(pipe.tokenizer("a cat").input_ids)  # [BOS] a cat [EOS], then zeros up to max_sequence_length
    assert (ours[0, n:] == 0).all() and (ours[0, :n] != 0).any(dim=-1).all()
    videos = pipe.decode(torch.randn(2, *pipe.latent_shape()))
    assert videos.shape == (2, 3, 5, 32, 32) and videos.dtype == torch.float32 and 0 <= videos.min() and videos.max() <= 1
    assert not any(p.requires_grad for m in pipe.frozen_modules() for p in m.parameters())


@pytest.mark.parametrize("expand_timesteps", [False, True])
def test_wan_ode_equals_diffusers_wan_pipeline(request, expand_timesteps):
    """flowrl's Euler ODE (flow_sde at noise level 0) with CFG = WanPipeline + FlowMatchEulerDiscreteScheduler
    with its default arguments (the same grid: set_timesteps(K) with the checkpoint's shift 3), from the same
    initial latents; and the decoded videos = the pipeline's output_type="pt" frames. Also with Wan2.2's
    per-token timesteps."""
    from diffusers import WanPipeline

    from flowrl.samplers import FlowSDEConfig
    from flowrl.samplers.rollout import rollout

    wan_dir = request.getfixturevalue("wan_expand_dir" if expand_timesteps else "wan_dir")
    pipe, steps, scale = load("wan", wan_dir), 4, 4.0
    assert pipe.expand_timesteps == expand_timesteps
    noise = torch.randn(2, *pipe.latent_shape(), generator=torch.Generator().manual_seed(0))
    sigmas = pipe.schedule.sigmas(steps)
    traj = rollout(
        pipe,
        FlowSDEConfig(noise_level=0.0).build(),
        PROMPTS,
        [{}, {}],
        torch.arange(2),
        sigmas,
        torch.Generator().manual_seed(1),
        scale,
        initial_noise=noise,
    )

    reference = WanPipeline.from_pretrained(wan_dir)  # default arguments: the scheduler's own set_timesteps(K)
    call = {
        "negative_prompt": "",
        "height": 32,
        "width": 32,
        "num_inference_steps": steps,
        "guidance_scale": scale,
        "max_sequence_length": 16,
    }
    theirs = reference(PROMPTS, num_frames=9, latents=noise.clone(), output_type="latent", **call).frames
    assert torch.equal(reference.scheduler.sigmas, sigmas)
    diff = float((traj.latents[:, -1] - theirs).abs().max())
    print(f"oracle max |diff| {diff:.2e}")
    assert diff < 1e-5, f"flowrl's ODE differs from WanPipeline by {diff}"
    assert float((theirs - noise).abs().max()) > 0.1  # the model did something
    # decoding (latents_mean / latents_std, the video VAE, [0, 1]) = the pipeline's output_type="pt" frames (B, T, 3, H, W)
    frames = reference(PROMPTS, num_frames=5, latents=noise.clone(), output_type="pt", **call).frames
    # atol 5e-5: the latents agree to ~1.3e-6 (float summation order), and the video VAE's decode amplifies that
    # about tenfold (1.18e-5 measured with diffusers 0.42.1); a wrong latent scaling or clamp would be far larger
    torch.testing.assert_close(traj.samples, frames.permute(0, 2, 1, 3, 4), atol=5e-5, rtol=0)


@pytest.mark.parametrize("family", ["wan", "cogvideox"])
def test_bf16_lora_with_gradient_checkpointing_backpropagates(family, request):
    """The real-checkpoint settings (bf16 base, fp32 LoRA, gradient checkpointing, CFG) give finite
    gradients on every LoRA tensor."""
    from flowrl.config import LoraConfig

    directory = request.getfixturevalue("wan_dir" if family == "wan" else "cogvideox_dir")
    frames = 5 if family == "wan" else 9
    pipe = load(family, directory, dtype="bfloat16", lora=LoraConfig(r=4, alpha=8), gradient_checkpointing=True, num_frames=frames)
    assert pipe.model_dtype == torch.bfloat16 and pipe.denoiser.is_gradient_checkpointing
    pipe.denoiser.train()
    x = torch.randn(2, *pipe.latent_shape())
    out = pipe.predict(x, torch.tensor(0.6), pipe.encode(PROMPTS), guidance_scale=3.0)
    assert out.dtype == torch.float32 and out.shape == x.shape and torch.isfinite(out).all()
    out.square().mean().backward()
    params = pipe.trainable_parameters()
    assert params and all(p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert any(float(p.grad.abs().max()) > 0 for p in params)


# -- Wan2.1 image-to-video ------------------------------------------------------------------------


def test_wan_i2v_ode_equals_diffusers_pipeline(wan_i2v_dir, prompt_files):
    """The first-frame condition (CLIP embeds, VAE latents + mask) and the CFG branches match
    WanImageToVideoPipeline (default arguments, so the same grid) given the same image file and initial latents."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from flowrl.samplers import FlowSDEConfig
    from flowrl.samplers.rollout import rollout

    pipe, steps, scale = load("wan_i2v", wan_i2v_dir), 3, 4.0
    assert pipe.needs_metadata and pipe.image_encoder is not None
    image = str(prompt_files / "frame0.png")
    noise = torch.randn(1, *pipe.latent_shape(), generator=torch.Generator().manual_seed(0))
    sigmas = pipe.schedule.sigmas(steps)
    traj = rollout(
        pipe,
        FlowSDEConfig(noise_level=0.0).build(),
        PROMPTS[:1],
        [{"image": image}],
        torch.arange(1),
        sigmas,
        torch.Generator().manual_seed(1),
        scale,
        initial_noise=noise,
    )
    assert set(traj.cond) == {"prompt_embeds", "condition", "image_embeds"} and traj.cond["condition"].shape == (1, 8, 2, 4, 4)
    assert (traj.cond["condition"][:, :4, 0] == 1).all() and (traj.cond["condition"][:, :4, 1:] == 0).all()  # the mask channels

    reference = WanImageToVideoPipeline.from_pretrained(wan_i2v_dir)  # default arguments: the scheduler's own grid
    # diffusers 0.42.1's I2V prompt_clean calls ftfy unconditionally (not installed here): encode with WanPipeline's
    embeds = [WanPipeline._get_t5_prompt_embeds(reference, [p], max_sequence_length=16, device="cpu") for p in (PROMPTS[0], "")]
    theirs = reference(
        image=Image.open(image).convert("RGB"),
        prompt_embeds=embeds[0],
        negative_prompt_embeds=embeds[1],
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=steps,
        guidance_scale=scale,
        latents=noise.clone(),
        max_sequence_length=16,
        output_type="latent",
    ).frames
    assert torch.equal(reference.scheduler.sigmas, sigmas)
    diff = float((traj.latents[:, -1] - theirs).abs().max())
    print(f"oracle max |diff| {diff:.2e}")
    assert diff < 1e-5, f"flowrl's I2V ODE differs from WanImageToVideoPipeline by {diff}"
    # a tensor image in [0, 1] is accepted too, and conditions differently from another image
    tensor_cond = pipe.encode(PROMPTS[:1], [{"image": torch.rand(3, 24, 40)}])
    assert tensor_cond["condition"].shape == traj.cond["condition"].shape
    assert (tensor_cond["condition"] - traj.cond["condition"]).abs().max() > 1e-3


# -- CogVideoX --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary", [True, False])
def test_cogvideox_ddim_equals_diffusers_pipeline(request, rotary):
    """flowrl's DDIM (eta 0) over the zero-terminal-SNR v-prediction table, with rotary (5B) or sinusoidal (2B)
    positions and the (B, T, C, H, W) permutation, = CogVideoXPipeline with CogVideoXDDIMScheduler
    (4 trailing steps of 1000)."""
    from diffusers import CogVideoXPipeline

    from flowrl.samplers import DDIMSampler
    from flowrl.samplers.rollout import rollout

    directory = request.getfixturevalue("cogvideox_dir" if rotary else "cogvideox_sincos_dir")
    pipe, steps, scale = load("cogvideox", directory, num_frames=9), 4, 4.0
    assert pipe.prediction_type == "v_prediction" and pipe.schedule.alphas_cumprod[-1] == 0  # zero terminal SNR honoured
    reference = CogVideoXPipeline.from_pretrained(directory)
    torch.testing.assert_close(pipe.schedule.alphas_cumprod, reference.scheduler.alphas_cumprod.double())
    assert pipe.latent_shape() == (4, 3, 4, 4) and (pipe.rotary_embeddings() is not None) == rotary  # 9 frames: (9 - 1) // 4 + 1
    noise = torch.randn(2, *pipe.latent_shape(), generator=torch.Generator().manual_seed(0))
    traj = rollout(
        pipe,
        DDIMSampler(pipe.schedule, "v_prediction", eta=0.0, clip_sample=None, reduction="mean"),
        PROMPTS,
        [{}, {}],
        torch.arange(2),
        pipe.schedule.sigmas(steps),
        torch.Generator().manual_seed(1),
        scale,
        initial_noise=noise,
    )
    call = {"negative_prompt": "", "height": 32, "width": 32, "num_frames": 9, "num_inference_steps": steps, "guidance_scale": scale}
    call["max_sequence_length"] = 16
    theirs = reference(PROMPTS, **call, latents=noise.permute(0, 2, 1, 3, 4).clone(), output_type="latent").frames  # (B, T, C, H, W)
    diff = float((traj.latents[:, -1] - theirs.permute(0, 2, 1, 3, 4)).abs().max())
    print(f"oracle max |diff| {diff:.2e}")
    assert diff < 1e-5, f"flowrl's DDIM differs from CogVideoXPipeline by {diff}"
    assert traj.samples.shape == (2, 3, 9, 32, 32) and 0 <= traj.samples.min() and traj.samples.max() <= 1
    frames = reference(PROMPTS, **call, latents=noise.permute(0, 2, 1, 3, 4).clone(), output_type="pt").frames
    torch.testing.assert_close(traj.samples, frames.permute(0, 2, 1, 3, 4), atol=1e-5, rtol=0)


# -- errors and configs -------------------------------------------------------------------------------


def test_bad_video_sizes_and_sources_fail_with_one_sentence(wan_dir, wan_i2v_dir, tmp_path):
    from flowrl.errors import FlowRLError

    with pytest.raises(FlowRLError, match="num_frames must be 4 \\* n \\+ 1"):
        load("wan", wan_dir, num_frames=6)
    with pytest.raises(FlowRLError, match="multiples of 16"):
        load("wan", wan_dir, height=40)
    with pytest.raises(FlowRLError, match="use pipeline.name=wan_i2v"):
        load("wan", wan_i2v_dir)
    with pytest.raises(FlowRLError, match="use pipeline.name=wan"):
        load("wan_i2v", wan_dir)
    (tmp_path / "empty").mkdir()
    for name in ("wan", "wan_i2v", "cogvideox"):
        with pytest.raises(FlowRLError, match="could not"):
            load(name, tmp_path / "empty")


def test_wan_config_loads_and_validates():
    from flowrl.config import load_config

    config = load_config(CONFIGS / "wan" / "grpo_motion.yaml", [])
    assert config.pipeline.name == "wan" and config.pipeline.pretrained == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert config.pipeline.dtype == "bfloat16" and config.train.mixed_precision == "bf16" and config.pipeline.lora is not None
    assert config.pipeline.gradient_checkpointing and config.sampler.name == "flow_sde"
    assert set(config.reward.components) == {"motion_quality"}
    assert (config.pipeline.num_frames - 1) % 4 == 0 and config.pipeline.height % 16 == 0 and config.pipeline.width % 16 == 0
    from flowrl.prompts import prompt_pool

    assert prompt_pool(config.prompts.dataset, "train", file=config.prompts.train_file)
