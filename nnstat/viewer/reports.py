"""HTML reports in an ``--export``: embedded, sandboxed, loading nothing.

Served, a report opens under the ``sandbox`` Content-Security-Policy of
`nnstat.viewer.server.CSP_REPORT`. An export has no server to send that header, and a
``file://`` link would open the report as a page of its own (scripts running, requests going
out). So the export carries each report's HTML and the page shows it in an
``<iframe sandbox srcdoc=...>``: ``sandbox`` without ``allow-scripts`` or ``allow-same-origin``
(no script runs, the frame has no origin, so it reads neither the page nor files), and a
``srcdoc`` frame keeps the page's own Content-Security-Policy (no ``connect-src``, images from
``data:`` only, ``default-src 'none'``), so it loads nothing either. The page's policy allows
the report's ``<style>`` elements and ``style`` attributes by their hashes (`style_hashes`), so
the report looks as served. A report over `EXPORT_REPORT_MAX` bytes is left out with a note.

Example:
    >>> embed_report_text("<style>h1{color:red}</style><h1>hi</h1>", "r.html")["srcdoc"][:7]
    '<style>'
"""

from __future__ import annotations

import base64
import hashlib
from html.parser import HTMLParser
from pathlib import Path

__all__ = ["EXPORT_REPORT_MAX", "csp_hash", "embed_report", "embed_report_text", "style_hashes"]

# a report larger than this is not carried in an export (the demo's is well under 1 MiB)
EXPORT_REPORT_MAX = 8 * 1024 * 1024


def embed_report(path: Path, rel: str) -> dict:
    """``{"srcdoc": html}`` for the report at ``path`` (shown as ``rel``), or ``{"omitted":
    reason}`` when it is too large or unreadable."""
    try:
        size = path.stat().st_size
        if size > EXPORT_REPORT_MAX:
            return {
                "omitted": f"{rel} is {size / 2**20:.1f} MiB, over the "
                f"{EXPORT_REPORT_MAX / 2**20:.0f} MiB an export carries: open the folder "
                "with nnstat view to see it"
            }
        data = path.read_bytes()
    except OSError as exc:
        return {"omitted": f"cannot read {rel}: {exc}"}
    return embed_report_text(data.decode("utf-8", errors="replace"), rel)


def embed_report_text(text: str, rel: str) -> dict:
    """``{"srcdoc": text}``, or ``{"omitted": reason}`` when ``text`` is too large."""
    if len(text.encode("utf-8")) > EXPORT_REPORT_MAX:
        return {"omitted": f"{rel} is over {EXPORT_REPORT_MAX / 2**20:.0f} MiB: not embedded"}
    return {"srcdoc": text}


class _Styles(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[str] = []
        self.attributes: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._in_style = tag == "style"
        if self._in_style:
            self.elements.append("")
        self.attributes += [v for k, v in attrs if k == "style" and v]

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.attributes += [v for k, v in attrs if k == "style" and v]

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.elements[-1] += data


def style_hashes(html: str) -> tuple[set[str], set[str]]:
    """CSP hash sources (``'sha256-...'``) of ``html``'s ``<style>`` element texts and of its
    ``style`` attribute values, as the browser will see them (line ends normalised to LF).

    Example:
        >>> els, attrs = style_hashes('<style>p{}</style><p style="color:red">x</p>')
        >>> len(els), len(attrs)
        (1, 1)
    """
    p = _Styles()
    p.feed(html.replace("\r\n", "\n").replace("\r", "\n"))
    p.close()
    return {csp_hash(t) for t in p.elements}, {csp_hash(t) for t in p.attributes}


def csp_hash(text: str) -> str:
    """The Content-Security-Policy source (``'sha256-...'``) that allows ``text`` inline.

    Example:
        >>> csp_hash("")
        "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='"
    """
    digest = base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")
    return f"'sha256-{digest}'"
