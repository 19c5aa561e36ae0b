"""The CPU/meta checks of ``benchmarks/attribution_scale.py`` (the ~1B Llama GPU part): its
memory plan against a closed-form parameter count and bytes measured on the CPU, and a 2-layer
Llama logged with EK-FAC, scored and refined on the CPU against independent references
(per-sequence autograd gradients projected with the store's projections; the exact damped
Gauss-Newton solve in the logged space, built from ``torch.func`` products)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nnstat  # noqa: E402
from nnstat.influence import Refinement, compute_influence_all  # noqa: E402
from nnstat.influence.refine.memory import Allocations  # noqa: E402
from nnstat.store import GradientStore  # noqa: E402

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
)
RANK = 2


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "attribution_scale.py"
    spec = importlib.util.spec_from_file_location("attribution_scale_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_parameter_count_closed_form_matches_the_built_models(bench):
    for overrides in (TINY, {**TINY, "tie_word_embeddings": True}, {}):
        cfg = bench.llama_config(**overrides)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        assert bench.parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    big = bench.llama_config()
    assert 0.9e9 < bench.parameter_count(big) < 1.2e9  # "~1B"


def test_memory_plan_of_the_1b_model_on_meta(bench):
    cfg = bench.llama_config()
    plan = bench.memory_plan(cfg, batch=2, seq=256)
    assert plan.parameters == 2 * bench.parameter_count(cfg)  # bfloat16
    # 16 layers x 7 Linear + lm_head + the embedding, rank 64 on both sides; 33 RMSNorms, 64
    norms = 2 * 16 + 1
    assert plan.watched == 16 * 7 + 2 + norms
    assert plan.row_width == (16 * 7 + 2) * 64 * 64 + norms * 64
    assert plan.rows_in_flight == 16 * 2 * plan.row_width * 4
    # the capture's largest module: lm_head (2048 in, 32000 out) over 2 x 256 positions
    assert plan.capture == 2 * 256 * (2048 + 32000 + 128) * 4
    # EK-FAC: per layer q/k/v/o 2 x 2048² per side, gate/up 2048² + 5632², down the same
    h, i = 2048, 5632
    layer = 4 * 2 * (2 * h * h) + 3 * 2 * (h * h + i * i)
    emb = 32000 + 2 * h * h  # the embedding's diagonal input side, its dense output side
    head = 2 * h * h + 2 * 64 * 64  # lm_head's 32000 side is over max_factor_dim: projected
    eigenvalues = plan.row_width - norms * 64  # the Kronecker modules' corrected eigenvalues
    assert plan.ekfac == 4 * (16 * layer + emb + head + eigenvalues + norms * h * h)
    # activations grow linearly in the tokens of a batch at a fixed length
    double = bench.memory_plan(cfg, batch=4, seq=256)
    assert double.activations == pytest.approx(2 * plan.activations, rel=1e-3)


def test_memory_plan_activations_match_bytes_measured_on_the_cpu(bench):
    cfg = bench.llama_config(**TINY)
    plan = bench.memory_plan(cfg, batch=3, seq=16, rank=RANK, dtype=torch.float32, device="cpu")
    model = bench.build_model(cfg, "cpu", torch.float32)
    x = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    assert plan.parameters == sum(p.numel() * 4 for p in model.parameters())
    weights = {p.data_ptr() for p in model.parameters()}
    with Allocations() as counter:
        loss = bench.lm_loss(model, x)
        # every storage the forward made and still holds, less the weights' (a view of a
        # weight is an op's output the counter cannot tell from a new storage)
        live = sum(n for key, n in counter.live.items() if key not in weights)
    assert live == plan.activations + loss.numel() * loss.element_size()
    assert plan.activations > 10 * 3 * 16 * 64 * 4  # not a trivial count
    # on meta, scaled-dot-product attention takes its math path, which saves the attention
    # probabilities a fused kernel does not: the plan there is an upper bound
    meta = bench.memory_plan(cfg, batch=3, seq=16, rank=RANK, dtype=torch.float32)
    assert meta.parameters == plan.parameters and meta.activations >= plan.activations


def _per_sequence_losses(model, x):
    logits = model(input_ids=x).logits[:, :-1]
    tok = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
    )
    return tok.reshape(x.shape[0], -1).mean(1)


def _reference_rows(model, x, store: GradientStore) -> torch.Tensor:
    """Per-sequence gradients of each logged module (autograd, one sequence at a time),
    projected ``P_out G P_inᵀ`` with the store's projections, in the store's layout."""
    proj = store.projections()
    mods = dict(model.named_modules())
    rows = []
    for i in range(len(x)):
        loss = _per_sequence_losses(model, x[i : i + 1]).sum()
        parts = []
        for entry in store.meta["modules"]:
            m = mods[entry["name"]]
            (g,) = torch.autograd.grad(loss, m.weight, retain_graph=True)
            p_in = proj[f"{entry['name']}/p_in"]
            if entry["r_out"] is None:  # RMSNorm: a flat gradient, projected on one side
                parts.append(p_in @ g.reshape(-1))
                continue
            g = g.T if isinstance(m, torch.nn.Embedding) else g  # matrix form [d_out, d_in]
            parts.append((proj[f"{entry['name']}/p_out"] @ g @ p_in.T).reshape(-1))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _log(model, data, root, project, statistic):
    run = nnstat.init(project=project, root_dir=str(root))
    nnstat.setup({"log": "grad", "save": "grad", "statistic": statistic, "rank": RANK})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = nnstat.watch(model)
    nnstat.add_projection(rank=RANK)
    for _ in run.schedule():
        for lo in range(0, len(data), 4):
            with run(data_id=list(range(lo, min(lo + 4, len(data))))):
                _per_sequence_losses(model, data[lo : lo + 4]).sum().backward()
            model.zero_grad()
    nnstat.unwatch()  # run.schedule() finalized each pass
    return names, [str(w.message) for w in caught]


def _ggn_logged(model, data, store: GradientStore) -> torch.Tensor:
    """``P G Pᵀ``: the Gauss-Newton matrix of the mean per-sequence loss, in the logged space
    (a logged direction lifted to the weights as ``P_outᵀ V P_in``), column by column."""
    import copy

    from torch.func import functional_call, jvp, vjp

    # the same weights through eager attention: the fused CPU kernel has no forward-mode AD
    model = copy.deepcopy(model)
    model.config._attn_implementation = "eager"
    proj = store.projections()
    mods = dict(model.named_modules())
    params = {k: v.detach() for k, v in model.named_parameters()}
    layout = store.meta["modules"]
    width = sum(e["width"] for e in layout)

    def logits_of(p):
        return functional_call(model, p, (data,)).logits[:, :-1]

    def lift(v):
        out = {k: torch.zeros_like(t) for k, t in params.items()}
        for e in layout:
            n = e["name"]
            block = v[e["offset"] : e["offset"] + e["width"]]
            if e["r_out"] is None:  # RMSNorm: flat
                out[f"{n}.weight"] = (block @ proj[f"{n}/p_in"]).reshape(
                    params[f"{n}.weight"].shape
                )
                continue
            block = block.reshape(e["r_out"], e["r_in"])
            w = proj[f"{n}/p_out"].T @ block @ proj[f"{n}/p_in"]
            out[f"{n}.weight"] = w.T if isinstance(mods[n], torch.nn.Embedding) else w
        return out

    def project(grads):
        parts = []
        for e in layout:
            n = e["name"]
            g = grads[f"{n}.weight"]
            if e["r_out"] is None:  # RMSNorm: flat
                parts.append(proj[f"{n}/p_in"] @ g.reshape(-1))
                continue
            g = g.T if isinstance(mods[n], torch.nn.Embedding) else g
            parts.append((proj[f"{n}/p_out"] @ g @ proj[f"{n}/p_in"].T).reshape(-1))
        return torch.cat(parts)

    logits, pull = vjp(logits_of, params)
    p = logits.softmax(-1)
    tokens = logits.shape[1]
    cols = []
    for j in range(width):
        e = torch.zeros(width)
        e[j] = 1.0
        _, jv = jvp(logits_of, (params,), (lift(e),))
        # the mean-token cross-entropy's Hessian in the logits, per token: diag(p) − p pᵀ
        hjv = (p * jv - p * (p * jv).sum(-1, keepdim=True)) / tokens
        (g,) = pull(hjv)
        cols.append(project(g) / len(data))
    return torch.stack(cols, 1)


def test_tiny_llama_logged_scored_and_refined_on_the_cpu(bench, tmp_path):
    torch.manual_seed(0)
    cfg = bench.llama_config(**TINY)
    model = bench.build_model(cfg, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, cfg.vocab_size, (8, 12), generator=gen)
    query = torch.randint(0, cfg.vocab_size, (3, 12), generator=gen)
    names, warned = _log(model, train, tmp_path, "train", "ekfac")
    _log(model, query, tmp_path, "queries", "none")
    store = GradientStore(tmp_path / "train")
    # what nnstat captures of a Llama: every Linear, the embedding and every RMSNorm (rotary
    # embeddings have no parameters): every parameter, nothing skipped
    assert len(names) == 2 * 7 + 2 + 2 * 2 + 1 and {"lm_head", "model.norm"} <= set(names)
    assert not [w for w in warned if "cannot capture" in w]
    assert store.meta["row_width"] == (2 * 7 + 2) * RANK * RANK + 5 * RANK
    rows = torch.cat([torch.as_tensor(r) for _, r in store.iter_blocks(64)])
    ref = _reference_rows(model, train, store)
    assert torch.allclose(rows, ref, rtol=1e-4, atol=1e-6 * ref.abs().max())
    qref = _reference_rows(model, query, GradientStore(tmp_path / "queries"))
    dot = compute_influence_all(
        str(tmp_path / "queries"),
        str(tmp_path / "train"),
        preconditioner="identity",
        progress=False,
    )
    assert torch.allclose(dot.scores.double(), qref.double() @ ref.double().T, rtol=1e-3)
    ekfac = compute_influence_all(
        str(tmp_path / "queries"), str(tmp_path / "train"), progress=False
    )
    assert ekfac.meta["preconditioner"] == "ekfac" and torch.isfinite(ekfac.scores).all()
    # refinement against the exact damped solve in the logged space
    ggn = _ggn_logged(model, train, store).double()
    ggn = (ggn + ggn.T) / 2
    damping = float(torch.linalg.eigvalsh(ggn).mean())  # well conditioned: CG converges fast
    refine = Refinement(
        model,
        None,
        [train[lo : lo + 4] for lo in range(0, len(train), 4)],
        batch_loss=lambda x: _per_sequence_losses(model, x).sum(),
        steps=8,
        curvature="ggn",
        loss_reduction="sum",
        damping=damping,
        progress=False,
    )
    refined = compute_influence_all(
        str(tmp_path / "queries"), str(tmp_path / "train"), refine=refine, damping=damping
    )
    solved = torch.linalg.solve(ggn + damping * torch.eye(len(ggn)), qref.double().T).T
    exact = solved @ ref.double().T
    err = (refined.scores.double() - exact).abs().max() / exact.abs().max()
    assert err < 1e-3, err
    unrefined = (ekfac.scores.double() - exact).abs().max() / exact.abs().max()
    assert unrefined > 10 * err  # the check can tell refined from EK-FAC scores


def test_the_scoring_target_times_the_device_branch_against_a_copy_of_the_same_bytes(
    bench, tmp_path, monkeypatch
):
    """The GPU part's scoring target on a small store, with the device branch switched on (the
    branch a GPU takes): the bytes that cross to the device are the stored (factored) ones, the
    copy bound is timed on exactly those bytes, and the scores are the dense float64 ones."""
    import numpy as np

    from nnstat.influence import score

    crossed: list[int] = []
    stream_to = score.stream_to

    def counting(*args, **kwargs):
        for block in stream_to(*args, **kwargs):
            crossed.append(block[2].numel() * block[2].element_size())
            yield block

    monkeypatch.setattr(score, "_device_branch", lambda device: True)
    monkeypatch.setattr(score, "stream_to", counting)
    copies: list[int] = []
    copy_seconds = bench.copy_seconds
    monkeypatch.setattr(
        bench, "copy_seconds", lambda n, d, repeat=3: copies.append(n) or copy_seconds(n, d, repeat)
    )
    root = tmp_path / "train"
    meta = bench.write_factored_store(root, rows=300, modules=3, rank=8, factors=2)
    r = bench.score_against_copy_bound(root, queries=4, device="cpu")
    stored = np.concatenate([np.load(p) for p in GradientStore(root).shards])
    assert stored.shape == (300, 3 * 2 * (8 + 8)) and r["rows"] == 300
    # the stored bytes crossed, once per call (an untimed call, then the timed one)
    assert r["bytes"] == stored.nbytes and sum(crossed) == 2 * stored.nbytes
    assert copies == [stored.nbytes]  # the bound: a copy of the same bytes
    assert r["ratio"] == r["copy_seconds"] / r["seconds"] and r["seconds"] > 0
    # the scores: every module multiplied out by numpy, in float64
    per_module = stored.reshape(300, 3, 32).astype(np.float64)  # [U (2 x 8), V (2 x 8)] each
    u, v = per_module[..., :16].reshape(300, 3, 2, 8), per_module[..., 16:].reshape(300, 3, 2, 8)
    dense = np.einsum("nkjo,nkji->nkoi", u, v).reshape(300, -1)
    want = r["query_rows"].double().numpy() @ dense.T
    np.testing.assert_allclose(r["result"].scores.double().numpy(), want, rtol=1e-4, atol=1e-4)
    assert [m["factors"] for m in meta["modules"]] == [2, 2, 2]
    table = bench.score_table(r)
    assert "| 300 factored rows (3 modules, rank 8, c = 2) | 4 |" in table
