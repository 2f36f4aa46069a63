"""Fingerprints of the shipped presets: did a change move any number?

Runs every preset that needs no hub weights (digits, digits_video, dllm, toy) for a few iterations with the
evaluation before and after, then `flowrl eval` and `flowrl sample` on one checkpoint, each in its own process on
one thread, and records a SHA-256 of every run's metrics (metrics.jsonl without the perf/* timings), of its final
weights, of the evaluation's printed record (without the spec's resolved config and environment) and of the samples. Two fingerprint files compare key by key: a refactoring that claims to change no number must leave every
fingerprint equal. Runs another checkout's code with ``--src`` (its flowrl is put first on the path), so a change
is measured against the commit before it:

    git worktree add /tmp/before HEAD~1
    python bench/preset_fingerprints.py --src /tmp/before --out before.json
    python bench/preset_fingerprints.py --out after.json --compare before.json

Diffusion-DPO's offline pairs are built first with the same code. About 5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GROUPS = ("digits", "digits_video", "dllm", "toy")
FAST = ["train.iterations=2", "eval.every=0", "log.trackers=[]", "log.progress=false", "log.checkpoint_every=0"]
EXTRA = {"dllm": ["prompts.eval_size=64"]}


def flowrl(src: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def metrics_digest(run: Path) -> str:
    rows = [
        {k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    return digest(json.dumps(rows, sort_keys=True).encode())


def weights_digest(run: Path) -> str:
    files = sorted((run / "checkpoints").glob("step_*/*.safetensors"))
    return digest(b"".join(f.name.encode() + f.read_bytes() for f in files))


def pairs_module(src: Path) -> str:
    """The pairs builder's module in that checkout (flowrl.preference_pairs before the preferences/ folder)."""
    return "flowrl.preferences.pairs" if (src / "flowrl" / "preferences").is_dir() else "flowrl.preference_pairs"


def eval_digest(stdout: str) -> str:
    """The digest of the record `flowrl eval` printed (its last line), every number and setting in it, less the spec's
    resolved config and environment (a config key a change adds with its default, or another library version, is not a
    number that moved) and the checkpoint's directory (a temporary one; its name stays)."""
    try:
        record = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return f"failed: {stdout.strip()[-200:]}"
    spec = record.get("spec", {})
    spec.pop("config", None)
    spec.pop("environment", None)
    model = spec.get("model", {})
    if model.get("checkpoint"):  # where the checkpoint is: a new temporary directory on every run
        model["checkpoint"] = Path(model["checkpoint"]).name
    return digest(json.dumps(record, sort_keys=True).encode())


def fingerprints(src: Path, work: Path) -> dict[str, str]:
    presets = sorted(p for p in (src / "configs").rglob("*.yaml") if p.relative_to(src / "configs").parts[0] in GROUPS)
    pairs = work / "pairs"
    proc = flowrl(src, src, "-m", pairs_module(src), "configs/digits/diffusion_dpo.yaml", "--num-prompts", "64", "--out", str(pairs))
    out: dict[str, str] = {
        "pairs": digest(b"".join(f.read_bytes() for f in sorted(pairs.rglob("*")) if f.is_file()))
        if proc.returncode == 0
        else f"failed: {proc.stderr.strip()[-200:]}"
    }
    for preset in presets:
        name = str(preset.relative_to(src / "configs").with_suffix(""))
        run = work / name.replace("/", "_")
        extra = EXTRA.get(name.split("/")[0], []) + ([f"prompts.pairs={pairs}"] if name == "digits/diffusion_dpo" else [])
        proc = flowrl(src, src, "-m", "flowrl.cli", "train", str(preset), *FAST, f"output_dir={run}", *extra)
        if proc.returncode != 0:
            out[name] = f"failed: {proc.stderr.strip()[-200:]}"
        else:
            out[name] = f"metrics {metrics_digest(run)} weights {weights_digest(run)}"
        print(f"{name:<32} {out[name]}", flush=True)
    checkpoint = work / "digits_grpo" / "checkpoints" / "step_000002"
    evaluated = flowrl(src, src, "-m", "flowrl.cli", "eval", str(checkpoint))
    out["eval digits/grpo"] = eval_digest(evaluated.stdout)
    flowrl(
        src, src, "-m", "flowrl.cli", "sample", str(checkpoint), "--prompt", "a handwritten seven", "-n", "4", "--out", str(work / "s.npy")
    )
    out["sample digits/grpo"] = digest((work / "s.npy").read_bytes()) if (work / "s.npy").is_file() else "failed"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=REPO, help="the checkout whose code runs (default: this one)")
    p.add_argument("--out", type=Path, help="write the fingerprints as JSON")
    p.add_argument("--compare", type=Path, help="a fingerprint file to compare with, key by key")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = fingerprints(args.src.resolve(), Path(tmp))
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        moved = sorted(k for k in set(before) | set(found) if before.get(k) != found.get(k))
        for key in moved:
            print(f"MOVED {key}: {before.get(key)} -> {found.get(key)}")
        print(f"fingerprints_equal={len(found) - len(moved)}/{len(found)}")
        return 1 if moved else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
