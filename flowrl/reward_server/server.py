"""Running the reward server: uvicorn serving the Starlette app, in this process or as ``flowrl serve-reward``."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time

from flowrl.errors import FlowRLError
from flowrl.reward_server.config import LOOPBACK, ServerConfig, load_server_config, resolve_device, resolve_token

try:  # the server extra; the remote client and the rest of flowrl do without it
    import uvicorn

    from flowrl.reward_server.app import ServerState, build_app
    from flowrl.reward_server.batcher import Batcher
except ImportError as e:  # pragma: no cover - only without flowrl[server]
    _MISSING: str | None = e.name
else:
    _MISSING = None

# Open connections, idle ones included, at which uvicorn itself answers 503 (plain text): a ceiling far
# above max_connections, the scoring requests in flight, which the app answers 503 + Retry-After itself.
CONNECTIONS_PER_SLOT = 4
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
GRACEFUL_S = 10  # on stop, requests in flight get this long to finish


class RewardServer:
    """An HTTP reward server in this process: ``start()`` serves on a background thread, ``stop()`` ends.

    ``reward`` defaults to the weighted sum built from ``config.reward``; pass any object following the
    Reward protocol to serve a reward that is not in flowrl's registry.
    """

    def __init__(self, config: ServerConfig, token: str | None, reward=None) -> None:
        if _MISSING is not None:
            raise FlowRLError(f"the reward server needs {_MISSING}, which is not installed; pip install 'flowrl[server]'.")
        if token is None and not config.allow_no_token:
            raise FlowRLError("the reward server needs a token unless allow_no_token is true.")
        if reward is None:
            from flowrl.reward_models import build_reward_from_config

            reward = build_reward_from_config(config.reward)
        components = getattr(reward, "components", None)
        names = list(components) if isinstance(components, dict) else [str(getattr(reward, "name", "reward"))]
        self.config = config
        self.device = resolve_device(config.device)
        batcher = Batcher(
            reward, self.device, config.max_batch, config.coalesce, config.max_wait_ms / 1000, max_queue=config.max_connections
        )
        from flowrl.reward_models.mix import required_metadata  # the trainer's check of the same declarations

        self.state = ServerState(config, token, names, batcher, required=sorted(required_metadata(reward)))
        # The socket is bound here, not by uvicorn, so that port 0 is resolved and a port in use is one
        # sentence before anything starts.
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((config.host, config.port))
            self.socket.listen(2048)
        except OSError as e:
            self.socket.close()
            raise FlowRLError(f"the reward server could not listen on {config.host}:{config.port} ({e.strerror or e}).") from None
        self._address = self.socket.getsockname()
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(
                build_app(self.state),
                log_config=None,
                access_log=False,
                lifespan="off",
                limit_concurrency=CONNECTIONS_PER_SLOT * config.max_connections,
                timeout_keep_alive=KEEP_ALIVE_S,
                timeout_graceful_shutdown=GRACEFUL_S,
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def url(self) -> str:
        host = self._address[0]
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> RewardServer:
        self.state.batcher.start()
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]}, name="flowrl-reward-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise FlowRLError(f"the reward server on {self.url} did not start.")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.uvicorn.should_exit = True
            self._thread.join(timeout=GRACEFUL_S + 5)
            self._thread = None
        self.socket.close()
        self.state.batcher.stop()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _log_requests() -> None:
    """uvicorn's access and error logs to stderr, one line each (the CLI only; in-process servers stay quiet)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("flowrl-reward %(message)s"))
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if name == "uvicorn.access" else logging.WARNING)
        logger.propagate = False


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
    if config.host not in LOOPBACK:
        print(
            f"flowrl-reward: warning: serving on {config.host}, reachable from other hosts; the token "
            "travels in clear text unless a TLS proxy sits in front.",
            file=sys.stderr,
        )
    server = RewardServer(config, token)
    _log_requests()  # after the server: uvicorn's Config clears the access logger's handlers when built
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
        batching = (
            f"batches of up to {config.max_batch} samples, waiting at most {config.max_wait_ms:g} ms"
            if config.coalesce
            else "one request per reward call"
        )
        print(f"flowrl-reward: scoring {weights} on {server.device} ({batching}); stop with Ctrl+C.", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
