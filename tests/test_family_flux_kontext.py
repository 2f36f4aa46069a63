"""FLUX.1 Kontext through flowrl: the real diffusers classes at tiny size (FluxTransformer2DModel with a guidance
embedding, CLIP + T5, AutoencoderKL) saved as a ``FluxKontextPipeline`` and loaded through
``pipeline.pretrained=<dir>``; the source image comes from each prompt's metadata; oracle checks against
``FluxKontextPipeline.__call__``."""

from __future__ import annotations

import json
import operator
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.pipelines.tiny.sd3_flux import build_tiny_kontext
from tests.family_tester import EmbeddedGuidanceTesterMixin, FamilyTesterMixin, tiny_checkpoint
from tests.tiny_components import family_config, ode_sample

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["make the cat red", "add a hat to the dog"]
T5_TOKENS = 8
SIZE = 16  # generated images: 16x16 pixels, 8x8 latents, 16 packed tokens
# Flow-Factory's Kontext LoRA targets (the preset's): FLUX's attention projections plus the double blocks' feed-forwards
FLOW_FACTORY_TARGETS = (
    "[attn.to_k, attn.to_q, attn.to_v, attn.to_out.0, attn.add_k_proj, attn.add_q_proj, attn.add_v_proj, attn.to_add_out, "
    "ff.net.0.proj, ff_context.net.0.proj, ff.net.2, ff_context.net.2]"
)


kontext_dir = tiny_checkpoint(build_tiny_kontext)


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


class TestFluxKontext(EmbeddedGuidanceTesterMixin, FamilyTesterMixin):
    """FLUX.1 Kontext: the source image of each prompt's metadata (resized, VAE mode latents, packed after the
    generated tokens with RoPE ids of first axis 1), the guidance embedding, the dynamic shift of the output size."""

    name, checkpoint, pipeline_class, prompts = "flux_kontext", "kontext_dir", "FluxKontextPipeline", tuple(PROMPTS)
    grpo_overrides = {"sampler.diffusion": "dance_grpo", "sampler.noise_level": 0.3}  # re-scoring uses the stored source latents
    # LoRA on Flow-Factory's Kontext targets (the preset's)
    lora_overrides, lora_guidance_scale = {"pipeline.lora": f"{{r: 4, alpha: 8, target_modules: {FLOW_FACTORY_TARGETS}}}"}, 2.5
    oracle_steps, oracle_guidance_scale, oracle_bound, oracle_decode_atol = 3, 2.5, (operator.le, 1e-6), 1e-4
    guidance_embedder, embedded_guidance_scale = "time_text_embed.guidance_embedder", 2.5
    test_two_adjoint_matching_iterations = None
    test_two_diffusion_nft_iterations = None
    test_loads_through_flowrl_and_samples = None

    def config(self, **extra):
        return kontext_config(self.directory, self.run_dir, self.fixture("prompt_files"), **extra)

    def load(self, directory=None, **options):
        return load(directory or self.directory, **options)

    def metadata(self):
        return metadata(self.fixture("prompt_files"))

    def oracle_inputs(self, case):
        return list(PROMPTS), metadata(self.fixture("prompt_files"), (0, 0))  # one source image, two edits of it (a GRPO group)

    def check_conditioning(self, adapter, pipe, case):
        assert adapter.guidance_mode == "embedded" and adapter.latent_shape() == (4, 8, 8)
        cond = adapter.encode(*self.oracle_inputs(case))
        assert cond["image_latents"].shape == (2, 4, 10, 14)  # 20x28 pixels (multiples of 4 already), 5x7 packed tokens

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        """FluxKontextPipeline.__call__ with its own sigmas and mu; max_area = height * width keeps the requested size."""
        from PIL import Image

        from flowrl.pipelines.flux import pack_latents

        with Image.open(self.oracle_inputs(case)[1][0]["image"]) as img:
            source = img.convert("RGB")
        size = {"height": SIZE, "width": SIZE, "max_area": SIZE * SIZE, "_auto_resize": False}
        call = {"num_inference_steps": steps, "guidance_scale": scale, "max_sequence_length": T5_TOKENS, "output_type": output_type}
        return pipe(image=source, prompt=list(PROMPTS), latents=pack_latents(noise), **size, **call).images

    def pipeline_latents(self, adapter, ours):
        from flowrl.pipelines.flux import pack_latents

        return pack_latents(ours)

    def check_oracle(self, adapter, pipe, noise, ours, case):
        # the source image matters: another one changes the prediction
        cond = adapter.encode(*self.oracle_inputs(case))
        other = adapter.encode(PROMPTS, metadata(self.fixture("prompt_files"), (1, 1)))
        x, sigma = noise, torch.tensor(0.7)
        with torch.no_grad():
            assert (adapter.predict(x, sigma, cond, 2.5) - adapter.predict(x, sigma, other, 2.5)).abs().max() > 1e-4

    def grid_call_arguments(self, adapter, pipe):
        """The dynamic shift of the generated image's token count, the source tokens not counted."""
        from PIL import Image

        with Image.open(self.fixture("prompt_files") / "source0.png") as img:
            source = img.convert("RGB")
        call = {"image": source, "prompt": "a cat", "height": SIZE, "width": SIZE, "max_area": SIZE * SIZE, "_auto_resize": False}
        return {**call, "max_sequence_length": T5_TOKENS}

    def check_grid(self, adapter, grid):
        assert adapter.schedule.grid == "flux" and adapter.schedule.dynamic

    def check_lora_run(self, trainer):
        from peft.utils import get_peft_model_state_dict

        assert any("ff_context" in k for k in get_peft_model_state_dict(trainer.pipeline.denoiser))


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


def test_one_forward_per_step_carries_both_token_sets_and_source_errors(kontext_dir, prompt_files):
    """One transformer call per step carrying both token sets (the guidance checks are the mixin's); a missing
    source image and a batch of differently sized ones fail with one sentence."""
    from flowrl.errors import FlowRLError

    adapter = load(kontext_dir)
    calls = []
    hook = adapter.denoiser.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(kwargs["hidden_states"].shape), with_kwargs=True
    )
    try:
        ode_sample(adapter, PROMPTS, seed=3, guidance_scale=2.5, metadata=metadata(prompt_files))
    finally:
        hook.remove()
    assert calls == [torch.Size([2, 16 + 35, 16])] * 3  # 16 generated + 35 source tokens of 4 * 4 channels
    with pytest.raises(FlowRLError, match="needs a source image per prompt"):
        adapter.encode(PROMPTS, [{}, {}])
    with pytest.raises(FlowRLError, match=r"different sizes \[\(20, 28\), \(28, 20\)\]"):
        adapter.encode(PROMPTS, metadata(prompt_files, (0, 2)))
    fixed = load(kontext_dir, condition_height=16, condition_width=24)  # a fixed size holds any mix
    assert fixed.encode(PROMPTS, metadata(prompt_files, (0, 2)))["image_latents"].shape == (2, 4, 8, 12)
    with pytest.raises(FlowRLError, match="multiples of 4"):
        load(kontext_dir, condition_height=18, condition_width=24)


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
