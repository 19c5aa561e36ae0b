"""Module activations through the capture engine; the recorder's reduction vs nnstat.describe."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nnstat.recorder import STAT_NAMES, Recorder, read_step_meta, read_step_stats, segment_stats


def test_segment_stats_agree_with_foundation_summarize() -> None:
    from nnstat.describe import summarize

    torch.manual_seed(0)
    xs = [torch.randn(4, 9), torch.randn(17) * 3 + 1, torch.randn(2, 3, 5)]
    xs[1][3] = float("nan")
    ours = segment_stats(xs).double()
    names = {"mean": "mean", "std": "std", "min": "min", "max": "max", "abs_max": "abs_max"}
    names |= {"norm": "l2", "nonfinite": "nonfinite", "numel": "numel"}
    theirs = summarize(xs, [names[s] for s in STAT_NAMES])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_track_activations_records_inputs_and_output_gradients(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    rec = Recorder(tmp_path, every=2, sample_k=2)
    rec.track_module(model, prefix="net.")
    assert rec.track_activations(model, prefix="net.", loss_reduction="mean") == ["0", "2"]
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for step in range(2):
        rec.start_batch(step)
        # the engine's hooks only run inside recorded batches
        assert (rec._engine._ctx is not None) == (step == 0)
        out = rec.register_tensor("out", model(x), role="output")
        loss = rec.register_tensor("loss", (out - y).pow(2).mean(), role="loss")
        model.zero_grad()
        loss.backward()
        rec.finish_batch()
    meta = read_step_meta(rec.path)
    assert len(meta) == 1
    meta = meta[0]
    stats = read_step_stats(rec.path, "train-000000000")
    r = meta["rows"]

    def row(tensor: str, stream: str, sample: int = -1) -> np.ndarray:
        for i in range(len(r["tensor"])):
            if (r["tensor"][i], r["stream"][i], r["sample"][i]) == (tensor, stream, sample):
                return stats[i]
        raise KeyError((tensor, stream, sample))

    h = torch.tanh(model[0](x)).detach()
    col = {s: i for i, s in enumerate(STAT_NAMES)}
    np.testing.assert_allclose(row("2:input", "forward")[col["norm"]], float(h.norm()), rtol=1e-5)
    np.testing.assert_allclose(row("0:input", "forward", 1)[col["mean"]], float(x[1].mean()), 1e-5)
    # output gradient of the first layer: autograd on the batch loss (mean), not per-sample
    z = model[0](x).detach().requires_grad_(True)
    (gz,) = torch.autograd.grad((model[2](torch.tanh(z)) - y).pow(2).mean(), z)
    np.testing.assert_allclose(row("0:output", "gradient")[col["norm"]], float(gz.norm()), 1e-5)
    np.testing.assert_allclose(
        row("0:output", "gradient", 0)[col["abs_max"]], float(gz[0].abs().max()), 1e-5
    )
    with pytest.raises(KeyError):
        row("0:output", "forward")  # the engine gives no output values, so none are invented
    doc = json.loads((rec.path / "graphs" / f"{meta['graphs']['0']}.json").read_text())
    edges = {tuple(e) for e in doc["edges"]}
    assert {
        ("0:input", "0:output"),
        ("net.0.weight", "0:output"),
        ("net.2.bias", "2:output"),
    } <= edges
    rec.close()
    assert all(not m._forward_hooks for m in model.modules())
