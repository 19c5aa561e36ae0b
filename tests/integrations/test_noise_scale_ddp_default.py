"""The callbacks' noise scale under DDP (2 gloo processes): each rank's gradient against the
all-reduced one, from the communication hook, by default; checked against per-sample gradients
of every rank's shard (torch.func) at the weights of each step."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import spawn, spawn_launched
from nnstat.integrations._hooks import StatsOptions, StepStats
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat

B, WORLD = 8, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(WORLD * B, 6, generator=g), torch.randint(0, 3, (WORLD * B,), generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _run(hooks: StepStats, ddp: nn.Module, opt, rank: int, steps: list[str], record: list):
    """Optimizer steps through the callbacks' driver; ``"plain"``: one backward of the rank's
    B samples; ``"no_sync"``: two micro-batches of B / 2, the first under ``no_sync()``;
    ``"sync_both"``: the same without ``no_sync()`` (two synchronised backwards);
    ``"overflow"``: one backward of an infinite loss (as a mixed-precision overflow), no
    update."""
    model = ddp.module
    for kind in steps:
        x, y = _data(len(record))
        record.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        shard = slice(rank * B, (rank + 1) * B)
        x, y = x[shard], y[shard]
        if kind in ("plain", "overflow"):
            hooks.begin_batch(model)
            (_loss(ddp, x, y) * (float("inf") if kind == "overflow" else 1.0)).backward()
        else:
            for k in range(2):
                quiet = ddp.no_sync() if kind == "no_sync" and k == 0 else contextlib.nullcontext()
                hooks.begin_batch(model)
                half = slice(k * B // 2, (k + 1) * B // 2)
                with quiet:
                    (_loss(ddp, x[half], y[half]) / 2).backward()
        hooks.before_step(model, opt, log=False)
        if kind != "overflow":
            opt.step()
        hooks.after_step()
        opt.zero_grad(set_to_none=True)


def _driver(rank: int, out_dir: str) -> None:
    from _ledger import host_reads
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from nnstat.background.transfer import LocalCopy

    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1e-4)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    record: list = []
    out: dict = {}
    # the default under DDP without accumulation: the hook, every step
    auto = StepStats(StatsOptions(noise_scale_window=10))
    auto.configure(1, B, WORLD, wrapped=ddp)
    out["auto_method"] = auto.method
    reads: list[str] = []
    LocalCopy.ready = False  # copies held back as on a GPU
    with host_reads(reads):
        _run(auto, ddp, opt, rank, ["plain", "plain"], record)
    LocalCopy.ready = True
    out["reads"] = reads
    out["auto"] = auto.gns.state_dict()
    auto.close()
    # forced under accumulation: B_small = the rank's samples of the step; the same DDP model
    # (its hook is re-pointed); a step synchronised twice and one with non-finite gradients are
    # left out, with a warning each
    forced = StepStats(StatsOptions(noise_scale_window=10, noise_scale_method="ddp"))
    forced.configure(2, B // 2, WORLD, wrapped=ddp)
    out["forced_method"] = forced.method
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(forced, ddp, opt, rank, ["no_sync", "sync_both", "overflow", "no_sync"], record)
    out["warnings"] = [str(w.message) for w in caught]
    out["forced"] = forced.gns.state_dict()
    forced.close()
    # closed: the hook stays (DDP cannot drop it) and only averages
    x, y = _data(99)
    ddp.zero_grad()
    _loss(ddp, x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]).backward()
    out["after_close"] = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).tolist()
    # a DDP model that has its own communication hook cannot take the noise scale's: "auto"
    # warns and measures per-sample norms, a forced "ddp" is refused
    other = nn.parallel.DistributedDataParallel(_model())
    other.register_comm_hook(None, default_hooks.allreduce_hook)
    fallback = StepStats(StatsOptions())
    fallback.configure(1, B, WORLD, wrapped=other)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback.begin_batch(other.module)
    out["fallback"] = [fallback.method, [str(w.message) for w in caught]]
    fallback.close()
    refused = StepStats(StatsOptions(noise_scale_method="ddp"))
    refused.configure(1, B, WORLD, wrapped=other)
    try:
        refused.begin_batch(other.module)
    except RuntimeError as e:
        out["refused"] = str(e)
    out["record"] = [{k: v.tolist() for k, v in state.items()} for state in record]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _per_sample(state: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every sample's gradient at ``state`` (torch.func), flattened, float64: ``(n, P)``."""
    model = _model()
    model.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(len(x), -1) for g in per.values()], 1).double()


def _reference(record: list, steps: list[int]) -> dict:
    """The windowed state of a NoiseScale fed ``mean_r |g_r|^2`` (each rank's shard mean) and
    ``|G|^2`` (all 2B samples) at the weights of each step in ``steps``."""
    ref = nnstat.NoiseScale(window=10)
    for step in steps:
        x, y = _data(step)
        per = _per_sample(record[step], x, y)
        local = [per[r * B : (r + 1) * B].mean(0) for r in range(WORLD)]
        small = float(torch.stack([g.pow(2).sum() for g in local]).mean())
        ref.update(small, float(per.mean(0).pow(2).sum()), B, WORLD * B)
    return ref.state_dict()["stats"][""]


@pytest.mark.timeout(120)
def test_step_driver_under_ddp_defaults_to_the_hook_and_matches_per_sample_gradients(tmp_path):
    spawn(_driver, str(tmp_path), world=WORLD)
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for got in runs:
        assert got["auto_method"] == "ddp" and got["forced_method"] == "ddp"
        assert got["reads"] == []  # nothing read back inside the steps
        record = got["record"]
        assert len(record) == 6 and record == runs[0]["record"]
        # plain steps 0, 1; accumulated steps 2 and 5 (3 synchronised twice, 4 overflowed)
        for key, steps in (("auto", [0, 1]), ("forced", [2, 5])):
            state, expected = got[key]["stats"][""], _reference(record, steps)
            assert got[key]["n_updates"] == len(steps)
            assert state["nums"] == pytest.approx(expected["nums"], rel=1e-5)
            assert state["dens"] == pytest.approx(expected["dens"], rel=1e-5)
        assert len(got["warnings"]) == 2
        assert "synchronised the gradients 2 times" in got["warnings"][0]
        assert "non-finite gradients" in got["warnings"][1]
        method, caught = got["fallback"]
        assert method == "per_sample" and len(caught) == 1
        assert "already has a communication hook" in caught[0] and "per-sample" in caught[0]
        assert "already has a communication hook" in got["refused"]
    # after close() the hook averages exactly as DDP does: the same gradient on both ranks
    assert runs[0]["after_close"] == pytest.approx(runs[1]["after_close"], rel=1e-6)


class _Points(torch.utils.data.Dataset):
    def __init__(self) -> None:
        x, y = _data(1000)
        self.x, self.y = x.repeat(4, 1), y.repeat(4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class _Classifier(nn.Module):
    """``_model()`` behind the Trainer's calling convention (loss: the batch mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


def _train_on_gloo(model, dataset, cb, out_dir: str, **args) -> tuple:
    """Train ``model`` on ``dataset`` with the HF Trainer under gloo (CPU, nothing saved, a log
    line every step, ``args`` on top); returns the trainer and its noise-scale log lines."""
    import transformers

    arguments = transformers.TrainingArguments(
        output_dir=out_dir,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        ddp_backend="gloo",
        **args,
    )
    trainer = transformers.Trainer(model, arguments, train_dataset=dataset, callbacks=[cb])
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "noise_scale/trace_sigma" in h]


def _hf_trainer(rank: int, out_dir: str) -> None:
    """One rank of a 2-process HF Trainer run (accelerate sets up gloo from the environment)."""
    from nnstat.integrations.huggingface import NNStatCallback

    model, seen = _Classifier(), []

    def record(module, args, kwargs):  # the weights and the rank's inputs of every forward
        state = {k: v.tolist() for k, v in module.net.state_dict().items()}
        seen.append({"state": state, "x": kwargs["x"].tolist(), "y": kwargs["labels"].tolist()})

    model.register_forward_pre_hook(record, with_kwargs=True)
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_window=10)
    # max_grad_norm: the Trainer's 1.0, which clips after the hook measured
    trainer, logs = _train_on_gloo(
        model, _Points(), cb, out_dir, per_device_train_batch_size=B, max_steps=3, learning_rate=0.1
    )
    out = {"method": cb.hooks.method, "wrapped": type(trainer.model_wrapped).__name__}
    with open(os.path.join(out_dir, f"hf{rank}.json"), "w") as f:
        json.dump({**out, "logs": logs, "seen": seen}, f)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_hf_trainer_under_ddp_defaults_to_the_hook(tmp_path):
    pytest.importorskip("transformers")
    spawn_launched(_hf_trainer, str(tmp_path), world=WORLD)
    runs = [json.loads((tmp_path / f"hf{r}.json").read_text()) for r in range(WORLD)]
    ref = nnstat.NoiseScale(window=10)
    assert len(runs[0]["logs"]) == len(runs[0]["seen"]) == 3
    for step, seen in enumerate(zip(*(run["seen"] for run in runs), strict=True)):
        assert seen[0]["state"] == seen[1]["state"]  # the ranks hold the same weights
        x = torch.tensor([p for s in seen for p in s["x"]])
        y = torch.tensor([t for s in seen for t in s["y"]])
        per = _per_sample(seen[0]["state"], x, y)
        local = [per[r * B : (r + 1) * B].mean(0) for r in range(WORLD)]
        small = float(torch.stack([g.pow(2).sum() for g in local]).mean())
        ref.update(small, float(per.mean(0).pow(2).sum()), B, WORLD * B)
        for run in runs:
            assert run["method"] == "ddp" and run["wrapped"] == "DistributedDataParallel"
            got = run["logs"][step]
            assert got["step"] == step + 1
            assert got["noise_scale/grad_sq_norm"] == pytest.approx(ref.grad_sq_norm, rel=1e-4)
            assert got["noise_scale/trace_sigma"] == pytest.approx(ref.trace_sigma, rel=1e-4)


def _lightning(rank: int, out_dir: str) -> None:
    """One rank of a 2-process Lightning ``strategy="ddp"`` run (the processes are ours)."""
    import lightning as L
    from nnstat.integrations.lightning import NNStatCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            return _loss(self.net, *batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module, seen = Module(), []

    def record(net, args):  # the weights and the rank's inputs of every forward
        state = {k: v.tolist() for k, v in net.state_dict().items()}
        seen.append({"state": state, "x": args[0].tolist()})

    module.net.register_forward_pre_hook(record)
    x, y = _Points().x, _Points().y
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)
    cb = NNStatCallback(stats=["l2"], groups=["weight"], every=1, noise_scale_window=10)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=3, callbacks=[cb],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    methods = []
    cb.on_train_start = lambda tr, pl: methods.append(type(tr.strategy.model).__name__)
    trainer.fit(module, loader)
    out = {"method": cb.hooks.method, "wrapped": methods, "history": cb.history, "seen": seen}
    with open(os.path.join(out_dir, f"pl{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.mark.timeout(180)
def test_lightning_ddp_defaults_to_the_hook(tmp_path):
    pytest.importorskip("lightning")
    spawn_launched(_lightning, str(tmp_path), world=WORLD)
    runs = [json.loads((tmp_path / f"pl{r}.json").read_text()) for r in range(WORLD)]
    points = {
        tuple(p): label for p, label in zip(_Points().x.tolist(), _Points().y.tolist(), strict=True)
    }
    ref = nnstat.NoiseScale(window=10)
    assert [len(run["history"]) for run in runs] == [3, 3]
    for step, seen in enumerate(zip(*(run["seen"] for run in runs), strict=True)):
        assert seen[0]["state"] == seen[1]["state"]
        x = torch.tensor([p for s in seen for p in s["x"]])
        y = torch.tensor([points[tuple(p)] for s in seen for p in s["x"]])
        per = _per_sample(seen[0]["state"], x, y)
        local = [per[r * B : (r + 1) * B].mean(0) for r in range(WORLD)]
        small = float(torch.stack([g.pow(2).sum() for g in local]).mean())
        ref.update(small, float(per.mean(0).pow(2).sum()), B, WORLD * B)
        for run in runs:
            assert run["method"] == "ddp" and run["wrapped"] == ["DistributedDataParallel"]
            got = run["history"][step]
            assert got["step"] == step + 1
            assert got["noise_scale/grad_sq_norm"] == pytest.approx(ref.grad_sq_norm, rel=1e-4)
            assert got["noise_scale/trace_sigma"] == pytest.approx(ref.trace_sigma, rel=1e-4)


_VALID = [6, 1, 5, 1, 6, 1, 5, 1]  # label tokens per sequence; the rest is padding (-100)
_C = [1.0, -2.0, 0.5]  # every label token's input: each token's gradient is this vector


class _Padded(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(_VALID)

    def __getitem__(self, i: int) -> dict:
        labels = torch.full((6,), -100)
        labels[: _VALID[i]] = 0
        return {"x": torch.tensor(_C).repeat(6, 1), "labels": labels}


class _TokenSum(nn.Module):
    """A loss summed over the label tokens and divided by ``num_items_in_batch`` (the Trainer
    then scales it by the world size under ``average_tokens_across_devices``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(3))

    def forward(self, x, labels, num_items_in_batch=None, **kwargs) -> dict:
        valid = labels != -100
        total = num_items_in_batch if num_items_in_batch is not None else valid.sum()
        return {"loss": ((x @ self.p) * valid).sum() / total}


def _hf_token_counts(rank: int, out_dir: str) -> None:
    """One rank of a 2-process HF Trainer step whose ranks hold different label-token counts."""
    from nnstat.integrations.huggingface import NNStatCallback

    model, counts = _TokenSum(), []
    model.register_forward_pre_hook(
        lambda m, a, kw: counts.append(int(kw["labels"].ne(-100).sum())), with_kwargs=True
    )
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_window=10)
    trainer, logs = _train_on_gloo(
        model, _Padded(), cb, out_dir, per_device_train_batch_size=2, max_steps=1,
        learning_rate=0.0, average_tokens_across_devices=True,
    )  # fmt: skip
    with open(os.path.join(out_dir, f"tokens{rank}.json"), "w") as f:
        json.dump({"method": cb.hooks.method, "logs": logs, "counts": counts}, f)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_hf_trainer_ddp_weighs_ranks_by_their_label_tokens(tmp_path):
    """HF's ``average_tokens_across_devices`` (the default) makes rank r's gradient ``R n_r/N``
    times its tokens' mean: with every token's gradient the same vector ``c`` (no noise) and
    ranks of different token counts, the callback gives ``|G|^2 = |c|^2`` and ``tr(Sigma) = 0``
    (weighing the ranks equally reports noise that is not there)."""
    pytest.importorskip("transformers")
    spawn_launched(_hf_token_counts, str(tmp_path), world=WORLD)
    runs = [json.loads((tmp_path / f"tokens{r}.json").read_text()) for r in range(WORLD)]
    assert runs[0]["counts"] != runs[1]["counts"]  # the ranks' token counts differ
    g_sq = float(torch.tensor(_C).pow(2).sum())
    for run in runs:
        assert run["method"] == "ddp" and len(run["logs"]) == 1
        got = run["logs"][0]
        assert got["noise_scale/grad_sq_norm"] == pytest.approx(g_sq, rel=1e-5)
        assert abs(got["noise_scale/trace_sigma"]) <= 1e-5 * g_sq


_LENS = [9, 2, 8, 3, 9, 2, 8, 3]  # label tokens per sequence of 10 (the rest: -100)


def _tiny_gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=17, n_positions=12,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


class _Sentences(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(_LENS)

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 17, (10,), generator=torch.Generator().manual_seed(i))
        labels = ids.clone()
        labels[_LENS[i] :] = -100
        return {"input_ids": ids, "labels": labels}


def _hf_gpt2(rank: int, out_dir: str) -> None:
    """One rank of a 2-process HF Trainer step of a tiny GPT-2 on padded sequences."""
    from nnstat.integrations.huggingface import NNStatCallback

    model, seen = _tiny_gpt2(), []
    model.register_forward_pre_hook(
        lambda m, a, kw: seen.append([kw["input_ids"].tolist(), kw["labels"].tolist()]),
        with_kwargs=True,
    )
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_window=10)
    trainer, logs = _train_on_gloo(
        model, _Sentences(), cb, out_dir, per_device_train_batch_size=2, max_steps=1,
        learning_rate=0.0, max_grad_norm=0.0,
    )  # fmt: skip
    with open(os.path.join(out_dir, f"gpt{rank}.json"), "w") as f:
        json.dump({"logs": logs, "seen": seen}, f)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_hf_trainer_ddp_gpt2_matches_the_estimator_from_each_ranks_gradient(tmp_path):
    """A causal LM under ``average_tokens_across_devices``: the callback's values are those of
    the estimator computed by hand from each rank's gradient (its shifted label tokens' summed
    loss over the Trainer's global count, times the world size), the ranks weighed by their
    token counts ``n_r``: the local norm over ``mean(n^2)/mean(n)^2``, ``B_small =
    mean(n^2)/mean(n)``, ``B_big = R mean(n)`` tokens."""
    pytest.importorskip("transformers")
    spawn_launched(_hf_gpt2, str(tmp_path), world=WORLD)
    runs = [json.loads((tmp_path / f"gpt{r}.json").read_text()) for r in range(WORLD)]
    model = _tiny_gpt2().double()
    batches = [[torch.tensor(t) for t in run["seen"][0]] for run in runs]
    n = [float(labels[:, 1:].ne(-100).sum()) for _, labels in batches]  # what the loss sums
    divisor = sum(float(labels.ne(-100).sum()) for _, labels in batches)  # the Trainer's count
    local = []
    for ids, labels in batches:
        model.zero_grad()
        logits = model(input_ids=ids).logits[:, :-1].reshape(-1, 17)
        summed = nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="sum")
        (summed * WORLD / divisor).backward()
        local.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    mean_n, mean_n2 = sum(n) / WORLD, sum(k * k for k in n) / WORLD
    small = float(sum(g @ g for g in local)) / WORLD / (mean_n2 / mean_n**2)
    big = float((sum(local) / WORLD).pow(2).sum())
    ref = nnstat.NoiseScale(window=10)
    ref.update(small, big, mean_n2 / mean_n, WORLD * mean_n)
    assert n[0] != n[1]  # the ranks' token counts differ
    for run in runs:
        got = run["logs"][0]
        assert got["noise_scale/grad_sq_norm"] == pytest.approx(ref.grad_sq_norm, rel=1e-4)
        assert got["noise_scale/trace_sigma"] == pytest.approx(ref.trace_sigma, rel=1e-4)
