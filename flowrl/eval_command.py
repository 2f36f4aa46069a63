"""What ``flowrl eval`` runs on a checkpoint or a config: the plain held-out evaluation and the inference-time
searches (best-of-N, SVDD, SMC) for image / video models and diffusion LMs. Each returns the record ``flowrl eval``
prints, with its evaluation spec (evaluation/spec.py); ``evaluate_again`` re-runs a recorded spec and compares bit for bit.
The command line (cli.py) only parses arguments and prints; the Python API can call these directly."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import FlowRLError

# --smc-lambda when not given: image / video rewards are of order 1 and differ by ~0.1 among samples; a diffusion LM's
# likelihood score is a sum of token log-probs, where lambda = 1 already squares the model's distribution
SMC_DEFAULT_LAMBDA = {"images": 10.0, "text": 1.0}


def run_evaluation(config, checkpoint: Path | None, method: dict, out: Path) -> dict:
    """Run one evaluation (``method``: plain, best_of with n, svdd with m, smc with n, lambda, ess_threshold, tempering
    and resampling; a diffusion LM's with its select rules) and return the record flowrl eval prints, its ``spec`` included."""
    text = config.pipeline.modality == "text"
    name = method.get("name")
    if name == "best_of":
        if text and method.get("stop_at") is not None:
            raise FlowRLError("--stop-at is for image and video models; a diffusion LM's best-of-N selects without a verifier.")
        if text:
            return _text_best_of_n(config, checkpoint, method["n"], method.get("select"), out)
        return _best_of_n(config, checkpoint, method["n"], out, method.get("stop_at"))
    if name == "svdd":
        return (_text_svdd if text else _svdd)(config, checkpoint, method["m"], *([method.get("select")] if text else []), out)
    if name == "smc":
        return (_text_smc if text else _smc)(config, checkpoint, method, out)
    if name in ("noise_search", "rbf"):
        if text:
            flag = "--noise-search" if name == "noise_search" else "--rbf"
            raise FlowRLError(f"{flag} searches a flow or diffusion model's noise; for a diffusion LM use --best-of, --svdd or --smc.")
        return _noise_search(config, checkpoint, method, out) if name == "noise_search" else _rbf(config, checkpoint, method["m"], out)
    if name != "plain":
        raise FlowRLError(
            f"unknown evaluation method {name!r} in the spec; this flowrl knows plain, best_of, svdd, smc, noise_search and rbf."
        )
    from .trainer import Trainer
    from .training.checkpoint import read_weights

    trainer = Trainer(config)
    if checkpoint is not None:
        trainer.load_weights(read_weights(checkpoint))
    metrics, shown = trainer.evaluate(return_samples=True)
    spec = trainer.eval_spec(metrics, shown, checkpoint)
    return {**{k: round(v, 6) for k, v in metrics.items()}, "settings": eval_settings(config), "spec": spec}


def evaluate_again(path: Path, out: Path) -> int:
    """``flowrl eval --spec``: the recorded evaluation again, compared bit for bit."""
    from .config import validate
    from .evaluation.spec import differences, read_spec
    from .training.checkpoint import verify_checkpoint
    from .training.run_logger import json_line

    recorded = read_spec(path)
    checkpoint = recorded["model"].get("checkpoint")
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        if not (checkpoint / "config.yaml").is_file():
            raise FlowRLError(f"the spec's checkpoint '{checkpoint}' is not there any more, so its evaluation cannot be re-run.")
        verify_checkpoint(checkpoint, ["config.yaml"])
    elif recorded["model"].get("trained_weights_unsaved"):
        raise FlowRLError(f"the spec in '{path}' measured trained weights that were never saved in a checkpoint, so it cannot be re-run.")
    try:
        config = validate(recorded["config"])
    except FlowRLError as e:
        raise FlowRLError(f"the config recorded in '{path}' is not valid for this flowrl: {str(e).rstrip('.')}.") from None
    record = run_evaluation(config, checkpoint, recorded["method"], out)
    now = record["spec"]

    keys = sorted(set(recorded["result"]) | set(now["result"]))  # exact floats, NaN recorded as null
    moved = {k: [recorded["result"].get(k), now["result"].get(k)] for k in keys if recorded["result"].get(k) != now["result"].get(k)}
    record["reproduction"] = {
        "spec": str(path),
        "bit_for_bit": not moved,
        "moved": moved,  # metric -> [recorded, now]
        "differing_fields": differences(recorded, now),
    }
    if moved:
        print(f"NOT reproduced: {len(moved)} of {len(keys)} numbers differ from '{path}':", file=sys.stderr)
        for k, (a, b) in moved.items():
            print(f"  {k}: {a!r} recorded, {b!r} now", file=sys.stderr)
    else:
        print(f"reproduced bit for bit: all {len(keys)} numbers of '{path}' came back the same.", file=sys.stderr)
    for line in record["reproduction"]["differing_fields"]:
        print(f"  differs: {line}", file=sys.stderr)
    print(json_line(record))
    return 0 if not moved else 1


def eval_settings(config) -> dict:
    """The settings an evaluation number depends on, printed with it (block length alone moves a dLLM's
    accuracy by points; steps, guidance and seed move an image reward)."""
    if config.pipeline.modality == "text":
        from .evaluation.spec import text_generation_settings

        return {
            "model": config.pipeline.pretrained,
            "dataset": config.prompts.dataset,
            "eval_size": config.prompts.eval_size,
            **text_generation_settings(config.sampler),
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
        # a masked-token model (amused) is evaluated with its own sampler: the ODE has nothing to say about tokens
        "sampler": config.sampler.name if "masked_tokens" in type(config.sampler).prediction_types else "ode",
    }


def image_model(config, checkpoint: Path | None):
    """The config's image / video model (a checkpoint's weights loaded), its samplers, its reward and its
    held-out setting: what the inference-time scaling methods use, with no trainer or optimizer."""
    from . import seeding
    from .config import set_num_threads
    from .evaluation.held_out import held_out_images
    from .modalities.images import build_image_components
    from .pipelines.common import device_for
    from .reward_models import build_reward_from_config
    from .training.checkpoint import load_checkpoint_weights
    from .training.determinism import enable_deterministic_mode

    set_num_threads(config)
    if config.train.deterministic:
        enable_deterministic_mode()
    device = device_for(config.pipeline.device)
    reward = build_reward_from_config(config.reward)
    seeding.seed_initialisation(config.seed)
    parts = build_image_components(config, device)
    if checkpoint is not None:
        load_checkpoint_weights(parts.pipeline, checkpoint)
    parts.pipeline.denoiser.eval()
    return parts, reward, held_out_images(config, parts.pipeline, device)


def _search_spec(
    config, checkpoint: Path | None, method: dict, modules, sampler: dict, prompts, metadata, reward, result: dict, shape=None
):
    """The eval spec of a search (best-of-N, SVDD): no judge is scored there."""
    from .evaluation.spec import build_spec, weights_sha256

    return build_spec(
        config,
        method=method,
        checkpoint=checkpoint,
        weights=weights_sha256(modules),
        sampler=sampler,
        prompts=list(prompts),
        metadata=list(metadata),
        reward=reward,
        judge=None,
        result=result,
        sample_shape=shape,
    )


def _meter_images(parts, reward):
    """A search's counted cost (inference/cost.py) and the metered model and reward it runs instead of the plain ones."""
    from .inference.cost import SearchCost, metered

    cost = SearchCost()
    pipeline, verifier = metered(cost, pipeline=parts.pipeline, verifiers=[reward])
    return cost, pipeline, verifier


def _print_cost(cost, items: int) -> None:
    c = cost.record(items)
    print(
        f"  cost per item: {c['denoiser_rows_per_item']:g} denoiser rows ({c['denoiser_seconds_per_item']:.3f} s), "
        f"{c['verifier_rows_per_item']:g} verifier rows ({c['verifier_seconds_per_item']:.3f} s, decode included), "
        f"wall {c['wall_seconds_per_item']:.3f} s (CPU {c['cpu_seconds_per_item']:.3f} s)"
    )


def _image_search_record(config, checkpoint, parts, reward, held, result, cost, out, method, sampler, exact, settings, extra=None) -> dict:
    """The record ``flowrl eval`` prints for an image search: its rounded numbers, ``extra``, its cost, grid, settings
    and evaluation spec."""
    spec = _search_spec(
        config,
        checkpoint,
        method,
        [("", parts.pipeline.denoiser)],
        sampler,
        held.prompts,
        held.metadata,
        reward,
        exact,
        tuple(result.samples.shape[1:]),
    )
    return {
        **{k: round(v, 6) for k, v in exact.items()},
        **(extra or {}),
        "cost": cost.record(len(held)),
        "grid": str(out),
        "settings": settings,
        "spec": spec,
    }


def _best_of_n(config, checkpoint: Path | None, n: int, out: Path, stop_at: float | None = None) -> dict:
    import torch

    from .inference.best_of_n import best_of_n
    from .visualize import save_grid

    parts, reward, held = image_model(config, checkpoint)
    cost, pipeline, verifier = _meter_images(parts, reward)
    with cost:
        result = best_of_n(
            pipeline,
            parts.eval_sampler,
            verifier,
            held.prompts,
            held.metadata,
            n,
            held.sigmas,
            held.generator(),
            held.guidance_scale,
            config.eval.batch_size,
            stop_at=stop_at,
        )
    curve = result.scaling_curve()
    print(f"best-of-N on {len(result.best)} held-out items ({config.eval.samples_per_prompt} per prompt):")
    for k, v in curve.items():
        print(f"  N = {k:4d}   eval reward {v:.4f}")
    steps = held.sigmas.numel() - 1
    draws = float(result.draws.double().mean())
    if stop_at is not None:
        print(
            f"  stopping at reward {stop_at:g}: {draws:.2f} candidates drawn per item ({draws * steps:.1f} denoiser rows, {draws:.2f} reward calls)"
        )
    _print_cost(cost, len(held))
    save_grid(result.samples, out, ncol=config.eval.samples_per_prompt)
    exact = {
        **{f"eval/reward/mean@{k}": v for k, v in curve.items()},
        **{f"eval/reward/{k}@{n}": float(v[torch.isfinite(v)].mean()) for k, v in result.components.items()},
        # counted cost per item: candidates drawn (= reward calls), and denoiser rows (steps per candidate, no padding)
        f"eval/best_of{n}/draws_per_item": draws,
        f"eval/best_of{n}/denoiser_rows_per_item": draws * steps,
    }
    return _image_search_record(
        config,
        checkpoint,
        parts,
        reward,
        held,
        result,
        cost,
        out,
        {"name": "best_of", "n": n, **({"stop_at": stop_at} if stop_at is not None else {})},
        {"name": parts.eval_sampler.name},
        exact,
        eval_settings(config),
    )


def _svdd(config, checkpoint: Path | None, m: int, out: Path) -> dict:
    import torch

    from .inference.svdd import svdd_in_batches
    from .samplers.rollout import start_noise
    from .visualize import save_grid

    parts, reward, held = image_model(config, checkpoint)
    gen = held.generator()
    noise = start_noise(parts.pipeline, len(held), gen)  # the plain evaluation's start noise
    cost, pipeline, verifier = _meter_images(parts, reward)
    with cost:
        result = svdd_in_batches(
            pipeline,
            parts.sampler,
            verifier,
            held.prompts,
            held.metadata,
            m,
            held.sigmas,
            gen,
            held.guidance_scale,
            config.eval.batch_size,
            noise,
        )
    _print_cost(cost, len(held))
    save_grid(result.samples, out, ncol=config.eval.samples_per_prompt)
    finite = result.scores[torch.isfinite(result.scores)]
    exact = {
        f"eval/reward/mean@svdd{m}": float(finite.mean()),
        **{f"eval/reward/{k}@svdd{m}": float(v.nanmean()) for k, v in result.components.items()},
    }
    settings = {**eval_settings(config), "sampler": parts.sampler.name}  # SVDD draws from the rollout sampler
    return _image_search_record(
        config,
        checkpoint,
        parts,
        reward,
        held,
        result,
        cost,
        out,
        {"name": "svdd", "m": m},
        {"name": parts.sampler.name, **config.sampler.model_dump(mode="json")},
        exact,
        settings,
    )


def _noise_search(config, checkpoint: Path | None, method: dict, out: Path) -> dict:
    import torch

    from .inference.noise_search import zero_order_search
    from .visualize import save_grid

    rounds, neighbors, step = method["rounds"], method["neighbors"], float(method["step"])
    parts, reward, held = image_model(config, checkpoint)
    cost, pipeline, verifier = _meter_images(parts, reward)
    with cost:  # ODE samples, as best-of-N: the plain evaluation's start noise is round 0's pivot
        result = zero_order_search(
            pipeline,
            parts.eval_sampler,
            verifier,
            held.prompts,
            held.metadata,
            rounds,
            neighbors,
            step,
            held.sigmas,
            held.generator(),
            held.guidance_scale,
            config.eval.batch_size,
        )
    tag = f"noise{rounds}x{neighbors}"
    history = [float(h[torch.isfinite(h)].mean()) for h in result.history]
    print(f"zero-order noise search on {len(held)} held-out items, {neighbors} neighbours at step {step:g} per round:")
    for r, v in enumerate(history):
        print(f"  round {r:3d}   {1 + r * neighbors:4d} samples per item   eval reward {v:.4f}")
    _print_cost(cost, len(held))
    save_grid(result.samples, out, ncol=config.eval.samples_per_prompt)
    exact = {
        f"eval/reward/mean@{tag}": history[-1],
        **{f"eval/reward/{k}@{tag}": float(v.nanmean()) for k, v in result.components.items()},
        **{f"eval/{tag}/reward_after_round{r}": v for r, v in enumerate(history)},
        f"eval/{tag}/samples_per_item": float(result.evaluations),
    }
    settings = {**eval_settings(config), "noise_search": {"rounds": rounds, "neighbors": neighbors, "step": step}}
    return _image_search_record(
        config,
        checkpoint,
        parts,
        reward,
        held,
        result,
        cost,
        out,
        {"name": "noise_search", "rounds": rounds, "neighbors": neighbors, "step": step},
        {"name": parts.eval_sampler.name},
        exact,
        settings,
    )


def _rbf(config, checkpoint: Path | None, m: int, out: Path) -> dict:
    import torch

    from .inference.rbf import rbf_in_batches
    from .samplers.rollout import start_noise
    from .visualize import save_grid

    parts, reward, held = image_model(config, checkpoint)
    gen = held.generator()
    noise = start_noise(parts.pipeline, len(held), gen)  # the plain evaluation's start noise
    cost, pipeline, verifier = _meter_images(parts, reward)
    with cost:
        result = rbf_in_batches(
            pipeline,
            parts.sampler,
            verifier,
            held.prompts,
            held.metadata,
            m,
            held.sigmas,
            gen,
            held.guidance_scale,
            config.eval.batch_size,
            noise,
        )
    finite = result.scores[torch.isfinite(result.scores)]
    per_step = result.candidates.double().mean(1)
    print(
        f"RBF, {m} candidates per step on average, {len(held)} held-out items: reward {float(finite.mean()):.4f}; "
        f"candidates per step {' '.join(f'{c:.2f}' for c in per_step.tolist())}; "
        f"{float(result.rolled_over.double().sum(0).mean()):.2f} early moves per item"
    )
    _print_cost(cost, len(held))
    save_grid(result.samples, out, ncol=config.eval.samples_per_prompt)
    exact = {
        f"eval/reward/mean@rbf{m}": float(finite.mean()),
        **{f"eval/reward/{k}@rbf{m}": float(v.nanmean()) for k, v in result.components.items()},
        f"eval/rbf{m}/rollovers_per_item": float(result.rolled_over.double().sum(0).mean()),
        **{f"eval/rbf{m}/candidates_at_step{k + 1}": float(c) for k, c in enumerate(per_step.tolist())},
    }
    settings = {**eval_settings(config), "sampler": parts.sampler.name, "rbf": m}
    return _image_search_record(
        config,
        checkpoint,
        parts,
        reward,
        held,
        result,
        cost,
        out,
        {"name": "rbf", "m": m},
        {"name": parts.sampler.name, **config.sampler.model_dump(mode="json")},
        exact,
        settings,
    )


def _smc_summary(n: int, lam: float, items: int, resamples: float, calls: tuple[int, int], measured: str) -> None:
    print(
        f"SMC, {n} particles per item toward p_base exp({lam:g} r), {items} held-out items: {measured}; "
        f"{resamples:.2f} resamplings per item; per item {calls[0]} denoiser and {calls[1]} reward rows"
    )


def _smc(config, checkpoint: Path | None, method: dict, out: Path) -> dict:
    import torch

    from .inference.smc import smc_in_batches
    from .visualize import save_grid

    n, lam, threshold = method["n"], float(method["lambda"]), float(method["ess_threshold"])
    tempering, resampling = method.get("tempering", "linear"), method.get("resampling", "systematic")
    parts, reward, held = image_model(config, checkpoint)
    cost, pipeline, verifier = _meter_images(parts, reward)
    with cost:
        result = smc_in_batches(
            pipeline,
            parts.sampler,
            verifier,
            held.prompts,
            held.metadata,
            n,
            held.sigmas,
            held.generator(),  # item i's particles, resamplings and final draw all from item i's stream
            held.guidance_scale,
            config.eval.batch_size,
            lam=lam,
            ess_threshold=threshold,
            tempering=tempering,
            resampling=resampling,
        )
    _print_cost(cost, len(held))
    save_grid(result.samples, out, ncol=config.eval.samples_per_prompt)
    finite = result.scores[torch.isfinite(result.scores)]
    weighted = result.weighted_reward()
    exact = {
        f"eval/reward/mean@smc{n}": float(finite.mean()),
        **{f"eval/reward/{k}@smc{n}": float(v.nanmean()) for k, v in result.components.items()},
        f"eval/smc{n}/weighted_reward": float(weighted[torch.isfinite(weighted)].mean()),
        f"eval/smc{n}/resamples_per_item": float(result.resample_count.double().mean()),
        f"eval/smc{n}/final_ess_fraction": float(result.ess[-1].mean() / n),
    }
    calls = (result.denoiser_calls, result.reward_calls)
    drawn, weighted_mean = exact[f"eval/reward/mean@smc{n}"], exact[f"eval/smc{n}/weighted_reward"]
    measured = f"reward of the drawn particles {drawn:.4f}, weighted {weighted_mean:.4f}"
    _smc_summary(n, lam, len(held), exact[f"eval/smc{n}/resamples_per_item"], calls, measured)
    settings = {**eval_settings(config), "sampler": parts.sampler.name, "smc": n, "lambda": lam, "ess_threshold": threshold}
    return _image_search_record(
        config,
        checkpoint,
        parts,
        reward,
        held,
        result,
        cost,
        out,
        {"name": "smc", "n": n, "lambda": lam, "ess_threshold": threshold, "tempering": tempering, "resampling": resampling},
        {"name": parts.sampler.name, **config.sampler.model_dump(mode="json")},
        exact,
        settings,
        extra={"denoiser_calls_per_item": calls[0], "reward_calls_per_item": calls[1]},
    )


def text_model(config, checkpoint: Path | None):
    """The config's diffusion LM (a checkpoint's weights loaded, DCoLT's unmasking head included) and the run's
    reward, which grades the held-out items: what text best-of-N and SVDD use, with no trainer or optimizer."""
    from . import seeding
    from .config import set_num_threads
    from .modalities.text import TextModality
    from .pipelines.common import device_for
    from .reward_models import build_reward_from_config
    from .training.checkpoint import load_checkpoint_weights, read_weights
    from .training.determinism import enable_deterministic_mode

    set_num_threads(config)
    if config.train.deterministic:
        enable_deterministic_mode()
    seeding.seed_initialisation(config.seed)  # DCoLT's head is created fresh before its weights are loaded
    modality = TextModality(config, device_for(config.pipeline.device))
    modality.check()
    if checkpoint is not None:
        extra = modality.objective.extra_module
        if extra is not None:
            extra.load_state_dict({k[len("objective.") :]: v for k, v in read_weights(checkpoint).items() if k.startswith("objective.")})
        load_checkpoint_weights(modality.pipeline, checkpoint)
    modality.pipeline.model.eval()
    return modality, build_reward_from_config(config.reward)


def _text_rules(select: str | None, default: str) -> list[str]:
    rules = [r.strip() for r in (select or default).split(",") if r.strip()]
    if not rules:
        raise FlowRLError(f"--select needs at least one rule, got '{select}'.")
    return list(dict.fromkeys(rules))


def _text_modules(modality) -> list:
    """The modules whose weights a diffusion LM's evaluation runs: the model, and DCoLT's unmasking head."""
    extra = modality.objective.extra_module
    return [("", modality.pipeline.model), *([("objective.", extra)] if extra is not None else [])]


def _meter_text(modality, scorers) -> tuple:
    """A diffusion-LM search's counted cost, its metered model and selection scores (the grader is not metered: it
    measures, it never selects)."""
    from .inference.cost import SearchCost, metered

    cost = SearchCost()
    return (cost, *metered(cost, lm=modality.pipeline, verifiers=scorers))


def _text_best_of_n(config, checkpoint: Path | None, n: int, select: str | None, out: Path) -> dict:
    import json

    from tqdm import tqdm

    from .atomic_files import atomic_path
    from .inference.plots import save_scaling_plot
    from .inference.text_best_of_n import ORACLE, text_best_of_n
    from .inference.text_candidates import build_scorers, check_candidates_differ

    rules = _text_rules(select, "majority,likelihood")
    check_candidates_differ("--best-of", n, config.sampler.eval_temperature, config.sampler.remasking)  # before minutes of loading
    scorers = build_scorers(rules, config.reward)  # refuses a gold grader before any model is loaded
    modality, grader = text_model(config, checkpoint)
    prompts, metadata = [p for p, _ in modality.eval_pool], [m for _, m in modality.eval_pool]
    temperature = config.sampler.eval_temperature
    cost, lm, *metered_scorers = _meter_text(modality, scorers)
    with cost, tqdm(total=n * len(prompts), desc=f"best-of-{n}", unit="completion", disable=None) as bar:
        result = text_best_of_n(
            lm,
            config.sampler,
            config.pipeline.prompt_length,
            grader,
            metered_scorers,
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
    _print_cost(cost, len(prompts))
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
    exact = {
        **{f"eval/reward/mean@{k}/{r}": curves[r][k] for r in rules for k in result.ks()},
        **{f"eval/oracle_pass@{k}": curves[ORACLE][k] for k in result.ks()},
        "eval/reward/mean/single_sample": single,
    }
    method = {"name": "best_of", "n": n, "select": ",".join(rules)}
    sampler = {"name": "masked", **config.sampler.model_dump(mode="json")}
    spec = _search_spec(config, checkpoint, method, _text_modules(modality), sampler, prompts, metadata, grader, exact)
    return {
        **{k: round(v, 6) for k, v in exact.items()},
        "cost": cost.record(len(prompts)),
        "plot": str(out),
        "completions": str(rows_path),
        "settings": {**eval_settings(config), "n": n, "select": rules},
        "spec": spec,
    }


def _one_score_search(config, checkpoint: Path | None, flag: str, what: str, count: int, select: str | None):
    """What the diffusion-LM searches that value each candidate by one score (SVDD, SMC) share: the rule checked,
    its scorer, the model and its grader, the held-out prompts and metadata."""
    from .inference.text_candidates import build_scorers, check_candidates_differ

    rules = _text_rules(select, "likelihood")
    if len(rules) != 1 or rules[0] == "majority":
        raise FlowRLError(f"{flag} {what} by one score (likelihood, a reward's name or reward), got --select {select}.")
    check_candidates_differ(flag, count, config.sampler.eval_temperature, config.sampler.remasking)
    scorer = build_scorers(rules, config.reward)[0]
    modality, grader = text_model(config, checkpoint)
    prompts, metadata = [p for p, _ in modality.eval_pool], [m for _, m in modality.eval_pool]
    return rules, scorer, modality, grader, prompts, metadata


def _text_svdd(config, checkpoint: Path | None, m: int, select: str | None, out: Path) -> dict:
    import json

    from tqdm import tqdm

    from .atomic_files import atomic_path
    from .inference.canvas_svdd import canvas_svdd_in_batches
    from .inference.masked_svdd import masked_svdd_in_batches

    rules, scorer, modality, grader, prompts, metadata = _one_score_search(config, checkpoint, "--svdd", "values each candidate", m, select)
    svdd_in_batches = canvas_svdd_in_batches if config.sampler.name == "entropy_bound" else masked_svdd_in_batches  # DiffusionGemma's
    cost, lm, scorer = _meter_text(modality, [scorer])
    with cost, tqdm(total=len(prompts), desc=f"svdd-{m}", unit="item", disable=None) as bar:
        result = svdd_in_batches(
            lm,
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
    _print_cost(cost, len(prompts))
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
    exact = {
        f"eval/reward/mean@svdd{m}/{rules[0]}": float(graded.scores.float().nanmean()),
        **{f"eval/reward/{k}@svdd{m}": float(v.float().nanmean()) for k, v in graded.extras.items()},
    }
    method = {"name": "svdd", "m": m, "select": rules[0]}
    sampler = {"name": "masked", **config.sampler.model_dump(mode="json")}
    spec = _search_spec(config, checkpoint, method, _text_modules(modality), sampler, prompts, metadata, grader, exact)
    return {
        **{k: round(v, 6) for k, v in exact.items()},
        "denoiser_forwards_per_item": round(result.forwards / len(prompts), 3),
        "cost": cost.record(len(prompts)),
        "completions": str(rows_path),
        "settings": {**eval_settings(config), "svdd": m, "select": rules[0]},
        "spec": spec,
    }


def _text_smc(config, checkpoint: Path | None, method: dict, out: Path) -> dict:
    import json

    from tqdm import tqdm

    from .atomic_files import atomic_path
    from .inference.masked_smc import masked_smc_in_batches
    from .inference.smc import _weighted_mean

    if config.sampler.name == "entropy_bound":
        raise FlowRLError("--smc is not implemented for DiffusionGemma's entropy-bound sampler; use --best-of or --svdd.")
    n, lam, threshold, select = method["n"], float(method["lambda"]), float(method["ess_threshold"]), method.get("select")
    tempering, resampling = method.get("tempering", "linear"), method.get("resampling", "systematic")
    rules, scorer, modality, grader, prompts, metadata = _one_score_search(config, checkpoint, "--smc", "weights each particle", n, select)
    cost, lm, scorer = _meter_text(modality, [scorer])
    with cost, tqdm(total=len(prompts), desc=f"smc-{n}", unit="item", disable=None) as bar:
        result = masked_smc_in_batches(
            lm,
            config.sampler,
            config.pipeline.prompt_length,
            scorer,
            prompts,
            n,
            config.sampler.eval_temperature,
            config.eval.seed,
            config.rollout.batch_size,
            lam=lam,
            ess_threshold=threshold,
            tempering=tempering,
            resampling=resampling,
            position_scorer=modality.position_scorer,
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
                        "particles": result.particles[i],
                        "weights": [round(float(w), 6) for w in result.log_weights[i].exp()],
                    }
                )
                + "\n"
            )
    weighted = _weighted_mean(result.log_weights, result.values)
    exact = {
        f"eval/reward/mean@smc{n}/{rules[0]}": float(graded.scores.float().nanmean()),
        **{f"eval/reward/{k}@smc{n}": float(v.float().nanmean()) for k, v in graded.extras.items()},
        f"eval/smc{n}/weighted_{rules[0]}": float(weighted.nanmean()),  # the self-normalised estimate of E_target[score]
        f"eval/smc{n}/resamples_per_item": float(result.resample_count.double().mean()),
    }
    calls = (result.denoiser_calls, result.reward_calls)
    measured = f"run's reward of the drawn completions {exact[f'eval/reward/mean@smc{n}/{rules[0]}']:.4f}"
    _smc_summary(n, lam, len(prompts), exact[f"eval/smc{n}/resamples_per_item"], calls, measured)
    _print_cost(cost, len(prompts))
    method = {
        "name": "smc",
        "n": n,
        "lambda": lam,
        "ess_threshold": threshold,
        "tempering": tempering,
        "resampling": resampling,
        "select": rules[0],
    }
    sampler = {"name": "masked", **config.sampler.model_dump(mode="json")}
    spec = _search_spec(config, checkpoint, method, _text_modules(modality), sampler, prompts, metadata, grader, exact)
    return {
        **{k: round(v, 6) for k, v in exact.items()},
        "denoiser_calls_per_item": calls[0],
        "reward_calls_per_item": calls[1],
        "cost": cost.record(len(prompts)),
        "completions": str(rows_path),
        "settings": {**eval_settings(config), "smc": n, "lambda": lam, "ess_threshold": threshold, "select": rules[0]},
        "spec": spec,
    }
