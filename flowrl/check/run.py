"""``flowrl check CONFIG [overrides]``: build the run as training does, run one prompt group through it, and verify
that training, evaluation, sampling and the exported card agree.

    trainer = Trainer(config)                        # the run as flowrl train builds it (a temporary output_dir)
    loop.iteration(0)                                # rollout -> score -> prepare -> update, the update re-scoring at
                                                     #   unchanged weights (rescore.py): ratio 1 to rounding, per step
    trainer.evaluate() on one held-out item          # the evaluation path, recorded
    trainer.sample(), flowrl sample's defaults       # the sampling paths after training, recorded
    trainer.save(); the card flowrl export writes    # the card's "as evaluated" line against the evaluation
    loop.update(batch, 0)                            # one real optimizer step: what the update reads of the config

Every path's settings are recorded from the calls the model received (paths.py) and compared (parity.py); every
config key set but never read during all of it is reported (reads.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config, load_config, to_yaml
from .card import CARD, compare_card, stated, write_card
from .parity import EVALUATION, ROLLOUT, Context, compare, same_deterministic_step
from .paths import PathRecorder, image_settings, text_settings
from .reads import ReadRecorder
from .report import CheckResult
from .rescore import NOT_APPLICABLE, Rescore, image_steps, precision_of, rescoring, text_steps

TRAINER_SAMPLE, SAMPLE_COMMAND, SPEC = "Trainer.sample", "flowrl sample", "eval spec"


@dataclass
class SampleCommand:
    """What ``flowrl sample CHECKPOINT`` (no flags) samples with, as the command line resolves it (flowrl/cli.py)."""

    pipeline: Any  # the pipeline section it loads the model from (the checkpoint's config.yaml)
    sampler: Any  # the built sampler
    steps: int
    guidance_scale: float
    guidance_mode: str


SampleCommandProbe = Callable[[Path, Any], SampleCommand]  # (checkpoint, the run's model) -> what flowrl sample uses


def check(
    config: Config | str | os.PathLike, overrides: Sequence[str] = (), *, sample_command: SampleCommandProbe | None = None
) -> CheckResult:
    """Run the check on ``config`` (a preset name, a YAML file or a :class:`Config`) with ``overrides``;
    ``sample_command``: how ``flowrl sample`` resolves a checkpoint (the command line passes its own)."""
    source = str(config) if not isinstance(config, Config) else "<Config>"
    with tempfile.TemporaryDirectory(prefix="flowrl_check_") as tmp:
        run_config = _run_config(config, overrides, Path(tmp))
        return Check(run_config, Path(tmp), source, sample_command).run()


def _run_config(config, overrides: Sequence[str], tmp: Path) -> Config:
    """The user's config with the check's own keys: a temporary output directory, one prompt group. A Config object
    goes through YAML with only its set keys, so that what was set stays known (pydantic's ``model_fields_set``)."""
    if isinstance(config, Config):
        path = tmp / "given.yaml"
        path.write_text(to_yaml_set(config))
        config = path
    return load_config(config, [*overrides, f"output_dir={tmp / 'run'}", "train.prompts_per_iteration=1", "resume_from=null"])


def to_yaml_set(config: Config) -> str:
    import yaml

    return (
        yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True), sort_keys=False) if config.model_fields_set else to_yaml(config)
    )


class Check:
    def __init__(self, config: Config, tmp: Path, source: str, sample_command: SampleCommandProbe | None):
        self.config, self.tmp, self.source, self.sample_command = config, tmp, source, sample_command
        self.reads, self.paths = ReadRecorder(), PathRecorder()
        self.samplers: dict[str, Any] = {}
        self.notes: list[str] = []
        self.problems: list[str] = []

    def run(self) -> CheckResult:
        from ..modalities.images import ImageModality
        from ..trainer import Trainer

        with self.reads.recording():
            self.trainer = trainer = Trainer(self.config)
        self.images = isinstance(trainer.modality, ImageModality)
        recording = self.paths.on_images(trainer.pipeline) if self.images else self.paths.on_text(trainer.modality)
        with recording:
            batch, engine, step_sampler = self._iteration()
            rescore = self._rescore(batch, engine, step_sampler)
            shown, spec = self._evaluate()
            self._trainer_sample()
            checkpoint = self._save()
            self._sample_command(checkpoint)
        card = self._card(checkpoint)
        with self.reads.recording():
            trainer.loop.update(batch, 0)  # a real step: what the optimizer reads of the config (clipping, decay)
        rows = self._rows(spec)
        differences = compare(rows, self._context(rows))
        measured = self._measured(rows, shown)
        rows[CARD] = card or {}
        differences += compare_card(card, rows.get(EVALUATION, {}), measured)
        return CheckResult(self.source, rescore, rows, differences, self.reads.unread(self.config), self.notes, self.problems)

    # -- the training iteration, its update re-scoring --------------------------------------------------------------
    def _iteration(self):
        loop = self.trainer.loop
        with rescoring(self.trainer) as (engine, step_sampler), self._phases(loop) as batches, self.reads.recording():
            loop.iteration(0)
        return batches["update"], engine, step_sampler

    @contextlib.contextmanager
    def _phases(self, loop) -> Iterator[dict[str, Any]]:
        """Name the recorded calls by the loop's phase (the rollout, the update) and keep the batch the update gets."""
        collect, update, batches = loop.collect, loop.update, {}

        def collecting(*args, **kwargs):
            with self.paths.path(ROLLOUT):
                return collect(*args, **kwargs)

        def updating(batch, iteration):
            batches["update"] = batch
            with self.paths.path("update"):
                return update(batch, iteration)

        loop.collect, loop.update = collecting, updating
        try:
            yield batches
        finally:
            del loop.collect, loop.update

    def _rescore(self, batch, engine, step_sampler) -> Rescore:
        objective, precision = self.trainer.objective, precision_of(self.config)
        if not objective.needs_log_probs:
            return Rescore(
                False,
                precision,
                note=f"objective '{objective.name}' {NOT_APPLICABLE.get(objective.trains_on, 'has no per-step log-probs')}",
            )
        rows = len(batch)
        if step_sampler is None:
            note = f"one prompt group, {rows} completions: the objective's ratio of the update's log-probs to the rollout's"
            return Rescore(True, precision, text_steps(batch, engine, precision), note)
        steps = image_steps(step_sampler, precision)
        stochastic = int(batch.stochastic.sum())
        note = (
            f"one prompt group of {rows} rows; the {len(steps)} of its {stochastic} stochastic steps the update trained, "
            "re-scored through its minibatches at the rollout's weights"
        )
        rescore = Rescore(True, precision, steps, note)
        update = self.paths.recordings.get("update")
        rollout = self.paths.recordings.get(ROLLOUT)
        if self.config.rollout.guidance_mode == "cfg_rollout_only" and update and rollout:
            scales = ({c.guidance_scale for c in rollout.calls}, {c.guidance_scale for c in update.calls})
            if scales[0] != scales[1]:
                rescore.intended = (
                    f"rollout.guidance_mode cfg_rollout_only re-scores without guidance (rollout {sorted(scales[0])}, "
                    f"update {sorted(scales[1])}), so the ratio starts off 1 on purpose (docs/guidance.md)"
                )
        return rescore

    # -- the evaluation and the sampling paths ---------------------------------------------------------------------
    def _evaluate(self):
        trainer = self.trainer
        with _one_held_out_item(trainer.modality), self.paths.path(EVALUATION), self.reads.recording():
            metrics, shown = trainer.evaluate(return_samples=True)
            spec = trainer.eval_spec(metrics, shown, None)
        self.samplers[EVALUATION] = getattr(trainer.modality, "eval_sampler", None)
        self.samplers[ROLLOUT] = trainer.sampler
        return shown, spec

    def _first_item(self) -> tuple[str, dict]:
        from ..evaluation.held_out import eval_pool

        return eval_pool(self.config)[0]

    def _trainer_sample(self) -> None:
        prompt, metadata = self._first_item()
        options = {"metadata": [metadata]} if self.images else {}
        with self.paths.path(TRAINER_SAMPLE), self.reads.recording():
            self.trainer.sample([prompt], 1, seed=0, **options)
        self.samplers[TRAINER_SAMPLE] = getattr(self.trainer.modality, "eval_sampler", None)

    def _save(self) -> Path:
        with self.reads.recording():
            return self.trainer.save()

    def _sample_command(self, checkpoint: Path) -> None:
        """flowrl sample CHECKPOINT's defaults, run on the run's own model (the command would load the same one from
        the checkpoint's pipeline section, which must equal the run's)."""
        if not self.images:
            self.notes.append("flowrl sample: it samples image and video models; a diffusion LM samples through Trainer.sample")
            return
        if self.sample_command is None:
            self.notes.append("flowrl sample: its defaults are read by the command line (flowrl check), not from Python")
            return
        from ..samplers.rollout import sample

        pipeline = self.trainer.pipeline
        command = self.sample_command(checkpoint, pipeline)
        if command.pipeline != self.config.pipeline:
            changed = [
                k for k in type(self.config.pipeline).model_fields if getattr(command.pipeline, k, None) != getattr(self.config.pipeline, k)
            ]
            self.problems.append(
                f"flowrl sample loads the model from the checkpoint's pipeline section, which differs from the run's in {changed}"
            )
        prompt, metadata = self._first_item()
        mode = pipeline.guidance_mode
        pipeline.guidance_mode = command.guidance_mode  # as flowrl sample sets it on the model it loads
        try:
            with self.paths.path(SAMPLE_COMMAND):
                sample(pipeline, command.sampler, [prompt], 1, command.steps, command.guidance_scale, seed=0, metadata=[metadata])
        finally:
            pipeline.guidance_mode = mode
        self.samplers[SAMPLE_COMMAND] = command.sampler

    def _card(self, checkpoint: Path) -> dict[str, Any] | None:
        return stated(write_card(checkpoint, self.tmp / "export"))

    # -- the rows and what the differences are measured against ------------------------------------------------------
    def _rows(self, spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}
        for path, rec in self.paths.recordings.items():
            if path == "update":
                continue
            if self.images:
                rows[path] = image_settings(rec, self.samplers.get(path), self.trainer.pipeline.schedule)
            else:
                rows[path] = text_settings(rec)
        if ROLLOUT not in rows or not rows[ROLLOUT]:
            rows.pop(ROLLOUT, None)
            self.notes.append(
                f"the rollout: objective '{self.trainer.objective.name}' trains on {self.trainer.objective.trains_on}, not on rollouts"
            )
        rows[SPEC] = _spec_row(spec, self.images)
        return {p: rows[p] for p in (ROLLOUT, EVALUATION, SPEC, TRAINER_SAMPLE, SAMPLE_COMMAND) if p in rows}

    def _context(self, rows) -> Context:
        ec = self.config.eval
        text_temperature = None if self.images else self.config.sampler.eval_temperature
        grid = self.trainer.pipeline.schedule.sigmas(self.config.rollout.num_inference_steps) if self.images else None

        def deterministic(path: str) -> bool:
            sampler, rollout = self.samplers.get(path), self.samplers.get(ROLLOUT)
            if sampler is None or rollout is None or grid is None or "latent shape" not in rows.get(ROLLOUT, {}):
                return False
            shape = tuple(int(n) for n in str(rows[ROLLOUT]["latent shape"]).split("x"))
            return same_deterministic_step(sampler, rollout, grid, shape)

        return Context(ec.num_inference_steps, ec.guidance_scale, text_temperature, deterministic, self._objective_rollout())

    def _objective_rollout(self) -> frozenset[str]:
        """The text settings the objective's own rollout sampler changes (with the steps they imply), or none."""
        own = getattr(self.trainer.objective, "rollout_sampler", None)
        if self.images or own is None:
            return frozenset()
        run, rollout = self.config.sampler.model_dump(mode="json"), own(self.config.sampler).model_dump(mode="json")
        return frozenset({k for k in run if rollout.get(k) != run[k]} | {"steps"})

    def _measured(self, rows, shown) -> dict[str, Any]:
        """What the card's values are held against beside the evaluation's row: the sampler's name, the schedule's
        shift, the evaluated samples' size (images) or the generation's temperature (text)."""
        evaluated = rows.get(EVALUATION, {})
        if not self.images:
            return dict(evaluated)
        measured: dict[str, Any] = {"sampler": getattr(self.samplers.get(EVALUATION), "name", None)}
        shift = getattr(self.trainer.pipeline.schedule, "shift", None)
        if shift is not None:
            measured["flow_shift"] = float(shift)
        shape = tuple(shown.shape[1:]) if hasattr(shown, "shape") else ()
        if len(shape) >= 3:
            measured["height"], measured["width"] = int(shape[-2]), int(shape[-1])
        if len(shape) == 4:
            measured["num_frames"] = int(shape[1])
        return measured


def _spec_row(spec: dict[str, Any], images: bool) -> dict[str, Any]:
    """What the evaluation spec records of the settings, in the rows' names."""
    g = spec.get("generation", {})
    if images:
        return {"steps": g.get("steps"), "guidance scale": float(g["guidance_scale"]) if g.get("guidance_scale") is not None else None}
    return {k: g[k] for k in ("temperature", "steps", "gen_length") if g.get(k) is not None}


@contextlib.contextmanager
def _one_held_out_item(modality) -> Iterator[None]:
    """The evaluation of the first held-out item only (its own keyed noise, as in the full evaluation)."""
    if hasattr(modality, "held_out"):
        held = modality.held_out
        modality.held_out = dataclasses.replace(
            held, prompts=held.prompts[:1], metadata=held.metadata[:1], sample_index=held.sample_index[:1]
        )
        try:
            yield
        finally:
            modality.held_out = held
    else:
        pool = modality.eval_pool
        modality.eval_pool = pool[:1]
        try:
            yield
        finally:
            modality.eval_pool = pool
