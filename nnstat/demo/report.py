"""A self-contained HTML report: headings, paragraphs, key/value and column tables, and
matplotlib figures embedded as base64 PNG. No external asset, script or font: the file opens
offline, anywhere.

Every figure must carry a title (a figure in a report has to say what it shows), and the report
records, per figure, its title and the smallest text as it is displayed on the page
(:attr:`HtmlReport.figures`), so a test can hold the page to readable labels.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HtmlReport", "FigureInfo", "figure_png", "figure_title", "PAGE_WIDTH_PX"]

#: Width of the page's content column in CSS pixels (``main`` below: 1160 - 2 x 32 padding).
#: Figures wider than this are scaled down by the browser, and so is their text.
PAGE_WIDTH_PX = 1096
#: Figures are drawn at 100 CSS pixels per inch and saved at this resolution, so they stay
#: sharp on high-density screens and in screenshots.
SAVE_DPI = 150

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0;
       color: #1f2328; background: #f6f8fa; }
main { max-width: 1160px; margin: 0 auto; padding: 24px 32px 48px; background: #fff; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 20px; margin: 32px 0 8px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
p, li { line-height: 1.5; font-size: 15px; }
.sub { color: #57606a; margin-top: 0; }
table.kv { border-collapse: collapse; margin: 8px 0 16px; font-size: 14px; }
table.kv td { padding: 4px 14px 4px 0; border-bottom: 1px solid #eaeef2; }
table.kv td:first-child { color: #57606a; }
table.grid { border-collapse: collapse; margin: 8px 0 16px; font-size: 14px; }
table.grid th { text-align: left; padding: 4px 12px 4px 0; border-bottom: 2px solid #d0d7de; }
table.grid td { padding: 3px 12px 3px 0; border-bottom: 1px solid #eaeef2;
                font-variant-numeric: tabular-nums; }
table.grid td.num, table.grid th.num { text-align: right; }
figure { margin: 12px 0 20px; }
figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { color: #57606a; font-size: 13px; margin-top: 4px; }
code { background: #f6f8fa; padding: 1px 4px; border-radius: 4px; font-size: 13px; }
nav a { margin-right: 14px; font-size: 14px; }
"""


@dataclass(frozen=True)
class FigureInfo:
    """What the report knows of one embedded figure."""

    title: str
    min_text_px: float  # the smallest visible text as displayed, in CSS pixels


def figure_title(fig: Any) -> str:
    """The figure's title: its suptitle, else the titles of its axes joined by " / "."""
    sup = getattr(fig, "_suptitle", None)
    if sup is not None and sup.get_text().strip():
        return sup.get_text().strip()
    titles = [ax.get_title().strip() for ax in fig.axes if ax.get_title().strip()]
    return " / ".join(dict.fromkeys(titles))


def _min_text_px(fig: Any, scale: float) -> float:
    from matplotlib.text import Text

    # called after the figure was saved: the draw made tick labels and legends into Text
    # artists with their final sizes
    sizes = [
        t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
    ]
    return min(sizes, default=float("inf")) * 100.0 / 72.0 * scale


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
        self._parts: list[str | Callable[[], str]] = []
        self._toc: list[tuple[str, str]] = []
        self.figures: list[FigureInfo] = []

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

    def table(self, rows: Mapping[str, Any | Callable[[], Any]]) -> None:
        """A two-column key/value table. A callable value is called when the page is rendered:
        for a number known only at the end, such as the run's total wall time."""
        items = list(rows.items())

        def render() -> str:
            body = "".join(
                f"<tr><td>{html.escape(str(k))}</td>"
                f"<td>{html.escape(str(v() if callable(v) else v))}</td></tr>"
                for k, v in items
            )
            return f'<table class="kv">{body}</table>'

        self._parts.append(render)

    def grid(self, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table with a header row; numbers are right-aligned and shown with 4 significant
        digits (integers in full)."""
        width = len(columns)
        if any(len(r) != width for r in rows):
            raise ValueError(f"every row must have {width} cells")

        def cell(v: Any, tag: str) -> str:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return f"<{tag}>{html.escape(str(v))}</{tag}>"
            text = f"{v:,}" if isinstance(v, int) else f"{v:.4g}"
            return f'<{tag} class="num">{html.escape(text)}</{tag}>'

        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
        body = "".join("<tr>" + "".join(cell(v, "td") for v in r) + "</tr>" for r in rows)
        self._parts.append(f'<table class="grid"><tr>{head}</tr>{body}</table>')

    def figure(self, fig: Any, caption: str = "", alt: str = "") -> FigureInfo:
        """Embed a matplotlib Figure as a base64 PNG (the figure is cleared afterwards).

        Raises ``ValueError`` for a figure without a title (suptitle or axes title)."""
        title = figure_title(fig)
        if not title:
            raise ValueError("a report figure needs a title (suptitle or an axes title)")
        natural = float(fig.get_figwidth()) * 100.0  # CSS px at 100 px per inch
        width = min(natural, PAGE_WIDTH_PX)
        data = base64.b64encode(figure_png(fig, dpi=SAVE_DPI)).decode("ascii")
        info = FigureInfo(title, _min_text_px(fig, width / natural))
        self.figures.append(info)
        alt_text = html.escape(alt or title, quote=True)
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self._parts.append(
            f'<figure data-title="{html.escape(title, quote=True)}" '
            f'data-min-text-px="{info.min_text_px:.1f}"><img alt="{alt_text}" '
            f'width="{natural:.0f}" src="data:image/png;base64,{data}">{cap}</figure>'
        )
        fig.clear()
        return info

    def html(self) -> str:
        """The whole page."""
        nav = " ".join(f'<a href="#{a}">{html.escape(h)}</a>' for a, h in self._toc)
        sub = f'<p class="sub">{html.escape(self.subtitle)}</p>' if self.subtitle else ""
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head>"
            f"<body><main><h1>{html.escape(self.title)}</h1>{sub}<nav>{nav}</nav>"
            + "\n".join(p() if callable(p) else p for p in self._parts)
            + "</main></body></html>\n"
        )

    def write(self, path: str | Path) -> Path:
        """Write the page (creating parent folders) and return its absolute path."""
        path = Path(path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path
