"""A reward server: run heavy reward models in another process (or on another host) and score over HTTP.

    FLOWRL_REWARD_TOKEN=... flowrl serve-reward server.yaml
    FLOWRL_REWARD_TOKEN=... python -m flowrl.reward_server server.yaml [--port N]

A Starlette app on uvicorn (the ``server`` extra). The client is ``flowrl.reward_models.remote.RemoteReward``
(reward name ``remote``), which needs neither. Wire format, see docs/reward_server.md:

* ``POST /score`` with ``Authorization: Bearer <token>`` and a ``Content-Length``; the body is either an
  NPZ archive (``samples``: float32 in [0, 1] or uint8 in [0, 255], (B, C, H, W) or (B, C, T, H, W);
  ``meta``: a 0-d unicode array holding the JSON ``{"prompts": [...], "metadata": [...]}``), or a JSON
  object ``{"images": [base64 PNG, ...], "prompts": [...], "metadata": [...]}`` sent as
  ``application/json``. Nothing is ever unpickled: NPZ members are read with ``allow_pickle=False``
  after their headers were checked to hold plain float32/uint8/unicode arrays.
* ``200 {"scores": [...], "extras": {name: [...]}}``; NaN is ``null`` and +-inf is ``"inf"``/``"-inf"``.
* Errors answer ``{"error": "<one sentence>"}`` with 400 (malformed request, float32 samples outside [0, 1],
  a sample without metadata the reward needs, or the reward refusing the request's data: a FlowRLError,
  ValueError, TypeError or KeyError raised on it), 401 (token), 404, 408 (the body stalled), 411 (no
  Content-Length), 413 (body over ``max_request_bytes``), 500 (the reward failed otherwise: a crash, out of
  memory; the client retries it) or 503 with ``Retry-After`` (``max_connections`` requests in flight, or the
  scoring queue is full). The client never retries a 4xx.
* ``GET /health`` (no token needed) answers ``{"status": "ok", "reward": [component names], ...}``.

Files: ``config`` (the YAML), ``batcher`` (dynamic batching on the one thread that owns the model),
``app`` (the HTTP routes and their checks), ``server`` (uvicorn, in process or as the command).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flowrl.errors import FlowRLError
from flowrl.reward_server.config import DEFAULT_TOKEN_ENV, ServerConfig, load_server_config, resolve_token
from flowrl.reward_server.server import RewardServer, serve_main

__all__ = ["DEFAULT_TOKEN_ENV", "RewardServer", "ServerConfig", "load_server_config", "main", "resolve_token", "serve", "serve_main"]

serve = serve_main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flowrl.reward_server", description="Serve a flowrl reward over HTTP (see docs/reward_server.md)."
    )
    p.add_argument("config", help="server YAML: reward, host, port, token_env, limits, batching")
    p.add_argument("--port", type=int, default=None, help="override the config's port (0: pick a free one)")
    args = p.parse_args(argv)
    try:
        return serve_main(args.config, args.port)
    except FlowRLError as e:
        print(f"flowrl: error: {e}", file=sys.stderr)
        return 2
