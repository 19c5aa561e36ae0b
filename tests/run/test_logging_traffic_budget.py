"""Traffic budget of rank-64 logging of every module of GPT-2 small (batch 8 x 512), counted on
``meta`` by ``benchmarks/logging_traffic.py`` (no memory, no arithmetic: seconds): bytes the
logged pass's ops read and write beyond the plain forward+backward (an ``out=`` tensor counted
as written, not read), bytes it allocates beyond it (new op outputs), host reads in the step,
and tensors at least the size of the logits.

It adds 7.3 GB moved, 0.44 GB allocated and no host read; itemised in docs/store.md:
each watched module's captured rows read once by its projection (3.6 GB with the tied head's
logits gradient), the weights guard's one checksum of every weight per block (2.0 GB: a cat
of each dtype group's words, then two reductions of them) and LayerNorm's per-sample
gradients (1.6 GB: five passes over ``[N, T, D]`` per LayerNorm).
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
    assert moved <= 7.35e9, (moved, items)
    assert allocated <= 0.5e9, (allocated, logged.allocated_by_file)
    # the weights guard: one checksum per block, a cat of the words into a kept buffer (read
    # and written once) then two reductions of them (no product): 4 x 124.4M words x 4 bytes
    assert logged.by_file["run/weights.py"] <= 2.0e9, items
    # LayerNorm (25 modules): five passes over [N, T, D] each (read x and b, write and read
    # b∘x, read b: no x̂, no statistics recomputed), next to [N, T] and [N, D] ones
    nt_d = 8 * 512 * 768 * 4
    assert logged.by_file["capture/kinds/layernorm.py"] <= 25 * 5 * nt_d * 1.01, items
    # b∘x is its one [N, T, D] temporary (25 modules x 12.6 MB), next to a few [N, D] sums
    assert logged.allocated_by_file["capture/kinds/layernorm.py"] <= 25 * 8 * (512 + 8) * 768 * 4
    assert logged.reads == 0  # nothing read back in the step
    # no tensor the size of the logits beyond those the plain pass makes
    assert sorted(logged.sizes) == sorted(plain.sizes) and logits in plain.sizes
