"""nnstat.capture: the one set of module hooks, streaming per-sample quantities to consumers.

Example:
    >>> import torch
    >>> from nnstat.capture import CaptureEngine
    >>> engine = CaptureEngine()
    >>> engine.watch(torch.nn.Linear(2, 2))
    ['model']
"""

from nnstat.capture.capture import ModuleCapture
from nnstat.capture.engine import CaptureConsumer, CaptureEngine, UnsupportedModuleError
from nnstat.capture.kinds import detect_kind

__all__ = [
    "CaptureConsumer",
    "CaptureEngine",
    "ModuleCapture",
    "UnsupportedModuleError",
    "detect_kind",
]
