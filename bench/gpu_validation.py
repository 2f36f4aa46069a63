"""The GPU validation: what a session runs first when a GPU is lent (about 15 minutes of device time, one H100 / H200).

    bash bench/gpu_validation.sh [--out DIR]          # on the GPU machine: wheels from .whl/, then this script
    python bench/gpu_validation.py --dry-run --out DIR  # the same path at tiny size on the CPU (tests/test_gpu_validation.py)

Four steps, each in its own process with its own time limit, each recorded whatever the others do:

1. the machine: torch, CUDA, the card's name and memory, bf16, the scaled-dot-product attention backends available;
2. one real-size GRPO iteration per family, random weights in bf16 with LoRA and gradient checkpointing at the
   preset's resolution (``bench/real_size_iteration.py``: SD3.5-Medium, FLUX.2-klein-4B, Z-Image-Turbo), its peak GPU
   memory beside docs/distributed.md's computed figure and its seconds per iteration;
3. deterministic mode (``train.deterministic: true``): two 2-iteration runs of the digits preset on the device, twice,
   and whether the two runs' weights hash the same;
4. the suite's CUDA-only tests (``CUDA_TESTS``; ``tests/test_gpu_validation.py`` checks that the list is every test
   the suite skips without CUDA).

Writes ``gpu_validation.json`` (every number, for bench/RESULTS.md) and ``gpu_validation.md`` (the table a person reads)
to ``--out``. ``--dry-run`` runs every step on the CPU at tiny size, so the path is tested where there is no GPU; its
numbers mean nothing. Nothing here is a GPU claim unless the JSON's ``machine.cuda`` is true.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # flowrl from this checkout (the GPU machine has it only here)
FAMILIES = ("sd3", "flux2_klein", "z_image")  # the three: SD3.5-Medium, FLUX.2-klein-4B, Z-Image-Turbo
CUDA_TESTS = ("tests/test_failure_behaviour.py::test_a_named_gpu_is_honoured",)
MACHINE = """
import json, torch
cuda = torch.cuda.is_available()
info = {"torch": torch.__version__, "cuda": cuda, "cuda_version": torch.version.cuda}
if cuda:
    p = torch.cuda.get_device_properties(0)
    b = torch.backends.cuda
    info.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1), capability=list(torch.cuda.get_device_capability(0)),
                bf16=torch.cuda.is_bf16_supported(), sdpa={"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
                "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()})
print(json.dumps(info))
"""


def run_step(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run one step's process; its last stdout line as JSON when it is one, else the output's tail."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:.0f} s", "seconds": round(time.perf_counter() - start, 1)}
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        return {"status": f"failed (exit {proc.returncode})", "seconds": seconds, "stderr_tail": proc.stderr[-1500:]}
    lines = proc.stdout.strip().splitlines()
    try:
        return {"status": "ok", "seconds": seconds, "result": json.loads(lines[-1])}
    except (IndexError, json.JSONDecodeError):
        return {"status": "ok", "seconds": seconds, "stdout_tail": proc.stdout[-1500:]}


def child_env(threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def real_size_iterations(args) -> dict:
    """One bf16 LoRA iteration per family (tiny on the CPU with --dry-run); what bench/real_size_iteration.py prints."""
    out = {}
    for family in args.families:
        cmd = [sys.executable, str(REPO / "bench" / "real_size_iteration.py"), "--family", family]
        cmd += ["--size", "tiny", "--device", "cpu"] if args.dry_run else ["--device", "cuda"]
        step = run_step(cmd, args.family_timeout, child_env(2 if args.dry_run else None))
        result = step.pop("result", None) or {}
        keep = ("transformer_params", "lora_params", "resolution", "steps", "samples", "iteration_s", "peak_gpu_memory_gib",
                "peak_gpu_memory_forward_backward_gib", "docs_table_gib", "loss_finite")  # fmt: skip
        out[family] = {**step, **{k: result[k] for k in keep if k in result}}
        out[family]["denoiser"] = {k: v for k, v in result.get("denoiser", {}).items() if k.endswith("_s")}
    return out


def weights_hash(run: Path) -> str:
    """SHA-256 over the final checkpoint's safetensors files, in name order."""
    from flowrl.training.run_summary import latest_checkpoint

    digest = hashlib.sha256()
    for f in sorted(latest_checkpoint(run).glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def deterministic_runs(args) -> dict:
    """Two 2-iteration runs of digits/grpo with train.deterministic: true on the device; equal weights or not."""
    device = "cpu" if args.dry_run else "cuda"
    runs, hashes = [], []
    for i in (0, 1):
        run = args.out / f"deterministic_{i}"
        cmd = [sys.executable, "-m", "flowrl.cli", "train", "digits/grpo", "train.iterations=2", "train.deterministic=true",
               f"pipeline.device={device}", "eval.every=0", "log.progress=false", "log.trackers=[]", f"output_dir={run}", "--json"]  # fmt: skip
        step = run_step(cmd, args.family_timeout, child_env())
        runs.append({k: v for k, v in step.items() if k != "result"})
        hashes.append(weights_hash(run) if step["status"] == "ok" else None)
    equal = hashes[0] is not None and hashes[0] == hashes[1]
    return {"device": device, "runs": runs, "weights_sha256": hashes, "bit_identical": equal}


def cuda_tests(args) -> dict:
    """The suite's CUDA-only tests, run with pytest (they skip, and say so, where there is no CUDA)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS]
    step = run_step(cmd, args.family_timeout, child_env())
    step["tests"] = list(CUDA_TESTS)
    step["pytest"] = (step.get("stdout_tail") or "").strip().splitlines()[-1:]  # e.g. "1 passed in 3.1s" / "1 skipped"
    return step


def summary_table(record: dict) -> str:
    """The markdown a person reads (and bench/RESULTS.md takes), from the record."""
    m = record["machine"].get("result", {})
    lines = [
        f"GPU validation {record['date']}: {m.get('device', 'no CUDA device (CPU)')}, torch {m.get('torch')}, "
        f"CUDA {m.get('cuda_version')}{' (dry run: tiny sizes on the CPU; the numbers mean nothing)' if record['dry_run'] else ''}",
        "",
        "| family | status | resolution | peak GPU GiB (docs table) | s / iteration | forward / backward s |",
        "|---|---|---|---|---|---|",
    ]
    for family, r in record["real_size"].items():
        d = r.get("denoiser", {})
        lines.append(
            f"| {family} | {r['status']} | {r.get('resolution', '')} | {r.get('peak_gpu_memory_gib', '-')} "
            f"({r.get('docs_table_gib', '-')}) | {r.get('iteration_s', '-')} | {d.get('forward_grad_s', '-')} / {d.get('backward_s', '-')} |"
        )
    det = record["deterministic"]
    lines += [
        "",
        f"Deterministic mode on {det['device']}: two runs' weights {det['weights_sha256']}, bit-identical: {det['bit_identical']}.",
    ]
    tests = record["cuda_tests"]
    lines.append(f"CUDA-only tests ({len(tests['tests'])}): {tests['status']}, pytest: {' '.join(tests.get('pytest', []))}.")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU at tiny size (tests the path; no GPU numbers)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "runs" / "gpu_validation")))
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--family-timeout", type=float, default=150.0, help="seconds for each step's process")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": args.dry_run}
    record["machine"] = run_step([sys.executable, "-c", MACHINE], 120)
    record["real_size"] = real_size_iterations(args)
    record["deterministic"] = deterministic_runs(args)
    record["cuda_tests"] = cuda_tests(args)
    (args.out / "gpu_validation.json").write_text(json.dumps(record, indent=1) + "\n")
    table = summary_table(record)
    (args.out / "gpu_validation.md").write_text(table + "\n")
    print(table)
    print(json.dumps({"out": str(args.out), "all_ok": all_ok(record)}))
    return 0 if all_ok(record) else 1


def all_ok(record: dict) -> bool:
    steps = [record["machine"], *record["real_size"].values(), *record["deterministic"]["runs"], record["cuda_tests"]]
    return all(s["status"] == "ok" for s in steps) and record["deterministic"]["bit_identical"]


if __name__ == "__main__":
    sys.exit(main())
