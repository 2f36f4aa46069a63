"""bench/dllm_rollout_speed.py in its ``--quick`` mode (the three cases on the embedded and tiny models): it runs, its
record has the numbers it prints, and at temperature 0 flowrl's masked-diffusion rollout (full sequence and block
cache) gives the tokens of the plain LLaDA reference loop, and flowrl's entropy-bound sampler gives transformers'
``generate``'s from the same seed. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_mode_runs_and_tokens_match(tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "dllm_rollout_speed.py"), "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["threads"] == 1 and rec["date"] and rec["command"] and rec["machine"]["torch"]
    cases = {c["case"]: c for c in rec["cases"]}
    assert set(cases) == {"arith_mdlm", "arith_bd3lm", "diffusion_gemma_tiny"}
    assert cases["arith_mdlm"]["tokens_equal"] == {"flowrl full sequence T=0 == reference loop T=0": True}
    assert cases["arith_bd3lm"]["tokens_equal"] == {
        "flowrl full sequence T=0 == reference loop T=0": True,
        "flowrl block cache T=0 == reference loop T=0": True,
    }
    assert cases["diffusion_gemma_tiny"]["tokens_equal"] == {"flowrl, one generator == transformers generate (same seed)": True}
    bd = cases["arith_bd3lm"]["modes"]
    # the cache runs fewer rows than the full sequence: the prompt once, then the current block (and the one just finished)
    batch, prompt, gen, block, steps = 4, 24, 16, 4, 16
    assert bd["flowrl full sequence T=0"]["forward_rows"] == bd["reference loop T=0"]["forward_rows"] == steps * batch * (prompt + gen)
    blocks = gen // block
    assert bd["flowrl block cache T=0"]["forward_rows"] == batch * (prompt + steps * block + (blocks - 1) * block)
    for case in cases.values():
        for mode, v in case["modes"].items():
            assert v["tokens_per_s"] > 0 and v["forward_rows"] > 0, mode
            assert abs(sum(v["profile"]["phases_share"].values()) - 1) < 0.02, mode  # the phases cover the run
            if "reference" in v:
                assert v["speed_x_reference"] > 0
    assert "tokens equal" in proc.stdout and "x ref" in proc.stdout
