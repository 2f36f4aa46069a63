"""A reward server: run heavy reward models in another process (or on another host) and score over HTTP.

    FLOWRL_REWARD_TOKEN=... flowrl serve-reward server.yaml
    FLOWRL_REWARD_TOKEN=... python -m flowrl.reward_models.server server.yaml [--port N]

The client is ``flowrl.reward_models.remote.RemoteReward`` (reward name ``remote``). Wire format, see
docs/reward_server.md:

* ``POST /score`` with ``Authorization: Bearer <token>`` and a ``Content-Length``; the body is either an
  NPZ archive (``samples``: float32 in [0, 1] or uint8 in [0, 255], (B, C, H, W) or (B, C, T, H, W);
  ``meta``: a 0-d unicode array holding the JSON ``{"prompts": [...], "metadata": [...]}``), or a JSON
  object ``{"images": [base64 PNG, ...], "prompts": [...], "metadata": [...]}`` sent as
  ``application/json``. Nothing is ever unpickled: NPZ members are read with ``allow_pickle=False``
  after their headers were checked to hold plain float32/uint8/unicode arrays.
* ``200 {"scores": [...], "extras": {name: [...]}}``; NaN is ``null`` and +-inf is ``"inf"``/``"-inf"``.
* Errors answer ``{"error": "<one sentence>"}`` with 400 (malformed request), 401 (token), 404, 411 (no
  Content-Length), 413 (body over ``max_request_bytes``), 500 (the reward raised) or 503 (too busy).
* ``GET /health`` (no token needed) answers ``{"status": "ok", "reward": [component names], ...}``.

One model serves many connections: HTTP requests are parsed on their own threads, but scoring runs on a
single worker thread, so requests are scored one after another (never concurrently on the model). With
``coalesce: true`` the worker scores all requests waiting in its queue that have the same sample shape
as one batch (up to ``max_batch`` samples) and splits the results; leave it off for rewards whose score
of a sample depends on the rest of its batch.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import io
import json
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import numpy as np
import torch
from pydantic import Field, ValidationError, field_validator

from flowrl.config import RewardConfig, Section, _describe, read_yaml_mapping
from flowrl.errors import FlowRLError

DEFAULT_TOKEN_ENV = "FLOWRL_REWARD_TOKEN"
NPZ_CONTENT_TYPE = "application/x-npz"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_DRAIN_SECONDS = 2.0  # how long a rejected request's unread body is drained before the socket closes


class ServerConfig(Section):
    """``flowrl serve-reward`` configuration (YAML). Unknown keys are rejected."""

    reward: RewardConfig  # same shape as a training config's ``reward`` section
    host: str = "127.0.0.1"  # loopback only; serving other hosts must be asked for explicitly
    port: int = Field(0, ge=0, le=65535)  # 0: pick a free port (printed on start)
    token_env: str = DEFAULT_TOKEN_ENV  # environment variable holding the shared secret
    allow_no_token: bool = False  # serve without a token (anyone who can connect can score)
    max_request_bytes: int = Field(64 * 2**20, ge=1)  # body limit, and limit of the decoded pixels
    max_batch: int = Field(256, ge=1)  # samples per request (and per coalesced batch)
    device: str = "auto"  # "auto": CUDA when present, else CPU
    coalesce: bool = False  # score queued requests of the same shape as one batch
    max_connections: int = Field(64, ge=1)  # open connections at once; more are closed at once

    @field_validator("host", "token_env")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v == "auto":
            return v
        try:
            torch.device(v)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{v!r} is not a torch device ({str(e).splitlines()[0]})") from None
        return v


def load_server_config(path: str | Path) -> ServerConfig:
    """Read and validate a server YAML; every problem is a one-sentence FlowRLError."""
    tree = read_yaml_mapping(path, "reward server config")
    try:
        return ServerConfig.model_validate(tree)
    except ValidationError as e:
        raise FlowRLError(_describe(e.errors()[0]) + ".") from None


def resolve_token(config: ServerConfig) -> str | None:
    """The shared secret from ``config.token_env``; None only when ``allow_no_token`` permits it."""
    token = os.environ.get(config.token_env, "")
    if token:
        return token
    if config.allow_no_token:
        return None
    raise FlowRLError(
        f"the reward server needs a shared secret: set the environment variable {config.token_env} "
        "(or set allow_no_token: true to serve without one)."
    )


# ----------------------------------------------------------------------------------------- decoding


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
        raise BadRequest(
            f"NPZ member '{name}' has dtype {dtype}; expected {' or '.join(allowed[k] for k in kinds)}."
        )
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
            f"samples must be (B, C, H, W) images or (B, C, T, H, W) videos with no empty dimension, "
            f"got shape {tuple(samples.shape)}."
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
        raise BadRequest(
            f"the batch has {batch} samples but {len(prompts)} prompts and {len(metadata)} metadata entries."
        )
    if samples.dtype.kind == "u":
        tensor = torch.from_numpy(samples.astype(np.float32)) / 255.0
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    return _Job(tensor, prompts, metadata)


def _encode_value(v: float) -> float | str | None:
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _encode_list(t) -> list:
    return [_encode_value(v) for v in t.detach().to("cpu", dtype=torch.float32).tolist()]


# ----------------------------------------------------------------------------------------- scoring


_STOP = object()


class _Scorer:
    """The single worker thread that owns the model: jobs are scored one after another.

    With ``coalesce`` it drains every queued job with the same sample shape (up to ``max_batch``
    samples in all) into one reward call; if that call fails, each job is scored alone so that one bad
    request cannot fail its neighbours.
    """

    def __init__(self, reward, device: str, max_batch: int, coalesce: bool, max_queue: int) -> None:
        self.reward = reward
        self.device = device
        self.max_batch = max_batch
        self.coalesce = coalesce
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.requests = 0
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="flowrl-reward-scorer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.queue.put(_STOP)
            self._thread.join(timeout=30)

    def submit(self, job: _Job) -> None:
        """Queue a job (raises queue.Full when the server is saturated)."""
        self.queue.put_nowait(job)

    def _run(self) -> None:
        carry = None
        while True:
            first = carry if carry is not None else self.queue.get()
            carry = None
            if first is _STOP:
                return
            group, total = [first], len(first)
            while self.coalesce:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if (
                    nxt is _STOP
                    or nxt.samples.shape[1:] != first.samples.shape[1:]
                    or total + len(nxt) > self.max_batch
                ):
                    carry = nxt
                    break
                group.append(nxt)
                total += len(nxt)
            self._score_group(group)

    def _score_group(self, group: list[_Job]) -> None:
        self.requests += len(group)
        try:
            if len(group) == 1:
                self._score(group)
            else:
                try:
                    self._score(group)
                except Exception:  # noqa: BLE001 - retry alone, so only the bad request fails
                    for job in group:
                        try:
                            self._score([job])
                        except Exception as e:  # noqa: BLE001
                            job.error = e
        except Exception as e:  # noqa: BLE001 - reported to the client as 400 or 500
            for job in group:
                job.error = e
        finally:
            for job in group:
                job.done.set()

    def _score(self, group: list[_Job]) -> None:
        self.batches += 1
        samples = torch.cat([j.samples for j in group]) if len(group) > 1 else group[0].samples
        prompts = [p for j in group for p in j.prompts]
        metadata = [m for j in group for m in j.metadata]
        with torch.no_grad():
            out = self.reward(samples.to(self.device), prompts, metadata)
        n = samples.shape[0]
        scores = out.scores.reshape(-1) if out.scores.numel() == n else None
        if scores is None:
            raise RuntimeError(f"the reward returned {out.scores.numel()} scores for {n} samples")
        extras = {k: v.reshape(-1) for k, v in out.extras.items() if v.numel() == n}
        start = 0
        for job in group:
            end = start + len(job)
            job.result = (
                _encode_list(scores[start:end]),
                {k: _encode_list(v[start:end]) for k, v in extras.items()},
            )
            start = end


# ----------------------------------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    server_version = "flowrl-reward/1"
    sys_version = ""
    timeout = 60  # seconds per socket read/write: a stalled client cannot hold a thread forever
    server: "_HTTPServer"

    # -- responses
    def _send_json(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _reject(self, status: int, message: str, headers: dict[str, str] | None = None, drain: bool = True) -> None:
        """Answer an error; when the body was not read, half-close and drain it briefly so the client
        receives the answer instead of a connection reset (a bounded "lingering close")."""
        self._send_json(status, {"error": message}, headers)
        if not drain:
            return
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + _DRAIN_SECONDS
            self.connection.settimeout(0.25)
            while time.monotonic() < deadline:
                try:
                    if not self.connection.recv(65536):
                        break
                except socket.timeout:
                    continue
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        sys.stderr.write(f"flowrl-reward {self.address_string()} {format % args}\n")

    # -- routes
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if urlsplit(self.path).path != "/health":
            self._reject(404, "unknown path; use GET /health or POST /score.", drain=False)
            return
        state = self.server.state
        self._send_json(
            200,
            {
                "status": "ok",
                "reward": state.names,
                "max_batch": state.config.max_batch,
                "max_request_bytes": state.config.max_request_bytes,
                "requests": state.scorer.requests,
                "batches": state.scorer.batches,
            },
        )

    def do_POST(self) -> None:  # noqa: N802
        state = self.server.state
        if urlsplit(self.path).path != "/score":
            self._reject(404, "unknown path; use GET /health or POST /score.")
            return
        if state.token is not None:
            auth = self.headers.get("Authorization", "")
            scheme, _, given = auth.partition(" ")
            given = given.strip() if scheme.lower() == "bearer" else ""
            if not hmac.compare_digest(given.encode("utf-8", "replace"), state.token.encode("utf-8")):
                self._reject(401, "wrong or missing token.", {"WWW-Authenticate": 'Bearer realm="flowrl-reward"'})
                return
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length") is None:
            self._reject(411, "a Content-Length header is required (chunked bodies are refused).")
            return
        try:
            length = int(self.headers["Content-Length"])
            if length < 0:
                raise ValueError
        except ValueError:
            self._reject(400, "the Content-Length header is not a non-negative integer.")
            return
        limit = state.config.max_request_bytes
        if length > limit:
            self._reject(413, f"the request body has {length} bytes, more than this server's limit of {limit}.")
            return
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True  # the client went away mid-body
            return
        try:
            job = decode_request(body, self.headers.get("Content-Type", ""), limit, state.config.max_batch)
        except BadRequest as e:
            self._reject(400, str(e), drain=False)
            return
        del body
        try:
            state.scorer.submit(job)
        except queue.Full:
            self._reject(503, "the reward server is busy; retry later.", drain=False)
            return
        job.done.wait()
        if job.error is not None:
            e = job.error
            if isinstance(e, FlowRLError):
                self._reject(400, str(e), drain=False)
            else:
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
                first = (str(e).splitlines() or [""])[0]
                self._reject(500, f"the reward raised {type(e).__name__}: {first}".rstrip(": ") + ".", drain=False)
            return
        scores, extras = job.result
        self._send_json(200, {"scores": scores, "extras": extras})


@dataclass
class _State:
    config: ServerConfig
    token: str | None
    names: list[str]
    scorer: _Scorer


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    state: _State

    def __init__(self, address, handler, max_connections: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        # Past max_connections a connection is closed at once: a flood cannot spawn unbounded threads.
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):  # a client that gave up: one line, no traceback
            sys.stderr.write(f"flowrl-reward {client_address[0]} connection lost ({type(error).__name__})\n")
        else:
            super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


class RewardServer:
    """An HTTP reward server in this process: ``start()`` serves on background threads, ``stop()`` ends.

    ``reward`` defaults to the weighted sum built from ``config.reward``; pass any object following the
    Reward protocol to serve a reward that is not in flowrl's registry.
    """

    def __init__(self, config: ServerConfig, token: str | None, reward=None) -> None:
        if token is None and not config.allow_no_token:
            raise FlowRLError("the reward server needs a token unless allow_no_token is true.")
        if reward is None:
            from flowrl.reward_models import build_reward_from_config

            reward = build_reward_from_config(config.reward)
        components = getattr(reward, "components", None)
        names = list(components) if isinstance(components, dict) else [str(getattr(reward, "name", "reward"))]
        self.config = config
        self.device = _resolve_device(config.device)
        scorer = _Scorer(reward, self.device, config.max_batch, config.coalesce, config.max_connections)
        try:
            self.httpd = _HTTPServer((config.host, config.port), _Handler, config.max_connections)
        except OSError as e:
            raise FlowRLError(
                f"the reward server could not listen on {config.host}:{config.port} ({e.strerror or e})."
            ) from None
        self.httpd.state = _State(config, token, names, scorer)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> "RewardServer":
        self.httpd.state.scorer.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="flowrl-reward-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.httpd.server_close()
        self.httpd.state.scorer.stop()

    def __enter__(self) -> "RewardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_main(config_path: str, port: int | None = None) -> int:
    """Serve the reward of ``config_path`` until SIGINT/SIGTERM; return 0.

    Prints ``flowrl reward server listening on http://HOST:PORT`` (one line, flushed) on stdout once it
    accepts connections. Configuration problems raise FlowRLError before anything is bound.
    """
    config = load_server_config(config_path)
    if port is not None:
        if not 0 <= port <= 65535:
            raise FlowRLError(f"port {port} is outside 0-65535.")
        config.port = port
    token = resolve_token(config)
    if config.host not in _LOOPBACK:
        print(f"flowrl-reward: warning: serving on {config.host}, reachable from other hosts; the token "
              "travels in clear text unless a TLS proxy sits in front.", file=sys.stderr)
    server = RewardServer(config, token)
    stop = threading.Event()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
        except ValueError:  # not the main thread: stop with KeyboardInterrupt only
            pass
    try:
        server.start()
        print(f"flowrl reward server listening on {server.url}", flush=True)
        weights = ", ".join(f"{k} x {v:g}" for k, v in config.reward.components.items())
        print(f"flowrl-reward: scoring {weights} on {server.device}; stop with Ctrl+C.", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


serve = serve_main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flowrl.reward_models.server",
                                description="Serve a flowrl reward over HTTP (see docs/reward_server.md).")
    p.add_argument("config", help="server YAML: reward, host, port, token_env, limits")
    p.add_argument("--port", type=int, default=None, help="override the config's port (0: pick a free one)")
    args = p.parse_args(argv)
    try:
        return serve_main(args.config, args.port)
    except FlowRLError as e:
        print(f"flowrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
