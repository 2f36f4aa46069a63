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


BEFORE_41 = json.loads((REPO / "tests" / "goldens" / "search_specs_before_41.json").read_text())
# what each spec ran as, named as the sections name it since issue #41 (the setting it did not record: as it ran)
RAN_AS = {
    "digits_rbf": {"name": "rbf_rollover", "m": 2},
    "digits_svdd": {"name": "svdd", "m": 2, "last_step": "best_of_m"},
    "dllm_svdd": {"name": "svdd", "m": 2, "last_step": "best_of_m", "select": "likelihood"},
}


@pytest.mark.parametrize("name", list(BEFORE_41))
@pytest.mark.slow
def test_a_spec_written_before_the_released_rbf_and_svdd_reruns_bit_for_bit(name, tmp_path, capsys):
    """Specs ``flowrl eval`` printed at 6aa652f (before issue #41 made ``rbf`` the released FlowRBF and SVDD's last step
    the released one): ``rbf`` without ``chains`` runs flowrl's rollover variant, ``svdd`` without ``last_step`` the
    final best-of-M, and their numbers come back bit for bit under the names they were recorded with."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(BEFORE_41[name]["spec"]))
    assert main(["eval", "--spec", str(spec), "--out", str(tmp_path / "again.png")]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["reproduction"]["bit_for_bit"] and record["reproduction"]["moved"] == {}
    assert record["spec"]["result"] == BEFORE_41[name]["spec"]["result"]
    assert record["spec"]["method"] == RAN_AS[name]
    recorded = [d for d in record["reproduction"]["differing_fields"] if d.startswith("method.")]
    assert recorded == [
        f"method.{d}" for d in {"digits_rbf": ['name: "rbf" -> "rbf_rollover"']}.get(name, ['last_step: null -> "best_of_m"'])
    ]


def test_a_method_without_the_settings_issue_41_added_means_what_it_ran():
    from flowrl.inference.sections import as_recorded

    assert as_recorded({"name": "rbf", "m": 4}) == {"name": "rbf_rollover", "m": 4}
    assert as_recorded({"name": "rbf", "m": 4, "chains": 2, "init_particles": 25}) == {
        "name": "rbf",
        "m": 4,
        "chains": 2,
        "init_particles": 25,
    }
    assert as_recorded({"name": "svdd", "m": 4}) == {"name": "svdd", "m": 4, "last_step": "best_of_m"}
    assert as_recorded({"name": "svdd", "m": 4, "last_step": "plain"})["last_step"] == "plain"
    for method in ({"name": "plain"}, {"name": "best_of", "n": 2}, {"name": "my_pkg.search:Mine", "k": 1}):
        assert as_recorded(method) == method
