"""The shipped presets that need no hub weights, each trained as shipped: the held-out evaluation before and after,
with its components, the wall time and the samples it took, into bench/results/preset_results.json.

    python bench/preset_results.py                          # every such preset (about an hour on one core)
    python bench/preset_results.py digits/grpo dllm/bgpo    # some; the others' records are kept

Each preset runs as a user runs it (``flowrl train NAME --json`` in its own process, one torch thread, a temporary
output directory); Diffusion-DPO's offline pairs are built first with the command its preset names. Each preset's
record carries its own date, machine, load and commit, since a full pass takes long enough for those to change.
docs/results.md is generated from the file (bench/results_page.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

NAME = "preset_results"
GROUPS = ("digits", "digits_video", "dllm", "toy")  # the presets whose weights ship with flowrl
PAIRS = {"digits/diffusion_dpo": ["-m", "flowrl.preferences.pairs", "configs/digits/diffusion_dpo.yaml", "--num-prompts", "1024"]}


def shipped_presets() -> list[str]:
    return sorted(f"{p.parent.name}/{p.stem}" for g in GROUPS for p in (record.REPO / "configs" / g).glob("*.yaml"))


def run(args: list[str], cwd: Path) -> tuple[float, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def evaluations(run_dir: Path) -> list[dict]:
    """The run's evaluation rows from metrics.jsonl: every eval/* number with its iteration."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {"step": r["step"], **{k: v for k, v in r.items() if k.startswith("eval/") and not k.startswith("eval/perf")}}
        for r in rows
        if r.get("eval/reward/mean") is not None
    ]


def measure(preset: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        command, stamp = f"flowrl train configs/{preset}.yaml", None
        pairs_s = None
        if preset in PAIRS:
            pairs = PAIRS[preset] + ["--out", str(work / "pairs")]
            pairs_s, _ = run(pairs, record.REPO)
            command = f"python {' '.join(PAIRS[preset])} --out pairs/digits_flow; {command}"
        stamp = record.stamp(command)
        overrides = [f"output_dir={work / 'run'}", "log.trackers=[]", "log.progress=false"]
        if preset in PAIRS:
            overrides.append(f"prompts.pairs={work / 'pairs'}")
        seconds, stdout = run(["-m", "flowrl.cli", "train", preset, *overrides, "--json"], record.REPO)
        summary = json.loads(stdout.strip().splitlines()[-1])
        evals = evaluations(work / "run")
    return {
        **stamp,
        "preset": preset,
        "iterations": summary["iterations_completed"],
        "samples_per_iteration": summary["samples_per_iteration"],
        "wall_s": round(seconds, 1),
        "pairs_wall_s": None if pairs_s is None else round(pairs_s, 1),
        "before": evals[0] if evals else None,
        "after": evals[-1] if len(evals) > 1 else None,
        "curve": [[e["step"], e["eval/reward/mean"]] for e in evals],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("presets", nargs="*", help="preset names (default: every preset that needs no hub weights)")
    a = p.parse_args()
    presets = a.presets or shipped_presets()
    unknown = sorted(set(presets) - set(shipped_presets()))
    if unknown:
        raise SystemExit(f"not a preset that runs without hub weights: {', '.join(unknown)}")
    results = record.read(NAME) or {"about": __doc__.split("\n\n")[0], "presets": {}}
    for preset in presets:
        print(f"{preset} ...", flush=True)
        results["presets"][preset] = measure(preset)
        results["presets"] = dict(sorted(results["presets"].items()))
        record.write(NAME, results)  # after each preset: an interrupted pass keeps what it measured
        r = results["presets"][preset]
        b, e = (r["before"] or {}).get("eval/reward/mean"), (r["after"] or {}).get("eval/reward/mean")
        print(json.dumps({"preset": preset, "before": b, "after": e, "wall_s": r["wall_s"]}), flush=True)


if __name__ == "__main__":
    main()
