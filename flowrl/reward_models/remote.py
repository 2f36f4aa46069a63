"""A reward scored by a flowrl reward server in another process or on another host.

    reward:
      components: {remote: 1.0}
      kwargs: {remote: {url: "http://127.0.0.1:8123"}}   # token from $FLOWRL_REWARD_TOKEN

The samples travel as an NPZ archive (never pickle), the prompts and metadata as JSON inside it; see
``flowrl.reward_server`` and docs/reward_server.md for the wire format. Connection errors,
timeouts and 5xx answers (503 "busy" included, after at least its Retry-After) are retried with jittered
exponential backoff for up to ``retry_for`` seconds; 4xx answers (a wrong token, a request the server
refuses) are not, since sending the same request again cannot help. With several URLs (replicas of one
server) requests go round-robin, chunks of one batch go to different replicas at once, and a failed
attempt moves on to the next replica at once; the backoff waits only after every replica has failed.
Only the standard library: a training process needs no HTTP package.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.reward_models.http_post import (
    TRANSPORT_ERRORS,
    Endpoint,
    backoff_seconds,
    failure_cause,
    is_loopback,
    json_answer,
    parse_server_url,
    post,
)
from flowrl.reward_models.wire import NPZ_CONTENT_TYPE, decode_value
from flowrl.types import RewardOutput

ENCODINGS = ("float32", "uint8", "png")
URL_ENV = "FLOWRL_REWARD_URL"
DOWN_S = 10.0  # a replica that failed is tried after the others for this long


class RewardServerError(FlowRLError):
    """The reward server could not be reached, or refused or garbled an answer (one sentence)."""


class _Retryable(Exception):
    """A failure worth another attempt; the message is the cause as the final error names it."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, (Tensor, np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(value)


def parse_endpoint(url: str) -> Endpoint:
    """A replica's URL: ``/score`` is appended unless it is there."""
    return parse_server_url(url, "reward server url", "http://HOST:PORT", "/score")


class RemoteReward:
    """Score samples on a flowrl reward server (``flowrl serve-reward``).

    Args:
        url:         the server, e.g. ``http://127.0.0.1:8123`` (``/score`` is appended), or several replicas as a
                     list or a comma-separated string; None reads it from the environment variable
                     FLOWRL_REWARD_URL (comma-separated for several) when the reward is first called.
        token:       the shared secret; None reads it from the environment variable ``token_env`` (no
                     Authorization header is sent when neither is set).
        token_env:   the environment variable holding the shared secret when token is None.
        timeout:     seconds each socket operation of one attempt may take.
        retry_for:   seconds from the first attempt during which connection errors, timeouts and 5xx answers
                     are retried (on the next replica at once, when there are several); the last attempt starts
                     at the latest then (a server restarting must not end a long run, a dead one must end it in
                     bounded time).
        backoff:     after the k-th round in which every replica failed (with one server: the k-th failure), the
                     wait is ``backoff * 2**(k-1)`` seconds (at most 30 s) times a random factor in [0.5, 1.5],
                     so clients that failed together do not come back together; at least the server's
                     Retry-After on a 503.
        retries:     at most this many attempts in all (None: as many as ``retry_for`` allows).
        batch_size:  samples per request (None: the whole batch in one request); keep it at or below the
                     server's ``max_batch`` and the body under its ``max_request_bytes``. With several replicas
                     the chunks are scored on them at the same time.
        encoding:    "float32" (NPZ, exact), "uint8" (NPZ, 4x smaller, pixels rounded to 1/255) or "png"
                     (JSON with base64 PNGs, rounded to 1/255; images with 1 or 3 channels only).
        name:        the component's name in logs and errors.
        differentiable: must stay false: the reward is never differentiable, gradients do not cross the network.
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
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
        self.endpoints: list[Endpoint] = []
        self._turn = 0  # round-robin: the replica the next request starts on
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        if url is not None:
            self._set_urls(url)

    @property
    def url(self) -> str | None:
        """The server's URL, or the replicas' URLs joined by ", " (as the errors name them)."""
        return ", ".join(e.url for e in self.endpoints) or None

    def _set_urls(self, url: str | Sequence[str]) -> None:
        urls = [u for u in (url.split(",") if isinstance(url, str) else list(url)) if str(u).strip()]
        if not urls:
            raise FlowRLError("the remote reward's url list is empty.")
        self.endpoints = [parse_endpoint(u) for u in urls]
        exposed = [e.url for e in self.endpoints if e.scheme == "http" and not is_loopback(e.host)]
        if self.token and exposed:
            warnings.warn(
                f"the reward server token is sent in clear text to {', '.join(exposed)}; use https (a TLS proxy) "
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
                raise FlowRLError(f"the png encoding sends (B, 1 or 3, H, W) images, got shape {tuple(x.shape)}; use float32.")
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
    def _order(self) -> list[Endpoint]:
        """This request's replicas in the order to try them: round-robin, the ones that failed lately last."""
        with self._lock:
            start = self._turn
            self._turn += 1
        n, now = len(self.endpoints), time.monotonic()
        ranked = sorted(range(n), key=lambda i: (self.endpoints[i].down_until > now, (i - start) % n))
        return [self.endpoints[i] for i in ranked]

    def _post(self, body: bytes, content_type: str) -> dict:
        cause, attempt, start, retry_after = "", 0, time.monotonic(), None
        order = self._order()
        n = len(order)
        while attempt == 0 or self._wait_before(attempt, n, start, retry_after):
            if attempt and attempt % n == 0:
                retry_after = None  # the round's Retry-After has been waited for
            endpoint = order[attempt % n]
            attempt += 1
            failure, status, data, answer_retry_after = self._attempt(endpoint, body, content_type)
            if failure is None:
                endpoint.down_until = 0.0
                return self._answer(endpoint, status, data)
            if answer_retry_after is not None:
                retry_after = max(retry_after or 0.0, answer_retry_after)
            endpoint.down_until = time.monotonic() + DOWN_S
            cause = failure if n == 1 else f"{endpoint.url}: {failure}"
        servers = f"reward server {self.url}" if n == 1 else f"reward servers {self.url}"
        raise RewardServerError(f"{servers} did not answer after {attempt} attempt{'s' * (attempt != 1)} ({cause}).")

    def _wait_before(self, attempt: int, n: int, start: float, retry_after: float | None) -> bool:
        """Whether attempt ``attempt + 1`` may start (``retries`` and ``retry_for`` not spent); when each of the ``n``
        replicas failed this round, it backs off first (the last attempt starts at ``retry_for`` at the latest)."""
        if self.retries is not None and attempt >= self.retries:
            return False
        left = self.retry_for - (time.monotonic() - start)
        if left <= 0:
            return False
        if attempt == n:  # every replica failed once: a person watching a silent run should know why it waits
            servers = f"reward server {self.url} is" if n == 1 else f"reward servers {self.url} are"
            limit = f"at most {self.retries - attempt} more attempt(s) " if self.retries is not None else ""
            print(
                f"flowrl: {servers} not answering; retrying, {limit}for up to {left:.0f} s more (retry_for).",
                file=sys.stderr,
                flush=True,
            )
        if attempt % n == 0:
            time.sleep(min(backoff_seconds(attempt // n, self.backoff, retry_after, self._jitter), left))
        return True

    def _attempt(self, endpoint: Endpoint, body: bytes, content_type: str) -> tuple[str | None, int, bytes, float | None]:
        """One attempt: (why it is worth another, or None: an answer to read), status, payload, and the server's
        Retry-After when it failed with a 5xx."""
        try:
            status, data, retry_after = post(endpoint, body, content_type, self.timeout, self.token)
        except TRANSPORT_ERRORS as e:
            return failure_cause(e, self.timeout, "reward server", endpoint.url, RewardServerError), 0, b"", None
        if status >= 500:
            message = self._error_message(data)
            return (f"HTTP {status}: {message}" if message else f"HTTP {status}"), status, data, retry_after
        return None, status, data, None

    def _answer(self, endpoint: Endpoint, status: int, data: bytes) -> dict:
        """The server's answer to a request it did not fail on: its JSON, or one sentence why there is none."""
        if status != 200:
            message = self._error_message(data)
            raise RewardServerError(
                f"reward server {endpoint.url} refused the request (HTTP {status}" + (f": {message}" if message else "") + ")."
            )
        return json_answer(data, "reward server", endpoint.url, RewardServerError)

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

    def _check_call(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> None:
        """The url (read from FLOWRL_REWARD_URL on the first call when none was given) and the batch's shapes."""
        if not self.endpoints:
            url = os.environ.get(URL_ENV)
            if not url:
                raise FlowRLError(f"the remote reward has no url; set reward.kwargs.{self.name}.url or {URL_ENV}.")
            self._set_urls(url)
        n = samples.shape[0]
        if samples.ndim not in (4, 5):
            raise FlowRLError(f"a remote reward sends (B, C, H, W) images or (B, C, T, H, W) videos, got shape {tuple(samples.shape)}.")
        if len(prompts) != n or len(metadata) != n:
            raise FlowRLError(f"a remote reward got {n} samples but {len(prompts)} prompts and {len(metadata)} metadata entries.")

    def _score_chunks(self, score: Callable[[list[int]], Any], chunks: list[list[int]]) -> list[Any]:
        """Every chunk's answer, in order: one chunk per replica at a time when there are several."""
        if len(self.endpoints) > 1 and len(chunks) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(len(self.endpoints), thread_name_prefix="flowrl-remote-reward")
            return list(self._pool.map(score, chunks))
        return [score(chunk) for chunk in chunks]

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        self._check_call(samples, prompts, metadata)
        n = samples.shape[0]
        # The server refuses non-finite float samples (it validates [0, 1]); such a sample (a diverged rollout)
        # scores NaN without being sent, as an in-process reward would score it, and is dropped by the trainer.
        finite = torch.isfinite(samples.detach().reshape(n, -1)).all(dim=1).cpu() if n else torch.ones(0, dtype=torch.bool)
        rows = finite.nonzero().flatten().tolist()
        step = self.batch_size or max(len(rows), 1)
        chunks = [rows[start : start + step] for start in range(0, len(rows), step)]

        def score(chunk: list[int]):
            return self._score_chunk(samples[chunk], [prompts[i] for i in chunk], [metadata[i] for i in chunk])

        scores: list[float] = []
        extras: dict[str, list[float]] | None = None
        for chunk_scores, chunk_extras in self._score_chunks(score, chunks):
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
