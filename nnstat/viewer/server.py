"""`nnstat view DIR [--port N]` and `nnstat view DIR --export page.html`.

Shows whatever nnstat wrote under DIR (`nnstat.viewer.discover`): Tracker runs (JSONL), recorder
trials, gradient stores (the influence explorer, `nnstat.viewer.explorer`) and HTML reports.
Serves on 127.0.0.1 only, with the standard library's ``http.server``. Every asset is a file in
``nnstat/viewer/static`` (the charting library uPlot is vendored in ``static/vendor``); the page
never loads anything from another origin.

A recorder folder is untrusted input: `nnstat.viewer.bundle` checks every file, the page puts every
value into the DOM as text, and a Content-Security-Policy (a header when served, a ``<meta>`` in
an export) allows only the viewer's own scripts, so even a value that slipped through as markup
could not run. The server answers only requests whose ``Host`` names 127.0.0.1 or localhost
with its port, so a web page in the browser cannot reach it through DNS rebinding.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from nnstat.influence.cli import usage_error
from nnstat.viewer.bundle import load_bundle
from nnstat.viewer.discover import discover, rel_id
from nnstat.viewer.explorer import Explorer
from nnstat.viewer.reports import csp_hash, embed_report, style_hashes

STATIC = Path(__file__).parent / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
# the page's scripts in load order (index.html names each once); vendored files first, and
# dom.js (the shared DOM helper) before the views that use it
SCRIPTS = (
    "vendor/uPlot.iife.min.js",
    "charts.js",
    "graph.js",
    "dom.js",
    "app.js",
    "explorer.js",
    "home.js",
)
STYLES = ("vendor/uPlot.min.css", "style.css")
_ASSETS = SCRIPTS + STYLES
# served page: only this origin's scripts and styles, data from api/data, nothing else
CSP_SERVED = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# connections waiting to be accepted (http.server's default is 5: a burst of connections beyond
# it has its SYNs dropped and retried after 1, 3, 7, 15 … s; the kernel caps it at somaxconn)
BACKLOG = 1024
# a connection silent this long (no request line, no headers, not reading the answer) is closed,
# so its thread ends instead of waiting forever
REQUEST_TIMEOUT = 10.0


def render_page(data: dict | None = None) -> str:
    """The page; with ``data`` it is self-contained (assets and data inlined) for ``--export``.

    Example:
        >>> "<svg" in render_page() or "id=\\"graph\\"" in render_page()
        True
    """
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    if data is None:
        return html
    styles = []
    for name in STYLES:
        css = "\n" + (STATIC / name).read_text(encoding="utf-8")
        html = _swap(html, f'<link rel="stylesheet" href="static/{name}">', f"<style>{css}</style>")
        styles.append(css)
    scripts = []
    for name in SCRIPTS:
        js = "\n" + (STATIC / name).read_text(encoding="utf-8").replace("</", "<\\/")
        html = _swap(html, f'<script src="static/{name}"></script>', f"<script>{js}</script>")
        scripts.append(js)
    # a file:// page has no origin to name, so the inlined scripts and style are allowed by their
    # hashes: an inline script or event handler that is not one of them never runs, and no
    # request leaves the page (no connect-src, images from data: only). The reports' sandboxed
    # srcdoc frames keep this policy: their <style> elements and style attributes are allowed
    # by their hashes too (nnstat.viewer.reports)
    style_src = [csp_hash(css) for css in styles]
    elements: set[str] = set()
    attributes: set[str] = set()
    for rep in data.get("reports", []):
        if isinstance(rep.get("srcdoc"), str):
            e, a = style_hashes(rep["srcdoc"])
            elements |= e
            attributes |= a
    style_src += sorted((elements | attributes) - set(style_src))
    if attributes:
        style_src.append("'unsafe-hashes'")
    csp = (
        f"default-src 'none'; script-src {' '.join(csp_hash(js) for js in scripts)}; "
        f"style-src {' '.join(style_src)}; img-src data:; base-uri 'none'; "
        "form-action 'none'"
    )
    meta = f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
    html = _swap(html, '<meta charset="utf-8">', f'<meta charset="utf-8">\n{meta}')
    # every "<" as \u003c: no tensor name can close the script element or open a comment
    blob = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
    tag = '<script id="nnstat-data" type="application/json"></script>'
    return _swap(html, tag, f'<script id="nnstat-data" type="application/json">{blob}</script>')


def _swap(html: str, old: str, new: str) -> str:
    # index.html and this function change together; a missed placeholder would ship a page that
    # silently loads nothing, so it is an error here
    if html.count(old) != 1:
        raise RuntimeError(f"nnstat/viewer/static/index.html must hold {old!r} exactly once")
    return html.replace(old, new)


def export_bundle(root: str | Path, bundle: dict | None = None) -> dict:
    """The bundle of ``root`` with what a file without a server needs: each store's explorer
    results precomputed (`Explorer.export`) and each report's HTML (``srcdoc``, shown in a
    sandboxed frame; ``omitted`` with the reason when too large: `nnstat.viewer.reports`)."""
    root = Path(root)
    bundle = load_bundle(root) if bundle is None else bundle
    explorer = Explorer(root)
    for store in bundle["stores"]:
        store["export"] = explorer.export(store["id"], store["query_sets"])
    # looked up among the reports found (as the server does), never a path from the data
    found = {rel_id(root, f): f for f in discover(root).reports}
    for rep in bundle["reports"]:
        f = found.get(rep["id"])
        rep.pop("href", None)
        rep.update(embed_report(f, rep["id"]) if f else {"omitted": f"{rep['id']} went away"})
    return bundle


def export(root: str | Path, out: str | Path) -> Path:
    """Write one self-contained HTML page of everything under ``root`` to ``out``.

    Example:
        >>> export("nnstat-demo-logs", "nnstat-view.html")  # doctest: +SKIP
    """
    out = Path(out)
    out.write_text(render_page(export_bundle(root)), encoding="utf-8")
    return out


def host_allowed(host: str | None, port: int) -> bool:
    """Whether a request's ``Host`` header names this loopback server (127.0.0.1 or localhost).

    A page from another site that rebinds its own name to 127.0.0.1 still sends its own name as
    ``Host``; refusing it keeps the recorder folder away from that page.

    Example:
        >>> host_allowed("localhost:8050", 8050), host_allowed("evil.example:8050", 8050)
        (True, False)
    """
    if host is None:
        return False
    names = ("127.0.0.1", "localhost")
    allowed = {f"{n}:{port}" for n in names} | (set(names) if port == 80 else set())
    return host.strip().lower() in allowed


def make_server(
    root: str | Path, port: int = 8050, request_timeout: float | None = REQUEST_TIMEOUT
) -> ThreadingHTTPServer:
    """An HTTP server for ``root`` bound to 127.0.0.1 (``port=0`` picks a free port).

    ``request_timeout``: seconds a connection may stay silent (reading the request, or not
    taking the answer) before it is closed.

    Example:
        >>> srv = make_server("runs/recorder", port=0)  # doctest: +SKIP
        >>> srv.serve_forever()  # doctest: +SKIP
    """
    load_bundle(root)  # fail early with a clear message on a wrong folder
    return _server(Path(root), port, request_timeout=request_timeout)


# a report is an HTML file from the folder (the demo's report.html): shown in a sandbox (no
# script runs, it gets no origin, so it cannot read the viewer's api/) and it loads nothing
CSP_REPORT = (
    "sandbox; default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'"
)


class ViewerServer(ThreadingHTTPServer):
    """One thread per connection (daemon threads: a stuck client never blocks exit), a listen
    backlog of `BACKLOG`, and ``request_timeout`` seconds for each socket operation."""

    daemon_threads = True
    request_queue_size = BACKLOG
    request_timeout: float | None = REQUEST_TIMEOUT


def _server(
    root: Path,
    port: int,
    request_timeout: float | None = REQUEST_TIMEOUT,
    backlog: int = BACKLOG,
) -> ThreadingHTTPServer:
    explorer = Explorer(root)  # influence results cached for the life of this server

    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            # StreamRequestHandler.setup applies self.timeout to the socket: a client that sends
            # nothing (or stops reading) gets socket.timeout, and the connection is closed
            self.timeout = self.server.request_timeout
            super().setup()

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            host = self.headers.get("Host")
            if host is None:
                self._send(400, "text/plain", b"missing Host header")
                return
            own = self.server.server_address[1]
            if not host_allowed(host, own):
                msg = f"Host {host!r} is not this server: open http://127.0.0.1:{own}/"
                self._send(403, "text/plain", msg.encode("utf-8"))
                return
            url = urlsplit(self.path)
            path = url.path
            if path in ("/", "/index.html"):
                self._send(200, "text/html", render_page().encode("utf-8"))
            elif path == "/api/data":
                self._send_data()
            elif path in ("/api/queries", "/api/influence", "/api/self"):
                self._send_explorer(path, parse_qs(url.query))
            elif path.startswith("/report/"):
                self._send_report(path[len("/report/") :])
            elif path.startswith("/static/") and path[len("/static/") :] in _ASSETS:
                f = STATIC / path[len("/static/") :]
                self._send(200, _TYPES[f.suffix], f.read_bytes())
            else:
                self._send(404, "text/plain", b"not found")

        def _send_data(self) -> None:
            try:
                bundle = load_bundle(root)
            except OSError as exc:
                # the folder went away or became unreadable while serving: the page says so
                self._send(500, "text/plain", f"cannot read {root}: {exc}".encode())
                return
            except Exception:
                self._send(500, "text/plain", b"internal error: see the nnstat view terminal")
                raise  # socketserver prints the traceback to the terminal
            for rep in bundle["reports"]:
                rep["href"] = "report/" + rep["id"]
            self._send_json(bundle)

        def _send_explorer(self, path: str, query: dict[str, list[str]]) -> None:
            def arg(name: str, default: str | None = None) -> str:
                values = query.get(name)
                if not values:
                    if default is None:
                        raise ValueError(f"missing parameter {name!r}")
                    return default
                return values[0]

            def int_arg(name: str, default: str | None = None) -> int:
                text = arg(name, default)
                try:
                    return int(text)
                except ValueError:
                    raise ValueError(
                        f"parameter {name!r} must be a whole number, got {text!r}"
                    ) from None

            try:
                store = arg("store")
                if path == "/api/queries":
                    result = explorer.queries(store, arg("set", ""))
                elif path == "/api/influence":
                    q, k = int_arg("q"), int_arg("k", "10")
                    mode, scores = arg("mode", "dot"), arg("scores", "")
                    result = explorer.influence(store, arg("set", ""), q, k, mode, scores)
                else:
                    result = explorer.self_influence(store, int_arg("k", "10"))
            except (KeyError, ValueError, IndexError) as exc:
                # a wrong store, set, index or k: the page shows the message
                msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
                self._send(400, "text/plain", str(msg).encode("utf-8"))
                return
            except Exception as exc:
                self._send(500, "text/plain", f"influence failed: {exc}".encode())
                raise
            self._send_json(result)

        def _send_report(self, rel: str) -> None:
            # looked up among the reports found, never joined into a path from the request
            for f in discover(root).reports:
                if rel_id(root, f) == rel:
                    try:
                        body = f.read_bytes()
                    except OSError as exc:
                        self._send(500, "text/plain", f"cannot read {f}: {exc}".encode())
                        return
                    self._send(200, "text/html", body, csp=CSP_REPORT)
                    return
            self._send(404, "text/plain", b"no such report")

        def _send_json(self, obj: object) -> None:
            body = json.dumps(obj, allow_nan=False, separators=(",", ":"))
            self._send(200, "application/json", body.encode("utf-8"))

        def _send(self, code: int, ctype: str, body: bytes, csp: str = CSP_SERVED) -> None:
            self.send_response(code)
            self.send_header("Content-Type", f"{ctype}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", csp)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # keep the terminal quiet; errors still raise in the handler thread

    class Server(ViewerServer):
        request_queue_size = backlog

    srv = Server(("127.0.0.1", port), Handler)
    srv.request_timeout = request_timeout
    return srv


def serve_in_thread(
    root: str | Path, port: int = 0, request_timeout: float | None = REQUEST_TIMEOUT
) -> tuple[ThreadingHTTPServer, str]:
    """Start a server in a daemon thread; returns it and its URL (for notebooks and tests)."""
    srv = make_server(root, port, request_timeout=request_timeout)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnstat view``.

    Example:
        >>> main(["runs/recorder", "--export", "report.html"])  # doctest: +SKIP
    """
    p = argparse.ArgumentParser(
        prog="nnstat view",
        description="browse what nnstat wrote under a folder: Tracker runs (JSONL), recorder "
        "trials, gradient stores (influence explorer) and reports",
    )
    p.add_argument("root", help="folder to search (4 levels deep), or one run/trial/store folder")
    p.add_argument(
        "--port", type=_port, default=8050, help="port on 127.0.0.1 (default 8050, 0: any free)"
    )
    p.add_argument("--export", metavar="HTML", help="write one self-contained file and exit")
    args = p.parse_args(argv)
    try:
        bundle = load_bundle(args.root)
    except OSError as exc:  # FileNotFoundError: no such folder, or nothing nnstat wrote in it
        return usage_error(p, str(exc))
    for problem in bundle["problems"]:
        print(f"nnstat view: skipped {problem['file']}: {problem['message']}", file=sys.stderr)
    if args.export:
        out = Path(args.export)
        try:
            page = render_page(export_bundle(args.root, bundle))
        except Exception as exc:  # scoring a store failed: say which and why, write nothing
            print(f"nnstat view: cannot export: {exc}", file=sys.stderr)
            return 1
        try:
            out.write_text(page, encoding="utf-8")
        except OSError as exc:
            return usage_error(p, f"argument --export: cannot write {out}: {exc}")
        print(f"wrote {out}")
        return 0
    try:
        srv = _server(Path(args.root), args.port)
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


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be a port number 0-65535 (0: any free), got {text!r}"
        )
    return port


if __name__ == "__main__":
    sys.exit(main())
