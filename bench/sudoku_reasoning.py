"""Where an RL gain on the embedded Sudoku LM comes from: the base model and a trained checkpoint on d1's 500 test
puzzles, greedy and at temperature 1, measured the same way in one run.

Per setting: accuracy (all 16 cells right), cell accuracy (empty cells right), the mean number of broken rows,
columns and boxes (``flowrl.data.sudoku.sudoku_violations``), the clue-copy rate (answers keeping every clue), the
well-formed rate (an ``<answer>`` block with exactly 16 digits), the accuracy among the answers that keep every clue,
the valid rate (a grid breaking no rule and keeping every clue: 124 of the 500 puzzles have more than one solution and
the file lists one, so a valid answer can be graded wrong), and puzzles solved only after / only before; plus a few puzzles
the checkpoint solves and the base model does not, both answers shown.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sudoku_reasoning.py --checkpoint runs/dllm_sudoku_diffu_grpo/checkpoints/latest
    OMP_NUM_THREADS=1 .venv/bin/python bench/sudoku_reasoning.py --checkpoint runs/dllm_sudoku_tracerl/checkpoints/latest \
        --record sudoku_reasoning_tracerl

Writes bench/results/sudoku_reasoning.json (or the ``--record`` name). Needs ../shared/data (FLOWRL_DATA_DIR). Results: docs/objectives/dllm.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import record  # noqa: E402
from flowrl.data.sudoku import PROMPT_LEN, held_out, sudoku_violations  # noqa: E402
from flowrl.pipelines.dllm import load_masked_lm  # noqa: E402
from flowrl.reward_models.math_answer import extract_answer  # noqa: E402
from flowrl.samplers.masked import decode_completions, generate  # noqa: E402
from flowrl.training.checkpoint import checkpoint_directory, read_weights  # noqa: E402

GEN = 18  # <answer>, 16 cells, </answer>: the preset's gen_length = steps = block_length (one cell per step)


def answers(lm, items, temperature: float, seed: int) -> list[str]:
    """The model's completions of every item, the preset's sampler (low confidence, one token per step)."""
    ids = lm.tokenizer([p for p, _ in items], return_tensors="pt").input_ids
    assert ids.shape[1] == PROMPT_LEN
    with torch.no_grad():
        traj = generate(
            lm, ids, torch.ones_like(ids), GEN, GEN, GEN, temperature=temperature, generator=torch.Generator().manual_seed(seed)
        )
    return decode_completions(lm.tokenizer, traj.completion_ids, lm.eos_token_id)


def grid(text: str) -> str | None:
    """The answer's 16 cells, or None when it is not well formed (no answer block, or not exactly 16 digits)."""
    digits = "".join(c for c in (extract_answer(text, prefer_answer_tags=True) or "") if c.isdigit())
    return digits if len(digits) == 16 else None


def measure(texts: list[str], items) -> dict:
    grids = [grid(t) for t in texts]
    n = len(items)
    solved = [g == m["solution"] for g, (_, m) in zip(grids, items, strict=True)]
    cells = [
        sum(g is not None and g[i] == m["solution"][i] for i in range(16) if m["puzzle"][i] == "0") / m["puzzle"].count("0")
        for g, (_, m) in zip(grids, items, strict=True)
    ]
    kept = [
        g is not None and all(p in ("0", c) for p, c in zip(m["puzzle"], g, strict=True)) for g, (_, m) in zip(grids, items, strict=True)
    ]
    return {
        "accuracy": round(sum(solved) / n, 4),
        "cell_accuracy": round(sum(cells) / n, 4),
        "broken_units_mean": round(sum(sudoku_violations(g) if g else 12 for g in grids) / n, 3),
        "clue_copy_rate": round(sum(kept) / n, 4),
        "well_formed_rate": round(sum(g is not None for g in grids) / n, 4),
        # d1's file lists one solution, but 124 of its 500 puzzles have more: any valid grid keeping the clues is right
        "valid_rate": round(sum(g is not None and k and sudoku_violations(g) == 0 for g, k in zip(grids, kept, strict=True)) / n, 4),
        # how much of the accuracy is copying the clues: the solved share of the answers that keep them all
        "accuracy_given_clues_kept": round(sum(solved) / max(1, sum(kept)), 4),
        "solved": solved,
    }


def load(checkpoint: Path | None):
    lm = load_masked_lm(str(REPO / "flowrl" / "assets" / "sudoku_mdlm"))
    if checkpoint is not None:
        weights = read_weights(checkpoint_directory(checkpoint))
        lm.load_trainable_state_dict({k: v for k, v in weights.items() if not k.startswith("objective.")})
    lm.model.eval()
    return lm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--record", default="sudoku_reasoning", help="the name of the JSON under bench/results/ (one per preset's checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--examples", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    items = held_out()
    models = {"base": load(None), "trained": load(a.checkpoint)}
    out, texts = {}, {}
    for temperature in (0.0, 1.0):
        for name, lm in models.items():
            texts[name, temperature] = answers(lm, items, temperature, a.seed)
            out[f"{name}_T{temperature:g}"] = measure(texts[name, temperature], items)
        before, after = out[f"base_T{temperature:g}"].pop("solved"), out[f"trained_T{temperature:g}"].pop("solved")
        out[f"gained_T{temperature:g}"] = sum(b < c for b, c in zip(before, after, strict=True))
        out[f"lost_T{temperature:g}"] = sum(b > c for b, c in zip(before, after, strict=True))
        if temperature == 0.0:
            fixed = [i for i, (b, c) in enumerate(zip(before, after, strict=True)) if c and not b][: a.examples]
            out["examples_greedy"] = [
                {
                    "puzzle": items[i][1]["puzzle"],
                    "solution": items[i][1]["solution"],
                    "base": texts["base", 0.0][i],
                    "trained": texts["trained", 0.0][i],
                }
                for i in fixed
            ]
    print(json.dumps(out, indent=1))
    run = a.checkpoint.resolve().parents[1]  # the training run the checkpoint belongs to: its curve and wall time
    if (run / "summary.json").is_file():
        summary = json.loads((run / "summary.json").read_text())
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        out["run"] = {
            "wall_seconds": summary.get("wall_seconds_this_process"),
            "iterations": summary.get("iterations_completed"),
            "greedy_accuracy_curve": [[r["step"], r["eval/reward/mean"]] for r in rows if "eval/reward/mean" in r],
        }
    record.write(a.record, {**record.stamp(record.this_command()), "checkpoint": str(a.checkpoint), "puzzles": len(items), **out})


if __name__ == "__main__":
    main()
