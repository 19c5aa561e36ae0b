"""What logging (or the noise scale) adds to GPT-2 small's forward+backward, counted on ``meta``.

The model is built on ``meta`` (no memory, no arithmetic: seconds on any machine), so this
measures the work an accelerator would be given, not time: aten ops (kernel launches), bytes
that ops read and write (operands plus results: an upper bound on memory traffic, since a cache
may serve some operands; an ``out=`` tensor counts as written, not read) and GEMM FLOPs, of a
plain forward+backward and of the same pass with nnstat: ``--workload logging`` inside
``run(data_id=...)`` with rank-64 projections of every supported module (the logging workload
of `benchmarks/gpu_check.py`);
``--workload noise`` inside ``NoiseScale.batch()`` (per-sample gradient norms of every
module). The tables list what nnstat adds: in all (ops, bytes moved, bytes allocated: the
outputs of ops that are neither views nor in-place/``out=``), per nnstat module that issued the
ops (the innermost ``nnstat/`` frame of the call) and per op shape; and how many tensors at
least the size of the logits each pass allocates. Needs ``transformers``.
``tests/run/test_logging_traffic_budget.py`` holds the logging numbers to a budget with
:func:`measure`.

Run:  .venv/bin/python benchmarks/logging_traffic.py [--workload logging|noise]
      [--layers 12 --batch 8 --seq 512]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nnstat

_GEMMS = ("mm", "bmm", "addmm", "baddbmm")


_NNSTAT = str(Path(__file__).resolve().parents[1] / "nnstat") + "/"


def _caller() -> str:
    """The innermost ``nnstat/`` source file on the stack (``"-"``: the model's own ops)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_NNSTAT):
            return name[len(_NNSTAT) :]
        frame = frame.f_back
    return "-"


class Traffic(TorchDispatchMode):
    """Per op name: launches, bytes of operands and results, GEMM FLOPs, bytes allocated (new
    outputs); per (op, operand shapes) and per issuing nnstat file: bytes; the sizes of the
    new outputs of at least ``big`` bytes. A meta tensor copied to the host (a flag read, the
    staged rows' copy) reads as ones; ``reads``: such copies."""

    def __init__(self, big: int = 2**20) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.flops: collections.Counter[str] = collections.Counter()
        self.shapes: collections.Counter[tuple] = collections.Counter()
        self.allocated: collections.Counter[str] = collections.Counter()
        self.by_file: collections.Counter[str] = collections.Counter()
        self.allocated_by_file: collections.Counter[str] = collections.Counter()
        self.big, self.sizes = big, []
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "copy_" and src.device.type == "cpu" and args[1].device.type == "meta":
            return src.fill_(1)  # the staged rows' copy to the host: ones (flags: True)
        if src is not None and src.device.type == "meta":
            if name == "_local_scalar_dense":
                self.reads += 1
                return True if src.dtype == torch.bool else 1
            target = kwargs.get("device")
            if name == "_to_copy" and target is not None and torch.device(target).type == "cpu":
                self.reads += 1
                return torch.ones(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        # an ``out=`` tensor is written, not read: counted once, as a result
        read = {k: v for k, v in kwargs.items() if k != "out"}
        operands = [t for t in tree_flatten((args, read))[0] if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in operands)
        moved += sum(
            t.numel() * t.element_size()
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        )
        self.ops[name] += 1
        self.bytes[name] += moved
        self.shapes[(name, tuple(tuple(t.shape) for t in operands))] += moved
        where = _caller()
        self.by_file[where] += moved
        # a result the schema does not alias to an input (in place, out=) is a new tensor
        outs = tree_flatten(out)[0]
        for ret, t in zip(func._schema.returns, outs, strict=False):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                size = t.numel() * t.element_size()
                self.allocated[name] += size
                self.allocated_by_file[where] += size
                if size >= self.big:
                    self.sizes.append(size)
        if name.rstrip("_") in _GEMMS:  # in-place forms too (baddbmm_, addmm_)
            a, b = operands[-2], operands[-1]
            self.flops[name] += 2 * a.numel() * b.shape[-1]
        return out


def measure(
    layers: int = 12, batch: int = 8, seq: int = 512, rank: int = 64, workload: str = "logging"
) -> tuple[Traffic, Traffic, int]:
    """``(plain, with nnstat, bytes of the logits)`` for GPT-2 (``layers``) on ``meta``: a plain
    forward+backward, and the third one under ``workload`` (the first fingerprints the
    weights and moves the projections to the device)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(n_layer=layers)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    logits = batch * seq * config.vocab_size * 4

    def one_pass(block) -> Traffic:
        with Traffic(big=logits) as t, block if block is not None else contextlib.nullcontext():
            model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)
        return t

    plain = one_pass(None)
    if workload == "noise":
        gns = nnstat.NoiseScale(beta=0.99)
        gns.watch(model)
        for _ in range(3):
            logged = one_pass(gns.batch())
        gns.unwatch()
        return plain, logged, logits
    with tempfile.TemporaryDirectory() as tmp:
        run = nnstat.init(project="traffic", root_dir=tmp)
        try:
            nnstat.setup({"log": "grad", "save": "grad", "loss_reduction": "mean"})
            nnstat.watch(model)
            nnstat.add_projection(rank=rank)
            for b in range(3):
                logged = one_pass(run(data_id=list(range(batch * b, batch * b + batch))))
            nnstat.finalize()
        finally:
            nnstat.unwatch()
    return plain, logged, logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--workload", choices=("logging", "noise"), default="logging")
    args = p.parse_args()
    plain, logged, logits = measure(args.layers, args.batch, args.seq, args.rank, args.workload)
    if args.workload == "noise":
        what = "NoiseScale, every module"
    else:
        what = f"logging, rank {args.rank}, every supported module"

    def total(c: collections.Counter) -> float:
        return float(sum(c.values()))

    print(
        f"\nGPT-2 ({args.layers} layers), batch {args.batch} x {args.seq}, {what}, "
        f"torch {torch.__version__}\n"
    )
    print(
        "| pass | aten ops | GB read + written | GB allocated | tensors >= logits | host "
        "reads | GEMM GFLOP |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, t in (("plain forward+backward", plain), (args.workload, logged)):
        print(
            f"| {label} | {total(t.ops):.0f} | {total(t.bytes) / 1e9:.2f} "
            f"| {total(t.allocated) / 1e9:.2f} | {len(t.sizes)} | {t.reads} "
            f"| {total(t.flops) / 1e9:.0f} |"
        )
    print(
        f"\n{args.workload} adds {(total(logged.bytes) - total(plain.bytes)) / 1e9:.2f} GB "
        f"read + written, {(total(logged.allocated) - total(plain.allocated)) / 1e9:.2f} GB "
        f"allocated (logits: {logits / 1e9:.2f} GB)"
    )
    print(f"\n| nnstat file issuing the ops {args.workload} adds | GB moved | GB allocated |")
    print("| --- | ---: | ---: |")
    for where, moved in logged.by_file.most_common():
        if where != "-":
            print(f"| {where} | {moved / 1e9:.3f} | {logged.allocated_by_file[where] / 1e9:.3f} |")
    extra = collections.Counter(logged.shapes)
    extra.subtract(plain.shapes)
    print(f"\n| op (operand shapes) {args.workload} adds | GB |")
    print("| --- | ---: |")
    for (name, shapes), moved in sorted(extra.items(), key=lambda kv: -kv[1])[:12]:
        shown = str(shapes) if len(shapes) <= 4 else f"{shapes[:3]} ... ({len(shapes)} operands)"
        print(f"| {name} {shown} | {moved / 1e9:.3f} |")


if __name__ == "__main__":
    main()
