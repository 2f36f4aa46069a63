"""``flowrl tiny FAMILY OUT [--variant V] [--seed N] [--overwrite]``: write a tiny random-weight checkpoint of a family
and print the ``flowrl train`` commands that run its presets on it. ``add_tiny_parser`` / ``run_tiny`` plug into
flowrl's command line; ``main`` runs the command on its own (the same one-sentence errors, exit 2)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ...console import say
from ...errors import FlowRLError

HELP = "write a tiny random-weight checkpoint of a model family (runs its presets on a laptop; random weights: plumbing only)"


def add_tiny_parser(sub) -> argparse.ArgumentParser:
    """Add ``tiny`` to the subcommands ``sub`` (an argparse ``add_subparsers`` object) and return its parser."""
    from . import family_list

    p = sub.add_parser("tiny", help=HELP, description=HELP + ".", epilog=f"families (variants, the default first): {family_list()}")
    p.add_argument("family", help="the family's pipeline.name (flux2, z_image, wan, dllm, ...)")
    p.add_argument("out", type=Path, help="the directory to write (a new or empty one)")
    p.add_argument("--variant", default=None, help="which of the family's checkpoints (flux2: dev, klein, klein-base); default: its first")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0; the same seed writes the same weights)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return p


def run_tiny(args) -> int:
    """Write the checkpoint ``args`` names, then say where it is and how to train on it; a FlowRLError for a mistake."""
    from . import tiny_checkpoint, variant_of
    from .runs import RUNS, runs_for, tiny_overrides

    if args.seed < 0:
        raise FlowRLError(f"--seed must be non-negative, got {args.seed}.")
    variant, chosen = variant_of(args.family, args.variant)
    out = tiny_checkpoint(args.family, args.out, variant, seed=args.seed, overwrite=args.overwrite)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    say(f"wrote a tiny {args.family} checkpoint ({variant}: {chosen.about}; seed {args.seed}) to {out}, {size / 1e6:.1f} MB.")
    say("Its weights are random: a run on it exercises the whole path (loading, sampling, log-probs, the update), not quality.")
    for run in runs_for(args.family, variant):
        command = ["flowrl", "train", RUNS[run].preset, *tiny_overrides(run, out)]
        say(f"\n{run}:\n  " + " ".join(shlex.quote(part) for part in command))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``flowrl tiny`` on its own: ``main(["flux2", "out", "--variant", "klein"])``; 0 on success, 2 on a mistake."""
    parser = argparse.ArgumentParser(prog="flowrl")
    add_tiny_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tiny", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_tiny(args)
    except FlowRLError as e:
        print(f"flowrl: error: {e}", file=sys.stderr)
        return 2
