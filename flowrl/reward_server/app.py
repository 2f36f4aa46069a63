"""The reward server's HTTP side: a Starlette ASGI app with ``POST /score`` and ``GET /health``.

Every check that needs no body comes before a byte of it is read: the token (401), a Content-Length
(411), the size limit (413) and the number of scoring requests in flight (503 + Retry-After). The body is
read with a deadline, decoded on a worker thread (``wire.decode_request``: NPZ or PNG, never pickle), and
queued on the ``Batcher``; the event loop only waits for it, so any number of clients can wait at once.
Every refusal is ``{"error": "<one sentence>"}``.

What the client caused is 4xx, never retried: a malformed body (``BadRequest``), a sample whose metadata
lacks a key the reward declares in ``required_metadata`` (checked before the request is queued), and an
error the reward raises on the request's own data (``CLIENT_ERRORS``: FlowRLError, ValueError, TypeError,
KeyError; the batcher scores a failing merged batch again request by request, so the error is the
request's own). Anything else the reward raises (RuntimeError, a CUDA out-of-memory, MemoryError) is the
server's: 500, which the client retries.
"""

from __future__ import annotations

import asyncio
import hmac
import queue
import sys
import traceback
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flowrl.errors import FlowRLError
from flowrl.reward_models.wire import BadRequest, _Job, decode_request
from flowrl.reward_server.batcher import Batcher
from flowrl.reward_server.config import ServerConfig

# What a reward raises on a request's own data (a metadata value of the wrong type, a sample shape it cannot
# read): answered 400, since sending the same request again cannot help. Everything else is answered 500.
CLIENT_ERRORS = (FlowRLError, ValueError, TypeError, KeyError)

RETRY_AFTER_S = 1  # the Retry-After of a 503: a busy server frees a slot within about one scoring call
BUSY = "the reward server is busy; retry later."
BODY_TIMEOUT_S = 60.0  # a stalled client cannot hold a request slot forever
DRAIN_S = 2.0  # how long a refused request's unread body is read and dropped before answering
_UNKNOWN = "unknown path; use GET /health or POST /score."


@dataclass
class ServerState:
    config: ServerConfig
    token: str | None
    names: list[str]  # the reward's component names, reported by /health
    batcher: Batcher
    # (reward name, metadata key) pairs the reward needs in every sample's metadata (its components' and
    # wrappers' ``required_metadata``, components weighted 0 left out, as the trainer checks them)
    required: list[tuple[str, str]] = field(default_factory=list)
    in_flight: int = 0  # POST /score requests being read, decoded, queued or scored


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _drain(request: Request) -> None:
    """Read and drop what the client is still sending, for at most DRAIN_S: answering with the body unread
    makes the server close a socket that holds unread data, the kernel then resets the connection, and a
    client still sending would lose the answer."""

    async def consume() -> None:
        async for _ in request.stream():
            pass

    try:
        await asyncio.wait_for(consume(), DRAIN_S)
    except (asyncio.TimeoutError, ClientDisconnect):
        pass


def _token_ok(state: ServerState, header: str) -> bool:
    if state.token is None:
        return True
    scheme, _, given = header.partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(given.encode("utf-8", "replace"), state.token.encode("utf-8"))


async def _read_body(request: Request, length: int) -> bytes | None:
    """The body of exactly ``length`` bytes, or None when the client went away or stalled."""
    chunks: list[bytes] = []

    async def read() -> None:
        async for chunk in request.stream():
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except (asyncio.TimeoutError, ClientDisconnect):
        return None
    body = b"".join(chunks)
    return body if len(body) == length else None


def missing_metadata(required: list[tuple[str, str]], metadata: list[dict]) -> str | None:
    """The sentence refusing the first sample whose metadata lacks (or nulls) a key the reward needs, or None."""
    for reward_name, key in required:
        for i, m in enumerate(metadata):
            if m.get(key) is None:
                return (
                    f"sample {i} has no '{key}' in its metadata, which reward '{reward_name}' needs to score it; "
                    f"send a '{key}' with every sample."
                )
    return None


def error_answer(e: BaseException) -> JSONResponse:
    """What the reward raised while scoring one request, as the client's 400 or the server's 500."""
    first = " ".join((str(e).splitlines() or [""])[0].split())
    if isinstance(e, FlowRLError):  # the reward's own sentence
        return _error(400, first or "the reward refused this request.")
    if isinstance(e, CLIENT_ERRORS):
        reason = f"{type(e).__name__}: {first}".rstrip(": .")
        return _error(400, f"the reward could not score this request's data ({reason}).")
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return _error(500, f"the reward raised {type(e).__name__}: {first}".rstrip(": .") + ".")


async def _score(state: ServerState, request: Request, length: int) -> Response:
    body = await _read_body(request, length)
    if body is None:
        return _error(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s.")
    config = state.config
    try:
        job: _Job = await run_in_threadpool(
            decode_request, body, request.headers.get("content-type", ""), config.max_request_bytes, config.max_batch
        )
    except BadRequest as e:
        return _error(400, str(e))
    del body
    missing = missing_metadata(state.required, job.metadata)
    if missing is not None:
        return _error(400, missing)
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def finished() -> None:  # on the batcher's thread
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    job.on_done = finished
    try:
        state.batcher.submit(job)
    except queue.Full:
        return _error(503, BUSY, {"Retry-After": str(RETRY_AFTER_S)})
    await done
    if job.error is not None:
        return error_answer(job.error)
    scores, extras = job.result
    return JSONResponse({"scores": scores, "extras": extras})


def _refusal(state: ServerState, headers: Headers) -> tuple[Response | None, int]:
    """What answers a POST /score before a byte of its body is read (the token, a Content-Length, the size limit, the
    requests in flight), or None when it may be read; and its Content-Length (-1 when it has none or a bad one)."""
    if not _token_ok(state, headers.get("authorization", "")):
        return _error(401, "wrong or missing token.", {"WWW-Authenticate": 'Bearer realm="flowrl-reward"'}), -1
    if "transfer-encoding" in headers or "content-length" not in headers:
        return _error(411, "a Content-Length header is required (chunked bodies are refused)."), -1
    length = int(headers["content-length"]) if headers["content-length"].isdigit() else -1
    limit = state.config.max_request_bytes
    if length < 0:
        return _error(400, "the Content-Length header is not a non-negative integer."), length
    if length > limit:
        return _error(413, f"the request body has {length} bytes, more than this server's limit of {limit}."), length
    if state.in_flight >= state.config.max_connections:
        return _error(503, BUSY, {"Retry-After": str(RETRY_AFTER_S)}), length
    return None, length


def build_app(state: ServerState) -> Starlette:
    """The ASGI app serving ``state``'s reward."""

    async def health(request: Request) -> Response:
        batcher = state.batcher
        return JSONResponse(
            {
                "status": "ok",
                "reward": state.names,
                "max_batch": state.config.max_batch,
                "max_request_bytes": state.config.max_request_bytes,
                "coalesce": batcher.coalesce,
                "max_wait_ms": state.config.max_wait_ms,
                "requests": batcher.requests,
                "batches": batcher.batches,
                "samples": batcher.samples,
                "queued": batcher.queue.qsize(),
                "in_flight": state.in_flight,
            }
        )

    async def score(request: Request) -> Response:
        refusal, length = _refusal(state, request.headers)
        if refusal is not None:
            await _drain(request)
            return refusal
        state.in_flight += 1  # the event loop is one thread: no lock needed
        try:
            return await _score(state, request, length)
        finally:
            state.in_flight -= 1

    async def unknown(request: Request, exc: HTTPException) -> Response:
        await _drain(request)
        if exc.status_code in (404, 405):  # a wrong method is a wrong path: there are only two routes
            return _error(404, _UNKNOWN)
        return _error(exc.status_code, f"{exc.detail}.")

    return Starlette(
        routes=[Route("/health", health, methods=["GET"]), Route("/score", score, methods=["POST"])],
        exception_handlers={HTTPException: unknown},
    )
