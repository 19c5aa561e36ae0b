"""Recorder: statistics against numpy / torch.func references, schedules, graphs, storage."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, vmap

from nnstat.recorder import (
    STAT_NAMES,
    Recorder,
    Schedule,
    autograd_edges,
    graph_document,
    graph_hash,
    read_step_meta,
    read_step_stats,
    read_step_values,
    segment_stats,
)
from nnstat.recorder.schedule import make_schedule
from nnstat.recorder.storage import read_kpis


def np_stats(x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    f = x[np.isfinite(x)]
    return {
        "mean": f.mean(),
        "std": f.std(),
        "min": f.min(),
        "max": f.max(),
        "abs_max": np.abs(f).max(),
        "norm": np.sqrt((f**2).sum()),
        "nonfinite": float((~np.isfinite(x)).sum()),
        "numel": float(x.size),
    }


def assert_row(row: np.ndarray, ref: dict[str, float], rtol: float = 1e-5) -> None:
    for j, name in enumerate(STAT_NAMES):
        np.testing.assert_allclose(row[j], ref[name], rtol=rtol, atol=1e-6, err_msg=name)


def test_segment_stats_matches_numpy_with_nonfinite() -> None:
    torch.manual_seed(0)
    xs = [torch.randn(5, 7), torch.randn(3) * 100, torch.randn(2, 2, 2), torch.tensor([4.0])]
    xs[0][1, 2] = float("nan")
    xs[2][0, 1, 1] = float("inf")
    xs[2][1, 0, 0] = -float("inf")
    out = segment_stats(xs).numpy()
    assert out.shape == (4, len(STAT_NAMES))
    for row, x in zip(out, xs, strict=True):
        assert_row(row, np_stats(x.numpy()))
    empty = segment_stats([torch.tensor([float("nan"), float("nan")])]).numpy()[0]
    assert np.isnan(empty[STAT_NAMES.index("mean")]) and empty[STAT_NAMES.index("nonfinite")] == 2
    assert np.isnan(empty[STAT_NAMES.index("norm")])  # no finite entry: unknown, not zero


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, rec: Recorder | None = None) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if rec is not None:
            rec.register_tensor("hidden", h)
        return self.fc2(h)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y, reduction="sum")


def one_step(rec: Recorder, model: MLP, x: torch.Tensor, y: torch.Tensor, step: int):
    rec.start_batch(step)
    rec.start_iteration()
    rec.register_tensor("x", x, role="input")
    rec.register_tensor("y", y, role="target")
    out = rec.register_tensor("out", model(x, rec), role="output")
    loss = rec.register_tensor("loss", loss_fn(out, y), role="loss")
    rec.add_tensor_connection("x", "hidden")
    rec.finish_iteration()
    model.zero_grad()
    loss.backward()
    rec.record_kpi("loss", loss.detach())
    return rec.finish_batch(), out, loss


def row_of(meta: dict, tensor: str, stream: str, sample: int = -1, iteration: int | None = None):
    r = meta["rows"]
    for i in range(len(r["tensor"])):
        if (r["tensor"][i], r["stream"][i], r["sample"][i]) == (tensor, stream, sample) and (
            iteration is None or r["iteration"][i] == iteration
        ):
            return i
    raise KeyError((tensor, stream, sample))


def test_recorded_statistics_match_independent_references(tmp_path) -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    rec = Recorder(tmp_path, group="g", every=1, sample_k=3, raw_max_numel=20)
    rec.track_module(model)
    record, out, loss = one_step(rec, model, x, y, 0)
    stats = read_step_stats(rec.path, "train-000000000")
    meta = read_step_meta(rec.path)[0]
    assert meta == json.loads(json.dumps(record))
    # forward statistics: batch and first samples
    h_ref = torch.tanh(model.fc1(x)).detach().numpy()
    assert_row(stats[row_of(meta, "hidden", "forward")], np_stats(h_ref))
    for i in range(3):
        assert_row(stats[row_of(meta, "hidden", "forward", i)], np_stats(h_ref[i]))
    assert meta["rows"]["sample"].count(3) == 0
    # gradient of the intermediate tensor, reference via autograd on a fresh graph
    h = torch.tanh(model.fc1(x)).detach().requires_grad_(True)
    (g_h,) = torch.autograd.grad(loss_fn(model.fc2(h), y), h)
    assert_row(stats[row_of(meta, "hidden", "gradient")], np_stats(g_h.numpy()))
    assert_row(stats[row_of(meta, "hidden", "gradient", 1)], np_stats(g_h[1].numpy()))
    # parameter gradient: sum of torch.func per-sample gradients
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    g_w = per_sample["fc1.weight"].sum(0).numpy()
    assert_row(stats[row_of(meta, "fc1.weight", "gradient", iteration=-1)], np_stats(g_w))
    assert_row(stats[row_of(meta, "fc2.bias", "forward")], np_stats(model.fc2.bias.detach()))
    # raw values of small tensors, KPIs, roles, module summary
    vals = read_step_values(rec.path, "train-000000000")
    torch.testing.assert_close(vals["0/forward/loss"], loss.detach())
    torch.testing.assert_close(vals["-1/forward/fc2.bias"], model.fc2.bias.detach())
    assert "0/forward/hidden" not in vals  # 48 elements > raw_max_numel
    assert meta["kpis"]["loss"] == pytest.approx(float(loss.detach()))
    assert meta["roles"]["y"] == "target" and meta["roles"]["fc1.weight"] == "parameter"
    trial = json.loads((rec.path / "trial.json").read_text())
    mods = {m["name"]: m for m in trial["modules"]}
    assert mods["fc1"]["params_own"] == 36 and mods["(root)"]["params_total"] == 36 + 21


def test_dependency_graph_and_stable_hash(tmp_path, run_python) -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    digests = []
    for trial in ("a", "b"):
        rec = Recorder(tmp_path, group="g", trial=trial, every=1)
        rec.track_module(model)
        record, _, _ = one_step(rec, model, x, y, 0)
        digests.append(record["graphs"]["0"])
        doc = json.loads((rec.path / "graphs" / f"{record['graphs']['0']}.json").read_text())
    assert digests[0] == digests[1]
    expected = {
        ("fc1.weight", "hidden"),
        ("fc1.bias", "hidden"),
        ("x", "hidden"),  # manual edge: x does not require grad
        ("hidden", "out"),
        ("fc2.weight", "out"),
        ("fc2.bias", "out"),
        ("out", "loss"),
    }
    assert {tuple(e) for e in doc["edges"]} == expected
    assert len(doc["nodes"]) == 9  # 4 parameters + x, y, hidden, out, loss
    # same document hashed in a fresh interpreter (PYTHONHASHSEED differs) gives the same digest
    code = (
        "import json,sys; from nnstat.recorder import graph_hash; "
        "print(graph_hash(json.loads(sys.stdin.read())))"
    )
    env_out = run_python(
        "-c",
        code,
        input=json.dumps(doc),
        capture_output=True,
        text=True,
        check=True,
        # another hash seed; PYTHONPATH kept (a checkout run without installing needs it)
        env={"PYTHONHASHSEED": "123", "PATH": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    assert env_out.stdout.strip() == digests[0]
    changed = graph_document([tuple(n) for n in doc["nodes"]], expected - {("out", "loss")})
    assert graph_hash(changed) != digests[0]


def test_autograd_edges_skip_unregistered_ops_and_handle_depth() -> None:
    w = torch.randn(3, requires_grad=True)
    a = w * 2
    b = (a.exp() + 1).log()  # two unregistered ops between a and b
    c = b.sum() + a.sum()
    assert autograd_edges([("w", w), ("a", a), ("b", b), ("c", c)]) == {
        ("w", "a"),
        ("a", "b"),
        ("b", "c"),
        ("a", "c"),
    }
    z = w
    for _ in range(3000):  # deeper than Python's recursion limit
        z = z * 1.0
    assert autograd_edges([("w", w), ("z", z)]) == {("w", "z")}
    # outputs of one multi-output op are told apart by their output number
    u, v = (w * 3).chunk(3)[:2]
    s = u.sum() * v.sum()
    assert autograd_edges([("w", w), ("u", u), ("v", v), ("s", s)]) == {
        ("w", "u"),
        ("w", "v"),
        ("u", "s"),
        ("v", "s"),
    }
    with pytest.raises(ValueError, match="unregistered"):
        graph_document([("a", "input")], [("a", "b")])


def test_schedules_backoff_fixed_steps_and_retroactive(tmp_path) -> None:
    s = Schedule(every=2, backoff=2.0, max_every=8, steps=(5,))
    gaps, t, k = [], 0, 0
    while t < 60:
        gaps.append(t)
        t, k = t + min(8, round(2 * 2.0**k)), k + 1
    assert [t for t in range(60) if s.is_scheduled(t)] == sorted(set(gaps) | {5})
    assert [t for t in range(10) if Schedule(every=3).is_scheduled(t)] == [0, 3, 6, 9]
    with pytest.raises(ValueError) as bad_key:
        make_schedule({"evry": 3})
    assert str(bad_key.value) == (
        "unknown schedule key 'evry'; valid keys: every, backoff, max_every, start, steps, retroactive"
    )
    torch.manual_seed(0)
    model = MLP()
    rec = Recorder(
        tmp_path,
        every=None,
        schedules={"test": {"every": None, "retroactive": True}, "train": {"every": 4}},
    )
    rec.track_module(model)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    for step in range(6):
        rec.start_batch(step, type_of_execution="test")
        with torch.no_grad():
            out = rec.register_tensor("out", model(x), role="output")
        rec.decide_recording_of_batch(bool(out.abs().max() > 0) and step % 2 == 1)
        rec.finish_batch()
        one_step(rec, model, x, y, step)
    metas = read_step_meta(rec.path)
    assert [(m["type_of_execution"], m["step"], m["reason"]) for m in metas] == [
        ("test", 1, "decision"),
        ("test", 3, "decision"),
        ("test", 5, "decision"),
        ("train", 0, "schedule"),
        ("train", 4, "schedule"),
    ]
    assert not out.requires_grad  # no_grad forward values are recorded without changing them
    rec.start_batch(6, type_of_execution="other")  # falls back to the default: never
    with pytest.raises(ValueError, match="retroactive=True"):
        rec.decide_recording_of_batch(True)
    assert rec.finish_batch() is None


def test_multiple_iterations_have_their_own_rows_and_graphs(tmp_path) -> None:
    torch.manual_seed(0)
    cell = torch.nn.Linear(3, 3)
    rec = Recorder(tmp_path, every=1, sample_k=0)
    rec.track_module(cell, prefix="cell.")
    rec.start_batch(0)
    state, total = torch.zeros(2, 3), 0.0
    states = []
    for _ in range(3):
        rec.start_iteration()
        state = rec.register_tensor("state", torch.tanh(cell(state)))
        states.append(state)
        if len(states) == 3:
            rec.register_tensor("extra", state * 2)
        rec.finish_iteration()
        total = total + state.pow(2).sum()
    rec.register_tensor("total", total, role="loss")  # after finish_iteration: the last pass
    total.backward()
    record = rec.finish_batch()
    assert record["iterations"] == 3
    assert ("total", 2) in zip(record["rows"]["tensor"], record["rows"]["iteration"], strict=True)
    stats = read_step_stats(rec.path, "train-000000000")
    meta = read_step_meta(rec.path)[0]
    for it, s in enumerate(states):
        assert_row(stats[row_of(meta, "state", "forward", iteration=it)], np_stats(s.detach()))
    # iteration 1's state gradient: from its own loss term and through the later iterations
    s1 = states[1].detach().requires_grad_(True)
    s2 = torch.tanh(cell(s1))
    (g1,) = torch.autograd.grad(s1.pow(2).sum() + s2.pow(2).sum(), s1)
    assert_row(stats[row_of(meta, "state", "gradient", iteration=1)], np_stats(g1.detach()))
    g = record["graphs"]
    assert g["0"] != g["2"]  # iteration 2 registers "extra"
    # a graph only links tensors of its own iteration, so iterations 0 and 1 share one graph
    assert g["0"] == g["1"]
    doc2 = json.loads((rec.path / "graphs" / f"{g['2']}.json").read_text())
    assert ["state", "extra"] in doc2["edges"] and ["cell.weight", "state"] in doc2["edges"]
    assert ["state", "total"] in doc2["edges"]


def test_storage_is_readable_during_training_and_never_pickles(tmp_path) -> None:
    torch.manual_seed(0)
    model = MLP()
    rec = Recorder(tmp_path, every=2)
    rec.track_module(model)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    seen, losses = [], []
    for step in range(6):
        _, _, loss = one_step(rec, model, x, y, step)
        losses.append(float(loss.detach()))
        seen.append(len(read_step_meta(rec.path)))
    assert seen == [1, 1, 2, 2, 3, 3]
    # KPIs of every step, recorded or not; step 5 is buffered until a recorded step or close()
    assert [r["step"] for r in read_kpis(rec.path)] == [0, 1, 2, 3, 4]
    rec.close()
    kpis = read_kpis(rec.path)
    assert [r["step"] for r in kpis] == [0, 1, 2, 3, 4, 5]
    assert [r["kpis"]["loss"] for r in kpis] == pytest.approx(losses)
    with open(rec.path / "kpis.jsonl", "a") as fh:
        fh.write('{"type": "train", "st')  # a line the writer is still appending
    assert len(read_kpis(rec.path)) == 6
    leftovers = [p.name for p in rec.path.rglob(".*")]
    assert leftovers == []
    for npy in (rec.path / "steps").glob("*.npy"):
        np.load(npy, allow_pickle=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        Recorder(tmp_path, every=2)
    Recorder(tmp_path, every=2, overwrite=True)
    assert read_step_meta(rec.path) == []


def test_bad_input_is_named(tmp_path) -> None:
    rec = Recorder(tmp_path, every=1)
    with pytest.raises(RuntimeError, match="start_batch"):
        rec.register_tensor("x", torch.ones(1))
    rec.start_batch(0)
    with pytest.raises(ValueError, match="valid roles are"):
        rec.register_tensor("x", torch.ones(1), role="weights")
    rec.register_tensor("x", torch.ones(1))
    with pytest.raises(ValueError, match="registered twice"):
        rec.register_tensor("x", torch.ones(1))
    with pytest.raises(RuntimeError, match="twice"):
        rec.start_batch(1)
    with pytest.raises(ValueError, match="valid streams"):
        from nnstat.recorder import Rule

        Rule("nonfinite", stream="grad")
    with pytest.raises(ValueError, match="plain folder name"):
        Recorder(tmp_path, group="../escape")


def test_bad_kpi_and_complex_tensor_are_refused_at_the_call_naming_them(tmp_path):
    rec = Recorder(tmp_path, group="g", trial="t", every=1)
    rec.start_batch(0)
    with pytest.raises(TypeError, match=r"register_tensor\('z'\).*complex64.*abs\(\)"):
        rec.register_tensor("z", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="KPI 'acc' must be a real number"):
        rec.record_kpi("acc", "0.5")
    with pytest.raises(ValueError, match=r"KPI 'loss' must be a scalar.*\(3,\)"):
        rec.record_kpi("loss", torch.ones(3))
    rec.record_kpi("loss", torch.tensor([0.25]))
    rec.record_kpi("n", np.int64(7))
    rec.finish_batch()
    rec.close()  # nothing refused is left behind to fail here
    (record,) = read_kpis(tmp_path / "g" / "t")
    assert record["kpis"] == {"loss": 0.25, "n": 7.0}


def test_every_recorded_file_gets_the_umask_mode_raw_values_too(tmp_path, umask_027) -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    rec = Recorder(tmp_path / "rec", group="g", every=1, raw_max_numel=20)
    rec.track_module(model)
    one_step(rec, model, x, y, 0)
    rec.add_note("a note")
    rec.close()
    written = {p.name for p in (rec.path / "steps").iterdir()}
    assert "train-000000000.values.safetensors" in written and not any(".tmp" in n for n in written)
    assert umask_027(rec.path) == {}
