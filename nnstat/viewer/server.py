"""`nnstat view ROOT [--port N]` and `nnstat view ROOT --export report.html`.

Serves on 127.0.0.1 only, with the standard library's ``http.server``. Every asset is a file in
``nnstat/viewer/static``; the page never loads anything from another origin.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

from nnstat.viewer.data import load_bundle

STATIC = Path(__file__).parent / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
_ASSETS = ("app.js", "graph.js", "plot.js", "style.css")


def render_page(data: dict | None = None) -> str:
    """The page; with ``data`` it is self-contained (assets and data inlined) for ``--export``.

    Example:
        >>> "<svg" in render_page() or "id=\\"graph\\"" in render_page()
        True
    """
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    if data is None:
        return html
    css = (STATIC / "style.css").read_text(encoding="utf-8")
    html = html.replace(
        '<link rel="stylesheet" href="static/style.css">', f"<style>\n{css}</style>"
    )
    for name in ("graph.js", "plot.js", "app.js"):
        js = (STATIC / name).read_text(encoding="utf-8").replace("</", "<\\/")
        html = html.replace(f'<script src="static/{name}"></script>', f"<script>\n{js}</script>")
    # every "<" as \u003c: no tensor name can close the script element or open a comment
    blob = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
    tag = '<script id="nnstat-data" type="application/json"></script>'
    return html.replace(tag, f'<script id="nnstat-data" type="application/json">{blob}</script>')


def export(root: str | Path, out: str | Path) -> Path:
    """Write one self-contained HTML report of ``root`` to ``out``.

    Example:
        >>> export("runs/recorder/default", "report.html")  # doctest: +SKIP
    """
    out = Path(out)
    out.write_text(render_page(load_bundle(root)), encoding="utf-8")
    return out


def make_server(root: str | Path, port: int = 8050) -> ThreadingHTTPServer:
    """An HTTP server for ``root`` bound to 127.0.0.1 (``port=0`` picks a free port).

    Example:
        >>> srv = make_server("runs/recorder", port=0)  # doctest: +SKIP
        >>> srv.serve_forever()  # doctest: +SKIP
    """
    root = Path(root)
    load_bundle(root)  # fail early with a clear message on a wrong folder

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = urlparse(self.path).path
            if path in ("/", "/index.html"):
                self._send(200, "text/html", render_page().encode("utf-8"))
            elif path == "/api/data":
                body = json.dumps(load_bundle(root), allow_nan=False, separators=(",", ":"))
                self._send(200, "application/json", body.encode("utf-8"))
            elif path.startswith("/static/") and path[len("/static/") :] in _ASSETS:
                f = STATIC / path[len("/static/") :]
                self._send(200, _TYPES[f.suffix], f.read_bytes())
            else:
                self._send(404, "text/plain", b"not found")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", f"{ctype}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # keep the terminal quiet; errors still raise in the handler thread

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def serve_in_thread(root: str | Path, port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Start a server in a daemon thread; returns it and its URL (for notebooks and tests)."""
    srv = make_server(root, port)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnstat view``.

    Example:
        >>> main(["runs/recorder", "--export", "report.html"])  # doctest: +SKIP
    """
    p = argparse.ArgumentParser(prog="nnstat view", description="browse a recorder folder")
    p.add_argument("root", help="recorder folder: <root>, <root>/<group> or one trial folder")
    p.add_argument("--port", type=int, default=8050, help="port on 127.0.0.1 (default 8050)")
    p.add_argument("--export", metavar="HTML", help="write one self-contained file and exit")
    args = p.parse_args(argv)
    try:
        if args.export:
            out = export(args.root, args.export)
            print(f"wrote {out}")
            return 0
        srv = make_server(args.root, args.port)
    except FileNotFoundError as exc:
        print(f"nnstat view: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # typically the port is taken
        print(f"nnstat view: cannot listen on 127.0.0.1:{args.port}: {exc}", file=sys.stderr)
        return 2
    print(
        f"nnstat view: serving {args.root} at http://127.0.0.1:{srv.server_address[1]}/", flush=True
    )
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
