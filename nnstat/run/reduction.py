"""Is the loss of a ``run(...)`` block a mean over the batch? (checked once per pass).

The store's rows are per-sample gradients of **each sample's own loss**. With the default
``loss_reduction="sum"`` the Run takes the backward's output gradients as they are, so a loss
that averages over the batch makes every row ``g_i / N`` (and a short last batch
``g_i / N_last``): influence scores come out scaled per batch, silently. The gradients alone
cannot tell; the loss can: :class:`nnstat.capture.reduction.MeanLossProbe` (in the capture
layer, as the noise scale uses it too) watches the first completed block of each pass.

Example:
    >>> import torch
    >>> x = torch.randn(8, 3, requires_grad=True)
    >>> with MeanLossProbe() as probe:
    ...     x.pow(2).mean().backward()
    >>> probe.mean_over_batch(8)
    'mean'
"""

from __future__ import annotations

import warnings
from typing import Any

from nnstat.capture.reduction import MeanLossProbe


def reduction_probe(
    active: bool, model: Any, first_block: bool, loss_reduction: str, warned_once: set[str]
) -> MeanLossProbe | None:
    """A :class:`MeanLossProbe` for the first block (``first_block``) of a pass or eval log
    that captures anything (``active``); ``None`` once the user was warned for this
    ``loss_reduction`` (``"mean loss"`` or ``"position mean"`` in ``warned_once``) or for a
    ``torch.compile``d ``model`` (no function mode inside)."""
    compiled = hasattr(model, "_orig_mod")
    warned = "mean loss" if loss_reduction == "sum" else "position mean"
    if not active or compiled or not first_block or warned in warned_once:
        return None
    return MeanLossProbe(loss_reduction)


def warn_mean_loss(probe: MeanLossProbe, n: int, warned_once: set[str]) -> None:
    """Warn (once: ``"mean loss"`` joins ``warned_once``) when ``probe`` saw the loss of a block
    of ``n`` samples use a mean over the batch under ``loss_reduction="sum"`` (the probe's
    ``declared``), or (once: ``"position mean"``) a mean over the positions of the samples
    (tokens) under ``"mean"`` (call it from ``Run.__call__``: the warning points at the user's
    ``with run(...)``)."""
    if probe.declared == "mean":
        warn_position_mean(probe, n, warned_once)
        return
    what = probe.mean_over_batch(n)
    if what is None:
        return
    warned_once.add("mean loss")
    # a mean over the samples' positions (tokens) is not fixed by loss_reduction='mean'
    alt = (
        " (a mean over the samples' positions, as here, needs the sum: loss_reduction='mean' "
        "would leave each row scaled by n / positions counted)"
        if probe.mean_over_positions(n) is not None
        else ", or setup({'loss_reduction': 'mean'}) for a mean over the batch"
    )
    warnings.warn(
        f"nnstat: the loss of this run(...) block is a mean over its {n} samples ({what}), "
        "but the run's loss_reduction is 'sum' (the default): every stored gradient is its "
        "sample's gradient divided by the batch size (and a short last batch by its own "
        "size). Compute each sample's own loss summed (e.g. cross_entropy(..., "
        f"reduction='sum')){alt}.",
        stacklevel=4,
    )


def warn_position_mean(probe: MeanLossProbe, n: int, warned_once: set[str]) -> None:
    """Under ``loss_reduction="mean"``: warn (once) when the loss averaged over the positions
    of the ``n`` samples (``cross_entropy(logits.view(-1, V), ...)``, a token mean) rather
    than over the samples. The Run multiplies by ``n``, so each row is ``n / counted`` of its
    sample's (summed) gradient, a factor that changes from batch to batch with the positions
    counted (``ignore_index``, padding): influence across batches is scaled unevenly."""
    found = probe.mean_over_positions(n)
    if found is None:
        return
    warned_once.add("position mean")
    what, rows = found
    warnings.warn(
        f"nnstat: the loss of this run(...) block is a mean over {rows} rows ({what}), "
        f"{rows // n} per sample (positions, tokens), not over its {n} samples: with "
        f"loss_reduction='mean' every stored gradient is {n}/(positions counted) of its "
        "sample's own (summed) gradient, a factor that changes from batch to batch with the "
        "positions counted (ignore_index, padding). Sum the loss over positions (e.g. "
        "cross_entropy(..., reduction='sum')) and keep loss_reduction='sum' (the default).",
        stacklevel=4,
    )
