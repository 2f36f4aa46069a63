"""One GRPO iteration of a real-size, randomly initialised SD3.5-Medium- or FLUX.1-class transformer
with LoRA and gradient checkpointing, through flowrl's own loading path; prints peak GPU memory and
seconds per iteration.

    python bench/real_size_iteration.py --family sd3  [--size real|tiny] [--resolution 512] [--steps 10]
    python bench/real_size_iteration.py --family flux

The transformer has the released checkpoint's architecture (config below) with random weights; the VAE
is real-size too. The text encoders keep their real widths (CLIP-L 768, CLIP-G 1280, T5-XXL 4096) but
ONE layer each: they are frozen, run once per distinct prompt (cached), and are not part of the step
being measured. The pipeline is written with ``save_pretrained`` and loaded with
``pipeline.pretrained=<dir>``, as a user's checkpoint would be. ``--size tiny`` runs the same path at a
tiny config on a CPU (to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Released architectures (the transformer/config.json of each checkpoint).
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
FLUX1_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
TINY_SD3 = dict(
    sample_size=32,
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=16,
    pooled_projection_dim=64,
    out_channels=16,
    pos_embed_max_size=64,
)
TINY_FLUX = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
SD3_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(8, 16),
    layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    norm_num_groups=4,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)


def text_encoders(real: bool, family: str):
    """One-layer text encoders with the real widths (tiny widths for --size tiny)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from flowrl.data.digits import build_tokenizer

    def clip(width, projection):
        cfg = CLIPTextConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=1,
            num_attention_heads=max(1, width // 64),
            projection_dim=width,
            vocab_size=1000,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        )
        return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)

    t5 = T5EncoderModel(
        T5Config(
            vocab_size=1000,
            d_model=4096 if real else 32,
            d_kv=64 if real else 8,
            d_ff=10240 if real else 37,
            num_layers=1,
            num_heads=64 if real else 4,
        )
    )
    tok = build_tokenizer()
    if family == "sd3":
        widths = (768, 1280) if real else (32, 32)
        return dict(
            text_encoder=clip(widths[0], True),
            tokenizer=tok,
            text_encoder_2=clip(widths[1], True),
            tokenizer_2=tok,
            text_encoder_3=t5,
            tokenizer_3=tok,
        )
    return dict(text_encoder=clip(768 if real else 32, False), tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok)


def build_checkpoint(family: str, real: bool, directory: Path) -> None:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):  # random init of a 12B model is slow on a CPU
        if family == "sd3":
            transformer = SD3Transformer2DModel(**(SD35_MEDIUM if real else TINY_SD3))
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        else:
            transformer = FluxTransformer2DModel(**(FLUX1_DEV if real else TINY_FLUX))
            scheduler = FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
            )
        vae = AutoencoderKL(**(SD3_VAE if real else TINY_VAE))
        encoders = text_encoders(real, family)
    cls = StableDiffusion3Pipeline if family == "sd3" else FluxPipeline
    pipe = cls(transformer=transformer.to(torch.bfloat16), scheduler=scheduler, vae=vae, **encoders)
    pipe.save_pretrained(directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["sd3", "flux"], default="sd3")
    ap.add_argument("--size", choices=["real", "tiny"], default="real")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--group", type=int, default=4, help="samples per iteration (one prompt group)")
    ap.add_argument("--lora-rank", type=int, default=32)
    args = ap.parse_args()
    real = args.size == "real"
    cuda = torch.cuda.is_available()

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        build_checkpoint(args.family, real, Path(tmp) / "model")
        built = time.perf_counter() - t0
        if cuda:
            torch.cuda.empty_cache()
        resolution = args.resolution if real else 32
        overrides = {
            "pipeline.name": args.family,
            "pipeline.pretrained": str(Path(tmp) / "model"),
            "pipeline.dtype": "bfloat16",
            "pipeline.lora": f"{{r: {args.lora_rank}, alpha: {2 * args.lora_rank}}}",
            "pipeline.gradient_checkpointing": True,
            "pipeline.height": resolution,
            "pipeline.width": resolution,
            "pipeline.device": "auto" if cuda else "cpu",
            "train.mixed_precision": "bf16",
            "sampler.name": "flow_sde",
            "objective.name": "grpo",
            "rollout.num_inference_steps": args.steps,
            "rollout.batch_size": args.group,
            "rollout.guidance_scale": 3.5 if args.family == "flux" else 4.5,
            "rollout.guidance_mode": "embedded" if args.family == "flux" else "cfg",
            "train.iterations": 1,
            "train.prompts_per_iteration": 1,
            "train.num_generations": args.group,
            "train.batch_size": args.group,
            "reward.components": "{ink: 1.0}",
            "eval.every": 0,
            "eval.samples_per_prompt": 1,
            "log.grid_prompts": 1,
            "log.checkpoint_every": 0,
            "log.progress": False,
            "output_dir": str(Path(tmp) / "run"),
            "prompts.dataset": "digits",
        }
        trainer = Trainer(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
        params = sum(p.numel() for p in trainer.pipeline.denoiser.parameters())
        lora = sum(p.numel() for p in trainer.trainable_parameters())
        trainer.train_iteration(0)  # warm-up (kernels, allocator, prompt cache)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        metrics = trainer.train_iteration(1)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        result = {
            "family": args.family,
            "size": args.size,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "transformer_params": params,
            "lora_params": lora,
            "resolution": resolution,
            "steps": args.steps,
            "samples": args.group,
            "seconds_per_iteration": round(seconds, 2),
            "rollout_s": round(metrics["perf/rollout_s"], 2),
            "update_s": round(metrics["perf/update_s"], 2),
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "checkpoint_build_s": round(built, 1),
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()
