"""Transformer layouts: position lookups ``[T]`` / ``[1, T]`` / ``[B, T]``, a ``[T, T]``
relative-position table, tied input/output embeddings, ``nn.MultiheadAttention`` and
``F.scaled_dot_product_attention``.

Every per-sample gradient is checked against ``torch.func.vmap(grad(...))`` of each sequence's
own loss on a float64 model (the captures are float32: tolerances are float32's). Layouts the
shapes cannot tell apart (``T`` equal to the batch size) must be refused with the module, the
layout and the one-line fix, never captured wrong.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.capture import CaptureEngine, UnsupportedModuleError

V, D, H = 13, 8, 2


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss of each sequence, summed over its tokens and the sequences."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def reference(model: nn.Module, ids: torch.Tensor, *extra: torch.Tensor) -> dict:
    """{parameter name: [B, *shape]}: each sequence's own gradient (torch.func)."""

    def one(p, x, *e):
        return lm_loss(functional_call(model, p, (x[None], *(t[None] for t in e))), x[None])

    params = {k: v.detach() for k, v in model.named_parameters()}
    return vmap(grad(one), in_dims=(None, 0, *[0] * len(extra)))(params, ids, *extra)


def capture(model: nn.Module, ids: torch.Tensor, *extra: torch.Tensor, **batch) -> tuple:
    """(names, {module: capture}, warnings) of one logged backward (block samples: "input")."""
    engine = CaptureEngine()
    names = engine.watch(model)
    caps: dict = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with engine.batch(samples="input", **batch):
            lm_loss(model(ids, *extra), ids).backward()
    engine.unwatch()
    model.zero_grad()
    return names, caps, [str(w.message) for w in seen if "nnstat" in str(w.message)]


def assert_matches(caps: dict, ref: dict, names: list[str], tied: dict | None = None) -> None:
    """Every module's per-sample gradients (and squared norms) equal the reference;
    ``tied``: {module: the parameter name torch.func reports for its shared weight}."""
    assert set(caps) == set(names)
    for name, cap in caps.items():
        got = cap.per_sample_grads_by_param()
        sq = 0
        for pname, g in got.items():
            key = (tied or {}).get(name) if pname == "weight" else None
            want = ref[key or (f"{name}.{pname}" if name != "model" else pname)]
            scale = want.abs().max().item()
            assert scale > 0, (name, pname)
            torch.testing.assert_close(g.double(), want, rtol=0, atol=1e-5 * scale, msg=name)
            sq = sq + want.flatten(1).pow(2).sum(1)
        torch.testing.assert_close(cap.per_sample_sq_norm().double(), sq, rtol=1e-4, atol=1e-8)


class NanoGPT(nn.Module):
    """nanoGPT/minGPT: ``wpe`` looked up on ``torch.arange(T)`` (``layout="[T]"``), GPT-2's
    ``[1, T]``, or ids given per sequence (``[B, T]``); one causal block with
    ``F.scaled_dot_product_attention`` on nn.Linear projections; ``lm_head`` tied or not."""

    def __init__(self, layout: str = "[T]", tied: bool = False, block: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(block, D)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tied:
            self.wte.weight = self.lm_head.weight  # nanoGPT's spelling
        self.layout = layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        pos = torch.arange(t)
        if self.layout == "[1, T]":
            pos = pos[None]
        elif self.layout == "[B, T]":
            pos = pos.expand(b, t)
        x = self.wte(ids) + self.wpe(pos)
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        x = x + self.fc(torch.tanh(self.ln2(x)))
        return self.lm_head(self.ln_f(x))


def ids_of(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", ["[T]", "[1, T]", "[B, T]"])
def test_position_lookup_layouts_match_torch_func(layout):
    """nanoGPT's ``wpe(torch.arange(T))`` (no batch dimension; it stopped logging before with
    "different batch sizes (6: 'wpe'; 4: ...)"), GPT-2's ``[1, T]`` and per-sequence ids:
    every module, the SDPA block's projections included."""
    torch.manual_seed(0)
    model = NanoGPT(layout).double()
    ids = ids_of(4, 6)
    names, caps, warned = capture(model, ids)
    assert warned == []
    assert caps["wpe"].num_samples == 4
    assert_matches(caps, reference(model, ids), names)


@pytest.mark.parametrize("layout", ["[T]", "[1, T]"])
def test_shared_lookup_under_a_mean_loss_and_a_padding_mask(layout):
    """``loss_reduction="mean"`` and a padding mask (which sizes the batch) with a shared
    position lookup: masked positions take no part in any module's rows."""
    torch.manual_seed(0)
    model = NanoGPT(layout).double()
    ids = ids_of(3, 6, seed=1)
    keep = (torch.arange(6)[None] < torch.tensor([[6], [4], [5]])).double()
    labels = ids.masked_fill(keep == 0, -100)

    def loss(logits, y):  # a mean over the 3 sequences of each one's summed token losses
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / 3

    engine = CaptureEngine()
    names = engine.watch(model)
    caps: dict = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap}))
    with engine.batch(mask=keep, loss_reduction="mean"):
        loss(model(ids), labels).backward()
    engine.unwatch()

    def one(p, x, y):
        logits = functional_call(model, p, (x[None],))
        # causal attention: padding at the end does not reach the kept positions
        return F.cross_entropy(logits.flatten(0, 1), y, reduction="sum")

    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, ids, labels)
    assert caps["wpe"].num_samples == 3
    assert_matches(caps, ref, names)


def test_position_lookup_with_t_equal_to_the_batch_is_refused_with_the_fix():
    """``wpe(torch.arange(T))`` with T == B: ``[T]`` looks like one id per sample. The first
    use (broadcast over the batch) gives it away: the module is left out, never captured as
    rows of samples, and the message names it, the layout and the ``[None]`` fix, which then
    captures it exactly."""
    torch.manual_seed(0)
    model = NanoGPT("[T]").double()
    ids = ids_of(6, 6)
    names, caps, warned = capture(model, ids)
    assert "wpe" not in caps and set(caps) == set(names) - {"wpe"}
    assert len(warned) == 1
    msg = warned[0]
    assert "'wpe'" in msg and "(6,)" in msg and "equal to 6, the batch size" in msg
    assert "[T] position ids" in msg and "self.pos(torch.arange(T)[None])" in msg
    ref = reference(model, ids)
    assert_matches(caps, ref, [n for n in names if n != "wpe"])
    model.layout = "[1, T]"  # the fix
    names, caps, warned = capture(model, ids)
    assert warned == [] and caps["wpe"].num_samples == 6
    assert_matches(caps, ref, names)


class LabelConditioned(nn.Module):
    """An embedding of one class label per sample (``[B]``, not the model's first input): the
    case the ``T == B`` check must not refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.label = nn.Embedding(V, D), nn.Embedding(5, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        c = self.label(label)  # [B, D]
        return self.head(torch.tanh(self.tok(ids) + c.unsqueeze(1) * 0.5))


def test_per_sample_label_embedding_with_as_many_labels_as_positions_is_kept():
    torch.manual_seed(0)
    model = LabelConditioned().double()
    ids, label = ids_of(4, 4), torch.tensor([0, 3, 3, 1])
    names, caps, warned = capture(model, ids, label)
    assert warned == [] and caps["label"].num_samples == 4
    assert_matches(caps, reference(model, ids, label), names)


class RelativeBias(nn.Module):
    """T5-style: a ``[T, T]`` table of relative-position buckets looked up into a
    ``[T, T, heads]`` bias, permuted to ``[1, heads, T, T]`` and added to the scores;
    ``slot=True`` looks it up on ``buckets[None]`` (the fix when T equals the batch size)."""

    def __init__(self, slot: bool = False) -> None:
        super().__init__()
        self.tok, self.rel = nn.Embedding(V, D), nn.Embedding(7, H)
        self.qkv, self.head = nn.Linear(D, 3 * D), nn.Linear(D, V)
        self.slot = slot

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        pos = torch.arange(t)
        buckets = (pos[None, :] - pos[:, None]).clamp(-3, 3) + 3
        if self.slot:
            bias = self.rel(buckets[None]).permute(0, 3, 1, 2)
        else:
            bias = self.rel(buckets).permute(2, 0, 1).unsqueeze(0)
        q, k, v = self.qkv(self.tok(ids)).view(b, t, 3, H, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 2.0 + bias
        return self.head((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D))


def test_relative_position_table_is_expanded_and_matches_torch_func():
    torch.manual_seed(0)
    model = RelativeBias().double()
    ids = ids_of(3, 5)
    names, caps, warned = capture(model, ids)
    assert warned == [] and caps["rel"].num_samples == 3
    assert_matches(caps, reference(model, ids), names)


def test_relative_position_table_with_t_equal_to_the_batch_is_refused_then_fixed():
    torch.manual_seed(0)
    model = RelativeBias().double()
    ids = ids_of(5, 5)
    names, caps, warned = capture(model, ids)
    assert "rel" not in caps and len(warned) == 1
    assert "'rel'" in warned[0] and "(5, 5)" in warned[0] and "relative-position" in warned[0]
    ref = reference(model, ids)
    model.slot = True  # rel(buckets[None]): [1, T, T] ids, expanded to the batch
    names, caps, warned = capture(model, ids)
    assert warned == []
    assert_matches(caps, ref, names)


def test_tied_embeddings_are_one_parameter_captured_once():
    """``wte.weight is lm_head.weight``: captured once, under ``lm_head``, as the sum of both
    modules' contributions (the gradient torch.func gives the one parameter), under a mean
    loss; ``wte`` is not a module of its own in the names or the captures."""
    torch.manual_seed(0)
    model = NanoGPT("[T]", tied=True).double()
    ids = ids_of(4, 6)

    def mean_loss(logits, y):
        return lm_loss(logits, y) / 4

    engine = CaptureEngine()
    names = engine.watch(model)
    caps: dict = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap}))
    with engine.batch(samples="input", loss_reduction="mean"):
        mean_loss(model(ids), ids).backward()
    assert "wte" not in names and "lm_head" in names and list(engine.watched) == names
    engine.unwatch()
    assert caps["lm_head"].num_positions == 2 * 4 * 6  # every use of the weight
    # the reference: torch.func names the shared parameter after its first owner, wte
    assert [k for k, _ in model.named_parameters()][0] == "wte.weight"
    # "mean": captures are gradients of each sequence's own (summed) loss, as the reference
    assert_matches(caps, reference(model, ids), names, tied={"lm_head": "wte.weight"})
    # summed over the batch: the gradient autograd accumulated in the one parameter
    got = caps["lm_head"].per_sample_grads_by_param()["weight"].sum(0)
    torch.testing.assert_close(got.double() / 4, model.lm_head.weight.grad, rtol=0, atol=1e-6)


def test_tie_groups_are_completed_and_untieable_ones_refused():
    """Selecting one module of a tie captures the whole group under its owner; a tie whose
    modules also own parameters of their own (an output bias) is refused with the reason."""
    model = NanoGPT(tied=True)
    assert CaptureEngine().watch(model, name_filter="^wte$") == ["lm_head"]
    biased = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, V))
    biased[1].weight = biased[0].weight
    with pytest.raises(UnsupportedModuleError, match="share a parameter but not all"):
        CaptureEngine().watch(biased, name_filter="0")
    with pytest.warns(UserWarning, match="output bias"):
        assert CaptureEngine().watch(biased) == []


class MHAModel(nn.Module):
    """A pre-LN block on ``nn.MultiheadAttention`` (``batch_first`` either way), causal
    self-attention or cross-attention to a second sequence, and a padding mask on keys."""

    def __init__(self, batch_first: bool, cross: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(8, D)
        self.ln = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=batch_first, dropout=dropout)
        self.head = nn.Linear(D, V)
        self.batch_first, self.cross = batch_first, cross

    def forward(self, ids: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t))
        h = self.ln(x)
        seq = (lambda z: z) if self.batch_first else (lambda z: z.transpose(0, 1))
        if self.cross:
            m = self.tok(memory)
            pad = memory == 0  # padding token 0: not attended
            y = self.attn(seq(h), seq(m), seq(m), key_padding_mask=pad)[0]
        else:
            mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
            y = self.attn(seq(h), seq(h), seq(h), attn_mask=mask, is_causal=True)[0]
        return self.head(x + seq(y))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_multihead_attention_in_proj_and_out_proj_match_torch_func(batch_first, cross):
    torch.manual_seed(0)
    model = MHAModel(batch_first, cross).double()
    ids = ids_of(3, 5)
    extra = ()
    if cross:
        memory = ids_of(3, 4, seed=2)
        memory[1, -2:] = 0
        extra = (memory,)
    names, caps, warned = capture(model, ids, *extra)
    assert warned == [] and {"attn", "attn.out_proj"} <= set(names)
    assert caps["attn"].kind == "attention" and caps["attn"].num_samples == 3
    assert set(caps["attn"].per_sample_grads_by_param()) == {"in_proj_weight", "in_proj_bias"}
    assert_matches(caps, reference(model, ids, *extra), names)


def test_multihead_attention_dropout_or_used_weights_are_refused_with_the_fix():
    torch.manual_seed(0)
    model = MHAModel(True, dropout=0.1).double().train()
    names, caps, warned = capture(model, ids_of(3, 5))
    assert "attn" not in caps and "attn.out_proj" not in caps
    assert any("'attn'" in w and "dropout=0.1" in w and "dropout=0.0" in w for w in warned)

    class UsesWeights(MHAModel):
        def forward(self, ids):
            h = self.ln(self.tok(ids))
            y, w = self.attn(h, h, h)
            return self.head(h + y) + w.sum(-1, keepdim=True)

    model = UsesWeights(True).double()
    names, caps, warned = capture(model, ids_of(3, 5))
    assert "attn" not in caps and "head" in caps
    assert any("second output" in w and "need_weights=False" in w for w in warned)


def test_multihead_attention_with_frozen_parameters_on_the_model_input():
    """The store's ``param_grads=False`` pass freezes the watched parameters; an attention
    module fed the model's input (no gradient anywhere upstream, eval mode: torch's fused
    path) still gets its rows through ``outputs_require_grad``."""

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)
            self.head = nn.Linear(D, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x)[0]).sum(1)

    torch.manual_seed(0)
    model = First().double().eval()
    x, y = torch.randn(4, 5, D, dtype=torch.float64), torch.randint(0, 3, (4,))

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None], reduction="sum")

    ref = vmap(grad(one), in_dims=(None, 0, 0))(dict(model.named_parameters()), x, y)
    model.requires_grad_(False)
    engine = CaptureEngine()
    names = engine.watch(model)
    caps: dict = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap}))
    with engine.batch(outputs_require_grad=True):
        F.cross_entropy(model(x), y, reduction="sum").backward()
    engine.unwatch()
    assert_matches(caps, {k: v.detach() for k, v in ref.items()}, names)


@pytest.mark.parametrize("layout", ["[T]", "ambiguous", "mha"])
def test_layout_hooks_read_nothing_back_to_the_host(layout):
    """Expanding a shared lookup, checking an ambiguous one, merging a tie and recomputing
    attention add no host read to a step (on a GPU each would wait for the queue): the step
    with nnstat reads exactly what the model alone reads."""
    from _ledger import host_reads

    torch.manual_seed(0)
    if layout == "mha":
        model, ids = MHAModel(batch_first=True), ids_of(3, 5)
    else:
        model, ids = NanoGPT("[T]", tied=True), ids_of(6 if layout == "ambiguous" else 4, 6)
    alone: list[str] = []
    with host_reads(alone):
        lm_loss(model(ids), ids).backward()
    engine = CaptureEngine()
    engine.watch(model)
    caps: list = []
    engine.add_consumer(caps.append)
    reads: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ambiguous" leaves wpe out, with a warning
        with host_reads(reads), engine.batch(samples="input"):
            lm_loss(model(ids), ids).backward()
    engine.unwatch()
    assert caps and reads == alone


def test_a_run_block_refuses_an_ambiguous_lookup_rather_than_storing_it(tmp_path):
    """In the plain workflow the ``T == B`` lookup is not stored as zeros or as wrong rows:
    the block is refused, naming the module and the layout."""
    import nnstat

    torch.manual_seed(0)
    model = NanoGPT("[T]")
    ids = ids_of(6, 6)
    run = nnstat.init(project="ambiguous", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad"})
    nnstat.watch(model)
    with pytest.warns(UserWarning, match="'wpe'"), pytest.raises(ValueError) as info:
        with run(data_id=list(range(6))):
            lm_loss(model(ids), ids).backward()
    assert "'wpe'" in str(info.value) and "[T] position ids" in str(info.value)
    run.unwatch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.finalize()


class PosNorm(nn.Module):
    """A LayerNorm on the position embedding's output before it is added (row by row on a
    shared table): it is as shared as the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.norm = nn.Embedding(V, D), nn.Embedding(8, D), nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(
            torch.tanh(self.tok(ids) + self.norm(self.pos(torch.arange(ids.shape[1]))))
        )


def test_a_module_on_a_shared_lookup_is_captured_with_it_or_refused_with_it():
    torch.manual_seed(0)
    model = PosNorm().double()
    ids = ids_of(3, 5)
    names, caps, warned = capture(model, ids)
    assert warned == [] and caps["norm"].num_samples == 3
    assert_matches(caps, reference(model, ids), names)
    ids = ids_of(5, 5)  # T == B: both the lookup and the LayerNorm on it are refused
    names, caps, warned = capture(model, ids)
    assert set(caps) == {"tok", "head"} and len(warned) == 2
    assert "'norm'" in warned[1] and "'pos'" in warned[1] and "[None]" in warned[1]
    assert_matches(caps, reference(model, ids), ["tok", "head"])


class Encoder(nn.Module):
    """``nn.TransformerEncoderLayer``: batch-first, or torch's default sequence-first."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.enc = nn.TransformerEncoderLayer(D, H, 16, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(D, V)
        self.batch_first = batch_first

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = (lambda z: z) if self.batch_first else (lambda z: z.transpose(0, 1))
        return self.head(seq(self.enc(seq(self.emb(ids)))))


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_transformer_layer_batch_first_or_sequence_first(batch_first):
    """Batch-first: every module of the layer matches torch.func. Sequence-first: its Linears
    and LayerNorms see [T, B, E] (wrong rows when T == B), so they are not watched and the
    warning names the layer and batch_first=True; its attention is still captured."""
    torch.manual_seed(0)
    model = Encoder(batch_first).double()
    ids = ids_of(5, 5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        names = CaptureEngine().watch(model)
    layer = {"enc.linear1", "enc.linear2", "enc.norm1", "enc.norm2"}
    if batch_first:
        assert layer <= set(names) and not seen
    else:
        assert not layer & set(names) and {"enc.self_attn", "enc.self_attn.out_proj"} <= set(names)
        msg = str(seen[0].message)
        assert "'enc'" in msg and "batch_first=False" in msg and "batch_first=True" in msg
    names, caps, warned = capture(model, ids)
    assert warned == []
    assert_matches(caps, reference(model, ids), names)


def test_a_sequence_first_transformer_layer_passed_as_the_model_is_refused_too():
    """The layer as the watched model itself (its modules' names have no ``"enc."`` prefix):
    its Linears and LayerNorms see ``[T, B, E]``; captured, they gave T "samples" whose rows
    were positions, not samples (B = 4, T = 5: per-sample gradients of shape [5, ...]). They
    are skipped with the warning naming the layer; its attention still matches torch.func."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 16, dropout=0.0).double()
    x, y = torch.randn(5, 4, D, dtype=torch.float64), torch.randn(5, 4, D, dtype=torch.float64)
    engine = CaptureEngine()
    with pytest.warns(UserWarning, match=r"'model', built with batch_first=False") as seen:
        names = engine.watch(layer)
    assert names == ["self_attn", "self_attn.out_proj"]
    assert all(f"{m} (" in str(seen[0].message) for m in ("linear1", "linear2", "norm1", "norm2"))
    with pytest.raises(UnsupportedModuleError, match="batch_first=True"):
        CaptureEngine().watch(layer, name_filter="linear1")
    caps = {}
    engine.add_consumer(lambda c: caps.setdefault(c.name, c.per_sample_grads_by_param()))
    with engine.batch():
        F.mse_loss(layer(x), y, reduction="sum").backward()
    engine.unwatch()
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def one(p, xi, yi):  # sample i: column i of the sequence-first tensors
        return F.mse_loss(functional_call(layer, p, (xi[:, None],)), yi[:, None], reduction="sum")

    ref = vmap(grad(one), in_dims=(None, 1, 1))(params, x, y)
    assert set(caps) == {"self_attn", "self_attn.out_proj"}
    for name, grads in caps.items():
        for p, g in grads.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"].float(), rtol=1e-5, atol=1e-6)
