"""FLUX.2-dev and FLUX.2-klein through flowrl: the real diffusers / transformers classes at tiny size (a 30-layer
Mistral3 and a 27-layer Qwen3 text encoder, so that the pipelines' default stacked layers exist), saved with
``save_pretrained`` and loaded through ``pipeline.pretrained=<dir>``; oracle checks against ``Flux2Pipeline`` and
``Flux2KleinPipeline``'s own ``__call__``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flowrl.pipelines.tiny.flux2 import build_tiny_flux2, chat_tokenizer, tiny_flux2_vae, tiny_mistral3, tiny_qwen3  # noqa: F401
from tests.family_tester import EmbeddedGuidanceTesterMixin, FamilyTesterMixin, Grid, flow_match, tiny_checkpoint, with_model_index
from tests.tiny_components import euler_final_latents, family_config

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a photo of a cat", "a dog"]  # FamilyTesterMixin.prompts
TOKENS = {"dev": 64, "klein": 32}  # pipeline.max_sequence_length of the tiny models
SIZE = 16  # pixels: latents (16, 4, 4) after the 2x2 patchify of a (4, 8, 8) VAE latent, 16 image tokens

dev_dir = tiny_checkpoint(build_tiny_flux2, "dev")
klein_dir = tiny_checkpoint(build_tiny_flux2, "klein")


def load(directory, variant: str = "dev", **kwargs):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    config = PipelineConfig(
        name="flux2", pretrained=str(directory), device="cpu", height=SIZE, width=SIZE, max_sequence_length=TOKENS[variant], **kwargs
    )
    return build_pipeline(config, "cpu")


def flux2_config(directory, output_dir, variant: str = "dev", **extra):
    guidance = {"rollout.guidance_mode": "embedded", "rollout.guidance_scale": 4.0} if variant == "dev" else {"rollout.guidance_scale": 4.0}
    return family_config(
        "flux2",
        directory,
        output_dir,
        **{"pipeline.max_sequence_length": TOKENS[variant], "pipeline.height": SIZE, "pipeline.width": SIZE, **guidance, **extra},
    )


def pipeline_call(pipe, noise: torch.Tensor, variant: str, output_type: str, guidance_scale: float, steps: int = 2):
    """The diffusers pipeline's own __call__ with its default grid, from flowrl's noise (its prepare_latents takes
    latents in flowrl's (B, 4C, h, w) layout and packs them)."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=PROMPTS,
        latents=noise.clone(),
        num_inference_steps=steps,
        height=SIZE,
        width=SIZE,
        guidance_scale=guidance_scale,
        output_type=output_type,
        max_sequence_length=TOKENS[variant],
    ).images


# -- oracles against the diffusers pipelines ----------------------------------------------------------


class Flux2Tester(FamilyTesterMixin):
    """What FLUX.2-dev and FLUX.2-klein share: the chat-template text encoder's stacked layers, 2x2-patchified
    latents, the empirical-mu grid, the FLUX.2 VAE's batch-norm denormalisation."""

    name, variant, lora_guidance_scale, frozen_modules = "flux2", "dev", 4.0, 2
    oracle_decode_atol = 1e-5
    test_two_adjoint_matching_iterations = None
    test_two_diffusion_nft_iterations = None
    test_loads_through_flowrl_and_samples = None

    def config(self, **extra):
        return flux2_config(self.directory, self.run_dir, self.variant, **extra)

    def load(self, directory=None, **options):
        return load(directory or self.directory, self.variant, **options)

    def pipeline_call(self, pipe, noise, steps, scale, output_type, case):
        return pipeline_call(pipe, noise, self.variant, output_type, scale, steps)


class TestFlux2Dev(EmbeddedGuidanceTesterMixin, Flux2Tester):
    """FLUX.2-dev: Mistral3 layers (10, 20, 30), the guidance embedding, packed (B, tokens, 16) latents."""

    checkpoint, pipeline_class = "dev_dir", "Flux2Pipeline"
    grids = {"dynamic": Grid(), "static": Grid(flow_match(shift=3.0))}
    guidance_embedder, embedded_guidance_scale = "time_guidance_embed.guidance_embedder", 4.0

    @pytest.mark.slow  # over 5 s a grid: FLUX.2's pipeline call is the slowest of the families'
    def test_default_grid_is_the_pipelines_for_k_1_to_50(self, grid):
        super().test_default_grid_is_the_pipelines_for_k_1_to_50(grid)

    def check_conditioning(self, adapter, pipe, case):
        """Chat template + stacked layers (10, 20, 30), 4-D ids, as Flux2Pipeline.encode_prompt."""
        assert adapter.variant == "dev" and adapter.guidance_mode == "embedded" and adapter.lora_pipeline_class == "Flux2Pipeline"
        assert adapter.out_layers == (10, 20, 30) and adapter.latent_shape() == (16, 4, 4)
        embeds, ids = pipe.encode_prompt(PROMPTS, max_sequence_length=TOKENS["dev"])
        cond = adapter.encode(PROMPTS)
        assert embeds.shape == (2, TOKENS["dev"], 48) and torch.equal(ids[0], adapter.txt_ids)
        torch.testing.assert_close(cond["prompt_embeds"], embeds, atol=1e-6, rtol=0)
        assert (cond["prompt_embeds"][0] - cond["prompt_embeds"][1]).abs().max() > 1e-3, "the prompt was truncated away"

    def pipeline_latents(self, adapter, ours):
        from flowrl.pipelines.flux2 import pack_latents

        return pack_latents(ours)  # the pipeline returns packed (B, tokens, 16) latents

    def check_oracle(self, adapter, pipe, noise, ours, case):
        assert (ours - noise).abs().max() > 0.1 and adapter.decode(ours).shape == (2, 3, SIZE, SIZE)

    def grid_call_arguments(self, adapter, pipe):
        embeds = adapter.encode(["a cat"])["prompt_embeds"]  # the grid does not depend on the text: skip the encoder
        return {"prompt_embeds": embeds, "height": SIZE, "width": SIZE, "guidance_scale": 4.0}

    def check_grid(self, adapter, grid):
        """The empirical mu changes with K: the dynamically shifting config, and a static shift 3 (mu ignored)."""
        assert adapter.schedule.grid == "flux" and adapter.schedule.dynamic == (grid == "dynamic")

    def check_grid_extras(self, adapter, pipe, directory, grid):
        """The flow_shift override gives a static shift on the same grid; another family's grid is refused."""
        from flowrl.errors import FlowRLError
        from flowrl.samplers.schedules import FlowSchedule

        shifted = self.load(flow_shift=2.0)
        assert not shifted.schedule.dynamic and torch.equal(shifted.schedule.sigmas(4), FlowSchedule(2.0, "flux").sigmas(4))
        with pytest.raises(FlowRLError, match="sampling_grid 'leading' does not apply to flux2"):
            self.load(sampling_grid="leading")


class TestFlux2Klein(Flux2Tester):
    """FLUX.2-klein base: Qwen3 layers (9, 18, 27) with thinking off, no guidance input, true CFG against the encoded
    empty prompt; LoRA under true CFG."""

    variant, checkpoint, pipeline_class = "klein", "klein_dir", "Flux2KleinPipeline"
    test_default_grid_is_the_pipelines_for_k_1_to_50 = None
    test_two_grpo_iterations = None

    @pytest.mark.slow  # about 4 s with the 27-layer text encoder
    def test_sampler_equals_the_diffusers_pipeline(self, oracle_case):
        super().test_sampler_equals_the_diffusers_pipeline(oracle_case)

    def check_conditioning(self, adapter, pipe, case):
        assert adapter.variant == "klein" and not adapter.step_distilled and adapter.guidance_mode == "cfg"
        assert adapter.out_layers == (9, 18, 27) and not adapter.guidance_embeds and adapter.lora_pipeline_class == "Flux2KleinPipeline"
        embeds, _ = pipe.encode_prompt(PROMPTS, max_sequence_length=TOKENS["klein"])
        empty, _ = pipe.encode_prompt("", max_sequence_length=TOKENS["klein"])
        torch.testing.assert_close(adapter.encode(PROMPTS)["prompt_embeds"], embeds, atol=1e-6, rtol=0)
        torch.testing.assert_close(adapter.unconditional(1)["prompt_embeds"], empty, atol=1e-6, rtol=0)

    def pipeline_latents(self, adapter, ours):
        return adapter.denormalize(ours)  # klein returns the VAE's latents (B, 4, 8, 8)

    def check_oracle(self, adapter, pipe, noise, ours, case):
        unguided = euler_final_latents(adapter, noise, self.oracle_steps, 1.0, PROMPTS)
        assert (unguided - ours).abs().max() > 1e-3, "the CFG branch changed nothing"


def test_klein_distilled_runs_without_guidance(klein_dir, tmp_path):
    """is_distilled: the pipeline ignores guidance_scale (its output at 4.0 is flowrl's at 1); flowrl refuses a
    scale other than 1 and the embedded mode, each in one sentence."""
    from diffusers import Flux2KleinPipeline

    from flowrl.errors import FlowRLError

    directory = with_model_index(klein_dir, tmp_path, is_distilled=True)
    adapter, pipe = load(directory, "klein"), Flux2KleinPipeline.from_pretrained(directory)
    assert adapter.step_distilled and pipe.config.is_distilled
    noise = adapter.initial_noise(2, torch.Generator().manual_seed(2))
    theirs = pipeline_call(pipe, noise, "klein", "latent", 4.0)
    torch.testing.assert_close(adapter.denormalize(euler_final_latents(adapter, noise, 2, 1.0, PROMPTS)), theirs, atol=1e-5, rtol=0)
    with pytest.raises(FlowRLError, match="step-distilled .* set rollout.guidance_scale to 1"):
        euler_final_latents(adapter, noise, 2, 4.0, PROMPTS)
    with pytest.raises(FlowRLError, match="does not use"):
        adapter.guidance_mode = "embedded"
    # a pipeline given in memory (flowrl.Trainer(pipeline=...)) is told apart by its class and config alike
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    given = build_pipeline(PipelineConfig(name="flux2", device="cpu", height=SIZE, width=SIZE), "cpu", loaded=pipe)
    assert given.variant == "klein" and given.step_distilled and given.text_encoder is pipe.text_encoder


@pytest.mark.parametrize("image_seq_len", [16, 1024, 4096, 4301, 16384])
def test_empirical_mu_grid_equals_the_scheduler_at_real_sizes(image_seq_len):
    """Both branches of the empirical mu (step-dependent up to 4300 tokens, linear in the size above) at real sizes
    (1024 tokens = 512x512, 4096 = 1024x1024, 16384 = 2048x2048): Flux2Schedule equals the scheduler set up as the
    pipelines do it, with diffusers' own compute_empirical_mu."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from flowrl.pipelines.flux2 import Flux2Schedule, empirical_mu

    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    ours = Flux2Schedule(grid="flux", dynamic=True, image_seq_len=image_seq_len)
    for steps in (1, 4, 8, 28, 50):
        assert empirical_mu(image_seq_len, steps) == compute_empirical_mu(image_seq_len, steps)
        scheduler.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(image_seq_len, steps))
        assert torch.equal(ours.sigmas(steps), scheduler.sigmas), (image_seq_len, steps)


# -- guidance ------------------------------------------------------------------------------------------


def test_other_pipelines_and_short_text_encoders_are_refused(dev_dir, klein_dir, tmp_path):
    from flowrl.errors import FlowRLError

    with pytest.raises(FlowRLError, match="is a FluxPipeline checkpoint; pipeline.name=flux2 reads Flux2Pipeline"):
        load(with_model_index(dev_dir, tmp_path, _class_name="FluxPipeline"))
    short = tmp_path / "short"
    shutil.copytree(klein_dir, short)
    tiny_qwen3(layers=20).save_pretrained(short / "text_encoder")
    with pytest.raises(FlowRLError, match=r"has 20 layers, but FLUX.2 stacks the hidden states of layers \(9, 18, 27\)"):
        load(short, "klein")


# -- training --------------------------------------------------------------------------------------------


def test_dev_lora_targets_and_diffusers_load_lora_weights(dev_dir, tmp_path):
    """The default targets cover the double blocks' image and text attention and the single blocks' fused
    projections (each by its full name); Flux2Pipeline.load_lora_weights loads every tensor of the saved file."""
    from diffusers import Flux2Pipeline
    from peft.utils import get_peft_model_state_dict

    adapter = load(dev_dir, lora={"r": 4, "alpha": 8})
    targets = set(adapter.default_lora_targets)
    assert "single_transformer_blocks.0.attn.to_out" in targets and "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in targets
    assert "transformer_blocks.0.attn.add_q_proj" in targets and len(targets) == 8 + 2
    lora = {n.rsplit(".lora_", 1)[0] for n, p in adapter.denoiser.named_parameters() if p.requires_grad}
    assert lora == targets
    with torch.no_grad():
        for p in adapter.trainable_parameters():
            p.normal_(0, 0.1)  # peft's B starts at zero: give the file something to carry
    adapter.save_lora(tmp_path / "lora")
    pipe = Flux2Pipeline.from_pretrained(dev_dir)
    pipe.load_lora_weights(tmp_path / "lora")
    theirs = get_peft_model_state_dict(pipe.transformer, adapter_name=next(iter(pipe.transformer.peft_config)))
    ours = get_peft_model_state_dict(adapter.denoiser)
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k].float(), v) for k, v in ours.items())


# -- presets ---------------------------------------------------------------------------------------------

PRESETS = [
    "configs/flux2/grpo_dev_clip_pickscore.yaml",
    "configs/flux2/grpo_klein_base_pickscore.yaml",
    "configs/flux2/grpo_klein_pickscore.yaml",
]


@pytest.mark.parametrize("path", PRESETS)
def test_presets_validate(path):
    from flowrl.config import load_config
    from flowrl.prompts import prompt_pool

    config = load_config(Path(__file__).resolve().parents[1] / path, [])
    pc = config.prompts
    assert len(prompt_pool(pc.dataset, pc.train_split, file=pc.train_file)) > 10
    assert len(prompt_pool(pc.dataset, pc.eval_split, pc.eval_size, file=pc.eval_file)) > 1
    assert config.pipeline.name == "flux2" and config.pipeline.dtype == "bfloat16" and config.train.mixed_precision == "bf16"
    assert config.pipeline.lora is not None and config.pipeline.lora.r == 64 and config.pipeline.gradient_checkpointing
    assert config.sampler.name == "flow_sde" and config.train.learning_rate == 3e-4 and config.objective.clip_range == 1e-4
    if "dev" in path:  # guidance-distilled: the scale is the embedding's input
        assert config.rollout.guidance_mode == "embedded" and config.rollout.guidance_scale == 4.0
        assert config.reward.components == {"clip_score": 1.0, "pickscore": 0.5}
    elif "base" in path:  # true CFG
        assert config.rollout.guidance_mode == "cfg" and config.rollout.guidance_scale == 4.0
    else:  # step-distilled: no guidance, 4 steps
        assert config.rollout.guidance_scale == 1.0 and config.rollout.num_inference_steps == 4
