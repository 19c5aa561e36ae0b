"""Op budget of the accelerator path: a GPT-2-small-shaped model on the ``meta`` device (which
takes the accelerator branch and holds no memory), every aten op of one ``Tracker.step()`` and of
``describe_layers()`` counted with a ``TorchDispatchMode``.

What must hold: non-view ops on the device stay within a budget of a few hundred, do not grow
with the number of layers (only with dtype groups), include none of the ops that synchronise
with the host, and the step reads the device exactly once (its staged table).

The model is hand-written with GPT-2 small's 148 parameter tensors (transformers' import alone
takes ~10 s on a loaded CI machine): token and position embeddings, per block two LayerNorms,
the qkv, attention-out and two MLP projections with biases, and the final LayerNorm.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nnstat

#: Ops that make the host wait for the device queue (or read a value back to size an output).
SYNCING = {
    "nonzero",
    "masked_select",
    "masked_scatter",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",  # CUDA's reads the largest index back to size its output
    "_local_scalar_dense",  # .item(), float(), bool()
    "is_nonzero",
    "equal",
}


class OpCount(TorchDispatchMode):
    """Counts non-view ops on meta tensors (what launches kernels on an accelerator) and the
    device-to-host copies, which it fakes (meta tensors hold no values): zeros arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.device: collections.Counter[str] = collections.Counter()
        self.host_reads = 0
        self.bool_index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        on_meta = any(t.device.type == "meta" for t in tensors) or (
            str(kwargs.get("device")) == "meta"
        )
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "meta":
            if str(kwargs.get("device")) == "cpu":
                self.host_reads += 1
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu":
            if args[1].device.type == "meta":
                self.host_reads += 1
                return args[0]
        if on_meta and not func.is_view:
            self.device[func.overloadpacket.__name__] += 1
            if func.overloadpacket is torch.ops.aten.index:
                indices = [i for i in args[1] if i is not None]
                self.bool_index += any(i.dtype in (torch.bool, torch.uint8) for i in indices)
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.device.values())


def gpt2_shaped(n_layer: int, embed_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """GPT-2 small's parameter shapes (148 tensors at 12 layers), built on meta."""
    d = 768
    with torch.device("meta"):
        blocks = []
        for _ in range(n_layer):
            blocks += [
                torch.nn.LayerNorm(d),
                torch.nn.Linear(d, 3 * d),
                torch.nn.Linear(d, d),
                torch.nn.LayerNorm(d),
                torch.nn.Linear(d, 4 * d),
                torch.nn.Linear(4 * d, d),
            ]
        emb = [torch.nn.Embedding(50257, d), torch.nn.Embedding(1024, d)]
        model = torch.nn.Sequential(*emb, *blocks, torch.nn.LayerNorm(d))
    emb[0].to(embed_dtype)
    emb[1].to(embed_dtype)
    return model


def step_counts(model: torch.nn.Module, **kw) -> OpCount:
    """Ops of the second logged ``Tracker.step()`` (the first builds cached layouts)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    opt.step()  # optimizer states exist before the Tracker looks for them
    tracker = nnstat.Tracker(model, opt, background=False, **kw)
    for _ in range(2):
        opt.step()
        with OpCount() as count:
            tracker.step()
    tracker.close()
    return count


KINDS = {"default": {}, "all stats + histograms": {"stats": None, "histograms": True}}
BUDGET = {"default": 100, "all stats + histograms": 1000}


def test_the_model_has_gpt2_smalls_148_tensors():
    assert len(list(gpt2_shaped(12).parameters())) == 148
    assert sum(p.numel() for p in gpt2_shaped(12).parameters()) == 124_439_808


@pytest.mark.parametrize("kind", list(KINDS))
def test_tracker_step_is_within_budget_without_syncs_and_reads_once(kind):
    count = step_counts(gpt2_shaped(12), **KINDS[kind])
    assert count.total <= BUDGET[kind], count.device.most_common(12)
    assert not SYNCING & set(count.device), SYNCING & set(count.device)
    assert count.bool_index == 0  # boolean-mask indexing syncs to size its output
    assert count.host_reads == 1  # the step's staged table, one transfer


@pytest.mark.parametrize("kind", list(KINDS))
def test_tracker_ops_do_not_grow_with_layers_only_with_dtypes(kind):
    two, four = step_counts(gpt2_shaped(2), **KINDS[kind]), step_counts(
        gpt2_shaped(4), **KINDS[kind]
    )
    assert four.device == two.device  # 50 or 26 tensors: the same kernels
    mixed = step_counts(gpt2_shaped(2, embed_dtype=torch.bfloat16), **KINDS[kind])
    # a bfloat16 group beside the float32 one: about twice the per-group work, no more
    assert 1.3 * two.total <= mixed.total <= 2.0 * two.total
    assert mixed.host_reads == 1


def test_describe_layers_is_within_budget_and_does_not_grow_with_layers():
    counts = []
    for n_layer in (12, 2):
        weights = nnstat.get_weight(gpt2_shaped(n_layer))
        for _ in range(2):  # the second call reuses the cached layout
            with OpCount() as count:
                weights.describe_layers()
        counts.append(count)
    assert counts[0].total <= 250, counts[0].device.most_common(12)
    assert counts[0].device == counts[1].device
    assert not SYNCING & set(counts[0].device)
    assert counts[0].host_reads == 1


#: ops that allocate without launching a kernel
ALLOCATING = {"empty", "empty_like", "empty_strided", "new_empty"}


def test_describe_layers_of_a_fresh_weight_copy_launches_kernels_per_dtype_group():
    """The everyday call, ``wandb.log(nnstat.get_weight(model).describe_layers())`` every step:
    the copy of the weights too is a kernel per dtype group, not per tensor."""

    def kernels(model: torch.nn.Module) -> OpCount:
        for _ in range(2):  # the second call reuses the cached layout
            with OpCount() as count:
                nnstat.get_weight(model).describe_layers()
        for op in ALLOCATING:
            count.device.pop(op, None)
        return count

    twelve, two = kernels(gpt2_shaped(12)), kernels(gpt2_shaped(2))
    assert twelve.device == two.device, (twelve.device - two.device, two.device - twelve.device)
    assert twelve.total <= 150, twelve.device.most_common(12)
    assert not SYNCING & set(twelve.device) and twelve.host_reads == 1
    mixed = kernels(gpt2_shaped(2, embed_dtype=torch.bfloat16))
    assert two.total < mixed.total <= 2 * two.total and mixed.host_reads == 1
