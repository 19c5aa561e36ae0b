"""The check between the blocks of a logging pass sees every bit of every parameter and buffer
(a partial ``.data`` write that leaves ``_version`` alone), the modules' training modes, and the
modules that hold a watched submodule; query logs carry the whole model's fingerprint."""

import pytest
import torch
from torch import nn

import nnstat
from nnstat.influence import compute_influence_all
from nnstat.store.errors import ModelChangedError

pytestmark = pytest.mark.filterwarnings("ignore:cannot capture per-sample")

X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)).eval()


def _pass(tmp_path, model, watched, ids, step=None, **watch):
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 2})
    nnstat.watch(watched, **watch)
    try:
        for lo in range(0, len(ids), 4):
            with run(data_id=ids[lo : lo + 4]):
                model(X[ids[lo : lo + 4]]).square().sum().backward()
            if step is not None:
                step()
            model.zero_grad()
        nnstat.finalize()
    finally:
        nnstat.unwatch()


def _swap(w):
    w[0, [1, 2]] = w[0, [2, 1]].clone()


# each edits values that a few strided samples per tensor would not see, without a version bump
EDITS = {
    "strided half": lambda m: m[0].weight.data[:, 1::2].mul_(2),
    "one element": lambda m: m[0].weight.data[3, 5].add_(1e-3),
    "sign of one element": lambda m: m[0].weight.data[3, 5].neg_(),
    "buffer element": lambda m: m[1].running_mean.data[1].add_(0.5),
    "two elements exchanged": lambda m: _swap(m[0].weight.data),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_partial_data_write_between_blocks_is_refused_at_the_next_block(tmp_path, edit):
    model = _model()
    before = model[0].weight._version, model[1].running_mean._version
    with pytest.raises(ModelChangedError, match=r"changed between two run\(\.\.\.\) blocks"):
        _pass(tmp_path, model, model, list(range(16)), step=lambda: EDITS[edit](model))
    assert (model[0].weight._version, model[1].running_mean._version) == before
    nnstat.finalize()


def test_a_train_eval_switch_between_blocks_is_reported(tmp_path):
    model = _model()
    with pytest.raises(ModelChangedError, match=r"1 \(training mode\)"):
        _pass(tmp_path, model, model, list(range(16)), step=model.train)
    nnstat.finalize()


def test_a_parent_of_a_watched_submodule_changed_between_blocks_is_refused(tmp_path):
    model = _model()

    def step():
        model[0].weight.data[2, 2] += 1.0  # the backbone computing the watched layer's input

    with pytest.raises(ModelChangedError, match="checksum"):
        _pass(tmp_path, model, model[2], list(range(16)), step=step)
    nnstat.finalize()


def test_a_parent_of_a_watched_submodule_changed_before_a_resume_is_refused(tmp_path):
    model = _model()
    _pass(tmp_path, model, model[2], list(range(8)))
    with torch.no_grad():
        model[0].weight.mul_(3)  # re-trained backbone: the head's rows now differ
    with pytest.raises(ModelChangedError, match="model_sha256"):
        _pass(tmp_path, model, model[2], list(range(8, 16)))
    assert len(nnstat.GradientStore(tmp_path / "p")) == 8


def _query(run, model):
    nnstat.eval()
    with run(data_id=["q0", "q1"]):
        model(X[:2]).square().sum().backward()
    model.zero_grad()
    return nnstat.get_log()


def test_a_query_captured_after_an_unwatched_backbone_changed_is_refused(tmp_path):
    model = _model()
    run = nnstat.init(project="q", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 2})
    nnstat.watch(model, name_filter="2")
    for lo in range(0, 8, 4):
        with run(data_id=list(range(lo, lo + 4))):
            model(X[lo : lo + 4]).square().sum().backward()
        model.zero_grad()
    nnstat.finalize()
    same = _query(run, model)
    with torch.no_grad():
        model[0].weight.mul_(1.01)  # the watched layer "2" is untouched
    moved = _query(run, model)
    nnstat.unwatch()
    assert same.meta["params_sha256"] == moved.meta["params_sha256"]
    assert same.meta["model_sha256"] != moved.meta["model_sha256"]
    path = tmp_path / "q"
    res = compute_influence_all(same, path, preconditioner="raw", progress=False)
    assert torch.isfinite(res.scores).all()
    pattern = (
        r"model_sha256 \w+\.\.\.\) and the store .*model_sha256 \w+\.\.\.\) were captured from "
        r"different weights of the whole model.*Re-capture the queries"
    )
    with pytest.raises(ValueError, match=pattern):
        compute_influence_all(moved, path, preconditioner="raw", progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_the_checksum_sees_every_single_change_and_exchanges(dtype):
    """Against a direct reference: any one changed element, any exchange of two distinct values
    (random values, so no exchange of x with -x), gives another checksum."""
    from nnstat.run.weights import checksum

    g = torch.Generator().manual_seed(1)
    t = (torch.randn(257, generator=g) * 100).to(dtype)

    def words(x):
        return x.view(torch.int16).to(torch.int32) if x.element_size() == 2 else x.view(torch.int32)

    base = int(checksum(words(t)))
    # the closed form: sum of word_i * (2i + 1) modulo 2**32 (as int32)
    w = words(t).long()
    ref = sum(int(v) * (2 * i + 1) for i, v in enumerate(w.tolist()))
    ref = (ref + 2**31) % 2**32 - 2**31
    assert base == ref
    for i in range(0, 257, 17):
        u = t.clone()
        u.view(torch.uint8)[i * t.element_size()] ^= 1  # one bit of element i
        assert int(checksum(words(u))) != base
        j = (i * 7 + 3) % 257
        if t[i] != t[j]:
            u = t.clone()
            u[[i, j]] = t[[j, i]]
            assert int(checksum(words(u))) != base


def test_the_block_check_names_the_dtype_group_that_changed():
    """Odd-sized 2-byte and 1-byte groups (padded to whole words) and a float32 group: an edit of
    one element is found, in its group only, however the groups are laid out."""
    from nnstat.run.weights import BlockGuard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1, bias=False).to(torch.bfloat16))
    model.register_buffer("mask", torch.tensor([True, False, True]))
    for edit, group in [
        (lambda: model[1].weight.data[0, 1].mul_(-1), "torch.bfloat16"),
        (lambda: model.mask.data[1].fill_(True), "torch.bool"),
        (lambda: model[0].bias.data[2].add_(1e-6), "torch.float32"),
    ]:
        guard = BlockGuard()
        guard.record(model)
        assert guard.changed(model) == []
        edit()
        (changed,) = guard.changed(model)
        assert group in changed


@pytest.mark.parametrize("extra", [0, 5])
def test_the_checksum_of_a_grid_of_words_is_the_closed_form(extra):
    """Words over several rows of the reduced grid (whole rows, and a padded last row): the row
    and column sums give exactly sum(word_i * (2i + 1)) modulo 2**32, and a change or an
    exchange anywhere (across rows, within a column) changes it."""
    from nnstat.run.weights import COLUMNS, checksum

    g = torch.Generator().manual_seed(2)
    n = 3 * COLUMNS + extra
    w = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    idx = torch.arange(n, dtype=torch.int64)
    ref = int((w.long() * (2 * idx + 1)).sum()) % 2**32
    assert int(checksum(w)) % 2**32 == ref
    for i, j in [(1, COLUMNS + 1), (7, 2 * COLUMNS + 9), (n - 1, 0)]:
        u = w.clone()
        u[[i, j]] = w[[j, i]]
        assert int(checksum(u)) != int(checksum(w))
        u = w.clone()
        u[i] ^= 1 << 30
        assert int(checksum(u)) != int(checksum(w))
