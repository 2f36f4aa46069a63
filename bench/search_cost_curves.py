"""Held-out reward against counted cost for every inference-time search, measured through ``flowrl eval``'s own code
(eval_command.run_evaluation: the same searches, specs and cost records as the command line).

Each point is one search at one budget B (candidates per item: best-of-N's N, SVDD's M per step (its last step as
released, and with the final best-of-M), RBF's M per step and chain (as released: 2 chains, the best of 25 start noises
each) and flowrl's rollover RBF's M per step, SMC's particles, noise search's 1 + rounds samples); its x values are the
search's counted cost per item (inference/cost.py): denoiser rows, verifier rows, and wall seconds (denoiser +
verifier + the rest, the whole search).

    # digits flow model, cheap verifier (the README reward: ink + digit classifier)
    python bench/search_cost_curves.py images --json runs/isc/digits_base_cheap.json
    # the same with a slow verifier: a CLIP ViT-B/32 at real size (random weights, built from transformers classes,
    # save_pretrained, loaded by flowrl's clip_score reward) scored on every candidate with weight 0, so the
    # selection and the reward numbers are the README reward's and only the verifier's time changes
    python bench/search_cost_curves.py images --verifier clip --json runs/isc/digits_base_clip.json
    # after GRPO
    python bench/search_cost_curves.py images --checkpoint runs/digits_grpo/checkpoints/step_000030 --json ...
    # the embedded digits video model with its own (cheap) reward
    python bench/search_cost_curves.py images --preset digits_video/grpo.yaml --label video --json runs/isc/video.json
    # arithmetic diffusion LM (selection score: the model's likelihood; graded by the run's math reward)
    python bench/search_cost_curves.py text [--checkpoint runs/dllm_diffu_grpo/checkpoints/step_000060] --json ...
    # tables (equal-wall-time winners) and the plot
    python bench/search_cost_curves.py report runs/isc/*.json --out docs/images/search_cost_digits.png

Every measurement is appended to --json as it finishes (a killed run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import load_config  # noqa: E402
from flowrl.eval_command import run_evaluation  # noqa: E402
from flowrl.inference.sections import as_recorded  # noqa: E402

IMAGE_METHODS = ("best_of", "best_of_stop", "noise_search", "svdd", "svdd_best_of_m", "smc", "rbf", "rbf_one_chain", "rbf_rollover")
TEXT_METHODS = ("best_of", "svdd", "svdd_best_of_m", "smc")


def build_clip_vit_b32(directory: Path) -> Path:
    """CLIP ViT-B/32 at its released size (CLIPConfig's defaults: vision 768 x 12 layers, patch 32, 224 px; text
    512 x 12 layers), random weights, with a real CLIP image processor and a byte-level BPE tokenizer, saved with
    save_pretrained. Its score means nothing (random weights); its cost is a real CLIP's."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    # the GPT-2 / CLIP byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    rest = [b for b in range(256) if b not in printable]
    chars = [chr(c) for c in printable] + [chr(256 + i) for i in range(len(rest))]
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer.from_pretrained(str(directory))
    torch.manual_seed(0)
    CLIPModel(CLIPConfig()).save_pretrained(str(directory))
    try:  # transformers 5.x without torchvision: the PIL image processor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        ImageProcessor = CLIPImageProcessor
    CLIPProcessor(image_processor=ImageProcessor(), tokenizer=tokenizer).save_pretrained(str(directory))
    return directory


def image_method(name: str, b: int, stop_at: float) -> dict:
    if name == "best_of":
        return {"name": "best_of", "n": b}
    if name == "best_of_stop":
        return {"name": "best_of", "n": b, "stop_at": stop_at}
    if name == "noise_search":  # a (1 + 1) hill climb: B samples per item
        return {"name": "noise_search", "rounds": b - 1, "neighbors": 1, "step": 0.5}
    if name in ("svdd", "svdd_best_of_m"):
        return {"name": "svdd", "m": b, "last_step": "best_of_m" if name == "svdd_best_of_m" else "plain"}
    if name == "smc":
        return {"name": "smc", "n": b, "lambda": 100.0, "ess_threshold": 0.5, "tempering": "linear", "resampling": "systematic"}
    if name == "rbf_rollover":
        return {"name": "rbf_rollover", "m": b}
    if name == "rbf_one_chain":  # the released loop alone: one chain from one start noise
        return {"name": "rbf", "m": b, "chains": 1, "init_particles": 1}
    return {"name": "rbf", "m": b, "chains": 2, "init_particles": 25}


def reward_of(record: dict, method: dict) -> float:
    """The held-out reward (images) or accuracy (text) of a record ``flowrl eval`` printed."""
    means = [v for k, v in record.items() if k.startswith("eval/reward/mean@")]
    method = as_recorded(method)
    name = method["name"]
    if name == "best_of":
        key = f"eval/reward/mean@{method['n']}"
        return record[key] if key in record else record[f"{key}/{method['select']}"]
    tag = {
        "svdd": f"svdd{method.get('m')}",
        "smc": f"smc{method.get('n')}",
        "rbf": f"rbf{method.get('m')}x{method.get('chains')}",
        "rbf_rollover": f"rbf{method.get('m')}",  # the names it had as flowrl's rbf before issue #41
    }.get(name)
    if name == "noise_search":
        tag = f"noise{method['rounds']}x{method['neighbors']}"
    hits = [k for k in record if k == f"eval/reward/mean@{tag}" or k.startswith(f"eval/reward/mean@{tag}/")]
    assert len(hits) == 1, (hits, means)
    return record[hits[0]]


def measure(config, checkpoint, method, label: dict, out_json: Path, tmp: Path) -> dict:
    start = time.perf_counter()
    record = run_evaluation(config, checkpoint, dict(method), tmp / "grid.png")
    row = {**label, "method": method, "reward": reward_of(record, method), **record["cost"], "process_seconds": time.perf_counter() - start}
    with open(out_json, "a") as f:
        f.write(json.dumps(row) + "\n")
    c = record["cost"]
    print(
        f"{label['model']:>8} {label['verifier']:>6} {json.dumps(method):<110} reward {row['reward']:.4f}  "
        f"den {c['denoiser_rows_per_item']:7.1f} rows {c['denoiser_seconds_per_item']:.4f} s  "
        f"ver {c['verifier_rows_per_item']:6.1f} rows {c['verifier_seconds_per_item']:.4f} s  wall {c['wall_seconds_per_item']:.4f} s/item",
        flush=True,
    )
    return row


def run_images(args) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # batches of --batch-size rows that divide the items: no padding rows in the counts except where a search pads
        # by design (best-of-N's stopped items keep their batch's shape: --stop-at saves rows only batch by batch)
        overrides = [
            f"output_dir={tmp / 'run'}",
            "log.progress=false",
            f"eval.samples_per_prompt={args.samples_per_prompt}",
            f"eval.batch_size={args.batch_size}",
        ]
        if args.verifier == "clip":
            if args.preset != "digits/grpo.yaml":
                raise SystemExit("--verifier clip adds clip_score to the digits reward: use it with --preset digits/grpo.yaml only.")
            clip = build_clip_vit_b32(Path(args.clip_dir))
            overrides += [
                "reward.components={ink: 1.0, digit_classifier: 1.0, clip_score: 0.0}",
                f"reward.kwargs={{clip_score: {{pretrained: '{clip}'}}}}",
            ]
        checkpoint = Path(args.checkpoint) if args.checkpoint else None
        config = load_config(REPO / "configs" / args.preset, overrides + args.overrides)
        label = {"model": args.label, "verifier": args.verifier}
        if args.no_baseline:  # measured by an earlier call into the same file
            rows = [json.loads(line) for line in open(args.json) if line.strip()]
            plain = next(
                r for r in rows if (r["model"], r["verifier"], r["budget"]) == (args.label, args.verifier, 1) and not r.get("note")
            )
        else:
            plain = measure(config, checkpoint, {"name": "best_of", "n": 1}, {**label, "budget": 1}, Path(args.json), tmp)
            plain_sde = {"name": "svdd", "m": 1, "last_step": "plain"}  # = SMC N = 1 = rollover RBF M = 1 (tested)
            measure(config, checkpoint, plain_sde, {**label, "budget": 1, "note": "plain SDE"}, Path(args.json), tmp)
        stop_at = args.stop_at if args.stop_at is not None else round(plain["reward"] + 0.05, 3)
        for b in args.budgets:
            for name in args.methods:
                measure(config, checkpoint, image_method(name, b, stop_at), {**label, "budget": b}, Path(args.json), tmp)


def run_text(args) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        overrides = [f"output_dir={tmp / 'run'}", "log.progress=false", f"prompts.eval_size={args.eval_size}", "sampler.eval_temperature=1"]
        overrides += [f"rollout.batch_size={min(args.eval_size, 128)}"]
        config = load_config(REPO / "configs" / "dllm" / "diffu_grpo.yaml", overrides + args.overrides)
        checkpoint = Path(args.checkpoint) if args.checkpoint else None
        label = {"model": args.label, "verifier": "likelihood"}
        if not args.no_baseline:
            measure(config, checkpoint, {"name": "best_of", "n": 1, "select": "likelihood"}, {**label, "budget": 1}, Path(args.json), tmp)
        for b in args.budgets:
            for name in args.methods:
                method = {
                    "best_of": {"name": "best_of", "n": b},
                    "svdd": {"name": "svdd", "m": b, "last_step": "plain"},
                    "svdd_best_of_m": {"name": "svdd", "m": b, "last_step": "best_of_m"},
                    "smc": {"name": "smc", "n": b, "lambda": 1.0, "ess_threshold": 0.5, "tempering": "linear", "resampling": "systematic"},
                }[name]
                measure(config, checkpoint, {**method, "select": "likelihood"}, {**label, "budget": b}, Path(args.json), tmp)


def method_label(m: dict) -> str:
    """The method's line in the tables and the plot (a row measured before issue #41 by what it ran: ``as_recorded``)."""
    m = as_recorded(m)
    name = m["name"]
    if name == "best_of":
        return "best-of-N + stop" if "stop_at" in m else "best-of-N"
    if name == "svdd":
        return "SVDD + final best-of-M" if m["last_step"] == "best_of_m" else "SVDD"
    if name == "rbf" and (m["chains"], m["init_particles"]) != (2, 25):
        return f"RBF (released, {m['chains']} chain x {m['init_particles']} start)"
    return {"smc": "SMC", "rbf": "RBF (released)", "rbf_rollover": "RBF rollover (flowrl)", "noise_search": "noise search"}[name]


def report(args) -> None:
    """Per (model, verifier): every point, then the best reward reachable within budgets of 1, 2, 4, 8, 16 x the plain
    evaluation's cost, in CPU seconds (this process's own work: the clock to read on a CPU shared with other jobs),
    wall seconds, and denoiser rows."""
    rows = [json.loads(line) for path in args.files for line in open(path) if line.strip()]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        r.setdefault("cpu_seconds_per_item", float("nan"))
        groups.setdefault((r["model"], r["verifier"]), []).append(r)
    for (model, verifier), rs in groups.items():
        per_den = sum(r["denoiser_seconds"] for r in rs) / sum(r["denoiser_rows"] for r in rs)
        per_ver = sum(r["verifier_seconds"] for r in rs) / sum(r["verifier_rows"] for r in rs)
        print(
            f"\n### {model}, verifier {verifier} ({rs[0]['items']} items; wall {per_den * 1e3:.2f} ms per denoiser row, {per_ver * 1e3:.2f} ms per verifier row)\n"
        )
        print(
            "| method | B | reward | denoiser rows / item | verifier rows / item | denoiser CPU ms / item | verifier CPU ms / item | CPU ms / item | wall ms / item |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            lab = method_label(r["method"]) + (" (plain SDE)" if r.get("note") else "")
            cpu = [
                r.get(k, float("nan")) * 1e3
                for k in ("denoiser_cpu_seconds_per_item", "verifier_cpu_seconds_per_item", "cpu_seconds_per_item")
            ]
            print(
                f"| {lab} | {r['budget']} | {r['reward']:.4f} | {r['denoiser_rows_per_item']:.1f} | {r['verifier_rows_per_item']:.1f} | "
                f"{cpu[0]:.0f} | {cpu[1]:.0f} | {cpu[2]:.0f} | {r['wall_seconds_per_item'] * 1e3:.0f} |"
            )
        budgets = sorted({r["budget"] for r in rs})
        print("\nreward (CPU ms / item) by budget B:\n")
        print("| method | " + " | ".join(f"B = {b}" for b in budgets) + " |")
        print("|---|" + "---|" * len(budgets))
        for lab in dict.fromkeys(method_label(r["method"]) + (" (plain SDE)" if r.get("note") else "") for r in rs):
            cells = []
            for b in budgets:
                hit = [r for r in rs if r["budget"] == b and method_label(r["method"]) + (" (plain SDE)" if r.get("note") else "") == lab]
                cells.append(f"{hit[0]['reward']:.3f} ({hit[0]['cpu_seconds_per_item'] * 1e3:.0f})" if hit else "")
            print(f"| {lab} | " + " | ".join(cells) + " |")
        plain = next(r for r in rs if r["budget"] == 1 and not r.get("note"))
        print("\n| budget (x plain best-of-1) | best within CPU time | best within wall time | best within denoiser rows |")
        print("|---|---|---|---|")
        for x in (1, 2, 4, 8, 16):
            cells = []
            for key in ("cpu_seconds_per_item", "wall_seconds_per_item", "denoiser_rows_per_item"):
                within = [r for r in rs if r[key] <= x * plain[key] * 1.02]
                if not within:
                    cells.append("-")
                    continue
                top = max(within, key=lambda r: r["reward"])
                cells.append(f"{top['reward']:.4f} {method_label(top['method'])}{' (SDE)' if top.get('note') else ''} B={top['budget']}")
            print(f"| {x} | " + " | ".join(cells) + " |")
    if args.out:
        plot(groups, Path(args.out))


def plot(groups: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = (
        ("denoiser_rows_per_item", "denoiser rows / item"),
        ("verifier_rows_per_item", "verifier rows / item"),
        ("cpu_seconds_per_item", "CPU s / item (denoiser + verifier + rest)"),
    )
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.6 * len(groups)), squeeze=False)
    labels = dict.fromkeys(method_label(r["method"]) for rs in groups.values() for r in rs if not r.get("note"))
    colours = {lab: plt.get_cmap("tab20")(i % 20) for i, lab in enumerate(labels)}  # one colour per method in every panel
    for row, ((model, verifier), rs) in enumerate(groups.items()):
        by_method: dict[str, list[dict]] = {}
        for r in rs:  # the released RBF's B = 1 still searches (its chains and start noises): a point of its own line
            if r["budget"] > 1 or (r["method"]["name"] == "rbf" and not r.get("note")):
                by_method.setdefault(method_label(r["method"]), []).append(r)
        ode = [r for r in rs if r["budget"] == 1 and r["method"]["name"] == "best_of"]  # best-of-1: the plain (ODE) evaluation
        sde = [r for r in rs if r.get("note")] or ode  # SVDD M = 1: the plain SDE rollout (= SMC N = 1 = RBF M = 1, tested)
        for col, (key, name) in enumerate(xs):
            ax = axes[row][col]
            for lab, pts in by_method.items():
                # the B = 1 point each line starts from: the ODE sample, the plain SDE path (SVDD, SMC and the rollover
                # RBF at 1), none for the released RBF (its M = 1 still searches 2 chains x 25 start noises)
                start = ode if lab.startswith("best-of") or lab == "noise search" else [] if lab.startswith("RBF (released") else sde
                pts = sorted(start + pts, key=lambda r: r["budget"])
                x = [p[key] if p.get(key) == p.get(key) else p["wall_seconds_per_item"] for p in pts]  # no CPU time recorded: wall
                ax.plot(x, [p["reward"] for p in pts], marker="o", label=lab, color=colours[lab])
            ax.set_xscale("log")
            ax.set_xlabel(name)
            ax.set_ylabel("held-out reward" if "arith" not in model else "held-out accuracy")
            ax.set_title(f"{model}, verifier: {verifier}", fontsize=9)
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("images")
    i.add_argument("--checkpoint", default=None)
    i.add_argument("--preset", default="digits/grpo.yaml", help="under configs/: digits/grpo.yaml or digits_video/grpo.yaml")
    i.add_argument("--label", default="base")
    i.add_argument("--verifier", choices=("cheap", "clip"), default="cheap")
    i.add_argument("--clip-dir", default="/tmp/flowrl_clip_vit_b32")
    i.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8])
    i.add_argument("--methods", nargs="+", default=list(IMAGE_METHODS), choices=IMAGE_METHODS)
    i.add_argument("--samples-per-prompt", type=int, default=2, help="held-out items = 20 prompts x this")
    i.add_argument("--stop-at", type=float, default=None, help="best-of-N + stop threshold (default: the plain reward + 0.05)")
    i.add_argument("--batch-size", type=int, default=8, help="eval.batch_size: rows per denoiser call")
    i.add_argument("--no-baseline", action="store_true", help="the B = 1 points are already in --json")
    i.add_argument("--threads", type=int, default=1)
    i.add_argument("--json", required=True)
    i.add_argument("overrides", nargs="*")
    t = sub.add_parser("text")
    t.add_argument("--checkpoint", default=None)
    t.add_argument("--label", default="base")
    t.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8])
    t.add_argument("--eval-size", type=int, default=256, help="held-out problems (a multiple of 128 / budget: no padding)")
    t.add_argument("--methods", nargs="+", default=list(TEXT_METHODS), choices=TEXT_METHODS)
    t.add_argument("--no-baseline", action="store_true", help="the B = 1 point is already in --json")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--json", required=True)
    t.add_argument("overrides", nargs="*")
    r = sub.add_parser("report")
    r.add_argument("files", nargs="+")
    r.add_argument("--out", default=None)
    args = p.parse_args()
    {"images": run_images, "text": run_text, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
