"""LoRA on the embedded models (digits image and video), through the same adapter base as the hub families:
only the adapters train, checkpoints carry the diffusers LoRA file, and that file loaded into a fresh base
denoiser with diffusers' own LoRA loaders reproduces the trained model, as does `flowrl export`.

Before the embedded adapters shared DiffusersAdapter, ``pipeline.lora`` on the digits model was ignored
(all 791,233 UNet parameters trained) and a LoRA digits_video run crashed at its first checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import ode_sample, rescoring_ratio_is_one, two_iterations_change_every_parameter

from flowrl.config import PipelineConfig
from flowrl.pipelines import build_pipeline

CASES = {
    "digits": (CONFIGS / "digits" / "grpo.yaml", "digits_flow", ["draw the digit 3", "a 7"]),
    "digits_video": (CONFIGS / "digits_video" / "grpo.yaml", "digits_video", ["digit 3 going up", "a five moves left"]),
}


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.slow
def test_lora_run_round_trips_through_diffusers(family, tmp_path, one_thread):
    from diffusers import CogVideoXPipeline, CogVideoXTransformer3DModel, StableDiffusionPipeline, UNet2DConditionModel

    from flowrl.cli import main

    config, pretrained, prompts = CASES[family]
    trainer = two_iterations_change_every_parameter(
        fast_overrides(tmp_path / "run", **{"pipeline.lora": "{r: 4, alpha: 8}", "train.learning_rate": 1e-2, "log.checkpoint_every": 2}),
        config,
    )
    pipe = trainer.pipeline
    trained = [n for n, p in pipe.denoiser.named_parameters() if p.requires_grad]
    assert trained and all("lora" in n for n in trained)
    assert sum(p.numel() for p in pipe.trainable_parameters()) < 0.05 * sum(p.numel() for p in pipe.denoiser.parameters())
    rescoring_ratio_is_one(trainer)
    ours = ode_sample(pipe, prompts, seed=3)
    base = build_pipeline(PipelineConfig(name=family, pretrained=pretrained), "cpu")
    assert (ode_sample(base, prompts, seed=3) - ours).abs().max() > 1e-3, "the LoRA did not change the samples"

    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    # The user's path, nothing of flowrl: a fresh base denoiser + the LoRA file through diffusers' loaders
    # (the family's pipeline class reads the file and its metadata, e.g. lora_alpha, as load_lora_weights does).
    lora_file = str(checkpoint / "pytorch_lora_weights.safetensors")
    if family == "digits":
        denoiser = UNet2DConditionModel.from_pretrained(base.source, subfolder="unet")
        state, alphas, metadata = StableDiffusionPipeline.lora_state_dict(lora_file, return_lora_metadata=True)
        StableDiffusionPipeline.load_lora_into_unet(state, alphas, unet=denoiser, metadata=metadata)
    else:
        denoiser = CogVideoXTransformer3DModel.from_pretrained(base.source, subfolder="transformer")
        state, metadata = CogVideoXPipeline.lora_state_dict(lora_file, return_lora_metadata=True)
        CogVideoXPipeline.load_lora_into_transformer(state, transformer=denoiser, metadata=metadata)
    base.denoiser = denoiser
    torch.testing.assert_close(ode_sample(base, prompts, seed=3), ours, atol=1e-5, rtol=0)

    # `flowrl export`: the shipped model's directory with the LoRA merged into the denoiser.
    assert main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0
    exported = build_pipeline(PipelineConfig(name=family, pretrained=str(tmp_path / "merged")), "cpu")
    assert not any("lora" in n for n, _ in exported.denoiser.named_parameters())
    torch.testing.assert_close(ode_sample(exported, prompts, seed=3), ours, atol=1e-4, rtol=0)
