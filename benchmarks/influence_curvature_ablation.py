"""Which cheap curvature would lift unrefined influence: an ablation on influence_quality's tasks.

The unrefined scores of every K-FAC-family method are ``g_qᵀ (H̃ + λI)⁻¹ g_i`` for some
approximation ``H̃`` of the curvature, block-diagonal over layers. This script builds the
candidates independently of nnstat (float64, torch.func per-example and per-class gradients,
forward/backward hooks for the Kronecker factors) and measures their LDS on the same tasks,
models and retrained subsets as `influence_quality.py`:

* the **empirical Fisher** (EF: the real targets' gradients, what a gradient store logs) against
  the **Gauss-Newton matrix** (GGN = true Fisher of softmax cross-entropy: the expectation over
  the model's predicted classes, one backward per class);
* **K-FAC** (``S ⊗ A``; conv layers KFC-normalised: ``A`` per position, ``S`` summed over them),
  **EK-FAC** (K-FAC eigenbases, eigenvalues corrected to the curvature's own second moments in
  them) and the **exact layer block**;
* the damping ``λ = c × mean eigenvalue``, per layer (nnstat's and Kronfluence's rule) or one
  global mean (LogIX's style), for a few ``c``;
* K-FAC/EK-FAC **without the bias** (what LogIX scores: it skips bias gradients).

Scores use the real targets' gradients in every row; only ``H̃`` changes.

    .venv/bin/python benchmarks/influence_curvature_ablation.py --tasks mlp,logreg,cnn \\
        --train both --out /tmp/ablation.json   # ~3 min on 2 cores (the retraining: ~2 min)
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))
import influence_quality as iq  # noqa: E402  (the tasks, trainers and protocol seed)

from nnstat.influence.lds import run_lds_protocol  # noqa: E402

CE = nn.functional.cross_entropy
LAYERS = (nn.Linear, nn.Conv2d)


def class_grads(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``[N, K, out, in+1]``: the gradient of example i's loss at label ``labels[i, k]``
    as a matrix (weight columns, then the bias column)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return CE(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(vmap(grad(loss), in_dims=(None, None, 0)), in_dims=(None, 0, 0))(params, x, labels)
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, LAYERS):
            w = g[f"{name}.weight"]
            w = w.reshape(*w.shape[:3], -1)
            out.append(torch.cat([w, g[f"{name}.bias"][..., None]], -1).double())
    return out


def kron_factors(model, x, labels, weights) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K-FAC factors per layer: ``A = E_{i,t}[ã ãᵀ]`` (``ã`` with a homogeneous 1, per position
    for conv) and ``S = (1/N) Σ_i Σ_k w_ik Σ_t s sᵀ`` (output gradients of label ``labels[:, k]``).
    """
    mods = [m for m in model.modules() if isinstance(m, LAYERS)]
    acts, outs = {}, {}
    hooks = [m.register_forward_hook(lambda m, i, o: acts.__setitem__(m, i[0])) for m in mods]
    hooks += [
        m.register_full_backward_hook(lambda m, gi, go: outs.__setitem__(m, go[0])) for m in mods
    ]
    n = len(x)
    a_f: dict[nn.Module, torch.Tensor] = {}
    s_f = {m: torch.zeros((), dtype=torch.float64) for m in mods}
    try:
        for k in range(labels.shape[1]):
            model.zero_grad()
            CE(model(x), labels[:, k], reduction="sum").backward()
            for m in mods:
                a, s = acts[m].detach(), outs[m].detach()
                if isinstance(m, nn.Conv2d):
                    a = nn.functional.unfold(a, m.kernel_size).transpose(1, 2)
                    s = s.flatten(2).transpose(1, 2)
                else:
                    a, s = a[:, None], s[:, None]
                a = torch.cat([a, torch.ones_like(a[..., :1])], -1).double()
                s = s.double() * weights[:, k, None, None].sqrt()
                if m not in a_f:
                    a_f[m] = torch.einsum("ntd,nte->de", a, a) / (a.shape[0] * a.shape[1])
                s_f[m] = s_f[m] + torch.einsum("nto,ntp->op", s, s) / n
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad()
    return [s_f[m] for m in mods], [a_f[m] for m in mods]


def kron_blocks(s_f, a_f, correct: Callable | None, no_bias: bool = False):
    """``(kind, eigenvalues, Q_S, Q_A)`` per layer: K-FAC (products of the factors' eigenvalues)
    or EK-FAC (``correct(layer, Q_S, Q_A)``); ``no_bias`` drops the homogeneous coordinate."""
    out = []
    for layer, (s, a) in enumerate(zip(s_f, a_f, strict=True)):
        e_s, q_s = torch.linalg.eigh(s)
        if no_bias:
            e_a, q_a = torch.linalg.eigh(a[:-1, :-1])
            q_a = torch.cat([q_a, q_a.new_zeros(1, q_a.shape[1])])  # the bias column scores 0
        else:
            e_a, q_a = torch.linalg.eigh(a)
        lam = e_s.clamp_min(0)[:, None] * e_a.clamp_min(0) if correct is None else None
        out.append(("kron", lam if lam is not None else correct(layer, q_s, q_a), q_s, q_a))
    return out


def exact_blocks(per_example: list[torch.Tensor], weights: torch.Tensor):
    """The exact layer blocks ``(1/N) Σ_i Σ_k w_ik g_ik g_ikᵀ``, eigendecomposed."""
    out = []
    for g in per_example:
        g = g.reshape(g.shape[0], g.shape[1], -1)
        h = torch.einsum("nk,nkp,nkq->pq", weights, g, g) / len(g)
        e, u = torch.linalg.eigh(h)
        out.append(("block", e.clamp_min(0), u, None))
    return out


def apply_block(block, x: torch.Tensor, damping: float) -> torch.Tensor:
    kind, lam, q1, q2 = block
    if kind == "kron":
        return q1 @ ((q1.T @ x @ q2) / (lam + damping)) @ q2.T
    flat = x.reshape(len(x), -1)
    return (((flat @ q1) / (lam + damping)) @ q1.T).reshape(x.shape)


def nonzero_mean(lam: torch.Tensor) -> float:
    lam = lam.flatten()
    return float(lam[lam > 1e-10 * lam.max()].mean())


def run_setting(task_name: str, method: str, args, cache: Path | None) -> dict:
    task = iq.make_task(task_name, args)
    torch.manual_seed(0)
    train_fn = iq.trainer(task, method, args)
    base = train_fn(torch.arange(len(task.train[0])))
    hit = cache / f"{task_name}_{method}_m{args.m}.pt" if cache else None
    if hit is not None and hit.exists():  # tensors only (weights_only): no pickle on load
        d = torch.load(hit, weights_only=True)
        proto = types.SimpleNamespace(subset_masks=d["masks"], subset_losses=d["losses"])
    else:  # influence_quality's protocol: same subsets (seed 1), same retraining
        proto = run_lds_protocol(
            train_fn,
            len(task.train[0]),
            lambda m: CE(m(task.query[0]), task.query[1], reduction="none"),
            m=args.m,
            seed=1,
        )
        if hit is not None:
            torch.save({"masks": proto.subset_masks, "losses": proto.subset_losses}, hit)
    (x, y), (xq, yq) = task.train, task.query
    n = len(x)
    with torch.no_grad():
        logits = base(x)
    c = logits.shape[1]
    p = torch.softmax(logits, -1).double()
    every = torch.arange(c).expand(n, c)
    g_class = class_grads(base, x, every)  # [N, C, out, in+1] per layer
    g_query = [g[:, 0] for g in class_grads(base, xq, yq[:, None])]
    g_train = [g[torch.arange(n), y] for g in g_class]
    ones = torch.ones(n, 1, dtype=torch.float64)
    s_ef, a_f = kron_factors(base, x, y[:, None], ones)
    s_gn, _ = kron_factors(base, x, every, p)

    def correct_ef(layer, q_s, q_a):
        return (torch.einsum("op,npi,ij->noj", q_s.T, g_train[layer], q_a) ** 2).mean(0)

    def correct_gn(layer, q_s, q_a):
        proj = torch.einsum("op,nkpi,ij->nkoj", q_s.T, g_class[layer], q_a) ** 2
        return (proj * p[:, :, None, None]).sum(1).mean(0)

    candidates = {
        "K-FAC, EF": kron_blocks(s_ef, a_f, None),
        "K-FAC, GGN": kron_blocks(s_gn, a_f, None),
        "EK-FAC, EF": kron_blocks(s_ef, a_f, correct_ef),
        "EK-FAC, GGN": kron_blocks(s_gn, a_f, correct_gn),
        "exact layer block, EF": exact_blocks([g[:, None] for g in g_train], ones),
        "exact layer block, GGN": exact_blocks(g_class, p),
        "K-FAC, EF, no bias": kron_blocks(s_ef, a_f, None, no_bias=True),
        "EK-FAC, EF, no bias": kron_blocks(s_ef, a_f, correct_ef, no_bias=True),
    }
    rows = []

    def add(name: str, rule: str, c_: float | None, blocks: list | None, per_layer: Callable):
        scores = sum(  # blocks=None: the identity, plain dot products
            torch.einsum(
                "qoi,noi->qn",
                g_query[i] if blocks is None else apply_block(blocks[i], g_query[i], per_layer(i)),
                g,
            )
            for i, g in enumerate(g_train)
        )
        mean, sem, _ = iq.lds_summary(scores.float(), proto)
        rows.append({"curvature": name, "damping": rule, "c": c_, "lds": mean, "sem": sem})

    for name, blocks in candidates.items():
        global_mean = sum(float(b[1].sum()) for b in blocks) / sum(b[1].numel() for b in blocks)
        for c_ in args.c:
            add(
                name, "per layer", c_, blocks, lambda i, b=blocks, c_=c_: c_ * nonzero_mean(b[i][1])
            )
            add(name, "global", c_, blocks, lambda i, c_=c_, m=global_mean: c_ * m)
    add("identity (dot products)", "-", None, None, lambda i: 0.0)
    return {"task": task_name, "train": method, "rows": rows}


def print_table(result: dict, cs: list[float]) -> None:
    print(f"\n### {result['task']} / {result['train']}\n")
    head = " | ".join(f"c={c} {r}" for c in cs for r in ("per layer", "global"))
    print(f"| curvature | {head} |")
    print("| --- |" + " ---: |" * (2 * len(cs)))
    by = {}
    for r in result["rows"]:
        by.setdefault(r["curvature"], {})[(r["c"], r["damping"])] = r
    for name, cells in by.items():
        vals = [cells.get((c, d)) for c in cs for d in ("per layer", "global")]
        if all(v is None for v in vals):
            (only,) = cells.values()
            vals = [only] + [None] * (len(vals) - 1)
        txt = " | ".join("" if v is None else f"{v['lds']:.3f} ± {v['sem']:.3f}" for v in vals)
        print(f"| {name} | {txt} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="mlp,logreg,cnn")
    ap.add_argument("--train", choices=["lbfgs", "adam", "both"], default="both")
    ap.add_argument("--m", type=int, default=50)
    ap.add_argument("--c", default="0.1,0.3,1.0", help="damping multipliers of the mean eigenvalue")
    ap.add_argument("--cache", type=Path, default=None, help="folder for the retraining results")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    args = types.SimpleNamespace(
        n_train=300, n_query=40, hidden=24, steps=300, lr=0.01, lbfgs_iter=1000, wd=1e-3, m=a.m
    )
    args.c = [float(c) for c in a.c.split(",")]
    if a.cache is not None:
        a.cache.mkdir(parents=True, exist_ok=True)
    trains = ["lbfgs", "adam"] if a.train == "both" else [a.train]
    results = []
    for task in a.tasks.split(","):
        for method in trains:
            res = run_setting(task, method, args, a.cache)
            print_table(res, args.c)
            results.append(res)
    if a.out is not None:
        a.out.write_text(
            json.dumps(
                {"config": vars(a) | {"out": str(a.out)}, "results": results}, indent=1, default=str
            )
        )


if __name__ == "__main__":
    main()
