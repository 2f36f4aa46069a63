"""The checks every model family's tests share, and (re-exported) the tiny builders of the real diffusers /
transformers classes, which live in the package (flowrl/pipelines/tiny/, ``flowrl tiny FAMILY OUT``).

Nothing here is a mock: each builder returns the real class at a tiny config, the family tests save it
with ``save_pretrained`` (a real diffusers pipeline directory with model_index.json) and load it back
through flowrl's own loading path (``pipeline.pretrained=<that directory>``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.pipelines.tiny.components import (  # noqa: F401 (re-exported: the family tests import them from here)
    CORPUS,
    flux_dynamic_scheduler,
    tiny_causal_vae,
    tiny_clip_text,
    tiny_flux_components,
    tiny_flux_transformer,
    tiny_flux_vae,
    tiny_t5,
    tiny_tokenizer,
    tiny_unet,
    tiny_vae,
)
from flowrl.pipelines.tiny.unet import build_tiny_sd, tiny_sd_pipeline  # noqa: F401

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
