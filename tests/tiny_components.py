"""Tiny, seeded instances of the real diffusers / transformers classes (the way diffusers' own tests
build dummy components), and the checks every model family must pass.

Nothing here is a mock: each builder returns the real class at a tiny config, the family tests save it
with ``save_pretrained`` (a real diffusers pipeline directory with model_index.json) and load it back
through flowrl's own loading path (``pipeline.pretrained=<that directory>``).
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "a photo of a cat",
    "a painting of a dog sitting on a bench",
    "an astronaut riding a horse on the moon",
    "the digit seven",
    "a red apple on a wooden table",
    "a city at night with neon lights",
    "",
    "a small boat moving left across a lake",
    "a bird flying up into the sky",
    "one two three four five six",
]


def tiny_tokenizer(max_length: int = 16):
    """A real byte-pair ``PreTrainedTokenizerFast`` trained in-process on a tiny corpus (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    tok.train_from_iterator(
        CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    bos, eos = tok.token_to_id("[BOS]"), tok.token_to_id("[EOS]")
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]", special_tokens=[("[BOS]", bos), ("[EOS]", eos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]", model_max_length=max_length
    )


def tiny_clip_text(hidden: int = 32, projection: bool = False, seed: int = 0, vocab_size: int = 512):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        hidden_size=hidden,
        intermediate_size=37,
        layer_norm_eps=1e-5,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        projection_dim=hidden,
        max_position_embeddings=64,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def tiny_t5(d_model: int = 32, seed: int = 0, umt5: bool = False, vocab_size: int = 512):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**kwargs)).eval()
    return T5EncoderModel(T5Config(**kwargs)).eval()


def tiny_vae(latent_channels: int = 4, seed: int = 0, **kwargs):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        block_out_channels=[8, 16],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        **kwargs,
    ).eval()


def tiny_causal_vae(cls_name: str = "AutoencoderKLWan", base_dim: int = 4, dim_mult=(1, 1, 1, 1)):
    """A causal 3-D VAE of Wan's design (``AutoencoderKLWan``; Qwen-Image's ``AutoencoderKLQwenImage`` is one too) at
    tiny size: 4 latent channels with a non-trivial latents_mean / latents_std, so the normalisation is exercised."""
    import diffusers

    torch.manual_seed(0)
    return getattr(diffusers, cls_name)(
        base_dim=base_dim,
        z_dim=4,
        dim_mult=list(dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    ).eval()


def tiny_flux_vae():
    """The 4-channel VAE of the FLUX-shaped tiny models (FLUX.1, Kontext, Z-Image): FLUX's scaling and shift factors."""
    return tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)


def tiny_unet(**kwargs):
    """A seeded UNet2DConditionModel at tiny size (two blocks of 8 and 16 channels, 4 latent channels); ``kwargs``:
    the family's block types and conditioning."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4, norm_num_groups=4, **kwargs
    )


def tiny_flux_transformer(guidance_embeds: bool = True):
    """FLUX.1-shaped: one double- and one single-stream block, a guidance embedding (dev, Kontext) or not (schnell)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
        guidance_embeds=guidance_embeds,
    )


def tiny_flux_components(guidance_embeds: bool = True) -> dict:
    """The components of a FLUX.1-shaped pipeline (FluxPipeline, FluxKontextPipeline): the transformer, FLUX.1-dev's
    dynamic scheduler, the FLUX VAE, CLIP and T5 with their tokenizers."""
    return dict(
        transformer=tiny_flux_transformer(guidance_embeds),
        scheduler=flux_dynamic_scheduler(),
        vae=tiny_flux_vae(),
        text_encoder=tiny_clip_text(seed=1),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_t5(d_model=32),
        tokenizer_2=tiny_tokenizer(),
    )


def flux_dynamic_scheduler():
    """FLUX.1-dev's FlowMatchEulerDiscreteScheduler config: shift from the image token count (mu)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )


# -- the checks every family runs ---------------------------------------------------------------------


def family_config(name: str, pretrained: Path, output_dir: Path, sampler: str = "flow_sde", **extra) -> list[str]:
    """Overrides for two fast GRPO iterations of a tiny family model on the CPU."""
    base = {
        "pipeline.name": name,
        "pipeline.pretrained": str(pretrained),
        "pipeline.device": "cpu",
        "sampler.name": sampler,
        "output_dir": str(output_dir),
        "reward.components": "{ink: 1.0}",
        "train.iterations": 2,
        "train.prompts_per_iteration": 2,
        "train.num_generations": 2,
        "train.batch_size": 4,
        "train.learning_rate": 1e-3,
        "objective.name": "grpo",
        "objective.clip_range": 10.0,
        "rollout.num_inference_steps": 3,
        "rollout.batch_size": 4,
        "eval.every": 0,
        "eval.samples_per_prompt": 1,
        "prompts.dataset": "digits",
        "log.checkpoint_every": 0,
        "log.progress": False,
        "log.grid_prompts": 2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def replace_overrides(overrides: list[str], prefixes: tuple[str, ...], new: list[str]) -> list[str]:
    """``overrides`` without the keys starting with ``prefixes``, then ``new``: a family's GRPO test run turned
    into another objective's."""
    return [o for o in overrides if not o.startswith(prefixes)] + new


def as_adjoint_matching(overrides: list[str], flow: bool = True, guidance_mode: str = "cfg_rollout_only") -> list[str]:
    """A family's GRPO test overrides turned into Adjoint Matching: the memoryless sampler of its kind
    (flow_memoryless; DDIM with eta = 1 for DDPM models), the differentiable ink reward through the VAE
    decoder, every step trained, and by default guided rollouts with an unguided control (the authors' CFG
    recipe)."""
    sampler = ["sampler.name=flow_memoryless"] if flow else ["sampler.name=ddim", "sampler.eta=1.0"]
    return replace_overrides(
        overrides,
        ("objective.", "sampler.", "reward.components=", "rollout.guidance_mode="),
        sampler
        + [
            "objective.name=adjoint_matching",
            "objective.reward_multiplier=10.0",
            "objective.num_trained_steps=null",
            "reward.components={ink: 1.0}",
            f"rollout.guidance_mode={guidance_mode}",
        ],
    )


def as_diffusion_nft(overrides: list[str], guidance_scale: float = 1.0) -> list[str]:
    """A family's GRPO test overrides turned into DiffusionNFT: deterministic ODE rollouts (no log-probs), CFG-free."""
    return replace_overrides(
        overrides,
        ("objective.", "sampler.", "rollout.guidance_scale=", "rollout.same_noise_in_group="),
        [
            "sampler.name=ode",
            "objective.name=diffusion_nft",
            f"rollout.guidance_scale={guidance_scale}",
            "rollout.same_noise_in_group=false",
        ],
    )  # deterministic rollouts from one noise would all be the same sample


def two_iterations_change_every_parameter(overrides: list[str], config: Path | None = None):
    """Run two real training iterations (``config`` file, then ``overrides``; GRPO unless they name another
    objective); assert every trainable tensor moved. Returns the trainer."""
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)  # tests build trainers with different mixed_precision in one process
    trainer = Trainer(load_config(config, overrides))
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert before, "nothing is trainable"
    trainer.fit()
    after = dict(trainer.module.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"{len(unchanged)} of {len(before)} trainable tensors did not change, e.g. {unchanged[:3]}"
    return trainer


def euler_final_latents(adapter, noise: torch.Tensor, steps: int, guidance_scale: float, prompts, metadata=None) -> torch.Tensor:
    """flowrl's rollout with the Euler (noise_level=0) step from given noise: the final latents (the families'
    oracle against a diffusers pipeline's own FlowMatchEuler loop)."""
    from flowrl.samplers import FlowSDEConfig
    from flowrl.samplers.rollout import rollout

    traj = rollout(
        adapter,
        FlowSDEConfig(noise_level=0.0).build(),
        prompts,
        metadata or [{} for _ in prompts],
        torch.arange(len(prompts)),
        adapter.schedule.sigmas(steps),
        torch.Generator().manual_seed(0),
        guidance_scale,
        stochastic_steps=torch.zeros(steps, dtype=torch.bool),
        initial_noise=noise,
        decode=False,
    )
    return traj.latents[:, -1]


def rescoring_ratio_is_one(trainer, atol: float = 1e-5) -> float:
    """Roll out, then re-score every stochastic step at unchanged weights: log-ratio must be 0."""
    traj = trainer.collect(0)
    worst = 0.0
    with torch.no_grad():
        for k in torch.nonzero(traj.stochastic).flatten().tolist():
            out = trainer.pipeline.predict(traj.latents[:, k], traj.sigmas[k], traj.cond, traj.guidance_scale)
            step = trainer.sampler.step(out, traj.latents[:, k], traj.sigmas[k], traj.sigmas[k + 1], x_next=traj.latents[:, k + 1])
            worst = max(worst, float((step.log_prob - traj.log_probs[:, k]).abs().max()))
    assert worst <= atol, f"re-scoring at unchanged weights gave |log ratio| up to {worst}"
    return worst


def rescoring_in_minibatches_ratio_is_one(pipeline, sampler, traj, splits=((3, 5), (1, 7)), atol: float = 1e-5) -> None:
    """Re-score a stored rollout at unchanged weights in minibatches of other sizes than the rollout's
    (batch-size-dependent kernels are a known cause of r != 1): every stochastic step's ratio is 1."""
    for split in splits:
        start = 0
        for size in split:
            part = traj[torch.arange(start, start + size)]
            start += size
            for k in torch.nonzero(part.stochastic).flatten().tolist():
                with torch.no_grad():
                    out = pipeline.predict(part.latents[:, k], part.sigmas[k], part.cond, part.guidance_scale)
                    new = sampler.step(out, part.latents[:, k], part.sigmas[k], part.sigmas[k + 1], x_next=part.latents[:, k + 1])
                # float32 resolves a log-prob of magnitude L only to ~L * 1.2e-7, and a summed (reduction="sum")
                # log-prob is ~50-80 here: re-scoring in another batch size moves it by a few ULPs (up to 2.3e-5
                # measured on an AMD EPYC), so the tolerance grows with |log p|; a mean-reduced one stays at atol.
                tol = atol + 1e-6 * part.log_probs[:, k].abs()
                assert ((new.log_prob - part.log_probs[:, k]).abs() <= tol).all(), (k, torch.exp(new.log_prob - part.log_probs[:, k]))


def ode_sample(pipeline, prompts: list[str], seed: int = 0, steps: int = 3, guidance_scale: float = 1.0, metadata=None) -> torch.Tensor:
    """Deterministic samples (the evaluation sampler) from a fixed seed, with the prompts' ``metadata`` (a source
    image, a first frame) where the family reads one."""
    from flowrl.config import ODEConfig
    from flowrl.samplers import build_sampler
    from flowrl.samplers.rollout import rollout

    gen = torch.Generator().manual_seed(seed)
    sampler = build_sampler(ODEConfig(), pipeline)
    traj = rollout(
        pipeline,
        sampler,
        prompts,
        metadata or [{} for _ in prompts],
        torch.arange(len(prompts)),
        pipeline.schedule.sigmas(steps).to(pipeline.device),
        gen,
        guidance_scale,
        same_noise_in_group=False,
    )
    return traj.samples


def tiny_sd_pipeline(prediction_type: str = "epsilon"):
    """A tiny Stable Diffusion pipeline of the real diffusers classes (UNet, VAE, CLIP text encoder), in memory."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    unet = tiny_unet(
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=prediction_type,
    )
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=tiny_clip_text(),
        tokenizer=tiny_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return pipe


def build_tiny_sd(directory, prediction_type: str = "epsilon"):
    """:func:`tiny_sd_pipeline` saved with ``save_pretrained`` (a real pipeline directory with model_index.json)."""
    tiny_sd_pipeline(prediction_type).save_pretrained(directory)
    return directory
