"""Qwen-Image (text-to-image, Edit, Edit-Plus) through flowrl: the real diffusers / transformers classes at tiny
size (QwenImageTransformer2DModel, AutoencoderKLQwenImage, Qwen2_5_VLForConditionalGeneration, a Qwen2Tokenizer
trained in-process), saved with ``save_pretrained`` and loaded through ``pipeline.pretrained=<dir>``; oracle
checks against the diffusers pipelines' own ``__call__``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.pipelines.tiny.qwen_image import (  # noqa: F401
    QWEN_SCHEDULER,
    SPECIAL,
    build_tiny_qwen_edit,
    build_tiny_qwen_image,
    tiny_image_processor,
    tiny_qwen_tokenizer,
    tiny_qwen_transformer,
    tiny_qwen_vl,
)
from tests.family_tester import FamilyTesterMixin, Grid, tiny_checkpoint
from tests.tiny_components import euler_final_latents, family_config

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of a cat", "a red apple on a wooden table in the sun"]  # different lengths: a padded mask
TEXT_TOKENS = 32  # pipeline.max_sequence_length of the tiny runs
SIZE = 32  # pixels: 4x4 latents, 2x2 = 4 image tokens

qwen_dir = tiny_checkpoint(build_tiny_qwen_image)


def load(name: str, directory, **kwargs):
    from flowrl.pipelines import FAMILIES, build_pipeline

    options = {"max_sequence_length": TEXT_TOKENS, "height": SIZE, "width": SIZE, **kwargs}
    return build_pipeline(FAMILIES.section(name)(pretrained=str(directory), device="cpu", **options), "cpu")


def qwen_config(directory, output_dir, name: str = "qwen_image", **extra):
    return family_config(
        name,
        directory,
        output_dir,
        **{
            "pipeline.max_sequence_length": TEXT_TOKENS,
            "pipeline.height": SIZE,
            "pipeline.width": SIZE,
            "rollout.guidance_scale": 4.0,
            **extra,
        },
    )


def load_diffusers(pipeline_cls, directory):
    """``pipeline_cls.from_pretrained(directory)``; the edit pipelines get their processor built by
    :func:`qwen2vl_processor` (without torchvision transformers cannot load Qwen2VLProcessor)."""
    if pipeline_cls.__name__ == "QwenImagePipeline":
        return pipeline_cls.from_pretrained(directory)
    pipe = pipeline_cls.from_pretrained(directory, processor=qwen2vl_processor(directory))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- edit --------------------------------------------------------------------------------------------
CONDITION_AREA = 96 * 96  # pipeline.condition_area of the edit tests (the pipelines' 1024 x 1024 scaled down)


def qwen2vl_processor(directory):
    """The checkpoint's Qwen2VLProcessor, for the diffusers pipelines. Without torchvision transformers builds it
    only without its video processor, which needs torchvision and which the pipelines never use: the class check
    of that one argument is skipped (the processor's __call__ is transformers' own)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    try:
        return Qwen2VLProcessor.from_pretrained(Path(directory) / "processor")
    except ImportError:  # torchvision missing
        pass
    check = ProcessorMixin.check_argument_for_proper_class

    def skip_video(self, name, argument):
        return None if name == "video_processor" and argument is None else check(self, name, argument)

    ProcessorMixin.check_argument_for_proper_class = skip_video
    try:
        return Qwen2VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(Path(directory) / "processor"),
            tokenizer=AutoTokenizer.from_pretrained(Path(directory) / "processor"),
            video_processor=None,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


edit_dir = tiny_checkpoint(build_tiny_qwen_edit)
edit_plus_dir = tiny_checkpoint(build_tiny_qwen_edit, plus=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Source images (PNG files): two squares and a 3:2 landscape, and a .jsonl prompt file for each edit model."""
    import numpy as np
    import PIL.Image

    root = tmp_path_factory.mktemp("qwen_sources")
    rng = np.random.default_rng(0)
    paths = {}
    for name, (w, h) in {"square_a": (48, 48), "square_b": (40, 40), "wide": (60, 40)}.items():
        paths[name] = str(root / f"{name}.png")
        PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[name])
    edit = [{"prompt": "make it red", "image": paths["square_a"]}, {"prompt": "add a hat", "image": paths["square_b"]}]
    plus = [
        {"prompt": "put the cat on the table", "images": [paths["square_a"], paths["wide"]]},
        {"prompt": "swap the colors", "images": [paths["square_b"], paths["wide"]]},
    ]
    for name, rows in (("edit", edit), ("plus", plus)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = str(root / f"{name}.jsonl")
    return paths


def edit_config(directory, output_dir, name: str, prompt_file: str, **extra):
    return qwen_config(
        directory,
        output_dir,
        name=name,
        **{
            "pipeline.condition_area": CONDITION_AREA,
            "prompts.dataset": "file",
            "prompts.train_file": prompt_file,
            "prompts.eval_file": prompt_file,
            **extra,
        },
    )


# -- the shared checks ------------------------------------------------------------------------------
class QwenTester(FamilyTesterMixin):
    """What the Qwen-Image pipelines share: the Qwen2.5-VL text encoder with its templates, true CFG against " "
    with the norm rescale, packed latents, the dynamic shift with the terminal stretch; LoRA (the last block's
    text-stream tail is never a target: it cannot reach the output)."""

    lora_guidance_scale = 4.0
    test_two_adjoint_matching_iterations = None
    test_two_diffusion_nft_iterations = None
    test_loads_through_flowrl_and_samples = None

    def load(self, directory=None, **options):
        return load(self.name, directory or self.directory, **{**self.load_options, **options})

    def diffusers_pipeline(self, directory=None):
        import diffusers

        return load_diffusers(getattr(diffusers, self.pipeline_class), directory or self.directory)

    def lora_sample_inputs(self, trainer):
        """Two prompts (with their metadata, the edit models' source images) of the run's own prompt pool."""
        from flowrl.prompts import prompts_for

        pool = prompts_for(trainer.config.prompts, "train")[:2]
        return [p for p, _ in pool], [m for _, m in pool] if getattr(trainer.pipeline, "needs_metadata", False) else None

    def check_lora_run(self, trainer):
        assert "transformer_blocks.1.attn.add_q_proj" not in trainer.pipeline.default_lora_targets


class TestQwenImage(QwenTester):
    """Qwen-Image text-to-image."""

    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # diffusers' K = 1 grid (0 / 0)
    name, checkpoint, pipeline_class, prompts = "qwen_image", "qwen_dir", "QwenImagePipeline", tuple(PROMPTS)
    oracle_decode_atol, frozen_modules = 1e-5, 2
    grids = {"32x32": Grid(), "64x32": Grid(load={"height": 64, "width": 32})}

    def config(self, **extra):
        return qwen_config(self.directory, self.run_dir, **extra)

    def check_conditioning(self, adapter, pipe, case):
        """Template + dropped prefix + padded mask, as QwenImagePipeline.encode_prompt."""
        assert adapter.latent_shape() == (4, 4, 4) and adapter.guidance_mode == "cfg" and adapter.config.negative_prompt == " "
        embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=TEXT_TOKENS)
        cond = adapter.encode(PROMPTS)
        assert mask is not None and cond["prompt_embeds"].shape == (2, TEXT_TOKENS, 32)
        length = embeds.shape[1]
        torch.testing.assert_close(cond["prompt_embeds"][:, :length], embeds, atol=1e-5, rtol=0)
        assert torch.equal(cond["prompt_embeds_mask"][:, :length], mask) and cond["prompt_embeds_mask"][:, length:].sum() == 0
        assert cond["prompt_embeds"][:, length:].abs().max() == 0

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        """Packing, img_shapes, timestep / 1000, true CFG against " " with the norm rescale, the VAE decode, as
        QwenImagePipeline.__call__ (default arguments but the size and the text length)."""
        from flowrl.pipelines.flux import pack_latents

        call = {"height": SIZE, "width": SIZE, "num_inference_steps": steps, "max_sequence_length": TEXT_TOKENS}
        return pipe(
            prompt=PROMPTS, negative_prompt=" ", true_cfg_scale=scale, latents=pack_latents(noise), output_type=output_type, **call
        ).images

    def pipeline_latents(self, adapter, ours):
        from flowrl.pipelines.flux import pack_latents

        return pack_latents(ours)

    def check_oracle(self, adapter, pipe, noise, ours, case):
        # without the rescale the guided prediction differs: the pipeline's rescale is really applied
        x, sigma, cond, scale = noise, torch.tensor(0.7), adapter.encode(PROMPTS), self.oracle_guidance_scale
        plain = self.load(cfg_norm_rescale=False)
        with torch.no_grad():
            assert (plain.predict(x, sigma, cond, scale) - adapter.predict(x, sigma, cond, scale)).abs().max() > 1e-3

    def grid_call_arguments(self, adapter, pipe):
        embeds, _ = pipe.encode_prompt(["a cat"], max_sequence_length=TEXT_TOKENS)
        height, width = adapter.sample_size()
        return {"prompt_embeds": embeds, "height": height, "width": width, "true_cfg_scale": 1.0}

    def check_grid(self, adapter, grid):
        """mu from the token count (two sizes), then the shift_terminal stretch to 0.02."""
        assert adapter.schedule.grid == "flux" and adapter.schedule.dynamic and adapter.schedule.shift_terminal == pytest.approx(0.02)

    def compare_grid(self, adapter, steps, timesteps, sigmas, grid):
        """K = 2..50; at K = 1 diffusers' stretch divides 0 by 0 (a NaN sigma) and flowrl samples [1, 0]."""
        ours = adapter.schedule.sigmas(steps)
        if steps == 1:
            assert torch.isnan(sigmas[0]) and torch.equal(ours, torch.tensor([1.0, 0.0]))
            return
        assert torch.equal(ours, sigmas), (grid, steps)
        assert float(ours[-2]) == pytest.approx(0.02, abs=1e-6)

    def check_grid_extras(self, adapter, pipe, directory, grid):
        from flowrl.errors import FlowRLError

        assert self.load(sampling_grid="linspace").schedule.sigmas(4)[-2] > 0.02  # no stretch there
        with pytest.raises(FlowRLError, match="does not apply to qwen_image"):
            self.load(sampling_grid="flow_match")

    def check_grpo_run(self, trainer, worst):
        from flowrl.errors import FlowRLError

        # the last block's text-stream tail cannot reach the output: frozen, not carried through the optimizer
        frozen = [n for n, p in trainer.pipeline.denoiser.named_parameters() if not p.requires_grad]
        assert frozen and all(
            n.startswith("transformer_blocks.1.") and ("txt_mlp" in n or "added_q" in n or "add_q" in n or "to_add_out" in n)
            for n in frozen
        )
        with pytest.raises(FlowRLError, match="guidance-distilled"):
            trainer.pipeline.guidance_mode = "embedded"


class TestQwenImageEdit(QwenTester):
    """Qwen-Image-Edit: one source image a prompt, from a .jsonl prompt file (the sampler oracle is
    test_qwen_image_edit_matches_diffusers_pipeline_with_true_cfg below); the `flowrl export` checks are the
    text-to-image model's."""

    name, checkpoint, pipeline_class, prompt_file = "qwen_image_edit", "edit_dir", "QwenImageEditPipeline", "edit"
    load_options, lora_export = {"condition_area": CONDITION_AREA}, False
    test_sampler_equals_the_diffusers_pipeline = None
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None

    def config(self, **extra):
        return edit_config(self.directory, self.run_dir, self.name, self.fixture("sources")[self.prompt_file], **extra)

    def check_grpo_run(self, trainer, worst):
        """The stored condition carries the images' latents and the negative branch."""
        traj = trainer.collect(0)
        assert traj.cond["image_latents"].shape[1] == 36 and traj.cond["image_shapes"][0].tolist() == [[6, 6]]  # 96 x 96 sources
        assert not torch.equal(traj.cond["prompt_embeds"], traj.cond["negative_prompt_embeds"])


class TestQwenImageEditPlus(TestQwenImageEdit):
    """Qwen-Image-Edit-Plus: two source images a prompt, Edit-2511's zero_cond_t."""

    name, checkpoint, pipeline_class, prompt_file = "qwen_image_edit_plus", "edit_plus_dir", "QwenImageEditPlusPipeline", "plus"
    test_two_grpo_iterations = None


@pytest.mark.parametrize("plus", [False, True], ids=["edit", "edit_plus"])
def test_qwen_image_edit_matches_diffusers_pipeline_with_true_cfg(request, sources, monkeypatch, plus):
    """Oracle for both edit pipelines: the source images' resizing, the processor's inputs (vision tokens
    expanded, pixel values, grids), the edit templates with 64 dropped tokens, the VAE condition latents (mode,
    mean/std, packed after the generated tokens), img_shapes (and Edit-2511's zero_cond_t), true CFG with the
    same images and the norm rescale, as QwenImageEditPipeline / QwenImageEditPlusPipeline.__call__. The
    pipelines hard-code a 1024 x 1024 source area (a 7 s VAE encode per image on one CPU core): here their
    module's area is patched to CONDITION_AREA, which flowrl gets as pipeline.condition_area."""
    import PIL.Image
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    from flowrl.pipelines.flux import pack_latents, unpack_latents
    from flowrl.pipelines.qwen_image import QwenImageEditConfig, QwenImageEditPlusConfig, calculate_dimensions

    # flowrl's defaults are the pipelines' own areas, and its rounding their calculate_dimensions
    assert QwenImageEditConfig(pretrained="x").condition_area == pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE == 1024 * 1024
    assert QwenImageEditPlusConfig(pretrained="x").vlm_condition_area == pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE
    for ratio in (1.0, 1.5, 0.5625, 4 / 3):
        assert calculate_dimensions(1024 * 1024, ratio) == pipeline_qwenimage_edit.calculate_dimensions(1024 * 1024, ratio)[:2]
        assert calculate_dimensions(384 * 384, ratio) == pipeline_qwenimage_edit_plus.calculate_dimensions(384 * 384, ratio)
    if plus:
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", CONDITION_AREA)
        directory, name, cls = request.getfixturevalue("edit_plus_dir"), "qwen_image_edit_plus", QwenImageEditPlusPipeline
        paths = [sources["square_a"], sources["wide"]]
        metadata = [{"images": paths}]
    else:
        original = pipeline_qwenimage_edit.calculate_dimensions
        monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(CONDITION_AREA, ratio))
        directory, name, cls = request.getfixturevalue("edit_dir"), "qwen_image_edit", QwenImageEditPipeline
        paths = [sources["wide"]]
        metadata = [{"image": paths[0]}]
    adapter, pipe = load(name, directory, condition_area=CONDITION_AREA), load_diffusers(cls, directory)
    images = [PIL.Image.open(p).convert("RGB") for p in paths]
    prompt = ["make the cat red"]

    # the VLM sees what the pipeline's processor gives
    vlm_images, _, sizes = adapter._prepare_images(images)
    text = adapter._prompt_text(prompt[0], len(images))
    theirs_inputs = pipe.processor(text=[text], images=vlm_images, padding=True, return_tensors="pt")
    ours_inputs = adapter._vlm_inputs([text], [vlm_images])
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        assert torch.equal(ours_inputs[key], theirs_inputs[key]), key
    embeds, mask = pipe.encode_prompt(prompt, image=vlm_images if plus else vlm_images[0])
    cond = adapter.encode(prompt, metadata)
    length = embeds.shape[1]
    torch.testing.assert_close(cond["prompt_embeds"][:, :length], embeds, atol=1e-5, rtol=0)
    assert mask is None and cond["prompt_embeds_mask"].sum() == length
    expected_tokens = sum((h // 16) * (w // 16) for h, w in sizes)
    assert cond["image_latents"].shape == (1, expected_tokens, 16)

    steps, scale = 2, 4.0
    noise = adapter.initial_noise(1, torch.Generator().manual_seed(1))
    call = dict(
        image=images if plus else images[0],
        prompt=prompt,
        negative_prompt=" ",
        true_cfg_scale=scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
    )
    theirs = pipe(latents=pack_latents(noise), output_type="latent", **call).images
    assert torch.equal(pipe.scheduler.sigmas, adapter.schedule.sigmas(steps))
    ours = euler_final_latents(adapter, noise, steps, scale, prompt, metadata)
    diff = (ours - unpack_latents(theirs, 4, 4)).abs().max().item()
    print(f"{name} oracle ({len(images)} source images, true CFG {scale}, {steps} steps): max |flowrl - diffusers| = {diff:.2e}")
    assert diff < 1e-5
    torch.testing.assert_close(adapter.decode(ours), pipe(latents=pack_latents(noise), output_type="pt", **call).images, atol=1e-5, rtol=0)


def test_qwen_image_edit_refuses_what_it_cannot_batch(edit_dir, sources):
    """One sentence for a prompt without a source image and for a source of another aspect ratio than the run's;
    condition_aspect crops mixed sources to one geometry; where Edit-Plus reads its sources."""
    from flowrl.errors import FlowRLError

    adapter = load("qwen_image_edit", edit_dir, condition_area=CONDITION_AREA)
    with pytest.raises(FlowRLError, match="needs a source image per prompt"):
        adapter.encode(["make it red"], [{}])
    adapter.encode(["make it red"], [{"image": sources["square_a"]}])
    with pytest.raises(FlowRLError, match="condition_aspect"):
        adapter.encode(["make it red"], [{"image": sources["wide"]}])
    # centre-cropped to one aspect ratio, mixed sources share the geometry
    cropped = load("qwen_image_edit", edit_dir, condition_area=CONDITION_AREA, condition_aspect=1.0)
    cond = cropped.encode(["make it red", "add a hat"], [{"image": sources["square_a"]}, {"image": sources["wide"]}])
    assert cond["image_latents"].shape == (2, 36, 16) and cond["image_shapes"].tolist() == [[[6, 6]], [[6, 6]]]
    # Edit-Plus: the sources from metadata["images"], metadata["image"] or the keys pipeline.source_images names
    plus = load("qwen_image_edit_plus", edit_dir, condition_area=CONDITION_AREA, source_images=["front", "back"])
    meta = {"front": sources["square_a"], "back": sources["square_b"], "image": sources["wide"]}
    assert plus._source_images(meta) == [sources["square_a"], sources["square_b"]]
    plus.config.source_images = None
    assert plus._source_images(meta) == [sources["wide"]] and plus._source_images({"images": ["a", "b"]}) == ["a", "b"]
    with pytest.raises(FlowRLError, match="non-empty list"):
        plus._source_images({"images": "a.png"})


# -- presets -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["configs/qwen_image/grpo_pickscore.yaml", "configs/qwen_image/edit_plus_grpo_pickscore.yaml"])
def test_real_configs_validate(path):
    """The presets load and resolve without weights; the text-to-image one's bundled prompt files resolve (the edit
    one names the user's own .jsonl of instructions and source images)."""
    from flowrl.config import load_config
    from flowrl.prompts import prompt_pool

    config = load_config(Path(__file__).resolve().parents[1] / path, [])
    assert config.pipeline.dtype == "bfloat16" and config.train.mixed_precision == "bf16"
    assert config.pipeline.lora is not None and config.pipeline.gradient_checkpointing and config.pipeline.offload_frozen
    assert config.rollout.guidance_mode == "cfg" and config.rollout.guidance_scale == 4.0 and config.pipeline.negative_prompt == " "
    assert config.sampler.name == "flow_sde" and config.sampler.noise_level == 1.0 and config.rollout.num_inference_steps == 10
    assert (config.pipeline.lora.r, config.pipeline.lora.alpha, config.train.learning_rate) == (64, 128, 3e-4)
    if "edit" in path:
        assert config.pipeline.name == "qwen_image_edit_plus" and config.pipeline.condition_area == 384 * 384
        assert config.pipeline.condition_aspect == 1.0 and (config.pipeline.height, config.pipeline.width) == (384, 384)
        return
    pc = config.prompts
    assert len(prompt_pool(pc.dataset, pc.train_split, file=pc.train_file)) > 10
    assert len(prompt_pool(pc.dataset, pc.eval_split, pc.eval_size, file=pc.eval_file)) > 1
    assert config.pipeline.name == "qwen_image" and config.reward.components == {"clip_score": 1.0, "pickscore": 0.5}
    assert config.objective.per_reward_advantages
