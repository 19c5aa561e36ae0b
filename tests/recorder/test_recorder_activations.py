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


class _SharedPositions(torch.nn.Module):
    """A position embedding fed ``[1, T]`` ids, broadcast over the batch (GPT-2's ``wpe``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(10, 4)
        self.pos = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1])[None])
        return self.head(torch.tanh(h).mean(1))


def test_shared_position_embedding_output_gradient_is_recorded_per_sample(tmp_path) -> None:
    torch.manual_seed(0)
    model = _SharedPositions()
    ids, y = torch.randint(0, 10, (3, 5)), torch.randint(0, 3, (3,))
    rec = Recorder(tmp_path, every=1, sample_k=3)
    rec.track_activations(model, loss_reduction="sum")
    rec.start_batch(0)
    loss = rec.register_tensor(
        "loss", torch.nn.functional.cross_entropy(model(ids), y, reduction="sum"), role="loss"
    )
    loss.backward()
    rec.finish_batch()
    rec.close()
    meta = read_step_meta(rec.path)[0]
    stats = read_step_stats(rec.path, "train-000000000")
    r = meta["rows"]
    col = {s: i for i, s in enumerate(STAT_NAMES)}
    # reference: each example's own gradient of its loss w.r.t. the position rows it used
    for i in range(3):
        p = model.pos(torch.arange(5)[None]).detach().requires_grad_(True)
        h = model.tok(ids[i : i + 1]) + p
        out = model.head(torch.tanh(h).mean(1))
        (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(out, y[i : i + 1]), p)
        found = [
            stats[k]
            for k in range(len(r["tensor"]))
            if (r["tensor"][k], r["sample"][k]) == ("pos:output", i)
        ]
        assert len(found) == 1, (i, found)
        np.testing.assert_allclose(found[0][col["norm"]], float(g.norm()), rtol=1e-5)
