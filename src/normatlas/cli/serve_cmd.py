"""``normatlas serve``: the atlas as a local web page (:mod:`normatlas.web`), until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import CliError, nonnegative_int

DEFAULT_EXPERIMENTS = "experiments-out"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def configure_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=nonnegative_int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; loopback only)")
    p.add_argument(
        "--allow-remote", action="store_true", help="allow a --host other than loopback (the API is unauthenticated)"
    )
    p.add_argument(
        "--root", default=".", help="the only folder whose checkpoints the Inspect page may read (default .)"
    )
    p.add_argument(
        "--experiments",
        default=None,
        help=f"the experiments output folder, DIR/*/result.json (default ./{DEFAULT_EXPERIMENTS} if it exists)",
    )
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument("--verbose", action="store_true", help="log every request on stderr")


def _folder(value: str, flag: str) -> Path:
    path = Path(value).expanduser()
    if not path.is_dir():
        raise CliError(f"{flag} {value}: not a folder")
    return path.resolve()


def serve(args: argparse.Namespace) -> int:
    """Serve the page and its API until interrupted; exit 0 on Ctrl-C with the socket closed."""
    if args.host not in LOOPBACK and not args.allow_remote:
        raise CliError(f"--host {args.host}: refusing to serve beyond loopback without --allow-remote")
    root = _folder(args.root, "--root")
    if args.experiments is not None:
        experiments: Path | None = _folder(args.experiments, "--experiments")
    else:
        experiments = Path(DEFAULT_EXPERIMENTS).resolve() if Path(DEFAULT_EXPERIMENTS).is_dir() else None
    from ..web import Config, make_server

    if args.host not in LOOPBACK:
        print(f"warning: serving on {args.host}: anyone who can reach it can use the API", file=sys.stderr)
    try:
        server = make_server(args.host, args.port, Config(root, experiments))
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    server.quiet = not args.verbose
    print(
        f"normatlas: serving {server.url}  (root {root}; experiments {experiments or 'none'}); Ctrl-C stops", flush=True
    )
    if args.open:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("normatlas: stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
