"""docs/results.md is what bench/results_page.py renders from the measurement records, every record carries its
provenance, and the words beside the numbers carry no number of their own."""

from __future__ import annotations

import json
import re
import sys

import yaml
from conftest import REPO

from flowrl.presets import preset_names

sys.path.insert(0, str(REPO / "bench"))
import results_page  # noqa: E402  (bench/results_page.py)

RESULTS = REPO / "bench" / "results"


def test_the_page_is_the_records_rendered():
    assert (REPO / "docs" / "results.md").read_text() == results_page.render(), "run python bench/results_page.py --write"


def test_every_record_names_its_date_machine_command_and_commit():
    records = json.loads((RESULTS / "preset_results.json").read_text())["presets"]
    assert set(records) <= set(preset_names()) and len(records) >= 20
    for name, r in records.items():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]) and r["commit"], name
        assert r["command"].endswith(f"flowrl train configs/{name}.yaml"), name
        assert {"cpu", "cores", "load_1min", "torch"} <= set(r["machine"]), name
        assert r["before"]["eval/reward/mean"] is not None and r["curve"][0][1] == r["before"]["eval/reward/mean"], name


def test_notes_carry_words_not_numbers():
    notes = yaml.safe_load((RESULTS / "notes.yaml").read_text())
    assert set(notes) <= set(preset_names())
    for name, text in notes.items():
        assert not re.search(r"\d\.\d|\d+ ?(s|%)\b", text), f"{name}: a number in a note; it belongs in a record"
