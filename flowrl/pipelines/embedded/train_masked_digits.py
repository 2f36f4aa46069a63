"""Train the embedded masked-token text-to-digit generator (aMUSEd's classes) and write it where flowrl ships it.

    python -m flowrl.pipelines.embedded.train_masked_digits --out flowrl/assets/digits_masked

Two stages on scikit-learn's 8x8 digits, single-threaded by default:

1. the tokenizer: a ``VQModel`` (8x8 pixels -> 4x4 tokens of a 64-entry codebook) trained on reconstruction
   MSE + its own commitment loss (diffusers' ``VectorQuantizer``, straight-through), with codebook entries that no
   image of a batch uses restarted at random encoder outputs every ``restart_every`` steps (the usual cure for
   dead codes; without it a third of a small codebook stays unused);
2. the generator: a ``UVit2DModel`` + ``CLIPTextModelWithProjection`` trained as MaskGIT / aMUSEd are: each image's
   tokens masked independently with probability cos(u pi / 2), u ~ U(0, 1) (the cosine schedule AmusedScheduler
   unmasks along), cross-entropy on the masked tokens, the prompt dropped 10% of the time so classifier-free
   guidance works, AmusedPipeline's default micro-conditioning.

The output is an ``AmusedPipeline`` directory (``model_index.json``, vqvae/, transformer/, text_encoder/,
tokenizer/, scheduler/; safetensors), so diffusers loads it as it loads ``amused/amused-256``, and so does flowrl
(``pipeline.name: amused``, ``pretrained: digits_masked``). ``training_info.json`` records the settings and how
well the tokenizer reconstructs (pixel MSE, the embedded classifier's accuracy on the reconstructions: what the
generator can reach at best). Deterministic for a given seed and thread count.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ...data.digits import EVAL_TEMPLATES, MAX_PROMPT_TOKENS, TRAIN_TEMPLATES, build_tokenizer, load_digit_images, prompt_for
from .masked_digits_models import (
    CODEBOOK_SIZE,
    MICRO_CONDS,
    TOKEN_GRID,
    build_scheduler,
    build_text_encoder,
    build_transformer,
    build_vqvae,
)
from .training import ASSETS, loss_ema, optimizer_step, parse_training_arguments, save_model, training_parser, warmup_cosine

CFG_DROPOUT = 0.1


def quantized_latents(vq, x: torch.Tensor) -> torch.Tensor:
    """The encoder's pre-quantisation vectors (N * 4 * 4, D), in VectorQuantizer's row order."""
    h = vq.encode(x).latents
    return h.permute(0, 2, 3, 1).reshape(-1, h.shape[1])


def image_tokens(vq, x: torch.Tensor) -> torch.Tensor:
    """Token ids (N, 4, 4) of images (N, 1, 8, 8): the nearest codebook entry of each encoder vector."""
    z = quantized_latents(vq, x)
    idx = torch.cdist(z, vq.quantize.embedding.weight).argmin(1)
    return idx.view(x.shape[0], TOKEN_GRID, TOKEN_GRID)


def decode_tokens(vq, tokens: torch.Tensor) -> torch.Tensor:
    """Pixels (N, 1, 8, 8), [0, 1] before AmusedPipeline's clip, of token ids (N, 4, 4), as AmusedPipeline decodes them."""
    shape = (tokens.shape[0], TOKEN_GRID, TOKEN_GRID, vq.config.latent_channels)
    return vq.decode(tokens.reshape(tokens.shape[0], -1), force_not_quantize=True, shape=shape).sample


def train_vq(images: torch.Tensor, steps: int, batch_size: int, lr: float, restart_every: int, gen: torch.Generator):
    vq = build_vqvae()
    opt = torch.optim.AdamW(vq.parameters(), lr=lr, weight_decay=0.0)
    sched = warmup_cosine(opt, steps, warmup=max(1, steps // 50))
    ema = None
    bar = tqdm(range(steps), desc="train VQ tokenizer")
    used = torch.zeros(CODEBOOK_SIZE, dtype=torch.bool)
    for step in bar:
        x = images[torch.randint(0, images.shape[0], (batch_size,), generator=gen)]
        out = vq(x)
        loss = F.mse_loss(out.sample, x) + out.commit_loss.mean()
        optimizer_step(loss, opt, sched)
        with torch.no_grad():
            z = quantized_latents(vq, x)
            used |= torch.bincount(torch.cdist(z, vq.quantize.embedding.weight).argmin(1), minlength=CODEBOOK_SIZE) > 0
            if (step + 1) % restart_every == 0 and step + 1 < steps * 0.8:
                dead = (~used).nonzero().flatten()
                if len(dead):  # restart unused entries at random encoder outputs of this batch
                    pick = torch.randint(0, z.shape[0], (len(dead),), generator=gen)
                    vq.quantize.embedding.weight[dead] = z[pick]
                used.zero_()
        ema = loss_ema(ema, loss)
        bar.set_postfix(loss=f"{ema:.4f}")
    return vq.eval()


def prompts_batch(labels: torch.Tensor, tokenizer, gen: torch.Generator) -> torch.Tensor:
    templates = TRAIN_TEMPLATES + EVAL_TEMPLATES
    t_idx = torch.randint(0, len(templates), (len(labels),), generator=gen).tolist()
    drop = (torch.rand(len(labels), generator=gen) < CFG_DROPOUT).tolist()
    prompts = ["" if d else prompt_for(int(y), templates[t]) for y, t, d in zip(labels.tolist(), t_idx, drop)]
    return tokenizer(prompts, padding="max_length", max_length=MAX_PROMPT_TOKENS, truncation=True, return_tensors="pt").input_ids


def masked_tokens_loss(transformer, text_encoder, tokens: torch.Tensor, ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """MaskGIT's loss: mask each token with probability cos(u pi / 2), cross-entropy on the masked ones."""
    b = tokens.shape[0]
    flat = tokens.reshape(b, -1)
    ratio = torch.cos(torch.rand(b, generator=gen) * math.pi / 2)
    mask = torch.rand(flat.shape, generator=gen) < ratio[:, None]
    none = ~mask.any(1)  # at least one masked token per image
    mask[none, torch.randint(0, flat.shape[1], (int(none.sum()),), generator=gen)] = True
    inputs = torch.where(mask, CODEBOOK_SIZE, flat).view_as(tokens)
    out = text_encoder(ids, return_dict=True, output_hidden_states=True)
    micro = torch.tensor([MICRO_CONDS], dtype=torch.float32).expand(b, -1)
    logits = transformer(inputs, encoder_hidden_states=out.hidden_states[-2], pooled_text_emb=out.text_embeds, micro_conds=micro)
    logits = logits.reshape(b, CODEBOOK_SIZE, -1).permute(0, 2, 1)  # (B, L, codebook)
    return F.cross_entropy(logits[mask], flat[mask])


def train_generator(tokens: torch.Tensor, labels: torch.Tensor, tokenizer, steps: int, batch_size: int, lr: float, gen: torch.Generator):
    transformer, text_encoder = build_transformer(), build_text_encoder()
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    sched = warmup_cosine(opt, steps, warmup=max(1, steps // 50))
    ema = None
    bar = tqdm(range(steps), desc="train masked-token generator")
    for _ in bar:
        idx = torch.randint(0, tokens.shape[0], (batch_size,), generator=gen)
        loss = masked_tokens_loss(transformer, text_encoder, tokens[idx], prompts_batch(labels[idx], tokenizer, gen), gen)
        optimizer_step(loss, opt, sched, clip=params)
        ema = loss_ema(ema, loss)
        bar.set_postfix(loss=f"{ema:.4f}")
    return transformer.eval(), text_encoder.eval(), ema


@torch.no_grad()
def reconstruction_report(vq, images: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor) -> dict:
    from ...reward_models.digit_classifier import DigitClassifierReward

    recon = decode_tokens(vq, tokens).clip(0, 1)  # as AmusedPipeline decodes
    classifier = DigitClassifierReward()
    meta = [{"digit": int(y)} for y in labels]
    prob = classifier(recon, [""] * len(labels), meta).scores
    prob_data = classifier(images, [""] * len(labels), meta).scores
    return {
        "reconstruction_mse": round(float(F.mse_loss(recon, images)), 5),
        "codes_used": int(torch.unique(tokens).numel()),
        "classifier_prob_reconstructions": round(float(prob.mean()), 4),
        "classifier_prob_data": round(float(prob_data.mean()), 4),
    }


def train(out: Path, vq_steps: int, steps: int, batch_size: int, lr: float, seed: int, threads: int) -> None:
    from diffusers import AmusedPipeline

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    images, labels = load_digit_images()
    images = (images + 1) / 2  # AmusedPipeline's decoder output is the image in [0, 1] (it clips there)
    tokenizer = build_tokenizer()
    start = time.time()
    vq = train_vq(images, vq_steps, batch_size, lr, restart_every=100, gen=gen)
    with torch.no_grad():
        tokens = image_tokens(vq, images)
    recon = reconstruction_report(vq, images, labels, tokens)
    print(json.dumps(recon), flush=True)
    vq_seconds = time.time() - start
    transformer, text_encoder, ema = train_generator(tokens, labels, tokenizer, steps, batch_size, lr, gen)
    info = {
        "vq_steps": vq_steps,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "threads": threads,
        **recon,
        "final_loss_ema": ema,
        "vq_train_seconds": round(vq_seconds, 1),
        "train_seconds": round(time.time() - start, 1),
        "command": f"python -m flowrl.pipelines.embedded.train_masked_digits --vq-steps {vq_steps} --steps {steps} --seed {seed}",
    }
    pipe = AmusedPipeline(vqvae=vq, tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, scheduler=build_scheduler())
    save_model(out, [("", pipe)], info)
    print(json.dumps(info))


def main() -> None:
    p = training_parser(__doc__, out=None, steps=2500, batch_size=128, lr=2e-3)
    p.add_argument("--vq-steps", type=int, default=600)
    a = parse_training_arguments(p)
    out = a.out or ASSETS / "digits_masked"
    train(out, a.vq_steps, a.steps, a.batch_size, a.lr, a.seed, a.threads)


if __name__ == "__main__":
    main()
