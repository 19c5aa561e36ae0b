"""Under torch.distributed (2 gloo ranks) shards are split across ranks and gathered: every rank
returns exactly the single-process result."""

from __future__ import annotations

import torch
from _dist import spawn

from nnstat.influence import ModuleSpec, TensorSource, compute_influence_all


def _sources():
    gen = torch.Generator().manual_seed(11)
    layout = [ModuleSpec("a", 0, 2, 3), ModuleSpec("b", 6, 1, 4, "layernorm", flat_width=4)]
    ids = [f"t{i}" for i in range(45)]
    train = TensorSource(torch.randn(45, 10, generator=gen), ids=ids, layout=layout, shard_rows=10)
    query = TensorSource(torch.randn(3, 10, generator=gen), layout=layout)
    return query, train


def _worker(rank: int, out_dir: str) -> None:
    query, train = _sources()
    full = compute_influence_all(query, train, preconditioner="raw", damping=0.1, batch_size=4)
    top = compute_influence_all(
        query, train, preconditioner="raw", damping=0.1, top_k=4, batch_size=4
    )
    torch.save(
        {
            "scores": full.scores,
            "train_ids": full.train_ids,
            "helpful_ids": top.helpful_ids,
            "harmful_ids": top.harmful_ids,
            "helpful_scores": top.helpful_scores,
        },
        f"{out_dir}/rank{rank}.pt",
    )


def test_distributed_split_and_gather_equals_single_process(tmp_path):
    spawn(_worker, str(tmp_path), world=2)
    query, train = _sources()
    full = compute_influence_all(query, train, preconditioner="raw", damping=0.1, progress=False)
    top = full.top_k(4)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["train_ids"] == full.train_ids
        torch.testing.assert_close(got["scores"], full.scores)
        assert got["helpful_ids"] == top.helpful_ids
        assert got["harmful_ids"] == top.harmful_ids
        torch.testing.assert_close(got["helpful_scores"], top.helpful_scores)
