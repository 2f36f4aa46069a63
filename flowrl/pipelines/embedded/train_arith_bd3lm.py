"""Train the embedded block-diffusion math LM (arith_bd3lm) and write it where flowrl ships it.

    python -m flowrl.pipelines.embedded.train_arith_bd3lm [--steps 500] [--block-length 4] [--out flowrl/assets/arith_bd3lm]

The same task and SFT data as arith_mdlm (``train_arith.py``: the arithmetic problems, 30% of the solutions with an
answer one off), but the model is a block-diffusion LM (BD3-LM / SDAR style) so that generation can keep the prompt
and the finished blocks in an exact key-value cache: a tiny ``transformers.LlamaForCausalLM`` (a decoder class, so
its attention takes a cache and a custom 4-D mask; not Qwen2, for which transformers 5's AutoTokenizer replaces the
saved word-level tokenizer by Qwen2's own) trained with block-causal attention
(``pipelines/block_attention.py``): each block of ``block_length`` tokens attends to itself fully and to the blocks
before it, never to a later one. The config records ``diffusion_block_length``, which is how ``load_masked_lm``
knows to apply that attention.

Training is BD3-LM's vectorised form: input ``[prompt ; x_t ; x_0]``, each completion block noised at its own
masking rate t ~ U(0, 1) (at least one masked token per row), every noised block attending to the clean earlier
blocks and itself; the loss is the mean cross-entropy of the masked tokens (as train_arith, LLaDA's SFT form without
the 1/t weight). So each block learns to be denoised given the clean prefix it has at sampling time.

Writes the model, its tokenizer and ``training_info.json`` into one directory; deterministic for a seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...atomic_files import atomic_directory
from ...data.arith import COMPLETION_LEN, PROMPT_LEN, build_tokenizer, problems, vocabulary
from ..block_attention import block_diffusion_training_mask, block_diffusion_training_positions
from .train_arith import encode


def build_model(block_length: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(vocabulary()),
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    config.diffusion_block_length = block_length  # read by flowrl's load_masked_lm: block-causal attention
    config.mask_token_id = tokenizer.mask_token_id
    return LlamaForCausalLM(config)


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int, num_problems: int, flaw_rate: float, block_length: int) -> None:
    if COMPLETION_LEN % block_length:
        raise SystemExit(f"--block-length {block_length} must divide the completion length {COMPLETION_LEN}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = build_tokenizer()
    ids, attn = encode(tokenizer, problems("train", num_problems, seed, flaw_rate))
    model = build_model(block_length)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
    )
    G, num_blocks = COMPLETION_LEN, COMPLETION_LEN // block_length
    start, ema = time.time(), None
    for _ in (bar := tqdm(range(steps), desc="train arith_bd3lm")):
        idx = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
        prompt, prompt_mask, x0 = ids[idx, :PROMPT_LEN], attn[idx, :PROMPT_LEN], ids[idx, PROMPT_LEN:]
        t = torch.rand(batch_size, num_blocks, generator=gen).repeat_interleave(block_length, 1)  # one rate per block
        masked = torch.rand(batch_size, G, generator=gen) < t
        masked[torch.arange(batch_size), torch.randint(0, G, (batch_size,), generator=gen)] = True
        x_t = torch.where(masked, tokenizer.mask_token_id, x0)
        logits = model(
            input_ids=torch.cat([prompt, x_t, x0], 1),
            attention_mask=block_diffusion_training_mask(prompt_mask, G, block_length, torch.float32),
            position_ids=block_diffusion_training_positions(prompt_mask, G),
        ).logits[:, PROMPT_LEN : PROMPT_LEN + G]
        loss = torch.nn.functional.cross_entropy(logits[masked], x0[masked])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    info = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "train_problems": num_problems,
        "flaw_rate": flaw_rate,
        "block_length": block_length,
        "final_loss_ema": ema,
        "train_seconds": round(time.time() - start, 1),
        "command": f"python -m flowrl.pipelines.embedded.train_arith_bd3lm --steps {steps} --batch-size {batch_size} --lr {lr} --seed {seed} --flaw-rate {flaw_rate} --block-length {block_length} --threads {torch.get_num_threads()}",
    }
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "assets" / "arith_bd3lm")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--flaw-rate", type=float, default=0.3, help="fraction of SFT solutions whose final answer is one off")
    p.add_argument("--block-length", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    train(a.out, a.steps, a.batch_size, a.lr, a.seed, a.problems, a.flaw_rate, a.block_length)


if __name__ == "__main__":
    main()
