"""``flowrl train | sample | eval``: the command line. Errors the user can fix print one sentence."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import FlowRLError, Preempted

PREEMPTED_EXIT = 143  # 128 + SIGTERM: what a shell, SLURM and Kubernetes read as "ended by SIGTERM"

EPILOG = """examples:
  flowrl presets
  flowrl train digits/grpo                                        (a shipped preset; or a YAML file)
  flowrl train configs/digits/grpo.yaml train.iterations=10 output_dir=runs/quick
  flowrl sample runs/digits_grpo/checkpoints/step_000030 --prompt "a handwritten seven" -n 8
  flowrl eval runs/digits_grpo/checkpoints/step_000030
  flowrl eval configs/digits/grpo.yaml --best-of 16      (or --svdd 16: inference-time scaling)
  flowrl eval configs/dllm/diffu_grpo.yaml sampler.eval_temperature=1 --best-of 16 --select majority,likelihood
  flowrl export runs/sd_lora/checkpoints/step_000100 exported_model
  flowrl export runs/sd_lora/checkpoints/step_000100 my_lora --lora-only --push-to-hub me/my-lora
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
    t = sub.add_parser("train", help="train with a preset or YAML config and key=value overrides")
    t.add_argument("config", help="a shipped preset by name (digits/grpo; see flowrl presets) or a YAML file")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.iterations=10")
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
    s.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the checkpoint's)")
    s.add_argument(
        "--sampler",
        choices=("ode", "rollout"),
        default="ode",
        help="ode: the deterministic sampler (default); rollout: a checkpoint's own training sampler (e.g. the memoryless "
        "SDE an Adjoint Matching model was trained on), with fresh noise",
    )
    s.add_argument("--guidance-scale", type=float, default=None)
    s.add_argument("--image", default=None, help="first frame for image-to-video models (wan_i2v)")
    s.add_argument(
        "--out",
        type=Path,
        default=Path("samples.png"),
        help="a .png grid (images; videos also as MP4 / GIF), or a .npy file: the final samples as a float32 array (N, ...)",
    )
    e = sub.add_parser(
        "eval",
        help="held-out evaluation reward of a checkpoint or a config's starting model; or grade the generations recorded in a .jsonl file",
    )
    e.add_argument("source", help="checkpoint directory, YAML config, or .jsonl of recorded generations")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--field", default="llada_generation_256", help="(.jsonl) the field holding the generations")
    e.add_argument("--gold-field", default="ground_truth", help="(.jsonl) the field holding the gold answer")
    e.add_argument(
        "--best-of",
        type=int,
        default=None,
        metavar="N",
        help="Best-of-N: keep the best of N candidates per held-out item (by the run's reward); prints the "
        "reward at N = 1, 2, 4, ... and writes the chosen samples' grid to --out",
    )
    e.add_argument(
        "--svdd",
        type=int,
        default=None,
        metavar="M",
        help="SVDD-PM: sample the held-out items keeping, at every step, the best of M candidates from the "
        "rollout sampler by the reward of their predicted x0; writes the grid to --out",
    )
    e.add_argument(
        "--select",
        default=None,
        metavar="RULES",
        help="(diffusion LMs) how --best-of / --svdd choose without the gold answer, comma-separated: majority "
        "(self-consistency over the extracted answers; --best-of only), likelihood (the model's own), a reward's name "
        "(e.g. format), or reward (the run's reward, if it does not read the gold answer); default majority,likelihood "
        "for --best-of, likelihood for --svdd",
    )
    e.add_argument(
        "--out",
        type=Path,
        default=Path("best_of_n.png"),
        help="(--best-of, --svdd) grid of the chosen samples; for diffusion LMs the accuracy-vs-N plot, "
        "the chosen completions going to the same name with .jsonl",
    )
    x = sub.add_parser(
        "export", help="write a run checkpoint as a standalone diffusers model directory (merged weights) or as a diffusers LoRA file"
    )
    x.add_argument("checkpoint", help="a run checkpoint directory, e.g. runs/x/checkpoints/step_000030")
    x.add_argument("out", type=Path, help="output directory (must not exist)")
    x.add_argument("--lora-only", action="store_true", help="write only pytorch_lora_weights.safetensors (LoRA runs)")
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
    sub.add_parser("presets", help="list the presets shipped with flowrl (flowrl train NAME)")
    r = sub.add_parser("serve-reward", help="serve a reward model over HTTP on loopback (token in FLOWRL_REWARD_TOKEN)")
    r.add_argument("config", help="reward server YAML (see docs/reward_server.md)")
    r.add_argument("--port", type=int, default=None, help="override the config's port (0 = any free port)")
    lb = sub.add_parser("label", help="label a pairs directory by hand in a browser (writes DIR/labels.jsonl; docs/labeling.md)")
    lb.add_argument("directory", help="a pairs directory (python -m flowrl.preference_pairs)")
    lb.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default loopback; any other needs the token, "
        "FLOWRL_LABEL_TOKEN or a random one printed in the address)",
    )
    lb.add_argument("--port", type=int, default=8765, help="port (0 = any free port)")
    return p


def _quiet_library_progress() -> None:
    """flowrl draws its own progress bars; the libraries' per-file loading bars only bury them."""
    import diffusers
    import transformers

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command not in ("label", "presets"):  # no model loads: no need to import diffusers
        _quiet_library_progress()
    try:
        _check_arguments(args)
        return {
            "train": _train,
            "sample": _sample,
            "eval": _eval,
            "export": _export,
            "serve-reward": _serve_reward,
            "label": _label,
            "presets": _presets,
        }[args.command](args)
    except FlowRLError as e:
        from .distributed import report_error

        report_error(f"flowrl: error: {e}")  # once per launch of several processes, and to the launcher's report
        return 2
    except OSError as e:  # a file operation not wrapped where it happens: still one sentence naming the path
        from .checkpoint import os_error_reason
        from .distributed import report_error

        where = f"'{e.filename}'" if e.filename else "a file"
        report_error(f"flowrl: error: could not access {where}: {os_error_reason(e)}.")
        return 2
    except KeyboardInterrupt:
        print("flowrl: interrupted.", file=sys.stderr)
        return 130
    except Preempted:
        print("flowrl: stopped by a second SIGTERM; the run's last checkpoint is the one to resume from.", file=sys.stderr)
        return PREEMPTED_EXIT


def _check_arguments(args) -> None:
    """Out-of-range arguments are refused before any model is loaded, in one sentence naming the argument."""
    import math

    def at_least_one(flag: str, value) -> None:
        if value is not None and value < 1:
            raise FlowRLError(f"{flag} must be at least 1, got {value}.")

    if args.command == "sample":
        at_least_one("-n/--num-samples", args.num_samples)
        at_least_one("--steps", args.steps)
        if args.guidance_scale is not None and not math.isfinite(args.guidance_scale):
            raise FlowRLError(f"--guidance-scale must be a finite number, got {args.guidance_scale}.")
        if args.seed < 0:
            raise FlowRLError(f"--seed must be non-negative, got {args.seed}.")
        if args.out.suffix.lower() != ".npy":
            from .visualize import image_format

            image_format(args.out)  # an --out extension that names no image format: one sentence, before any model loads
    if args.command == "eval" and (args.best_of is not None or args.svdd is not None):
        from .visualize import image_format

        image_format(args.out)
    if args.command == "eval":
        at_least_one("--best-of", args.best_of)
        at_least_one("--svdd", args.svdd)
    if args.command in ("serve-reward", "label") and args.port is not None and not 0 <= args.port <= 65535:
        raise FlowRLError(f"--port must be in 0-65535, got {args.port}.")
    if args.command == "sample" or (args.command == "eval" and (args.best_of is not None or args.svdd is not None)):
        _check_writable(args.out)


def _check_writable(path: Path) -> None:
    """Refuse an output path that cannot be written before minutes of sampling, not after (the write itself
    still reports any later failure in one sentence)."""
    import errno
    import os

    from .checkpoint import os_error_reason

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
    from .presets import PRESET_DIR, preset_names, summary

    names = preset_names()
    width = max(len(n) for n in names)
    print(f"{len(names)} presets shipped in {PRESET_DIR} (flowrl train NAME [key=value ...]):")
    for name in names:
        print(f"  {name:<{width}}  {summary(name)}")
    return 0


def _serve_reward(args) -> int:
    from .reward_server import serve_main

    return serve_main(args.config, port=args.port)


def _label(args) -> int:
    from .label_server import serve

    return serve(args.directory, host=args.host, port=args.port)


def _train(args) -> int:
    from .config import load_config
    from .distributed import end_process_group
    from .run_logger import json_line
    from .trainer import Trainer

    config = load_config(args.config, args.overrides)
    trainer = Trainer(config)
    summary = trainer.fit()
    if trainer.is_main:  # one summary line per run, not one per process
        print(json_line(summary))
    end_process_group()
    return PREEMPTED_EXIT if summary["status"] == "preempted" else 0


def _config_for_source(source: str, overrides: list[str]):
    """A checkpoint directory carries its config.yaml (verified against the checkpoint's checksums before it is
    read); anything else is a YAML config file."""
    from .checkpoint import STATE_FILE, verify_checkpoint
    from .config import load_config

    path = Path(source)
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
    from .checkpoint import read_weights
    from .run_logger import json_line

    if args.source.endswith(".jsonl"):
        from .evaluation.recorded import format_report, grade_recorded

        result = grade_recorded(args.source, field=args.field, gold_field=args.gold_field)
        print(format_report(result))
        print(json_line({k: result[k] for k in ("n", "n_skipped", "accuracy", "extracted_fraction")}))
        return 0
    config, checkpoint = _config_for_source(args.source, args.overrides)
    if config.pipeline.modality == "text" and args.best_of is not None:
        return _text_best_of_n(config, checkpoint, args.best_of, args.select, args.out)
    if config.pipeline.modality == "text" and args.svdd is not None:
        return _text_svdd(config, checkpoint, args.svdd, args.select, args.out)
    if args.select is not None:
        raise FlowRLError("--select chooses among a diffusion LM's completions; image best-of-N and SVDD select by the run's reward.")
    if args.best_of is not None:
        return _best_of_n(config, checkpoint, args.best_of, args.out)
    if args.svdd is not None:
        return _svdd(config, checkpoint, args.svdd, args.out)
    from .trainer import Trainer

    trainer = Trainer(config)
    if checkpoint is not None:
        trainer.load_weights(read_weights(checkpoint))
    metrics = trainer.evaluate()
    print(json_line({**{k: round(v, 6) for k, v in metrics.items()}, "settings": _eval_settings(config)}))  # NaN -> null
    return 0


def _eval_settings(config) -> dict:
    """The settings an evaluation number depends on, printed with it (block length alone moves a dLLM's
    accuracy by points; steps, guidance and seed move an image reward)."""
    if config.pipeline.modality == "text":
        sc = config.sampler
        return {
            "model": config.pipeline.pretrained,
            "dataset": config.prompts.dataset,
            "eval_size": config.prompts.eval_size,
            "gen_length": sc.gen_length,
            "steps": sc.steps,
            "block_length": sc.block_length,
            "temperature": sc.eval_temperature,
            "remasking": sc.remasking,
            "threshold": sc.threshold,
        }
    from .config import eval_steps_and_guidance

    steps, guidance = eval_steps_and_guidance(config)
    return {
        "model": config.pipeline.pretrained,
        "dataset": config.prompts.dataset,
        "samples_per_prompt": config.eval.samples_per_prompt,
        "seed": config.eval.seed,
        "steps": steps,
        "guidance_scale": guidance,
        "sampler": "ode",
    }


def _image_model(config, checkpoint: Path | None):
    """The config's image / video model (a checkpoint's weights loaded), its samplers, its reward and its
    held-out setting: what the inference-time scaling methods use, with no trainer or optimizer."""
    from . import seeding
    from .config import set_num_threads
    from .evaluation.held_out import held_out_images
    from .modalities.images import build_image_components
    from .reward_models import build_reward_from_config

    set_num_threads(config)
    device = _device(config.pipeline.device)
    reward = build_reward_from_config(config.reward)
    seeding.seed_initialisation(config.seed)
    parts = build_image_components(config, device)
    if checkpoint is not None:
        _load_checkpoint_weights(parts.pipeline, checkpoint)
    parts.pipeline.denoiser.eval()
    return parts, reward, held_out_images(config, parts.pipeline, device)


def _best_of_n(config, checkpoint: Path | None, n: int, out: Path) -> int:
    import torch

    from .inference.best_of_n import best_of_n
    from .run_logger import json_line
    from .visualize import save_grid

    parts, reward, held = _image_model(config, checkpoint)
    result = best_of_n(
        parts.pipeline,
        parts.eval_sampler,
        reward,
        held.prompts,
        held.metadata,
        n,
        held.sigmas,
        held.generator(),
        held.guidance_scale,
        config.rollout.batch_size,
    )
    curve = result.scaling_curve()
    print(f"best-of-N on {len(result.best)} held-out items ({config.eval.samples_per_prompt} per prompt):")
    for k, v in curve.items():
        print(f"  N = {k:4d}   eval reward {v:.4f}")
    save_grid(result.samples, out, ncol=config.eval.samples_per_prompt)
    components = {f"eval/reward/{k}@{n}": round(float(v[torch.isfinite(v)].mean()), 6) for k, v in result.components.items()}
    print(
        json_line(
            {
                **{f"eval/reward/mean@{k}": round(v, 6) for k, v in curve.items()},
                **components,
                "grid": str(out),
                "settings": _eval_settings(config),
            }
        )
    )
    return 0


def _svdd(config, checkpoint: Path | None, m: int, out: Path) -> int:
    import torch

    from .inference.svdd import svdd_in_batches
    from .run_logger import json_line
    from .visualize import save_grid

    parts, reward, held = _image_model(config, checkpoint)
    gen = held.generator()
    noise = parts.pipeline.initial_noise(len(held), gen)  # the plain evaluation's start noise
    result = svdd_in_batches(
        parts.pipeline,
        parts.sampler,
        reward,
        held.prompts,
        held.metadata,
        m,
        held.sigmas,
        gen,
        held.guidance_scale,
        config.rollout.batch_size,
        noise,
    )
    save_grid(result.samples, out, ncol=config.eval.samples_per_prompt)
    finite = result.scores[torch.isfinite(result.scores)]
    components = {f"eval/reward/{k}@svdd{m}": round(float(v.nanmean()), 6) for k, v in result.components.items()}
    settings = {**_eval_settings(config), "sampler": parts.sampler.name}  # SVDD draws from the rollout sampler
    print(json_line({f"eval/reward/mean@svdd{m}": round(float(finite.mean()), 6), **components, "grid": str(out), "settings": settings}))
    return 0


def _text_model(config, checkpoint: Path | None):
    """The config's diffusion LM (a checkpoint's weights loaded, DCoLT's unmasking head included) and the run's
    reward, which grades the held-out items: what text best-of-N and SVDD use, with no trainer or optimizer."""
    from . import seeding
    from .checkpoint import read_weights
    from .config import set_num_threads
    from .modalities.text import TextModality
    from .reward_models import build_reward_from_config

    set_num_threads(config)
    seeding.seed_initialisation(config.seed)  # DCoLT's head is created fresh before its weights are loaded
    modality = TextModality(config, _device(config.pipeline.device))
    modality.check()
    if checkpoint is not None:
        extra = modality.objective.extra_module
        if extra is not None:
            extra.load_state_dict({k[len("objective.") :]: v for k, v in read_weights(checkpoint).items() if k.startswith("objective.")})
        _load_checkpoint_weights(modality.pipeline, checkpoint)
    modality.pipeline.model.eval()
    return modality, build_reward_from_config(config.reward)


def _text_rules(select: str | None, default: str) -> list[str]:
    rules = [r.strip() for r in (select or default).split(",") if r.strip()]
    if not rules:
        raise FlowRLError(f"--select needs at least one rule, got '{select}'.")
    return list(dict.fromkeys(rules))


def _text_best_of_n(config, checkpoint: Path | None, n: int, select: str | None, out: Path) -> int:
    import json

    from tqdm import tqdm

    from .checkpoint import atomic_path
    from .inference.plots import save_scaling_plot
    from .inference.text_best_of_n import ORACLE, text_best_of_n
    from .inference.text_candidates import build_scorers, check_candidates_differ
    from .run_logger import json_line

    rules = _text_rules(select, "majority,likelihood")
    check_candidates_differ("--best-of", n, config.sampler.eval_temperature, config.sampler.remasking)  # before minutes of loading
    scorers = build_scorers(rules, config.reward)  # refuses a gold grader before any model is loaded
    modality, grader = _text_model(config, checkpoint)
    prompts, metadata = [p for p, _ in modality.eval_pool], [m for _, m in modality.eval_pool]
    temperature = config.sampler.eval_temperature
    with tqdm(total=n * len(prompts), desc=f"best-of-{n}", unit="completion", disable=None) as bar:
        result = text_best_of_n(
            modality.pipeline,
            config.sampler,
            config.pipeline.prompt_length,
            grader,
            scorers,
            prompts,
            metadata,
            n,
            temperature,
            config.eval.seed,
            config.rollout.batch_size,
            modality.position_scorer,
            progress=bar.update,
        )
    curves = result.curves(rules)
    print(
        f"best-of-N on {len(prompts)} held-out items, candidates at temperature {temperature:g}; accuracy of each rule's choice "
        f"(the run's reward), and pass@N: any candidate right, an oracle upper bound, not an accuracy:"
    )
    print("  " + f"{'N':>4}" + "".join(f"{r:>14}" for r in rules) + f"{'pass@N oracle':>16}")
    for k in result.ks():
        print("  " + f"{k:>4}" + "".join(f"{curves[r][k]:>14.4f}" for r in rules) + f"{curves[ORACLE][k]:>16.4f}")
    single = result.sample_accuracy()
    print(f"  single-sample accuracy over all {n * len(prompts)} candidates: {single:.4f}")
    save_scaling_plot(
        {f"{config.pipeline.pretrained}{' (' + checkpoint.name + ')' if checkpoint else ''}, T = {temperature:g}": curves},
        out,
        "held-out accuracy (run's reward)",
    )
    rows_path = out.with_suffix(".jsonl")
    with atomic_path(rows_path) as tmp, open(tmp, "w") as f:
        for i, prompt in enumerate(prompts):  # every rule's choice at N, with the candidates' answers it chose from
            chosen = {r: int(result.choose(r, n)[i]) for r in rules}
            f.write(
                json.dumps(
                    {
                        "prompt": prompt,
                        "answers": result.answers[i],
                        "graded": result.graded[i].tolist(),
                        "chosen": {r: {"index": j, "completion": result.completions[i][j]} for r, j in chosen.items()},
                    }
                )
                + "\n"
            )
    print(
        json_line(
            {
                **{f"eval/reward/mean@{k}/{r}": round(curves[r][k], 6) for r in rules for k in result.ks()},
                **{f"eval/oracle_pass@{k}": round(curves[ORACLE][k], 6) for k in result.ks()},
                "eval/reward/mean/single_sample": round(single, 6),
                "plot": str(out),
                "completions": str(rows_path),
                "settings": {**_eval_settings(config), "n": n, "select": rules},
            }
        )
    )
    return 0


def _text_svdd(config, checkpoint: Path | None, m: int, select: str | None, out: Path) -> int:
    import json

    from tqdm import tqdm

    from .checkpoint import atomic_path
    from .inference.masked_svdd import masked_svdd_in_batches
    from .inference.text_candidates import build_scorers, check_candidates_differ
    from .run_logger import json_line

    rules = _text_rules(select, "likelihood")
    if len(rules) != 1 or rules[0] == "majority":
        raise FlowRLError(f"--svdd values each candidate by one score (likelihood, a reward's name or reward), got --select {select}.")
    check_candidates_differ("--svdd", m, config.sampler.eval_temperature, config.sampler.remasking)
    scorer = build_scorers(rules, config.reward)[0]
    modality, grader = _text_model(config, checkpoint)
    prompts, metadata = [p for p, _ in modality.eval_pool], [m_ for _, m_ in modality.eval_pool]
    with tqdm(total=len(prompts), desc=f"svdd-{m}", unit="item", disable=None) as bar:
        result = masked_svdd_in_batches(
            modality.pipeline,
            config.sampler,
            config.pipeline.prompt_length,
            scorer,
            prompts,
            m,
            config.sampler.eval_temperature,
            config.eval.seed,
            config.rollout.batch_size,
            modality.position_scorer,
            progress=bar.update,
        )
    graded = grader(result.completions, prompts, metadata)
    rows_path = out.with_suffix(".jsonl")
    with atomic_path(rows_path) as tmp, open(tmp, "w") as f:
        for i, prompt in enumerate(prompts):
            f.write(
                json.dumps(
                    {
                        "prompt": prompt,
                        "completion": result.completions[i],
                        "score": float(graded.scores[i]),
                        "value": float(result.scores[i]),
                    }
                )
                + "\n"
            )
    components = {f"eval/reward/{k}@svdd{m}": round(float(v.float().nanmean()), 6) for k, v in graded.extras.items()}
    print(
        json_line(
            {
                f"eval/reward/mean@svdd{m}/{rules[0]}": round(float(graded.scores.float().nanmean()), 6),
                **components,
                "denoiser_forwards_per_item": round(result.forwards / len(prompts), 3),
                "completions": str(rows_path),
                "settings": {**_eval_settings(config), "svdd": m, "select": rules[0]},
            }
        )
    )
    return 0


def _sample(args) -> int:

    import torch

    from .pipelines import FAMILIES, build_pipeline
    from .samplers import ODEConfig, build_sampler
    from .samplers.rollout import sample
    from .visualize import save_grid

    if args.num_samples < 1:
        raise FlowRLError(f"-n must be at least 1, got {args.num_samples}.")
    source = Path(args.source)
    if source.is_dir() and (source / "config.yaml").is_file():
        config, _ = _config_for_source(args.source, [])
        pipe_cfg, steps, guidance = config.pipeline, config.rollout.num_inference_steps, config.rollout.guidance_scale
    else:
        family = "digits_video" if args.source == "digits_video" else "digits"  # the embedded models by name
        pipe_cfg, steps, guidance, config = FAMILIES.section(family)(pretrained=args.source), 10, 1.0, None
    threads = config.train.num_threads if config is not None else None
    if threads or pipe_cfg.default_num_threads():
        torch.set_num_threads(threads or pipe_cfg.default_num_threads())
    device = _device(pipe_cfg.device)
    pipeline = build_pipeline(pipe_cfg, device)
    if config is not None:
        _load_checkpoint_weights(pipeline, source)
        pipeline.guidance_mode = config.rollout.guidance_mode
    pipeline.denoiser.eval()
    if args.prompt is None:
        if config is None:
            raise FlowRLError(f"--prompt is required when sampling from '{args.source}' (it is not a run checkpoint).")
        from .evaluation.held_out import eval_pool

        args.prompt = [eval_pool(config)[0][0]]
    if args.image is not None and not Path(args.image).is_file():
        raise FlowRLError(f"--image '{args.image}' does not exist.")
    metadata = [{"image": args.image} if args.image else {} for _ in args.prompt]
    if args.sampler == "rollout" and config is None:
        raise FlowRLError(f"--sampler rollout uses a checkpoint's training sampler, and '{args.source}' is not a run checkpoint.")
    sampler = build_sampler(config.sampler if args.sampler == "rollout" else ODEConfig(), pipeline)
    traj = sample(
        pipeline,
        sampler,
        args.prompt,
        args.num_samples,
        args.steps or steps,
        guidance if args.guidance_scale is None else args.guidance_scale,
        seed=args.seed,
        metadata=metadata,
    )
    if args.out.suffix.lower() == ".npy":  # the raw final samples, for analysis (e.g. the 2-D toy's (N, 2) points)
        import numpy as np

        from .checkpoint import atomic_path

        with atomic_path(args.out) as tmp, open(tmp, "wb") as f:
            np.save(f, traj.samples.detach().float().cpu().numpy())
        print(f"wrote {args.out} (array {tuple(traj.samples.shape)}, {len(args.prompt)} prompt(s) x {args.num_samples} samples)")
        return 0
    save_grid(traj.samples, args.out, ncol=args.num_samples)
    written = [args.out]
    if traj.samples.ndim == 5:  # videos: the PNG is a filmstrip; the clips themselves as MP4 and GIF
        from .visualize import save_videos

        written += save_videos(traj.samples, args.out.with_suffix(""), ncol=args.num_samples)
    print(f"wrote {', '.join(map(str, written))} ({len(args.prompt)} prompt(s) x {args.num_samples} samples)")
    return 0


def _device(spec: str):
    """pipeline.device honoured exactly (refused when this machine lacks it); auto: a GPU when present."""
    import torch

    from .config import resolve_device

    device = resolve_device(spec)
    return device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load_checkpoint_weights(pipeline, checkpoint: Path) -> None:
    from .checkpoint import read_weights

    weights = {k: v for k, v in read_weights(checkpoint).items() if not k.startswith("objective.")}
    try:
        pipeline.load_trainable_state_dict(weights)
    except (RuntimeError, KeyError, ValueError) as e:
        raise FlowRLError(f"checkpoint '{checkpoint}' does not match its model ({str(e).splitlines()[0][:160]}).") from None


def _export(args) -> int:
    """A standalone model directory: the base model's components with the fine-tuned denoiser (LoRA
    merged into its weights), loadable with ``DiffusionPipeline.from_pretrained(out)`` for diffusers
    checkpoints; or, with --lora-only, the diffusers LoRA file for ``load_lora_weights``."""
    import shutil

    from .checkpoint import atomic_directory
    from .model_card import push_to_hub, write_model_card
    from .pipelines import build_pipeline

    source = Path(args.checkpoint)
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
    config, _ = _config_for_source(str(source), [])
    pipeline = build_pipeline(config.pipeline, "cpu")
    _load_checkpoint_weights(pipeline, source)
    subfolder = pipeline.denoiser_subfolder
    with atomic_directory(args.out) as tmp:
        if args.lora_only:
            if not pipeline.has_lora:
                raise FlowRLError("--lora-only needs a LoRA run (this checkpoint fine-tuned the whole denoiser).")
            pipeline.save_lora(tmp)
        else:
            # by subfolder; several for a denoiser that spans components (Wan2.2's transformer + transformer_2)
            merged = pipeline.merged_components() if hasattr(pipeline, "merged_components") else {subfolder: pipeline.merged_denoiser()}
            base = Path(pipeline.source)  # a local directory (embedded models: their shipped one) or a hub id
            if base.is_dir():
                shutil.copytree(base, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*merged, "training_info.json"))
                for name, module in merged.items():
                    module.save_pretrained(tmp / name)
            else:  # a hub id: diffusers assembles the pipeline around the merged denoiser
                from diffusers import DiffusionPipeline

                assembled = DiffusionPipeline.from_pretrained(config.pipeline.pretrained, revision=config.pipeline.revision, **merged)
                assembled.save_pretrained(tmp)
        write_model_card(
            tmp, source, config, "lora" if args.lora_only else "full", where=args.push_to_hub or str(args.out), license=args.license
        )
    print(f"wrote {args.out}")
    if args.push_to_hub is not None:  # the local export is complete before anything is sent: a failed push leaves it whole
        try:
            url = push_to_hub(args.out, args.push_to_hub, private=args.private)
        except FlowRLError as e:
            raise FlowRLError(
                f"could not push to the hub: {str(e).rstrip('.')}; the local export '{args.out}' is complete, "
                f"upload it later with `hf upload {args.push_to_hub} {args.out}`."
            ) from None
        print(f"pushed to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
