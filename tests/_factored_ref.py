"""A float64 numpy reference for stores of factored rows: module layouts from a short spec, and
dense rows multiplied out module by module (``Σ_j u_j v_jᵀ`` by ``einsum``), independent of
`nnstat.store.factored`."""

from __future__ import annotations

import numpy as np
import torch


def factored_modules(spec: list[tuple]) -> list[dict]:
    """meta.json module entries from ``spec``: ``("f", c, r_out, r_in)`` a factored linear
    module, ``("p", width)`` a plain (dense) one, laid out in order."""
    mods, off = [], 0
    for i, s in enumerate(spec):
        if s[0] == "f":
            c, r_out, r_in = s[1:]
            w = c * (r_out + r_in)
            mods.append({"name": f"m{i}", "kind": "linear", "offset": off, "width": w,
                         "r_out": r_out, "r_in": r_in, "factors": c})  # fmt: skip
        else:
            w = s[1]
            mods.append({"name": f"m{i}", "kind": "layernorm", "offset": off, "width": w,
                         "r_out": None, "r_in": w})  # fmt: skip
        off += w
    return mods


def dense_numpy(rows: np.ndarray | torch.Tensor, mods: list[dict]) -> np.ndarray:
    """float64 dense rows: each factored module multiplied out, plain columns as stored."""
    r = rows.double().numpy() if isinstance(rows, torch.Tensor) else rows.astype(np.float64)
    parts = []
    for m in mods:
        x = r[:, m["offset"] : m["offset"] + m["width"]]
        if m.get("factors"):
            c, r_out, r_in = m["factors"], m["r_out"], m["r_in"]
            u, v = x[:, : c * r_out].reshape(-1, c, r_out), x[:, c * r_out :].reshape(-1, c, r_in)
            x = np.einsum("njo,nji->noi", u, v).reshape(len(x), -1)
        parts.append(x)
    return np.concatenate(parts, 1)


def dense_modules(mods: list[dict]) -> list[dict]:
    """The dense layout of ``mods`` (meta.json modules): each factored module's ``r_out · r_in``
    columns, laid out in order, the others as they are."""
    out, off = [], 0
    for m in mods:
        w = m["r_out"] * m["r_in"] if m.get("factors") else m["width"]
        out.append({**{k: v for k, v in m.items() if k != "factors"}, "offset": off, "width": w})
        off += w
    return out


def kfac_metric(
    meta: dict, t: np.ndarray, kind: str, damping: float, stats: dict[str, torch.Tensor]
) -> np.ndarray:
    """float64 ``M`` on the dense rows ``t``: identity, or K-FAC ``(S ⊗ A + λI)⁻¹`` per Kronecker
    module (``stats``' backward and forward covariances) and ``(TᵀT/n + λI)⁻¹`` for a plain
    module such as LayerNorm (what nnstat's ``kfac`` fits)."""
    m = np.eye(t.shape[1])
    if kind == "identity":
        return m
    for mod in dense_modules(meta["modules"]):
        s = slice(mod["offset"], mod["offset"] + mod["width"])
        eye = np.eye(mod["width"])
        if mod["r_out"] is None:
            m[s, s] = np.linalg.inv(t[:, s].T @ t[:, s] / len(t) + damping * eye)
        else:
            sb = stats[f"{mod['name']}/backward/covariance"].double().numpy()
            af = stats[f"{mod['name']}/forward/covariance"].double().numpy()
            m[s, s] = np.linalg.inv(np.kron(sb, af) + damping * eye)  # row-major vec(G)
    return m
