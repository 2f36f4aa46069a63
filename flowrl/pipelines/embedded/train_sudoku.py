"""Train the embedded masked-diffusion 4x4 Sudoku LM and write it where flowrl ships it.

    python -m flowrl.pipelines.embedded.train_sudoku [--steps 170] [--out flowrl/assets/sudoku_mdlm]

The model is arith_mdlm's architecture (a tiny bidirectional ``transformers.BertForMaskedLM``) with the Sudoku
vocabulary, trained with the same LLaDA SFT loss (``train_arith.masked_completion_loss``: the prompt never masked,
each completion token masked with probability t ~ U(0, 1)) on generated puzzles (``flowrl.data.sudoku``: 8 clues,
one solution, none of them a puzzle of the shared test file, which must be present to exclude them).

Training is deliberately short: the model writes well-formed grids and keeps its clues, but solves only part of
the held-out puzzles, which leaves room for RL (the numbers: docs/objectives/dllm.md, "Sudoku").

Writes the model, its tokenizer and ``training_info.json`` into one directory; deterministic for a seed and thread count.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...data.sudoku import CLUES, COMPLETION_LEN, PROMPT_LEN, build_tokenizer, completion_text, training_set, vocabulary
from .train_arith import bidirectional_lm, masked_completion_loss
from .training import ASSETS, loss_ema, optimizer_step, parse_training_arguments, save_model, training_parser, warmup_cosine


def build_model(hidden: int = 128, layers: int = 4, heads: int = 4):
    """sudoku_mdlm's architecture: arith_mdlm's BertForMaskedLM over the Sudoku vocabulary and 34 positions."""
    return bidirectional_lm(len(vocabulary()), PROMPT_LEN + COMPLETION_LEN, hidden, layers, heads)


def encode(tokenizer, pairs) -> torch.Tensor:
    """(N, 34) token ids: the 16 puzzle cells, then ``<answer>``, the 16 solution cells and ``</answer>``."""
    texts = [f"{p} {completion_text(m['solution'])}" for p, m in pairs]
    ids = tokenizer(texts, return_tensors="pt").input_ids
    if ids.shape[1] != PROMPT_LEN + COMPLETION_LEN:
        raise AssertionError(f"a Sudoku example must be {PROMPT_LEN + COMPLETION_LEN} tokens, got {ids.shape[1]}")
    return ids


def train(
    out: Path, steps: int, batch_size: int, lr: float, seed: int, num_puzzles: int, hidden: int = 128, layers: int = 4, clues: int = CLUES
) -> dict:
    """Fit the model on ``num_puzzles`` generated puzzles for ``steps`` steps and write it into ``out``; returns the
    training_info written beside it."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = build_tokenizer()
    ids = encode(tokenizer, training_set(num_puzzles, seed, clues))
    attn = torch.ones_like(ids)  # fixed length: no padding anywhere
    model = build_model(hidden, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = warmup_cosine(opt, steps, warmup=max(1, steps // 20))
    start, ema = time.time(), None
    for _ in (bar := tqdm(range(steps), desc="train sudoku_mdlm")):
        idx = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
        loss = masked_completion_loss(model, tokenizer, ids[idx], attn[idx], gen, prompt_len=PROMPT_LEN)
        optimizer_step(loss, opt, sched, clip=model.parameters())
        ema = loss_ema(ema, loss)
        bar.set_postfix(loss=f"{ema:.3f}")
    command = f"python -m flowrl.pipelines.embedded.train_sudoku --steps {steps} --seed {seed} --puzzles {num_puzzles} --clues {clues} --threads {torch.get_num_threads()}"
    settings = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "train_puzzles": num_puzzles,
        "clues": clues,
        "hidden": hidden,
    }
    info = {**settings, "layers": layers, "final_loss_ema": ema, "train_seconds": round(time.time() - start, 1), "command": command}
    save_model(out, [("", model), ("", tokenizer)], info)  # one directory holding model and tokenizer, like a hub checkpoint
    print(json.dumps(info))
    return info


def main() -> None:
    p = training_parser(__doc__, out=ASSETS / "sudoku_mdlm", steps=170, batch_size=64, lr=1e-3, threads=1)
    p.add_argument("--puzzles", type=int, default=2000, help="generated training puzzles (one solution each)")
    p.add_argument("--clues", type=int, default=CLUES, help="clues per training puzzle (the test puzzles have 8)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    a = parse_training_arguments(p)
    train(a.out, a.steps, a.batch_size, a.lr, a.seed, a.puzzles, a.hidden, a.layers, a.clues)


if __name__ == "__main__":
    main()
