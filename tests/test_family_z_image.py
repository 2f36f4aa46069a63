"""Z-Image / Z-Image-Turbo through flowrl: the real diffusers/transformers classes at tiny size (ZImageTransformer2DModel,
Qwen3Model with a chat-template tokenizer, AutoencoderKL), saved with ``save_pretrained`` and loaded through
``pipeline.pretrained=<dir>``; oracle checks against ``ZImagePipeline.__call__``."""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch

from flowrl.pipelines.tiny.z_image import CHAT_TEMPLATE, build_tiny_z_image, qwen_tokenizer  # noqa: F401
from tests.family_tester import FamilyTesterMixin, Grid, flow_match, tiny_checkpoint
from tests.tiny_components import family_config, ode_sample

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = 48  # pipeline.max_sequence_length of the tiny model
# captions of different lengths: 26 real tokens (one 32-token block) and 48 (two blocks), so the two images' RoPE
# positions differ and the transformer's batch needs its attention mask, as with real prompts
PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon with a red apple on a wooden table and a city at night"]
z_dir = tiny_checkpoint(build_tiny_z_image)


def load(directory, **kwargs):
    from flowrl.pipelines import build_pipeline
    from flowrl.pipelines.z_image import ZImageConfig

    options = {"height": 16, "width": 16, "max_sequence_length": TOKENS, **kwargs}
    return build_pipeline(ZImageConfig(pretrained=str(directory), device="cpu", **options), "cpu")


def z_config(directory, output_dir, **extra):
    return family_config(
        "z_image",
        directory,
        output_dir,
        **{"pipeline.max_sequence_length": TOKENS, "pipeline.height": 16, "pipeline.width": 16, **extra},
    )


class TestZImage(FamilyTesterMixin):
    """Z-Image(-Turbo): chat-template Qwen3 encoding with per-caption masks, 1 - sigma timesteps, negated outputs,
    the pipeline's CFG ``c + s (c - u)`` against a negative prompt (flowrl's scale s + 1)."""

    name, checkpoint, pipeline_class, prompts = "z_image", "z_dir", "ZImagePipeline", tuple(PROMPTS)
    grpo_overrides = {"rollout.guidance_scale": 5.0}  # the base model's recipe: true CFG (diffusers' 4.0 = flowrl's 5.0)
    # no CFG: the same float32 operations in the same order (0.0 measured); CFG: flowrl writes u + w (c - u) on the
    # negated outputs where diffusers writes c + s (c - u) before negating, a float32 rounding apart (1.6e-6 measured)
    oracle_cases = {
        "turbo_no_cfg": {"guidance_scale": 0.0, "negative": None, "bound": (operator.le, 0.0)},
        "base_cfg4_negative": {"guidance_scale": 4.0, "negative": "blurry, low quality", "bound": (operator.le, 1e-5)},
    }
    oracle_steps, oracle_decode_atol, frozen_modules = 3, 1e-4, 2
    grids = {
        "turbo_shift3": Grid(),
        "dynamic": Grid(flow_match(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)),
    }
    grid_call = {"prompt": "a cat", "height": 16, "width": 16, "guidance_scale": 0.0, "max_sequence_length": TOKENS}
    test_two_adjoint_matching_iterations = None
    test_two_diffusion_nft_iterations = None
    test_loads_through_flowrl_and_samples = None

    def config(self, **extra):
        return z_config(self.directory, self.run_dir, **extra)

    def load(self, directory=None, **options):
        return load(directory or self.directory, **options)

    def oracle_adapter(self, case):
        return self.load(negative_prompt=case["negative"] or "")

    def negatives(self, case):
        return None if case["negative"] is None else [case["negative"]] * 2

    def check_conditioning(self, adapter, pipe, case):
        """Each caption is its real tokens only, as the pipeline's list; the unconditional branch the negative's."""
        assert adapter.latent_shape() == (4, 8, 8) and adapter.schedule.shift == 3.0 and not adapter.schedule.dynamic
        with torch.no_grad():
            embeds, negatives = pipe.encode_prompt(
                list(PROMPTS), do_classifier_free_guidance=True, negative_prompt=self.negatives(case), max_sequence_length=TOKENS
            )
        cond, uncond = adapter.encode(PROMPTS), adapter.unconditional(2)
        assert cond["prompt_mask"].sum(1).tolist() == [26, 48] == [len(e) for e in embeds]
        for i in range(2):
            torch.testing.assert_close(cond["prompt_embeds"][i][cond["prompt_mask"][i]], embeds[i], atol=1e-6, rtol=0)
            torch.testing.assert_close(uncond["prompt_embeds"][i][uncond["prompt_mask"][i]], negatives[i], atol=1e-6, rtol=0)

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        # ZImagePipeline writes the chat-templated texts back into the lists it is given: fresh lists per call
        call = {"num_inference_steps": steps, "height": 16, "width": 16, "guidance_scale": scale, "max_sequence_length": TOKENS}
        return pipe(
            prompt=list(PROMPTS), negative_prompt=self.negatives(case), latents=noise.clone(), output_type=output_type, **call
        ).images

    def flowrl_guidance(self, scale):
        return scale + 1.0

    def check_grid(self, adapter, grid):
        """ZImagePipeline's float32 torch.linspace(1, 1/K, K), shifted by the static shift 3 (Z-Image-Turbo's config)
        or by exp(mu) of the image token count (a dynamic config, mu = 0.50 at 16 tokens)."""
        assert adapter.schedule.grid == "flux" and adapter.schedule.dynamic == (grid == "dynamic")

    def check_grid_extras(self, adapter, pipe, directory, grid):
        """FLUX's numpy line differs from it for most K, so sampling_grid=flux (FLUX's grid) stays a different,
        selectable grid; another family's is refused."""
        from flowrl.errors import FlowRLError

        flux = load(directory, sampling_grid="flux")
        assert type(flux.schedule).__name__ == "FlowSchedule"
        assert sum(not torch.equal(flux.schedule.sigmas(k), adapter.schedule.sigmas(k)) for k in range(1, 51)) > 30
        with pytest.raises(FlowRLError, match="sampling_grid 'leading' does not apply to z_image"):
            load(directory, sampling_grid="leading")


def test_guidance_turbo_one_forward_base_cfg_two_branches_embedded_refused(z_dir, tmp_path):
    """Turbo (scale 1): one single-batch forward per step; CFG: one forward of both branches, whose unconditional half
    is the negative prompt; 'embedded' (a guidance input) is refused: Z-Image has no guidance embedding."""
    from flowrl.config import load_config
    from flowrl.errors import FlowRLError
    from flowrl.trainer import Trainer

    adapter = load(z_dir, negative_prompt="blurry")
    calls = []
    hook = adapter.denoiser.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    try:
        ode_sample(adapter, PROMPTS, steps=3, guidance_scale=1.0)
        assert calls == [2, 2, 2]
        calls.clear()
        ode_sample(adapter, PROMPTS, steps=3, guidance_scale=5.0)
        assert calls == [4, 4, 4]
    finally:
        hook.remove()
    x, sigma, cond = adapter.initial_noise(2, torch.Generator().manual_seed(0)), torch.tensor(0.6), adapter.encode(PROMPTS)
    with torch.no_grad():  # the guided prediction is u + 5 (c - u) with u the negative prompt's
        c, u = adapter.predict(x, sigma, cond, 1.0), adapter.predict(x, sigma, adapter.encode(["blurry"] * 2), 1.0)
        torch.testing.assert_close(adapter.predict(x, sigma, cond, 5.0), u + 5.0 * (c - u), atol=1e-5, rtol=0)
    with pytest.raises(FlowRLError, match="Z-Image has none"):
        adapter.guidance_mode = "embedded"
    from types import SimpleNamespace

    from flowrl.training.distributed import choose_blocks_to_wrap

    plugin = SimpleNamespace(transformer_cls_names_to_wrap=None)  # FSDP's units (docs/distributed.md): every block
    assert choose_blocks_to_wrap(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), adapter.denoiser) == ["ZImageTransformerBlock"]
    with pytest.raises(FlowRLError, match="guidance embedding"):
        Trainer(load_config(None, z_config(z_dir, tmp_path / "run", **{"rollout.guidance_mode": "embedded"})))


def test_preset_validates():
    from flowrl.config import load_config
    from flowrl.prompts import prompt_pool

    for name, scale, steps in (("grpo_pickscore_turbo.yaml", 1.0, 6), ("grpo_pickscore.yaml", 5.0, 10)):
        config = load_config(Path(__file__).resolve().parents[1] / "configs" / "z_image" / name, [])
        pc = config.prompts
        assert len(prompt_pool(pc.dataset, pc.train_split, file=pc.train_file)) > 10
        assert len(prompt_pool(pc.dataset, pc.eval_split, pc.eval_size, file=pc.eval_file)) > 1
        assert config.pipeline.name == "z_image" and config.pipeline.dtype == "bfloat16" and config.train.mixed_precision == "bf16"
        assert config.pipeline.lora is not None and config.pipeline.lora.r == 64 and config.pipeline.gradient_checkpointing
        assert config.rollout.guidance_scale == scale and config.rollout.num_inference_steps == steps
        assert config.rollout.guidance_mode == "cfg" and config.reward.components == {"pickscore": 1.0}
