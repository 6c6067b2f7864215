"""`sdtrain ui [ROOT]`: a local web app over the run folders under ROOT."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` answers without starlette, which is
# an optional extra.
import argparse
import ipaddress
import os
import secrets
import socket
from pathlib import Path

TOKEN_ENV = "SDTRAIN_UI_TOKEN"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("ui", help="a local web app: every run under a folder, live curves, compare, start",
                            description="Serves a web page over every run folder under ROOT, whether the UI or "
                                        "the CLI started it: runs, live curves and samples, compare, and runs "
                                        "started, stopped and resumed from the page, queued. Binds 127.0.0.1; "
                                        f"another address needs a token in ${TOKEN_ENV}. See docs/ui.md.")
    parser.add_argument("root", type=Path, nargs="?", default=Path("runs"), metavar="ROOT",
                        help="the folder of run folders (default ./runs); runs the UI starts go here")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: a free one, printed)")
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address to bind (default 127.0.0.1; any other needs ${TOKEN_ENV})")
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="runs the UI trains at once; more wait in its queue (default 1)")
    parser.set_defaults(run=run)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from sdtrain.errors import UserError

    if args.parallel < 1:
        raise UserError(f"--parallel {args.parallel}: pass 1 or more")
    token = os.environ.get(TOKEN_ENV) or None
    if not _loopback(args.host) and not token:
        raise UserError(f"--host {args.host} lets other machines in: set {TOKEN_ENV} to a secret first "
                        f"(e.g. export {TOKEN_ENV}={secrets.token_urlsafe(24)})")
    root = args.root
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} is a file; pass the folder that holds the run folders")
    try:
        import uvicorn

        from sdtrain.ui.app import create_app
    except ImportError as exc:
        raise UserError(f"the web UI needs {exc.name or 'starlette and uvicorn'}: pip install 'sdtrain[ui]'") from None
    root.mkdir(parents=True, exist_ok=True)
    app = create_app(root, token=token, parallel=args.parallel)
    # Bound before the address is printed: whoever reads it (a person, a script, a test) connects at once, the
    # connection waiting in the socket's queue until the server takes it. Port 0 takes a free one.
    listening = _bind(args.host, args.port)
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    address = f"http://{shown}:{listening.getsockname()[1]}/" + (f"?token={token}" if token else "")
    print(f"sdtrain ui: {root.resolve()} at {address}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    from sdtrain.errors import UserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as exc:
        listening.close()
        raise UserError(f"--port {port}: cannot listen on {host} ({exc.strerror}); pass another port, or 0 for "
                        "a free one") from None
    listening.listen(128)
    return listening
