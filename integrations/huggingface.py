"""HuggingFace Trainer integration: statistics on the Trainer's logging steps, and the LogIX-style
influence workflow (``patch_trainer`` / ``NNStatArguments``).

``NNStatCallback`` runs nnstat's Tracker (weight/grad/optimizer-state/update statistics, trust
ratios) on the steps the Trainer logs and a streaming noise scale on every step, and adds the
metrics to the Trainer's own log dict, so whatever ``report_to`` names (W&B, TensorBoard, ...)
receives them, ``trainer.state.log_history`` keeps them, and every later callback's ``on_log``
sees them (only the console printer does not). ``JsonlCallback(run_dir)`` writes those logs as
the ``metrics.jsonl`` that ``nnstat view`` opens.

Example:
    >>> from transformers import Trainer, TrainingArguments  # doctest: +SKIP
    >>> from nnstat.integrations.huggingface import NNStatCallback  # doctest: +SKIP
    >>> trainer = Trainer(model, TrainingArguments("out", logging_steps=10, report_to="tensorboard"),
    ...                   train_dataset=ds, callbacks=[NNStatCallback()])  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
"""

from nnstat.integrations._hf_callback import NNStatCallback, watch_trainer
from nnstat.integrations._hf_jsonl import JsonlCallback
from nnstat.integrations._hf_patch import NNStatArguments, patch_trainer

__all__ = ["JsonlCallback", "NNStatArguments", "NNStatCallback", "patch_trainer", "watch_trainer"]
