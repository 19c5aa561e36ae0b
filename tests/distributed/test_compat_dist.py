"""Every capability under DDP, FSDP2 (``fully_shard``, DTensor parameters), HSDP (``fully_shard``
on a 2-D replicate x shard mesh) and FSDP1 (``FullyShardedDataParallel`` on CPU,
``use_orig_params=True``), 2 gloo processes each.

One spawn per wrapper (module-scoped, cached) runs the whole workflow and saves what every rank
saw; each test then checks one capability against an independent single-process reference:
``torch.func`` per-sample gradients, numpy/scipy statistics of the unsharded tensors, closed-form
projections and dot products.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F
from _compat_worker import LR, MOMENTUM, SPLITS, STATS, WORLD, data, model, worker
from _dist import spawn
from safetensors.torch import load_file
from torch.func import functional_call, grad, vmap

import nnstat

WRAPPERS = ("ddp", "fsdp2", "fsdp1", "hsdp")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            out = tmp_path_factory.mktemp(kind)
            spawn(worker, kind, str(out), world=WORLD)
            cache[kind] = str(out)
        return cache[kind]

    return get


def _per_sample_ref() -> dict[str, torch.Tensor]:
    m = model()
    x, y = data()
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(m, p, (xi[None],)), yi[None], reduction="sum")

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def _after_step() -> dict[str, dict[str, np.ndarray]]:
    """Unsharded tensors after one SGD step on the mean over ranks of the local sum losses."""
    m = model()
    x, y = data()
    w0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
    (F.cross_entropy(m(x), y, reduction="sum") / WORLD).backward()
    opt.step()
    out: dict[str, dict[str, np.ndarray]] = {"weight": {}, "grad": {}, "update": {}}
    out["momentum_buffer"] = {}
    for n, p in m.named_parameters():
        out["weight"][n] = p.detach().numpy().ravel().astype(np.float64)
        out["grad"][n] = p.grad.numpy().ravel().astype(np.float64)
        out["momentum_buffer"][n] = opt.state[p]["momentum_buffer"].numpy().ravel().astype(float)
        out["update"][n] = (p.detach() - w0[n]).numpy().ravel().astype(np.float64)
    return out


def _np_stats(v: np.ndarray) -> dict[str, float]:
    return {
        "numel": float(v.size),
        "mean": float(v.mean()),
        "var": float(v.var()),
        "skew": float(scipy.stats.skew(v)),
        "kurtosis": float(scipy.stats.kurtosis(v)),
        "min": float(v.min()),
        "max": float(v.max()),
        "abs_max": float(np.abs(v).max()),
        "l1": float(np.abs(v).sum()),
        "l2": float(np.linalg.norm(v)),
        "sparsity": float((v == 0).mean()),
        "nonfinite": 0.0,
    }


def _close(got: float, want: float, what: str) -> None:
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5), what


@pytest.mark.parametrize("kind", WRAPPERS)
def test_netdict_describe_tracker_equal_unsharded(spawned, kind):
    out = spawned(kind)
    ref = _after_step()
    for rank in range(WORLD):
        res = json.loads(open(os.path.join(out, f"netdict-rank{rank}.json")).read())
        # Tracker: weight, grad, optimizer state and update of every layer
        for group in ("weight", "grad", "momentum_buffer", "update"):
            for name, v in ref[group].items():
                want = _np_stats(v)
                for s in STATS:
                    _close(res["tracker"][f"{group}/{name}/{s}"], want[s], f"{group}/{name}/{s}")
        # describe per layer and for the whole network, and NetDict norms
        for name, v in ref["weight"].items():
            want = _np_stats(v)
            for s in STATS:
                _close(res["describe_layers"][f"w/{name}/{s}"], want[s], f"{name}/{s}")
            _close(res["layer_norms"][name], want["l2"], f"{name} norm")
        for name, v in ref["momentum_buffer"].items():
            want = _np_stats(v)
            for s in STATS:
                _close(res["describe_momentum"][f"m/{name}/{s}"], want[s], f"momentum {name}/{s}")
        whole = _np_stats(np.concatenate(list(ref["grad"].values())))
        for s in STATS:
            _close(res["describe_grad"][s], whole[s], f"whole grad {s}")
        _close(res["norm1"], float(sum(np.abs(v).sum() for v in ref["weight"].values())), "l1")


@pytest.mark.parametrize("kind", WRAPPERS)
def test_capture_per_sample_grads_match_torch_func(spawned, kind):
    out = spawned(kind)
    ref = _per_sample_ref()
    for rank in range(WORLD):
        lo, hi = SPLITS[rank]
        got = load_file(os.path.join(out, f"psg-rank{rank}.safetensors"))
        assert set(got) == set(ref)
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v[lo:hi], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_capture_forward_hook_sees_the_whole_weight(spawned, kind):
    out = spawned(kind)
    init = dict(model().named_parameters())
    for rank in range(WORLD):
        seen = load_file(os.path.join(out, f"seen-rank{rank}.safetensors"))
        for name in ("0", "2", "3"):
            # the whole weight as a plain tensor under every wrapper: the engine's hook runs
            # first on the module (prepend), before FSDP2's own post-forward reshards it
            assert float(seen[f"{name}.is_dtensor"]) == 0.0, name
            torch.testing.assert_close(seen[f"{name}.weight"], init[f"{name}.weight"].detach())


@pytest.mark.parametrize("kind", WRAPPERS)
def test_statistics_ekfac_equal_single_process_union(spawned, kind):
    from _compat_worker import collect_ekfac

    out = spawned(kind)
    x, y = data()
    want = collect_ekfac(model(), x, y)
    for rank in range(WORLD):
        got = load_file(os.path.join(out, f"ekfac-rank{rank}.safetensors"))
        assert set(got) == set(want)
        for k in want:
            if k.endswith("eigenvectors"):  # defined up to sign
                overlap = (got[k] * want[k]).sum(0).abs()
                torch.testing.assert_close(overlap, torch.ones_like(overlap), atol=1e-3, rtol=0)
                continue
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


def _projected_ref(store: nnstat.GradientStore) -> dict[int, torch.Tensor]:
    """Store rows from torch.func per-sample gradients and the stored projections."""
    ref = _per_sample_ref()
    proj = store.projections()
    rows = []
    for spec in store.modules:
        name = spec["name"]
        w, b = ref[f"{name}.weight"], ref.get(f"{name}.bias")
        if spec["kind"] == "layernorm":
            g = torch.cat([w, b], 1)
            p = proj.get(f"{name}/p_in")
            rows.append(g if p is None else g @ p.T)
            continue
        g = torch.cat([w, b[:, :, None]], 2) if b is not None else w
        p_in, p_out = proj.get(f"{name}/p_in"), proj.get(f"{name}/p_out")
        if p_in is not None:
            g = g @ p_in.T
        if p_out is not None:
            g = p_out @ g
        rows.append(g.reshape(len(g), -1))
    full = torch.cat(rows, 1)
    return {i: full[i] for i in range(len(full))}


@pytest.mark.parametrize("kind", WRAPPERS)
def test_store_per_rank_shards_union_every_id_once(spawned, kind):
    out = spawned(kind)
    store = nnstat.GradientStore(os.path.join(out, "store"))
    assert sorted(s.name for s in store.shards) == ["rank0-00000.npy", "rank1-00000.npy"]
    assert sorted(store.ids) == list(range(SPLITS[-1][1]))  # every id exactly once
    ref = _projected_ref(store)
    rows = store.rows(0, len(store))
    for i, rid in enumerate(store.ids):
        torch.testing.assert_close(rows[i], ref[rid], rtol=1e-4, atol=1e-6)
    prints = {open(os.path.join(out, f"fingerprint-rank{r}.txt")).read() for r in range(WORLD)}
    assert prints == {store.meta["params_sha256"]}  # one fingerprint for all ranks


@pytest.mark.parametrize("kind", WRAPPERS)
def test_influence_split_across_ranks_and_gathered(spawned, kind):
    out = spawned(kind)
    store = nnstat.GradientStore(os.path.join(out, "store"))
    rows = store.rows(0, len(store))
    for rank in range(WORLD):
        got = torch.load(os.path.join(out, f"influence-rank{rank}.pt"), weights_only=True)
        assert got["train_ids"] == store.ids
        q = [store.ids.index(i) for i in got["query_ids"]]
        torch.testing.assert_close(got["scores"], rows[q] @ rows.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_recorder_parameters_and_activations(spawned, kind):
    out = spawned(kind)
    ref = _after_step()
    w0 = {n: p.detach().double().numpy().ravel() for n, p in model().named_parameters()}
    x, y = data()
    for rank in range(WORLD):
        rows = json.loads(open(os.path.join(out, f"recorder-rank{rank}.json")).read())
        for name, v in w0.items():
            got = rows[f"{name}|forward"]
            _close(got["norm"], float(np.linalg.norm(v)), f"{name} norm")
            _close(got["std"], float(v.std()), f"{name} std")
            _close(got["numel"], float(v.size), f"{name} numel")
            g = ref["grad"][name]
            _close(rows[f"{name}|gradient"]["norm"], float(np.linalg.norm(g)), f"{name} grad")
            _close(rows[f"{name}|gradient"]["max"], float(g.max()), f"{name} grad max")
        # activations are per-rank data: this rank's batch, unwrapped model
        lo, hi = SPLITS[rank]
        m = model()
        z = m[0](x[lo:hi]).detach().requires_grad_(True)
        h = m[2](m[1](z))
        (gz,) = torch.autograd.grad(F.cross_entropy(m[3](h), y[lo:hi], reduction="sum"), z)
        _close(rows["3:input|forward"]["norm"], float(h.norm()), "3:input")
        _close(rows["0:output|gradient"]["norm"], float(gz.norm()), "0:output grad")


@pytest.mark.parametrize("kind", WRAPPERS)
def test_noise_scale_per_sample_mode_uses_this_ranks_batch(spawned, kind):
    out = spawned(kind)
    ref = _per_sample_ref()
    for rank in range(WORLD):
        lo, hi = SPLITS[rank]
        n = hi - lo
        # b_small = 1 (one sample's gradient), b_big = this rank's batch: both local, although
        # the wrapper has averaged .grad over the ranks
        per = torch.cat([v[lo:hi].reshape(n, -1) for v in ref.values()], 1).double()
        want = nnstat.NoiseScale(window=4)
        want.update(float(per.pow(2).sum(1).mean()), float(per.mean(0).pow(2).sum()), 1, n)
        got = json.loads(open(os.path.join(out, f"gns-rank{rank}.json")).read())
        assert got["grad_sq_norm"] == pytest.approx(want.grad_sq_norm, rel=1e-4)
        assert got["value"] == pytest.approx(want.value, rel=1e-4)
