"""Tracker guards against silent misuse: step() before optimizer.step(), and an optimizer that
does not hold the model's parameters. References are numpy norms of the weights themselves."""

import gc
import re
import warnings

import numpy as np
import pytest
import torch
from nnstat.integrations._hooks import StatsOptions, StepStats
from torch import nn

import nnstat

ORDER = r"optimizer\.step\(\) has not run since"


def setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def backward(model, i):
    g = torch.Generator().manual_seed(50 + i)
    x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


def flat(t):
    return t.detach().double().numpy().ravel()


def ratio_keys(metrics):
    return [k for k in metrics if k.startswith(("update/", "trust_ratio/", "update_ratio/"))]


KINDS = [
    pytest.param({"background": False}, id="sync"),
    pytest.param({"background": True}, id="background"),
    pytest.param({"background": False, "histograms": True, "bins": 4}, id="unfused"),
]


@pytest.mark.parametrize("kw", KINDS)
def test_step_before_optimizer_step_warns_once_and_logs_no_fake_update(kw):
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, **kw)
    w0 = flat(model[0].weight).copy()
    logged = []
    with pytest.warns(UserWarning, match=ORDER) as rec:
        for i in range(3):
            opt.zero_grad()
            backward(model, i)
            logged.append(dict(tracker.step()))  # wrong order: before optimizer.step()
            opt.step()
    tracker.close()
    order = [str(w.message) for w in rec if re.search(ORDER, str(w.message))]
    assert len(order) == 1  # warned once, at the first call
    msg = order[0]
    assert "call tracker.step() once per iteration, after optimizer.step()" in msg.lower()
    assert "created" in msg and "update/, trust_ratio/ and update_ratio/" in msg
    # the first call had no optimizer step since construction: an update of exactly zero and
    # a trust ratio of inf would be fake; they are absent, the rest is there and right
    first = logged[0]
    assert ratio_keys(first) == []
    assert first["weight/0.weight/l2"] == pytest.approx(np.linalg.norm(w0), rel=1e-5)
    assert "grad/0.weight/l2" in first
    # later calls follow one optimizer step each: measured (lagging, as the warning says)
    assert all(np.isfinite(m["trust_ratio/0.weight"]) for m in logged[1:])


@pytest.mark.parametrize("kw", KINDS)
def test_skipped_optimizer_step_leaves_out_that_update_and_measures_the_next(kw):
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, **kw)
    weights = []
    out = []
    with pytest.warns(UserWarning, match=r"call 1\).*previous tracker\.step\(\)"):
        for i in range(3):
            opt.zero_grad()
            backward(model, i)
            weights.append({n: flat(p).copy() for n, p in model.named_parameters()})
            if i != 1:  # step 1 skipped, as torch.amp.GradScaler does after inf gradients
                opt.step()
            out.append(dict(tracker.step()))
    tracker.close()
    assert ratio_keys(out[0]) and not ratio_keys(out[1])
    for n, p in model.named_parameters():
        # step 2's update is the change made by optimizer step 2 alone (from the weights
        # before it, which are those after step 0)
        upd = flat(p) - weights[2][n]
        assert out[2][f"update/{n}/l2"] == pytest.approx(np.linalg.norm(upd), rel=1e-4)
        assert out[2][f"trust_ratio/{n}"] == pytest.approx(
            np.linalg.norm(flat(p)) / np.linalg.norm(upd), rel=1e-4
        )


def test_right_order_and_every_n_never_warn_and_hooks_are_removed():
    model, opt = setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracker = nnstat.Tracker(model, opt, every=3)
        for i in range(7):
            opt.zero_grad()
            backward(model, i)
            opt.step()
            out = tracker.step()
            if out is not None:
                assert np.isfinite(out["trust_ratio/2.weight"])
        tracker.close()
    assert not opt._optimizer_step_post_hooks
    # framework callbacks build a Tracker per logged step and never close it: the counting
    # hook goes with the Tracker instead of piling up on the optimizer
    for i in range(3):
        t = nnstat.Tracker(model, opt, background=False)
        backward(model, i)
        opt.step()
        t.step()
    del t
    gc.collect()
    assert not opt._optimizer_step_post_hooks


def test_optimizer_without_the_models_parameters_raises_with_the_fix():
    model, _ = setup()
    other, opt = setup()  # an optimizer of another instance (same architecture)
    with pytest.raises(ValueError, match=r"holds none of the 4 trainable") as e:
        nnstat.Tracker(model, opt)
    assert "0.weight" in str(e.value) and "optimizer=None" in str(e.value)
    nnstat.Tracker(other, opt).close()  # its own model is fine


def test_optimizer_with_some_parameters_warns_naming_the_others():
    model, _ = setup()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"does not hold 2 of the 4") as rec:
        nnstat.Tracker(model, opt)
    assert "['2.weight', '2.bias']" in str(rec[0].message) and "include=" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nnstat.Tracker(model, opt, include=r"^0\.")  # only what it updates: fine
        model[2].requires_grad_(False)  # frozen layers are not expected in the optimizer
        nnstat.Tracker(model, opt)


def test_a_module_replaced_after_construction_is_refused_and_in_place_casts_are_not():
    # the Tracker held the old layer: it logged the replaced weights' norms as the model's
    model, _ = setup()
    tracker = nnstat.Tracker(model, stats=["l2"], groups=["weight"])
    model.double()  # in place: the same parameters, now float64
    got = tracker.step()
    for name, p in model.named_parameters():
        assert got[f"weight/{name}/l2"] == pytest.approx(np.linalg.norm(p.detach().numpy()))
    model[2] = nn.Linear(7, 3)
    with pytest.raises(
        ValueError, match=r"^Tracker: .*\['2\.weight', '2\.bias'\].*new Tracker"
    ) as e:
        tracker.step()
    assert "replaced" in str(e.value)
    tracker.close()
    fresh = nnstat.Tracker(model, stats=["l2"], groups=["weight"])
    got = fresh.step()
    assert got["weight/2.weight/l2"] == pytest.approx(np.linalg.norm(model[2].weight.detach()))
    fresh.close()


def test_framework_driver_falls_back_to_no_optimizer_states_for_flat_copies():
    # DeepSpeed ZeRO / master weights: the optimizer steps flat fp32 copies of the parameters
    model, _ = setup()
    flat_copy = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    opt = torch.optim.Adam([flat_copy], lr=0.05)
    hooks = StepStats(StatsOptions(noise_scale=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hooks.before_step(model, opt, log=True)
        backward(model, 0)
        flat_copy.grad = torch.ones_like(flat_copy)
        opt.step()
        with torch.no_grad():
            model[0].weight.add_(1.0)  # the copy is written back into the model
        metrics = hooks.after_step()
    assert "weight/0.weight/l2" in metrics and "grad/0.weight/l2" in metrics
    assert not any(k.startswith(("exp_avg/", "exp_avg_sq/")) for k in metrics)
    assert metrics["update/0.weight/l2"] == pytest.approx(np.sqrt(35), rel=1e-5)


@pytest.mark.parametrize("bad", [[1, 2], "adam", object()])
def test_optimizer_that_is_not_one_is_refused_at_construction(bad):
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer.*got "):
        nnstat.Tracker(model, optimizer=bad)


def test_a_sink_that_mutates_its_dict_does_not_change_what_others_get():
    def one_step(sinks):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        got = []
        tracker = nnstat.Tracker(
            model, opt, sinks=[*sinks, lambda m, s: got.append(dict(m))], background=False
        )
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        returned = dict(tracker.step())
        tracker.close()
        return got, returned

    def clearing(metrics, step):
        metrics.clear()

    def popping(metrics, step):
        metrics.pop(next(iter(metrics)))

    control, _ = one_step([])
    got, returned = one_step([clearing, popping])
    assert len(control[0]) > 3  # weight, grad and update statistics of both parameters
    assert got == control and returned == control[0]
