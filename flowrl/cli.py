"""``flowrl train | sample | eval | check | ...``: the command line. Errors the user can fix print one sentence."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .console import libraries_on_stderr, say
from .errors import FlowRLError, Preempted

PREEMPTED_EXIT = 143  # 128 + SIGTERM: what a shell, SLURM and Kubernetes read as "ended by SIGTERM"

EPILOG = """examples:
  flowrl presets
  flowrl config train                                             (a section's keys, types, defaults, descriptions)
  flowrl train digits/grpo                                        (a shipped preset; or a YAML file)
  flowrl train configs/digits/grpo.yaml train.iterations=10 output_dir=runs/quick
  flowrl sample runs/digits_grpo/checkpoints/step_000030 --prompt "a handwritten seven" -n 8
  flowrl eval runs/digits_grpo/checkpoints/step_000030
  flowrl eval configs/digits/grpo.yaml --best-of 16      (or --svdd 16: inference-time scaling)
  flowrl eval configs/digits/grpo.yaml --smc 16 --smc-lambda 30   (particles toward p_base exp(lambda r))
  flowrl eval configs/digits/grpo.yaml --rbf 4       (or --noise-search 5: rollover budget forcing, noise search)
  flowrl eval configs/dllm/diffu_grpo.yaml sampler.eval_temperature=1 --best-of 16 --select majority,likelihood
  flowrl check configs/digits/grpo.yaml                  (training, evaluation, sampling and the card agree?)
  flowrl export runs/sd_lora/checkpoints/step_000100 exported_model
  flowrl export runs/sd_lora/checkpoints/step_000100 my_lora --lora-only --push-to-hub me/my-lora
  flowrl export runs/flux_lora/checkpoints/step_000100 for_comfy --format comfy   (the LoRA in the original layout)
  flowrl tiny flux2 tiny_klein --variant klein-base      (random weights: try a family's presets on a laptop)
  flowrl check digits/grpo                                (training, evaluation, sampling and the card agree)
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line like every other flowrl error (exit 2), not usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"flowrl: error: {self.prog}: {message.rstrip('.')} (see {self.prog} --help).\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="flowrl",
        description="RL alignment of diffusion and flow models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train with a preset or YAML config and key=value overrides",
        epilog="every key and what it does: flowrl config [SECTION | objective.NAME | PRESET], or docs/config_reference.md",
    )
    t.add_argument("config", help="a shipped preset by name (digits/grpo; see flowrl presets) or a YAML file")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.iterations=10")
    t.add_argument(
        "--json",
        action="store_true",
        help="end with the run's summary as one JSON line, for scripts (what summary.json holds); "
        "default: a few lines for a person (how it ended, the reward before -> after, where the run is, what to run next)",
    )
    t.add_argument(
        "--debug",
        action="store_true",
        help="on an error, print its full traceback above the one-sentence error (a run that failed also wrote it to "
        "error.log in its output_dir)",
    )
    _add_sample_parser(sub)
    _add_eval_parser(sub)
    _add_check_parser(sub)
    _add_export_parser(sub)
    from .pipelines.tiny.command import add_tiny_parser

    add_tiny_parser(sub)
    sub.add_parser("presets", help="list the presets shipped with flowrl (flowrl train NAME)")
    c = sub.add_parser("config", help="explain the config: its sections, or one section's keys with types, defaults and descriptions")
    c.add_argument(
        "target",
        nargs="?",
        help="a section (train), a part (objective.grpo, pipeline.flux, reward.pickscore), serve-reward, "
        "or a preset / YAML file to show its values beside the descriptions; none: the list of sections",
    )
    c.add_argument("--name", default=None, help="the part's name, for a target pipeline, sampler, objective or reward")
    _add_server_parsers(sub)
    return p


def _add_sample_parser(sub) -> None:
    s = sub.add_parser("sample", help="sample a grid of images from a checkpoint or a pretrained model")
    s.add_argument("source", help="checkpoint directory, or an embedded model name / model directory")
    s.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="prompt text (repeat for several); default for a checkpoint: its first held-out prompt",
    )
    s.add_argument("-n", "--num-samples", type=int, default=8, help="samples per prompt")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the checkpoint's evaluation steps)")
    s.add_argument(
        "--sampler",
        choices=("ode", "rollout"),
        default="ode",
        help="ode: the deterministic sampler (default); rollout: a checkpoint's own training sampler (e.g. the memoryless "
        "SDE an Adjoint Matching model was trained on), with fresh noise; a masked-token model (amused) always samples "
        "with its own unmasking sampler",
    )
    s.add_argument("--guidance-scale", type=float, default=None, help="(default: the checkpoint's evaluation guidance)")
    s.add_argument("--image", default=None, help="first frame for image-to-video models (wan_i2v)")
    s.add_argument(
        "--out",
        type=Path,
        default=None,
        help="a .png grid (images; videos also as MP4 / GIF), or a .npy file: the final samples as a float32 array (N, ...); "
        "default: samples.png in a new folder (RUN/outputs/sample_<time>/ for a run checkpoint, else "
        "flowrl_outputs/sample_<time>/)",
    )
    s.add_argument("--overwrite", action="store_true", help="replace an existing --out file (default: refuse)")


def _add_check_parser(sub) -> None:
    k = sub.add_parser(
        "check",
        help="build the run as training would and verify, for one prompt group, that training, evaluation, sampling and "
        "the exported card agree (docs/check.md); exit 1 on any mismatch",
    )
    k.add_argument("config", help="a shipped preset by name (digits/grpo) or a YAML file, as for flowrl train")
    k.add_argument("overrides", nargs="*", help="dotted overrides, e.g. pipeline.pretrained=DIR")
    k.add_argument("--json", action="store_true", help="print the result as one JSON line, for scripts")


def _add_export_parser(sub) -> None:
    x = sub.add_parser(
        "export", help="write a run checkpoint as a standalone diffusers model directory (merged weights) or as a diffusers LoRA file"
    )
    x.add_argument("checkpoint", help="a run checkpoint directory, e.g. runs/x/checkpoints/step_000030")
    x.add_argument("out", type=Path, help="output directory (must not exist)")
    x.add_argument("--lora-only", action="store_true", help="write only pytorch_lora_weights.safetensors (LoRA runs)")
    x.add_argument(
        "--format",
        choices=("diffusers", "comfy"),
        default="diffusers",
        help="diffusers: a model directory or, with --lora-only, diffusers' LoRA file (default); comfy: the LoRA as one "
        "OUT/lora.safetensors in the model's original / kohya layout, for ComfyUI and kohya-style tools (docs/lora_export.md)",
    )
    x.add_argument(
        "--license",
        default=None,
        help="license in the model card (README.md); default: the card says the model inherits its base model's license",
    )
    x.add_argument(
        "--push-to-hub",
        default=None,
        metavar="REPO",
        help="then upload the export to this Hugging Face Hub repo "
        "(created if needed; token from HF_TOKEN or `hf auth login`; endpoint HF_ENDPOINT)",
    )
    x.add_argument("--private", action="store_true", help="(--push-to-hub) create the repo private")


def _add_server_parsers(sub) -> None:
    """The local servers: the reward server and the labelling page."""
    r = sub.add_parser("serve-reward", help="serve a reward model over HTTP on loopback (token in FLOWRL_REWARD_TOKEN)")
    r.add_argument("config", help="reward server YAML (see docs/reward_server.md)")
    r.add_argument("--port", type=int, default=None, help="override the config's port (0 = any free port)")
    lb = sub.add_parser("label", help="label a pairs directory by hand in a browser (writes DIR/labels.jsonl; docs/labeling.md)")
    lb.add_argument("directory", help="a pairs directory (python -m flowrl.preferences.pairs)")
    lb.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default loopback; any other needs the token, "
        "FLOWRL_LABEL_TOKEN or a random one printed in the address)",
    )
    lb.add_argument("--port", type=int, default=8765, help="port (0 = any free port)")


# flowrl eval's search flags: metavar, type and help. Each sets a field of a search's section (inference/sections.py),
# which holds its default and bounds: {description} and {default} are that field's.
_SEARCH_FLAGS = {
    "--best-of": (
        "N",
        int,
        "Best-of-N: keep the best of N candidates per held-out item (by the run's reward); prints the reward at N = 1, 2, 4, "
        "... and writes the chosen samples' grid to --out",
    ),
    "--stop-at": (
        "REWARD",
        float,
        "(--best-of, image and video models) stop an item's search once a candidate's reward reaches REWARD; prints the "
        "candidates drawn per item",
    ),
    "--svdd": (
        "M",
        int,
        "SVDD-PM: sample the held-out items keeping, at every step but the last, the best of M candidates from the rollout "
        "sampler by the reward of their predicted x0, the last step a plain one as released (--svdd-last-step); writes "
        "the grid to --out",
    ),
    "--svdd-last-step": ("plain|best_of_m", str, "(--svdd) {description} (default {default})"),
    "--smc": (
        "N",
        int,
        "SMC: N particles per held-out item on the rollout sampler, weighted by exp(lambda_t r(x0_hat)) with lambda_t rising "
        "linearly to --smc-lambda and resampled when the ESS falls below --smc-ess-threshold N, targeting p_base(x) "
        "exp(lambda r(x)); one particle per item drawn by its final weight; writes the grid to --out",
    ),
    "--noise-search": (
        "ROUNDS",
        int,
        "zero-order search over each held-out item's start noise (ODE samples): ROUNDS rounds of --noise-neighbors "
        "candidates sqrt(1 - s^2) e + s d around the best noise so far, 1 + ROUNDS x neighbours samples per item; 0 is the "
        "plain evaluation; writes the grid to --out",
    ),
    "--noise-neighbors": ("K", int, "(--noise-search) {description} (default {default})"),
    "--noise-step": ("S", float, "(--noise-search) {description}, in (0, 1] (default {default})"),
    "--rbf": (
        "M",
        int,
        "FlowRBF as released: --rbf-chains chains per item from the best of --rbf-init-particles start noises each, M "
        "candidates per step and chain, the unspent budget rolled over, stopping two steps early to spend the rest there; "
        "returns the best candidate's predicted x0 (docs/inference_scaling.md); writes the grid to --out",
    ),
    "--rbf-chains": ("B", int, "(--rbf) {description}"),
    "--rbf-init-particles": ("N", int, "(--rbf) {description}"),
    "--rbf-rollover": ("M", int, "flowrl's rollover budget forcing (its --rbf before issue #41; docs/inference_scaling.md)"),
    "--smc-lambda": ("LAMBDA", float, "(--smc) {description}"),
    "--smc-ess-threshold": ("FRACTION", float, "(--smc) {description} (default {default}; 0 never, 1 at every step)"),
    "--select": (
        "RULES",
        str,
        "(diffusion LMs) how --best-of / --svdd / --smc choose without the gold answer, comma-separated: majority "
        "(self-consistency over the extracted answers; --best-of only), likelihood (the model's own), a reward's name "
        "(e.g. format), or reward (the run's reward, if it does not read the gold answer); default majority,likelihood "
        "for --best-of, likelihood for --svdd and --smc",
    ),
}


def _add_eval_parser(sub) -> None:
    """``flowrl eval``: a plain held-out evaluation, a search (``--best-of``, ``--svdd``, ``--smc``, ``--noise-search``,
    ``--rbf``, or any registered search by ``--search NAME``), a spec re-run, or grading recorded generations."""
    from .inference.flags import flag_fields

    e = sub.add_parser(
        "eval",
        help="held-out evaluation reward of a checkpoint or a config's starting model; or grade the generations recorded in a .jsonl file",
    )
    e.add_argument("source", nargs="?", help="checkpoint directory, YAML config, or .jsonl of recorded generations")
    e.add_argument("overrides", nargs="*")
    e.add_argument(
        "--spec",
        type=Path,
        default=None,
        metavar="FILE",
        help="re-run exactly the evaluation recorded in FILE (an eval spec: a line `flowrl eval` printed, a run's "
        "summary.json, or a spec file), say whether its number came back bit for bit and which recorded fields differ; "
        "exit 1 when the number differs",
    )
    e.add_argument("--field", default="llada_generation_256", help="(.jsonl) the field holding the generations")
    e.add_argument("--gold-field", default="ground_truth", help="(.jsonl) the field holding the gold answer")
    fields = flag_fields()
    for flag, (metavar, kind, text) in _SEARCH_FLAGS.items():
        info = fields[flag]
        e.add_argument(flag, type=kind, default=None, metavar=metavar, help=text.format(description=info.description, default=info.default))
    e.add_argument(
        "--search",
        nargs="+",
        default=None,
        metavar=("NAME", "KEY=VALUE"),
        help="a search by name, with its settings: flowrl's own (best_of, svdd, smc, noise_search, rbf, rbf_rollover: --search best_of "
        "n=8 is --best-of 8), one registered with flowrl.register_search or installed (entry point group "
        "flowrl.searches), or an import path package.module:Class (docs/inference_scaling.md)",
    )
    e.add_argument(
        "--out",
        type=Path,
        default=None,
        help="(searches) grid of the chosen samples; for diffusion LMs the accuracy-vs-N plot, "
        "the chosen completions going to the same name with .jsonl; default: best_of_n.png in a new folder "
        "(RUN/outputs/eval_<time>/ for a run checkpoint, else flowrl_outputs/eval_<time>/)",
    )
    e.add_argument("--overwrite", action="store_true", help="(searches) replace an existing --out file (default: refuse)")


def _quiet_library_progress() -> None:
    """flowrl draws its own progress bars; the libraries' per-file loading bars only bury them."""
    import diffusers
    import transformers

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command not in ("label", "presets", "config"):  # no model loads: no need to import diffusers
        _quiet_library_progress()
    try:
        _check_arguments(args)
        command = {
            "train": _train,
            "sample": _sample,
            "eval": _eval,
            "export": _export,
            "check": _check,
            "serve-reward": _serve_reward,
            "label": _label,
            "presets": _presets,
            "config": _config,
            "tiny": _tiny,
        }[args.command]
        if args.command in ("serve-reward", "label"):  # long-running servers: their address line is read from stdout
            return command(args)
        with libraries_on_stderr():  # stdout: flowrl's own lines only (DeepSpeed's import notice goes to stderr)
            return command(args)
    except BrokenPipeError:  # `flowrl presets | head`: the reader has what it wanted; nothing is wrong
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away
    except FlowRLError as e:
        from .training.distributed import report_error

        if getattr(args, "debug", False):  # the sentence's traceback, with the user's code that caused it
            import traceback

            traceback.print_exception(e, file=sys.stderr)
        report_error(f"flowrl: error: {e}")  # once per launch of several processes, and to the launcher's report
        return 2
    except OSError as e:  # a file operation not wrapped where it happens: still one sentence naming the path
        from .atomic_files import os_error_reason
        from .training.distributed import report_error

        where = f"'{e.filename}'" if e.filename else "a file"
        report_error(f"flowrl: error: could not access {where}: {os_error_reason(e)}.")
        return 2
    except KeyboardInterrupt:
        print("flowrl: interrupted.", file=sys.stderr)
        return 130
    except Preempted:
        print("flowrl: stopped by a second SIGTERM; the run's last checkpoint is the one to resume from.", file=sys.stderr)
        return PREEMPTED_EXIT


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that Python's final flush of a closed pipe does not print a second error."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (a test's capture)
        pass


def _tiny(args) -> int:
    from .pipelines.tiny.command import run_tiny

    return run_tiny(args)


def _check_arguments(args) -> None:
    """Out-of-range arguments are refused before any model is loaded, in one sentence naming the argument."""
    chosen = args.command in ("sample", "eval") and args.out is None
    if args.command in ("sample", "eval"):  # before anything else: where it writes, never over an existing file
        args.out = _output_file(args)
    if args.command == "sample":
        _check_sample_arguments(args)
    searching = args.command == "eval" and args.spec is None and _eval_search(args) is not None  # bounds refused here
    if searching:
        from .visualize import image_format

        image_format(args.out)
        if chosen:
            print(f"flowrl: --out not given; the chosen samples go to {args.out}", file=sys.stderr)
    if args.command in ("serve-reward", "label") and args.port is not None and not 0 <= args.port <= 65535:
        raise FlowRLError(f"--port must be in 0-65535, got {args.port}.")
    if args.command == "sample" or searching:
        _check_writable(args.out)


def _check_sample_arguments(args) -> None:
    import math

    for flag, value in (("-n/--num-samples", args.num_samples), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise FlowRLError(f"{flag} must be at least 1, got {value}.")
    if args.guidance_scale is not None and not math.isfinite(args.guidance_scale):
        raise FlowRLError(f"--guidance-scale must be a finite number, got {args.guidance_scale}.")
    if args.seed < 0:
        raise FlowRLError(f"--seed must be non-negative, got {args.seed}.")
    if args.out.suffix.lower() not in (".npy", ".jsonl"):  # .jsonl: a diffusion LM's completions
        from .visualize import image_format

        image_format(args.out)  # an --out extension that names no image format: one sentence, before any model loads


def _output_file(args) -> Path:
    """Where ``flowrl sample`` / ``flowrl eval`` (a search) writes: ``--out`` when given, refused when it exists unless
    ``--overwrite``; else a new folder named for the command and the time, under the run of a run checkpoint (its
    ``outputs/``) or under ``flowrl_outputs/`` in the working directory, so that no command replaces another's files."""
    if args.command == "sample":  # a diffusion LM's samples are text
        command, name = "sample", "samples.jsonl" if _text_source(args.source) is not None else "samples.png"
    else:
        command, name = "eval", "best_of_n.png"
    if args.out is not None:
        siblings = [args.out] if command == "sample" else [args.out, args.out.with_suffix(".jsonl")]
        existing = next((p for p in siblings if p.exists()), None)
        if existing is not None and not args.overwrite:
            raise FlowRLError(f"'{existing}' already exists; give another --out, or --overwrite to replace it.")
        return args.out
    import time

    source = Path(args.source) if args.source else None
    in_run = source is not None and source.parent.name == "checkpoints" and (source.parent.parent / "config.yaml").is_file()
    base = source.parent.parent / "outputs" if in_run else Path("flowrl_outputs")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = base / f"{command}_{stamp}", 2
    while folder.exists():
        folder, n = base / f"{command}_{stamp}_{n}", n + 1
    return folder / name


def _search_flags(args) -> dict:
    """The search flags given on the command line (``--best-of``: 4), each set up by a search's section."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in _SEARCH_FLAGS}
    return {flag: value for flag, value in given.items() if value is not None}


def _eval_search(args):
    """The search ``flowrl eval`` is asked for (None: the plain evaluation), its bounds and combinations checked."""
    from .inference.flags import search_from_flags

    name, *settings = args.search or [None]
    return search_from_flags(_search_flags(args), name, settings)


def _check_writable(path: Path) -> None:
    """Refuse an output path that cannot be written before minutes of sampling, not after (the write itself
    still reports any later failure in one sentence)."""
    import errno
    import os

    from .atomic_files import os_error_reason

    if path.is_dir():
        raise FlowRLError(f"could not write '{path}': it is a directory.")
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)  # the nearest existing ancestor
    if parent is None:
        return
    if not parent.is_dir():
        raise FlowRLError(f"could not write '{path}': '{parent}' is a file, not a directory.")
    if not os.access(parent, os.W_OK | os.X_OK):
        code = errno.EROFS if os.statvfs(parent).f_flag & os.ST_RDONLY else errno.EACCES
        raise FlowRLError(f"could not write '{path}': {os_error_reason(OSError(code, os.strerror(code)))}.")


def _presets(args) -> int:
    from .evidence import LEGEND, badge
    from .presets import PRESET_DIR, preset_names, summary

    names = preset_names()
    width = max(len(n) for n in names)
    # one header line: tools read every later line's first word as a preset name
    say(f"{len(names)} presets shipped in {PRESET_DIR} (flowrl train NAME [key=value ...]); {LEGEND} (docs/evidence.md):")
    for name in names:
        say(f"  {name:<{width}}  {badge(name)}  {summary(name)}")
    return 0


def _config(args) -> int:

    from .config_reference import config_text

    say(config_text(args.target, args.name))  # a closed pipe (flowrl config | head): main() ends quietly
    return 0


def _serve_reward(args) -> int:
    from .reward_server import serve_main

    return serve_main(args.config, port=args.port)


def _label(args) -> int:
    from .preferences.label_server import serve

    return serve(args.directory, host=args.host, port=args.port)


def _train(args) -> int:
    from .config import load_config
    from .trainer import Trainer
    from .training.distributed import end_failed_run, end_process_group, exit_launched_process
    from .training.failure import RunFailed
    from .training.run_logger import json_line
    from .training.run_summary import human_summary

    config = load_config(args.config, args.overrides)
    trainer = Trainer(config)
    try:
        summary = trainer.fit()
    except RunFailed as e:  # every process stopped together, the work saved, summary.json written
        if args.debug and e.traceback:  # the process that failed
            print(e.traceback, end="", file=sys.stderr, flush=True)
        return end_failed_run(f"flowrl: error: {e}", trainer.is_main, e.together)
    if trainer.is_main:  # one summary per run, not one per process
        say(json_line(summary) if args.json else human_summary(summary, trainer.run_dir))
    code = PREEMPTED_EXIT if summary["status"] == "preempted" else 0
    if end_process_group():
        exit_launched_process(code)
    return code


def _config_for_source(source: str, overrides: list[str]):
    """A checkpoint directory carries its config.yaml (verified against the checkpoint's checksums before it is
    read); a run's ``checkpoints/latest`` pointer names its newest valid checkpoint; anything else is a YAML config file."""
    from .config import load_config
    from .training.checkpoint import STATE_FILE, checkpoint_directory, verify_checkpoint

    path = checkpoint_directory(Path(source))
    if path.is_dir():
        if (path / "checkpoints").is_dir() and not (path / STATE_FILE).exists():
            steps = sorted(p.name for p in (path / "checkpoints").glob("step_*") if p.is_dir())
            example = path / "checkpoints" / (steps[-1] if steps else "step_...")
            raise FlowRLError(f"'{path}' is a run directory, not a checkpoint; pass one of its checkpoints, e.g. '{example}'.")
        if not (path / "config.yaml").is_file():
            raise FlowRLError(f"'{path}' is not a flowrl checkpoint (no config.yaml inside).")
        verify_checkpoint(path, ["config.yaml"])
        return load_config(path / "config.yaml", overrides), path
    return load_config(path, overrides), None


def _eval(args) -> int:
    from .eval_command import evaluate_again, run_evaluation
    from .training.run_logger import json_line

    if args.spec is not None:
        if args.source is not None or args.overrides or _search_flags(args) or args.search is not None:
            raise FlowRLError(
                "--spec re-runs the recorded evaluation as it was; give it alone (no source, overrides or search flags such as --best-of or --select)."
            )
        return evaluate_again(args.spec, args.out)
    if args.source is None:
        raise FlowRLError("flowrl eval needs a checkpoint directory, a YAML config or a .jsonl file (or --spec FILE).")
    if args.source.endswith(".jsonl"):
        from .evaluation.recorded import format_report, grade_recorded

        result = grade_recorded(args.source, field=args.field, gold_field=args.gold_field)
        say(format_report(result))
        say(json_line({k: result[k] for k in ("n", "n_skipped", "accuracy", "extracted_fraction")}))
        return 0
    search = _eval_search(args)
    config, checkpoint = _config_for_source(args.source, args.overrides)
    say(json_line(run_evaluation(config, checkpoint, search or {"name": "plain"}, args.out)))  # NaN -> null
    return 0


def _sample(args) -> int:
    from .samplers.rollout import sample

    if args.num_samples < 1:
        raise FlowRLError(f"-n must be at least 1, got {args.num_samples}.")
    text = _text_source(args.source)
    if text is not None:
        return _sample_text(args, *text)
    if args.out.suffix.lower() == ".jsonl":
        raise FlowRLError(f"'{args.source}' samples images: give --out a .png grid or a .npy array, not '{args.out}'.")
    pipe_cfg, steps, guidance, config = _sample_source(args.source)
    pipeline = _sample_pipeline(Path(args.source), pipe_cfg, config)
    if args.image is not None and not Path(args.image).is_file():
        raise FlowRLError(f"--image '{args.image}' does not exist.")
    if args.prompt:
        prompts, metadata = args.prompt, [{"image": args.image} if args.image else {} for _ in args.prompt]
    else:  # the first held-out item whole: an edit or image-to-video model's prompt comes with its source image
        prompt, item = _first_held_out_item(args.source, config)
        prompts, metadata = [prompt], [{**item, "image": args.image} if args.image else item]
    sampler, steps, guidance = _sample_settings(args, pipeline, config, steps, guidance)
    traj = sample(pipeline, sampler, prompts, args.num_samples, steps, guidance, seed=args.seed, metadata=metadata)
    _write_samples(traj.samples, args.out, len(prompts), args.num_samples)
    return 0


def _sample_settings(args, pipeline, config, steps: int, guidance: float):
    """(sampler, steps, guidance) flowrl sample draws with: the flags where given, else the source's."""
    return _sample_sampler(args, pipeline, config), args.steps or steps, guidance if args.guidance_scale is None else args.guidance_scale


def _sample_source(source: str):
    """(pipeline section, steps, guidance, the run's config or None) of a run checkpoint or an embedded model's name. A
    checkpoint samples as its run evaluates (eval.num_inference_steps / eval.guidance_scale, else the rollout's): the
    numbers the run reported are of that model."""
    if Path(source).is_dir() and (Path(source) / "config.yaml").is_file():
        from .config import eval_steps_and_guidance

        config, _ = _config_for_source(source, [])
        return config.pipeline, *eval_steps_and_guidance(config), config
    from .pipelines import FAMILIES
    from .pipelines.embedded_models import EMBEDDED_IMAGE_FAMILIES

    family = EMBEDDED_IMAGE_FAMILIES.get(source, "digits")  # an embedded model by name, else a model directory
    return FAMILIES.section(family)(pretrained=source), 10, 1.0, None


def _sample_pipeline(source: Path, pipe_cfg, config):
    """The model, on the threads its family runs best on, with a checkpoint's weights loaded."""
    import torch

    from .pipelines import build_pipeline
    from .pipelines.common import device_for
    from .training.checkpoint import load_checkpoint_weights

    threads = (config.train.num_threads if config is not None else None) or pipe_cfg.default_num_threads()
    if threads:
        torch.set_num_threads(threads)
    pipeline = build_pipeline(pipe_cfg, device_for(pipe_cfg.device))
    if config is not None:
        load_checkpoint_weights(pipeline, source)
        pipeline.guidance_mode = config.rollout.guidance_mode
    pipeline.denoiser.eval()
    return pipeline


def _first_held_out_item(source: str, config) -> tuple[str, dict]:
    if config is None:
        raise FlowRLError(f"--prompt is required when sampling from '{source}' (it is not a run checkpoint).")
    from .evaluation.held_out import eval_pool

    prompt, metadata = eval_pool(config)[0]
    return prompt, dict(metadata)


def _text_source(source: str):
    """(config, checkpoint or None) when ``source`` is a diffusion LM: a run checkpoint of one, or an embedded LM by
    name (sampled as its preset does); None for an image or video model."""
    from .config import load_config
    from .presets import embedded_lm_presets

    presets = embedded_lm_presets()
    if source in presets:
        return load_config(presets[source], [f"pipeline.pretrained={source}"]), None
    if Path(source).is_dir() and (Path(source) / "config.yaml").is_file():
        config, checkpoint = _config_for_source(source, [])
        return (config, checkpoint) if config.pipeline.modality == "text" else None
    return None


def _sample_text(args, config, checkpoint) -> int:
    """A diffusion LM's completions at its evaluation temperature (greedy unless the run says otherwise), one JSON
    line per completion on stdout and in a .jsonl file."""
    import json

    from .atomic_files import atomic_path
    from .eval_command import text_model

    out = args.out
    if out.suffix.lower() != ".jsonl":
        raise FlowRLError(f"a diffusion LM's samples are text: give --out a .jsonl file, not '{args.out}'.")
    modality, _ = text_model(config, checkpoint)
    prompts = args.prompt or [_first_held_out_item(args.source, config)[0]]
    completions = modality.sample(prompts, args.num_samples, args.seed)
    rows = [{"prompt": p, "completion": c} for p, c in zip([p for p in prompts for _ in range(args.num_samples)], completions, strict=True)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for row in rows:
        say(json.dumps(row))
    print(f"flowrl: wrote {out} ({len(prompts)} prompt(s) x {args.num_samples} completions)", file=sys.stderr)
    return 0


def _sample_sampler(args, pipeline, config):
    """The deterministic sampler, or a checkpoint's own training sampler (--sampler rollout); a masked-token model's
    own unmasking sampler (image tokens have no ODE), as its evaluation uses."""
    from .samplers import ODEConfig, build_sampler

    if args.sampler == "rollout" and config is None:
        raise FlowRLError(f"--sampler rollout uses a checkpoint's training sampler, and '{args.source}' is not a run checkpoint.")
    if pipeline.prediction_type == "masked_tokens":
        from .samplers.masked_image import MaskedImageConfig

        section = config.sampler if config is not None else MaskedImageConfig()
    else:
        section = config.sampler if args.sampler == "rollout" else ODEConfig()
    return build_sampler(section, pipeline)


def _write_samples(samples, out: Path, prompts: int, per_prompt: int) -> None:
    """A .npy array of the final samples (for analysis), or a grid (videos also as MP4 and GIF clips)."""
    from .visualize import save_grid, save_videos

    out.parent.mkdir(parents=True, exist_ok=True)  # a new output folder (no --out) is made only now, once there is output
    if out.suffix.lower() == ".npy":  # the raw final samples, e.g. the 2-D toy's (N, 2) points
        import numpy as np

        from .atomic_files import atomic_path

        with atomic_path(out) as tmp, open(tmp, "wb") as f:
            np.save(f, samples.detach().float().cpu().numpy())
        say(f"wrote {out} (array {tuple(samples.shape)}, {prompts} prompt(s) x {per_prompt} samples)")
        return
    save_grid(samples, out, ncol=per_prompt)
    written = [out]
    if samples.ndim == 5:  # videos: the PNG is a filmstrip; the clips themselves as MP4 and GIF
        written += save_videos(samples, out.with_suffix(""), ncol=per_prompt)
    say(f"wrote {', '.join(map(str, written))} ({prompts} prompt(s) x {per_prompt} samples)")


def _check(args) -> int:
    from .check import check, format_report
    from .training.run_logger import json_line

    result = check(args.config, args.overrides, sample_command=_sample_command)
    say(json_line(result.as_json()) if args.json else format_report(result))
    return 0 if result.passed else 1


def _sample_command(checkpoint: Path, pipeline):
    """What `flowrl sample CHECKPOINT` with no flags samples with (flowrl check runs it on the run's own model)."""
    from .check import SampleCommand

    args = _parser().parse_args(["sample", str(checkpoint)])
    pipe_cfg, steps, guidance, config = _sample_source(args.source)
    sampler, steps, guidance = _sample_settings(args, pipeline, config, steps, guidance)
    return SampleCommand(pipe_cfg, sampler, steps, guidance, config.rollout.guidance_mode)


def _export(args) -> int:
    """A standalone model directory: the base model's components with the fine-tuned denoiser (LoRA
    merged into its weights), loadable with ``DiffusionPipeline.from_pretrained(out)`` for diffusers
    checkpoints; or, with --lora-only, the diffusers LoRA file for ``load_lora_weights``."""
    from .atomic_files import atomic_directory
    from .model_card import write_model_card
    from .pipelines import build_pipeline
    from .training.checkpoint import load_checkpoint_weights

    source = Path(args.checkpoint)
    _check_export_arguments(source, args)
    if getattr(args, "format", "diffusers") == "comfy":  # (a Namespace built by hand may not carry it)
        return _export_comfy(source, args)
    config, _ = _config_for_source(str(source), [])
    if config.pipeline.name == "toy2d":
        raise FlowRLError(
            "the 2-D toy has no model format to export: its checkpoint's safetensors are the model; sample it with "
            f"flowrl sample {source} --out points.npy."
        )
    pipeline = build_pipeline(config.pipeline, "cpu")
    load_checkpoint_weights(pipeline, source)
    with atomic_directory(args.out) as tmp:
        if args.lora_only:
            if not pipeline.has_lora:
                raise FlowRLError("--lora-only needs a LoRA run (this checkpoint fine-tuned the whole denoiser).")
            pipeline.save_lora(tmp)
        else:
            _write_merged_model(tmp, pipeline, config)
        write_model_card(
            tmp, source, config, "lora" if args.lora_only else "full", where=args.push_to_hub or str(args.out), license=args.license
        )
    say(f"wrote {args.out}")
    if args.push_to_hub is not None:  # the local export is complete before anything is sent: a failed push leaves it whole
        _push_export(args)
    return 0


def _export_comfy(source: Path, args) -> int:
    """The checkpoint's LoRA as one file in the model's original / kohya layout (ComfyUI, kohya-style tools), with the
    model card beside it; the base model is not loaded."""
    from .atomic_files import atomic_directory
    from .export_formats import export_lora
    from .model_card import write_model_card

    if args.lora_only or args.push_to_hub is not None:
        raise FlowRLError("--format comfy writes a LoRA file already; give it without --lora-only or --push-to-hub.")
    config, _ = _config_for_source(str(source), [])
    with atomic_directory(args.out) as tmp:
        written = export_lora(source, tmp, "comfy")
        write_model_card(tmp, source, config, "lora", where=str(args.out), license=args.license)
    say(f"wrote {args.out / written.name} (LoRA in the {config.pipeline.name} original layout, for ComfyUI / kohya)")
    return 0


def _check_export_arguments(source: Path, args) -> None:
    if not (source / "config.yaml").is_file():
        raise FlowRLError(f"'{source}' is not a run checkpoint directory (it has no config.yaml).")
    if args.out.exists():
        raise FlowRLError(f"export target '{args.out}' already exists; choose a new directory.")
    _check_writable(args.out)
    if args.push_to_hub is not None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError:
            raise FlowRLError(f"--push-to-hub '{args.push_to_hub}' is not a hub repository id (expected 'user/name').") from None


def _write_merged_model(tmp: Path, pipeline, config) -> None:
    """The base model's components with the merged denoiser: copied from a local base, assembled by diffusers around
    the merged denoiser for a hub id."""
    import shutil

    if config.pipeline.modality == "text":  # a diffusion LM: the transformers model (LoRA merged) and its tokenizer
        model = pipeline.model.merge_and_unload() if pipeline.has_lora else pipeline.model
        model.save_pretrained(tmp)
        pipeline.tokenizer.save_pretrained(tmp)
        return
    # by subfolder; several for a denoiser that spans components (Wan2.2's transformer + transformer_2)
    merged = (
        pipeline.merged_components()
        if hasattr(pipeline, "merged_components")
        else {pipeline.denoiser_subfolder: pipeline.merged_denoiser()}
    )
    base = Path(pipeline.source)  # a local directory (embedded models: their shipped one) or a hub id
    if base.is_dir():
        shutil.copytree(base, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*merged, "training_info.json"))
        for name, module in merged.items():
            module.save_pretrained(tmp / name)
        return
    from diffusers import DiffusionPipeline

    assembled = DiffusionPipeline.from_pretrained(config.pipeline.pretrained, revision=config.pipeline.revision, **merged)
    assembled.save_pretrained(tmp)


def _push_export(args) -> None:
    from .model_card import push_to_hub

    try:
        url = push_to_hub(args.out, args.push_to_hub, private=args.private)
    except FlowRLError as e:
        raise FlowRLError(
            f"could not push to the hub: {str(e).rstrip('.')}; the local export '{args.out}' is complete, "
            f"upload it later with `hf upload {args.push_to_hub} {args.out}`."
        ) from None
    say(f"pushed to {url}")


if __name__ == "__main__":
    sys.exit(main())
