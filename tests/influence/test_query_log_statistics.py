"""A query log's statistics (``nnstat.get_log()``) are read lazily, one module at a time, by
whoever uses them: ``get_log()`` allocates far less than the statistics file holds (it was
loaded whole into the log), a K-FAC fit on the log reads each tensor once, module after module,
and the scores are those of the same statistics held in a dict."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import nnstat
from nnstat.influence import compute_self_influence
from nnstat.influence.refine.memory import measure_peak
from nnstat.store.lazy import LazyStatistics

N_LAYERS, WIDTH = 6, 48


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(N_LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _log(tmp_path):
    model = _model()
    x = torch.randn(40, WIDTH)
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": [], "statistic": "kfac"})
    nnstat.watch(model)
    for lo in range(0, 32, 8):
        with run(data_id=list(range(lo, lo + 8))):
            model(x[lo : lo + 8]).pow(2).sum().backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.eval()
    with run(data_id=[f"q{i}" for i in range(8)]):
        model(x[32:]).pow(2).sum().backward()
    model.zero_grad()
    log, peak = measure_peak(nnstat.get_log, torch.device("cpu"))
    nnstat.unwatch()
    return log, peak


def test_query_log_reads_its_statistics_one_module_at_a_time(tmp_path, monkeypatch):
    log, peak = _log(tmp_path)
    total = sum(log.statistics[k].nbytes for k in log.statistics)
    modules = {k.split("/")[0] for k in log.statistics}
    assert len(modules) == N_LAYERS and total > 8 * WIDTH * WIDTH * N_LAYERS
    assert peak < total / 3, (peak, total)  # loaded whole into the log, it was >= total
    eager = dataclasses.replace(log, statistics={k: log.statistics[k] for k in log.statistics})

    reads: list[str] = []
    read = LazyStatistics._read
    monkeypatch.setattr(LazyStatistics, "_read", lambda s, f, k: reads.append(k) or read(s, f, k))
    lazy = compute_self_influence(log, preconditioner="kfac", damping=0.1)
    assert len(reads) == len(set(reads)) == 2 * N_LAYERS  # each factor read once, when used
    order = [k.split("/")[0] for k in reads]
    assert all(order[i] == order[i + 1] for i in range(0, len(order), 2))  # module by module
    reads.clear()
    whole = compute_self_influence(eager, preconditioner="kfac", damping=0.1)
    assert reads == []
    torch.testing.assert_close(lazy.scores, whole.scores, rtol=0, atol=0)
