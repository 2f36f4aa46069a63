"""The reward server's wire format, in one place: request decoding (NPZ or base64 PNG + JSON, never
pickle; every header checked before any data is read) and the JSON encoding of scores, where NaN is
``null`` and +-inf are the strings ``"inf"``/``"-inf"``. ``decode_value`` is the client's inverse of
``encode_value``.
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

NPZ_CONTENT_TYPE = "application/x-npz"


class BadRequest(Exception):
    """A malformed request; the message is one sentence for the client (answered with 400)."""


@dataclass
class _Job:
    samples: Any  # torch.Tensor (B, ...) float32 on CPU
    prompts: list[str]
    metadata: list[dict[str, Any]]
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[list, dict[str, list]] | None = None
    error: BaseException | None = None
    arrived: float = 0.0  # time.monotonic() when queued: the batcher's wait is bounded from it
    on_done: Callable[[], None] | None = None  # called on the scoring thread once result or error is set

    def __len__(self) -> int:
        return int(self.samples.shape[0])


def _read_npy_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, kinds: dict[str, int]) -> np.ndarray:
    """Read one .npy member after checking its header: no objects, an allowed dtype, a consistent size."""
    fmt = np.lib.format
    with zf.open(info) as f:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(f)
        else:
            raise BadRequest(f"NPZ member '{info.filename}' has an unsupported .npy version {version}.")
    name = info.filename[:-4]
    if dtype.hasobject:
        raise BadRequest(f"NPZ member '{name}' holds Python objects, which are refused (nothing is unpickled).")
    plain = dtype.fields is None and dtype.subdtype is None and dtype.kind in kinds
    if not plain or kinds[dtype.kind] not in (0, dtype.itemsize):
        allowed = {"f": "float32", "u": "uint8", "U": "unicode"}
        raise BadRequest(f"NPZ member '{name}' has dtype {dtype}; expected {' or '.join(allowed[k] for k in kinds)}.")
    if math.prod(shape) * dtype.itemsize > info.file_size:
        raise BadRequest(f"NPZ member '{name}' is shorter than its header says.")
    with zf.open(info) as f:
        return fmt.read_array(f, allow_pickle=False)


def _decode_npz(body: bytes, limit: int) -> tuple[np.ndarray, Any]:
    try:
        zf = zipfile.ZipFile(io.BytesIO(body))
        infos = zf.infolist()
    except Exception:  # noqa: BLE001 - any failure to parse untrusted bytes is the client's
        raise BadRequest("the request body is not a valid NPZ archive.") from None
    names = [i.filename for i in infos]
    if sorted(names) != ["meta.npy", "samples.npy"]:
        raise BadRequest(f"the NPZ archive must hold exactly the arrays 'samples' and 'meta', got {names[:8]}.")
    if sum(i.file_size for i in infos) > limit:
        raise BadRequest(f"the NPZ archive expands to more than {limit} bytes.")
    by_name = {i.filename: i for i in infos}
    try:
        samples = _read_npy_member(zf, by_name["samples.npy"], {"f": 4, "u": 1})
        meta = _read_npy_member(zf, by_name["meta.npy"], {"U": 0})
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt member, CRC error, encrypted or compressed oddly
        raise BadRequest(f"the NPZ archive is corrupt ({type(e).__name__}).") from None
    if meta.shape != ():
        raise BadRequest(f"NPZ member 'meta' must be a 0-d string holding JSON, got shape {meta.shape}.")
    try:
        meta_obj = json.loads(str(meta[()]))
    except (ValueError, RecursionError):
        raise BadRequest("NPZ member 'meta' is not valid JSON.") from None
    return samples, meta_obj


def _decode_png_json(body: bytes, limit: int) -> tuple[np.ndarray, Any]:
    from PIL import Image

    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise BadRequest("the request body is not valid JSON.") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("images"), list):
        raise BadRequest("a JSON request must be an object with an 'images' list of base64 PNG strings.")
    images = obj["images"]
    arrays, pixels, size = [], 0, None
    for i, item in enumerate(images):
        if not isinstance(item, str):
            raise BadRequest(f"image {i} is not a base64 string.")
        try:
            raw = base64.b64decode(item, validate=True)
            img = Image.open(io.BytesIO(raw), formats=["PNG"])
        except Exception:  # noqa: BLE001 - bad base64, not a PNG, a decompression bomb
            raise BadRequest(f"image {i} is not a base64-encoded PNG.") from None
        if img.mode not in ("L", "RGB"):
            raise BadRequest(f"image {i} has PNG mode {img.mode}; send 8-bit grayscale (L) or RGB.")
        if size is not None and (img.size, img.mode) != size:
            raise BadRequest(f"image {i} differs in size or mode from image 0; a batch needs one shape.")
        size = (img.size, img.mode)
        pixels += img.size[0] * img.size[1] * len(img.mode)
        if pixels > limit:  # checked from the header, before any pixel is decompressed
            raise BadRequest(f"the PNG images decode to more than {limit} bytes of pixels.")
        try:
            arr = np.array(img, dtype=np.uint8)
        except Exception:  # noqa: BLE001 - truncated or corrupt pixel data
            raise BadRequest(f"image {i} is a corrupt PNG.") from None
        arrays.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
    samples = np.stack(arrays) if arrays else np.zeros((0, 1, 1, 1), np.uint8)
    return samples, {k: v for k, v in obj.items() if k != "images"}


def decode_request(body: bytes, content_type: str, max_bytes: int, max_batch: int) -> _Job:
    """Turn a request body into a scoring job, or raise BadRequest with a one-sentence reason."""
    if "json" in content_type.lower():
        samples, meta = _decode_png_json(body, max_bytes)
    else:
        samples, meta = _decode_npz(body, max_bytes)
    if samples.ndim not in (4, 5) or 0 in samples.shape:
        raise BadRequest(
            f"samples must be (B, C, H, W) images or (B, C, T, H, W) videos with no empty dimension, got shape {tuple(samples.shape)}."
        )
    batch = samples.shape[0]
    if batch > max_batch:
        raise BadRequest(f"the batch has {batch} samples, more than this server's max_batch of {max_batch}.")
    if not isinstance(meta, dict):
        raise BadRequest("the request metadata must be a JSON object with 'prompts' and 'metadata'.")
    prompts = meta.get("prompts")
    metadata = meta.get("metadata", [{}] * batch)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("'prompts' must be a list of strings.")
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest("'metadata' must be a list of JSON objects.")
    if len(prompts) != batch or len(metadata) != batch:
        raise BadRequest(f"the batch has {batch} samples but {len(prompts)} prompts and {len(metadata)} metadata entries.")
    if samples.dtype.kind == "u":  # uint8: every value is a pixel in [0, 255]
        tensor = torch.from_numpy(samples.astype(np.float32)) / 255.0
    else:
        _check_float_range(samples)
        tensor = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    return _Job(tensor, prompts, metadata)


def _check_float_range(samples: np.ndarray) -> None:
    """float32 samples are images or videos as the pipelines decode them, in [0, 1]; anything else (1e6, NaN)
    is a client bug that a reward model would score without complaint, so it is refused."""
    if not np.isfinite(samples).all():
        raise BadRequest("float32 samples hold NaN or infinite values; send finite values in [0, 1].")
    lo, hi = float(samples.min()), float(samples.max())
    if lo < 0.0 or hi > 1.0:
        raise BadRequest(f"float32 samples must lie in [0, 1], got values from {lo:g} to {hi:g}; clamp them or send uint8 in [0, 255].")


def encode_value(v: float) -> float | str | None:
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def encode_list(t) -> list:
    return [encode_value(v) for v in t.detach().to("cpu", dtype=torch.float32).tolist()]


def decode_value(v: Any) -> float:
    """Inverse of ``encode_value`` (used by the client)."""
    if v is None:
        return math.nan
    if v == "inf":
        return math.inf
    if v == "-inf":
        return -math.inf
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise ValueError(f"{v!r} is not a score")
