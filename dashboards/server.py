"""The live dashboard: a Starlette (ASGI) app over the runs under one folder, read-only.

Pages (HTML shells that fetch JSON and draw with plotly.js, all served from the package):

    /                          the runs under the root, live
    /run?run=ID                one run: curves, findings, gradient flow, heatmaps, layer detail
    /compare?run=A&run=B...    runs overlaid

JSON (every response bounded, see :mod:`gradwatch.dashboards.data`):

    /api/runs                  /api/run/summary?run=ID        /api/run/curves?run=ID[&start&stop]
    /api/run/findings?run=ID   /api/run/flow?run=ID[&step]    /api/run/heatmap?run=ID&metric=M[&start&stop]
    /api/run/layer?run=ID&layer=NAME[&start&stop]            /api/run/progress?run=ID

Server push: ``/api/events`` (Server-Sent Events) sends ``runs`` when the list changes, and with
``run=ID`` (repeatable) a ``progress`` event whenever one of those runs records a step, a finding or
a status change. Runs are addressed by their path relative to the root; anything else is a 404.
Every route is GET: nothing here writes.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gradwatch import encoding
from gradwatch.dashboards import data
from gradwatch.errors import GradwatchError
from gradwatch.report.figures import script_json

#: page assets served under /static/ (plotly.js comes from the plotly package)
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
PLOTLY = "plotly.min.js"
#: how often live streams look at the store (seconds): a run page, the runs list
POLL_RUN, POLL_LIST = 0.5, 1.0
#: a comment line on idle streams keeps proxies from closing them
KEEPALIVE = 15.0
#: the pages may load only what this server serves
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                 b"img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
                                 b"base-uri 'none'; form-action 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: Host headers a loopback server always answers (besides the address it listens on)
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

log = logging.getLogger("gradwatch.dashboard")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, ``*.localhost``, or a loopback address.

    Loopback addresses are all of ``127.0.0.0/8`` and ``::1``, in any spelling.
    """
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> list[str]:
    """The Host header names a server bound to the loopback address ``host`` answers."""
    name = host.strip("[]").lower()
    own = f"[{name}]" if ":" in name else name
    return [*LOOPBACK_HOSTS, *([own] if own not in LOOPBACK_HOSTS else [])]


class _SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response, a 500 for an unexpected error included.

    The error is logged once; the client sees no internals.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *SECURITY_HEADERS]
            await send(message)

        try:
            await self.app(scope, receive, with_headers)
        except Exception:
            log.exception("gradwatch dashboard: internal error serving %s", scope.get("path"))
            if started:  # the response is under way: nothing better than ending it
                raise
            await _error(500, "internal error in the gradwatch dashboard; see the server's log")(
                scope, receive, with_headers)


class StrictJSONResponse(JSONResponse):
    """A JSON response written by :mod:`gradwatch.encoding`: strict JSON, a non-finite number ``null``
    with its string form beside it (the same scheme as ``gradwatch check --format json``).
    """

    def render(self, content: Any) -> bytes:
        """The body: compact strict JSON in UTF-8."""
        # any string from the filesystem left (a store's path) written as its characters
        return encoding.readable(encoding.dumps(content, ensure_ascii=False, separators=(",", ":"))).encode("utf-8")


def _error(status: int, message: str) -> JSONResponse:
    return StrictJSONResponse({"error": message}, status_code=status)


def _int(request: Request, name: str) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise data.BadRequest(f"{name} must be a whole number, got {text!r}") from None
    if value < 0 or value > 2**62:
        raise data.BadRequest(f"{name} must be between 0 and 2**62, got {value}")
    return value


def _one(request: Request, name: str) -> str:
    value = request.query_params.get(name)
    if not value:
        raise data.BadRequest(f"the {name!r} parameter is required")
    return value


class Dashboard:
    """The dashboard's state (root, caches, templates) and its request handlers."""

    def __init__(self, root: Path, *, poll: float = POLL_RUN) -> None:
        self.root = data.Root(root)
        self.envelopes = data.Envelopes()
        self.curves = data.Curves()
        self.poll = poll
        self.started = time.time()
        self._env = Environment(loader=PackageLoader("gradwatch.dashboards", "web"), autoescape=True,
                                undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self._plotly: bytes | None = None
        #: set when the server shuts down: live streams end instead of holding the shutdown up
        self.closing = threading.Event()

    # ---------------------------------------------------------------- pages
    def _page(self, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        boot = Markup(script_json(context.pop("boot", {})))
        body = self._env.get_template(template).render(boot=boot, root=str(self.root.root), **context)
        return HTMLResponse(body, status_code=status, headers={"cache-control": "no-store"})

    def _missing(self, what: str) -> HTMLResponse:
        return self._page("missing.html.j2", status=404, title="no such run", what=what)

    async def index(self, request: Request) -> Response:
        """The runs under the root."""
        return self._page("index.html.j2", title="runs", boot={"page": "index"})

    async def run_page(self, request: Request) -> Response:
        """One run (``?run=ID``)."""
        run_id = request.query_params.get("run", "")
        try:
            self.root.resolve(run_id)
        except data.NotFound:
            return self._missing(run_id)
        return self._page("run.html.j2", title=run_id, run_id=run_id, boot={"page": "run", "run": run_id})

    async def compare_page(self, request: Request) -> Response:
        """Runs overlaid (``?run=A&run=B``)."""
        ids = list(dict.fromkeys(request.query_params.getlist("run")))
        if not ids:
            return self._missing("(no run chosen)")
        for run_id in ids:
            try:
                self.root.resolve(run_id)
            except data.NotFound:
                return self._missing(run_id)
        return self._page("compare.html.j2", title="compare", runs=ids, boot={"page": "compare", "runs": ids})

    async def static(self, request: Request) -> Response:
        """Page assets, and plotly.js from the plotly package."""
        name = request.path_params["name"]
        headers = {"cache-control": "public, max-age=3600"}
        if name == PLOTLY:
            if self._plotly is None:
                from plotly.offline import get_plotlyjs

                self._plotly = get_plotlyjs().encode()
            return Response(self._plotly, media_type="text/javascript; charset=utf-8", headers=headers)
        if name not in ASSETS:
            return _error(404, "no such asset")
        body = (resources.files("gradwatch.dashboards") / "web" / name).read_bytes()
        return Response(body, media_type=ASSETS[name], headers={"cache-control": "no-cache"})

    # ---------------------------------------------------------------- JSON
    def _json(self, work: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """A JSON endpoint: runs ``work`` in the thread pool; bad input and unreadable runs become errors."""

        async def endpoint(request: Request) -> Response:
            try:
                return StrictJSONResponse(await run_in_threadpool(work, request),
                                          headers={"cache-control": "no-store"})
            except data.NotFound as exc:
                return _error(404, f"no run or layer named {str(exc)!r} here")
            except data.BadRequest as exc:
                return _error(400, str(exc))
            except GradwatchError as exc:  # a corrupted or newer store
                return _error(422, str(exc))

        return endpoint

    def _with_run(self, view: Callable[..., Any]) -> Callable[[Request], Any]:
        def work(request: Request) -> Any:
            run_id = _one(request, "run")
            with self.root.open(run_id) as run:
                return view(run, run_id, request)

        return self._json(work)

    def routes(self) -> list[Route]:
        """The app's routes (all GET)."""
        rn = self._with_run
        api = {
            "summary": rn(lambda run, rid, q: data.summary(run, rid)),
            "curves": rn(lambda run, rid, q: data.curves(run, self.curves, _int(q, "start"), _int(q, "stop"))),
            "findings": rn(lambda run, rid, q: data.findings(run)),
            "flow": rn(lambda run, rid, q: data.flow(run, _int(q, "step"))),
            "heatmap": rn(lambda run, rid, q: data.heatmap(
                run, self.envelopes, q.query_params.get("metric", "grad_norm"), _int(q, "start"), _int(q, "stop"))),
            "layer": rn(lambda run, rid, q: data.layer(run, self.envelopes, _one(q, "layer"), _int(q, "start"),
                                                         _int(q, "stop"))),
            "progress": rn(lambda run, rid, q: {"id": rid, **run.progress()}),
        }
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/run", self.run_page, methods=["GET"]),
            Route("/compare", self.compare_page, methods=["GET"]),
            Route("/static/{name}", self.static, methods=["GET"]),
            Route("/api/runs", self._json(lambda request: self.root.runs()), methods=["GET"]),
            *[Route(f"/api/run/{name}", endpoint, methods=["GET"]) for name, endpoint in api.items()],
            Route("/api/events", self.events, methods=["GET"]),
        ]

    # ---------------------------------------------------------------- server push
    def _progress(self, run_id: str) -> dict[str, Any]:
        try:
            with self.root.open(run_id) as run:
                return {"id": run_id, **run.progress()}
        except (data.NotFound, GradwatchError) as exc:
            return {"id": run_id, "error": str(exc) or "the run is gone"}

    async def events(self, request: Request) -> Response:
        """Server-Sent Events: ``runs`` (no ``run`` given) or ``progress`` of the given runs."""
        ids = list(dict.fromkeys(request.query_params.getlist("run")))
        for run_id in ids:
            try:
                self.root.resolve(run_id)
            except data.NotFound:
                return _error(404, f"no run named {run_id!r} here")

        async def stream() -> AsyncIterator[str]:
            sent: dict[str, str] = {}
            quiet = time.monotonic()
            yield "retry: 2000\n\n"
            while not self.closing.is_set():
                if ids:
                    updates = [await run_in_threadpool(self._progress, run_id) for run_id in ids]
                    batch = [("progress", u["id"], u) for u in updates]
                else:
                    batch = [("runs", "", await run_in_threadpool(self.root.runs))]
                for event, key, payload in batch:
                    text = encoding.readable(encoding.dumps(payload, separators=(",", ":")))
                    if sent.get(key) != text:
                        sent[key] = text
                        quiet = time.monotonic()
                        yield f"event: {event}\ndata: {text}\n\n"
                if time.monotonic() - quiet > KEEPALIVE:
                    quiet = time.monotonic()
                    yield ": keepalive\n\n"
                wake = time.monotonic() + (self.poll if ids else max(self.poll, POLL_LIST))
                while not self.closing.is_set() and time.monotonic() < wake:
                    await anyio.sleep(min(0.1, self.poll))

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})


def create_app(root: str | Path, *, host: str = "127.0.0.1", poll: float = POLL_RUN) -> Starlette:
    """The dashboard's ASGI app serving the runs under ``root``.

    Args:
        root: the folder whose runs are shown (it may itself be a run).
        host: the address the server binds; on a loopback address (any of ``127.0.0.0/8``, ``::1``,
            ``localhost``) only requests whose Host header names a loopback host or that address are
            served (a defence against DNS rebinding).
        poll: seconds between two looks at the store for a live page.
    """
    dashboard = Dashboard(Path(root), poll=poll)
    middleware = [Middleware(_SecurityHeaders), Middleware(GZipMiddleware, minimum_size=1024, compresslevel=5)]
    if is_loopback(host):  # inside the headers' middleware: its 400 carries them too
        middleware.insert(1, Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(host)))
    app = Starlette(routes=dashboard.routes(), middleware=middleware)
    app.state.dashboard = dashboard
    return app


# ---------------------------------------------------------------------- serving
#: connections waiting to be accepted (uvicorn's default)
BACKLOG = 2048


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one) and listening, or a GradwatchError saying why not.

    Binding and listening are one checked step: two dashboards started at once on one port may both
    bind (``SO_REUSEADDR``), but only one can listen; the other gets the error here, before it prints
    anything, never from the server later.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise GradwatchError(f"cannot listen on {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise GradwatchError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another port with "
                             f"--port (--port 0 picks a free one)") from None
    return sock


def url(host: str, port: int) -> str:
    """The address people open."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def _server(root: str | Path, host: str, poll: float) -> Any:
    import uvicorn

    app = create_app(root, host=host, poll=poll)
    closing = app.state.dashboard.closing

    class Server(uvicorn.Server):
        """uvicorn's server, telling the live streams to end when it is asked to stop."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            closing.set()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5, lifespan="off")
    server = Server(config)
    server.closing = closing  # type: ignore[attr-defined]
    return server


def serve(root: str | Path, sock: socket.socket, *, host: str = "127.0.0.1", poll: float = POLL_RUN) -> None:
    """Serve the dashboard on a bound socket (from :func:`bind`) until interrupted (Ctrl-C ends it quietly)."""
    try:
        serve_socket(_server(root, host, poll), sock)
    except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped for
        pass


class Running:
    """A dashboard served from a background thread (see :func:`start`)."""

    def __init__(self, server: Any, thread: threading.Thread, address: str) -> None:
        self._server = server
        self._thread = thread
        self.url = address

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and wait for the thread to end."""
        self._server.closing.set()
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(root: str | Path, *, host: str = "127.0.0.1", port: int = 0, poll: float = POLL_RUN) -> Running:
    """Serve the dashboard from a background thread (a notebook, a test); returns once it accepts requests.

    ``with start("runs") as dash: print(dash.url)`` stops it on leaving the block.
    """
    sock = bind(host, port)
    server = _server(root, host, poll)
    thread = threading.Thread(target=serve_socket, args=(server, sock), name="gradwatch-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise GradwatchError("the dashboard server did not start")
        time.sleep(0.02)
    return Running(server, thread, url(host, sock.getsockname()[1]))


def serve_socket(server: Any, sock: socket.socket) -> None:
    """Run a uvicorn server on a bound socket, closing the socket after."""
    with sock:
        server.run(sockets=[sock])
