"""Block diffusion with an exact key-value cache against full-sequence generation, measured in one run.

    python bench/block_cache.py [--n 256] [--steps 16 8] [--repeats 3] [--batch-size 128] [--json OUT.json]

On the embedded block-diffusion model (arith_bd3lm, block-causal, block length 4) the same held-out arithmetic prompts
are generated with ``sampler.kv_cache=none`` (every step runs prompt + whole completion, block-causal mask) and
``kv_cache=exact`` (prompt and finished blocks in a transformers DynamicCache, each step runs the current block), at
each step count, greedy (how flowrl evaluates) and at temperature 1 (how it rolls out). The two modes alternate
within each repeat, so load on the machine hits both alike; the ratio is of the medians. Also reported: accuracy
(math_answer) of each mode, whether the greedy tokens are identical, and the bidirectional arith_mdlm
(full sequence, its own preset's settings) as the model without a cache for reference.
Single-threaded (torch.set_num_threads(1)); run it under ``nice``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.pipelines.dllm import EMBEDDED_LMS, load_masked_lm  # noqa: E402
from flowrl.prompts import prompt_pool  # noqa: E402
from flowrl.reward_models import build_reward  # noqa: E402
from flowrl.samplers.masked import decode_completions, generate  # noqa: E402
from flowrl.samplers.text_generation import encode_prompts  # noqa: E402


def run(lm, items, batch_size, temperature, seed, **kw):
    """(seconds, completions ids) for every item, batch by batch; the clock covers generation only."""
    seconds, out = 0.0, []
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(items), batch_size):
        ids, mask = encode_prompts(lm, [p for p, _ in items[start : start + batch_size]], 24)
        t0 = time.perf_counter()
        traj = generate(lm, ids, mask, temperature=temperature, generator=gen, **kw)
        seconds += time.perf_counter() - t0
        out.append(traj.completion_ids)
    return seconds, torch.cat(out)


def accuracy(lm, reward, items, ids) -> float:
    texts = decode_completions(lm.tokenizer, ids, lm.eos_token_id)
    return float(reward(texts, [p for p, _ in items], [m for _, m in items]).scores.mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--steps", type=int, nargs="+", default=[16, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    items = prompt_pool("arith", "eval", a.n)
    reward = build_reward("math_answer")
    bd = load_masked_lm(str(EMBEDDED_LMS["arith_bd3lm"]))
    mdlm = load_masked_lm(str(EMBEDDED_LMS["arith_mdlm"]))
    for lm in (bd, mdlm):
        lm.model.eval()
    rows = []
    for steps in a.steps:
        for temperature in (0.0, 1.0):
            base = dict(gen_length=16, steps=steps, block_length=bd.block_length)
            modes = {
                "full": (bd, dict(base, kv_cache="none")),
                "cache": (bd, dict(base, kv_cache="exact")),
                "mdlm_full": (mdlm, dict(gen_length=16, steps=steps, block_length=16)),
            }
            times = {m: [] for m in modes}
            ids = {}
            for r in range(a.repeats):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for m in order:
                    lm, kw = modes[m]
                    s, ids[m] = run(lm, items, a.batch_size, temperature, 1234 + r, **kw)
                    times[m].append(s)
            row = {"steps": steps, "temperature": temperature, "n": len(items)}
            for m, (lm, _) in modes.items():
                row[f"{m}_ms_per_completion"] = 1000 * statistics.median(times[m]) / len(items)
                row[f"{m}_accuracy"] = accuracy(lm, reward, items, ids[m])
            row["speedup_cache_vs_full"] = statistics.median(times["full"]) / statistics.median(times["cache"])
            row["speedup_cache_vs_mdlm"] = statistics.median(times["mdlm_full"]) / statistics.median(times["cache"])
            row["per_repeat_ratio"] = [f / c for f, c in zip(times["full"], times["cache"], strict=True)]
            if temperature == 0:
                row["greedy_tokens_identical"] = bool(torch.equal(ids["full"], ids["cache"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                a.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
