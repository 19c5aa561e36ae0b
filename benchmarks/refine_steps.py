"""How close refinement's scores are to exact influence after k steps, by damping.

A 64-32-10 tanh MLP trained (Adam, 300 full-batch steps) on 300 digits; 20 held-out queries;
the store's rows are the unprojected per-sample gradients (``torch.func``), the preconditioner
``raw``, the curvature the Hessian. For each damping, the mean over queries of the Spearman
correlation between the refined scores after ``k`` steps and `nnstat.influence.exact` at the
same damping. The table in docs/influence.md ("When refinement can make the lists worse").

    python benchmarks/refine_steps.py
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.influence import ModuleSpec, Refinement, TensorSource, compute_influence_all, exact

STEPS = (0, 1, 2, 3, 5, 10)
DAMPINGS = (1e-3, 1e-2, 1e-1)
LOSS = nn.functional.cross_entropy


def main() -> None:
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    tx, ty, qx, qy = x[:300], y[:300], x[1700:1720], y[1700:1720]
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        LOSS(model(tx), ty).backward()
        opt.step()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def rows(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        one = grad(lambda p, a, b: LOSS(functional_call(model, p, (a[None],)), b[None]))
        g = vmap(one, (None, 0, 0))(params, xs, ys)
        parts = [torch.cat([g[f"{m}.weight"], g[f"{m}.bias"][..., None]], -1) for m in "02"]
        return torch.cat([p.flatten(1) for p in parts], 1)

    lay = [ModuleSpec("0", 0, 32, 65), ModuleSpec("2", 32 * 65, 10, 33)]
    train, query = TensorSource(rows(tx, ty), layout=lay), TensorSource(rows(qx, qy), layout=lay)
    print("| damping | " + " | ".join(f"k={k}" for k in STEPS) + " |")
    for lam in DAMPINGS:
        ref = exact(model, LOSS, (tx, ty), (qx, qy), lam, dtype=torch.float64).scores.numpy()
        cells = []
        for k in STEPS:
            refine = Refinement(
                model,
                LOSS,
                (tx, ty),
                steps=k,
                damping=lam,
                curvature="hessian",
                preconditioner="raw",
                progress=False,
                dtype=torch.float64,
            )
            s = compute_influence_all(query, train, refine=refine, damping=lam).scores.numpy()
            rho = np.mean([spearmanr(s[i], ref[i]).statistic for i in range(len(s))])
            cells.append(f"{rho:.3f}")
        print(f"| {lam:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
