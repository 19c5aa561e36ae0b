"""Modules whose input is shared by the whole batch (GPT-2's ``wpe`` sees ``[1, T]`` position ids).

References are per-example autograd backward passes (batch size 1 each) of a copy of the model
whose tied ``lm_head`` weight is a separate parameter of the same value, so every module's own
contribution is a plain ``.grad``. The tied parameter is captured once, under ``lm_head``
(nnstat/capture/layouts/tied.py): its reference is the sum of ``lm_head``'s and ``wte``'s gradients.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nnstat
from nnstat.capture import CaptureEngine

transformers = pytest.importorskip("transformers")

B, T, V = 3, 8, 97


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=V,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, same as the reference


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's next-token loss, summed over tokens and sequences (-100: no loss)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")


def reference(
    ids: torch.Tensor, labels: torch.Tensor | None = None
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """{module: per example {param: grad}} from one backward per example (a fresh, unwatched
    model of the same seed)."""
    untied = tiny_gpt2()
    untied.lm_head.weight = nn.Parameter(untied.transformer.wte.weight.detach().clone())
    modules = {
        n: m for n, m in untied.named_modules() if any(True for _ in m.parameters(recurse=False))
    }
    out: dict[str, list[dict[str, torch.Tensor]]] = {n: [] for n in modules}
    for i in range(len(ids)):
        untied.zero_grad()
        target = (ids if labels is None else labels)[i : i + 1]
        lm_loss(untied(input_ids=ids[i : i + 1]).logits, target).backward()
        for n, m in modules.items():
            out[n].append({k: p.grad.clone() for k, p in m.named_parameters(recurse=False)})
    for head, wte in zip(out["lm_head"], out.pop("transformer.wte"), strict=True):
        head["weight"] = head["weight"] + wte["weight"]  # one parameter: both uses
    return out


def matrix_form(kind: str, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """A module's gradient as the store lays it out (docs/architecture.md)."""
    if kind == "embedding":
        return grads["weight"].T
    if kind == "layernorm":
        return torch.cat([grads["weight"], grads["bias"]])
    w = grads["weight"].T if kind == "conv1d_hf" else grads["weight"]
    return torch.cat([w, grads["bias"][:, None]], 1) if "bias" in grads else w


def test_plain_workflow_stores_exact_rows_for_every_module_incl_wpe(tmp_path):
    model = tiny_gpt2()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    run = nnstat.init(project="gpt2", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad"})
    names = nnstat.watch(model)
    assert {"transformer.wpe", "lm_head"} <= set(names) and "transformer.wte" not in names
    nnstat.add_projection(rank=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out, nothing stored as zeros
        with run(data_id=["a", "b", "c"]):
            lm_loss(model(input_ids=ids).logits, ids).backward()
        nnstat.finalize()
    store = nnstat.GradientStore(tmp_path / "gpt2")
    log = store.load()
    assert log.ids == ["a", "b", "c"]
    proj = store.projections()
    ref = reference(ids)
    assert {m["name"] for m in store.modules} == set(names)
    worst = 0.0
    for m in store.modules:
        name, kind = m["name"], m["kind"]
        rows = store.module_view(log.rows, name)
        for i in range(B):
            g = matrix_form(kind, ref[name][i])
            p_in = proj.get(f"{name}/p_in")
            if kind == "layernorm":
                want = g if p_in is None else p_in @ g
            else:
                p_out = proj.get(f"{name}/p_out")
                g = g if p_out is None else p_out @ g
                want = g if p_in is None else g @ p_in.T
            assert want.abs().max() > 0, name
            err = (rows[i].flatten() - want.flatten()).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-5, (name, i, err)
    assert worst < 1e-5


@pytest.mark.parametrize("batch, padded", [(B, False), (1, False), (B, True)])
def test_engine_per_sample_grads_match_per_example_backward(batch, padded):
    """Unprojected: every module, wpe and wte included; batch 1 needs no expansion; with
    padding, the mask sizes the batch and masks wpe's rows of each sequence."""
    model = tiny_gpt2()
    ids = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(2))
    labels, mask = ids, None
    if padded:  # sequences of 8, 5 and 6 tokens; no loss on the padding (causal: no effect)
        mask = (torch.arange(T)[None] < torch.tensor([[8], [5], [6]])).float()
        labels = ids.masked_fill(mask == 0, -100)
    engine = CaptureEngine()
    names = engine.watch(model)
    caps: dict[str, dict[str, torch.Tensor]] = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap.per_sample_grads_by_param()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the batch: the mask's, else dim 0 of the model's input_ids
        with engine.batch(mask=mask, samples=None if padded else "input"):
            logits = model(input_ids=ids).logits
            lm_loss(logits, labels).backward()
    engine.unwatch()
    assert set(caps) == set(names) and engine.left_out == {}
    ref = reference(ids, labels)
    for name in names:
        for k, got in caps[name].items():
            want = torch.stack([r[k] for r in ref[name]])
            assert got.shape == want.shape, (name, k)
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (name, k)
    # the summed per-sample gradients are the batch gradient autograd computed: nothing changed
    wpe = model.transformer.wpe.weight
    assert torch.allclose(caps["transformer.wpe"]["weight"].sum(0), wpe.grad, atol=1e-5)


def test_kfac_statistics_of_wpe_use_each_samples_output_gradient(tmp_path):
    model = tiny_gpt2()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    run = nnstat.init(project="kfac", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac"})
    nnstat.watch(model)
    nnstat.add_projection(rank=4)
    for _ in run.schedule():
        with run(data_id=[0, 1, 2]):
            lm_loss(model(input_ids=ids).logits, ids).backward()
        model.zero_grad()
    stats = nnstat.GradientStore(tmp_path / "kfac").statistics()
    # S = (1/N) sum_i sum_t b_it b_itᵀ with b_i = d loss_i / d wpe-output of example i alone
    outs = []

    def keep(module, inputs, output):
        output.retain_grad()
        outs.append(output)

    hook = model.transformer.wpe.register_forward_hook(keep)
    for i in range(B):
        lm_loss(model(input_ids=ids[i : i + 1]).logits, ids[i : i + 1]).backward()
    hook.remove()
    b = torch.cat([o.grad for o in outs]).reshape(-1, 32)
    want = b.T @ b / B
    got = stats["transformer.wpe/backward/covariance"]
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()
    # the batch-summed gradient (what the hooks saw without the expansion) gives another S
    summed = sum(o.grad for o in outs).reshape(-1, 32)
    assert not torch.allclose(summed.T @ summed, want * B, rtol=1e-2)


class SharedNotBroadcast(nn.Module):
    """``glob`` sees a [1, 4] input shared by the batch and its output is summed over it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.glob = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.register_buffer("seed", torch.randn(1, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = self.glob(self.seed)
        return self.head(self.tok(ids).sum(1) + g.sum(0))  # a sum over the batch, not a broadcast


def test_batch1_output_used_otherwise_is_left_out_with_one_warning_and_exact_forward(tmp_path):
    torch.manual_seed(0)
    model = SharedNotBroadcast()
    ids, y = torch.randint(0, 10, (5, 6)), torch.randint(0, 3, (5,))
    plain = copy.deepcopy(model)
    want = F.cross_entropy(plain(ids), y, reduction="sum")
    want.backward()
    engine = CaptureEngine()
    engine.watch(model)
    caps = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap}))
    for step in range(2):
        model.zero_grad()
        caps.clear()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with engine.batch(samples=5):
                loss = F.cross_entropy(model(ids), y, reduction="sum")
                loss.backward()
        msgs = [str(w.message) for w in seen if "nnstat" in str(w.message)]
        assert len(msgs) == (1 if step == 0 else 0), msgs  # one warning, at the first batch
        if step == 0:
            assert "'glob'" in msgs[0] and "'sum'" in msgs[0] and "expand" in msgs[0]
        # the model computed exactly as without nnstat
        assert torch.equal(loss, want)
        for (k, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), k
        assert set(caps) == {"tok", "head"} and caps["tok"].num_samples == 5
    assert set(engine.left_out) == {"glob"}
    engine.unwatch()

    # the store's layout has it, so a run refuses the block instead of storing zeros
    run = nnstat.init(project="toy", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad"})
    nnstat.watch(model)
    with pytest.warns(UserWarning, match="'glob'"), pytest.raises(ValueError, match="'glob'"):
        with run(data_id=list(range(5))):
            F.cross_entropy(model(ids), y, reduction="sum").backward()
    close(run)


class PosFirst(nn.Module):
    """A position embedding that runs before the token embedding, combined by ``mul`` after a
    dtype cast: the batch comes from the model's input, every use broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(6, 4)
        self.tok = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(ids.shape[1])[None]).to(torch.float64) * 2.0
        h = self.tok(ids).double() * p
        return self.head(h.float().mean(1))


class Flattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).flatten(0, 1))  # b sees [N*T, 4]: no batch dimension


def test_different_batch_sizes_error_names_the_modules(tmp_path):
    torch.manual_seed(0)
    model = Flattened()
    run = nnstat.init(project="flat", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad"})
    nnstat.watch(model)
    with pytest.raises(ValueError, match="different batch sizes") as info:
        with run(data_id=[0, 1, 2]):
            model(torch.randn(3, 5, 4)).sum().backward()
    msg = str(info.value)
    assert "3: 'a'" in msg and "15: 'b'" in msg, msg
    close(run)


def close(run) -> None:
    """End a run whose only block was refused (its pass holds nothing)."""
    run.unwatch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.finalize()


class InPlace(nn.Module):
    """BERT's spelling: the shared position embedding is added in place."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(6, 4)
        self.tok = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        h += self.pos(torch.arange(ids.shape[1])[None])
        return self.head(h.mean(1))


def test_in_place_add_of_the_shared_output_matches_torch_func():
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = InPlace()
    ids, y = torch.randint(0, 10, (4, 6)), torch.randint(0, 3, (4,))
    engine = CaptureEngine()
    engine.watch(model)
    caps = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap.per_sample_grads_by_param()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with engine.batch(samples=4):
            F.cross_entropy(model(ids), y, reduction="sum").backward()
    engine.unwatch()

    def one(params, xi, yi):
        out = functional_call(model, params, (xi[None],))
        return F.cross_entropy(out, yi[None], reduction="sum")

    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, ids, y)
    assert caps["pos"]["weight"].shape == (4, 6, 4)
    assert torch.allclose(caps["pos"]["weight"], ref["pos.weight"], atol=1e-6)


def test_batch_unknown_when_the_module_ran_is_left_out_not_summed():
    """Submodules called without the watched root: B cannot be read from the model input, so
    the shared module saw a batch of 1 while the others saw 4; it is left out, with a warning."""
    torch.manual_seed(0)
    model = InPlace()
    ids = torch.randint(0, 10, (4, 6))
    engine = CaptureEngine()
    engine.watch(model)
    caps = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap.num_samples}))
    with pytest.warns(UserWarning, match="not capturing 'pos'.*batch of 1 while 'tok'"):
        with engine.batch(samples="input"):
            h = model.tok(ids) + model.pos(torch.arange(6)[None])
            model.head(h.mean(1)).sum().backward()
    assert caps == {"tok": 4, "head": 4} and "pos" in engine.left_out
    # without samples= (or a mask) nothing is expanded nor left out: the caller did not say
    # how many samples the block holds (its capture is the batch's sum, as before)
    fresh = CaptureEngine()
    fresh.watch(model)
    fresh.add_consumer(lambda cap: caps.update({cap.name: cap.num_samples}))
    with fresh.batch():
        F.cross_entropy(model(ids), torch.zeros(4, dtype=torch.long)).backward()
    assert caps["pos"] == 1 and fresh.left_out == {}
    engine.unwatch()
    fresh.unwatch()


def test_wrong_data_id_length_is_reported_as_such(tmp_path):
    """The expansion is sized by data_id: a wrong length fails the broadcast, and the error
    says data_id is wrong rather than blaming the module."""
    torch.manual_seed(0)
    model = InPlace()
    run = nnstat.init(project="ids", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad"})
    nnstat.watch(model)
    with pytest.warns(UserWarning, match="'pos'"), pytest.raises(ValueError, match="has 5 ent"):
        with run(data_id=list(range(5))):
            model(torch.randint(0, 10, (4, 6))).sum().backward()
    close(run)


class PosNorm(nn.Module):
    """The shared output goes through another watched module (a LayerNorm, row by row) before
    it is broadcast: both get per-sample gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(6, 4)
        self.norm = nn.LayerNorm(4)
        self.tok = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.norm(self.pos(torch.arange(ids.shape[1])[None]))
        return self.head(torch.tanh(self.tok(ids) + p).mean(1))


@pytest.mark.parametrize("arch", [PosFirst, PosNorm])
def test_shared_module_chains_match_torch_func(arch):
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = arch()
    ids, y = torch.randint(0, 10, (4, 6)), torch.randint(0, 3, (4,))
    engine = CaptureEngine()
    names = engine.watch(model)
    caps = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap.per_sample_grads_by_param()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with engine.batch(loss_reduction="mean", samples="input"):
            F.cross_entropy(model(ids), y).backward()
    engine.unwatch()

    def one(params, xi, yi):
        return F.cross_entropy(functional_call(model, params, (xi[None],)), yi[None])

    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, ids, y)
    assert set(caps) == set(names)
    for name in names:
        for k, got in caps[name].items():
            assert torch.allclose(got, ref[f"{name}.{k}"], atol=1e-6), (name, k)


def test_per_sample_noise_scale_norms_include_a_shared_position_embedding():
    """The noise scale's per-sample squared norms of ``wpe`` (fed ``[1, T]`` position ids) are
    each sample's own, from per-example backward passes; before, wpe saw a batch of 1."""
    from nnstat.gradient_noise.persample import PerSampleNorms

    model = tiny_gpt2()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    ref = reference(ids)
    norms = PerSampleNorms(model)
    with norms.batch():
        (lm_loss(model(input_ids=ids).logits, ids) / B).backward()  # a batch mean, as trained
    small, big, n = norms.last
    norms.close()
    assert n == B and "transformer.wpe" in small
    for name in ("transformer.wpe", "transformer.h.0.attn.c_attn", "transformer.ln_f"):
        per = [sum(float(g.square().sum()) for g in ex.values()) for ex in ref[name]]
        assert small[name] == pytest.approx(sum(per) / B, rel=1e-4), name
        total = [sum(ex[k] for ex in ref[name]) / B for k in ref[name][0]]
        assert big[name] == pytest.approx(sum(float(t.square().sum()) for t in total), rel=1e-4)


def test_framework_probe_keeps_a_shared_position_embedding():
    from nnstat.integrations._probe import ModuleProbe

    model = tiny_gpt2()
    probe = ModuleProbe(model, unshared=True)
    with probe:
        ids = torch.randint(0, V, (B, T))
        lm_loss(model(input_ids=ids).logits, ids).backward()
    keep = probe.keep()
    assert "transformer.wpe" in keep and "transformer.wpe" not in probe.excluded
    assert "lm_head" in probe.excluded  # tied (captured under lm_head alone): left out


def test_noise_scale_names_the_modules_of_each_batch_size():
    from nnstat.gradient_noise.persample import PerSampleNorms

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)

        def forward(self, x, y):
            return self.a(x).sum() + self.b(y).sum()

    model = Two()
    norms = PerSampleNorms(model)
    with pytest.raises(RuntimeError, match=r"different batch sizes.*3: 'b'; 4: 'a'"):
        with norms.batch():
            model(torch.ones(4, 2), torch.ones(3, 2)).backward()
    norms.close()
