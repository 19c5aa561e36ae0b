"""Attribution at scale: a Llama-shaped ~1B model, logged, scored and refined on one GPU.

A ``LlamaForCausalLM`` built from ``transformers.LlamaConfig`` with random weights (nothing is
downloaded; hidden 2048, 16 layers, MLP 5632, 32 heads, vocabulary 32000: 0.95B parameters) in
bfloat16 on the device. For each entry of ``RUNS`` (a name and the ``nnstat.setup`` keys that
differ: adding a factored variant is one more entry) it logs ``--n`` training sequences of
``--seq`` tokens with EK-FAC statistics (``run.schedule()``: factors, eigenvalues, then the rows)
through the public API, scores ``--queries`` query sequences against the store, and refines
``--refine-queries`` of them (``nnstat.influence.Refinement``, Gauss-Newton, ``--refine-steps``
passes); it prints tokens/s, peak device memory (``torch.cuda.max_memory_allocated``) and
seconds per stage. LogIX logs the same model and batches in the same run when ``logix`` is
importable (its LoRA logging, as in ``benchmarks/scale.py``); else the table says it was
skipped. Then the scoring target: ``--queries`` queries scored through
``compute_influence_all(..., device=...)`` against a ``--score-rows``-row store of factored rows
(``--score-modules`` modules of the factored run's shape, rank 64 x 64 at c = 8: 4 KiB a module
a row), its seconds against the host-to-device copy bound of its bytes (one plain ``copy_`` of
as many bytes from pinned host memory, timed in the same run), and their ratio (target:
>= 0.5). ``--gpt2-refine`` then runs the 12-layer GPT-2 refinement row of
``benchmarks/scale_influence.py`` (its own process and table).

    # the whole workload (1,024 sequences x 1,024 tokens)
    python3 benchmarks/attribution_scale.py --device cuda --n 1024 --seq 1024
    # what benchmarks/gpu_check.py --parts attribution runs (fits its time cap)
    python3 benchmarks/attribution_scale.py --device cuda --n 16 --queries 64 --refine-steps 1
    # with the 12-layer GPT-2 refinement row (gpu_check's `refine` part runs it on its own)
    python3 benchmarks/attribution_scale.py --device cuda --n 1024 --gpt2-refine
    # a dry run of the whole flow on a CPU (a 2-layer model of the same modules)
    .venv/bin/python benchmarks/attribution_scale.py --device cpu --tiny --n 8 --seq 32 \
        --queries 4 --refine-queries 2 --batch 4
    # the scoring target only (100,000 factored rows, 64 queries, against the copy bound)
    python3 benchmarks/attribution_scale.py --device cuda --score-only
    # the memory plan only, on `meta` (no device, no memory): runs anywhere
    .venv/bin/python benchmarks/attribution_scale.py --plan-only --batch 4

The capped run logs fewer sequences than the full workload; every logging stage is linear in
the sequences logged (``docs/scaling.md``: k = 0.93-1.00), so the full workload's seconds are
the printed tokens/s applied to 1,048,576 tokens; scoring 64 queries is linear in the rows.

``memory_plan`` is the device-memory plan of one logged batch, computed on ``meta`` (the CI
tests check it against a closed-form parameter count and against bytes measured on a tiny
model on the CPU: ``tests/influence/test_attribution_scale.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig

# One entry per logging variant: (name, the nnstat.setup keys besides log/save/statistic).
# Factored rows at c = 8 scored as dense on the LM task (docs/benchmarks.md, "Factored rows")
RUNS: list[tuple[str, dict]] = [
    ("dense rank 64", {"rank": 64}),
    ("factored rank 64, c = 8", {"rank": 64, "factors": 8}),
]

LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=5632,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
MIB = 2**20
# --tiny: a 2-layer model with the same modules, to dry-run this script on a CPU
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
)


def llama_config(**overrides) -> LlamaConfig:
    """The ~1B Llama shape (``LLAMA_1B``) with ``overrides`` (a tiny model for the tests)."""
    return LlamaConfig(**{**LLAMA_1B, **overrides})


def parameter_count(cfg: LlamaConfig) -> int:
    """Closed-form parameters of ``LlamaForCausalLM(cfg)`` (no biases: attention_bias and
    mlp_bias False): per layer q/o ``h²`` each, k/v ``h·kv`` each, gate/up/down ``h·i`` each,
    two RMSNorm weights ``h``; the embedding, the final norm and an untied ``lm_head``."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return cfg.num_hidden_layers * layer + v * h + h + (0 if cfg.tie_word_embeddings else v * h)


@dataclass
class MemoryPlan:
    """Device bytes of one logged batch (``batch`` x ``seq`` tokens) of a model, by part."""

    batch: int
    seq: int
    rank: int
    parameters: int  # the weights, in the model's dtype
    activations: int  # tensors autograd saves in the forward (a dry forward on `meta`)
    capture: int  # the backward hook's largest float32 copies: one module's inputs + output grads
    rows_in_flight: int  # float32 rows the store's writer queue may hold (queue_size blocks)
    ekfac: int  # float32 K-FAC factors (dense up to max_factor_dim) and their eigenbases
    watched: int  # modules whose rows are logged
    row_width: int  # float32 columns per stored row

    @property
    def total(self) -> int:
        """The sum: parameters + activations + capture + rows in flight + EK-FAC."""
        return self.parameters + self.activations + self.capture + self.rows_in_flight + self.ekfac

    def table(self) -> str:
        """A markdown table of the plan (MiB)."""
        out = [f"| part (batch {self.batch} x {self.seq} tokens, rank {self.rank}) | MiB |"]
        out.append("| --- | ---: |")
        for key in ("parameters", "activations", "capture", "rows_in_flight", "ekfac", "total"):
            out.append(f"| {key.replace('_', ' ')} | {getattr(self, key) / MIB:,.0f} |")
        return "\n".join(out)


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Sum over sequences of each sequence's mean next-token loss (one row per sequence)."""
    logits = model(input_ids=x).logits[:, :-1].float()
    tok = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
    )
    return tok.reshape(x.shape[0], -1).mean(1).sum()


def saved_bytes(model, x: torch.Tensor) -> int:
    """Bytes autograd saves in ``lm_loss``'s forward (each storage once: views share it)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata if t.device.type == "meta" else storage.data_ptr()
        seen.setdefault(key, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model, x)
    # parameters are saved by their own matmuls but are counted as parameters
    params = {
        (p.untyped_storage()._cdata if p.device.type == "meta" else p.data_ptr())
        for p in model.parameters()
    }
    return sum(b for k, b in seen.items() if k not in params)


def watched_modules(model) -> list[tuple[str, int, int | None]]:
    """``(name, d_in, d_out)`` of the modules a run logs: every Linear and the embedding (their
    rows are ``r_out x r_in``), and every RMSNorm (``d_out`` None: a flat gradient of ``D``,
    projected to ``r``); rotary embeddings have no parameters."""
    out: list[tuple[str, int, int | None]] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            out.append((name, m.in_features, m.out_features))
        elif isinstance(m, torch.nn.Embedding):
            out.append((name, m.num_embeddings, m.embedding_dim))
        elif type(m).__name__ == "LlamaRMSNorm":
            out.append((name, m.weight.numel(), None))
    return out


def memory_plan(
    cfg: LlamaConfig,
    batch: int,
    seq: int,
    rank: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "meta",
    queue_size: int = 16,
    max_factor_dim: int = 16384,
) -> MemoryPlan:
    """The device memory of one logged batch of ``LlamaForCausalLM(cfg)``, by part.

    Parameters and activations are measured on ``device`` (``meta``: shapes only, no memory);
    the rest is counted from the module shapes: the capture's float32 copies of the largest
    module's inputs and output gradients in its backward hook plus their rank-``rank``
    projections, ``queue_size`` blocks of ``batch`` float32 rows, and the EK-FAC factors (``A``
    ``d_in²``, ``S`` ``d_out²``, float32, with an eigenbasis each; a side over
    ``max_factor_dim`` is kept projected, ``rank²``; an embedding's input side is its diagonal;
    an RMSNorm's ``D²`` gradient covariance).

    Args:
        cfg: the model's configuration.
        batch: sequences per logged batch.
        seq: tokens per sequence.
        rank: projection rank of both sides of every logged module.
        dtype: the model's parameter dtype.
        device: where the dry forward runs (``meta``, or ``cpu`` for a small model).
        queue_size: the store writer's queue (``RunConfig.queue_size``).
        max_factor_dim: ``RunConfig.max_factor_dim``.

    Returns:
        The :class:`MemoryPlan`.

    Example:
        >>> plan = memory_plan(llama_config(), batch=4, seq=1024)
        >>> plan.parameters == 2 * parameter_count(llama_config())
        True
    """
    model = build_model(cfg, device, dtype)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.zeros(batch, seq, dtype=torch.long, device=device)
    acts = saved_bytes(model, x)
    mods = watched_modules(model)
    f32, tokens = 4, batch * seq
    capture = max(tokens * (d_in + (d_out or d_in) + 2 * rank) * f32 for _, d_in, d_out in mods)
    widths = [min(rank, d_in) * (min(rank, d_out) if d_out else 1) for _, d_in, d_out in mods]
    width = sum(widths)
    rows = queue_size * batch * width * f32

    def side(d: int, diagonal: bool = False) -> int:
        if diagonal:
            return d * f32
        return 2 * (rank * rank if d > max_factor_dim else d * d) * f32  # factor + eigenbasis

    ekfac = 0
    for (name, d_in, d_out), w in zip(mods, widths, strict=True):
        if d_out is None:  # a norm: its exact gradient covariance, no Kronecker factors
            ekfac += d_in * d_in * f32
            continue
        emb = name.endswith("embed_tokens")
        ekfac += side(d_in, diagonal=emb) + side(d_out) + w * f32  # + the eigenvalues
    return MemoryPlan(batch, seq, rank, params, acts, capture, rows, ekfac, len(mods), width)


# ---------------------------------------------------------------- the GPU run


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_mib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / MIB if device.startswith("cuda") else float("nan")


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def build_model(cfg: LlamaConfig, device: str, dtype: torch.dtype):
    """``LlamaForCausalLM(cfg)`` with random weights made directly on ``device`` in ``dtype``."""
    from transformers import LlamaForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)


def log_store(
    model, data, root: str, project: str, keys: dict, batch: int, device: str, statistic: str
) -> dict:
    """Log ``data`` (``[n, seq]`` tokens) into ``root/project`` with ``statistic`` (``ekfac``:
    ``run.schedule()`` runs the factors pass, then the eigenvalues pass that also saves the rows);
    seconds, tokens/s and peak MiB of each pass."""
    import nnstat

    run = nnstat.init(project=project, root_dir=root, overwrite=True)
    setup = {"log": "grad", "save": "grad", "statistic": statistic, "param_grads": False}
    nnstat.setup({**setup, **keys})
    nnstat.watch(model)
    out: dict = {}
    for p in run.schedule():
        _reset_peak(device)
        _sync(device)
        start = time.perf_counter()
        for lo in range(0, len(data), batch):
            x = data[lo : lo + batch].to(device)
            with run(data_id=list(range(lo, lo + len(x)))):
                lm_loss(model, x).backward()
            model.zero_grad(set_to_none=True)
        _sync(device)
        seconds = time.perf_counter() - start
        out[p.name] = {
            "seconds": seconds,
            "tokens_per_s": data.numel() / seconds,
            "peak_mib": _peak_mib(device),
        }
    nnstat.unwatch()  # run.schedule() finalized each pass
    return out


def log_logix(cfg: LlamaConfig, data, root: str, batch: int, device: str) -> dict | str:
    """LogIX's LoRA logging (``benchmarks/scale.py``'s LogIX arm) of the same batches on its own
    copy of the model (same seed, same weights: LoRA modules change the model they are added
    to): seconds, tokens/s and peak MiB of that model and its work (what was allocated before
    it is left out); or why it was skipped."""
    import importlib.util
    import os

    if importlib.util.find_spec("logix") is None:
        return "skipped: logix is not importable here"
    from logix import LogIX

    base = torch.cuda.memory_allocated() / MIB if device.startswith("cuda") else 0.0
    _reset_peak(device)
    model = build_model(cfg, device, torch.bfloat16)
    here = os.getcwd()
    os.makedirs(root, exist_ok=True)
    os.chdir(root)
    try:
        lx = LogIX(project="attribution")
        lx.watch(model)
        lx.add_lora()
        lx.setup({"grad": ["log"]})
        lx.save(True)
        _sync(device)
        start = time.perf_counter()
        for lo in range(0, len(data), batch):
            x = data[lo : lo + batch].to(device)
            with lx(data_id=[str(i) for i in range(lo, lo + len(x))]):
                lm_loss(model, x).backward()
            model.zero_grad(set_to_none=True)
        _sync(device)
        seconds = time.perf_counter() - start
        lx.finalize()
    finally:
        os.chdir(here)
    peak = _peak_mib(device) - base
    del model, lx
    return {"seconds": seconds, "tokens_per_s": data.numel() / seconds, "peak_mib": peak}


def score_and_refine(model, train, query, root: str, args) -> dict:
    """Score every query against the store (EK-FAC), then refine ``--refine-queries`` of them."""
    import nnstat
    from nnstat.influence import Refinement, compute_influence_all

    _reset_peak(args.device)
    start = time.perf_counter()
    res = compute_influence_all(f"{root}/queries", f"{root}/train", progress=False)
    scored = {"seconds": time.perf_counter() - start, "peak_mib": _peak_mib(args.device)}
    scored["finite"] = bool(torch.isfinite(res.scores).all())
    out = {"score": scored}
    if not args.refine_queries:
        return out
    # the refined queries' own store (a prefix of the queries, logged the same way)
    run = nnstat.init(project="refine_queries", root_dir=root, overwrite=True)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "none", **args.run_keys})
    nnstat.watch(model)
    q = query[: args.refine_queries]
    with run(data_id=list(range(len(q)))):
        lm_loss(model, q.to(args.device)).backward()
    model.zero_grad(set_to_none=True)
    nnstat.finalize()
    nnstat.unwatch()
    refine = Refinement(
        model,
        None,
        [train[lo : lo + args.batch] for lo in range(0, len(train), args.batch)],
        batch_loss=lambda x: lm_loss(model, x),
        steps=args.refine_steps,
        curvature="ggn",
        loss_reduction="sum",
        query_batch=args.refine_queries,
        progress=False,
    )
    _reset_peak(args.device)
    start = time.perf_counter()
    res = compute_influence_all(f"{root}/refine_queries", f"{root}/train", refine=refine)
    info = res.meta["refine"]
    out["refine"] = {
        "seconds": time.perf_counter() - start,
        "peak_mib": _peak_mib(args.device),
        "passes": info["passes"],
        "products": info["products"],
        "finite": bool(torch.isfinite(res.scores).all()),
    }
    return out


# ---------------------------------------------------------------- scoring against the copy bound


def write_factored_store(
    root: Path, rows: int, modules: int, rank: int = 64, factors: int = 8, seed: int = 0
) -> dict:
    """A store of ``rows`` random factored rows (``modules`` linear modules of ``rank x rank``,
    ``factors`` pairs each: the layout ``factors=c`` logging writes) in ``root``; returns its
    meta."""
    from nnstat.store import StoreWriter

    width = factors * 2 * rank
    mods = [
        {"name": f"layer{k}", "kind": "linear", "offset": k * width, "width": width,
         "r_out": rank, "r_in": rank, "factors": factors}
        for k in range(modules)
    ]  # fmt: skip
    meta = {"format_version": 1, "row_width": modules * width, "dtype": "float32", "modules": mods}
    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=modules * width, shard_rows=25_000)
    # one random block written again and again: drawing 100,000 rows would cost more than
    # scoring them, and the time to score does not depend on the values
    block = torch.randn(4096, modules * width, generator=torch.Generator().manual_seed(seed))
    for lo in range(0, rows, 4096):
        n = min(4096, rows - lo)
        writer.put(list(range(lo, lo + n)), block[:n])
    writer.close()
    return meta


def copy_seconds(nbytes: int, device: str, repeat: int = 3) -> float:
    """The fastest of ``repeat`` plain copies of ``nbytes`` from pinned host memory to ``device``
    (one ``copy_``, synchronised): the bound of bytes that cross the bus once. On a CPU: one
    copy between two host buffers."""
    cuda = device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)  # touched: no page faults in the timed copies
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def score_against_copy_bound(root: Path, queries: int, device: str) -> dict:
    """Score ``queries`` random queries against the factored store at ``root`` through the
    public API (``compute_influence_all(..., device=device)``, all pairs, ``identity``: the
    rows, not a fit, are timed) after one untimed call (the page cache, the device's start-up,
    the pinned buffers); its seconds, the stored bytes that crossed to the device, the copy
    bound of those bytes (`copy_seconds`) and the ratio of the two (1: at the bound)."""
    from nnstat.influence import compute_influence_all
    from nnstat.store import GradientLog, GradientStore
    from nnstat.store.factored import dense_layout

    store = GradientStore(root)
    dense = dense_layout(store.meta)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(queries, dense["row_width"], generator=gen)
    log = GradientLog(list(range(queries)), q, {**store.meta, **dense})
    kw = {"preconditioner": "identity", "device": device, "progress": False}
    compute_influence_all(log, store, **kw)
    _sync(device)
    start = time.perf_counter()
    res = compute_influence_all(log, store, **kw)
    _sync(device)
    seconds = time.perf_counter() - start
    nbytes = len(store) * store.row_width * 4
    bound = copy_seconds(nbytes, device)
    m = store.meta["modules"][0]
    return {
        "store": f"{len(store.meta['modules'])} modules, rank {m['r_out']}, c = {m['factors']}",
        "rows": len(store),
        "queries": queries,
        "bytes": nbytes,
        "seconds": seconds,
        "copy_seconds": bound,
        "ratio": bound / seconds,
        "result": res,
        "query_rows": q,
    }


def score_table(r: dict) -> str:
    """The scoring target's markdown table (of `score_against_copy_bound`)."""
    head = "| store | queries | GiB stored | score s | GB/s | pinned H2D copy s | of the bound |"
    row = (
        f"| {r['rows']:,} factored rows ({r['store']}) | {r['queries']} "
        f"| {r['bytes'] / 2**30:.2f} | {r['seconds']:.3f} | {r['bytes'] / r['seconds'] / 1e9:.2f} "
        f"| {r['copy_seconds']:.3f} | {r['ratio']:.0%} |"
    )
    return "\n".join([head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |", row])


def run_scoring(args) -> None:
    """The scoring target's stage (its own temporary store)."""
    print(f"\n# Scoring {args.queries} queries against a factored store (target: >= 50% of the")
    print("# host-to-device copy bound of its bytes)")
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        write_factored_store(Path(root) / "train", args.score_rows, args.score_modules)
        print(f"# store written in {time.perf_counter() - start:.1f} s", flush=True)
        r = score_against_copy_bound(Path(root) / "train", args.queries, args.device)
    print(score_table(r), flush=True)


def _row(name: str, stage: str, r: dict, tokens: int | None) -> str:
    tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
    full = f"{tokens / r['tokens_per_s']:,.0f}" if tokens and "tokens_per_s" in r else ""
    return f"| {name} | {stage} | {r['seconds']:.1f} | {tps} | {r['peak_mib']:,.0f} | {full} |"


def run_gpu(args) -> None:
    cfg = llama_config(**(TINY if args.tiny else {}))
    dtype = torch.bfloat16
    model = build_model(cfg, args.device, dtype)
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, cfg.vocab_size, (args.n, args.seq), generator=gen)
    query = torch.randint(0, cfg.vocab_size, (args.queries, args.seq), generator=gen)
    full = 1024 * 1024
    print(f"# Llama {parameter_count(cfg) / 1e9:.2f}B, bf16, {args.n} x {args.seq} tokens")
    print(memory_plan(cfg, args.batch, args.seq).table())  # on meta: an upper bound
    print()
    print("| logger | stage | seconds | tokens/s | peak MiB | s for 1,024 x 1,024 (linear) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for i, (name, keys) in enumerate(RUNS):
        args.run_keys = keys
        with tempfile.TemporaryDirectory() as root:
            stages = log_store(model, train, root, "train", keys, args.batch, args.device, "ekfac")
            for stage, r in stages.items():
                print(_row(name, f"log: {stage}", r, full), flush=True)
            if i == 0:  # LogIX beside the first variant, before the longer stages
                with tempfile.TemporaryDirectory() as lx_root:
                    lx = log_logix(cfg, train, lx_root, args.batch, args.device)
                if isinstance(lx, str):
                    print(f"| LogIX (LoRA, rank 64) | {lx} | | | | |", flush=True)
                else:
                    print(_row("LogIX (LoRA, rank 64)", "log", lx, full), flush=True)
            log_store(model, query, root, "queries", keys, args.batch, args.device, "none")
            done = score_and_refine(model, train, query, root, args)
            print(_row(name, f"score {args.queries} queries", done["score"], None), flush=True)
            if "refine" in done:
                r = done["refine"]
                stage = f"refine {args.refine_queries} ({r['passes']} passes)"
                print(_row(name, stage, r, None), flush=True)
    if args.gpt2_refine:
        cmd = [sys.executable, str(Path(__file__).parent / "scale_influence.py")]
        cmd += ["--device", args.device, "--n-layer", "12", "--refine-steps", "5"]
        # the 12-layer refinement row that gpu_check's ``refine`` part runs at 1,024 sequences
        cmd += ["--n", "256", "--queries", "32", "--seq", "128", "--statistics", "none"]
        cmd += ["--kinds", "refined", "--refine-batch", "32", "--store", "/tmp/nnstat_gpt2_12"]
        print("\n# GPT-2 12 layers, refinement: " + " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-4000:] + proc.stderr[-2000:], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=1024, help="training sequences")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences per logged batch")
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--refine-queries", type=int, default=8, help="0: no refinement")
    ap.add_argument("--refine-steps", type=int, default=2)
    ap.add_argument("--gpt2-refine", action="store_true", help="the 12-layer GPT-2 row")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model: a dry run on a CPU")
    ap.add_argument("--plan-only", action="store_true", help="print the memory plan on meta")
    ap.add_argument("--quick", action="store_true", help="16 x 256 tokens, 8 queries, 2 refined")
    ap.add_argument("--score-rows", type=int, default=100_000, help="rows of the scored store")
    ap.add_argument("--score-modules", type=int, default=8, help="its modules (4 KiB a row each)")
    ap.add_argument("--score-only", action="store_true", help="the scoring target alone")
    args = ap.parse_args()
    if args.quick:
        args.n, args.seq, args.queries, args.refine_queries = 16, 256, 8, 2
        args.score_rows = 20_000
    if args.plan_only:
        plan = memory_plan(llama_config(), args.batch, args.seq)
        print(json.dumps(asdict(plan) | {"total": plan.total}))
        print(plan.table())
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    if not args.score_only:
        run_gpu(args)
    run_scoring(args)


if __name__ == "__main__":
    main()
