"""nnstat.viewer: ``nnstat view DIR``, a local page for what nnstat wrote under DIR.

Tracker runs (`nnstat.integrations.JsonlLogger`), recorder trials, gradient stores (an influence
explorer) and the demo's report. `save_examples` / `save_queries` put what the explorer shows
beside a gradient store; `save_scores` saves scores made elsewhere (refined, as a report used
them) beside it, with the method that made them, so the explorer can show the same lists.

Example:
    >>> from nnstat.viewer import save_examples  # doctest: +SKIP
    >>> save_examples("nnstat_logs/my_project", ids=[0, 1], labels=[3, 5])  # doctest: +SKIP
"""

from nnstat.viewer.examples import (
    Examples,
    load_examples,
    load_queries,
    save_examples,
    save_queries,
)
from nnstat.viewer.scores import SavedScores, load_scores, method_line, save_scores

__all__ = [
    "Examples",
    "SavedScores",
    "load_examples",
    "load_queries",
    "load_scores",
    "method_line",
    "save_examples",
    "save_queries",
    "save_scores",
]
