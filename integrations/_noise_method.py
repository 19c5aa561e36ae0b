"""Which noise-scale estimator the training callbacks run (``noise_scale_method``).

Where the training loop already has gradients at two batch sizes, the noise scale costs one
norm per micro-batch or bucket and nothing else; per-sample gradient norms are the fallback for
one process without accumulation:

* ``"micro_batch"``: gradient accumulation's micro-batches against the step's gradient
  (``B_small`` = one micro-batch, ``B_big`` = the world size x all the step's micro-batches;
  under DDP the micro-batches run under ``no_sync()``, so they are local).
* ``"ddp"``: each rank's gradient against the all-reduced one, from a DDP communication hook
  (``B_small`` = the rank's samples per optimizer step, ``B_big`` = the global batch).
* ``"per_sample"``: per-sample gradient norms (``B_small = 1``, ``B_big`` = the rank's batch).

``"auto"`` takes the first that applies: ``"micro_batch"`` with 2 or more micro-batches per
step (it uses ``ranks x K`` small batches per step where ``"ddp"`` uses ``ranks``), ``"ddp"``
on 2 or more DDP processes, else ``"per_sample"``.
"""

from __future__ import annotations

from typing import Any

#: values of ``StatsOptions.noise_scale_method``
NOISE_SCALE_METHODS = ("auto", "per_sample", "micro_batch", "ddp")


def check_method(requested: str) -> None:
    """Refuse a ``noise_scale_method`` that is not one of `NOISE_SCALE_METHODS`.

    Args:
        requested: the callback's ``noise_scale_method``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).

    Example:
        >>> check_method("auto")
    """
    if requested not in NOISE_SCALE_METHODS:
        raise ValueError(
            f"noise_scale_method must be one of {NOISE_SCALE_METHODS}, got {requested!r}"
        )


def choose_method(
    requested: str, accumulation_steps: int, ranks: int, ddp: Any, micro_batch_size: int | None
) -> str:
    """The estimator to run for ``requested`` (one of `NOISE_SCALE_METHODS`).

    Args:
        requested: the callback's ``noise_scale_method``.
        accumulation_steps: micro-batches per optimizer step.
        ranks: processes whose gradients the step averages.
        ddp: the ``DistributedDataParallel`` model, or ``None`` (one process, FSDP, ...).
        micro_batch_size: samples per micro-batch per process, ``None`` if unknown.

    Returns:
        ``"per_sample"``, ``"micro_batch"`` or ``"ddp"``.

    Raises:
        ValueError: a forced method that cannot work here (the message says which can).

    Example:
        >>> choose_method("auto", 1, 1, None, 8), choose_method("auto", 4, 2, None, 8)
        ('per_sample', 'micro_batch')
    """
    check_method(requested)
    ddp_ok = ddp is not None and ranks > 1 and micro_batch_size is not None
    if requested == "auto":
        if accumulation_steps > 1:
            return "micro_batch"
        return "ddp" if ddp_ok else "per_sample"
    if requested == "micro_batch" and accumulation_steps < 2:
        raise ValueError(
            "noise_scale_method='micro_batch' needs gradient accumulation (2 or more "
            f"micro-batches per optimizer step, got {accumulation_steps}): there is no second "
            "batch size to compare; use 'ddp' under DDP, 'per_sample', or 'auto'"
        )
    if requested == "ddp" and not ddp_ok:
        why = (
            f"the training runs on {ranks} process(es)"
            if ranks < 2
            else (
                "no DistributedDataParallel model was found (FSDP, DeepSpeed?)"
                if ddp is None
                else "the per-process batch size is unknown"
            )
        )
        raise ValueError(
            f"noise_scale_method='ddp' needs DistributedDataParallel training on 2 or more "
            f"processes with a known per-process batch size, but {why}; use 'per_sample', "
            "'micro_batch' (gradient accumulation) or 'auto'"
        )
    return requested
