"""A search from a user's package outside the repository, run by ``flowrl eval --search`` in a subprocess.

The package is written to a temporary directory with a real ``*.dist-info`` (so ``importlib.metadata`` finds its entry
point in the group ``flowrl.searches``) and its search is the example of docs/inference_scaling.md ("A search is a
part"), read from the page itself, so the page cannot drift from the code. Named by import path and by entry point, it
gives exactly the numbers of flowrl's own ``--best-of`` on the same model (the same candidates: the same streams and
batches), its counted cost is best-of-N's formula, and its printed spec re-runs bit for bit. A plain class registered
with ``flowrl.register_search`` runs too, and a bad setting or a model it cannot search is one sentence.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import CONFIGS, REPO

import flowrl
from flowrl.errors import FlowRLError

GRPO = str(CONFIGS / "digits" / "grpo.yaml")
P, BATCH, K, N = 20, 8, 4, 3  # 20 held-out items (prompts.eval_size=2 on digits) in batches of 8 (the last padded), 4 steps
SETTING = ["prompts.eval_size=2", "eval.samples_per_prompt=1", f"eval.num_inference_steps={K}", f"eval.batch_size={BATCH}"]

PLAIN_CLASS = '''
import torch

from flowrl.inference import SearchOutcome
from flowrl.inference.candidates import sample_and_score
from flowrl.samplers.rollout import start_noise


class FirstCandidate:
    """Not a section: its constructor's keywords are its settings. Keeps each item's first candidate."""

    def __init__(self, label: str = "first"):
        self.label = label

    def search(self, model, verifier, items):
        got = sample_and_score(model, verifier, items, start_noise(model.pipeline, len(items), items.streams), items.streams)
        return SearchOutcome(metrics={f"eval/reward/mean@{self.label}": float(got.scores.mean())}, samples=got.samples)
'''


def docs_example() -> str:
    """The python block under "A search is a part" in docs/inference_scaling.md, as written there."""
    text = (REPO / "docs" / "inference_scaling.md").read_text()
    section = text[text.index("## A search is a part") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """my_searches on a directory outside the repository, its search declared as an entry point."""
    root = tmp_path_factory.mktemp("outside_search")
    pkg = root / "my_searches"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "searches.py").write_text(docs_example())
    (pkg / "plain.py").write_text(PLAIN_CLASS)
    info = root / "my_searches-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-searches\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""\
        [flowrl.searches]
        my_best_of = my_searches.searches:MyBestOfN
        """)
    )
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == "my_searches" or m.startswith("my_searches.")]:
        del sys.modules[name]


def _flowrl_eval(root, tmp_path, *args) -> dict:
    """``flowrl eval ARGS`` in a fresh process with the outside package on its path; its printed record."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "eval", *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def best_of(tmp_path_factory):
    """flowrl's own --best-of N on the same setting (in this process)."""
    from flowrl.cli import main

    tmp = tmp_path_factory.mktemp("best_of")
    out = tmp / "best.png"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["eval", GRPO, *SETTING, f"output_dir={tmp / 'run'}", "--best-of", str(N), "--out", str(out)]) == 0
    return json.loads(printed.getvalue().strip().splitlines()[-1]), _sha(out)


@pytest.mark.slow
def test_a_search_from_an_outside_package_runs_by_import_path_and_entry_point(outside, best_of, tmp_path):
    ours, grid = best_of
    run = [GRPO, *SETTING, f"output_dir={tmp_path / 'run'}"]
    by_path = _flowrl_eval(outside, tmp_path, *run, "--search", "my_searches.searches:MyBestOfN", f"n={N}", "--out", "path.png")
    by_entry_point = _flowrl_eval(outside, tmp_path, *run, "--search", "my_best_of", f"n={N}", "--out", "entry.png")
    key = f"eval/reward/mean@my_best_of{N}"
    for record, name in ((by_path, "my_searches.searches:MyBestOfN"), (by_entry_point, "my_best_of")):
        assert record["spec"]["method"] == {"name": name, "n": N}
        # the same candidates as flowrl's best-of-N: its best reward and its chosen samples, bit for bit
        assert record["spec"]["result"][key] == ours["spec"]["result"][f"eval/reward/mean@{N}"]
        assert record[key] == ours[f"eval/reward/mean@{N}"]
        assert _sha(tmp_path / record["grid"]) == grid
        # counted by flowrl's meter: N rounds of ceil(P / batch) padded batches of K steps; every real row scored once
        batches = math.ceil(P / BATCH)
        cost = record["cost"]
        assert cost["items"] == P
        assert (cost["denoiser_rows"], cost["denoiser_calls"]) == (N * batches * BATCH * K, N * batches * K)
        assert (cost["verifier_rows"], cost["verifier_calls"]) == (N * P, N * batches)
        assert {k: cost[k] for k in ("denoiser_rows", "verifier_rows")} == {k: ours["cost"][k] for k in ("denoiser_rows", "verifier_rows")}
        assert record["settings"] == ours["settings"]  # the plain evaluation's ODE sampler: not stochastic
    # the printed spec re-runs bit for bit in a fresh process
    (tmp_path / "spec.json").write_text(json.dumps(by_path))
    again = _flowrl_eval(outside, tmp_path, "--spec", "spec.json", "--out", "again.png")
    assert again["reproduction"]["bit_for_bit"] and again["reproduction"]["differing_fields"] == []


@pytest.mark.slow
def test_a_registered_plain_class_and_bad_settings(outside, best_of, tmp_path, capsys):
    from my_searches.plain import FirstCandidate

    from flowrl.cli import main
    from flowrl.config import load_config
    from flowrl.eval_command import run_evaluation

    ours, _ = best_of
    flowrl.register_search("first_candidate", FirstCandidate)
    try:
        config = load_config(GRPO, [*SETTING, f"output_dir={tmp_path / 'run'}"])
        record = run_evaluation(config, None, {"name": "first_candidate", "label": "zeroth"}, tmp_path / "first.png")
        # candidate 0 of every item is best-of-N's first candidate: best-of-1
        assert record["spec"]["result"]["eval/reward/mean@zeroth"] == ours["spec"]["result"]["eval/reward/mean@1"]
        assert record["spec"]["method"] == {"name": "first_candidate", "label": "zeroth"}
        assert record["cost"]["verifier_rows"] == P and record["cost"]["denoiser_rows"] == math.ceil(P / BATCH) * BATCH * K
        with pytest.raises(FlowRLError, match=r"^search 'first_candidate': n is not one of its settings \(label\)\.$"):
            run_evaluation(config, None, {"name": "first_candidate", "n": 2}, tmp_path / "x.png")
        with pytest.raises(FlowRLError, match="already registered"):
            flowrl.register_search("first_candidate", FirstCandidate)
    finally:
        from flowrl.inference import SEARCHES

        SEARCHES.unregister("first_candidate")
    # bad settings and a model the search cannot search: one sentence, before any model loads
    for args, sentence in (
        ([GRPO, "--search", "my_best_of", "n=0"], "search 'my_best_of': n must be at least 1, got 0."),
        ([GRPO, "--search", "my_best_of", "m=2"], "search 'my_best_of': m is not one of its settings (n)."),
        ([GRPO, "--search", "my_searches.searches:Missing"], "module 'my_searches.searches' has no attribute 'Missing'"),
        (
            [str(CONFIGS / "dllm" / "diffu_grpo.yaml"), "--search", "my_best_of"],
            "--search my_best_of searches image and video models; this run's model is a diffusion LM.",
        ),
    ):
        assert main(["eval", *args]) == 2
        assert sentence in capsys.readouterr().err
