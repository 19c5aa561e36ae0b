"""Under torch.distributed each rank writes its own shards; the store reads the union."""

import torch
from _dist import launch

import nnstat

SCRIPT = r"""
import sys, torch, torch.distributed as dist
from torch import nn
import nnstat

root = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # same model and projection on every rank
model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
x[3 + 8 * rank, 0] = float("nan")  # one bad row per rank, skipped and counted
run = nnstat.init(project="ddp", root_dir=root)
nnstat.setup({"statistic": "none", "nonfinite": "skip"})
nnstat.watch(model)
nnstat.add_projection(rank=2)
lo = 8 * rank  # each rank logs its half of the data
with run(data_id=list(range(lo, lo + 8))):
    nn.functional.cross_entropy(model(x[lo:lo + 8]), y[lo:lo + 8], reduction="sum").backward()
nnstat.finalize()
dist.barrier()
dist.destroy_process_group()
"""


OVERWRITE = r"""
import sys, torch, torch.distributed as dist
from torch import nn
import nnstat
from nnstat.store.errors import ModelChangedError

root = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)


def log(overwrite=False):
    run = nnstat.init(project="ddp", root_dir=root, overwrite=overwrite)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    lo = 8 * rank
    try:
        with run(data_id=list(range(lo, lo + 8))):
            nn.functional.cross_entropy(model(x[lo:lo + 8]), y[lo:lo + 8], reduction="sum").backward()
        nnstat.finalize()
    finally:
        nnstat.unwatch()
        model.zero_grad()


log()
dist.barrier()
with torch.no_grad():  # every rank takes the same step
    model[0].weight.add_(0.1)
try:
    log()
    raise SystemExit("a changed model was not refused on rank %d" % rank)
except ModelChangedError:
    pass
dist.barrier()
log(overwrite=True)  # rank 0 clears the store, every rank waits, then both write
dist.barrier()
dist.destroy_process_group()
"""


def _launch(tmp_path, source):
    script = tmp_path / "ddp.py"
    script.write_text(source)
    launch(str(script), str(tmp_path), world=2)


def test_two_gloo_ranks_write_their_own_shards(tmp_path):
    _launch(tmp_path, SCRIPT)
    store = nnstat.GradientStore(tmp_path / "ddp")
    names = sorted(s.name for s in store.shards)
    assert names == ["rank0-00000.npy", "rank1-00000.npy"]
    assert sorted(store.ids) == [i for i in range(16) if i not in (3, 11)]
    assert store.meta["skipped_rows"] == 2  # summed over ranks
    # the same rows as one process logging the union (minus the NaN rows)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    keep = [i for i in range(16) if i not in (3, 11)]
    run = nnstat.init(project="single", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    with run(data_id=keep):
        torch.nn.functional.cross_entropy(model(x[keep]), y[keep], reduction="sum").backward()
    nnstat.finalize()
    single = nnstat.GradientStore(run.path)
    ref = dict(zip(single.ids, single.rows(0, len(single)), strict=True))
    got = store.rows(0, len(store))
    for i, rid in enumerate(store.ids):
        torch.testing.assert_close(got[i], ref[rid])


def test_a_changed_model_is_refused_on_every_rank_and_overwritten_once(tmp_path):
    _launch(tmp_path, OVERWRITE)
    store = nnstat.GradientStore(tmp_path / "ddp")
    assert sorted(store.ids) == list(range(16))  # both ranks' rows, none of the old ones twice
    torch.manual_seed(0)  # the reference: one process, the changed weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    with torch.no_grad():
        model[0].weight.add_(0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    run = nnstat.init(project="single", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    with run(data_id=list(range(16))):
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    nnstat.finalize()
    nnstat.unwatch()
    single = nnstat.GradientStore(run.path)
    assert store.meta["params_sha256"] == single.meta["params_sha256"]
    ref = dict(zip(single.ids, single.rows(0, 16), strict=True))
    for i, rid in enumerate(store.ids):
        torch.testing.assert_close(store.rows(0, 16)[i], ref[rid])
