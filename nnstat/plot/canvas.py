"""The one place nnstat.plot creates a figure: no ``pyplot``, nothing global, no GUI backend.

Example:
    >>> fig = new_figure(4.0, 3.0)
    >>> [float(v) for v in fig.get_size_inches()]
    [4.0, 3.0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["new_figure"]


def new_figure(width: float, height: float, constrained: bool = True) -> Figure:
    """A ``width`` x ``height`` inch figure at 100 dpi, with constrained layout unless
    ``constrained=False`` (grids of many small images place their axes themselves: constrained
    layout costs seconds per draw at a hundred axes)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("nnstat.plot needs matplotlib: pip install 'nnstat[viz]'") from e
    return Figure(figsize=(width, height), dpi=100, layout="constrained" if constrained else None)
