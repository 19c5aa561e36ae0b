"""The logged parameter space of refinement: the store's modules' parameters as one flat vector.

`LoggedSpace` maps flat parameter vectors to the store's rows (``vec(P_out X P_inᵀ)`` per module,
`project`) and back (`lift`, the adjoint), and checks that the model is the one the store was
logged from (`check_weights`, `check_against_rows`). `captured_rows` gives per-example gradients
in this space from the capture engine, `logged_preconditioner` the preconditioner of this space.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nnstat.capture.kinds import Kind, detect_kind, unsupported_reason
from nnstat.curvature.products import ParamLayout, captured_example_grads
from nnstat.store.integrity import params_hash

from .cache import default_preconditioner, fitted
from .precondition import (
    Preconditioner,
    fit_from_rows,
    kfac_factor,
    stored_ekfac_factor,
    warn_without_statistics,
    without_statistics,
)
from .row_layout import ModuleSpec
from .sources import RowSource


@dataclass
class _Slot:
    """One logged module: where its parameters sit in the flat vector and its store layout."""

    spec: ModuleSpec  # the store's layout entry (projected widths)
    module: nn.Module
    kind: Kind
    d_out: int | None
    d_in: int
    params: list[tuple[str, str, torch.Size, int, int]]  # (key, full name, shape, offset, numel)
    p_out: torch.Tensor | None = None
    p_in: torch.Tensor | None = None


def _find_module(model: nn.Module, name: str) -> nn.Module:
    modules = dict(model.named_modules())
    if name in modules and name:
        return modules[name]
    if name == "model":  # the engine's name for a watched root module
        return model
    raise ValueError(
        f"the store logged module {name!r}, which the refinement model does not have "
        f"(its modules: {[n for n in modules if n][:10]}...): pass the model the store was "
        "logged from"
    )


class LoggedSpace:
    """The logged modules' parameters as one flat vector ``[k, P]`` (`ParamLayout` ``layout``),
    and conversions to the store's row layout (`project`) and back (`lift`, its adjoint)."""

    def __init__(
        self,
        model: nn.Module,
        source: RowSource,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        meta_modules = {m["name"]: m for m in (source.meta or {}).get("modules", [])}
        projections = source.projections()
        names = {id(p): n for n, p in model.named_parameters()}
        self.slots: list[_Slot] = []
        offset = 0
        for spec in source.layout:
            module = _find_module(model, spec.name)
            kind = detect_kind(module)
            if kind is None:
                raise ValueError(f"module {spec.name!r}: {unsupported_reason(module)}")
            d_in, d_out = kind.logged_dims(module)
            info = meta_modules.get(spec.name)
            if info is not None and (info.get("d_in"), info.get("d_out")) != (d_in, d_out):
                raise ValueError(
                    f"module {spec.name!r}: the store logged a {info.get('d_out')}x"
                    f"{info.get('d_in')} gradient, the refinement model has {d_out}x{d_in}: "
                    "pass the model the store was logged from"
                )
            p_out = projections.get(f"{spec.name}/p_out")
            p_in = projections.get(f"{spec.name}/p_in")
            r_in = d_in if p_in is None else p_in.shape[0]
            r_out = (d_out or 1) if p_out is None else p_out.shape[0]
            if spec.width != r_in * r_out:
                raise ValueError(
                    f"module {spec.name!r} takes {spec.width} columns in the log, but its "
                    f"{d_out}x{d_in} gradient with the store's projections gives {r_out * r_in}: "
                    "a log without meta must hold unprojected rows"
                )
            params = []
            for key, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                params.append((key, names[id(p)], p.shape, offset, p.numel()))
                offset += p.numel()
            self.slots.append(
                _Slot(
                    spec,
                    module,
                    kind,
                    d_out,
                    d_in,
                    params,
                    None if p_out is None else p_out.to(device=device, dtype=dtype),
                    None if p_in is None else p_in.to(device=device, dtype=dtype),
                )
            )
        self.size = offset
        self.names = [full for s in self.slots for _, full, _, _, _ in s.params]
        self.layout = ParamLayout(
            self.names, [shape for s in self.slots for *_, shape, _, _ in s.params]
        )
        self._first, count = {}, 0  # each slot's first entry among the layout's parameters
        for slot in self.slots:
            self._first[id(slot)], count = count, count + len(slot.params)

    # flat [k, P] <-> per-module matrix form [k, d_out, d_in(+1)] (layernorm [k, D(+D)])
    def matrix(self, flat: torch.Tensor | Sequence[torch.Tensor], s: _Slot) -> torch.Tensor:
        """Module ``s``'s matrix form of ``flat`` ``[k, P]``, or of its parts (one
        ``[k, *shape]`` tensor per parameter, in `layout` order)."""
        if isinstance(flat, torch.Tensor):
            k, like = flat.shape[0], flat
            params = {
                key: flat[:, off : off + n].reshape(k, *shape) for key, _, shape, off, n in s.params
            }
        else:
            first = self._first[id(s)]
            params = {p[0]: flat[first + i] for i, p in enumerate(s.params)}
            k, like = len(flat[0]), flat[0]
        for key, p in s.module.named_parameters(recurse=False):
            # a frozen parameter is not in the space (no curvature is taken in its directions)
            if key not in params:
                params[key] = like.new_zeros(k, *p.shape)
        return s.kind.matrix_from_params(s.module, params)

    def write(self, out: torch.Tensor, s: _Slot, mat: torch.Tensor) -> None:
        offsets = {key: (off, n) for key, _, _, off, n in s.params}
        for key, value in s.kind.grads_by_param(s.module, mat).items():
            if key in offsets:  # a frozen parameter's part is dropped (see `matrix`)
                off, n = offsets[key]
                out[:, off : off + n] = value.reshape(len(value), n)

    def project(self, flat: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """``vec(P_out X P_inᵀ)`` of every module: flat parameters (or their parts, see
        `matrix`) to the store's row layout."""
        parts = []
        for s in self.slots:
            x = self.matrix(flat, s)
            if not s.kind.outer:  # a flat gradient
                parts.append(x if s.p_in is None else x @ s.p_in.T)
                continue
            if s.p_out is not None:
                x = s.p_out @ x
            if s.p_in is not None:
                x = x @ s.p_in.T
            parts.append(x.reshape(len(x), -1))
        return torch.cat(parts, dim=1)

    def lift(self, y: torch.Tensor) -> torch.Tensor:
        """The adjoint of `project`: logged rows ``[k, width]`` to flat parameters,
        ``P_outᵀ Y P_in`` per module (the identity where a side is not projected)."""
        out = y.new_zeros(len(y), self.size)
        for s in self.slots:
            block = y[:, s.spec.offset : s.spec.stop]
            if not s.kind.outer:
                mat = block if s.p_in is None else block @ s.p_in
            else:
                r_out = s.d_out if s.p_out is None else s.p_out.shape[0]
                mat = block.reshape(len(y), r_out, -1)
                if s.p_out is not None:
                    mat = s.p_out.T @ mat
                if s.p_in is not None:
                    mat = mat @ s.p_in
            self.write(out, s, mat)
        return out


def captured_rows(
    flat: LoggedSpace,
    model: nn.Module,
    batch_loss: Callable[[Any], torch.Tensor],
    data: Any,
    loss_reduction: str,
    dtype: torch.dtype,
) -> Iterator[torch.Tensor]:
    """Per batch of ``data``, ``[b, P]`` per-example gradients of the logged modules from the
    capture engine (the same per-sample gradients the store holds), for ``batch_loss(batch)``
    data."""
    by_name = dict(model.named_parameters())
    slots = {s.spec.name: s for s in flat.slots}
    batches = captured_example_grads(
        model, list(slots), batch_loss, data, loss_reduction, [by_name[n] for n in flat.names]
    )
    for n, caps in batches:
        out = torch.zeros(n, flat.size, dtype=dtype, device=caps[0][1].device if caps else None)
        for name, mat in caps:
            flat.write(out, slots[name], mat.to(dtype))
        yield out


def check_weights(flat: LoggedSpace, meta: Mapping[str, Any], path: str) -> None:
    """The refinement model must carry the weights the store was logged with."""
    recorded = meta.get("params_sha256")
    if not recorded:
        return
    with torch.no_grad():
        mine = params_hash(
            (f"{s.spec.name}.{k}", p)
            for s in flat.slots
            for k, p in s.module.named_parameters(recurse=False)
        )
    if mine != recorded:
        raise ValueError(
            f"the refinement model's weights are not those the store {path} was logged with "
            f"(params_sha256 {mine[:12]}... vs {recorded[:12]}...): pass the model as it was "
            "when the store was written, or log a new store"
        )


def check_against_rows(
    flat: LoggedSpace,
    grads: Iterable[torch.Tensor],
    rows: torch.Tensor,
    ids: list,
    meta: Mapping,
) -> None:
    """Refuse query data whose gradients (``[b, P]`` batches, projected one at a time) are not
    the log's rows (other weights, loss or order)."""
    errs, n = [], 0
    for g in grads:
        proj = flat.project(g).to(torch.float32).cpu()
        want = rows[n : n + len(proj)].to(torch.float32)
        if len(want) == len(proj):
            errs.append((proj - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30))
        n += len(proj)
    if n != len(rows):
        raise ValueError(
            f"the refinement's query data has {n} examples but the log has "
            f"{len(rows)} rows: pass the data the log was captured from, in the same order"
        )
    err = torch.cat(errs)
    tol = 1e-2 if str(meta.get("dtype", "float32")) in ("float16", "bfloat16") else 1e-3
    bad = (err > tol).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"the gradients of the refinement's query data do not match the logged rows for "
            f"{len(bad)} of {len(rows)} examples (first: id {ids[i]!r}, relative difference "
            f"{float(err[i]):.3g}): the model's weights, the loss function or the order of the "
            "data differ from when the log was captured"
        )


def logged_preconditioner(
    source: RowSource,
    kind: str | None,
    stats: Mapping[str, torch.Tensor] | None,
    batch_size: int,
) -> Preconditioner:
    """The preconditioner of the logged space: the unrefined path's own (``fitted``), or, with
    refit statistics (``fisher=``), K-FAC/EK-FAC factors from them through the store's
    projections (EK-FAC eigenvalues apply where a module is logged unprojected)."""
    kind = kind or default_preconditioner(source)
    if stats is None or kind in ("identity", "raw"):
        return fitted(source, kind, batch_size)
    projections = source.projections()
    missing = without_statistics(source.layout, stats)
    warn_without_statistics(missing)
    factors: dict[str, Any] = {}
    for m in source.layout:
        if m.kronecker and m.name not in missing:
            f = stored_ekfac_factor(m, stats, projections) if kind == "ekfac" else None
            factors[m.name] = f if f is not None else kfac_factor(m, stats, projections)
    dense = [m for m in source.layout if m.name not in factors]
    if dense:
        factors.update(fit_from_rows(source, dense, {}, batch_size))
    return Preconditioner(kind, list(source.layout), factors)
