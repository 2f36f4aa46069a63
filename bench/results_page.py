"""docs/results.md, generated from the measurement records in bench/results/*.json (bench/record.py writes them):
every number on that page comes from a record, with the date, machine, load and command it was measured with.

    python bench/results_page.py --write    # regenerate docs/results.md
    python bench/results_page.py --check    # exit 1 when the page is not what the records give

What a preset's row means is said in bench/results/notes.yaml, in words only: a note carries no measured number
(tests/test_results_page.py checks it), so the page cannot drift from the records.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NOTES = RESULTS / "notes.yaml"
PAGE = REPO / "docs" / "results.md"
GROUP_TITLES = {
    "digits": "Text-to-digit images (embedded `digits_flow`, `digits_ddpm`, `digits_masked`)",
    "digits_video": "Text-to-digit video (embedded `digits_video`, CogVideoX classes)",
    "dllm": "Diffusion language models (embedded `arith_mdlm`, `arith_bd3lm`, a tiny DiffusionGemma)",
    "toy": "Two-dimensional toys with a closed-form target",
}


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def span(before: dict | None, after: dict | None, key: str) -> str:
    b, a = (before or {}).get(key), (after or {}).get(key)
    if b is None and a is None:
        return "-"
    return f"{fmt(b)} -> {fmt(a)}"


def components(r: dict) -> str:
    """Every reward component but the mean, and the held-out judge, before -> after."""
    keys = sorted(k for k in (r["before"] or {}) if k.startswith("eval/reward/") and k != "eval/reward/mean")
    keys += [k for k in ("eval/judge/mean", "eval/diversity") if k in (r["before"] or {})]
    return "<br>".join(f"{k.removeprefix('eval/').removeprefix('reward/')} {span(r['before'], r['after'], k)}" for k in keys)


def when(r: dict) -> str:
    return f"{r['date']}, load {r['machine']['load_1min']}, {r['commit']}"


def wall(r: dict) -> str:
    pairs = f" + {r['pairs_wall_s']:.0f} s pairs" if r.get("pairs_wall_s") else ""
    return f"{r['wall_s']:.0f} s{pairs}"


def preset_section(results: dict, notes: dict[str, str]) -> list[str]:
    lines = [
        "## The presets, trained as shipped",
        "",
        "Each preset that needs no hub weights, run as a user runs it (`flowrl train NAME`, one torch thread, its own",
        "process) with the held-out evaluation before and after: the preset's reward on prompts never trained on, with",
        "its components, the held-out judge (a reward never trained on) and the seed diversity where the preset has them.",
        "Wall times are the shared development machine's, with its 1-minute load average beside the run (2 cores: a load",
        "above 2 means other jobs were running), and the commit it ran at (`+dirty`: the working tree also held",
        "uncommitted edits, other work in progress that day).",
        "",
        "Re-measure: `python bench/preset_results.py [PRESET ...]`; regenerate this page: `python bench/results_page.py --write`.",
        "The two other 2-D toy presets (`toy/adjoint_matching_quadratic`, `toy/grpo_kl_linear`) are measured against their",
        "closed-form targets in [objectives/adjoint_matching.md](objectives/adjoint_matching.md) rather than here.",
        "",
    ]
    presets = results["presets"]
    for group, title in GROUP_TITLES.items():
        rows = {k: v for k, v in presets.items() if k.split("/")[0] == group}
        if not rows:
            continue
        lines += [f"### {title}", "", "| preset | held-out reward | components | samples | wall | measured |", "|---|---|---|---|---|---|"]
        for name, r in rows.items():
            reward = f"{fmt(r['before']['eval/reward/mean'])} -> **{fmt((r['after'] or {}).get('eval/reward/mean'))}**"
            samples = f"{r['iterations']} x {r['samples_per_iteration']}"
            lines.append(f"| `{name}` | {reward} | {components(r)} | {samples} | {wall(r)} | {when(r)} |")
        lines.append("")
        lines += [f"- `{name}`: {notes[name]}" for name in rows if name in notes]
        lines.append("")
    return lines


def overhead_section(results: dict) -> list[str]:
    lines = [
        "## Framework overhead",
        "",
        "A GRPO iteration of `digits/grpo` (`Trainer.train_iteration`: rollout, score, update) against the bare PyTorch",
        "model work the same iteration needs, timed alternately in one process, median of 5; ratio = flowrl / bare.",
        "",
        "| setting | samples x steps | guidance | phase | flowrl s | bare s | ratio | measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results["settings"].items():
        for i, (phase, t) in enumerate(s["phases"].items()):
            head = f"`{name}` | {s['samples']} x {s['steps']} | {s['guidance']}" if i == 0 else " | | "
            ratio = t["flowrl_s"] / t["raw_s"]
            ratio_s = f"**{ratio:.3f}**" if phase == "total" else f"{ratio:.3f}"
            stamp = f"{s['date']}, {s['threads']} threads, load {s['machine']['load_1min']}" if i == 0 else ""
            lines.append(f"| {head} | {phase} | {t['flowrl_s']:.3f} | {t['raw_s']:.3f} | {ratio_s} | {stamp} |")
    lines += ["", "Re-measure: `python bench/overhead.py --record [overrides]`.", ""]
    return lines


def machines(*records: dict | None) -> list[str]:
    seen: dict[str, dict] = {}
    for rec in records:
        for r in (rec or {}).get("presets", {}).values() or (rec or {}).get("settings", {}).values():
            m = r["machine"]
            seen[f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}"] = m
    return ["## Machines", "", *[f"- {name}" for name in sorted(seen)], ""]


def render() -> str:
    notes = yaml.safe_load(NOTES.read_text()) if NOTES.is_file() else {}
    presets, overhead = load("preset_results"), load("overhead")
    lines = [
        "# Measured results",
        "",
        "<!-- generated by `python bench/results_page.py --write` from bench/results/*.json; do not edit -->",
        "",
        "Every number on this page is read from a measurement record in `bench/results/` (written by the bench that",
        "measured it, with its date, machine, load, commit and command). Longer measurements with their own discussion",
        "(inference-scaling costs, distributed memory, the Adjoint Matching toys, the diffusion LMs' accuracy over seeds)",
        "are in the objective and topic pages and in `bench/RESULTS.md`.",
        "",
    ]
    if presets:
        lines += preset_section(presets, notes)
    if overhead:
        lines += overhead_section(overhead)
    lines += machines(presets, overhead)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="regenerate docs/results.md")
    g.add_argument("--check", action="store_true", help="exit 1 when docs/results.md is stale")
    a = p.parse_args()
    page = render()
    if a.write:
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(REPO)}")
    elif not PAGE.is_file() or PAGE.read_text() != page:
        sys.exit(f"{PAGE.relative_to(REPO)} is stale: python bench/results_page.py --write")


if __name__ == "__main__":
    main()
