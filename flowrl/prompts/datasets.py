"""Prompts from local Hugging Face ``datasets`` sources: parquet, arrow, jsonl/json, csv, or saved datasets.

``read_dataset_prompts(path, ...)`` returns the same ``(prompt, metadata)`` pairs as the prompt files of
:mod:`flowrl.prompts.files`, read with the ``datasets`` library (the optional extra
``pip install 'flowrl[datasets]'``). ``path`` is one of:

- a single ``.parquet``, ``.arrow``, ``.jsonl`` / ``.json``, ``.csv`` or ``.tsv`` file (its one split is "train");
- a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (read with ``load_from_disk``);
- any other folder: a local dataset repository (e.g. one fetched with ``hf download``), read with
  ``load_dataset(folder)``, which finds its data files (parquet, arrow, jsonl, csv, an image folder with a
  ``metadata.jsonl``, ...), its shards and its splits (from the file names, ``data/train-*.parquet``, or the
  README's ``configs``).

The split is ``split`` if given, else "train" when the source has one, else its only split; a source with
several splits and none of them "train" needs ``split``.

Column mapping, per row (rows are numbered from 0, as ``dataset[i]`` numbers them):

- ``prompt_column`` (default "prompt") is the prompt; every value must be a string (kept as is).
- ``image_columns``: source images (e.g. for image editing or image-to-video). A column may be a
  ``datasets.Image`` feature or hold path strings. Each becomes, in the metadata under the column's name,
  the absolute path of an image file: a path is resolved against the directory of the dataset file (for a
  folder source: that folder), like the ``"image"`` key of a prompt file, and must exist; an image stored as
  bytes inside the dataset is written once to a content-addressed cache file
  (``$FLOWRL_IMAGE_CACHE``, else ``$XDG_CACHE_HOME/flowrl/dataset_images``, else
  ``~/.cache/flowrl/dataset_images``; named by the bytes' SHA-256) and that file's path is given. Paths rather
  than PIL images, because the metadata travels as JSON (the remote reward client, preference pairs) and to
  other processes, and the consumers (``metadata["image"]`` of image-to-video) already open paths; the cache
  is shared by the processes of a distributed run and reused across runs. The first image column is also
  given as ``metadata["image"]`` (the key image-to-video reads) unless the metadata already has an
  ``"image"`` key. ``None`` (the default) picks every ``datasets.Image`` column and a string column named
  "image" (the prompt-file convention); ``[]`` picks none.
- ``metadata_columns``: the other columns copied into the metadata under the same names. ``None`` (the
  default) copies every column but the prompt column, leaving out media columns (images not picked as image
  columns, audio, video), so that a dataset's labels and ground truths reach the rewards without listing
  them. Values are made JSON-able: nested lists and dicts as they are, numpy scalars and arrays as Python
  numbers and lists, dates and times as ISO strings, decimals as floats; a ``ClassLabel`` stays its integer.

``limit`` keeps the first N rows of the split. The call never reaches the network: it runs with the
Hugging Face offline mode on (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), and a path that does not exist
(e.g. a Hub id) is refused with the ``hf download --repo-type dataset ... --local-dir ...`` command that
fetches it first. A ``load_dataset`` source is prepared in a temporary cache and held in memory, so nothing
is written to the Hugging Face cache. Every bad input is a one-sentence ``FlowRLError``.

In a config it will look like this (indicative; the config keys are settled where the config is defined)::

    prompts:
      dataset: hf
      train_file: data/my_prompts.parquet
      split: train
      columns: {prompt: caption, metadata: [category], images: [source_image]}
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import FlowRLError

IMAGE_CACHE_ENV = "FLOWRL_IMAGE_CACHE"
# single-file sources: suffix -> (datasets builder, builder kwargs)
FILE_BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".parquet": ("parquet", {}),
    ".arrow": ("arrow", {}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
}
_IMAGE_SUFFIXES = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tiff"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def read_dataset_prompts(
    path: str,
    *,
    split: str | None = None,
    prompt_column: str = "prompt",
    metadata_columns: list[str] | None = None,
    image_columns: list[str] | None = None,
    limit: int | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """Return the (prompt, metadata) pairs of a local Hugging Face dataset source, in row order (see the module doc)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise FlowRLError(f"the row limit for dataset '{path}' must be a positive whole number, got {limit!r}.")
    datasets = _import_datasets()
    source = Path(os.path.expanduser(str(path)))
    if not source.exists():
        hub_like = bool(_HUB_ID.match(str(path))) and Path(str(path)).suffix.lower() not in FILE_BUILDERS
        repo = str(path) if hub_like else "<repo_id>"
        local = f"data/{repo.split('/')[-1]}" if hub_like else "<dir>"
        raise FlowRLError(
            f"dataset '{path}' is not a local file or directory, and flowrl reads only local datasets "
            f"(download a Hub dataset first: hf download --repo-type dataset {repo} --local-dir {local})."
        )
    base = source if source.is_dir() else source.parent
    base = Path(os.path.abspath(base))
    with _offline_and_quiet(datasets):
        name, ds, n_splits = _load(datasets, source, split)
    where = f"dataset '{source}'" + (f" (split '{name}')" if n_splits > 1 or split is not None else "")
    if len(ds) == 0:
        raise FlowRLError(f"{where} holds no rows.")

    columns = list(ds.column_names)
    features = ds.features
    _check_column(prompt_column, "prompt", columns, where)
    images = _image_columns(image_columns, columns, features, prompt_column, where, datasets)
    metadata = _metadata_columns(metadata_columns, columns, features, prompt_column, images, where, datasets)
    needed = list(dict.fromkeys([prompt_column, *images, *metadata]))
    ds = ds.select_columns(needed)
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    rows = ds.with_format("arrow")[:].to_pylist()  # raw values: Image features stay {"bytes", "path"} dicts

    cache = _ImageCache(where)
    alias = images[0] if images and "image" not in metadata and "image" not in images else None
    pairs: list[tuple[str, dict[str, Any]]] = []
    for number, row in enumerate(rows):
        prompt = row[prompt_column]
        if not isinstance(prompt, str):
            got = "no value" if prompt is None else _a(type(prompt).__name__)
            raise FlowRLError(f"row {number} of {where} has {got} in prompt column '{prompt_column}', not a string.")
        meta: dict[str, Any] = {}
        for column in metadata:
            meta[column] = _jsonable(row[column], number, column, where)
        for column in images:
            meta[column] = _image_path(
                row[column], number, column, where, base, cache, is_feature=isinstance(features[column], datasets.Image)
            )
        if alias is not None:
            meta["image"] = meta[alias]
        pairs.append((prompt, meta))
    return pairs


# -- loading --------------------------------------------------------------------------------------
def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise FlowRLError("reading Hugging Face datasets needs the 'datasets' package: pip install 'flowrl[datasets]'.") from None
    return datasets


@contextmanager
def _offline_and_quiet(datasets) -> Iterator[None]:
    """Hugging Face offline mode, no progress bars and no library error logs, for the duration of a load."""
    from datasets import utils as ds_utils
    from datasets.utils import logging as ds_logging

    targets: list[tuple[Any, str]] = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")]
    try:
        from huggingface_hub import constants as hub_constants

        targets.append((hub_constants, "HF_HUB_OFFLINE"))
    except ImportError:  # pragma: no cover - datasets depends on huggingface_hub
        pass
    saved_attrs = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name in targets]
    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    bars_off = ds_utils.are_progress_bars_disabled()
    verbosity = ds_logging.get_verbosity()
    try:
        for obj, name in targets:
            setattr(obj, name, True)
        os.environ.update({k: "1" for k in saved_env})
        ds_utils.disable_progress_bars()
        ds_logging.set_verbosity(ds_logging.CRITICAL)  # the reason goes into our one sentence instead
        yield
    finally:
        for obj, name, value in saved_attrs:
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not bars_off:
            ds_utils.enable_progress_bars()
        ds_logging.set_verbosity(verbosity)


_MISSING = object()


def _load(datasets, source: Path, split: str | None) -> tuple[str, Any, int]:
    """(split name, Dataset, number of splits) of a local source."""
    if source.is_dir():
        what = f"dataset directory '{source}'"
        if (source / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: load only the chosen split
            try:
                names = [str(n) for n in json.loads((source / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise FlowRLError(f"could not read the split list of {what} ({_reason(e)}).") from None
            name = _choose_split(names, source, split)
            return name, _load_saved(datasets, source / name, f"split '{name}' of {what}"), len(names)
        if (source / "state.json").is_file() and (source / "dataset_info.json").is_file():  # Dataset.save_to_disk
            ds = _load_saved(datasets, source, what)
            name = _choose_split([str(ds.split) if ds.split is not None else "train"], source, split)
            return name, ds, 1
    else:
        what = f"dataset file '{source}'"
        if source.suffix.lower() not in FILE_BUILDERS:
            raise FlowRLError(
                f"{what} has an unsupported type '{source.suffix or '(none)'}' "
                f"(supported: {', '.join(FILE_BUILDERS)}, or a dataset directory)."
            )
        if source.stat().st_size == 0:
            raise FlowRLError(f"{what} is empty.")
    try:
        with tempfile.TemporaryDirectory(prefix="flowrl-datasets-") as cache_dir:
            if source.is_dir():  # a dataset repository layout: load_dataset finds the files and splits
                loaded = datasets.load_dataset(str(source), cache_dir=cache_dir, keep_in_memory=True)
            else:
                builder, kwargs = FILE_BUILDERS[source.suffix.lower()]
                loaded = datasets.load_dataset(builder, data_files=str(source), cache_dir=cache_dir, keep_in_memory=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - the library raises many kinds; each becomes one sentence
        raise _load_error(e, what) from None
    if not isinstance(loaded, datasets.DatasetDict):  # e.g. an IterableDataset
        raise FlowRLError(f"{what} did not load as a dataset (got a {type(loaded).__name__}).")
    name = _choose_split([str(n) for n in loaded], source, split)
    return name, loaded[name], len(loaded)


def _load_saved(datasets, folder: Path, what: str):
    """A Dataset.save_to_disk folder (one without data files holds no rows; the library cannot open it)."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        if isinstance(state, dict) and state.get("_data_files") == []:
            raise FlowRLError(f"{what} holds no rows.")
        return datasets.load_from_disk(str(folder))
    except FlowRLError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _load_error(e, what) from None


def _load_error(error: BaseException, what: str) -> FlowRLError:
    if type(error).__name__ == "EmptyDatasetError" or isinstance(error, StopIteration):
        return FlowRLError(f"{what} holds no data the datasets library can read.")
    if isinstance(error, ValueError) and "corresponds to no data" in str(error):  # a split of zero rows
        return FlowRLError(f"{what} holds no rows.")
    return FlowRLError(f"could not read {what} ({_reason(error)}).")


def _reason(error: BaseException) -> str:
    """The innermost useful message of a library error, on one line."""
    seen = error
    while seen.__cause__ is not None and type(seen).__name__ == "DatasetGenerationError":
        seen = seen.__cause__
    text = str(seen).strip().splitlines()[0].strip() if str(seen).strip() else type(seen).__name__
    text = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)[0]  # its first sentence: ours stays one sentence
    if len(text) > 200:
        text = text[:197] + "..."
    return text.rstrip(".")


def _choose_split(names: list[str], source: Path, split: str | None) -> str:
    listed = ", ".join(f"'{n}'" for n in names)
    if split is not None:
        if split not in names:
            raise FlowRLError(f"dataset '{source}' has no split '{split}' (splits: {listed}).")
        return split
    if "train" in names:
        return "train"
    if len(names) == 1:
        return names[0]
    raise FlowRLError(f"dataset '{source}' has the splits {listed} and none is 'train', so choose one with split.")


# -- columns --------------------------------------------------------------------------------------
def _check_column(column: str, role: str, columns: list[str], where: str) -> None:
    if column not in columns:
        raise FlowRLError(f"{where} has no {role} column '{column}' (columns: {', '.join(columns)}).")


def _is_path_feature(feature: Any, datasets) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _is_media(feature: Any) -> bool:
    from datasets.features.features import require_decoding

    return require_decoding(feature, ignore_decode_attribute=True)


def _image_columns(chosen: list[str] | None, columns: list[str], features: Any, prompt_column: str, where: str, datasets) -> list[str]:
    if chosen is None:
        return [
            c
            for c in columns
            if c != prompt_column
            and (isinstance(features[c], datasets.Image) or (c == "image" and _is_path_feature(features[c], datasets)))
        ]
    for column in chosen:
        _check_column(column, "image", columns, where)
        if not (isinstance(features[column], datasets.Image) or _is_path_feature(features[column], datasets)):
            raise FlowRLError(
                f"image column '{column}' of {where} holds {features[column]!r}, "
                f"neither images (a datasets.Image feature) nor image paths (strings)."
            )
    return list(dict.fromkeys(chosen))


def _metadata_columns(
    chosen: list[str] | None, columns: list[str], features: Any, prompt_column: str, images: list[str], where: str, datasets
) -> list[str]:
    if chosen is None:
        return [c for c in columns if c != prompt_column and c not in images and not _is_media(features[c])]
    out = []
    for column in chosen:
        _check_column(column, "metadata", columns, where)
        if column in images:
            continue  # given as an image path already
        if _is_media(features[column]):
            kind = type(features[column]).__name__
            raise FlowRLError(
                f"metadata column '{column}' of {where} holds media ({kind}), which cannot go into the "
                f"metadata as JSON (name an image column in image_columns instead)."
            )
        out.append(column)
    return list(dict.fromkeys(out))


# -- values ---------------------------------------------------------------------------------------
def _jsonable(value: Any, row: int, column: str, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v, row, column, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, row, column, where) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    kind = type(value).__module__.split(".")[0]
    if kind == "numpy":
        import numpy as np

        if isinstance(value, np.generic):
            return _jsonable(value.item(), row, column, where)
        if isinstance(value, np.ndarray):
            return _jsonable(value.tolist(), row, column, where)
    raise FlowRLError(
        f"row {row} of {where} holds {_a(type(value).__name__)} in metadata column '{column}', which cannot go into the metadata as JSON."
    )


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


class _ImageCache:
    """Image bytes from a dataset -> files named by their SHA-256 in the image cache directory."""

    def __init__(self, where: str):
        self.where = where
        self.root: Path | None = None

    def directory(self) -> Path:
        if self.root is None:
            env = os.environ.get(IMAGE_CACHE_ENV)
            if env:
                self.root = Path(os.path.expanduser(env))
            else:
                xdg = os.environ.get("XDG_CACHE_HOME")
                self.root = (Path(xdg) if xdg else Path.home() / ".cache") / "flowrl" / "dataset_images"
            self.root = Path(os.path.abspath(self.root))
        return self.root

    def store(self, data: bytes, row: int, column: str) -> str:
        digest = hashlib.sha256(data).hexdigest()
        root = self.directory()
        for suffix in _IMAGE_SUFFIXES.values():  # already written (and checked) by an earlier read
            if (root / f"{digest}{suffix}").is_file():
                return str(root / f"{digest}{suffix}")
        import PIL.Image

        try:
            with PIL.Image.open(io.BytesIO(data)) as img:
                fmt = img.format or "PNG"
        except Exception:  # noqa: BLE001 - PIL raises several kinds for bad bytes
            raise FlowRLError(f"row {row} of {self.where} holds bytes in image column '{column}' that are not a readable image.") from None
        target = root / f"{digest}{_IMAGE_SUFFIXES.get(fmt, '.' + fmt.lower())}"
        if target.is_file():
            return str(target)
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=root, prefix=f".{digest}-", delete=False) as f:
                f.write(data)
            os.replace(f.name, target)  # atomic: processes reading the same dataset write the same file
        except OSError as e:
            raise FlowRLError(
                f"could not write the images of {self.where} to the image cache '{root}' "
                f"({e.strerror or e}); set {IMAGE_CACHE_ENV} to a writable directory."
            ) from None
        return str(target)


def _image_path(value: Any, row: int, column: str, where: str, base: Path, cache: _ImageCache, *, is_feature: bool) -> str:
    if is_feature and isinstance(value, dict):
        if value.get("bytes"):
            return cache.store(value["bytes"], row, column)
        value = value.get("path")
    if not isinstance(value, str) or not value:
        got = "no image" if value is None or value == "" else _a(type(value).__name__)
        raise FlowRLError(f"row {row} of {where} has {got} in image column '{column}'.")
    if "://" in value:
        raise FlowRLError(
            f"row {row} of {where} names the remote image '{value[:120]}' in image column '{column}', and flowrl reads only local images."
        )
    path = Path(os.path.expanduser(value))
    path = Path(os.path.abspath(path if path.is_absolute() else base / path))
    if not path.is_file():
        raise FlowRLError(f"row {row} of {where} names the image '{value[:120]}' in image column '{column}', which is not a file ({path}).")
    return str(path)
