"""The embedded 4x4 Sudoku task (flowrl/data/sudoku.py, train_sudoku.py, the sudoku_compact prompt source and
SudokuReward's solved grade): the grids and the solution-free check by hand, the training puzzles' shape and their
exclusion of the shared test puzzles, the script's determinism at tiny size."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.data import sudoku
from flowrl.data.text_tasks import SUDOKU_FILE, default_data_dir
from flowrl.errors import FlowRLError
from flowrl.reward_models.puzzles import SudokuReward

needs_data = pytest.mark.skipif(not (default_data_dir() / SUDOKU_FILE).is_file(), reason="shared data files not present")
SOLVED = "1234341221434321"


def test_there_are_288_grids_each_valid_and_distinct():
    grids = sudoku.all_grids()
    assert len(grids) == 288 == len(set(grids))  # the known count of 4x4 Sudoku grids
    assert SOLVED in grids and all(sudoku.sudoku_violations(g) == 0 for g in grids)


def test_violations_counted_by_hand():
    # every row 1234: the 4 rows pass; each column holds one digit 4 times (4 fail); each box holds 1,2,1,2 or 3,4,3,4 (4 fail)
    assert sudoku.sudoku_violations("1234" * 4) == 8
    # two cells of the first row swapped in a solved grid: row 0 and box 0 still hold 1-4; columns 0 and 1 fail
    assert sudoku.sudoku_violations("2134341221434321") == 2
    assert sudoku.consistent(SOLVED, "1000000000000001") and not sudoku.consistent(SOLVED, "2000000000000000")


def test_training_puzzles_have_8_clues_one_solution_and_skip_the_excluded():
    first = sudoku.train_puzzles(30, seed=3, exclude=set())
    assert first == sudoku.train_puzzles(30, seed=3, exclude=set())  # deterministic in seed
    for puzzle, solution in first:
        assert 16 - puzzle.count("0") == sudoku.CLUES and sudoku.solutions(puzzle) == [solution]
    excluded = {p for p, _ in first[:10]}
    again = sudoku.train_puzzles(30, seed=3, exclude=excluded)
    assert not excluded & {p for p, _ in again} and len({p for p, _ in again}) == 30


def test_compact_texts_are_the_tokens_the_model_reads():
    tok = sudoku.build_tokenizer()
    prompt, meta = sudoku.example("1200000000000000", SOLVED)
    ids = tok(f"{prompt} {sudoku.completion_text(SOLVED)}").input_ids
    assert len(ids) == sudoku.PROMPT_LEN + sudoku.COMPLETION_LEN and tok.unk_token_id not in ids
    assert meta == {"puzzle": "1200000000000000", "solution": SOLVED}


def test_solved_grade_scores_the_whole_grid_and_cells_grade_the_empty_cells():
    puzzle = "1200000000000000"  # 14 empty cells
    answer = "<answer> " + " ".join(SOLVED) + " </answer>"
    miscopied = "<answer> " + " ".join("2" + SOLVED[1:]) + " </answer>"  # a clue changed, every empty cell right
    one_wrong = "<answer> " + " ".join(SOLVED[:15] + "2") + " </answer>"
    meta = [{"puzzle": puzzle, "solution": SOLVED}] * 3
    cells = SudokuReward()([answer, miscopied, one_wrong], [""] * 3, meta).scores.tolist()
    assert cells == pytest.approx([1.0, 1.0, 13 / 14])
    solved = SudokuReward(grade="solved")([answer, miscopied, one_wrong], [""] * 3, meta)
    assert solved.scores.tolist() == [1.0, 0.0, 0.0] == solved.extras["solved"].tolist()
    assert math.isnan(SudokuReward(grade="solved")([answer], [""], [{}]).scores.item())
    with pytest.raises(FlowRLError, match="grade"):
        SudokuReward(grade="rows")


@needs_data
def test_training_set_excludes_every_test_puzzle_and_eval_is_the_test_file():
    from flowrl.prompts import prompt_pool

    held = prompt_pool("sudoku_compact", "eval", size=500)
    assert len(held) == 500 and held[0][0] == " ".join(held[0][1]["puzzle"])
    test_puzzles = {m["puzzle"] for _, m in held}
    train = sudoku.training_set(300)
    assert len(train) == 300 and not test_puzzles & {m["puzzle"] for _, m in train}


def test_missing_data_is_one_error_naming_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWRL_DATA_DIR", str(tmp_path))
    with pytest.raises(FlowRLError, match=SUDOKU_FILE):
        sudoku.training_set(5)


@needs_data
def test_training_script_is_deterministic_at_tiny_size(tmp_path):
    from safetensors.torch import load_file

    from flowrl.pipelines.embedded.train_sudoku import train

    torch.set_num_threads(1)
    for out in ("a", "b"):
        info = train(tmp_path / out, steps=3, batch_size=4, lr=1e-3, seed=0, num_puzzles=8, hidden=16, layers=1)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert info["steps"] == 3 and "train_sudoku" in info["command"]
    assert (tmp_path / "a" / "tokenizer.json").is_file()


def test_constraint_verifier_reads_the_puzzle_from_the_prompt_never_the_solution():
    from flowrl.reward_models.puzzles import SudokuConstraintReward

    prompt = " ".join("1200000000000000")
    answers = [
        "<answer> " + " ".join(SOLVED) + " </answer>",  # valid, keeps the clues: 1
        "<answer> " + " ".join("2134341221434321") + " </answer>",  # 2 units broken and both clues changed: 1 - 4/28
        "<answer> " + " ".join("1234" * 4) + " </answer>",  # 8 units broken, clues kept: 1 - 8/28
        "no answer",
    ]
    verifier = SudokuConstraintReward()
    scores = verifier(answers, [prompt] * 4, [{"solution": "0" * 16}] * 4).scores.tolist()  # metadata ignored
    assert scores == pytest.approx([1.0, 1 - 4 / 28, 1 - 8 / 28, 0.0])
    assert math.isnan(verifier(answers[:1], ["Solve the 4x4 puzzle 1200"], [{}]).scores.item())


@needs_data
def test_a_quarter_of_the_test_puzzles_have_several_solutions_and_the_verifier_accepts_each():
    from flowrl.reward_models.puzzles import SudokuConstraintReward

    held = sudoku.held_out()
    counts = [len(sudoku.solutions(m["puzzle"])) for _, m in held]
    # the grader knows one solution of each (the docs' caveat): 124 puzzles have more
    assert [counts.count(k) for k in (1, 2, 3, 4)] == [376, 115, 8, 1] and len(counts) == 500
    prompt, meta = next((p, m) for (p, m), c in zip(held, counts, strict=True) if c == 2)
    both = sudoku.solutions(meta["puzzle"])
    answers = [sudoku.completion_text(g) for g in both]
    assert SudokuConstraintReward()(answers, [prompt] * 2, [{}] * 2).scores.tolist() == [1.0, 1.0]
    assert sorted(SudokuReward(grade="solved")(answers, [prompt] * 2, [meta] * 2).scores.tolist()) == [0.0, 1.0]
