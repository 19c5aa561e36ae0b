"""nnstat.demo: `nnstat demo`, a small network trained on scikit-learn's digits with nnstat
watching, then explained in a self-contained HTML report.

Example:
    >>> from nnstat.demo import main
    >>> main(["--epochs", "1", "--no-wandb"])  # doctest: +SKIP
"""

from nnstat.demo.train import DemoConfig, DemoState, main

__all__ = ["DemoConfig", "DemoState", "main"]
