"""nnstat.tracker: statistics of weights, gradients, optimizer states and updates every N steps.

`Tracker` computes them after ``optimizer.step()`` (in the background on an idle core when that
pays), and hands `StepMetrics` to its sinks (W&B, TensorBoard, anything with ``log``).

Example:
    >>> import torch
    >>> from nnstat.tracker import Tracker
    >>> model = torch.nn.Linear(3, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> tracker = Tracker(model, opt, background=False)
    >>> model(torch.randn(4, 3)).sum().backward(); opt.step()
    >>> "weight/weight/l2" in tracker.step()
    True
    >>> tracker.close()
"""

from nnstat.tracker.pending import StepMetrics
from nnstat.tracker.tracker import GROUPS, Sink, Tracker

__all__ = ["GROUPS", "Sink", "StepMetrics", "Tracker"]
