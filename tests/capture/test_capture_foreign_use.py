"""A watched parameter that also gets gradient outside its module's forward (an output layer
tied to the embedding by hand: ``F.linear(h, emb.weight)``) is left out with the reason and the
fix, never captured with only the module's share of its gradient; the set-ups where every use
of a parameter is a call of its module (a module called twice, ties through modules,
activation checkpointing, attention, in-place ops on a view output) keep every module, each
matching ``torch.func`` per-sample gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import nnstat
from nnstat.capture import CaptureEngine

V, D = 11, 6


class HandTied(nn.Module):
    """nanoGPT-like: the output layer reuses the token embedding by hand."""

    def __init__(self, how: str = "linear") -> None:
        super().__init__()
        self.emb, self.body = nn.Embedding(V, D), nn.Linear(D, D)
        self.how = how

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(ids)))
        if self.how == "matmul":
            return h @ self.emb.weight.T
        return F.linear(h, self.emb.weight)


class TiedThroughAModule(nn.Module):
    """The same tie through a module (GPT-2's lm_head): captured whole (tied.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.body = nn.Embedding(V, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids))))


class UsedInsideAnother(nn.Module):
    """``body``'s weight also scales ``gate``'s output inside the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.body, self.gate = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(ids)))
        return self.gate(h) * self.body.weight.sum()


class Recurrent(nn.Module):
    """One Linear applied at two depths (weight sharing by reuse), optionally checkpointed."""

    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        self.emb, self.step, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.ckpt = ckpt

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.step(torch.tanh(self.step(h))))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.ckpt is not None:
            h = checkpoint(self.block, h, use_reentrant=self.ckpt == "reentrant")
        else:
            h = self.block(h)
        return self.head(h)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` (in_proj by ``F.linear`` on its parameter, out_proj never
    called) and an in-place ReLU on a ``[N, T, d]`` Linear's view output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp, self.head = nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(F.relu(self.mlp(h), inplace=True))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), ids.roll(1, -1).reshape(-1), reduction="sum")


def reference(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, x):
        return lm_loss(functional_call(model, p, (x[None],)), x[None])

    return vmap(grad(one), in_dims=(None, 0))(params, ids)


def capture(model: nn.Module, ids: torch.Tensor) -> tuple[CaptureEngine, dict, list[str]]:
    engine = CaptureEngine()
    caps: dict = {}
    engine.add_consumer(lambda c: caps.setdefault(c.name, c.per_sample_grads_by_param()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine.watch(model)
        with engine.batch():
            lm_loss(model(ids), ids).backward()
    return engine, caps, [str(w.message) for w in seen]


def assert_matches(caps: dict, ref: dict) -> None:
    for name, grads in caps.items():
        for p, g in grads.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["linear", "matmul"])
def test_a_parameter_reused_by_hand_leaves_its_module_out_naming_the_fix(how):
    # captured, 'emb' held only the lookup's share of the embedding's gradient: its per-sample
    # gradients missed the output layer's part (a relative error of about 1 on this model)
    torch.manual_seed(0)
    model = HandTied(how)
    ids = torch.randint(0, V, (4, 5))
    engine, caps, warned = capture(model, ids)
    assert set(caps) == {"body"} and set(engine.left_out) == {"emb"}
    assert len(warned) == 1
    msg = warned[0]
    assert "'emb'" in msg and "'weight'" in msg and "outside every watched module" in msg
    assert "head.weight = emb.weight" in msg  # the fix: a tie through a module
    assert_matches(caps, reference(model, ids))


def test_a_parameter_used_inside_another_module_call_is_named_there():
    torch.manual_seed(0)
    model = UsedInsideAnother()
    ids = torch.randint(0, V, (3, 4))
    engine, caps, warned = capture(model, ids)
    assert set(caps) == {"emb", "gate"} and set(engine.left_out) == {"body"}
    assert len(warned) == 1 and "'body'" in warned[0] and "outside every watched" in warned[0]
    assert_matches(caps, reference(model, ids))


@pytest.mark.parametrize(
    "make",
    [
        TiedThroughAModule,
        Recurrent,
        lambda: Recurrent("reentrant"),
        lambda: Recurrent("non-reentrant"),
        Attention,
    ],
    ids=["tie-through-module", "recurrent", "ckpt-reentrant", "ckpt-non-reentrant", "attention"],
)
def test_every_use_through_its_module_keeps_every_module(make):
    torch.manual_seed(0)
    model = make()
    ids = torch.randint(0, V, (4, 5))
    engine, caps, warned = capture(model, ids)
    assert warned == [] and engine.left_out == {}
    ckpt, model.ckpt = getattr(model, "ckpt", None), None  # the same values without it (vmap)
    ref = reference(model, ids)
    model.ckpt = ckpt
    if isinstance(model, TiedThroughAModule):  # one capture of the tie, under its owner
        ref["head.weight"] = ref.pop("emb.weight")
    assert set(caps) == {n.rsplit(".", 1)[0] for n in ref}
    assert_matches(caps, ref)


def test_the_check_runs_once_and_again_after_a_new_watch():
    torch.manual_seed(0)
    model = HandTied()
    ids = torch.randint(0, V, (2, 3))
    engine, _, warned = capture(model, ids)
    assert len(warned) == 1
    assert engine._foreign is None  # checked: later blocks record no calls
    engine.unwatch()
    with pytest.warns(UserWarning, match="'emb'"):
        engine.watch(model)
        with engine.batch():
            lm_loss(model(ids), ids).backward()


def test_a_store_block_refuses_a_module_left_out_for_a_reused_parameter(tmp_path):
    torch.manual_seed(0)
    model = HandTied()
    ids = torch.randint(0, V, (4, 5))
    run = nnstat.init(project="hand-tied", root_dir=str(tmp_path))
    try:
        nnstat.watch(model)
        with pytest.warns(UserWarning, match="'emb'"), pytest.raises(ValueError) as err:
            with run(data_id=list(range(4))):
                lm_loss(model(ids), ids).backward()
        msg = str(err.value)
        assert "'emb'" in msg and "outside the module's own forward" in msg
        assert "through a module" in msg and "name_filter" in msg
    finally:
        nnstat.finalize()
        nnstat.unwatch()
