"""A self-contained HTML report: headings, paragraphs, key/value tables and matplotlib figures
embedded as base64 PNG. No external asset, script or font: the file opens offline, anywhere.

Example:
    >>> import tempfile, pathlib
    >>> from nnstat.demo.report import HtmlReport
    >>> rep = HtmlReport("nnstat demo")
    >>> rep.section("Summary", "Trained a small MLP.")
    >>> rep.table({"test accuracy": "0.97"})
    >>> path = rep.write(pathlib.Path(tempfile.mkdtemp()) / "report.html")
    >>> ">Summary</h2>" in path.read_text()
    True
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HtmlReport", "figure_png"]

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0;
       color: #1f2328; background: #f6f8fa; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 32px 48px; background: #fff; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 20px; margin: 32px 0 8px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
p, li { line-height: 1.5; font-size: 15px; }
.sub { color: #57606a; margin-top: 0; }
table.kv { border-collapse: collapse; margin: 8px 0 16px; font-size: 14px; }
table.kv td { padding: 4px 14px 4px 0; border-bottom: 1px solid #eaeef2; }
table.kv td:first-child { color: #57606a; }
figure { margin: 12px 0 20px; }
figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { color: #57606a; font-size: 13px; margin-top: 4px; }
code { background: #f6f8fa; padding: 1px 4px; border-radius: 4px; font-size: 13px; }
nav a { margin-right: 14px; font-size: 14px; }
"""


def figure_png(fig: Any, dpi: int = 100) -> bytes:
    """PNG bytes of a matplotlib Figure.

    Example:
        >>> from matplotlib.figure import Figure
        >>> figure_png(Figure(figsize=(1, 1)))[:4]
        b'\\x89PNG'
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class HtmlReport:
    """Builds one HTML page in order of the calls; :meth:`write` saves it.

    Example:
        >>> HtmlReport("t").html().startswith("<!DOCTYPE html>")
        True
    """

    def __init__(self, title: str, subtitle: str = "") -> None:
        self.title = title
        self.subtitle = subtitle
        self._parts: list[str] = []
        self._toc: list[tuple[str, str]] = []

    def section(self, heading: str, *paragraphs: str) -> None:
        """A heading (listed in the page's navigation) and paragraphs of plain text (escaped;
        ``code`` spans in backticks)."""
        anchor = "s" + str(len(self._toc))
        self._toc.append((anchor, heading))
        self._parts.append(f'<h2 id="{anchor}">{html.escape(heading)}</h2>')
        for text in paragraphs:
            self.paragraph(text)

    def paragraph(self, text: str) -> None:
        """One paragraph; text between backticks is shown as code."""
        pieces = html.escape(text).split("`")
        body = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))
        self._parts.append(f"<p>{body}</p>")

    def bullets(self, items: Sequence[str]) -> None:
        """A bulleted list of plain-text items."""
        rows = "".join(f"<li>{html.escape(str(i))}</li>" for i in items)
        self._parts.append(f"<ul>{rows}</ul>")

    def table(self, rows: Mapping[str, Any]) -> None:
        """A two-column key/value table."""
        body = "".join(
            f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
            for k, v in rows.items()
        )
        self._parts.append(f'<table class="kv">{body}</table>')

    def figure(self, fig: Any, caption: str = "", alt: str = "") -> None:
        """Embed a matplotlib Figure as a base64 PNG (the figure is closed afterwards)."""
        data = base64.b64encode(figure_png(fig)).decode("ascii")
        alt_text = html.escape(alt or caption or "figure", quote=True)
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self._parts.append(
            f'<figure><img alt="{alt_text}" src="data:image/png;base64,{data}">{cap}</figure>'
        )
        fig.clear()

    def html(self) -> str:
        """The whole page."""
        nav = " ".join(f'<a href="#{a}">{html.escape(h)}</a>' for a, h in self._toc)
        sub = f'<p class="sub">{html.escape(self.subtitle)}</p>' if self.subtitle else ""
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head>"
            f"<body><main><h1>{html.escape(self.title)}</h1>{sub}<nav>{nav}</nav>"
            + "\n".join(self._parts)
            + "</main></body></html>\n"
        )

    def write(self, path: str | Path) -> Path:
        """Write the page (creating parent folders) and return its absolute path."""
        path = Path(path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path
