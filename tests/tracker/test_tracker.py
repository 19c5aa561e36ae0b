"""Tracker: metrics against independently computed references."""

import math
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn

import nnstat
from nnstat.describe import Histogram


def setup(opt_cls=torch.optim.Adam, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = opt_cls(model.parameters(), lr=0.05, **kw)
    return model, opt


def one_step(model, opt):
    opt.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(16, 5)), torch.randint(0, 3, (16,))).backward()
    opt.step()


def l2(t):
    return float(np.linalg.norm(t.detach().double().numpy().ravel()))


@pytest.mark.parametrize("background", [True, False])
def test_default_step_matches_references(background):
    model, opt = setup()
    sink_calls = []
    tracker = nnstat.Tracker(
        model, opt, sinks=[lambda m, s: sink_calls.append((s, dict(m)))], background=background
    )
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        one_step(model, opt)
        metrics = tracker.step()
    # background: step 2 reaches the sinks when read, flushed or at the next step
    assert [s for s, _ in sink_calls] == ([0, 1] if background else [0, 1, 2])
    tracker.flush()
    assert [s for s, _ in sink_calls] == [0, 1, 2] and sink_calls[-1][1] == metrics
    for n, p in model.named_parameters():
        st = opt.state[p]
        assert metrics[f"weight/{n}/l2"] == pytest.approx(l2(p), rel=1e-5)
        assert metrics[f"weight/{n}/rms"] == pytest.approx(l2(p) / math.sqrt(p.numel()), rel=1e-5)
        assert metrics[f"grad/{n}/abs_max"] == pytest.approx(p.grad.abs().max().item(), rel=1e-6)
        assert metrics[f"exp_avg/{n}/l2"] == pytest.approx(l2(st["exp_avg"]), rel=1e-5)
        assert metrics[f"exp_avg_sq/{n}/abs_max"] == pytest.approx(
            st["exp_avg_sq"].max().item(), rel=1e-6
        )
        assert metrics[f"grad/{n}/nonfinite"] == 0
        upd = p.detach() - before[n]
        assert metrics[f"update/{n}/l2"] == pytest.approx(l2(upd), rel=1e-4)
        assert metrics[f"trust_ratio/{n}"] == pytest.approx(l2(p) / l2(upd), rel=1e-4)
        assert metrics[f"update_ratio/{n}"] == pytest.approx(l2(upd) / l2(p), rel=1e-4)
    assert not any(k.startswith("step/") for k in metrics)  # Adam's scalar step is not a layer stat


class _Scaled(nn.Module):
    """A linear map times a learnt 0-d scale (a parameter whose shape is a scalar's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.scale = nn.Linear(5, 3), nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.scale * self.fc(x)


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("opt_cls", [torch.optim.Adafactor, torch.optim.Adam])
def test_every_state_tensor_is_logged_whatever_its_shape_and_no_step_counter(opt_cls, background):
    """Adafactor keeps factored second moments (``row_var`` ``[3, 1]``, ``col_var`` ``[1, 5]``)
    for a matrix, ``variance`` for a vector: each is a state of its own shape, logged against
    numpy. Adam's ``step`` counter is a scalar, like a 0-d parameter itself: not a layer
    statistic, while that parameter's ``exp_avg`` is."""
    model = _Scaled()
    opt = opt_cls(model.parameters(), lr=0.05)
    tracker = nnstat.Tracker(model, opt, stats=["l2", "abs_max"], background=background)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        opt.step()
        metrics = tracker.step()
    metrics = dict(metrics)
    tracker.close()
    logged = set()
    for n, p in model.named_parameters():
        for key, v in opt.state[p].items():
            if key == "step":
                continue
            logged.add(key)
            assert metrics[f"{key}/{n}/l2"] == pytest.approx(l2(v), rel=1e-6), (key, n)
            assert metrics[f"{key}/{n}/abs_max"] == pytest.approx(float(v.abs().max()), rel=1e-6)
    groups = {k.split("/")[0] for k in metrics}
    assert logged <= groups and "step" not in groups
    expected = {"row_var", "col_var", "variance"} if opt_cls is torch.optim.Adafactor else set()
    assert expected <= logged
    assert ("exp_avg/scale/l2" in metrics) == (opt_cls is torch.optim.Adam)


class _Strided(nn.Module):
    """Parameters whose storage is not in their logical order: a transposed matrix, every
    second row of one, and a permuted 3-d tensor, with a contiguous one beside them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.t = nn.Parameter(torch.randn(6, 4).t())
        self.rows = nn.Parameter(torch.randn(8, 3)[::2])
        self.perm = nn.Parameter(torch.randn(3, 5, 2).permute(2, 0, 1))
        self.plain = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return (
            (x @ self.t).sum() + (x @ self.plain).pow(2).sum() * self.rows.sum() + self.perm.sum()
        )


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("stats", [None, ("l2", "rms", "abs_max", "nonfinite")])
def test_non_contiguous_parameters_match_numpy_every_step(stats, background):
    """The default statistics reduce weights and updates in one blocked pass over flat views,
    refreshing the snapshot block by block; a snapshot copied with the parameter's strides had
    a flat view that was a copy, so the refresh was lost and every later update was measured
    from the first weights. Each step's update against numpy, over three steps."""
    model = _Strided()
    assert not any(p.is_contiguous() for n, p in model.named_parameters() if n != "plain")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    tracker = nnstat.Tracker(model, opt, stats=stats, background=background)
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        model(torch.randn(5, 4)).backward()
        opt.step()
        metrics = dict(tracker.step())
        for n, p in model.named_parameters():
            for group, t in (("weight", p), ("grad", p.grad), ("update", p.detach() - before[n])):
                a = t.detach().double().numpy().ravel()
                assert metrics[f"{group}/{n}/l2"] == pytest.approx(np.linalg.norm(a), rel=1e-5)
                assert metrics[f"{group}/{n}/abs_max"] == pytest.approx(np.abs(a).max(), rel=1e-5)
    tracker.close()


def test_lbfgs_whole_model_state_is_not_a_layer_statistic():
    """L-BFGS keeps its flat direction and gradient of the whole model under the first
    parameter: neither is that layer's state, so no group is made of them."""
    model, opt = setup(torch.optim.LBFGS, history_size=3, max_iter=2)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    tracker = nnstat.Tracker(model, opt, stats=["l2"], background=False)
    opt.step(closure)
    metrics = dict(tracker.step())
    tracker.close()
    first = next(iter(opt.state.values()))
    flat = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() == 1]
    assert "d" in flat
    assert not {k.split("/")[0] for k in metrics} & set(flat)
    assert {k.split("/")[0] for k in metrics} == {
        "weight", "grad", "update", "trust_ratio", "update_ratio"
    }  # fmt: skip


def test_every_n_and_update_over_one_step_with_signed_stats():
    model, opt = setup(torch.optim.SGD, momentum=0.9)
    tracker = nnstat.Tracker(model, opt, every=3, stats=["mean", "min", "max", "skew", "l2"])
    logged = []
    for i in range(7):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        one_step(model, opt)
        out = tracker.step()
        if out is not None:
            logged.append(i)
            upd = {
                n: (p.detach() - before[n]).double().numpy().ravel()
                for n, p in model.named_parameters()
            }
            for n, u in upd.items():
                assert out[f"update/{n}/mean"] == pytest.approx(u.mean(), rel=1e-4, abs=1e-9)
                assert out[f"update/{n}/min"] == pytest.approx(u.min(), rel=1e-4)
                assert out[f"update/{n}/max"] == pytest.approx(u.max(), rel=1e-4)
                if u.size > 3:
                    assert out[f"update/{n}/skew"] == pytest.approx(
                        scipy.stats.skew(u, bias=True), rel=1e-3, abs=1e-4
                    )
            assert "momentum_buffer/0.weight/l2" in out
    assert logged == [0, 3, 6]


def test_histograms_providers_and_include():
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, histograms=True, include=r"^2\.", bins=8)
    tracker.add_provider(lambda: {"custom/value": 1.5})
    one_step(model, opt)
    out = tracker.step()
    assert out["custom/value"] == 1.5
    assert not any("/0.weight/" in k for k in out)
    h = out["weight/2.weight/hist"]
    assert isinstance(h, Histogram) and h.counts.sum() == 21 and len(h.edges) == 9
    assert tracker.latest is out
    tracker.add_provider(lambda: [1, 2])
    one_step(model, opt)
    with pytest.raises(TypeError, match="not a dict"):
        tracker.step()


def test_missing_grad_warns_once_and_nonfinite_counted():
    model, _ = setup()
    tracker = nnstat.Tracker(model, groups=["weight", "grad"], stats=["l2", "nonfinite"])
    with pytest.warns(UserWarning, match="no gradient") as rec:
        out = tracker.step()
        tracker.step()
    assert len(rec) == 1 and not any(k.startswith("grad/") for k in out)
    model(torch.randn(2, 5)).sum().backward()
    model[2].bias.grad[0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tracker.step()
    assert out["grad/2.bias/nonfinite"] == 1
    assert out["grad/2.bias/l2"] == pytest.approx(l2(model[2].bias.grad[1:]), rel=1e-5)


def test_sinks_objects_close_and_bad_arguments():
    class Sink:
        def __init__(self):
            self.rows, self.closed = [], False

        def log(self, metrics, step):
            self.rows.append(step)

        def close(self):
            self.closed = True

    model, opt = setup()
    sink = Sink()
    with nnstat.Tracker(model, opt, sinks=[sink]) as tracker:
        model(torch.randn(1, 5)).sum().backward()
        opt.step()
        tracker.step(step=10)
    assert sink.rows == [10] and sink.closed
    with pytest.raises(TypeError, match="log"):
        nnstat.Tracker(model, sinks=[42])
    for single in (sink, print):  # one sink not in a list
        with pytest.raises(TypeError, match=r"sinks must be a list.*sinks=\[\.\.\.\]"):
            nnstat.Tracker(model, sinks=single)
    with pytest.raises(ValueError, match="valid groups"):
        nnstat.Tracker(model, groups=["weights"])
    with pytest.raises(ValueError, match="every"):
        nnstat.Tracker(model, every=0)
    with pytest.raises(ValueError, match="valid names"):
        nnstat.Tracker(model, stats=["l2", "rsm"])
    with pytest.raises(ValueError, match="no parameter to track"):
        nnstat.Tracker(model, include="nothing")


def test_fused_default_path_every_two_with_nonfinite_weights():
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, every=2)
    for i in range(5):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        one_step(model, opt)
        if i == 4:
            with torch.no_grad():
                model[0].bias[1] = float("inf")
        out = tracker.step()
        assert (out is not None) == (i % 2 == 0)
        if out is None:
            continue
        for n, p in model.named_parameters():
            w = p.detach().double()
            upd = w - before[n].double()
            if i == 4 and n == "0.bias":
                finite = torch.isfinite(w)
                assert out["weight/0.bias/nonfinite"] == 1
                assert out["weight/0.bias/l2"] == pytest.approx(l2(w[finite]), rel=1e-6)
                assert out["update/0.bias/nonfinite"] == 1
                assert out["update/0.bias/abs_max"] == pytest.approx(
                    upd[torch.isfinite(upd)].abs().max().item(), rel=1e-6
                )
                continue
            assert out[f"weight/{n}/abs_max"] == pytest.approx(w.abs().max().item(), rel=1e-6)
            assert out[f"update/{n}/l2"] == pytest.approx(l2(upd), rel=1e-4)
            assert out[f"update/{n}/abs_max"] == pytest.approx(upd.abs().max().item(), rel=1e-4)
            assert out[f"trust_ratio/{n}"] == pytest.approx(l2(w) / l2(upd), rel=1e-4)
    assert tracker._plan(refresh=False).paired
