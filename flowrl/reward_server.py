"""A reward server: run heavy reward models in another process (or on another host) and score over HTTP.

    FLOWRL_REWARD_TOKEN=... flowrl serve-reward server.yaml
    FLOWRL_REWARD_TOKEN=... python -m flowrl.reward_server server.yaml [--port N]

The client is ``flowrl.reward_models.remote.RemoteReward`` (reward name ``remote``). Wire format, see
docs/reward_server.md:

* ``POST /score`` with ``Authorization: Bearer <token>`` and a ``Content-Length``; the body is either an
  NPZ archive (``samples``: float32 in [0, 1] or uint8 in [0, 255], (B, C, H, W) or (B, C, T, H, W);
  ``meta``: a 0-d unicode array holding the JSON ``{"prompts": [...], "metadata": [...]}``), or a JSON
  object ``{"images": [base64 PNG, ...], "prompts": [...], "metadata": [...]}`` sent as
  ``application/json``. Nothing is ever unpickled: NPZ members are read with ``allow_pickle=False``
  after their headers were checked to hold plain float32/uint8/unicode arrays.
* ``200 {"scores": [...], "extras": {name: [...]}}``; NaN is ``null`` and +-inf is ``"inf"``/``"-inf"``.
* Errors answer ``{"error": "<one sentence>"}`` with 400 (malformed request, float32 samples outside [0, 1]),
  401 (token), 404, 411 (no Content-Length), 413 (body over ``max_request_bytes``), 500 (the reward raised)
  or 503 with ``Retry-After`` (every connection slot or the scoring queue is full).
* ``GET /health`` (no token needed) answers ``{"status": "ok", "reward": [component names], ...}``.

One model serves many connections: HTTP requests are parsed on their own threads, but scoring runs on a
single worker thread, so requests are scored one after another (never concurrently on the model). With
``coalesce: true`` the worker scores all requests waiting in its queue that have the same sample shape
as one batch (up to ``max_batch`` samples) and splits the results; leave it off for rewards whose score
of a sample depends on the rest of its batch.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import queue
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import torch
from pydantic import Field, ValidationError, field_validator

from flowrl.config import RewardConfig, Section, _describe, read_yaml_mapping
from flowrl.errors import FlowRLError
from flowrl.reward_models.wire import BadRequest, _Job, decode_request, encode_list

DEFAULT_TOKEN_ENV = "FLOWRL_REWARD_TOKEN"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_DRAIN_SECONDS = 2.0  # how long a rejected request's unread body is drained before the socket closes
RETRY_AFTER_S = 1  # the Retry-After of a 503: a busy server frees a slot within about one scoring call
_BUSY = "the reward server is busy; retry later."


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
    max_connections: int = Field(64, ge=1)  # open connections at once; more get 503 + Retry-After at once

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
                encode_list(scores[start:end]),
                {k: encode_list(v[start:end]) for k, v in extras.items()},
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
            self._reject(503, _BUSY, {"Retry-After": str(RETRY_AFTER_S)}, drain=False)
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


def _busy_response() -> bytes:
    body = json.dumps({"error": _BUSY}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _Drainer:
    """Closes refused connections only after reading what their client still sends, for at most
    _DRAIN_SECONDS: closing a socket with unread data makes the kernel reset the connection, and the client
    would lose the 503 it was sent. One thread and at most ``limit`` sockets, so a flood stays bounded."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flowrl-reward-drainer", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            full = self._count >= self.limit
            self._count += not full
        if full:
            sock.close()
        else:
            self._incoming.put(sock)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _close(self, selector: selectors.BaseSelector, deadlines: dict, sock: socket.socket) -> None:
        selector.unregister(sock)
        del deadlines[sock]
        sock.close()
        with self._lock:
            self._count -= 1

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        deadlines: dict[socket.socket, float] = {}
        while not self._stop.is_set():
            while True:
                try:
                    sock = self._incoming.get_nowait()
                except queue.Empty:
                    break
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
                deadlines[sock] = time.monotonic() + _DRAIN_SECONDS
            for key, _ in selector.select(timeout=0.05) if deadlines else ():
                try:
                    if key.fileobj.recv(65536):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._close(selector, deadlines, key.fileobj)
            now = time.monotonic()
            for sock in [s for s, t in deadlines.items() if t < now]:
                self._close(selector, deadlines, sock)
            if not deadlines:
                self._stop.wait(0.05)
        for sock in list(deadlines):
            self._close(selector, deadlines, sock)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    state: _State

    def __init__(self, address, handler, max_connections: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self._slots = threading.BoundedSemaphore(max_connections)
        self._drainer = _Drainer()
        super().__init__(address, handler)

    def server_close(self) -> None:
        super().server_close()
        self._drainer.stop()

    def process_request(self, request, client_address) -> None:
        # Past max_connections a connection gets 503 + Retry-After from this (the accepting) thread without a
        # handler thread: a flood cannot spawn unbounded threads, and a client learns to come back later.
        if not self._slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(_busy_response())  # ~200 bytes: fits in an empty socket buffer, never blocks
                request.shutdown(socket.SHUT_WR)
            except OSError:
                request.close()
                return
            self._drainer.add(request)
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
    """"auto": CUDA when present; any other device must exist here (refused in one sentence, not at the first request)."""
    if device != "auto":
        from flowrl.config import resolve_device

        return str(resolve_device(device, key="device"))  # the server config's key
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
    p = argparse.ArgumentParser(prog="python -m flowrl.reward_server",
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
