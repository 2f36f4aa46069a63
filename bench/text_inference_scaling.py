"""Inference-time scaling on the embedded masked-diffusion LM (arith_mdlm), measured in one run per model:
greedy decoding, best-of-N at the sampling temperature with every verifier-free selection rule (and
pass@N, the oracle upper bound), and SVDD with M candidates per unmasking step valued by the model's
likelihood of a one-shot completion; denoiser work counted (rows through ``lm.logits``), not assumed.

    python bench/text_inference_scaling.py measure [--checkpoint DIR] [--label base] [--n 16] [--svdd 4 16] \\
        [--svdd-last-step plain|best_of_m] [--select majority,likelihood,format] --json OUT.json [key=value overrides]
    python bench/text_inference_scaling.py plot base.json after.json --out runs/x/inference_scaling.png

``measure`` prints a table and writes the numbers as JSON after every phase (greedy, best-of-N, each SVDD M); run
again on the same JSON it runs only the phases missing there. ``plot`` draws one panel per JSON (accuracy
against N for each rule, pass@N dashed, greedy and SVDD as references).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl import seeding  # noqa: E402
from flowrl.config import load_config  # noqa: E402
from flowrl.inference.masked_svdd import masked_svdd_in_batches  # noqa: E402
from flowrl.inference.plots import save_scaling_plot  # noqa: E402
from flowrl.inference.search import Items, TextSearchModel, TextVerifier  # noqa: E402
from flowrl.inference.text_best_of_n import ORACLE, text_best_of_n  # noqa: E402
from flowrl.inference.text_candidates import build_scorer, build_scorers  # noqa: E402
from flowrl.modalities.text import TextModality  # noqa: E402
from flowrl.objectives import own_modules  # noqa: E402
from flowrl.reward_models import build_reward_from_config  # noqa: E402
from flowrl.training.checkpoint import read_weights  # noqa: E402


class RowCounter:
    """Counts the rows the masked LM is run on (one row = one sequence through the model once)."""

    def __init__(self, lm):
        self.rows, self._logits = 0, lm.logits
        lm.logits = self

    def __call__(self, input_ids, attention_mask=None):
        self.rows += input_ids.shape[0]
        return self._logits(input_ids, attention_mask=attention_mask)


def load_modality(args) -> tuple:
    """The run's config and text modality (seeded as the run was), with a checkpoint's weights when one is given."""
    config_path = Path(args.checkpoint) / "config.yaml" if args.checkpoint else Path(args.config)
    config = load_config(config_path, args.overrides)
    seeding.seed_initialisation(config.seed)
    modality = TextModality(config, torch.device("cpu"))
    if args.checkpoint:
        weights = read_weights(Path(args.checkpoint))
        for prefix, module in own_modules(modality.objective):  # DCoLT's unmasking-policy head
            module.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
        modality.pipeline.load_trainable_state_dict({k: v for k, v in weights.items() if not k.startswith("objective.")})
    return config, modality


class Measurement:
    """One ``measure`` run: the held-out items, the model drawing candidates (its rows counted), and the JSON written
    after every phase; a file from an earlier run of the same measurement keeps its finished phases."""

    def __init__(self, args, config, modality: TextModality):
        self.args, self.config, self.modality = args, config, modality
        self.lm, self.sc, self.plen = modality.pipeline, config.sampler, config.pipeline.prompt_length
        self.lm.model.eval()
        self.grader = build_reward_from_config(config.reward)
        self.prompts, self.metadata = [p for p, _ in modality.eval_pool], [m for _, m in modality.eval_pool]
        self.counter, self.batch, self.seed, self.temp = RowCounter(self.lm), config.rollout.batch_size, config.eval.seed, args.temperature
        self.items = Items(self.prompts, self.metadata)
        self.rules = [r for r in args.select.split(",") if r]
        self.out_path = Path(args.json)
        # a file from an earlier run of the same measurement keeps its finished phases: only the missing ones run
        self.result: dict = json.loads(self.out_path.read_text()) if self.out_path.is_file() else {}
        sc = self.sc
        self.result.update(
            {
                "label": args.label,
                "checkpoint": args.checkpoint,
                "items": len(self.prompts),
                "temperature": self.temp,
                "n": args.n,
                "settings": {"gen_length": sc.gen_length, "steps": sc.steps, "block_length": sc.block_length, "remasking": sc.remasking},
            }
        )
        self.out_path.parent.mkdir(parents=True, exist_ok=True)

    def model(self, temperature: float) -> TextSearchModel:
        """The run's diffusion LM drawing candidates at ``temperature``."""
        return TextSearchModel(self.lm, self.sc, self.plen, temperature, self.seed, self.batch, self.modality.position_scorer)

    def save(self) -> None:  # after every phase: a killed run loses only the phase it was in
        self.out_path.write_text(json.dumps(self.result, indent=1))

    def timed(self, fn):
        self.counter.rows, start = 0, time.perf_counter()
        value = fn()
        return value, self.counter.rows, time.perf_counter() - start

    def greedy(self) -> float:
        """Greedy decoding; prints its accuracy and returns the plain sampler's rows (greedy or not: the same steps)."""
        result, prompts = self.result, self.prompts
        if "greedy" not in result:
            greedy, rows, secs = self.timed(lambda: text_best_of_n(self.model(0.0), TextVerifier([], [], self.grader), self.items, 1))
            result["greedy"] = {"accuracy": greedy.accuracy("majority", 1), "forwards_per_item": rows / len(prompts), "seconds": secs}
            self.save()
        plain_rows = result["greedy"]["forwards_per_item"] * len(prompts)  # the plain sampler's work (greedy or not: same steps)
        print(
            f"{self.args.label}: {len(prompts)} held-out items; greedy accuracy {result['greedy']['accuracy']:.4f} ({plain_rows:.0f} forwards)",
            flush=True,
        )
        return plain_rows

    def best_of_n(self, plain_rows: float) -> None:
        """Best-of-N at the sampling temperature, every selection rule and pass@N, from 1 to N candidates."""
        if "best_of_n" not in self.result:
            rules = self.rules
            best, rows, secs = self.timed(
                lambda: text_best_of_n(
                    self.model(self.temp),
                    TextVerifier(rules, build_scorers(rules, self.config.reward), self.grader),
                    self.items,
                    self.args.n,
                )
            )
            self.result["best_of_n"] = {
                "curves": {r: {str(k): v for k, v in c.items()} for r, c in best.curves(rules).items()},
                "single_sample_accuracy": best.sample_accuracy(),
                "forwards_vs_plain": rows / plain_rows,
                "seconds": secs,
            }
            self.save()
        self.print_best_of_n()

    def print_best_of_n(self) -> None:
        b, temp, n = self.result["best_of_n"], self.temp, self.args.n
        print(
            f"best-of-{n} at T = {temp:g}, accuracy of each rule's choice; pass@N = oracle upper bound ({b['forwards_vs_plain']:.2f}x "
            f"the plain forwards, {b['seconds']:.0f} s):"
        )
        shown = [r for r in b["curves"] if r != ORACLE]
        print(f"{'N':>4}" + "".join(f"{r:>12}" for r in shown) + f"{'pass@N':>10}")
        for k in b["curves"][ORACLE]:
            print(f"{k:>4}" + "".join(f"{b['curves'][r][k]:>12.4f}" for r in shown) + f"{b['curves'][ORACLE][k]:>10.4f}")
        print(
            f"single-sample accuracy at T = {temp:g} over all {n * len(self.prompts)} candidates: {b['single_sample_accuracy']:.4f}",
            flush=True,
        )

    def svdd(self, plain_rows: float) -> None:
        """SVDD at every M of ``--svdd`` not measured yet with this ``--svdd-last-step`` (those measured before are
        printed as they were; an entry without ``last_step`` was measured before issue #41, with the final best-of-M)."""
        self.result.setdefault("svdd", {})
        for m in self.args.svdd:
            earlier = self.result["svdd"].get(str(m), {})
            if earlier.get("last_step", "best_of_m") == self.args.svdd_last_step:
                print(f"svdd M = {m:>2}: accuracy {earlier['accuracy']:.4f} (earlier run)")
                continue
            self.svdd_point(m, plain_rows)

    def svdd_point(self, m: int, plain_rows: float) -> None:
        prompts = self.prompts
        last_step = self.args.svdd_last_step
        out, rows, secs = self.timed(
            lambda: masked_svdd_in_batches(self.model(self.temp), build_scorer("likelihood"), prompts, m, last_step=last_step)
        )
        acc = float(self.grader(out.completions, prompts, self.metadata).scores.float().nanmean())
        assert rows == out.forwards  # the function's own count is the counted work
        self.result["svdd"][str(m)] = {"accuracy": acc, "forwards_vs_plain": rows / plain_rows, "seconds": secs, "last_step": last_step}
        print(
            f"svdd M = {m:>2} (value: likelihood of the one-shot completion): accuracy {acc:.4f}, {rows / plain_rows:.2f}x the plain "
            f"forwards, {secs:.0f} s",
            flush=True,
        )
        self.save()


def measure(args) -> None:
    config, modality = load_modality(args)
    measurement = Measurement(args, config, modality)
    plain_rows = measurement.greedy()
    measurement.best_of_n(plain_rows)
    measurement.svdd(plain_rows)


def plot(args) -> None:
    panels, references = {}, {}
    for path in args.results:
        r = json.loads(Path(path).read_text())
        title = f"{r['label']} ({r['items']} held-out items, T = {r['temperature']:g})"
        panels[title] = {
            ("pass@N (oracle upper bound)" if rule == ORACLE else f"best-of-N, {rule}"): {int(k): v for k, v in c.items()}
            for rule, c in r["best_of_n"]["curves"].items()
        }
        if r["svdd"]:
            # M = 1 is the plain sample at the same seed (tested), which every rule's N = 1 point is too
            svdd = {1: r["best_of_n"]["curves"][ORACLE]["1"], **{int(m): v["accuracy"] for m, v in r["svdd"].items()}}
            panels[title]["SVDD, likelihood (M = N)"] = svdd
        references[title] = {f"greedy decoding {r['greedy']['accuracy']:.3f}": r["greedy"]["accuracy"]}
    save_scaling_plot(
        panels, Path(args.out), "held-out exact-match accuracy", references, title="arith_mdlm: accuracy against candidates per item"
    )
    print(f"wrote {args.out}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--config", default=str(REPO / "configs" / "dllm" / "diffu_grpo.yaml"))
    m.add_argument("--checkpoint", default=None, help="a run checkpoint (its config.yaml is used)")
    m.add_argument("--label", default="base arith_mdlm")
    m.add_argument("--n", type=int, default=16)
    m.add_argument("--temperature", type=float, default=1.0)
    m.add_argument("--svdd", type=int, nargs="*", default=[4, 16])
    m.add_argument(
        "--svdd-last-step",
        choices=("plain", "best_of_m"),
        default="best_of_m",
        help="SVDD's last step: best_of_m (the discrete release selects there too) or plain (the image release)",
    )
    m.add_argument("--select", default="majority,likelihood,format")
    m.add_argument("--json", required=True)
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("overrides", nargs="*")
    q = sub.add_parser("plot")
    q.add_argument("results", nargs="+")
    q.add_argument("--out", required=True)
    args = p.parse_args()
    if args.command == "measure":
        torch.set_num_threads(args.threads)
        measure(args)
    else:
        plot(args)


if __name__ == "__main__":
    main()
