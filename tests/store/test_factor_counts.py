"""Factor pairs per module (``factors={module or pattern: c}``): the mapping's resolution and
checks, the bytes a mixed store's row takes against hand-computed widths, and its scores against
a float64 numpy reference (the dense store's rows truncated by numpy's SVD, module by module)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import nnstat
from nnstat.influence import as_source, compute_influence_all
from nnstat.influence.precondition import Preconditioner
from nnstat.store import GradientStore
from nnstat.store.factor_counts import check_factors, factors_for

N, BATCH, T, D_IN, RANK = 24, 8, 6, 12, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    # "0": 16 x 13 -> rank 8 x 8; "1": 10 x 17 -> 8 x 8; "2": 3 x 11 -> 3 x 8 (a narrow side)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.Linear(16, 10), nn.Linear(10, 3))


def _data(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, T, D_IN, generator=torch.Generator().manual_seed(seed))


def _log(tmp_path, project, factors):
    model = _model()
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "rank": RANK,
                  "factors": factors})  # fmt: skip
    nnstat.watch(model)
    x = _data(N, 1)
    for s in range(0, N, BATCH):
        with run(data_id=list(range(s, s + BATCH))):
            model(x[s : s + BATCH]).square().sum().backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.eval()
    with run(data_id=[f"q{i}" for i in range(4)]):
        model(_data(4, 2)).square().sum().backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return tmp_path / project, log


# ------------------------------------------------------------------------ the mapping
def test_an_exact_name_wins_then_the_first_matching_pattern_then_dense():
    names = ["tok", "qkv", "fc1", "fc2", "head", "norm"]
    got = factors_for({"fc*": 3, "fc2": 5, "f*": 7, "head": None, "q?v": 2}, names)
    assert got == {"tok": None, "qkv": 2, "fc1": 3, "fc2": 5, "head": None, "norm": None}
    assert factors_for({"*": 1, "head": 6}, names) == {n: 6 if n == "head" else 1 for n in names}
    assert factors_for(4, names) == dict.fromkeys(names, 4)
    assert factors_for(None, names) == dict.fromkeys(names)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({}, r"factors=\{\} names no module"),
        ({"fc": 0}, r"factors\['fc'\] must be a positive int or None \(dense\), got 0"),
        ({"fc": 2.0}, r"factors\['fc'\] must be a positive int"),
        ({"fc": True}, r"factors\['fc'\] must be a positive int"),
        ({"": 2}, r"key '' must be a module name or pattern"),
        ([("fc", 2)], r"factors must be a positive int or None .* mapping, got \[\('fc', 2\)\]"),
    ],
)
def test_bad_mappings_are_refused_naming_the_entry(bad, match):
    with pytest.raises(ValueError, match=match):
        check_factors(bad)
    with pytest.raises(ValueError, match=match):
        nnstat.RunConfig(rank=8, factors=bad)


def test_a_key_matching_no_module_is_refused_listing_the_modules(tmp_path):
    with pytest.raises(ValueError, match=r"key 'fc9' matches no watched module; modules: \['0'"):
        _log(tmp_path, "typo", {"fc9": 2, "*": 1})


def test_a_mapping_needs_a_projection_rank_and_is_recorded_as_given():
    with pytest.raises(ValueError, match=r"rank is None .* rank=64, factors=8"):
        nnstat.RunConfig(factors={"*": 2})
    cfg = nnstat.RunConfig(rank=8, factors={"2": None, "*": 2})
    assert cfg.content()["run"]["factors"] == {"2": None, "*": 2}
    assert nnstat.RunConfig.from_json(cfg.to_json()) == cfg


# ------------------------------------------------------------------------ the store
def test_per_module_counts_give_the_hand_computed_row_bytes(tmp_path):
    # "0": c = 1 -> 1 * (8 + 8) = 16 columns; "1": c = 3 -> 3 * 16 = 48; "2": c = 2 would take
    # 2 * (3 + 8) = 22 < 24 = 3 * 8 columns, but it is set dense -> 24. Row: 88 float32 = 352 B
    path, _ = _log(tmp_path, "mixed", {"0": 1, "2": None, "*": 3})
    store = GradientStore(path)
    mods = {m["name"]: m for m in store.meta["modules"]}
    assert [mods[n].get("factors") for n in "012"] == [1, 3, None]
    assert [mods[n]["width"] for n in "012"] == [16, 48, 24]
    assert [mods[n]["offset"] for n in "012"] == [0, 16, 64]
    assert store.row_width == 88
    assert store.rows(0, 1).shape[1] * store.rows(0, 1).element_size() == 352
    assert store.meta["config"]["run"]["factors"] == {"0": 1, "2": None, "*": 3}
    assert set(store.meta["factor_energy"]) == {"0", "1"}  # dense modules keep all of theirs


def _truncated64(rows: np.ndarray, modules: list, counts: dict) -> np.ndarray:
    """float64 rows with each module's ``r_out x r_in`` block cut to its best rank-``c``
    approximation by numpy's SVD (``c = None``: unchanged)."""
    out = rows.copy()
    for m in modules:
        c = counts[m["name"]]
        if c is None:
            continue
        cols = slice(m["offset"], m["offset"] + m["width"])
        g = rows[:, cols].reshape(-1, m["r_out"], m["r_in"])
        u, s, vt = np.linalg.svd(g, full_matrices=False)
        out[:, cols] = ((u[..., :c] * s[:, None, :c]) @ vt[:, :c]).reshape(len(rows), -1)
    return out


@pytest.mark.parametrize("pre", ["identity", "kfac"])
def test_a_mixed_store_scores_as_numpys_per_module_truncation_of_the_dense_rows(tmp_path, pre):
    counts = {"0": 1, "1": 3, "2": None}  # T = 6 positions > c: the SVD path for "0" and "1"
    fpath, flog = _log(tmp_path, "f", counts)
    dpath, dlog = _log(tmp_path, "d", None)
    torch.testing.assert_close(flog.rows, dlog.rows)  # queries are logged dense and exact
    dense = GradientStore(dpath)
    modules = dense.meta["modules"]
    train64 = _truncated64(dense.rows(0, len(dense)).double().numpy(), modules, counts)
    # the preconditioner acts on the (dense) queries; K-FAC's comes from the statistics pass,
    # the same in both stores
    query = Preconditioner.fit(as_source(dpath), pre).apply(dlog.rows, damping=1e-3)
    ref = query.double().numpy() @ train64.T
    got = compute_influence_all(flog, fpath, preconditioner=pre, damping=1e-3).scores
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got.double().numpy() / scale, ref / scale, rtol=0, atol=2e-5)
    # and the truncation mattered: the dense store's scores are farther from it
    plain = compute_influence_all(dlog, dpath, preconditioner=pre, damping=1e-3).scores
    assert np.abs(plain.double().numpy() - ref).max() / scale > 1e-3


def test_a_store_resumes_under_its_mapping_and_refuses_another(tmp_path):
    def log(ids, factors):
        model = _model()
        run = nnstat.init(project="p", root_dir=tmp_path)
        nnstat.setup({"save": "grad", "rank": RANK, "factors": factors})
        nnstat.watch(model)
        with run(data_id=ids):
            model(_data(len(ids), ids[0])).square().sum().backward()
        nnstat.finalize()
        nnstat.unwatch()

    log([0, 1, 2], {"0": 1, "*": 3})
    log([3, 4], {"*": 3, "0": 1})  # the same counts per module
    assert len(GradientStore(tmp_path / "p")) == 5
    with pytest.raises(ValueError, match=r"cannot resume .* modules\[0\]\.factors: 1 -> 2"):
        log([5, 6], {"0": 2, "*": 3})
