"""What logging (or the noise scale) adds to GPT-2 small's forward+backward, counted on ``meta``.

The model is built on ``meta`` (no memory, no arithmetic: seconds on any machine), so this
measures the work an accelerator would be given, not time: aten ops (kernel launches), bytes
that ops read and write (operands plus results: an upper bound on memory traffic, since a cache
may serve some operands) and GEMM FLOPs, of a plain forward+backward and of the same pass with
nnstat: ``--workload logging`` inside ``run(data_id=...)`` with rank-64 projections of every
supported module (the logging workload of `benchmarks/gpu_check.py`);
``--workload noise`` inside ``NoiseScale.batch()`` (per-sample gradient norms of every
module). The tables list what nnstat adds, in all and per op shape. Needs ``transformers``.

Run:  .venv/bin/python benchmarks/logging_traffic.py [--workload logging|noise]
      [--layers 12 --batch 8 --seq 512]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nnstat

_GEMMS = ("mm", "bmm", "addmm", "baddbmm")


class Traffic(TorchDispatchMode):
    """Per op name: launches, bytes of operands and results, GEMM FLOPs; per (op, operand
    shapes): bytes. A meta tensor copied to the host (a flag read, the staged rows' copy) reads
    as ones."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.flops: collections.Counter[str] = collections.Counter()
        self.shapes: collections.Counter[tuple] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "copy_" and src.device.type == "cpu" and args[1].device.type == "meta":
            return src.fill_(1)  # the staged rows' copy to the host: ones (flags: True)
        if src is not None and src.device.type == "meta":
            if name == "_local_scalar_dense":
                return True if src.dtype == torch.bool else 1
            target = kwargs.get("device")
            if name == "_to_copy" and target is not None and torch.device(target).type == "cpu":
                return torch.ones(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        operands = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in operands)
        moved += sum(
            t.numel() * t.element_size()
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        )
        self.ops[name] += 1
        self.bytes[name] += moved
        self.shapes[(name, tuple(tuple(t.shape) for t in operands))] += moved
        if name.rstrip("_") in _GEMMS:  # in-place forms too (baddbmm_, addmm_)
            a, b = operands[-2], operands[-1]
            self.flops[name] += 2 * a.numel() * b.shape[-1]
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--workload", choices=("logging", "noise"), default="logging")
    args = p.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers))
    x = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")

    def one_pass(block) -> Traffic:
        with Traffic() as t, block if block is not None else contextlib.nullcontext():
            model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)
        return t

    plain = one_pass(None)
    if args.workload == "noise":
        gns = nnstat.NoiseScale(beta=0.99)
        gns.watch(model)
        for _ in range(3):
            logged = one_pass(gns.batch())
        what = "NoiseScale, every module"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run = nnstat.init(project="traffic", root_dir=tmp)
            nnstat.setup({"log": "grad", "save": "grad", "loss_reduction": "mean"})
            nnstat.watch(model)
            nnstat.add_projection(rank=args.rank)
            n = args.batch
            for b in range(3):  # the first batch fingerprints the weights, moves projections
                logged = one_pass(run(data_id=list(range(n * b, n * b + n))))
            nnstat.finalize()
        what = f"logging, rank {args.rank}, every supported module"

    def total(c: collections.Counter) -> float:
        return float(sum(c.values()))

    print(
        f"\nGPT-2 ({args.layers} layers), batch {args.batch} x {args.seq}, {what}, "
        f"torch {torch.__version__}\n"
    )
    print("| pass | aten ops | GB read + written | GEMM GFLOP |")
    print("| --- | ---: | ---: | ---: |")
    for label, t in (("plain forward+backward", plain), (args.workload, logged)):
        print(
            f"| {label} | {total(t.ops):.0f} | {total(t.bytes) / 1e9:.2f} "
            f"| {total(t.flops) / 1e9:.0f} |"
        )
    extra = collections.Counter(logged.shapes)
    extra.subtract(plain.shapes)
    print(f"\n| op (operand shapes) {args.workload} adds | GB |")
    print("| --- | ---: |")
    for (name, shapes), moved in sorted(extra.items(), key=lambda kv: -kv[1])[:12]:
        print(f"| {name} {shapes} | {moved / 1e9:.3f} |")


if __name__ == "__main__":
    main()
