"""4x4 Sudoku in a compact format for the embedded Sudoku LM (``sudoku_mdlm``): training puzzles generated from the
288 valid grids, the shared test file (d1's 500 puzzles) as the held-out set, and a word-level tokenizer.

    prompt:     "3 1 0 2 2 0 0 0 0 2 1 0 0 3 2 0"                       (the puzzle, 0 = empty, row by row)
    completion: "<answer> 3 1 4 2 2 4 3 1 1 2 1 3 1 3 2 4 </answer>"     (the 16 cells of the solution)

flowrl's ``SudokuReward`` grades the completion as it grades d1's: the digits of the ``<answer>`` block, read as
16 cells. Training puzzles have the test puzzles' shape (8 clues, exactly one solution) and never equal a puzzle
of the shared test file (``train_puzzles`` reads it to exclude them), so the held-out accuracy is measured on
puzzles the model never saw. ``sudoku_violations`` is the solution-free check the verifier of inference scaling uses.
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache
from typing import Any

from ..errors import FlowRLError

PROMPT_LEN = 16
COMPLETION_LEN = 18  # <answer>, 16 cells, </answer>
CLUES = 8  # every puzzle of the shared test file has 8 clues
SPECIALS = ["[PAD]", "[UNK]", "[MASK]", "[EOS]"]
# the 12 groups of 4 cells that must hold 1-4 once each: rows, columns, 2x2 boxes
UNITS = (
    [[4 * r + c for c in range(4)] for r in range(4)]
    + [[4 * r + c for r in range(4)] for c in range(4)]
    + [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
)


@lru_cache(maxsize=1)
def all_grids() -> tuple[str, ...]:
    """The 288 valid 4x4 Sudoku grids as 16-digit strings, sorted: rows stacked one permutation of 1-4 at a time,
    a row kept only when no column or box then holds a digit twice (the last check counts every unit)."""
    rows = ["".join(p) for p in itertools.permutations("1234")]
    partial = [""]
    for _ in range(4):
        partial = [g + r for g in partial for r in rows if _no_repeat(g + r)]
    return tuple(sorted(g for g in partial if sudoku_violations(g) == 0))


def _no_repeat(cells: str) -> bool:
    """Whether no unit repeats a digit among the filled leading cells."""
    for unit in UNITS:
        seen = [cells[i] for i in unit if i < len(cells)]
        if len(seen) != len(set(seen)):
            return False
    return True


def sudoku_violations(grid: str) -> int:
    """How many of the 12 rows, columns and boxes do not hold 1-4 exactly once (0 for a solved grid)."""
    return sum(sorted(grid[i] for i in unit) != ["1", "2", "3", "4"] for unit in UNITS)


def consistent(grid: str, puzzle: str) -> bool:
    """Whether ``grid`` keeps every clue of ``puzzle`` (its non-zero cells)."""
    return all(p == "0" or p == g for p, g in zip(puzzle, grid, strict=True))


def solutions(puzzle: str) -> list[str]:
    """Every valid grid that keeps the puzzle's clues."""
    return [g for g in all_grids() if consistent(g, puzzle)]


def train_puzzles(n: int, seed: int, exclude: set[str], clues: int = CLUES) -> list[tuple[str, str]]:
    """``n`` distinct (puzzle, solution) pairs: a random grid, ``clues`` random cells kept, only puzzles with one
    solution and none in ``exclude`` (the held-out puzzles); deterministic in seed."""
    rng, grids, out, seen = random.Random(seed), all_grids(), [], set(exclude)
    while len(out) < n:
        grid = rng.choice(grids)
        keep = set(rng.sample(range(16), clues))
        puzzle = "".join(c if i in keep else "0" for i, c in enumerate(grid))
        if puzzle in seen or len(solutions(puzzle)) != 1:
            continue
        seen.add(puzzle)
        out.append((puzzle, grid))
    return out


def prompt_text(puzzle: str) -> str:
    return " ".join(puzzle)


def completion_text(solution: str) -> str:
    return f"<answer> {' '.join(solution)} </answer>"


def example(puzzle: str, solution: str) -> tuple[str, dict[str, Any]]:
    """(compact prompt, SudokuReward's metadata) of one puzzle."""
    return prompt_text(puzzle), {"puzzle": puzzle, "solution": solution}


def held_out(limit: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The shared test file's puzzles (``$FLOWRL_DATA_DIR/sudoku_4x4_test.csv``) in the compact format."""
    from .text_tasks import load_sudoku

    return [example(m["puzzle"], m["solution"]) for _, m in load_sudoku(limit=limit)]


def training_set(n: int, seed: int = 0, clues: int = CLUES) -> list[tuple[str, dict[str, Any]]]:
    """``n`` generated training puzzles with ``clues`` clues, none of them a puzzle of the shared test file (which
    must exist)."""
    exclude = {m["puzzle"] for _, m in held_out()}
    if not exclude:
        raise FlowRLError("the shared Sudoku test file has no puzzles; the training puzzles cannot exclude them.")
    return [example(p, s) for p, s in train_puzzles(n, seed, exclude, clues)]


def vocabulary() -> list[str]:
    return SPECIALS + ["0", "1", "2", "3", "4", "<answer>", "</answer>"]


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` with [MASK] and [EOS] (saved with the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocabulary())}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]", eos_token="[EOS]", padding_side="left"
    )
