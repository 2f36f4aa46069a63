"""Prompt files (prompts.dataset=file), first-frame / per-frame scoring from the config, and the
MP4/GIF video output of the run directory."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.prompts.files import read_prompt_file


def test_txt_and_jsonl_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("# a comment\na cat\n\n  a dog  \n")
    assert read_prompt_file(str(tmp_path / "p.txt")) == [("a cat", {}), ("a dog", {})]
    lines = [json.dumps({"prompt": "a boat", "image": "frame.png", "label": 3}), json.dumps({"prompt": "a car"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    pairs = read_prompt_file(str(tmp_path / "p.jsonl"))
    assert pairs == [("a boat", {"image": str(tmp_path / "frame.png"), "label": 3}), ("a car", {})]
    assert len(read_prompt_file("simple_animals.txt")) == 45  # bundled
    train = {p for p, _ in read_prompt_file("general.txt")}
    assert not train & {p for p, _ in read_prompt_file("general_eval.txt")}


def test_prompt_file_errors_are_one_sentence(tmp_path):
    with pytest.raises(FlowRLError, match="does not exist"):
        read_prompt_file(str(tmp_path / "nope.txt"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(FlowRLError, match='line 2 needs a string "prompt" key'):
        read_prompt_file(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FlowRLError, match="needs both train_file and eval_file"):
        load_config(None, ["prompts.dataset=file", "prompts.train_file=general.txt"])


def test_first_frame_scoring_from_config():
    from flowrl.reward_models import build_reward_from_config

    config = load_config(None, ["reward.components={ink: 1.0}", "reward.video_frames.ink.first_frame_only=true"])
    reward = build_reward_from_config(config.reward)
    video = torch.zeros(2, 1, 4, 8, 8)
    video[0, :, 0] = 1.0  # only video 0's first frame is inked
    video[1, :, 1:] = 1.0  # video 1 is inked everywhere except its first frame
    scores = reward(video, ["a", "b"], [{}, {}]).scores
    assert scores[0] > scores[1]
    every = build_reward_from_config(load_config(None, ["reward.components={ink: 1.0}", "reward.video_frames.ink.every_n=1"]).reward)
    assert every(video, ["a", "b"], [{}, {}]).scores[1] > every(video, ["a", "b"], [{}, {}]).scores[0]
    with pytest.raises(FlowRLError, match="unknown reward 'inkk'"):
        load_config(None, ["reward.video_frames.inkk.every_n=2"])


def test_videos_are_written_as_mp4_and_gif(tmp_path):
    import imageio.v3 as iio

    from flowrl.visualize import save_grid, save_videos

    videos = torch.rand(3, 3, 5, 16, 16)
    written = save_videos(videos, tmp_path / "grid", ncol=2)
    assert sorted(p.suffix for p in written) == [".gif", ".mp4"]
    gif = iio.imread(tmp_path / "grid.gif")
    mp4 = iio.imread(tmp_path / "grid.mp4")
    assert gif.shape[0] == 5 and mp4.shape[0] == 5  # every frame of the videos
    # frame 0 of the GIF is the grid of the videos' first frames (GIF is lossless up to its palette)
    first = (videos[0, :, 0].permute(1, 2, 0).numpy() * 255).round()
    scale = 128 // 16
    top_left = gif[0, 2 : 2 + 16 * scale : scale, 2 : 2 + 16 * scale : scale, :3].astype(float)
    assert abs(top_left - first).mean() < 12
    save_grid(videos, tmp_path / "strip.png", ncol=2)  # filmstrip: one row per video
    assert iio.imread(tmp_path / "strip.png").shape[1] > iio.imread(tmp_path / "strip.png").shape[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial files left behind
