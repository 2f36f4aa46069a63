"""The embedded math task's data: disjoint splits, and the SFT data's careless answers (flaw_rate)."""

from __future__ import annotations

import json
import re

from conftest import REPO

from flowrl.data.arith import problems


def test_splits_are_disjoint_and_solutions_are_right():
    train, held_out = problems("train", 2000, 0), problems("eval", 500, 0)
    assert not {p for p, _ in train} & {p for p, _ in held_out}
    for _, meta in train + held_out:
        for a, op, b, c in re.findall(r"(\d+) ([+-]) (\d+) = (\d+)", meta["solution"]):
            assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert re.search(r"<answer> (\d+) </answer>", meta["solution"]).group(1) == meta["answer"]


def test_flawed_sft_data_keeps_the_problems_and_the_working_and_moves_only_the_answer_by_one():
    clean, flawed = problems("train", 4000, 0), problems("train", 4000, 0, flaw_rate=0.3)
    assert [p for p, _ in clean] == [p for p, _ in flawed]
    changed = 0
    for (_, c), (_, f) in zip(clean, flawed):
        assert f["answer"] == c["answer"]
        if f["solution"] != c["solution"]:
            changed += 1
            working = c["solution"].split(" <answer>")[0]
            assert f["solution"].startswith(working + " <answer>")
            written = int(re.search(r"<answer> (\d+) </answer>", f["solution"]).group(1))
            assert abs(written - int(c["answer"])) == 1
    assert 0.28 < changed / 4000 < 0.32


def test_shipped_model_records_how_it_was_trained():
    info = json.loads((REPO / "flowrl" / "assets" / "arith_mdlm" / "training_info.json").read_text())
    assert info["command"] == "python -m flowrl.pipelines.embedded.train_arith --steps 1000 --seed 0 --flaw-rate 0.3"
    assert (info["steps"], info["flaw_rate"], info["train_problems"]) == (1000, 0.3, 4000)
