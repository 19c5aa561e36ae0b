"""Traffic budget of rank-64 logging of every module of GPT-2 small (batch 8 x 512), counted on
``meta`` by ``benchmarks/logging_traffic.py`` (no memory, no arithmetic: seconds): bytes the
logged pass's ops read and write beyond the plain forward+backward, bytes it allocates beyond
it (new op outputs), host reads in the step, and tensors at least the size of the logits.

It adds 8.4 GB moved, 0.44 GB allocated and no host read; itemised in docs/benchmarks.md,
mostly each watched module's captured rows read by its projection (4 GB), the weights guard's
one checksum of every weight per block (2.5 GB) and LayerNorm's ``x̂`` (2.2 GB).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def _bench(monkeypatch):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "logging_traffic.py"
    spec = importlib.util.spec_from_file_location("logging_traffic_bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    return bench


def test_logging_gpt2_small_stays_within_its_traffic_budget(monkeypatch):
    plain, logged, logits = _bench(monkeypatch).measure(layers=12, batch=8, seq=512, rank=64)
    moved = sum(logged.bytes.values()) - sum(plain.bytes.values())
    allocated = sum(logged.allocated.values()) - sum(plain.allocated.values())
    items = {k: round(v / 1e9, 3) for k, v in logged.by_file.most_common() if k != "-"}
    assert moved <= 8.5e9, (moved, items)
    assert allocated <= 0.5e9, (allocated, logged.allocated_by_file)
    # the weights guard: one checksum per block, two reductions of the words (no product)
    assert logged.by_file["run/weights.py"] <= 2.6e9, items
    # LayerNorm: x̂ is its one [N, T, D] temporary (25 modules x 12.6 MB), next to a
    # few [N, D] sums
    assert logged.allocated_by_file["capture/kinds/layernorm.py"] <= 25 * 8 * (512 + 8) * 768 * 4
    assert logged.reads == 0  # nothing read back in the step
    # no tensor the size of the logits beyond those the plain pass makes
    assert sorted(logged.sizes) == sorted(plain.sizes) and logits in plain.sizes
