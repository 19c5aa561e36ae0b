"""Cost at the size people train: GPT-2 small (124M) and its shallower cousins, side by side.

HuggingFace ``GPT2LMHeadModel(GPT2Config(n_layer=L))`` from a config (random init, nothing
downloaded), random tokens, sequence ``--seq`` (128), batch ``--batch`` (4), AdamW. Every part
measures its variants in one process as interleaved rounds (each round runs every variant's
block of steps, the starting variant rotated; each block's time is divided by the plain block of
the same round, the median of those ratios is reported), at each ``--layers`` depth:

* ``stats``: a plain step; + a hand-written ``p.norm().item()`` of every weight and gradient;
  + ``nnstat.Tracker`` default statistics every step; + ``Tracker(stats=None, histograms=True)``
  (all 15 statistics and histograms of weights, grads, Adam states and updates); + W&B's
  ``wandb.watch(log="all", log_freq=1)`` (offline, on its own copy of the model: its hooks
  would slow every variant sharing the model).
* ``logging``: forward + backward of a batch with rank-64 LoGra projection written to a gradient
  store, for every supported module (the README's plain ``nnstat.watch(model)`` workflow) and
  for ``lm_head`` only, next to LogIX (``add_lora`` + ``save``), which wraps only ``nn.Linear``
  (on GPT-2 just ``lm_head``) and freezes every other parameter: so lm_head-only rows are
  compared with and without the other parameters' gradients. Bytes per sample from the files.
  Each logger runs in its own child process against its own plain pass (same model, same
  frozen parameters).

  Which rows are like for like: GPT-2's ``lm_head`` is TIED to ``transformer.wte``. nnstat
  logs the tied weight once, under ``lm_head``, as the sum of both uses (the output projection
  and the embedding lookup at the bottom of the network), so its per-sample gradient needs the
  backward down to the embedding, through every block, even with ``param_grads=False``.
  LogIX's LoRA branch sees only the ``nn.Linear`` use and stops the backward at the head. So
  the tied rows measure different gradients. The ``untied`` rows use
  ``GPT2Config(tie_word_embeddings=False)``: ``lm_head`` owns its weight, nnstat's
  ``param_grads=False`` pass and LogIX both need only ``lm_head``'s output gradient, and both
  are divided by the same plain pass (untied, only ``lm_head`` trainable, whose backward also
  stops at the head): those two rows are the like-for-like comparison.
* ``hf``: a ``transformers.Trainer`` with nnstat's ``NNStatCallback()`` (its defaults) vs the
  same Trainer without it.

Peak memory: ``--memory`` also runs each variant alone in a child process and reports the peak
resident memory of its steps (Linux ``VmHWM``, reset after the model is built) above the plain
variant's.

    WANDB_MODE=offline .venv/bin/python benchmarks/scale.py [--parts stats,logging,hf]
        [--layers 2,12] [--batch 4 --seq 128] [--rounds 5 --steps 2] [--threads 2] [--memory]
        [--device cuda]

On a GPU pass ``--device cuda --batch 8 --seq 512``; times are then taken after
``torch.cuda.synchronize()`` and memory is ``torch.cuda.max_memory_allocated`` per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nnstat

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

Step = Callable[[], None]


def gpt2(layers: int, device: str, seed: int = 0, tied: bool = True) -> torch.nn.Module:
    """``tied=False``: ``lm_head`` gets a weight of its own (not ``transformer.wte``'s)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=layers, tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg).to(device)


def tokens(args: argparse.Namespace, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50257, (n, args.seq), generator=g).to(args.device)


def lm_loss(model: torch.nn.Module, x: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = model(input_ids=x).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction=reduction
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- variants of each part


WANDB = 'wandb.watch(log="all", log_freq=1)'


def stats_variants(
    args, layers: int, tmp: str, only: str | None = None
) -> dict[str, tuple[Step, Step]]:
    """name -> (one training step, the wait that closes a timed block); `only`: build just that
    variant (the memory probe)."""
    if only == WANDB:
        return {WANDB: _watched(args, layers, tmp)}
    model = gpt2(layers, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = tokens(args, args.batch)

    def step(m=model, o=opt) -> None:
        o.zero_grad(set_to_none=True)
        lm_loss(m, x).backward()
        o.step()

    none = lambda: None  # noqa: E731
    out: dict[str, tuple[Step, Step]] = {"plain step": (step, none)}

    def norms() -> None:
        step()
        for p in model.parameters():
            _ = (p.detach().norm().item(), p.grad.norm().item())

    out["hand-written p.norm().item() per parameter"] = (norms, none)
    for label, kw in [
        ("default", {}),
        ("all stats + histograms", dict(stats=None, histograms=True)),
    ]:
        name = f"nnstat Tracker, {label}"
        if only in (None, name):
            t = nnstat.Tracker(model, opt, every=1, **kw)
            out[name] = (lambda t=t: (step(), t.step()), t.flush)
    if "wandb" in args.peers and only is None:
        out[WANDB] = _watched(args, layers, tmp)
    return out


def _watched(args, layers: int, tmp: str) -> tuple[Step, Step]:
    """wandb.watch on its own model (its hooks would slow every variant sharing one)."""
    import wandb

    model = gpt2(layers, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = tokens(args, args.batch)
    run = wandb.init(project="nnstat-scale", dir=tmp, mode="offline")
    run.watch(model, log="all", log_freq=1)

    def watched() -> None:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, x)
        loss.backward()
        opt.step()
        run.log({"loss": loss.item()})

    return watched, lambda: None


def _nnstat_logger(
    model, root: str, name_filter: str | None, x, param_grads: bool = True
) -> tuple[Step, Step]:
    run = nnstat.init(project="scale", root_dir=root, overwrite=True)
    nnstat.setup({"statistic": "none", "param_grads": param_grads})
    nnstat.watch(model, name_filter=name_filter)
    nnstat.add_projection(rank=64)
    return _logged_step(model, x, run), nnstat.finalize  # finalize writes the last shard


def _logged_step(model, x, block: Callable[..., Any]) -> Step:
    """One logged forward+backward per call inside ``block(data_id=...)`` (nnstat's Run or
    LogIX's), with fresh ids each time."""
    state = {"i": 0}

    def step() -> None:
        ids = [f"s{state['i']}-{j}" for j in range(len(x))]
        state["i"] += 1
        with block(data_id=ids):
            lm_loss(model, x, "sum").backward()
        model.zero_grad(set_to_none=True)

    return step


def _frozen_but(model: torch.nn.Module, keep: str) -> None:
    for n, p in model.named_parameters():
        p.requires_grad_(keep in n)


def logging_variants(
    args, layers: int, tmp: str, only: str | None = None
) -> dict[str, tuple[Step, Step]]:
    """Each variant on its own model (hooks, frozen parameters and LoRA modules differ)."""
    x = tokens(args, args.batch)
    none = lambda: None  # noqa: E731
    out: dict[str, tuple[Step, Step]] = {}

    def plain(model) -> Step:
        def step() -> None:
            lm_loss(model, x, "sum").backward()
            model.zero_grad(set_to_none=True)

        return step

    if only in (None, "plain forward+backward"):
        out["plain forward+backward"] = (plain(gpt2(layers, args.device)), none)
    if only in (None, "plain forward+backward, only lm_head trainable"):
        frozen = gpt2(layers, args.device)
        _frozen_but(frozen, "wte")  # lm_head is tied to wte: the one trainable weight
        out["plain forward+backward, only lm_head trainable"] = (plain(frozen), none)
    if only in (None, UNTIED_PLAIN):
        untied = gpt2(layers, args.device, tied=False)
        _frozen_but(untied, "lm_head")  # its own weight: the backward stops at the head
        out[UNTIED_PLAIN] = (plain(untied), none)
    # nnstat's Run is process-wide (the seed's API): one logging variant per process; the
    # others run as child processes through --only, measured against their own plain pass
    return out


UNTIED_PLAIN = "plain forward+backward, untied lm_head, only lm_head trainable"
LOGGING_NOTE = (
    "\nThe plain rows are divided by the first; each logger row by its own plain pass (same "
    "model, same frozen parameters) in its child process. GPT-2's lm_head is tied to wte: "
    "nnstat's tied lm_head rows log the weight's whole gradient (both uses, backward down to "
    "the embedding), LogIX's only the nn.Linear use, so they are not like for like. The two "
    "`untied` logger rows (GPT2Config(tie_word_embeddings=False); backward stops at the head "
    "in both) are."
)


def logger_model(args, layers: int, which: str) -> torch.nn.Module:
    """The model a logger (and the plain pass it is divided by) runs on: untied for the
    ``untied`` rows, with every parameter but ``lm_head``'s weight frozen for the ``others
    frozen`` ones (the tied weight is ``transformer.wte.weight``)."""
    untied = "untied" in which
    model = gpt2(layers, args.device, tied=not untied)
    if "others frozen" in which:
        _frozen_but(model, "lm_head" if untied else "wte")
    return model


def logging_alone(args, layers: int, which: str, tmp: str) -> tuple[Step, Step, Callable[[], int]]:
    x = tokens(args, args.batch)
    model = logger_model(args, layers, which)
    root = os.path.join(tmp, which.replace(" ", "_").replace(",", ""))
    if which == "nnstat every supported module":
        step, done = _nnstat_logger(model, root, None, x)
        return step, done, lambda: _bytes(Path(root) / "scale", (".npy",))
    if which == "nnstat lm_head":
        step, done = _nnstat_logger(model, root, r"^lm_head$", x)
        return step, done, lambda: _bytes(Path(root) / "scale", (".npy",))
    if which == "nnstat lm_head, others frozen":
        step, done = _nnstat_logger(model, root, r"^lm_head$", x)
        return step, done, lambda: _bytes(Path(root) / "scale", (".npy",))
    if which in (
        "nnstat lm_head, others frozen, param_grads False",
        "nnstat untied lm_head, others frozen, param_grads False",
    ):
        # no parameter gradient at all. Tied, the logged gradient still needs the embedding
        # use's output gradient, so the backward runs down to wte; untied (like for like with
        # LogIX), it stops at lm_head's output gradient, as it stops at LogIX's LoRA branch
        step, done = _nnstat_logger(model, root, r"^lm_head$", x, param_grads=False)
        return step, done, lambda: _bytes(Path(root) / "scale", (".npy",))
    if which in (
        "LogIX lm_head (add_lora, others frozen)",
        "LogIX untied lm_head (add_lora, others frozen)",
    ):
        from logix import LogIX

        os.makedirs(root, exist_ok=True)
        cwd = os.getcwd()
        os.chdir(root)
        lx = LogIX(project="bench")
        lx.watch(model)
        lx.add_lora()
        lx.setup({"grad": ["log"]})
        lx.save(True)
        os.chdir(cwd)
        step = _logged_step(model, x, lx)

        def done() -> None:
            here = os.getcwd()
            os.chdir(root)
            try:
                lx.finalize()
            finally:
                os.chdir(here)

        return step, done, lambda: _bytes(Path(root) / "logix", (".mmap",))
    raise ValueError(which)


LOGGERS = [
    "nnstat every supported module",
    "nnstat lm_head",
    "nnstat lm_head, others frozen",
    "nnstat lm_head, others frozen, param_grads False",
    "LogIX lm_head (add_lora, others frozen)",
    # like for like (see the module docstring): the same gradient, lm_head's own weight
    "nnstat untied lm_head, others frozen, param_grads False",
    "LogIX untied lm_head (add_lora, others frozen)",
]


def hf_variants(
    args, layers: int, tmp: str, only: str | None = None
) -> dict[str, tuple[Step, Step]]:
    """A Trainer run of --steps steps per call (a fresh Trainer over the same model each time,
    so each block also creates its AdamW state), with and without NNStatCallback()."""
    import transformers
    from nnstat.integrations.huggingface import NNStatCallback

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.x = tokens(args, n).cpu()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    def trainer_step(callback: dict | None) -> Step:
        model = gpt2(layers, args.device)
        targs = transformers.TrainingArguments(
            output_dir=os.path.join(tmp, f"hf-{len(callback or ())}-{callback is None}"),
            max_steps=args.steps * 10**6,
            per_device_train_batch_size=args.batch,
            logging_steps=10,
            report_to="none",
            save_strategy="no",
            use_cpu=args.device == "cpu",
            disable_tqdm=True,
            seed=0,
        )
        cbs = [NNStatCallback(**callback)] if callback is not None else []
        data = Tokens(args.batch * args.steps)

        def block() -> None:
            # a fresh Trainer over the same model: --steps optimizer steps per block
            targs.max_steps = args.steps
            trainer = transformers.Trainer(
                model=model, args=targs, train_dataset=data, callbacks=list(cbs)
            )
            with contextlib.redirect_stdout(io.StringIO()):  # its end-of-train metrics line
                trainer.train()

        return block

    none = lambda: None  # noqa: E731
    # the callback's default measures the noise scale on one micro-batch in 8 (per-sample
    # gradient norms); the third row separates that from the layer statistics
    names: dict[str, dict | None] = {
        "Trainer": None,
        "Trainer + NNStatCallback()": {},
        "Trainer + NNStatCallback(noise_scale=False)": {"noise_scale": False},
    }
    return {k: (trainer_step(v), none) for k, v in names.items() if only in (None, k)}


# ---------------------------------------------------------------- measuring


def _finish_wandb() -> None:
    with contextlib.suppress(ImportError):
        import wandb

        wandb.finish()


def _bytes(root: Path, suffixes: tuple[str, ...]) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.suffix in suffixes)


def interleave(args, runs: dict[str, tuple[Step, Step]], steps: int) -> dict[str, list[float]]:
    """Seconds per step of each variant in each round (rotated order)."""
    for fn, done in runs.values():  # warm-up: allocations, Adam state, first snapshot
        fn()
        done()
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, done = runs[name]
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            done()
            sync(args.device)
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def ratios(times: dict[str, list[float]], base: str) -> dict[str, tuple[float, float]]:
    """name -> (median seconds per step, median per-round ratio to `base`)."""
    b = times[base]
    return {
        k: (
            statistics.median(v),
            statistics.median(a / c for a, c in zip(v, b, strict=True)),
        )
        for k, v in times.items()
    }


def peak_memory(args, part: str, layers: int, variant: str) -> float:
    """MiB of peak memory of `variant` run alone (child process)."""
    cmd = [sys.executable, __file__, "--probe", json.dumps([part, layers, variant])]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--device", args.device]
    cmd += ["--threads", str(args.threads), "--peers", ",".join(args.peers)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"memory probe of {variant!r} failed:\n{res.stderr[-3000:]}")
    return float(res.stdout.strip().splitlines()[-1])


def probe(args) -> None:
    part, layers, variant = json.loads(args.probe)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        if part == "logging" and variant in LOGGERS:
            fn, done, _ = logging_alone(args, layers, variant, tmp)
        else:
            fn, done = VARIANTS[part](args, layers, tmp, only=variant)[variant]
        # the peak of the steps alone: building the model has its own transient peak, which
        # would hide every variant's extra memory
        _reset_peak(args.device)
        for _ in range(3):
            fn()
        done()
        _finish_wandb()
        print(_peak_mib(args.device))


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets VmHWM to the current RSS
        f.write("5")


def _peak_mib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


VARIANTS = {"stats": stats_variants, "logging": logging_variants, "hf": hf_variants}
BASE = {"stats": "plain step", "logging": "plain forward+backward", "hf": "Trainer"}


def logging_rows(args, layers: int) -> dict[str, tuple[float, float, int]]:
    """Each logger in its own child process, interleaved there with a plain pass."""
    out = {}
    for which in LOGGERS:
        if which.startswith("LogIX") and "logix" not in args.peers:
            continue
        if args.loggers == "every-module" and which != LOGGERS[0]:
            continue
        cmd = [sys.executable, __file__, "--logger", which, "--layers", str(layers)]
        cmd += [
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--device",
            args.device,
        ]
        cmd += ["--threads", str(args.threads), "--rounds", str(args.rounds)]
        cmd += ["--steps", str(args.steps)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode:
            print(f"\n{which} could not run: {res.stderr.strip().splitlines()[-1:]}")
            continue
        secs, ratio, per_sample = json.loads(res.stdout.strip().splitlines()[-1])
        out[which] = (secs, ratio, per_sample)
    return out


def logger_child(args) -> None:
    layers = int(args.layers)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        x = tokens(args, args.batch)
        model = logger_model(args, layers, args.logger)  # the logger's model, hooks aside

        def plain() -> None:
            lm_loss(model, x, "sum").backward()
            model.zero_grad(set_to_none=True)

        fn, done, nbytes = logging_alone(args, layers, args.logger, tmp)
        runs = {"plain": (plain, lambda: None), args.logger: (fn, lambda: None)}
        times = interleave(args, runs, args.steps)
        done()
        n_logged = args.batch * (1 + args.rounds * args.steps)
        r = ratios(times, "plain")[args.logger]
        print(json.dumps([r[0], r[1], nbytes() // n_logged]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="stats,logging,hf")
    p.add_argument("--layers", default="2,12")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--peers", default="wandb,logix", help="comma list; empty for none")
    p.add_argument("--memory", action="store_true", help="peak memory of each variant alone")
    # each logger row is a child process that builds GPT-2 again: a short check runs one
    p.add_argument("--loggers", choices=("all", "every-module"), default="all")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--logger", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.peers = [s for s in args.peers.split(",") if s]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        return probe(args)
    if args.logger:
        return logger_child(args)
    print(
        f"GPT-2 (n_embd 768), batch {args.batch} x {args.seq} tokens, AdamW, device "
        f"{args.device}, {torch.get_num_threads()} threads, {platform.machine()} "
        f"({os.cpu_count()} cores), torch {torch.__version__}, {args.rounds} rounds x "
        f"{args.steps} steps, {time.strftime('%Y-%m-%d')}"
    )
    for layers in [int(s) for s in args.layers.split(",")]:
        n = sum(q.numel() for q in gpt2(layers, "cpu").parameters())
        for part in args.parts.split(","):
            with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
                runs = VARIANTS[part](args, layers, tmp)
                times = interleave(args, runs, 1 if part == "hf" else args.steps)
                rows = {k: (s, r, None) for k, (s, r) in ratios(times, BASE[part]).items()}
                del runs
                _finish_wandb()
            if part == "logging":
                rows.update(logging_rows(args, layers))
            print(f"\n### {part}, n_layer={layers} ({n / 1e6:.0f}M parameters)\n")
            head = "| variant | ms / step | / plain |"
            head += " bytes / sample |" if part == "logging" else ""
            head += " peak MiB above plain |" if args.memory else ""
            print(head)
            print("|" + " --- |" + " ---: |" * (head.count("|") - 2))
            base_mem = peak_memory(args, part, layers, BASE[part]) if args.memory else 0.0
            per = 1000 / (args.steps if part == "hf" else 1)
            for name, (secs, ratio, nbytes) in rows.items():
                line = f"| {name} | {secs * per:.0f} | {ratio:.2f}x |"
                if part == "logging":
                    line += f" {nbytes:,} |" if nbytes is not None else " – |"
                if args.memory:
                    mem = peak_memory(args, part, layers, name) - base_mem
                    line += f" {mem:+.0f} |"
                print(line, flush=True)
            if part == "logging":
                print(LOGGING_NOTE)
        shutil.rmtree(os.path.join(tempfile.gettempdir(), "nnstat-scale"), ignore_errors=True)


if __name__ == "__main__":
    main()
