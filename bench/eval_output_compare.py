"""Does ``flowrl eval`` print the same thing from two source trees? (issue #38, item 4: search becomes a part and
every ``flowrl eval`` flag keeps its output.)

``record`` runs a fixed set of ``flowrl eval`` invocations (every search flag, image and diffusion-LM, plain, and a
few refusals) with one tree on the Python path and writes what each printed: exit status, stdout, stderr's last
line, and the sha256 of every file it wrote. ``compare`` reads two such records and says, invocation by invocation,
whether they are equal once the machine's clock is masked (every ``*seconds*`` number, and the spec's
``environment``, which describes the machine). ``respec`` re-runs, with the tree given, every spec the first record
printed (``flowrl eval --spec``) and says whether each came back bit for bit.

    python bench/eval_output_compare.py record --tree /tmp/search_before --out /tmp/evalcmp/before
    python bench/eval_output_compare.py record --tree /work/main --out /tmp/evalcmp/after
    python bench/eval_output_compare.py compare /tmp/evalcmp/before /tmp/evalcmp/after [--ignore spec.config.train.roles]
    python bench/eval_output_compare.py respec /tmp/evalcmp/before --tree /work/main --out /tmp/evalcmp/respec

Each invocation runs in ``OUT/work`` with ``configs`` linked from the tree, so the paths it prints are the same
from both trees. Small settings: the whole set takes a few minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

DIGITS = ["configs/digits/grpo.yaml", "prompts.eval_size=4", "eval.samples_per_prompt=2"]
VIDEO = ["configs/digits_video/grpo.yaml", "prompts.eval_size=2", "eval.samples_per_prompt=2"]
MASKED_IMAGE = ["configs/digits/masked_grpo.yaml", "prompts.eval_size=4", "eval.samples_per_prompt=2"]
DLLM = ["configs/dllm/diffu_grpo.yaml", "prompts.eval_size=8", "sampler.eval_temperature=1"]
GEMMA = ["configs/dllm/diffusion_gemma_step_grpo.yaml", "prompts.eval_size=4", "sampler.eval_temperature=1"]

# name -> arguments after `flowrl eval`
INVOCATIONS: dict[str, list[str]] = {
    "digits_plain": DIGITS,
    "digits_best_of": [*DIGITS, "--best-of", "4", "--out", "out/digits_best_of.png"],
    "digits_stop_at": [*DIGITS, "--best-of", "4", "--stop-at", "0.5", "--out", "out/digits_stop_at.png"],
    "digits_svdd": [*DIGITS, "--svdd", "2", "--out", "out/digits_svdd.png"],
    "digits_smc": [*DIGITS, "--smc", "4", "--out", "out/digits_smc.png"],
    "digits_smc_tuned": [*DIGITS, "--smc", "3", "--smc-lambda", "30", "--smc-ess-threshold", "1", "--out", "out/smc_tuned.png"],
    "digits_noise_search": [*DIGITS, "--noise-search", "1", "--out", "out/digits_noise.png"],
    "digits_noise_tuned": [*DIGITS, "--noise-search", "2", "--noise-neighbors", "2", "--noise-step", "0.3", "--out", "out/noise2.png"],
    "digits_rbf": [*DIGITS, "--rbf", "2", "--out", "out/digits_rbf.png"],
    "video_best_of": [*VIDEO, "--best-of", "2", "--out", "out/video_best_of.png"],
    "masked_image_best_of": [*MASKED_IMAGE, "--best-of", "2", "--out", "out/masked_best_of.png"],
    "dllm_plain": DLLM,
    "dllm_best_of": [*DLLM, "--best-of", "2", "--select", "majority,likelihood", "--out", "out/dllm_best_of.png"],
    "dllm_best_of_default": [*DLLM, "--best-of", "3", "--out", "out/dllm_best_of3.png"],
    "dllm_svdd": [*DLLM, "--svdd", "2", "--out", "out/dllm_svdd.png"],
    "dllm_smc": [*DLLM, "--smc", "2", "--out", "out/dllm_smc.png"],
    "dllm_smc_tuned": [
        *DLLM,
        "--smc",
        "2",
        "--smc-lambda",
        "2",
        "--smc-ess-threshold",
        "1",
        "--select",
        "likelihood",
        "--out",
        "out/s.png",
    ],
    "gemma_svdd": [*GEMMA, "--svdd", "2", "--out", "out/gemma_svdd.png"],
    "gemma_best_of": [*GEMMA, "--best-of", "2", "--out", "out/gemma_best_of.png"],
    # refusals: one sentence, exit 2
    "refuse_two_searches": [*DIGITS, "--best-of", "2", "--svdd", "2"],
    "refuse_best_of_zero": [*DIGITS, "--best-of", "0"],
    "refuse_noise_step": [*DIGITS, "--noise-search", "1", "--noise-step", "1.5"],
    "refuse_noise_neighbors_alone": [*DIGITS, "--noise-neighbors", "2"],
    "refuse_smc_lambda_alone": [*DIGITS, "--smc-lambda", "3"],
    "refuse_ess": [*DIGITS, "--smc", "2", "--smc-ess-threshold", "2"],
    "refuse_stop_at_alone": [*DIGITS, "--stop-at", "0.5"],
    "refuse_select_images": [*DIGITS, "--best-of", "2", "--select", "likelihood"],
    "refuse_stop_at_text": [*DLLM, "--best-of", "2", "--stop-at", "0.5"],
    "refuse_noise_text": [*DLLM, "--noise-search", "1"],
    "refuse_rbf_text": [*DLLM, "--rbf", "2"],
    "refuse_majority_svdd": [*DLLM, "--svdd", "2", "--select", "majority"],
    "refuse_gold_select": [*DLLM, "--best-of", "2", "--select", "math_answer"],
    "refuse_temperature_zero": ["configs/dllm/diffu_grpo.yaml", "prompts.eval_size=8", "--best-of", "2"],
    "refuse_gemma_smc": [*GEMMA, "--smc", "2"],
    "refuse_spec_with_flag": ["--spec", "nothing.json", "--best-of", "2"],
}

SECONDS = re.compile(r"seconds")
# a number of seconds in a printed line, e.g. "(0.123 s)", "wall 0.456 s (CPU 0.789 s)"; a library's log line's time
SECONDS_TEXT = re.compile(r"\d+\.\d+ s\b|^\[\d{4}-\d\d-\d\d [\d:,]+\]")


def _run(tree: Path, work: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "eval", *args], cwd=work, env=env, capture_output=True, text=True)
    stderr = [line for line in proc.stderr.splitlines() if line.strip()]
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr_last": stderr[-1] if stderr else ""}


def _files(work: Path) -> dict[str, str]:
    out = work / "out"
    return {str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*")) if p.is_file()}


def record(tree: Path, out: Path, names: list[str]) -> None:
    work = out / "work"
    (work / "out").mkdir(parents=True, exist_ok=True)
    if not (work / "configs").exists():
        (work / "configs").symlink_to(tree / "configs")
    records = {}
    for name in names:
        for p in (work / "out").glob("*"):
            p.unlink()
        result = _run(tree, work, INVOCATIONS[name])
        result["files"] = _files(work)
        records[name] = result
        print(f"{name}: exit {result['rc']}", flush=True)
    (out / "records.json").write_text(json.dumps(records, indent=1))


def _mask(value):
    """The value with the machine's clock and environment taken out."""
    if isinstance(value, dict):
        return {k: "<masked>" if SECONDS.search(k) or k == "environment" else _mask(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def _drop(record, paths: list[str]):
    """``record`` without the dotted ``paths``."""
    for path in paths:
        *parents, last = path.split(".")
        node = record
        for key in parents:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return record


def _differences(a, b, path: str = "") -> list[tuple[str, object, object]]:
    """(dotted path, before, after) of every value that differs between two parsed records."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d for k in dict.fromkeys([*a, *b]) for d in _differences(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}".lstrip("."))
        ]
    return [] if a == b else [(path, a, b)]


def _normal_stdout(stdout: str, ignore: list[str] = ()) -> list:
    lines = []
    for line in stdout.splitlines():
        try:
            lines.append(_drop(_mask(json.loads(line)), ignore))
        except json.JSONDecodeError:
            lines.append(SECONDS_TEXT.sub("<s>", line))
    return lines


def compare(before: Path, after: Path, ignore: list[str] = ()) -> int:
    """Invocation by invocation: equal once the clock is masked? ``ignore``: dotted paths in the printed records whose
    difference is someone else's change (a config key another change added), reported, not counted."""
    a, b = (json.loads((d / "records.json").read_text()) for d in (before, after))
    differing = 0
    for name in a:
        if name not in b:
            print(f"{name}: not recorded after")
            differing += 1
            continue
        ra, rb = a[name], b[name]
        ignored = [
            (p, va, vb) for la, lb in zip(_normal_stdout(ra["stdout"]), _normal_stdout(rb["stdout"])) for p, va, vb in _differences(la, lb)
        ]
        ignored = [d for d in ignored if d[0] in ignore]
        what = [
            part
            for part, same in (
                ("exit status", ra["rc"] == rb["rc"]),
                ("stdout", _normal_stdout(ra["stdout"], ignore) == _normal_stdout(rb["stdout"], ignore)),
                ("stderr's last line", ra["stderr_last"] == rb["stderr_last"]),
                ("files written", ra["files"] == rb["files"]),
            )
            if not same
        ]
        differing += bool(what)
        print(f"{name}: {'EQUAL' if not what else 'DIFFERS in ' + ', '.join(what)}" + (f" (ignored: {ignored[0][0]})" if ignored else ""))
        if "stdout" in what:
            for la, lb in zip(_normal_stdout(ra["stdout"]), _normal_stdout(rb["stdout"])):
                for path, va, vb in _differences(la, lb):
                    if path in ignore:
                        continue
                    print(f"    {path or 'line'}: before {str(va)[:300]}\n    {' ' * len(path or 'line')}  after  {str(vb)[:300]}")
        if "stderr's last line" in what:
            print(f"    before: {ra['stderr_last']}\n    after:  {rb['stderr_last']}")
    print(f"{len(a) - differing} of {len(a)} invocations equal (seconds and environment masked).")
    return 1 if differing else 0


def respec(before: Path, tree: Path, out: Path) -> int:
    """Every spec the first record printed, re-run from ``tree``: bit for bit?"""
    records = json.loads((before / "records.json").read_text())
    work = out / "work"
    (work / "out").mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, r in records.items():
        last = r["stdout"].strip().splitlines()[-1] if r["rc"] == 0 and r["stdout"].strip() else ""
        if not last.startswith("{") or "spec" not in json.loads(last):
            continue
        spec = work / f"{name}.json"
        spec.write_text(last)
        result = _run(tree, work, ["--spec", str(spec), "--out", f"out/{name}.png"])
        reproduced = result["rc"] == 0 and json.loads(result["stdout"].strip().splitlines()[-1])["reproduction"]["bit_for_bit"]
        failed += not reproduced
        print(f"{name}: {'reproduced bit for bit' if reproduced else 'NOT reproduced: ' + result['stderr_last']}", flush=True)
    print(f"{'all specs reproduced' if not failed else f'{failed} specs not reproduced'}.")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only", nargs="*", default=None, help="these invocations only")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--ignore", nargs="*", default=[], metavar="PATH", help="dotted paths of the records not compared (reported)")
    s = sub.add_parser("respec")
    s.add_argument("before", type=Path)
    s.add_argument("--tree", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.command == "record":
        record(args.tree.resolve(), args.out.resolve(), args.only or list(INVOCATIONS))
        return 0
    if args.command == "compare":
        return compare(args.before, args.after, args.ignore)
    return respec(args.before, args.tree.resolve(), args.out.resolve())


if __name__ == "__main__":
    sys.exit(main())
