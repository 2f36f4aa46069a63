"""Evaluation specs that ``flowrl eval`` printed before searches became parts (issue #38 item 4, at b257096) re-run
bit for bit with ``flowrl eval --spec``: their method names and settings (best_of with stop_at, smc with lambda,
ess_threshold, tempering and resampling, noise_search with rounds, neighbors and step, a diffusion LM's select rules)
are read by today's search sections. tests/goldens/search_specs_before_parts.json holds them, each with the command that
printed it (bench/eval_output_compare.py records the same commands and compares their whole output)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from flowrl.cli import main

SPECS = json.loads((REPO / "tests" / "goldens" / "search_specs_before_parts.json").read_text())


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.slow
def test_a_spec_written_before_searches_were_parts_reruns_bit_for_bit(name, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPECS[name]["spec"]))
    assert main(["eval", "--spec", str(spec), "--out", str(tmp_path / "again.png")]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["reproduction"]["bit_for_bit"] and record["reproduction"]["moved"] == {}
    assert record["spec"]["method"] == SPECS[name]["spec"]["method"]  # the same search, named as it was
    assert record["spec"]["result"] == SPECS[name]["spec"]["result"]
