"""Experiment trackers through accelerate (``log.trackers``): TensorBoard by default, W&B, and any other
tracker accelerate supports. Each gets the resolved config once, every logged metric, and the evaluation
sample grids (and videos) as media. ``metrics.jsonl`` stays the script-readable record; trackers are extra."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any

from ..errors import FlowRLError
from .checkpoint import writing

# accelerate's tracker name -> the pip package that provides it
PIP_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "'flowrl[wandb]'",
    "comet_ml": "comet-ml",
    "aim": "aim",
    "mlflow": "mlflow",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys with scalar values (TensorBoard's hparams take nothing else)."""
    flat: dict[str, Any] = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(flatten(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            flat[key] = v
        else:
            flat[key] = str(v)  # lists, None, empty sections
    return flat


def _quiet_tensorboard_writer_threads() -> None:
    """TensorBoard writes its event file from a thread of its own. A write that fails there (a full disk, a read-only
    directory) is kept for the run's thread, which raises it at its next log or flush (and flowrl says it in one
    sentence, ``writing``), and raised in the writer thread too, where Python would print it as a traceback: that
    second report is dropped. Every other thread's exception is printed as before."""
    previous = threading.excepthook
    if getattr(previous, "flowrl_quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith(("tensorboard.", "tensorboardX."))):
            previous(args)

    hook.flowrl_quiet_tensorboard = True
    threading.excepthook = hook


def _tensorboard_tracker(directory: Path):
    """accelerate's TensorBoard tracker writing straight into ``directory`` (the run's tensorboard/, as before
    trackers were configurable), with the config flattened into hparams."""
    from accelerate.tracking import TensorBoardTracker

    _quiet_tensorboard_writer_threads()

    class RunTensorBoard(TensorBoardTracker):
        def store_init_configuration(self, values: dict) -> None:
            super().store_init_configuration(flatten(values))

    return RunTensorBoard("", str(directory))


class Trackers:
    """The configured trackers of one run: ``log_with`` goes to the ``Accelerator``; :meth:`start` opens them
    (after the run directory is claimed), :meth:`log` and :meth:`log_samples` write, :meth:`finish` closes."""

    def __init__(self, config, run_dir: Path):
        self.names = list(config.log.trackers)
        self.run_dir = run_dir
        self.project = config.log.project or (Path(config.output_dir).resolve().name or "flowrl")
        self.kwargs = {name: dict(kw) for name, kw in config.log.tracker_kwargs.items()}
        self.accelerator = None
        self.started = False
        from accelerate.tracking import get_available_trackers

        available = {str(t) for t in get_available_trackers()}
        for name in self.names:  # refused before anything is written
            if name not in available:
                raise FlowRLError(
                    f"log.trackers names '{name}' but its package is not installed; pip install {PIP_PACKAGES.get(name, name)} "
                    f"(or remove '{name}' from log.trackers)."
                )

    def log_with(self) -> list:
        return [_tensorboard_tracker(self.run_dir / "tensorboard") if n == "tensorboard" else n for n in self.names] or None

    def start(self, accelerator, config_dict: dict[str, Any]) -> None:
        """Open every tracker with the resolved config (main process only; accelerate skips the others)."""
        self.accelerator = accelerator
        if not self.names:
            return
        kwargs = {k: dict(v) for k, v in self.kwargs.items()}
        if "wandb" in self.names and not os.environ.get("WANDB_DIR"):
            kwargs.setdefault("wandb", {}).setdefault("dir", str(self.run_dir))  # W&B's files in the run directory, not the cwd
        if "wandb" in kwargs and "dir" in kwargs["wandb"]:
            Path(kwargs["wandb"]["dir"]).mkdir(parents=True, exist_ok=True)
        with writing(self.run_dir):
            accelerator.init_trackers(self.project, config=config_dict, init_kwargs=kwargs)
        self.started = True

    def log(self, step: int, record: dict[str, Any]) -> None:
        """The finite numbers of one metrics record."""
        if not self.started:
            return
        values = {
            k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        with writing(self.run_dir):
            self.accelerator.log(values, step=step)

    def log_samples(self, step: int) -> None:
        """The evaluation samples of ``step`` the modality wrote (samples/step_N.png, and .mp4/.gif for videos)
        as media: an image in TensorBoard and W&B, a video in W&B."""
        if not self.started or not self.accelerator.is_main_process:
            return
        stem = self.run_dir / "samples" / f"step_{step:06d}"
        png = stem.with_suffix(".png")
        video = next((p for p in (stem.with_suffix(".mp4"), stem.with_suffix(".gif")) if p.is_file()), None)
        with writing(self.run_dir):
            for tracker in self.accelerator.trackers:
                if tracker.name == "tensorboard" and png.is_file():
                    import numpy as np
                    from PIL import Image

                    tracker.writer.add_image("samples", np.asarray(Image.open(png).convert("RGB")), step, dataformats="HWC")
                    tracker.writer.flush()
                elif tracker.name == "wandb":
                    import wandb

                    media = {}
                    if png.is_file():
                        media["samples"] = wandb.Image(str(png), caption=f"step {step}")
                    if video is not None:
                        media["samples_video"] = wandb.Video(str(video), caption=f"step {step}", format=video.suffix[1:])
                    if media:
                        tracker.run.log(media, step=step)

    def finish(self) -> None:
        """Close every tracker (what ``accelerator.end_training()`` does, less destroying the process group, which
        the trainer still needs to finish and a later Trainer in this process would find gone)."""
        if self.started:
            self.started = False
            with writing(self.run_dir):
                for tracker in self.accelerator.trackers:
                    tracker.finish()
            self.accelerator.trackers = []
