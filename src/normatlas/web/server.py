"""The standard-library HTTP server behind ``normatlas serve``: the page's files and its JSON API.

Routes are an explicit table (:data:`GET_ROUTES`, :data:`POST_ROUTES`); static files are served only by
name from the package's ``static`` folder (no path is ever joined from a request), figures only as
``/experiments/NAME/figure.svg|png`` of a result folder. Every error is JSON with a 4xx/5xx status;
bodies over :data:`MAX_BODY` get 413; every response carries a Content-Security-Policy that allows
only the page's own origin, and ``X-Content-Type-Options: nosniff``. A ``Host`` header is parsed strictly (a
name or a ``[v6]`` literal, then an optional ``:digits`` port; anything else is 403), and on a loopback server a
``Host`` that is not a loopback name is refused (a DNS-rebinding guard).

Slow and vanishing clients cost little: a body has :attr:`AtlasServer.body_timeout` seconds to arrive (else 408;
a body cut short is 400), at most :attr:`AtlasServer.max_threads` connections are served at once (the next one
gets a 503 and is closed), and a client that hangs up mid-answer is dropped quietly, with no traceback.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .._io import dumps
from .axes_api import normalize_view, taxonomy_view
from .catalog import NAME, experiments_view, models_view, papers_view, placements_view
from .inspect_api import Busy, Forbidden, Unreadable
from .inspect_jobs import Inspector
from .tools_api import ToolTargets, run_tool, tools_view

__all__ = ["CSP", "MAX_BODY", "AtlasServer", "Config", "make_server", "static_files"]

MAX_BODY = 64 * 1024
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_FIGURE = re.compile(r"/experiments/([^/]+)/(figure\.(?:svg|png))")
_JOB = re.compile(r"/api/inspect/job/([^/]+)")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# a Host header: a registered name or IPv4 address, or an IPv6 literal in brackets; then an optional :port
_HOST = re.compile(
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?))(?::(?P<port>\d{1,5}))?"
)
# what a client that vanished mid-request raises; such a request is dropped without a traceback
_GONE = (ConnectionError, TimeoutError)


@dataclass(frozen=True)
class Config:
    """What a server serves: the checkpoint root for ``/api/inspect`` and the experiments output folder."""

    root: Path
    experiments: Path | None


@dataclass(frozen=True)
class Answer:
    """A route's answer when it is not a plain 200: its status, JSON document and extra headers."""

    status: HTTPStatus
    doc: Any
    headers: dict[str, str] | None = None


class HTTPError(Exception):
    """A request the server refuses: its status, message and extra headers (``Allow`` on a 405)."""

    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def static_files() -> dict[str, bytes]:
    """Every file of the page (name -> bytes), read once from the package."""
    folder = resources.files("normatlas.web").joinpath("static")
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and Path(f.name).suffix in _TYPES}


class AtlasServer(ThreadingHTTPServer):
    """A threading HTTP server holding the page's files, its config, the inspector and the cached views."""

    daemon_threads = True
    allow_reuse_address = True
    #: connections served at once; one more is answered 503 and closed (a thread per idle socket is not free)
    max_threads = 32
    #: connections the kernel queues until they are accepted (the standard library's 5 drops a burst's handshakes,
    #: which the clients then retry after a second or more)
    request_queue_size = 64
    #: seconds a request body may take to arrive once its headers are in (else 408)
    body_timeout = 5.0

    def __init__(self, address: tuple[str, int], config: Config, quiet: bool = True) -> None:
        if ":" in address[0]:  # an IPv6 address such as ::1
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)
        self.config = config
        self.quiet = quiet
        self.files = static_files()
        self.inspector = Inspector(config.root)
        self.tool_targets = ToolTargets(config.root)
        self._views: dict[str, Any] = {}
        self._slots = threading.BoundedSemaphore(self.max_threads)

    def server_close(self) -> None:
        self.inspector.close()
        super().server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection while fewer than :attr:`max_threads` are busy; else a 503, closed at once."""
        if not self._slots.acquire(blocking=False):
            _refuse_busy(request, self.max_threads)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (broken pipe, reset, timeout) is nobody's error: no traceback for it."""
        if isinstance(sys.exc_info()[1], _GONE):
            return
        super().handle_error(request, client_address)

    def view(self, key: str, build: Callable[[], Any]) -> Any:
        """A read-only view, built once (the data files do not change while serving)."""
        if key not in self._views:
            self._views[key] = build()
        return self._views[key]

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = str(host)
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"


def _refuse_busy(sock: socket.socket, limit: int) -> None:
    """The 503 a connection over the limit gets, written without reading its request (never blocking long)."""
    body = dumps({"error": f"the server is serving {limit} connections already; retry", "status": 503}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n"
        f"Content-Security-Policy: {CSP}\r\nX-Content-Type-Options: nosniff\r\n\r\n"
    )
    try:
        sock.settimeout(0.5)
        sock.sendall(head.encode() + body)
    except OSError:
        pass


def make_server(host: str = "127.0.0.1", port: int = 0, config: Config | None = None) -> AtlasServer:
    """A bound (not yet serving) server; port 0 picks a free one. Call ``serve_forever`` on it."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an integer in [0, 65535]")
    return AtlasServer((host, port), config or Config(Path.cwd(), None))


def _health(server: AtlasServer) -> dict[str, Any]:
    from .. import __version__

    return {"ok": True, "version": __version__, "files": sorted(server.files), "time": time.time()}


GET_ROUTES: dict[str, Callable[[AtlasServer], Any]] = {
    "/api/health": _health,
    "/api/taxonomy": lambda s: s.view("taxonomy", taxonomy_view),
    "/api/placements": lambda s: placements_view(s.config.experiments),
    "/api/models": lambda s: s.view("models", models_view),
    "/api/papers": lambda s: s.view("papers", papers_view),
    "/api/experiments": lambda s: experiments_view(s.config.experiments),
    "/api/inspect": lambda s: {"root": str(s.inspector.root), "folders": s.inspector.folders()},
    "/api/tools": lambda s: tools_view(),
}


def _inspect(server: AtlasServer, body: Any) -> Answer:
    """``POST /api/inspect``: the job of the body's target, started or joined; 202 with its ``Location`` while it
    runs, 200 once it is done (a cached report)."""
    doc, finished = server.inspector.start(body)
    if finished:
        return Answer(HTTPStatus.OK, doc)
    return Answer(HTTPStatus.ACCEPTED, doc, {"Location": f"/api/inspect/job/{doc['job']}"})


def _tools(server: AtlasServer, body: Any) -> Answer:
    """``POST /api/tools``: a tool's job on a folder under the root, in the inspection queue (polled at
    ``GET /api/inspect/job/ID``); 202 while it runs, 200 once its result is cached."""
    doc, finished = server.inspector.start(body, server.tool_targets, run_tool)
    if finished:
        return Answer(HTTPStatus.OK, doc)
    return Answer(HTTPStatus.ACCEPTED, doc, {"Location": f"/api/inspect/job/{doc['job']}"})


POST_ROUTES: dict[str, Callable[[AtlasServer, Any], Any]] = {
    "/api/normalize": lambda s, body: normalize_view(body),
    "/api/inspect": _inspect,
    "/api/tools": _tools,
}


class Handler(BaseHTTPRequestHandler):
    """Routes one request; every failure becomes a JSON error, never a dropped connection or a traceback."""

    server: AtlasServer
    server_version = "normatlas"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # so an error to a garbled request line still has a status line
    timeout = 10  # seconds an idle or stalled connection keeps its thread (a body: AtlasServer.body_timeout)

    def log_message(self, format: str, *args: Any) -> None:
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} - {format % args}\n")

    def _send(self, status: HTTPStatus, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: HTTPStatus, doc: Any, extra: dict[str, str] | None = None) -> None:
        body = dumps(doc).encode()
        self._send(status, body, "application/json; charset=utf-8", extra)

    def _error(self, status: HTTPStatus, message: str, extra: dict[str, str] | None = None) -> None:
        extra = dict(extra or {})
        if self.command == "POST":  # a body left unread would be parsed as the next request
            extra["Connection"] = "close"
        try:
            self._json(status, {"error": message, "status": int(status)}, extra)
        except _GONE:  # the client is gone: nobody is left to tell
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own errors (a malformed request line, an unknown method) as JSON too."""
        self.close_connection = True
        try:
            status = HTTPStatus(code)
        except ValueError:
            status = HTTPStatus.BAD_REQUEST
        self._error(status, message or status.phrase, {"Connection": "close"})

    def _path(self) -> str:
        raw = urlsplit(self.path).path
        path = unquote(unquote(raw))  # doubly encoded traversal (%252e%252e) decodes to '..' as well
        if "\\" in path or "\x00" in path or any(part in ("..", ".") for part in path.split("/")):
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"path {raw!r} is not allowed (no '.', '..' or backslashes)")
        return path

    def _check_host(self) -> None:
        raw = self.headers.get("Host")
        loopback = str(self.server.server_address[0]) in LOOPBACK
        if raw is None and not loopback:
            return  # an HTTP/1.0 client on a server bound beyond loopback (--allow-remote)
        m = _HOST.fullmatch(raw or "")
        if m is None or int(m.group("port") or 0) > 65535:
            shown = (raw or "")[:80]
            raise HTTPError(HTTPStatus.FORBIDDEN, f"Host {shown!r} is not a host name or [IPv6] with an optional :port")
        host = m.group("v6") or m.group("name").lower()
        if loopback and host not in LOOPBACK:
            raise HTTPError(HTTPStatus.FORBIDDEN, f"Host {host!r} is not this loopback server")

    def _dispatch(self, method: str) -> None:
        try:
            self._check_host()
            path = self._path()
            if method == "POST":
                self._post(path)
            else:
                self._get(path)
        except HTTPError as exc:
            self._error(exc.status, str(exc), exc.headers)
        except Forbidden as exc:
            self._error(HTTPStatus.FORBIDDEN, str(exc))
        except Unreadable as exc:
            self._error(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc))
        except Busy as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), {"Retry-After": "2"})
        except FileNotFoundError as exc:
            self._error(HTTPStatus.NOT_FOUND, str(exc))
        except (ValueError, TypeError, KeyError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc).strip("'\"") or type(exc).__name__)
        except ConnectionError:  # the client hung up mid-answer
            self.close_connection = True
        except RecursionError:  # a structure nested past the interpreter's limit, met after parsing
            self._error(HTTPStatus.BAD_REQUEST, "the request is nested too deeply")
        except Exception as exc:  # a bug of normatlas or of a model build: a 500 that names it
            self.log_error("%s %s failed: %r", method, self.path, exc)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {str(exc)[:300]}")

    def _get(self, path: str) -> None:
        if path in GET_ROUTES:
            self._json(HTTPStatus.OK, GET_ROUTES[path](self.server))
        elif path in POST_ROUTES:
            raise HTTPError(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes POST", {"Allow": "POST"})
        elif (m := _JOB.fullmatch(path)) is not None:
            self._json(HTTPStatus.OK, self.server.inspector.job(m.group(1)))
        elif path.startswith("/api/"):
            raise HTTPError(HTTPStatus.NOT_FOUND, f"no API route {path}; see docs/web.md")
        elif (m := _FIGURE.fullmatch(path)) is not None:
            self._figure(m.group(1), m.group(2))
        else:
            name = "index.html" if path in ("/", "/index.html") else path.removeprefix("/static/")
            if (not path.startswith("/static/") and name != "index.html") or name not in self.server.files:
                raise HTTPError(HTTPStatus.NOT_FOUND, f"no page or file at {path}")
            self._send(HTTPStatus.OK, self.server.files[name], _TYPES[Path(name).suffix])

    def _figure(self, name: str, file: str) -> None:
        folder = self.server.config.experiments
        if folder is None or not NAME.fullmatch(name) or not (folder / name / file).is_file():
            raise HTTPError(HTTPStatus.NOT_FOUND, f"no figure {name}/{file} in the experiments folder")
        self._send(HTTPStatus.OK, (folder / name / file).read_bytes(), _TYPES[Path(file).suffix])

    def _post(self, path: str) -> None:
        if path not in POST_ROUTES:
            if path in GET_ROUTES or _JOB.fullmatch(path):
                raise HTTPError(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes GET", {"Allow": "GET, HEAD"})
            raise HTTPError(HTTPStatus.NOT_FOUND, f"no API route {path}; see docs/web.md")
        answer = POST_ROUTES[path](self.server, self._body())
        if isinstance(answer, Answer):
            self._json(answer.status, answer.doc, answer.headers)
        else:
            self._json(HTTPStatus.OK, answer)

    def _body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise HTTPError(HTTPStatus.LENGTH_REQUIRED, "POST needs a Content-Length header (a JSON body)")
        if int(length) > MAX_BODY:
            self.close_connection = True  # the unread body would be taken for the next request
            raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes; at most {MAX_BODY}")
        raw = self._read(int(length))
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON ({exc})") from None
        except RecursionError:
            raise HTTPError(HTTPStatus.BAD_REQUEST, "the body's JSON is nested too deeply") from None

    def _read(self, length: int) -> bytes:
        """``length`` bytes of body within :attr:`AtlasServer.body_timeout` seconds: 408 when they stall, 400 when
        the client stops sending before all of them."""
        wait = self.server.body_timeout
        self.connection.settimeout(wait)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise HTTPError(
                HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within {wait:g} s (Content-Length: {length})"
            ) from None
        finally:
            self.connection.settimeout(self.timeout)
        if len(raw) < length:
            self.close_connection = True
            raise HTTPError(
                HTTPStatus.BAD_REQUEST, f"the body is {len(raw)} bytes, shorter than its Content-Length ({length})"
            )
        return raw

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _not_allowed(self) -> None:
        self._error(
            HTTPStatus.METHOD_NOT_ALLOWED,
            f"method {self.command} is not allowed; use GET or POST",
            {"Allow": "GET, HEAD, POST"},
        )

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed
