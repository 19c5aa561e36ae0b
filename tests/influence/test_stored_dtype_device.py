"""16-bit stores (``dtype`` float16, bfloat16) on scoring's device branch: the rows are staged and
copied to the device as stored (half the bytes of float32) and widened to float32 there.

Run on the CPU by switching `score._device_branch` on, and on a GPU where there is one (``cuda``
mark). References are independent: the shards read with numpy (bfloat16 from its raw 16-bit
patterns), widened and scored in float64 numpy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _ledger import device_branch_staging, host_reads

import nnstat
from nnstat.influence import compute_influence_all, compute_self_influence, pipeline
from nnstat.influence.pipeline import read_ahead, units
from nnstat.influence.row_layout import ModuleSpec
from nnstat.influence.sources import StoreSource, TensorSource
from nnstat.store import GradientStore, StoreWriter

WIDTH, DAMPING, BATCH = 12, 0.1, 4


def _store(root, dtype, n=30, shard_rows=7, seed=0):
    meta = {
        "format_version": 1,
        "row_width": WIDTH,
        "dtype": dtype,
        "modules": [
            {"name": "fc", "kind": "linear", "offset": 0, "width": WIDTH, "r_out": 3, "r_in": 4}
        ],
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=WIDTH, shard_rows=shard_rows, dtype=dtype)
    rows = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed))
    writer.put(list(range(n)), rows)
    writer.close()
    return root


def _numpy_rows(root, dtype):
    """The store's rows widened to float64 with numpy alone (shard files in order)."""
    parts = [np.load(p) for p in GradientStore(root).shards]
    if dtype == "bfloat16":  # raw patterns: the high half of a float32's bits
        parts = [(p.astype(np.uint32) << 16).view(np.float32) for p in parts]
    return np.concatenate(parts).astype(np.float64)


def _q():
    rows = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(1))
    return TensorSource(rows, layout=[ModuleSpec("fc", 0, 3, 4)])


def test_staging_dtype_keeps_a_narrower_float_and_converts_the_rest():
    from nnstat.influence.pipeline import staging_dtype

    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    assert staging_dtype(f16, f32) == f16 and staging_dtype(bf16, f32) == bf16
    assert staging_dtype(f32, f32) == f32 and staging_dtype(f32, f64) == f32
    # wider than the scoring dtype, or not narrower (bfloat16 does not hold every float16)
    assert staging_dtype(f64, f32) == f32 and staging_dtype(bf16, f16) == f16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_read_ahead_hands_a_16bit_block_through_in_its_dtype_when_asked(dtype):
    g = torch.Generator().manual_seed(3)
    blocks = [((0, i), [i], torch.randn(3, 5, generator=g).to(dtype)) for i in range(4)]
    got = [
        (rows.dtype, rows.clone()) for _, _, rows in read_ahead(iter(blocks), "cpu", widen=False)
    ]
    assert [d for d, _ in got] == [dtype] * 4
    assert all(torch.equal(r, b[2]) for (_, r), b in zip(got, blocks, strict=True))
    # by default widened to float32 after the copy, each block into the same kept buffer
    widened, pointers = [], set()
    for _, _, rows in read_ahead(iter(blocks), "cpu"):
        widened.append(rows.clone())
        pointers.add(rows.data_ptr())
    assert all(r.dtype == torch.float32 for r in widened)
    ref = [torch.from_numpy(b[2].float().numpy().astype(np.float64)) for b in blocks]
    assert all(torch.equal(r.double(), x) for r, x in zip(widened, ref, strict=True))
    assert len(pointers) == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stored_rows_keep_the_stored_dtype_over_the_memory_map(tmp_path, dtype):
    root = _store(tmp_path / "s", dtype)
    source = StoreSource(GradientStore(root))
    view = source.stored_rows()
    want = torch.float16 if dtype == "float16" else torch.bfloat16
    stored = [(key, ids, rows) for key, ids, rows in units(view, BATCH)]
    assert {rows.dtype for _, _, rows in stored} == {want} and view.stored_dtype == want
    # the shard's memory map itself, not a host copy
    first = source.store.shard_array(0)
    assert stored[0][2].data_ptr() == first.ctypes.data
    # widened, bit for bit the rows the CPU branch reads (and numpy's)
    wide = torch.cat([rows.float() for _, _, rows in stored])
    plain = torch.cat([rows for _, rows in source.iter_blocks(BATCH)])
    assert plain.dtype == torch.float32 and torch.equal(wide, plain)
    np.testing.assert_array_equal(wide.double().numpy(), _numpy_rows(root, dtype))
    assert [i for _, ids, _ in stored for i in ids] == source.ids
    # the view's iter_blocks (a store read without its shards) keeps the dtype too
    again = [rows for _, rows in view.iter_blocks(BATCH)]
    assert {r.dtype for r in again} == {want} and torch.equal(torch.cat(again).float(), plain)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_device_branch_scores_a_16bit_store_from_its_stored_bytes(tmp_path, monkeypatch, dtype):
    root = _store(tmp_path / "s", dtype)
    rows, q = _numpy_rows(root, dtype), _q()
    kw = dict(preconditioner="raw", damping=DAMPING, batch_size=BATCH)
    device_branch_staging(monkeypatch, False)
    host = {m: compute_influence_all(q, root, mode=m, **kw) for m in ("dot", "cosine")}
    host_top = compute_influence_all(q, root, top_k=3, **kw)
    host_self = compute_self_influence(root, **kw)
    staged = device_branch_staging(monkeypatch, True)
    for mode, want in host.items():
        got = compute_influence_all(q, root, mode=mode, **kw)
        # float32 maths on the same widened rows: the CPU branch's scores bit for bit
        assert torch.equal(got.scores, want.scores) and got.train_ids == want.train_ids
    with host_reads([]) as reads:  # 9 blocks: nothing read back per block
        top = compute_influence_all(q, root, top_k=3, **kw)
    assert len(reads) <= 2, reads
    assert torch.equal(top.helpful_scores, host_top.helpful_scores)
    assert top.helpful_ids == host_top.helpful_ids and top.harmful_ids == host_top.harmful_ids
    own = compute_self_influence(root, **kw)
    torch.testing.assert_close(own.scores, host_self.scores, rtol=1e-6, atol=1e-6)
    # against float64 numpy of the widened rows (raw: M = (TᵀT / n + λI)⁻¹)
    m = np.linalg.inv(rows.T @ rows / len(rows) + DAMPING * np.eye(WIDTH))
    ref = q.rows.double().numpy() @ m @ rows.T
    np.testing.assert_allclose(host["dot"].scores.numpy(), ref, rtol=1e-4, atol=1e-4)
    diag = np.einsum("ij,jk,ik->i", rows, m, rows)
    np.testing.assert_allclose(own.scores.numpy(), diag, rtol=1e-4, atol=1e-4)
    # every training block was staged (what crosses to the device) as stored
    stored_dtype = torch.float16 if dtype == "float16" else torch.bfloat16
    assert staged and set(staged) == {(BATCH * WIDTH * 2, stored_dtype)}


def _factored_log(tmp_path, dtype):
    """A two-layer model's factored (c=2, rank 8) store in ``dtype``, and a query log."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 10))
    g = torch.Generator().manual_seed(1)
    x, xq = torch.randn(16, 5, 12, generator=g), torch.randn(3, 5, 12, generator=g)
    run = nnstat.init(project="f", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "rank": 8, "factors": 2,
                  "dtype": dtype})  # fmt: skip
    nnstat.watch(model)
    for s in range(0, len(x), 8):
        with run(data_id=list(range(s, s + 8))):
            model(x[s : s + 8]).square().sum().backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.eval()
    with run(data_id=[f"q{i}" for i in range(len(xq))]):
        model(xq).square().sum().backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return tmp_path / "f", log


def test_a_factored_16bit_store_crosses_as_stored_and_scores_as_the_cpu_branch(
    tmp_path, monkeypatch
):
    path, log = _factored_log(tmp_path, "float16")
    store = GradientStore(path)
    assert store.dtype == "float16" and store.row_width * 2 == log.meta["row_width"]
    kw = dict(preconditioner="kfac", damping=1e-3, batch_size=BATCH)
    device_branch_staging(monkeypatch, False)
    host = compute_influence_all(log, path, **kw)
    host_top = compute_influence_all(log, path, top_k=3, **kw)
    staged = device_branch_staging(monkeypatch, True)
    got = compute_influence_all(log, path, **kw)
    top = compute_influence_all(log, path, top_k=3, **kw)
    scale = host.scores.abs().max().item()
    torch.testing.assert_close(got.scores, host.scores, rtol=1e-5, atol=1e-6 * scale)
    assert got.train_ids == host.train_ids and top.helpful_ids == host_top.helpful_ids
    # the factored rows crossed as stored: 2-byte values of the stored (factored) width
    assert staged and set(staged) == {(BATCH * store.row_width * 2, torch.float16)}


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_copies_16bit_rows_as_stored_and_scores_as_the_cpu_branch(
    tmp_path, monkeypatch, dtype
):
    root = _store(tmp_path / "s", dtype, n=300, shard_rows=50)
    copied: list[tuple[torch.dtype, int]] = []
    copy = pipeline._DeviceCopies.copy

    def counting(self, rows):
        copied.append((rows.dtype, rows.numel() * rows.element_size()))
        out = copy(self, rows)
        assert out[0].dtype == torch.float32 and out[0].device.type == "cuda"
        return out

    monkeypatch.setattr(pipeline._DeviceCopies, "copy", counting)
    q_cpu = _q()
    q_gpu = TensorSource(q_cpu.rows.cuda(), layout=q_cpu.layout)
    kw = dict(preconditioner="raw", damping=DAMPING, batch_size=16, progress=False)
    for mode in ("dot", "cosine"):
        for top_k in (None, 4):
            a = compute_influence_all(q_cpu, root, mode=mode, top_k=top_k, **kw)
            b = compute_influence_all(q_gpu, root, mode=mode, top_k=top_k, **kw)
            if top_k is None:
                torch.testing.assert_close(b.scores, a.scores, rtol=1e-4, atol=1e-4)
                assert b.train_ids == a.train_ids
            else:
                torch.testing.assert_close(b.helpful_scores, a.helpful_scores, rtol=1e-4, atol=1e-4)
                assert b.helpful_ids == a.helpful_ids and b.harmful_ids == a.harmful_ids
    sa = compute_self_influence(root, **kw)
    sb = compute_self_influence(root, device="cuda", **kw)
    torch.testing.assert_close(sb.scores, sa.scores, rtol=1e-4, atol=1e-4)
    # every block crossed in the stored dtype: 2 bytes a value, the store's bytes in all per call
    stored = torch.float16 if dtype == "float16" else torch.bfloat16
    assert copied and {d for d, _ in copied} == {stored}
    assert sum(b for _, b in copied) == 5 * 300 * WIDTH * 2  # 4 scoring calls, 1 self-influence
