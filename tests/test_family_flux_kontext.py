"""FLUX.1 Kontext through flowrl: the real diffusers classes at tiny size (FluxTransformer2DModel with a guidance
embedding, CLIP + T5, AutoencoderKL) saved as a ``FluxKontextPipeline`` and loaded through
``pipeline.pretrained=<dir>``; the source image comes from each prompt's metadata; oracle checks against
``FluxKontextPipeline.__call__``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_components import (
    family_config,
    rescoring_ratio_is_one,
    tiny_clip_text,
    tiny_t5,
    tiny_tokenizer,
    tiny_vae,
    two_iterations_change_every_parameter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["make the cat red", "add a hat to the dog"]
T5_TOKENS = 8
SIZE = 16  # generated images: 16x16 pixels, 8x8 latents, 16 packed tokens
# Flow-Factory's Kontext LoRA targets (the preset's): FLUX's attention projections plus the double blocks' feed-forwards
FLOW_FACTORY_TARGETS = (
    "[attn.to_k, attn.to_q, attn.to_v, attn.to_out.0, attn.add_k_proj, attn.add_q_proj, attn.add_v_proj, attn.to_add_out, "
    "ff.net.0.proj, ff_context.net.0.proj, ff.net.2, ff_context.net.2]"
)


def build_tiny_kontext(directory):
    """FLUX.1-Kontext-dev-shaped: one double- and one single-stream block, guidance embedding, FLUX.1-dev's dynamic
    shift, a 4-channel VAE with FLUX's scaling and shift factors."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
        guidance_embeds=True,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    vae = tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    FluxKontextPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=tiny_clip_text(seed=1),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_t5(d_model=32),
        tokenizer_2=tiny_tokenizer(),
    ).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    return build_tiny_kontext(tmp_path_factory.mktemp("tiny_kontext"))


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """Source images (two 20x28, one 28x20) and .jsonl prompt files whose "image" names them."""
    from PIL import Image

    d = tmp_path_factory.mktemp("kontext_prompts")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(20, 28), (20, 28), (28, 20)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"source{i}.png")
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f"source{i}.png"}) + "\n" for i, p in enumerate(PROMPTS)))
    (d / "eval.jsonl").write_text(json.dumps({"prompt": PROMPTS[1], "image": "source1.png"}) + "\n")
    return d


def metadata(prompt_files, indices=(0, 1)):
    return [{"image": str(prompt_files / f"source{i}.png")} for i in indices]


def load(directory, **kwargs):
    from flowrl.pipelines import build_pipeline
    from flowrl.pipelines.flux_kontext import FluxKontextConfig

    options = {"height": SIZE, "width": SIZE, "max_sequence_length": T5_TOKENS, "condition_auto_resize": False, **kwargs}
    return build_pipeline(FluxKontextConfig(pretrained=str(directory), device="cpu", **options), "cpu")


def kontext_config(directory, output_dir, prompt_files, **extra):
    return family_config(
        "flux_kontext",
        directory,
        output_dir,
        **{
            "pipeline.max_sequence_length": T5_TOKENS,
            "pipeline.height": SIZE,
            "pipeline.width": SIZE,
            "pipeline.condition_auto_resize": False,
            "rollout.guidance_mode": "embedded",
            "rollout.guidance_scale": 2.5,
            "prompts.dataset": "file",
            "prompts.train_file": str(prompt_files / "train.jsonl"),
            "prompts.eval_file": str(prompt_files / "eval.jsonl"),
            **extra,
        },
    )


def sample(adapter, meta, steps: int = 3, seed: int = 3, guidance_scale: float = 2.5, noise_level: float | None = None, noise=None):
    """flowrl's deterministic rollout (the ODE sampler, or the Euler step of flow_sde at noise level 0 from
    ``noise``) with the source images of ``meta``: the trajectory."""
    from flowrl.config import ODEConfig
    from flowrl.samplers import FlowSDEConfig, build_sampler
    from flowrl.samplers.rollout import rollout

    extra = {} if noise is None else {"stochastic_steps": torch.zeros(steps, dtype=torch.bool), "initial_noise": noise}
    sampler = build_sampler(ODEConfig(), adapter) if noise_level is None else FlowSDEConfig(noise_level=noise_level).build()
    return rollout(
        adapter,
        sampler,
        PROMPTS,
        meta,
        torch.arange(len(PROMPTS)),
        adapter.schedule.sigmas(steps),
        torch.Generator().manual_seed(seed),
        guidance_scale,
        same_noise_in_group=False,
        **extra,
    )


def test_matches_diffusers_pipeline_with_source_image_and_embedded_guidance(kontext_dir, prompt_files):
    """Oracle: the source image's resize, VAE mode latents, packing and RoPE ids (first axis 1) appended to the
    generated tokens, sigma as time, the guidance input and the dynamic shift of the output size, as
    FluxKontextPipeline.__call__ (its own grid; max_area = height * width keeps the requested size)."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    from flowrl.pipelines.flux import pack_latents, unpack_latents

    adapter = load(kontext_dir)
    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)
    pipe.set_progress_bar_config(disable=True)
    assert adapter.guidance_mode == "embedded" and adapter.latent_shape() == (4, 8, 8)
    meta = metadata(prompt_files, (0, 0))  # one source image, two edits of it (a GRPO group shares its source)
    cond = adapter.encode(PROMPTS, meta)
    assert cond["image_latents"].shape == (2, 4, 10, 14)  # 20x28 pixels (multiples of 4 already), 5x7 packed tokens

    steps, scale = 3, 2.5
    noise = adapter.initial_noise(2, torch.Generator().manual_seed(1))
    with Image.open(meta[0]["image"]) as img:
        source = img.convert("RGB")

    def call(output_type):
        return pipe(
            image=source,
            prompt=list(PROMPTS),
            latents=pack_latents(noise),
            num_inference_steps=steps,
            height=SIZE,
            width=SIZE,
            max_area=SIZE * SIZE,
            _auto_resize=False,
            guidance_scale=scale,
            max_sequence_length=T5_TOKENS,
            output_type=output_type,
        ).images  # default arguments otherwise: the pipeline's own sigmas and mu

    theirs = unpack_latents(call("latent"), 8, 8)
    assert torch.equal(pipe.scheduler.sigmas, adapter.schedule.sigmas(steps))
    ours = sample(adapter, meta, steps, guidance_scale=scale, noise_level=0.0, noise=noise).latents[:, -1]
    diff = (ours - theirs).abs().max().item()
    print(f"Kontext oracle (embedded guidance {scale}, {steps} steps): max |flowrl - diffusers| = {diff:.2e}")
    assert diff <= 1e-6
    torch.testing.assert_close(adapter.decode(ours), call("pt"), atol=1e-4, rtol=0)
    # the source image matters: another one changes the prediction
    other = adapter.encode(PROMPTS, metadata(prompt_files, (1, 1)))
    x, sigma = noise, torch.tensor(0.7)
    with torch.no_grad():
        assert (adapter.predict(x, sigma, cond, scale) - adapter.predict(x, sigma, other, scale)).abs().max() > 1e-4


def test_source_image_size_is_the_pipelines(kontext_dir):
    """The size a source image is resized to (preferred Kontext resolution nearest in aspect ratio, floored to
    multiples of 16 by the real checkpoints' VAE, 4 by the tiny one's) is the one FluxKontextPipeline chooses: its
    image processor's resize is instrumented to report the size and stop the call there (no 1-megapixel encode);
    without auto-resize, the image's own size; a fixed pipeline.condition_height/width overrides both."""
    import diffusers.pipelines.flux.pipeline_flux_kontext as kontext
    from diffusers import FluxKontextPipeline
    from PIL import Image

    from flowrl.pipelines.flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS, kontext_image_size

    assert PREFERRED_KONTEXT_RESOLUTIONS == tuple(kontext.PREFERRED_KONTEXT_RESOLUTIONS)
    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)

    class Chosen(Exception):
        pass

    def report(image, height, width, **kwargs):
        raise Chosen(height, width)

    pipe.image_processor.resize = report
    auto, own = load(kontext_dir, condition_auto_resize=True), load(kontext_dir)
    for h, w in [(20, 28), (28, 20), (64, 64), (300, 200), (200, 300), (90, 400), (401, 97), (1000, 1001), (17, 33)]:
        image = Image.new("RGB", (w, h))
        for adapter, resize in ((auto, True), (own, False)):
            with pytest.raises(Chosen) as chosen:
                pipe(
                    image=image,
                    prompt="a cat",
                    height=SIZE,
                    width=SIZE,
                    max_area=SIZE * SIZE,
                    max_sequence_length=T5_TOKENS,
                    _auto_resize=resize,
                )
            assert adapter.source_size(image) == chosen.value.args, (h, w, resize)
    # the real checkpoints (VAE scale 8: multiples of 16): a 3:2 photo goes to 1248x832, a square one to 1024x1024
    assert kontext_image_size(1200, 1800, 16) == (832, 1248) and kontext_image_size(512, 512, 16) == (1024, 1024)
    fixed = load(kontext_dir, condition_height=12, condition_width=20)
    assert fixed.source_size(Image.new("RGB", (300, 200))) == (12, 20)


def test_default_grid_is_the_pipelines_for_k_1_to_50(kontext_dir, prompt_files):
    """FluxKontextPipeline's grid (linspace(1, 1/K, K), the dynamic shift of the generated image's token count,
    the source tokens not counted) equals flowrl's for K = 1..50."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    from tests.test_family_stable_diffusion import pipeline_default_grid

    adapter, pipe = load(kontext_dir), FluxKontextPipeline.from_pretrained(kontext_dir)
    assert adapter.schedule.grid == "flux" and adapter.schedule.dynamic
    with Image.open(prompt_files / "source0.png") as img:
        source = img.convert("RGB")
    for steps in range(1, 51):
        call = {"image": source, "prompt": "a cat", "height": SIZE, "width": SIZE, "max_area": SIZE * SIZE, "_auto_resize": False}
        _, sigmas = pipeline_default_grid(pipe, steps, max_sequence_length=T5_TOKENS, **call)
        assert torch.equal(adapter.schedule.sigmas(steps), sigmas), steps


def test_embedded_guidance_one_forward_per_step_and_source_errors(kontext_dir, prompt_files, tmp_path):
    """One transformer call per step carrying both token sets; the guidance-distilled model refuses other guidance
    modes (also through the trainer); a missing source image and a batch of differently sized ones fail with one
    sentence."""
    from flowrl.config import load_config
    from flowrl.errors import FlowRLError
    from flowrl.trainer import Trainer

    adapter = load(kontext_dir)
    calls = []
    hook = adapter.denoiser.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(kwargs["hidden_states"].shape), with_kwargs=True
    )
    try:
        sample(adapter, metadata(prompt_files), steps=3)
    finally:
        hook.remove()
    assert calls == [torch.Size([2, 16 + 35, 16])] * 3  # 16 generated + 35 source tokens of 4 * 4 channels
    with pytest.raises(FlowRLError, match="guidance-distilled"):
        adapter.guidance_mode = "cfg"
    with pytest.raises(FlowRLError, match="rollout.guidance_mode"):
        Trainer(load_config(None, kontext_config(kontext_dir, tmp_path / "run", prompt_files, **{"rollout.guidance_mode": "cfg"})))
    with pytest.raises(FlowRLError, match="needs a source image per prompt"):
        adapter.encode(PROMPTS, [{}, {}])
    with pytest.raises(FlowRLError, match=r"different sizes \[\(20, 28\), \(28, 20\)\]"):
        adapter.encode(PROMPTS, metadata(prompt_files, (0, 2)))
    fixed = load(kontext_dir, condition_height=16, condition_width=24)  # a fixed size holds any mix
    assert fixed.encode(PROMPTS, metadata(prompt_files, (0, 2)))["image_latents"].shape == (2, 4, 8, 12)
    with pytest.raises(FlowRLError, match="multiples of 4"):
        load(kontext_dir, condition_height=18, condition_width=24)


def test_two_grpo_iterations_full_finetune(kontext_dir, prompt_files, tmp_path):
    """Full fine-tuning with the DanceGRPO SDE and the embedded guidance; re-scoring uses the stored source latents."""
    overrides = kontext_config(
        kontext_dir, tmp_path / "run", prompt_files, **{"sampler.diffusion": "dance_grpo", "sampler.noise_level": 0.3}
    )
    trainer = two_iterations_change_every_parameter(overrides)
    print(f"Kontext re-scoring at unchanged weights: max |log ratio| = {rescoring_ratio_is_one(trainer):.2e}")


def test_lora_round_trip_through_diffusers_load_lora_weights(kontext_dir, prompt_files, tmp_path):
    """LoRA on Flow-Factory's Kontext targets (the preset's): every tensor trains; FluxKontextPipeline.load_lora_weights
    loads the checkpoint and, around flowrl's sampler, gives flowrl's samples; merged export and --lora-only agree."""
    from diffusers import FluxKontextPipeline
    from peft.utils import get_peft_model_state_dict

    from flowrl.cli import main
    from flowrl.pipelines import build_pipeline

    overrides = kontext_config(
        kontext_dir, tmp_path / "run", prompt_files, **{"pipeline.lora": f"{{r: 4, alpha: 8, target_modules: {FLOW_FACTORY_TARGETS}}}"}
    )
    trainer = two_iterations_change_every_parameter(overrides)
    rescoring_ratio_is_one(trainer)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    meta = metadata(prompt_files)
    ours = sample(trainer.pipeline, meta).samples

    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)
    pipe.load_lora_weights(checkpoint)
    ours_lora = get_peft_model_state_dict(trainer.pipeline.denoiser)
    theirs_lora = get_peft_model_state_dict(pipe.transformer, adapter_name=next(iter(pipe.transformer.peft_config)))
    assert set(theirs_lora) == set(ours_lora) and any("ff_context" in k for k in ours_lora)
    assert all(torch.equal(theirs_lora[k].float(), v) for k, v in ours_lora.items())
    adapter = build_pipeline(trainer.config.pipeline.model_copy(update={"lora": None}), "cpu")
    base = sample(adapter, meta).samples
    adapter.denoiser = pipe.transformer
    torch.testing.assert_close(sample(adapter, meta).samples, ours, atol=1e-5, rtol=0)
    assert (base - ours).abs().max() > 1e-4, "the LoRA did not change the samples, so the round trip proves nothing"

    assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0
    adapter.denoiser = FluxKontextPipeline.from_pretrained(tmp_path / "merged").transformer
    torch.testing.assert_close(sample(adapter, meta).samples, ours, atol=1e-4, rtol=0)
    assert main(["export", str(checkpoint), str(tmp_path / "lora"), "--lora-only"]) == 0
    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)
    pipe.load_lora_weights(tmp_path / "lora")
    adapter.denoiser = pipe.transformer
    torch.testing.assert_close(sample(adapter, meta).samples, ours, atol=1e-5, rtol=0)


def test_preset_validates(prompt_files):
    """The preset loads, and its prompt mapping (dataset hf, an edit instruction and a source image per row) gives
    each prompt its metadata["image"] when pointed at JSON lines of that shape."""
    from flowrl.config import load_config
    from flowrl.prompts import prompts_for

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "flux_kontext" / "grpo_pickscore.yaml", [])
    p = config.pipeline
    assert p.name == "flux_kontext" and p.dtype == "bfloat16" and config.train.mixed_precision == "bf16"
    assert p.lora is not None and p.lora.r == 64 and "ff_context.net.2" in p.lora.target_modules and p.gradient_checkpointing
    assert (p.height, p.width, p.condition_height, p.condition_width) == (384, 384, 384, 384)
    assert config.rollout.guidance_mode == "embedded" and config.rollout.guidance_scale == 2.5
    assert config.rollout.num_inference_steps == 10 and config.sampler.noise_level == 0.9
    local = config.prompts.model_copy(update={"train_file": str(prompt_files / "train.jsonl")})
    items = prompts_for(local, "train")
    assert [prompt for prompt, _ in items] == PROMPTS
    assert [Path(m["image"]).name for _, m in items] == ["source0.png", "source1.png"] and Path(items[0][1]["image"]).is_file()
