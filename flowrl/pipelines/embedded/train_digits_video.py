"""Train the embedded text-to-video model ("moving digits") and write it where flowrl ships it.

    python -m flowrl.pipelines.embedded.train_digits_video --out flowrl/assets/digits_video
    python -m flowrl.evaluation.digits_video digits_video [--checkpoint runs/x/checkpoints/step_000020]   (sample quality)

The denoiser is a ``diffusers.CogVideoXTransformer3DModel`` (the CogVideoX-2b text-to-video
transformer: 2x2 patches of every frame, 3-D sin-cos positions, full attention over the prompt and all
frames together, adaLN on the timestep) at tiny size, in pixel space (no VAE): clips (B, 1, T=4, 16, 16)
in [-1, 1]. The text encoder is a tiny ``transformers.CLIPTextModel`` trained jointly, as for the image
model. Rectified flow: velocity target ``noise - x0`` at ``x = (1 - sigma) x0 + sigma noise``,
sigma ~ U(0, 1) shifted towards noise (SD3 shift 3, also used for sampling); the prompt is dropped 10% of the time so classifier-free guidance works. Data:
``flowrl.data.digits_video.sample_clips`` (both template sets, every digit image). The output directory has
the diffusers layout (transformer/, text_encoder/, tokenizer/, scheduler/ with a
FlowMatchEulerDiscreteScheduler) plus training_info.json, and is written atomically. Deterministic for
a given seed and thread count. (Why CogVideoX and not Wan 2.1 or a 3-D UNet: docs/digits_video.md.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...data.digits import load_digit_images
from ...data.digits_video import (
    CANVAS,
    EVAL_TEMPLATES,
    MAX_PROMPT_TOKENS,
    NUM_FRAMES,
    TRAIN_TEMPLATES,
    build_tokenizer,
    prompt_for,
    sample_clips,
    vocabulary,
)
from ...samplers.forward_process import flow_noised
from ...samplers.schedules import shift_sigmas
from ..digits_video import denoise
from .digits_models import TEXT_DIM
from .digits_models import build_text_encoder as digits_text_encoder
from .training import ASSETS, loss_ema, optimizer_step, parse_training_arguments, save_model, training_parser, warmup_cosine

CFG_DROPOUT = 0.1
# SD3/Wan time shift, for training (sigma drawn more often near noise, where the prompt decides the
# digit and the direction) and sampling (saved in scheduler/, read by flowrl's FlowSchedule).
SHIFT = 3.0


def build_transformer(width: int = 64, layers: int = 4):
    from diffusers import CogVideoXTransformer3DModel

    head_dim = 32
    return CogVideoXTransformer3DModel(
        num_attention_heads=width // head_dim,
        attention_head_dim=head_dim,
        in_channels=1,
        out_channels=1,
        time_embed_dim=width,
        text_embed_dim=TEXT_DIM,
        num_layers=layers,
        sample_width=CANVAS,
        sample_height=CANVAS,
        sample_frames=NUM_FRAMES,
        patch_size=2,
        temporal_compression_ratio=1,  # pixel space: one position per frame
        max_text_seq_length=MAX_PROMPT_TOKENS,
        spatial_interpolation_scale=1.0,
        temporal_interpolation_scale=1.0,
    )


def build_text_encoder():
    """The image model's text encoder (``digits_models.build_text_encoder``) over this vocabulary, with
    the word embeddings initialised at std 1 instead of CLIP's 0.02: at 0.02 the position embeddings
    and the layers' outputs drown the single word that names the direction, and jointly training the
    encoder collapsed "left"/"right"/"up"/"down" onto one another before the denoiser learned to read
    them (measured: direction never followed; see docs/digits_video.md)."""
    model = digits_text_encoder(len(vocabulary()), MAX_PROMPT_TOKENS)
    torch.nn.init.normal_(model.embeddings.token_embedding.weight, std=1.0)
    return model


def make_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT)


def training_batch(images, labels, tokenizer, batch_size, gen):
    clips, digits, directions = sample_clips(images, labels, batch_size, gen)
    templates = TRAIN_TEMPLATES + EVAL_TEMPLATES
    t_idx = torch.randint(0, len(templates), (batch_size,), generator=gen).tolist()
    drop = (torch.rand(batch_size, generator=gen) < CFG_DROPOUT).tolist()
    prompts = ["" if x else prompt_for(d, m, templates[t]) for d, m, t, x in zip(digits, directions, t_idx, drop)]
    ids = tokenizer(prompts, padding="max_length", max_length=MAX_PROMPT_TOKENS, truncation=True, return_tensors="pt").input_ids
    return clips, ids


def flow_loss(transformer, text_encoder, x0, ids, gen):
    """Rectified-flow velocity loss; sigma ~ U(0, 1) moved towards noise by the scheduler's shift."""
    b = x0.shape[0]
    noise = torch.randn(x0.shape, generator=gen)
    sigma = shift_sigmas(torch.rand(b, generator=gen), SHIFT)
    x, target = flow_noised(x0, noise, sigma.view(b, 1, 1, 1, 1))
    ctx = text_encoder(ids).last_hidden_state
    pred = denoise(transformer, x, sigma * 1000, ctx)
    return torch.nn.functional.mse_loss(pred, target)


def save_video_model(directory: Path, transformer, text_encoder, tokenizer, scheduler, info: dict) -> None:
    """The diffusers layout: transformer/, text_encoder/, tokenizer/, scheduler/ and training_info.json."""
    parts = [("transformer", transformer), ("text_encoder", text_encoder), ("tokenizer", tokenizer), ("scheduler", scheduler)]
    save_model(directory, parts, info)


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int, width: int, layers: int, snapshot_every: int = 0) -> dict:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    images, labels = load_digit_images()
    tokenizer = build_tokenizer()
    transformer, text_encoder, scheduler = build_transformer(width, layers), build_text_encoder(), make_scheduler()
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    sched = warmup_cosine(opt, steps, warmup=max(1, steps // 50))
    start, ema = time.time(), None
    bar = tqdm(range(steps), desc="train digits_video", mininterval=5)
    for step in bar:
        if snapshot_every and step and step % snapshot_every == 0:  # to watch training; not the shipped model
            save_video_model(
                out.parent / f"{out.name}.snapshots" / f"step_{step:06d}",
                transformer,
                text_encoder,
                tokenizer,
                scheduler,
                {"step": step, "loss_ema": ema},
            )
        x0, ids = training_batch(images, labels, tokenizer, batch_size, gen)
        loss = flow_loss(transformer, text_encoder, x0, ids, gen)
        optimizer_step(loss, opt, sched, clip=params)
        ema = loss_ema(ema, loss)
        bar.set_postfix(loss=f"{ema:.4f}", refresh=False)
    info = {
        "denoiser": "CogVideoXTransformer3DModel",
        "shift": SHIFT,
        "width": width,
        "layers": layers,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "threads": torch.get_num_threads(),
        "final_loss_ema": ema,
        "train_seconds": round(time.time() - start, 1),
        "parameters": sum(p.numel() for p in transformer.parameters()) + sum(p.numel() for p in text_encoder.parameters()),
        "command": f"python -m flowrl.pipelines.embedded.train_digits_video --steps {steps} --batch-size {batch_size} "
        f"--lr {lr} --seed {seed} --width {width} --layers {layers} --threads {torch.get_num_threads()}",
    }
    save_video_model(out, transformer, text_encoder, tokenizer, scheduler, info)
    print(json.dumps(info))
    return info


def main() -> None:
    p = training_parser(__doc__, out=None, steps=2000, batch_size=32, lr=2e-3)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--snapshot-every", type=int, default=0, help="also write the model every N steps to OUT.snapshots/")
    a = parse_training_arguments(p)
    out = a.out or ASSETS / "digits_video"
    train(out, a.steps, a.batch_size, a.lr, a.seed, a.width, a.layers, a.snapshot_every)


if __name__ == "__main__":
    main()
