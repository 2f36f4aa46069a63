"""What ``flowrl eval`` runs on a checkpoint or a config: the plain held-out evaluation, or an inference-time search
(a part: flowrl/inference/, ``Search``) on the config's model. Each returns the record ``flowrl eval`` prints, with its
evaluation spec (evaluation/spec.py); ``evaluate_again`` re-runs a recorded spec and compares bit for bit.
This module loads the model a search runs on and dispatches; the search, its cost and its record are inference/'s.
The command line (cli.py) only parses arguments and prints; the Python API can call these directly."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .console import say
from .errors import FlowRLError


def run_evaluation(config, checkpoint: Path | None, method: dict | Any, out: Path) -> dict:
    """Run one evaluation and return the record flowrl eval prints, its ``spec`` included. ``method``: ``{"name":
    "plain"}``, a search section (``flowrl.inference.SEARCHES``), or a search as an evaluation spec records it (``{"name":
    "best_of", "n": 4}``, ``{"name": "smc", "n": 8, "lambda": 10.0, ...}``, a diffusion LM's with its ``select`` rules)."""
    from .inference import search_section
    from .inference.run import run_search
    from .inference.search import SearchSection

    if isinstance(method, dict) and method.get("name") == "plain":
        return _plain_evaluation(config, checkpoint)
    section = method if isinstance(method, SearchSection) else search_section(method)
    text = config.pipeline.modality == "text"
    section = section.prepare("text" if text else "images", config.sampler)  # refusals before any model loads
    setup = (_text_setup if text else _image_setup)(config, checkpoint, section)
    return run_search(config, checkpoint, section, setup, out)


def _plain_evaluation(config, checkpoint: Path | None) -> dict:
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
    from .inference.sections import as_recorded

    record = run_evaluation(config, checkpoint, as_recorded(recorded["method"]), out)  # a setting it did not record: as it ran
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
    say(json_line(record))
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


def text_model(config, checkpoint: Path | None):
    """The config's diffusion LM (a checkpoint's weights loaded, DCoLT's unmasking head included) and the run's
    reward, which grades the held-out items: what text best-of-N and SVDD use, with no trainer or optimizer."""
    from . import seeding
    from .config import set_num_threads
    from .modalities.text import TextModality
    from .objectives import own_modules
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
        weights = read_weights(checkpoint)
        for prefix, module in own_modules(modality.objective):  # DCoLT's unmasking-policy head
            module.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
        load_checkpoint_weights(modality.pipeline, checkpoint)
    modality.pipeline.model.eval()
    return modality, build_reward_from_config(config.reward)


def _text_modules(modality) -> list:
    """The modules whose weights a diffusion LM's evaluation runs: the model, and DCoLT's unmasking head."""
    from .objectives import own_modules

    return [("", modality.pipeline.model), *own_modules(modality.objective)]


def _image_setup(config, checkpoint: Path | None, section):
    """An image / video search's model (stepping with the rollout sampler when the search branches, else with the plain
    evaluation's), the run's reward as its verifier, and the held-out items with their streams."""
    from .inference.run import SearchSetup
    from .inference.search import ImageSearchModel, Items

    parts, reward, held = image_model(config, checkpoint)
    sampler = parts.sampler if section.stochastic else parts.eval_sampler
    model = ImageSearchModel(parts.pipeline, sampler, held.sigmas, held.guidance_scale, config.eval.batch_size)
    settings = eval_settings(config)
    described = {"name": sampler.name}
    if section.stochastic:  # SVDD, SMC and RBF draw from the rollout sampler
        settings["sampler"] = sampler.name
        described.update(config.sampler.model_dump(mode="json"))
    items = Items(held.prompts, held.metadata, held.generator(), config.eval.samples_per_prompt)
    return SearchSetup(model, reward, items, [("", parts.pipeline.denoiser)], described, reward, settings)


def _text_setup(config, checkpoint: Path | None, section):
    """A diffusion-LM search's model, its verifier (the ``--select`` scores; the run's reward grades) and the held-out
    items."""
    from .inference.run import SearchSetup
    from .inference.search import Items, TextSearchModel, TextVerifier
    from .inference.text_candidates import build_scorers

    scorers = build_scorers(section.rules, config.reward)  # refuses a gold grader before any model is loaded
    modality, grader = text_model(config, checkpoint)
    sc = config.sampler
    model = TextSearchModel(
        modality.pipeline,
        sc,
        config.pipeline.prompt_length,
        sc.eval_temperature,
        config.eval.seed,
        config.rollout.batch_size,
        modality.position_scorer,
    )
    items = Items([p for p, _ in modality.eval_pool], [m for _, m in modality.eval_pool])
    label = f"{config.pipeline.pretrained}{' (' + checkpoint.name + ')' if checkpoint else ''}, T = {sc.eval_temperature:g}"
    described = {"name": "masked", **sc.model_dump(mode="json")}
    verifier = TextVerifier(section.rules, scorers, grader)
    return SearchSetup(model, verifier, items, _text_modules(modality), described, grader, eval_settings(config), label)
