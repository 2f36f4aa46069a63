"""A reward scored by a flowrl reward server in another process or on another host.

    reward:
      components: {remote: 1.0}
      kwargs: {remote: {url: "http://127.0.0.1:8123"}}   # token from $FLOWRL_REWARD_TOKEN

The samples travel as an NPZ archive (never pickle), the prompts and metadata as JSON inside it; see
``flowrl.reward_server`` and docs/reward_server.md for the wire format. Connection errors,
timeouts and 5xx answers (503 "busy" included, after at least its Retry-After) are retried with jittered
exponential backoff for up to ``retry_for`` seconds; 4xx answers (a wrong token, a request the server
refuses) are not, since sending the same request again cannot help.
"""

from __future__ import annotations

import base64
import http.client
import io
import ipaddress
import json
import math
import os
import random
import socket
import ssl
import time
import warnings
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np
import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.reward_models.wire import NPZ_CONTENT_TYPE, decode_value
from flowrl.types import RewardOutput

ENCODINGS = ("float32", "uint8", "png")
MAX_BACKOFF_S = 30.0
MAX_RESPONSE_BYTES = 64 * 2**20
URL_ENV = "FLOWRL_REWARD_URL"


class RewardServerError(FlowRLError):
    """The reward server could not be reached, or refused or garbled an answer (one sentence)."""


class _Retryable(Exception):
    """A failure worth another attempt; the message is the cause as the final error names it."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _jsonable(value: Any) -> Any:
    if isinstance(value, (Tensor, np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(value)




def _retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (the HTTP-date form is not used by flowrl's server: ignored)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


class RemoteReward:
    """Score samples on a flowrl reward server (``flowrl serve-reward``).

    url:         the server, e.g. ``http://127.0.0.1:8123`` (``/score`` is appended); None reads it from
                 the environment variable FLOWRL_REWARD_URL when the reward is first called.
    token:       the shared secret; None reads it from the environment variable ``token_env`` (no
                 Authorization header is sent when neither is set).
    timeout:     seconds each socket operation of one attempt may take.
    retry_for:   seconds from the first attempt during which connection errors, timeouts and 5xx answers
                 are retried; the last attempt starts at the latest then (a server restarting must not end
                 a long run, a dead one must end it in bounded time).
    backoff:     the k-th wait is ``backoff * 2**(k-1)`` seconds (at most 30 s) times a random factor in
                 [0.5, 1.5], so clients that failed together do not come back together; at least the
                 server's Retry-After on a 503.
    retries:     at most this many attempts in all (None: as many as ``retry_for`` allows).
    batch_size:  samples per request (None: the whole batch in one request); keep it at or below the
                 server's ``max_batch`` and the body under its ``max_request_bytes``.
    encoding:    "float32" (NPZ, exact), "uint8" (NPZ, 4x smaller, pixels rounded to 1/255) or "png"
                 (JSON with base64 PNGs, rounded to 1/255; images with 1 or 3 channels only).
    The reward is never differentiable: gradients do not cross the network.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        token_env: str = "FLOWRL_REWARD_TOKEN",
        timeout: float = 60.0,
        retries: int | None = None,
        backoff: float = 1.0,
        retry_for: float = 120.0,
        name: str = "remote",
        differentiable: bool = False,
        batch_size: int | None = None,
        encoding: str = "float32",
    ) -> None:
        if differentiable:
            raise FlowRLError("a remote reward cannot be differentiable: gradients do not cross the network.")
        if retries is not None and not (isinstance(retries, int) and retries >= 1):
            raise FlowRLError(f"remote reward retries must be a positive integer (attempts in all) or null, got {retries!r}.")
        if not (math.isfinite(timeout) and timeout > 0 and math.isfinite(backoff) and backoff >= 0):
            raise FlowRLError(f"remote reward timeout must be positive and backoff non-negative, got {timeout} and {backoff}.")
        if not (isinstance(retry_for, (int, float)) and math.isfinite(retry_for) and retry_for >= 0):
            raise FlowRLError(f"remote reward retry_for must be a non-negative number of seconds, got {retry_for!r}.")
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
            raise FlowRLError(f"remote reward batch_size must be a positive integer or null, got {batch_size!r}.")
        if encoding not in ENCODINGS:
            raise FlowRLError(f"remote reward encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}.")
        self.name = name
        self.differentiable = False
        self.token = token if token is not None else (os.environ.get(token_env) or None)
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.retry_for = float(retry_for)
        self._jitter = random.Random()  # seeded by the OS: processes that failed together must not retry in step
        self.batch_size = batch_size
        self.encoding = encoding
        self.url: str | None = None
        if url is not None:
            self._set_url(url)

    def _set_url(self, url: str) -> None:
        parts = urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FlowRLError(f"reward server url '{url}' must look like http://HOST:PORT.")
        try:
            port = parts.port
        except ValueError:
            raise FlowRLError(f"reward server url '{url}' has an invalid port.") from None
        if parts.query or parts.fragment or parts.username or parts.password:
            raise FlowRLError(f"reward server url '{url}' must not carry a query, fragment or user name.")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = port or (443 if parts.scheme == "https" else 80)
        base = parts.path.rstrip("/")
        self.path = (base if base.endswith("/score") else base + "/score") or "/score"
        self.url = f"{parts.scheme}://{parts.netloc}{base.removesuffix('/score')}"
        if self.token and self.scheme == "http" and not _is_loopback(self.host):
            warnings.warn(
                f"the reward server token is sent in clear text to {self.url}; use https (a TLS proxy) "
                "or an SSH tunnel outside a trusted network.",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ encoding
    def _encode(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> tuple[bytes, str]:
        meta = {"prompts": [str(p) for p in prompts], "metadata": [dict(m) for m in metadata]}
        x = samples.detach().to("cpu", torch.float32).contiguous()
        if self.encoding == "png":
            from PIL import Image

            if x.ndim != 4 or x.shape[1] not in (1, 3):
                raise FlowRLError(
                    f"the png encoding sends (B, 1 or 3, H, W) images, got shape {tuple(x.shape)}; use float32."
                )
            pixels = (x * 255).round().clamp(0, 255).to(torch.uint8).numpy().transpose(0, 2, 3, 1)
            images = []
            for image in pixels:
                buffer = io.BytesIO()
                Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(buffer, format="PNG")
                images.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
            return self._json(dict(meta, images=images)).encode(), "application/json"
        if self.encoding == "uint8":
            array = (x * 255).round().clamp(0, 255).to(torch.uint8).numpy()
        else:
            array = x.numpy()
        buffer = io.BytesIO()
        np.savez(buffer, samples=array, meta=np.array(self._json(meta)))
        return buffer.getvalue(), NPZ_CONTENT_TYPE

    @staticmethod
    def _json(obj: Any) -> str:
        try:
            return json.dumps(obj, default=_jsonable)
        except (TypeError, ValueError) as e:
            bad = e.args[0] if e.args and not isinstance(e.args[0], str) else None
            what = f"a value of type {type(bad).__name__}" if bad is not None else "a value"
            raise FlowRLError(f"the metadata holds {what} that cannot be sent to the reward server as JSON.") from None

    # ------------------------------------------------------------------ transport
    def _attempt(self, body: bytes, content_type: str) -> tuple[int, bytes, float | None]:
        if self.scheme == "https":
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            try:
                conn.request("POST", self.path, body=body, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                # The server may have refused the body early (401, 413) and closed; its answer is
                # usually still readable.
                if conn.sock is None:
                    raise
            response = conn.getresponse()
            data = response.read(MAX_RESPONSE_BYTES + 1)
            return response.status, data, _retry_after(response.getheader("Retry-After"))
        finally:
            conn.close()

    def _wait(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before attempt ``attempt + 1``: jittered exponential backoff, at least the server's Retry-After."""
        wait = min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF_S) * self._jitter.uniform(0.5, 1.5)
        if retry_after is not None:
            wait = max(wait, min(retry_after, MAX_BACKOFF_S) * self._jitter.uniform(1.0, 1.2))
        return wait

    def _post(self, body: bytes, content_type: str) -> dict:
        cause, attempt, start, retry_after = "", 0, time.monotonic(), None
        while True:
            if attempt:
                if self.retries is not None and attempt >= self.retries:
                    break
                left = self.retry_for - (time.monotonic() - start)
                if left <= 0:
                    break
                time.sleep(min(self._wait(attempt, retry_after), left))  # the last attempt starts at retry_for
            attempt += 1
            retry_after = None
            try:
                status, data, retry_after = self._attempt(body, content_type)
            except ssl.SSLError as e:
                raise RewardServerError(f"reward server {self.url} failed the TLS handshake ({e.reason or e}).") from None
            except ConnectionRefusedError:
                cause = "connection refused"
                continue
            except (socket.timeout, TimeoutError):
                cause = f"timed out after {self.timeout:g} s"
                continue
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                cause = "connection closed without an answer"
                continue
            except socket.gaierror as e:
                cause = f"host not found: {e.strerror or e}"
                continue
            except (OSError, http.client.HTTPException) as e:
                cause = (getattr(e, "strerror", None) or str(e) or type(e).__name__).rstrip(".")
                continue
            message = self._error_message(data)
            if status >= 500:
                cause = f"HTTP {status}: {message}" if message else f"HTTP {status}"
                continue
            if status != 200:
                raise RewardServerError(
                    f"reward server {self.url} refused the request (HTTP {status}"
                    + (f": {message}" if message else "") + ")."
                )
            if len(data) > MAX_RESPONSE_BYTES:
                raise RewardServerError(f"reward server {self.url} sent an answer over {MAX_RESPONSE_BYTES} bytes.")
            try:
                return json.loads(data)
            except (ValueError, RecursionError):
                raise RewardServerError(f"reward server {self.url} sent an answer that is not JSON.") from None
        raise RewardServerError(f"reward server {self.url} did not answer after {attempt} attempt{'s' * (attempt != 1)} ({cause}).")

    @staticmethod
    def _error_message(data: bytes) -> str:
        try:
            message = json.loads(data).get("error", "")
        except (ValueError, AttributeError, RecursionError):
            return ""
        return " ".join(str(message).split()).rstrip(".")[:300]

    # ------------------------------------------------------------------ the Reward protocol
    def _score_chunk(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]):
        body, content_type = self._encode(samples, prompts, metadata)
        answer = self._post(body, content_type)
        n = samples.shape[0]
        try:
            scores = [decode_value(v) for v in answer["scores"]]
            extras = {str(k): [decode_value(v) for v in vals] for k, vals in (answer.get("extras") or {}).items()}
            if len(scores) != n or any(len(v) != n for v in extras.values()):
                raise ValueError(f"{len(scores)} scores for {n} samples")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RewardServerError(f"reward server {self.url} sent an unreadable answer ({e}).") from None
        return scores, extras

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        if self.url is None:
            url = os.environ.get(URL_ENV)
            if not url:
                raise FlowRLError(f"the remote reward has no url; set reward.kwargs.{self.name}.url or {URL_ENV}.")
            self._set_url(url)
        n = samples.shape[0]
        if samples.ndim not in (4, 5):
            raise FlowRLError(f"a remote reward sends (B, C, H, W) images or (B, C, T, H, W) videos, got shape {tuple(samples.shape)}.")
        if len(prompts) != n or len(metadata) != n:
            raise FlowRLError(f"a remote reward got {n} samples but {len(prompts)} prompts and {len(metadata)} metadata entries.")
        # The server refuses non-finite float samples (it validates [0, 1]); such a sample (a diverged rollout)
        # scores NaN without being sent, as an in-process reward would score it, and is dropped by the trainer.
        finite = torch.isfinite(samples.detach().reshape(n, -1)).all(dim=1).cpu() if n else torch.ones(0, dtype=torch.bool)
        rows = finite.nonzero().flatten().tolist()
        scores: list[float] = []
        extras: dict[str, list[float]] | None = None
        step = self.batch_size or max(len(rows), 1)
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            chunk_scores, chunk_extras = self._score_chunk(samples[chunk], [prompts[i] for i in chunk], [metadata[i] for i in chunk])
            scores += chunk_scores
            if extras is None:
                extras = chunk_extras
            else:  # keep the extras every chunk reported
                extras = {k: v + chunk_extras[k] for k, v in extras.items() if k in chunk_extras}
        device = samples.device

        def spread(values: list[float]) -> Tensor:
            out = torch.full((n,), math.nan, dtype=torch.float32)
            out[finite] = torch.tensor(values, dtype=torch.float32)
            return out.to(device)

        return RewardOutput(scores=spread(scores), extras={k: spread(v) for k, v in (extras or {}).items()})
