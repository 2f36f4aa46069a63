"""``flowrl label DIR``: a local web page on which a person orders the pairs of a pairs directory.

The page (flowrl/assets/label/) shows a pair's two samples side by side with the prompt; left / right /
tie / skip are buttons and keys; undo withdraws the last label. Every click is one record appended to
``DIR/labels.jsonl`` and fsynced before the page is told it was saved (flowrl/preferences/labels.py), so a
restart continues at the first unlabelled pair and loses nothing.

Security: the server binds to loopback unless told otherwise, and there it accepts only requests whose Host
is a loopback name (a web page elsewhere cannot reach it through DNS rebinding). On any other address every
request needs the access token (FLOWRL_LABEL_TOKEN, or a random one printed in the address; the page keeps
it in a SameSite=Strict cookie). Requests that change labels must be JSON, which a cross-site form cannot send.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FlowRLError
from .labels import CHOICES, LabelLog, left_slot, preferred_slot
from .pairs import SLOTS, image_path, read_pair_prompts

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "label"
TOKEN_ENV = "FLOWRL_LABEL_TOKEN"
TOKEN_HEADER = "x-flowrl-token"
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; img-src 'self'; frame-ancestors 'none'",
}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class LabelSession:
    """One pairs directory being labelled: its pairs, which images are missing, and the open label log."""

    directory: Path
    prompts: list[str]
    missing: dict[int, list[str]]  # pair -> its missing image files, relative to the directory
    log: LabelLog

    @classmethod
    def open(cls, directory: str | Path) -> LabelSession:
        directory = Path(directory)
        prompts = read_pair_prompts(directory)
        if not (directory / "images").is_dir():
            raise FlowRLError(
                f"'{directory}' has no images/ folder, so there is nothing to show; build the pairs again with "
                "python -m flowrl.preferences.pairs, which writes one."
            )
        missing: dict[int, list[str]] = {}
        for i in range(len(prompts)):
            gone = [
                image_path(directory, i, s).relative_to(directory).as_posix() for s in SLOTS if not image_path(directory, i, s).is_file()
            ]
            if gone:
                missing[i] = gone
        return cls(directory, prompts, missing, LabelLog(directory, len(prompts)))

    # -- what the page shows ------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        state = self.log.state
        last = state.by_seq[state.history[-1]] if state.history else None
        return {
            **state.counts(),
            "missing_images": len(self.missing),
            "last": {k: last[k] for k in ("seq", "pair", "choice")} if last else None,
        }

    def pair_view(self, pair: int | None) -> dict[str, Any] | None:
        if pair is None:
            return None
        left = left_slot(pair)
        sides = {"left": left, "right": SLOTS[1 - SLOTS.index(left)]}
        label = self.log.state.labels.get(pair)
        return {
            "pair": pair,
            "prompt": self.prompts[pair],
            "missing": self.missing.get(pair, []),
            "label": label["choice"] if label else None,
            **{side: f"/image/{pair}/{slot}.png" for side, slot in sides.items()},
        }

    def answer(self, current: int | None, **extra: Any) -> dict[str, Any]:
        return {"progress": self.progress(), "current": self.pair_view(current), **extra}

    # -- what a click does --------------------------------------------------------------------------
    def label(self, pair: Any, choice: Any) -> tuple[int, dict[str, Any]]:
        """(HTTP status, answer) for a click; a refused click changes nothing and says why in one sentence."""
        state = self.log.state
        if not isinstance(pair, int) or isinstance(pair, bool) or not 0 <= pair < state.total or choice not in CHOICES:
            return 400, self.answer(
                state.first_unlabelled(),
                error=f"a label needs 'pair' (0 to {state.total - 1}) and 'choice' ({', '.join(CHOICES)}); nothing was saved.",
            )
        if pair in state.labels:
            return 409, self.answer(
                state.first_unlabelled(),
                error=f"pair {pair} was already labelled '{state.labels[pair]['choice']}' "
                "(in another tab or window); nothing was saved, and this page now shows the next unlabelled pair.",
            )
        if pair in self.missing and choice != "skip":
            return 409, self.answer(
                pair,
                error=f"pair {pair} cannot be compared because {', '.join(self.missing[pair])} is missing "
                "from the pairs directory; only skip is possible.",
            )
        try:
            self.log.append({"pair": pair, "choice": choice, "preferred": preferred_slot(pair, choice)})
        except FlowRLError as e:  # the disk refused the write: the file is as before, and the page says so
            return 500, self.answer(pair, error=str(e))
        return 200, self.answer(state.first_unlabelled(), saved=pair)

    def undo(self, seq: Any) -> tuple[int, dict[str, Any]]:
        """Withdraw the last label in force, if it is still the one the page showed as last (``seq``)."""
        state = self.log.state
        if not state.history:
            return 409, self.answer(state.first_unlabelled(), error="there is no label to undo.")
        last = state.by_seq[state.history[-1]]
        if seq != last["seq"]:
            return 409, self.answer(
                state.first_unlabelled(),
                error=f"the last label is now pair {last['pair']}'s, saved in another tab "
                "or window; nothing was undone, and this page now shows the current state.",
            )
        try:
            self.log.append({"undo": last["seq"]})
        except FlowRLError as e:
            return 500, self.answer(state.first_unlabelled(), error=str(e))
        return 200, self.answer(last["pair"], undone=last["pair"])


def _refuse(status: int, sentence: str, api: bool):
    """A refusal in one sentence: JSON for the page's API calls, plain text otherwise; with the security headers."""
    from starlette.responses import JSONResponse, PlainTextResponse

    body = JSONResponse({"error": sentence}, status) if api else PlainTextResponse(sentence + "\n", status)
    body.headers.update(SECURITY_HEADERS)
    return body


def _refusal(request: Any, allowed_hosts: set[str] | None, token: str | None, cookie: str) -> tuple[int, str] | None:
    """(status, sentence) when the guard refuses ``request``: a Host that is not loopback (``allowed_hosts``), a wrong
    or missing token, or a POST that is not JSON; None when it passes."""
    if allowed_hosts is not None and request.headers.get("host") not in allowed_hosts:
        return 403, "this labelling server answers only requests addressed to 127.0.0.1 or localhost."
    if token is not None:
        given = request.headers.get(TOKEN_HEADER) or request.query_params.get("token") or request.cookies.get(cookie) or ""
        if not secrets.compare_digest(given.encode(), token.encode()):
            return (
                401,
                "this labelling server needs its access token: open the address that `flowrl label` printed (it ends in ?token=...).",
            )
    if request.method == "POST" and request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return 415, "labels are sent as JSON (Content-Type: application/json); nothing was saved."
    return None


def _guard(token: str | None, port: int, loopback: bool):
    """The middleware's dispatch: refuses what ``_refusal`` names, adds the security headers to every answer and hands
    the page its token cookie."""
    allowed_hosts = {f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")} if loopback else None
    # cookies are not kept apart by port: the name carries it. SameSite=Strict: never sent by another site's page
    cookie = f"flowrl_label_token_{port}"

    async def guard(request, call_next):
        refusal = _refusal(request, allowed_hosts, token, cookie)
        if refusal is not None:
            return _refuse(*refusal, api=request.url.path.startswith("/api/"))
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        if token is not None and request.url.path == "/":  # the page's own script, style and images then need no ?token=
            response.set_cookie(cookie, token, httponly=True, samesite="strict")
        return response

    return guard


def _routes(session: LabelSession) -> list[Any]:
    """The page, its assets and images, and the API that reads the state and records a label or an undo."""
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Route

    def asset(name: str, media_type: str):
        async def endpoint(request: Request) -> Response:
            return FileResponse(ASSETS / name, media_type=media_type)

        return endpoint

    async def state(request: Request) -> Response:
        return JSONResponse(session.answer(session.log.state.first_unlabelled()))

    async def image(request: Request) -> Response:
        pair, slot = int(request.path_params["pair"]), request.path_params["slot"]
        path = image_path(session.directory, pair, slot) if slot in SLOTS and 0 <= pair < len(session.prompts) else None
        if path is None or not path.is_file():
            return _refuse(404, f"no image {slot} for pair {pair} in '{session.directory}'.", False)
        return FileResponse(path, media_type="image/png")

    async def body(request: Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            data = None
        return data if isinstance(data, dict) else {}

    async def label(request: Request) -> Response:
        data = await body(request)
        status, answer = session.label(data.get("pair"), data.get("choice"))
        return JSONResponse(answer, status)

    async def undo(request: Request) -> Response:
        status, answer = session.undo((await body(request)).get("seq"))
        return JSONResponse(answer, status)

    return [
        Route("/", asset("index.html", "text/html")),
        Route("/label.js", asset("label.js", "text/javascript")),
        Route("/label.css", asset("label.css", "text/css")),
        Route("/api/state", state),
        Route("/image/{pair:int}/{slot}.png", image),
        Route("/api/label", label, methods=["POST"]),
        Route("/api/undo", undo, methods=["POST"]),
    ]


def build_app(session: LabelSession, token: str | None, port: int, loopback: bool):
    """The Starlette application. ``token``: required on every request when set (header, ``?token=`` or the
    cookie the page gets with it). ``loopback``: only Host headers naming a loopback address and ``port``."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    return Starlette(routes=_routes(session), middleware=[Middleware(BaseHTTPMiddleware, dispatch=_guard(token, port, loopback))])


def _stopping_cleanly(server_class: type) -> type:
    """uvicorn's Server, except that Ctrl-C or SIGTERM ends ``flowrl label`` with exit status 0 once the page is shut
    down (uvicorn re-raises the signal after its graceful shutdown, which would end the process with 130 or -15)."""

    class Server(server_class):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    getattr(self, "_captured_signals", []).clear()

    return Server


def serve(directory: str | Path, host: str = "127.0.0.1", port: int = 8765) -> int:
    """Serve the labelling page until Ctrl-C; prints the address (with the token where one is needed)."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise FlowRLError(f"flowrl label needs {e.name}, which is not installed; pip install 'flowrl[server]'.") from None

    session = LabelSession.open(directory)
    loopback = is_loopback(host)
    token = os.environ.get(TOKEN_ENV) or (None if loopback else secrets.token_urlsafe(24))
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(128)  # from here on a connection waits for the server instead of being refused
    except OSError as e:
        sock.close()
        raise FlowRLError(f"could not listen on {host}:{port}: {e.strerror or e}.") from None
    port = sock.getsockname()[1]
    app = build_app(session, token, port, loopback)
    shown = socket.gethostname() if host.strip("[]") in ("0.0.0.0", "::") else host  # every address: name this machine
    shown = f"[{shown.strip('[]')}]" if ":" in shown else shown
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    p = session.progress()
    if session.missing:
        first = next(iter(session.missing.values()))[0]
        print(
            f"flowrl label: {len(session.missing)} of {p['total']} pairs have a missing image (first: {first}); "
            "the page shows them as missing and they can only be skipped.",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"flowrl label: {p['labelled']} of {p['total']} pairs of '{session.directory}' labelled; open {url}  (Ctrl-C to stop)", flush=True
    )
    server = _stopping_cleanly(uvicorn.Server)(uvicorn.Config(app, log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        session.log.close()
    return 0
