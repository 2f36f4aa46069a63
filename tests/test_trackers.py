"""Trackers through accelerate (log.trackers): TensorBoard by default, W&B in offline mode with the resolved
config, every logged scalar and the sample grids (and videos) as media; names and packages checked up front."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config, supported_trackers
from flowrl.errors import FlowRLError
from flowrl.trainer import Trainer

GRPO = CONFIGS / "digits" / "grpo.yaml"
VIDEO = CONFIGS / "digits_video" / "grpo.yaml"


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, with its settings and caches in tmp (never the network or the home directory)."""
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    pytest.importorskip("wandb")


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``run-*.wandb`` file: a 7-byte ':W&B' header, then
    LevelDB-log chunks (4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last)
    in 32 KiB blocks. W&B's own Python reader of this file went into its Go core."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, pos, chunks = 32768, 7, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_offline_run(run_dir: Path) -> dict:
    """config, history rows (key -> value) and the media files of the one offline W&B run under run_dir."""
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    config, history, project = {}, [], None
    for record in wandb_records(next(runs[0].glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project = record.run.project
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    media = sorted(p.relative_to(runs[0] / "files" / "media") for p in (runs[0] / "files" / "media").rglob("*") if p.is_file())
    return {"project": project, "config": config, "history": history, "media": media}


@pytest.mark.slow
def test_wandb_offline_gets_config_scalars_and_sample_grids(tmp_path, offline_wandb, one_thread):
    run = tmp_path / "run"
    cfg = load_config(
        GRPO, fast_overrides(run, **{"log.trackers": "[tensorboard,wandb]", "log.tracker_kwargs": "{wandb: {mode: offline}}"})
    )
    Trainer(cfg).fit()
    logged = read_offline_run(run)
    assert logged["project"] == "run"  # log.project defaults to the output_dir's name
    config = {k: v for k, v in logged["config"].items() if k != "_wandb"}
    assert config == yaml.safe_load((run / "config.yaml").read_text())  # the resolved config
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for row in logged["history"]:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        scalars = {k: v for k, v in r.items() if k != "step" and v is not None}
        assert {k: by_step[r["step"]][k] for k in scalars} == pytest.approx(scalars), r["step"]
    for step in (0, 2):  # the evaluation steps' grids, as images
        assert by_step[step]["samples/_type"] == "image-file"
        assert list(run.glob(f"wandb/offline-run-*/files/{by_step[step]['samples/path']}"))
    assert [p.parent.name for p in logged["media"]] == ["images", "images"] and all(p.suffix == ".png" for p in logged["media"])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard still written beside W&B


@pytest.mark.slow
def test_wandb_gets_videos_of_a_video_model(tmp_path, offline_wandb, one_thread):
    run = tmp_path / "run"
    cfg = load_config(VIDEO, fast_overrides(run, **{"log.trackers": "[wandb]", "log.project": "flowrl-video-test"}))
    Trainer(cfg).fit()
    logged = read_offline_run(run)
    assert logged["project"] == "flowrl-video-test"
    kinds = {p.parent.name for p in logged["media"]}
    assert kinds == {"images", "videos"}, logged["media"]
    videos = [row for row in logged["history"] if "samples_video/_type" in row]
    assert [row["_step"] for row in videos] == [0, 2] and videos[0]["samples_video/_type"] == "video-file"
    assert not (run / "tensorboard").exists()  # only the trackers named


@pytest.mark.slow
def test_tensorboard_default_gets_scalars_config_and_grids(tmp_path, one_thread):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cfg = load_config(GRPO, fast_overrides(run))
    assert cfg.log.trackers == ["tensorboard"]
    Trainer(cfg).fit()
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        for key, value in r.items():
            if key != "step" and value is not None:
                assert value == pytest.approx([e.value for e in events.Scalars(key) if e.step == r["step"]][0], rel=1e-6), key
    assert [e.step for e in events.Images("samples")] == [0, 2]
    hparams = yaml.safe_load(next((run / "tensorboard").glob("*/hparams.yml")).read_text())
    assert hparams["objective.name"] == "grpo" and hparams["train.iterations"] == 2  # the resolved config, flattened


@pytest.mark.slow
def test_no_trackers_writes_metrics_only(tmp_path, one_thread):
    run = tmp_path / "run"
    Trainer(load_config(GRPO, fast_overrides(run, **{"log.trackers": "[]"}))).fit()
    assert (run / "metrics.jsonl").is_file() and not (run / "tensorboard").exists()


def test_unknown_tracker_and_stray_kwargs_are_refused_in_one_sentence(tmp_path):
    assert {"tensorboard", "wandb", "mlflow", "comet_ml"} <= set(supported_trackers())
    with pytest.raises(FlowRLError, match="'neptune' is not a tracker accelerate supports; choose from .*tensorboard"):
        load_config(GRPO, fast_overrides(tmp_path, **{"log.trackers": "[neptune]"}))
    with pytest.raises(FlowRLError, match="tracker_kwargs names wandb, which log.trackers does not list"):
        load_config(GRPO, fast_overrides(tmp_path, **{"log.tracker_kwargs": "{wandb: {mode: offline}}"}))


def test_missing_tracker_package_is_refused_before_anything_is_written(tmp_path):
    from accelerate.tracking import get_available_trackers

    missing = [t for t in supported_trackers() if t not in {str(a) for a in get_available_trackers()}]
    if not missing:
        pytest.skip("every tracker accelerate supports is installed here")
    run = tmp_path / "run"
    with pytest.raises(FlowRLError, match=f"log.trackers names '{missing[0]}' but its package is not installed; pip install "):
        Trainer(load_config(GRPO, fast_overrides(run, **{"log.trackers": f"[{missing[0]}]"})))
    assert not run.exists()
