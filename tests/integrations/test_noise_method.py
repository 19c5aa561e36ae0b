"""The callbacks' noise-scale estimator choice: gradients that exist anyway first (accumulation's
micro-batches, then DDP's local gradients), per-sample norms otherwise; forced methods that
cannot work are refused with the reason."""

from __future__ import annotations

import pytest
from nnstat.integrations._noise_method import choose_method

DDP = object()  # stands for a DistributedDataParallel model (only its presence matters)


@pytest.mark.parametrize(
    ("accumulation", "ranks", "ddp", "batch", "expected"),
    [
        (1, 1, None, 8, "per_sample"),
        (4, 1, None, 8, "micro_batch"),
        (4, 2, DDP, 8, "micro_batch"),  # K local micro-batches per rank beat one local gradient
        (1, 2, DDP, 8, "ddp"),
        (1, 2, None, 8, "per_sample"),  # FSDP, DeepSpeed: no DDP model to hook
        (1, 2, DDP, None, "per_sample"),  # B_small unknown: never a guessed one
        (1, 1, DDP, 8, "per_sample"),
    ],
)
def test_auto_uses_the_gradients_the_loop_already_has(accumulation, ranks, ddp, batch, expected):
    assert choose_method("auto", accumulation, ranks, ddp, batch) == expected


@pytest.mark.parametrize(
    ("method", "accumulation", "ranks", "ddp", "batch", "match"),
    [
        ("micro_batch", 1, 2, DDP, 8, "needs gradient accumulation"),
        ("ddp", 1, 1, None, 8, "runs on 1 process"),
        ("ddp", 1, 2, None, 8, "no DistributedDataParallel model"),
        ("ddp", 2, 2, DDP, None, "batch size is unknown"),
        ("microbatch", 2, 1, None, 8, "must be one of"),
    ],
)
def test_a_forced_method_that_cannot_work_is_refused(
    method, accumulation, ranks, ddp, batch, match
):
    with pytest.raises(ValueError, match=match):
        choose_method(method, accumulation, ranks, ddp, batch)


def test_forced_methods_that_can_work_are_kept():
    assert choose_method("per_sample", 4, 2, DDP, 8) == "per_sample"
    assert choose_method("micro_batch", 2, 1, None, None) == "micro_batch"
    assert choose_method("ddp", 4, 2, DDP, 8) == "ddp"
