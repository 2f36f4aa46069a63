"""Prompts from local Hugging Face `datasets` sources (flowrl/prompts/datasets.py), on real small datasets."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import re
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

from flowrl.errors import FlowRLError  # noqa: E402
from flowrl.prompts.datasets import read_dataset_prompts  # noqa: E402

ROWS = {"caption": ["a red cube", "a blue ball", "a green cone"], "category": ["shape", "toy", "shape"], "score": [1, 2, 3]}
PAIRS = [
    ("a red cube", {"category": "shape", "score": 1}),
    ("a blue ball", {"category": "toy", "score": 2}),
    ("a green cone", {"category": "shape", "score": 3}),
]


def png(color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (4, 3), color).save(buffer, format="PNG")
    return buffer.getvalue()


def read(path, **kwargs):
    return read_dataset_prompts(str(path), prompt_column="caption", **kwargs)


def one_sentence(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and text.endswith(".") and not re.search(r"\.\s+[A-Z]", text), text
    return text


@pytest.fixture(autouse=True)
def image_cache(tmp_path, monkeypatch):
    cache = tmp_path / "image-cache"
    monkeypatch.setenv("FLOWRL_IMAGE_CACHE", str(cache))
    return cache


def test_single_files_parquet_jsonl_csv_json_arrow(tmp_path):
    ds = Dataset.from_dict(ROWS)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.to_json(str(tmp_path / "p.jsonl"))
    ds.to_csv(str(tmp_path / "p.csv"), index=False)
    (tmp_path / "p.json").write_text(json.dumps([dict(zip(ROWS, v)) for v in zip(*ROWS.values())]))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for name in ("p.parquet", "p.jsonl", "p.csv", "p.json", arrow):
        assert read(tmp_path / name) == PAIRS, name
    assert read(tmp_path / "p.parquet", split="train", limit=2) == PAIRS[:2]
    assert read(tmp_path / "p.csv", metadata_columns=["score"]) == [(p, {"score": m["score"]}) for p, m in PAIRS]
    assert read(tmp_path / "p.jsonl", metadata_columns=[]) == [(p, {}) for p, _ in PAIRS]
    assert read_dataset_prompts(str(tmp_path / "p.parquet"), prompt_column="category", limit=1) == [
        ("shape", {"caption": "a red cube", "score": 1})
    ]


def test_saved_dataset_and_dataset_dict_choose_their_split(tmp_path):
    train = Dataset.from_dict(ROWS)
    test = Dataset.from_dict({"caption": ["a test prompt"], "category": ["eval"], "score": [9]})
    train.save_to_disk(str(tmp_path / "one"))
    assert read(tmp_path / "one") == PAIRS
    DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "two"))
    assert read(tmp_path / "two") == PAIRS  # "train" by default
    assert read(tmp_path / "two", split="test") == [("a test prompt", {"category": "eval", "score": 9})]
    assert read(tmp_path / "two" / "test") == [("a test prompt", {"category": "eval", "score": 9})]  # one split folder
    DatasetDict({"validation": train, "test": test}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "no_train")
    assert one_sentence(e) == (
        f"dataset '{tmp_path / 'no_train'}' has the splits 'validation', 'test' and none is 'train', so choose one with split."
    )
    assert read(tmp_path / "no_train", split="validation") == PAIRS
    DatasetDict({"test": test}).save_to_disk(str(tmp_path / "only_test"))
    assert read(tmp_path / "only_test") == [("a test prompt", {"category": "eval", "score": 9})]  # the only split
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "two", split="valid")
    assert one_sentence(e) == f"dataset '{tmp_path / 'two'}' has no split 'valid' (splits: 'train', 'test')."
    with pytest.raises(FlowRLError, match="has no split 'test' \\(splits: 'train'\\)"):
        read(tmp_path / "one", split="test")


def test_directory_of_parquet_shards_with_splits(tmp_path):
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    ds = Dataset.from_dict(ROWS)
    ds.select([0, 1]).to_parquet(str(repo / "data" / "train-00000-of-00002.parquet"))
    ds.select([2]).to_parquet(str(repo / "data" / "train-00001-of-00002.parquet"))
    Dataset.from_dict({"caption": ["held out"], "category": ["x"], "score": [0]}).to_parquet(
        str(repo / "data" / "test-00000-of-00001.parquet")
    )
    assert read(repo) == PAIRS
    assert read(repo, split="test") == [("held out", {"category": "x", "score": 0})]
    flat = tmp_path / "flat"  # a folder of jsonl files without split names: one "train" split
    flat.mkdir()
    ds.select([0]).to_json(str(flat / "a.jsonl"))
    ds.select([1, 2]).to_json(str(flat / "b.jsonl"))
    assert sorted(read(flat)) == sorted(PAIRS)


def test_values_become_json_able_metadata(tmp_path):
    features = Features(
        {
            "caption": Value("string"),
            "label": ClassLabel(names=["cat", "dog"]),
            "weight": Value("float32"),
            "tags": datasets.Sequence(Value("string")),
            "box": {"x": Value("int64"), "y": Value("int64")},
            "when": Value("timestamp[s]"),
            "flag": Value("bool"),
            "missing": Value("string"),
        }
    )
    Dataset.from_dict(
        {
            "caption": ["a"],
            "label": [1],
            "weight": [np.float32(0.5)],
            "tags": [["t1", "t2"]],
            "box": [{"x": 1, "y": 2}],
            "when": [datetime.datetime(2024, 5, 1, 12, 0)],
            "flag": [True],
            "missing": [None],
        },
        features=features,
    ).to_parquet(str(tmp_path / "v.parquet"))
    pairs = read(tmp_path / "v.parquet")
    assert pairs == [
        (
            "a",
            {
                "label": 1,
                "weight": 0.5,
                "tags": ["t1", "t2"],
                "box": {"x": 1, "y": 2},
                "when": "2024-05-01T12:00:00",
                "flag": True,
                "missing": None,
            },
        )
    ]
    json.dumps(pairs)
    Dataset.from_dict({"caption": ["a"], "blob": [b"\x00\x01"]}).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "b.parquet")
    assert one_sentence(e) == (
        f"row 0 of dataset '{tmp_path / 'b.parquet'}' holds a bytes in metadata column 'blob', which cannot go into the metadata as JSON."
    )


def test_embedded_image_bytes_go_to_the_content_addressed_cache(tmp_path, image_cache):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    features = Features({"caption": Value("string"), "source_image": Image(), "category": Value("string")})
    ds = Dataset.from_dict(
        {
            "caption": ["make it blue", "make it red", "again"],
            "source_image": [{"bytes": red, "path": None}, {"bytes": blue, "path": None}, {"bytes": red, "path": None}],
            "category": ["edit", "edit", "edit"],
        },
        features=features,
    )
    ds.to_parquet(str(tmp_path / "edit.parquet"))
    red_file = str(image_cache / f"{hashlib.sha256(red).hexdigest()}.png")
    blue_file = str(image_cache / f"{hashlib.sha256(blue).hexdigest()}.png")
    expected = [
        ("make it blue", {"category": "edit", "source_image": red_file, "image": red_file}),
        ("make it red", {"category": "edit", "source_image": blue_file, "image": blue_file}),
        ("again", {"category": "edit", "source_image": red_file, "image": red_file}),
    ]
    assert read(tmp_path / "edit.parquet") == expected  # Image columns are found without naming them
    assert read(tmp_path / "edit.parquet", image_columns=["source_image"]) == expected
    assert sorted(os.listdir(image_cache)) == sorted({os.path.basename(red_file), os.path.basename(blue_file)})
    with open(red_file, "rb") as f:
        assert f.read() == red
    with PILImage.open(blue_file) as img:
        assert img.size == (4, 3) and img.convert("RGB").getpixel((0, 0)) == (0, 0, 255)
    assert read(tmp_path / "edit.parquet", limit=1) == expected[:1]  # reading again reuses the cached files
    assert read(tmp_path / "edit.parquet", image_columns=[]) == [(p, {"category": "edit"}) for p, _ in expected]
    ds.save_to_disk(str(tmp_path / "edit_saved"))  # the same through save_to_disk
    assert read(tmp_path / "edit_saved") == expected
    json.dumps(expected)

    bad = Dataset.from_dict(
        {"caption": ["x"], "img": [{"bytes": b"not an image", "path": None}]},
        features=Features({"caption": Value("string"), "img": Image()}),
    )
    bad.to_parquet(str(tmp_path / "bad_img.parquet"))
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "bad_img.parquet")
    assert one_sentence(e) == (
        f"row 0 of dataset '{tmp_path / 'bad_img.parquet'}' holds bytes in image column 'img' that are not a readable image."
    )


def test_path_columns_resolve_against_the_dataset_directory(tmp_path):
    data = tmp_path / "data"
    (data / "frames").mkdir(parents=True)
    (data / "frames" / "a.png").write_bytes(png((1, 2, 3)))
    (tmp_path / "elsewhere.png").write_bytes(png((4, 5, 6)))
    rows = {
        "caption": ["edit a", "edit b"],
        "src": ["frames/a.png", str(tmp_path / "elsewhere.png")],
        "mask": ["frames/a.png", "frames/a.png"],
    }
    Dataset.from_dict(rows).to_json(str(data / "edits.jsonl"))
    a, elsewhere = str(data / "frames" / "a.png"), str(tmp_path / "elsewhere.png")
    assert read(data / "edits.jsonl", image_columns=["src", "mask"]) == [
        ("edit a", {"src": a, "mask": a, "image": a}),
        ("edit b", {"src": elsewhere, "mask": a, "image": elsewhere}),
    ]
    # without image_columns a string column is plain metadata, except one named "image" (the prompt-file convention)
    assert read(data / "edits.jsonl")[0] == ("edit a", {"src": "frames/a.png", "mask": "frames/a.png"})
    Dataset.from_dict({"caption": ["x"], "image": ["frames/a.png"], "src": ["frames/a.png"]}).to_csv(str(data / "named.csv"), index=False)
    assert read(data / "named.csv") == [("x", {"image": a, "src": "frames/a.png"})]
    assert read(data / "named.csv", image_columns=["src"], metadata_columns=["image"]) == [
        ("x", {"image": "frames/a.png", "src": a})
    ]  # a column named "image" is never overwritten
    # a directory source resolves against the directory given
    Dataset.from_dict({"caption": ["d"], "src": ["frames/a.png"]}).to_parquet(str(data / "train.parquet"))
    (data / "edits.jsonl").unlink()  # (so that the folder holds parquet only)
    (data / "named.csv").unlink()
    assert read(data, image_columns=["src"]) == [("d", {"src": a, "image": a})]

    Dataset.from_dict({"caption": ["x", "y"], "src": ["frames/a.png", "frames/gone.png"]}).to_json(str(data / "gone.jsonl"))
    with pytest.raises(FlowRLError) as e:
        read(data / "gone.jsonl", image_columns=["src"])
    assert one_sentence(e) == (
        f"row 1 of dataset '{data / 'gone.jsonl'}' names the image 'frames/gone.png' in image "
        f"column 'src', which is not a file ({data / 'frames' / 'gone.png'})."
    )
    Dataset.from_dict({"caption": ["x"], "src": ["https://example.com/a.png"]}).to_json(str(data / "url.jsonl"))
    with pytest.raises(FlowRLError) as e:
        read(data / "url.jsonl", image_columns=["src"])
    assert "names the remote image 'https://example.com/a.png' in image column 'src'" in one_sentence(e)
    Dataset.from_dict({"caption": ["x", "y"], "src": ["frames/a.png", None]}).to_json(str(data / "none.jsonl"))
    with pytest.raises(FlowRLError) as e:
        read(data / "none.jsonl", image_columns=["src"])
    assert one_sentence(e) == f"row 1 of dataset '{data / 'none.jsonl'}' has no image in image column 'src'."
    with pytest.raises(FlowRLError) as e:
        read(data / "train.parquet", image_columns=["caption2"])
    assert one_sentence(e) == f"dataset '{data / 'train.parquet'}' has no image column 'caption2' (columns: caption, src)."


def test_image_folder_with_metadata_jsonl(tmp_path):
    folder = tmp_path / "edits"
    folder.mkdir()
    (folder / "a.png").write_bytes(png((9, 9, 9)))
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "prompt": "make it pop"}) + "\n")
    assert read_dataset_prompts(str(folder)) == [("make it pop", {"image": str(folder / "a.png")})]


def test_bad_inputs_are_one_sentence(tmp_path):
    with pytest.raises(FlowRLError) as e:
        read_dataset_prompts("someone/edit-prompts")
    assert one_sentence(e) == (
        "dataset 'someone/edit-prompts' is not a local file or directory, and flowrl reads only "
        "local datasets (download a Hub dataset first: hf download --repo-type dataset "
        "someone/edit-prompts --local-dir data/edit-prompts)."
    )
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "nope.parquet")
    assert one_sentence(e) == (
        f"dataset '{tmp_path / 'nope.parquet'}' is not a local file or directory, and flowrl reads "
        f"only local datasets (download a Hub dataset first: hf download --repo-type dataset "
        f"<repo_id> --local-dir <dir>)."
    )

    (tmp_path / "corrupt.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "corrupt.parquet")
    assert one_sentence(e).startswith(f"could not read dataset file '{tmp_path / 'corrupt.parquet'}' (")
    (tmp_path / "corrupt.jsonl").write_text('{"caption": "ok"}\n{not json\n')
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "corrupt.jsonl")
    assert one_sentence(e).startswith(f"could not read dataset file '{tmp_path / 'corrupt.jsonl'}' (")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "empty.jsonl")
    assert one_sentence(e) == f"dataset file '{tmp_path / 'empty.jsonl'}' is empty."
    (tmp_path / "no_rows").mkdir()
    Dataset.from_dict({"caption": []}, features=Features({"caption": Value("string")})).save_to_disk(str(tmp_path / "no_rows" / "saved"))
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "no_rows" / "saved")
    assert one_sentence(e) == f"dataset directory '{tmp_path / 'no_rows' / 'saved'}' holds no rows."
    empty = Dataset.from_dict({"caption": []}, features=Features({"caption": Value("string")}))
    DatasetDict({"train": Dataset.from_dict({"caption": ["ok"]}), "test": empty}).save_to_disk(str(tmp_path / "half"))
    assert read(tmp_path / "half") == [("ok", {})]  # only the chosen split is opened
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "half", split="test")
    assert one_sentence(e) == f"split 'test' of dataset directory '{tmp_path / 'half'}' holds no rows."
    empty.to_parquet(str(tmp_path / "no_rows.parquet"))
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "no_rows.parquet")
    assert one_sentence(e) == f"dataset file '{tmp_path / 'no_rows.parquet'}' holds no rows."
    (tmp_path / "nothing").mkdir()
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "nothing")
    assert one_sentence(e) == f"dataset directory '{tmp_path / 'nothing'}' holds no data the datasets library can read."
    (tmp_path / "prompts.txt").write_text("a cat\n")
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "prompts.txt")
    assert one_sentence(e) == (
        f"dataset file '{tmp_path / 'prompts.txt'}' has an unsupported type '.txt' "
        f"(supported: .parquet, .arrow, .jsonl, .json, .csv, .tsv, or a dataset directory)."
    )

    Dataset.from_dict(ROWS).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(FlowRLError) as e:
        read_dataset_prompts(str(tmp_path / "p.parquet"))  # the default prompt column "prompt"
    assert one_sentence(e) == (f"dataset '{tmp_path / 'p.parquet'}' has no prompt column 'prompt' (columns: caption, category, score).")
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "p.parquet", metadata_columns=["category", "colour"])
    assert one_sentence(e) == (f"dataset '{tmp_path / 'p.parquet'}' has no metadata column 'colour' (columns: caption, category, score).")
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "p.parquet", image_columns=["score"])
    assert "image column 'score' of dataset" in one_sentence(e)
    with pytest.raises(FlowRLError) as e:
        read_dataset_prompts(str(tmp_path / "p.parquet"), prompt_column="score")
    assert one_sentence(e) == (f"row 0 of dataset '{tmp_path / 'p.parquet'}' has an int in prompt column 'score', not a string.")
    Dataset.from_dict({"caption": ["ok", None]}, features=Features({"caption": Value("string")})).to_json(str(tmp_path / "gap.jsonl"))
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "gap.jsonl")
    assert one_sentence(e) == f"row 1 of dataset '{tmp_path / 'gap.jsonl'}' has no value in prompt column 'caption', not a string."
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "p.parquet", limit=0)
    assert one_sentence(e) == f"the row limit for dataset '{tmp_path / 'p.parquet'}' must be a positive whole number, got 0."
    Dataset.from_dict(
        {"caption": ["x"], "img": [{"bytes": png((0, 0, 0)), "path": None}]},
        features=Features({"caption": Value("string"), "img": Image()}),
    ).to_parquet(str(tmp_path / "i.parquet"))
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "i.parquet", image_columns=[], metadata_columns=["img"])
    assert one_sentence(e) == (
        f"metadata column 'img' of dataset '{tmp_path / 'i.parquet'}' holds media (Image), which "
        f"cannot go into the metadata as JSON (name an image column in image_columns instead)."
    )


def test_offline_for_the_call_only_and_missing_extra(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    seen = {}
    real = datasets.load_dataset

    def spy(*args, **kwargs):
        seen.update(
            env=os.environ.get("HF_HUB_OFFLINE"), datasets=datasets.config.HF_HUB_OFFLINE, hub=huggingface_hub.constants.HF_HUB_OFFLINE
        )
        return real(*args, **kwargs)

    before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets, "load_dataset", spy)
    Dataset.from_dict(ROWS).to_csv(str(tmp_path / "p.csv"), index=False)
    assert read(tmp_path / "p.csv") == PAIRS
    assert seen == {"env": "1", "datasets": True, "hub": True}
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the extra were not installed
    with pytest.raises(FlowRLError) as e:
        read(tmp_path / "p.csv")
    assert one_sentence(e) == "reading Hugging Face datasets needs the 'datasets' package: pip install 'flowrl[datasets]'."


@pytest.mark.slow
def test_a_run_trains_on_a_dataset_through_the_config(tmp_path, one_thread):
    """``prompts.dataset: hf`` with a column mapping: the run's prompts and the metadata its reward reads (the
    classifier's ``digit``) come from a parquet file, the held-out ones from the "test" split of a saved DatasetDict."""
    from conftest import fast_overrides

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    Dataset.from_dict({"text": ["a handwritten seven", "the digit two"], "digit": [7, 2], "note": ["x", "y"]}).to_parquet(
        str(tmp_path / "train.parquet")
    )
    DatasetDict(
        {
            "train": Dataset.from_dict({"text": ["zzz"], "digit": [0]}),
            "test": Dataset.from_dict({"text": ["a drawing of the number seven"], "digit": [7]}),
        }
    ).save_to_disk(str(tmp_path / "eval"))
    overrides = fast_overrides(
        tmp_path / "run",
        **{
            "prompts.dataset": "hf",
            "prompts.train_file": str(tmp_path / "train.parquet"),
            "prompts.eval_file": str(tmp_path / "eval"),
            "prompts.eval_split": "test",
            "prompts.columns": "{prompt: text, metadata: [digit]}",
            "log.trackers": "[]",
            "pipeline.device": "cpu",
        },
    )
    trainer = Trainer(load_config(None, overrides))
    assert trainer.modality.train_pool == [("a handwritten seven", {"digit": 7}), ("the digit two", {"digit": 2})]
    assert trainer.modality.held_out.prompts == ["a drawing of the number seven"]
    assert trainer.fit()["status"] == "completed"
    # the same files mapped without the column the reward needs: refused at start-up, naming the prompt
    with pytest.raises(FlowRLError, match=r"^reward 'digit_classifier' needs 'digit' in every prompt's metadata, but training prompt 1 "):
        Trainer(load_config(None, [*overrides, "prompts.columns={prompt: text, metadata: []}", f"output_dir={tmp_path / 'other'}"]))
