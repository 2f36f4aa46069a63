"""Train the embedded text-to-video model ("moving digits") and write it where flowrl ships it.

    python -m flowrl.pipelines.embedded.train_digits_video --out flowrl/assets/digits_video

The denoiser is a ``diffusers.WanTransformer3DModel`` (the Wan 2.1 text-to-video transformer: 3-D
patches, 3-D RoPE, self-attention over all frames, cross-attention on the prompt) at tiny size, in
pixel space (no VAE): clips (B, 1, T=4, 16, 16) in [-1, 1]. The text encoder is a tiny
``transformers.CLIPTextModel`` trained jointly, as for the image model. Rectified flow: velocity
target ``noise - x0`` at ``x = (1 - sigma) x0 + sigma noise``, sigma ~ U(0, 1); the prompt is dropped
10% of the time so classifier-free guidance works. Data: ``digits_video_data.sample_clips`` (both
template sets, every digit image). The output directory has the diffusers layout (transformer/,
text_encoder/, tokenizer/, scheduler/ with a FlowMatchEulerDiscreteScheduler) plus training_info.json,
and is written atomically. Deterministic for a given seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...checkpoint import atomic_directory
from .digits_data import load_digit_images
from .digits_video_data import EVAL_TEMPLATES, MAX_PROMPT_TOKENS, TRAIN_TEMPLATES, build_tokenizer, prompt_for, sample_clips, vocabulary

CFG_DROPOUT = 0.1
TEXT_DIM = 32


def build_transformer(width: int = 64, layers: int = 4):
    from diffusers import WanTransformer3DModel

    head_dim = 32  # Wan's RoPE splits it 12 (time) + 10 (height) + 10 (width)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=width // head_dim,
        attention_head_dim=head_dim,
        in_channels=1,
        out_channels=1,
        text_dim=TEXT_DIM,
        freq_dim=64,
        ffn_dim=2 * width,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    )


def build_text_encoder():
    """The image model's text encoder (``digits_models.build_text_encoder``) over this vocabulary."""
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocabulary()), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_PROMPT_TOKENS, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    ))


def make_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)


def training_batch(images, labels, tokenizer, batch_size, gen):
    clips, digits, directions = sample_clips(images, labels, batch_size, gen)
    templates = TRAIN_TEMPLATES + EVAL_TEMPLATES
    t_idx = torch.randint(0, len(templates), (batch_size,), generator=gen).tolist()
    drop = (torch.rand(batch_size, generator=gen) < CFG_DROPOUT).tolist()
    prompts = ["" if x else prompt_for(d, m, templates[t]) for d, m, t, x in zip(digits, directions, t_idx, drop)]
    ids = tokenizer(prompts, padding="max_length", max_length=MAX_PROMPT_TOKENS, truncation=True, return_tensors="pt").input_ids
    return clips, ids


def flow_loss(transformer, text_encoder, x0, ids, gen):
    b = x0.shape[0]
    noise = torch.randn(x0.shape, generator=gen)
    sigma = torch.rand(b, generator=gen)
    s = sigma.view(b, 1, 1, 1, 1)
    x = (1 - s) * x0 + s * noise
    ctx = text_encoder(ids).last_hidden_state
    pred = transformer(x, sigma * 1000, ctx).sample
    return torch.nn.functional.mse_loss(pred, noise - x0)


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int, width: int, layers: int) -> dict:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    images, labels = load_digit_images()
    tokenizer = build_tokenizer()
    transformer, text_encoder, scheduler = build_transformer(width, layers), build_text_encoder(), make_scheduler()
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    warmup = max(1, steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    start, ema = time.time(), None
    bar = tqdm(range(steps), desc="train digits_video", mininterval=5)
    for _ in bar:
        x0, ids = training_batch(images, labels, tokenizer, batch_size, gen)
        loss = flow_loss(transformer, text_encoder, x0, ids, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.4f}", refresh=False)
    info = {"denoiser": "WanTransformer3DModel", "width": width, "layers": layers, "steps": steps, "batch_size": batch_size,
            "lr": lr, "seed": seed, "threads": torch.get_num_threads(), "final_loss_ema": ema,
            "train_seconds": round(time.time() - start, 1),
            "parameters": sum(p.numel() for p in transformer.parameters()) + sum(p.numel() for p in text_encoder.parameters()),
            "command": f"python -m flowrl.pipelines.embedded.train_digits_video --steps {steps} --batch-size {batch_size} "
                       f"--lr {lr} --seed {seed} --width {width} --layers {layers} --threads {torch.get_num_threads()}"}
    with atomic_directory(out) as tmp:  # a crash never leaves a half-written model
        transformer.save_pretrained(tmp / "transformer")
        text_encoder.save_pretrained(tmp / "text_encoder")
        tokenizer.save_pretrained(tmp / "tokenizer")
        scheduler.save_pretrained(tmp / "scheduler")
        (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out = a.out or Path(__file__).resolve().parents[2] / "assets" / "digits_video"
    train(out, a.steps, a.batch_size, a.lr, a.seed, a.width, a.layers)


if __name__ == "__main__":
    main()
