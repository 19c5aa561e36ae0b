"""``JsonlCallback``: the Trainer's training logs, nnstat's statistics included, as the
``metrics.jsonl`` that ``nnstat view`` opens (re-exported by :mod:`nnstat.integrations.huggingface`).

Example:
    >>> from nnstat.integrations.huggingface import JsonlCallback, NNStatCallback  # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=ds,
    ...                   callbacks=[NNStatCallback(), JsonlCallback("runs/gpt2")])  # doctest: +SKIP
    >>> trainer.train()  # then: nnstat view runs  # doctest: +SKIP
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

from nnstat.integrations.jsonl import JsonlLogger
from transformers import TrainerCallback

__all__ = ["JsonlCallback"]


class JsonlCallback(TrainerCallback):
    """Write every training log of the Trainer (loss, learning rate, grad norm and the keys an
    :class:`NNStatCallback` adds) to ``<run_dir>/metrics.jsonl`` at ``state.global_step``.

    Only numbers are written (the Trainer's logs hold nothing else; a string value is left out
    rather than refused, as the log dict is not this callback's to shape). Evaluation logs are
    written too, under their own keys (``eval_loss``...). The file is closed at the end of
    training; a later ``train()`` appends to it.

    Args:
        run_dir: the run's folder (created if missing); ``nnstat view <its parent>`` lists it.

    Example:
        >>> import tempfile
        >>> cb = JsonlCallback(tempfile.mkdtemp())
        >>> cb.run_dir.is_dir()
        True
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log: JsonlLogger | None = None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any):
        if not logs or not state.is_world_process_zero:
            return
        metrics = {k: v for k, v in logs.items() if isinstance(v, numbers.Number)}
        if self._log is None:
            self._log = JsonlLogger(self.run_dir)
        self._log.log(metrics, step=int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        log, self._log = self._log, None
        if log is not None:
            log.close()
