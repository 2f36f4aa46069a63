"""One HTTP POST to a scoring server, with the standard library only: what the reward-server client (remote.py)
and the VLM-judge client (openai_judge.py) share. Each keeps its own retry policy and wire format; here is the
part that must not differ between them: parsing a server URL, one attempt with its timeout, and naming why an
attempt failed in a few words (the final one-sentence error quotes it)."""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import socket
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flowrl.errors import FlowRLError

MAX_RESPONSE_BYTES = 64 * 2**20
MAX_BACKOFF_S = 30.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Endpoint:
    """Where requests go: ``path`` is the route POSTed to, ``url`` the server as errors name it."""

    scheme: str
    host: str
    port: int
    path: str
    url: str
    down_until: float = 0.0  # time.monotonic() before which a replica that failed is tried last (remote.py)


def parse_server_url(url: str, what: str, example: str, route: str, default_base: str = "") -> Endpoint:
    """``http(s)://HOST[:PORT][/BASE]`` with ``route`` appended to the base (a URL that already ends in it keeps it;
    an empty base reads as ``default_base``). ``what`` names the setting in the errors, ``example`` its form."""
    parts = urlsplit(str(url).strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FlowRLError(f"{what} '{url}' must look like {example}.")
    try:
        port = parts.port
    except ValueError:
        raise FlowRLError(f"{what} '{url}' has an invalid port.") from None
    if parts.query or parts.fragment or parts.username or parts.password:
        raise FlowRLError(f"{what} '{url}' must not carry a query, fragment or user name.")
    base = parts.path.rstrip("/").removesuffix(route) or default_base
    return Endpoint(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port or (443 if parts.scheme == "https" else 80),
        path=base + route,
        url=f"{parts.scheme}://{parts.netloc}{base}",
    )


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds (the HTTP-date form is not used by the servers flowrl talks to: ignored)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


def backoff_seconds(attempt: int, backoff: float, retry_after: float | None, jitter) -> float:
    """The wait before attempt ``attempt + 1``: ``backoff * 2**(attempt-1)`` (at most 30 s) times a random factor in
    [0.5, 1.5], so clients that failed together do not come back together; at least the server's Retry-After."""
    wait = min(backoff * 2 ** (attempt - 1), MAX_BACKOFF_S) * jitter.uniform(0.5, 1.5)
    if retry_after is not None:
        wait = max(wait, min(retry_after, MAX_BACKOFF_S) * jitter.uniform(1.0, 1.2))
    return wait


def post(
    endpoint: Endpoint, body: bytes, content_type: str, timeout: float, token: str | None, max_bytes: int = MAX_RESPONSE_BYTES
) -> tuple[int, bytes, float | None]:
    """One POST: (status, at most ``max_bytes`` + 1 bytes of the answer, Retry-After seconds); raises what the
    connection raises (:func:`failure_cause` names it)."""
    if endpoint.scheme == "https":
        conn = http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=timeout, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
    headers = {"Content-Type": content_type, "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        try:
            conn.request("POST", endpoint.path, body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            # The server may have refused the body early (401, 413) and closed; its answer is usually still readable.
            if conn.sock is None:
                raise
        response = conn.getresponse()
        data = response.read(max_bytes + 1)
        return response.status, data, retry_after_seconds(response.getheader("Retry-After"))
    finally:
        conn.close()


def failure_cause(error: Exception, timeout: float, server: str, url: str, error_class: type[FlowRLError]) -> str:
    """Why an attempt failed, in a few words, for an error that another attempt may not have (a refused connection,
    a timeout); a failed TLS handshake, which no retry mends, raises ``error_class`` at once."""
    if isinstance(error, ssl.SSLError):
        raise error_class(f"{server} {url} failed the TLS handshake ({error.reason or error}).") from None
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return f"timed out after {timeout:g} s"
    if isinstance(error, (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)):
        return "connection closed without an answer"
    if isinstance(error, socket.gaierror):
        return f"host not found: {error.strerror or error}"
    return (getattr(error, "strerror", None) or str(error) or type(error).__name__).rstrip(".")


def json_answer(data: bytes, server: str, url: str, error_class: type[FlowRLError], max_bytes: int = MAX_RESPONSE_BYTES) -> Any:
    """A server's answer read by :func:`post` as JSON; one over ``max_bytes`` (post's limit) or not JSON raises
    ``error_class`` naming the server (another attempt would not mend it)."""
    if len(data) > max_bytes:
        raise error_class(f"{server} {url} sent an answer over {max_bytes} bytes.")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise error_class(f"{server} {url} sent an answer that is not JSON.") from None


TRANSPORT_ERRORS = (OSError, http.client.HTTPException)  # what post() raises that failure_cause names
