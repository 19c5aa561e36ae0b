"""The training callbacks read nothing back inside a step and log every measured step, exactly,
at its own step.

The accelerator path runs on CPU tensors: `tracker._on_cpu` is patched and `LocalCopy.ready`
stands in for the CUDA event of a copy (False: still on its way; a `LocalCopy.wait` on such a
copy is what would be a host synchronisation on a GPU, counted by `_Waits`). HuggingFace reads
its loss back before it logs (`tr_loss.item()` in `_maybe_log_save_evaluate`), which on a GPU
waits for everything queued before it: `_hf_reads_its_loss` makes the copies arrive there.
References: l2 norms computed with torch from the weights and gradients around each step, and a
plain `nnstat.Tracker` on the same training (the synchronous accelerator path). On the ``meta``
device the callback's hooks are counted op by op (`DeviceLedger`).
"""

from __future__ import annotations

import collections
import math
import types
import warnings

import pytest
import torch
from _ledger import DeviceLedger, Kernels
from nnstat.integrations._hooks import StatsOptions, StepStats
from torch import nn

import nnstat
from nnstat.background.transfer import LocalCopy
from nnstat.tracker import tracker as tracker_module


class _Waits:
    """`LocalCopy.wait` calls on copies not yet arrived (on a GPU: the host waits for the
    device), with the phase of training they happened in."""

    def __init__(self, monkeypatch) -> None:
        self.phase, self.seen = "training", []
        real = LocalCopy.wait

        def wait(copy):
            if not copy.done():
                self.seen.append(self.phase)
            return real(copy)

        monkeypatch.setattr(LocalCopy, "wait", wait)


@pytest.fixture
def deferred(monkeypatch):
    """CPU tensors take the accelerator path; copies arrive only when a test says so."""
    monkeypatch.setattr(tracker_module, "_on_cpu", lambda params: False)
    monkeypatch.setattr(LocalCopy, "ready", False)
    return _Waits(monkeypatch)


def _norms(model: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, float]:
    """l2 of every weight, gradient and update, straight from the tensors (float64)."""
    out = {}
    for n, p in model.named_parameters():
        w = p.detach().double()
        out[f"weight/{n}/l2"] = torch.linalg.vector_norm(w).item()
        out[f"grad/{n}/l2"] = torch.linalg.vector_norm(p.grad.double()).item()
        out[f"update/{n}/l2"] = torch.linalg.vector_norm(w - before[n].double()).item()
    return out


def _check(logged: dict, direct: dict, plain: dict) -> None:
    # the Tracker's keys (the framework's own have no "/"; the noise scale is checked apart)
    ours = {k: v for k, v in logged.items() if "/" in k and not k.startswith("noise_scale/")}
    assert ours == plain  # the plain Tracker's numbers, exactly
    for key, value in direct.items():
        assert ours[key] == pytest.approx(value, rel=1e-6), key


# ------------------------------------------------------------------ meta device: op counts
def _drive_hf_hooks(cb, model, opt, steps: int, logging_steps: int):
    """The HF Trainer's event sequence for `steps` optimizer steps, each hook run under an op
    counter and a device ledger; returns ``{(logging?, hook): [(kernels, ledger counts)]}``."""
    args = types.SimpleNamespace(
        logging_strategy="steps", logging_steps=logging_steps, logging_first_step=False
    )
    state = types.SimpleNamespace(global_step=0, logging_steps=logging_steps, log_history=[])
    control = types.SimpleNamespace(should_log=False)
    seen = collections.defaultdict(list)

    def hook(logging, name, **kw):
        kernels, ledger = Kernels(), DeviceLedger()
        with ledger, kernels:
            getattr(cb, name)(args, state, control, model=model, optimizer=opt, **kw)
        seen[(logging, name)].append((dict(kernels.ops), ledger.counts()))

    for _ in range(steps):
        logging = (state.global_step + 1) % logging_steps == 0
        control.should_log = False
        hook(logging, "on_step_begin")
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        hook(logging, "on_pre_optimizer_step")
        opt.step()
        hook(logging, "on_optimizer_step")
        opt.zero_grad(set_to_none=True)
        state.global_step += 1
        hook(logging, "on_step_end")
        if control.should_log:
            logs = {"loss": 1.0}
            state.log_history.append({**logs, "step": state.global_step})
            hook(logging, "on_log", logs=logs)
    hook(False, "on_train_end")
    return seen


def test_hf_hooks_on_meta_launch_nothing_off_logging_steps_and_read_nothing_on_them():
    from nnstat.integrations.huggingface import NNStatCallback

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float64), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cb = NNStatCallback(noise_scale=False)
    cb._placed = True  # no Trainer handler to find
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # meta models deliver nothing (warned once)
        seen = _drive_hf_hooks(cb, model, opt, steps=9, logging_steps=3)
    nothing = ({}, (0, 0, 0, 0))
    for (logging, name), calls in seen.items():
        if not logging:  # not one kernel, not one read
            assert calls == [nothing] * len(calls), name
        # no read, no copy to or from the host, no data-dependent op: ever
        assert all(counts == (0, 0, 0, 0) for _, counts in calls[1:]), name
    assert len(seen[(True, "on_log")]) == 3
    # the update snapshot: one multi-tensor copy per dtype (two here), not one per tensor
    snap = [ops for ops, _ in seen[(True, "on_pre_optimizer_step")][1:]]
    assert snap == [{"aten::_foreach_copy_": 2}] * 2
    assert all(ops == {} for ops, _ in seen[(True, "on_log")])  # reading happens on the host


# ------------------------------------------------------------------ the shared driver
def _train(model, opt, i):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


def test_step_stats_keeps_every_step_until_collected_and_close_delivers_the_rest(deferred):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    hooks = StepStats(StatsOptions(noise_scale=False, stats=["l2"]))
    plain = nnstat.Tracker(model, opt, stats=["l2"], background=False)
    direct, ref = {}, {}
    for step in range(1, 8):
        log = step % 3 != 1  # steps 2, 3, 5, 6: two in a row too
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        _train(model, opt, step)
        hooks.before_step(model, opt, log)
        opt.step()
        hooks.after_step(step)
        ref[step] = dict(plain.step(step))
        if log:
            direct[step] = _norms(model, before)
        opt.zero_grad(set_to_none=True)
        assert hooks.collect() == []  # nothing has arrived: nothing handed over, nothing waited
    assert deferred.seen == []
    hooks.close()
    got = hooks.collect()
    assert [s for s, _ in got] == [2, 3, 5, 6]
    for step, metrics in got:
        _check(metrics, direct[step], ref[step])
    plain.close()
    assert not opt._optimizer_step_post_hooks  # the run's Tracker is closed too


# ------------------------------------------------------------------ HuggingFace
def _hf_reads_its_loss(monkeypatch, transformers):
    """A logging step's ``tr_loss.item()`` waits for the device: every copy queued so far has
    arrived when the Trainer calls ``on_log``; a new step starts with nothing arrived."""
    real = transformers.Trainer._maybe_log_save_evaluate

    def logging(self, *args, **kwargs):
        if self.control.should_log:
            LocalCopy.ready = True
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "_maybe_log_save_evaluate", logging)


@pytest.mark.parametrize("every", [None, 3], ids=["logging_steps", "every3"])
def test_hf_callback_logs_each_step_at_its_own_step_without_waiting(
    tmp_path, deferred, monkeypatch, every
):
    transformers = pytest.importorskip("transformers")
    from nnstat.integrations.huggingface import NNStatCallback
    from test_huggingface import Tokens, _args, _model

    _hf_reads_its_loss(monkeypatch, transformers)
    measured = [2, 4, 6] if every is None else [3, 6]

    class Reference(transformers.TrainerCallback):
        """Weights around each measured step, and a plain Tracker stepped every step."""

        def __init__(self) -> None:
            self.direct, self.plain, self.tracker, self.before = {}, {}, None, {}

        def on_step_begin(self, args, state, control, **kw):
            LocalCopy.ready = False  # this step's copies are on their way

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if self.tracker is None:
                self.tracker = nnstat.Tracker(model, optimizer, stats=["l2"], background=False)
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            step = state.global_step + 1
            metrics = dict(self.tracker.step(step))
            if step in measured:
                self.direct[step], self.plain[step] = _norms(model, self.before), metrics

    ref = Reference()
    cb = NNStatCallback(stats=["l2"], every=every, noise_scale_every=1)
    args = _args(tmp_path, max_steps=6, logging_steps=2, per_device_train_batch_size=4)
    trainer = transformers.Trainer(
        model=_model(), args=args, train_dataset=Tokens(24, 0), callbacks=[ref, cb]
    )
    trainer.train()
    assert deferred.seen == []  # not one wait for the device in the whole run
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # every=3 off logging_steps=2: the Trainer is asked to log steps 3 and 6 too
    assert [h["step"] for h in logs] == ([2, 4, 6] if every is None else [2, 3, 4, 6])
    stats = {h["step"]: h for h in logs if any(k.startswith("weight/") for k in h)}
    assert sorted(stats) == measured
    for step in measured:
        _check(stats[step], ref.direct[step], ref.plain[step])
        assert math.isfinite(
            stats[step]["noise_scale/grad_sq_norm"]
        )  # measured (checked in Lightning)
    assert cb.hooks._tracker is None and cb.hooks.gns is None  # closed at the end


def test_hf_callback_waits_at_on_log_only_when_nothing_read_the_device(tmp_path, deferred):
    """Without the Trainer's own read (copies never arrive by themselves here) the statistics
    of a logging step are still logged at that step: the wait happens at ``on_log``, once per
    logging step, never inside the optimizer-step hooks."""
    transformers = pytest.importorskip("transformers")
    from nnstat.integrations.huggingface import NNStatCallback
    from test_huggingface import Tokens, _args, _model

    class Phase(transformers.TrainerCallback):
        def on_log(self, args, state, control, **kw):
            deferred.phase = "on_log"

        def on_step_begin(self, args, state, control, **kw):
            deferred.phase = "training"

    cb = NNStatCallback(stats=["l2"], noise_scale=False)
    args = _args(tmp_path, max_steps=4, logging_steps=2, per_device_train_batch_size=4)
    trainer = transformers.Trainer(
        model=_model(), args=args, train_dataset=Tokens(16, 0), callbacks=[Phase(), cb]
    )
    phase = next(c for c in trainer.callback_handler.callbacks if isinstance(c, Phase))
    cb.place(trainer.callback_handler)
    trainer.callback_handler.callbacks.remove(phase)
    trainer.callback_handler.callbacks.insert(0, phase)  # before cb: its on_log runs first
    trainer.train()
    assert deferred.seen == ["on_log", "on_log"]
    logged = [
        h["step"] for h in trainer.state.log_history if "weight/transformer.wte.weight/l2" in h
    ]
    assert logged == [2, 4]


# ------------------------------------------------------------------ Lightning
@pytest.mark.parametrize("arrive", [False, True], ids=["held-back", "arrived-next-hook"])
def test_lightning_callback_logs_later_at_the_exact_step(tmp_path, deferred, monkeypatch, arrive):
    pytest.importorskip("lightning")
    from nnstat.integrations.lightning import NNStatCallback
    from test_lightning import Tiny, _data, _Reference, _trainer

    monkeypatch.setattr(LocalCopy, "ready", arrive)

    class Spy(_Reference):
        """torch.func noise scale (the parent), weights around each step, a plain Tracker,
        and when each logger call came."""

        def __init__(self) -> None:
            super().__init__(step=0)
            self.direct, self.plain, self.tracker, self.w0 = {}, {}, None, {}
            self.calls: list[tuple[int, int]] = []  # (step logged, global_step at the call)

        def on_before_optimizer_step(self, trainer, module, optimizer):
            if self.tracker is None:
                self.tracker = nnstat.Tracker(module, optimizer, stats=["l2"], background=False)
            self.w0 = {n: p.detach().clone() for n, p in module.named_parameters()}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            step = trainer.global_step
            self.plain[step] = dict(self.tracker.step(step))
            self.direct[step] = _norms(module, self.w0)

        def on_train_end(self, trainer, module):
            deferred.phase = "end"  # runs before nnstat's on_train_end

    spy = Spy()

    from lightning.pytorch.loggers import CSVLogger

    class Recording(CSVLogger):
        def log_metrics(self, metrics, step=None):
            if any(k.startswith("weight/") for k in metrics):
                spy.calls.append((step, trainer.global_step))
            super().log_metrics(metrics, step)

    cb = NNStatCallback(stats=["l2"])
    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    logger = Recording(str(tmp_path), name="csv")
    trainer = _trainer(tmp_path, [spy, cb], max_steps=6, log_every_n_steps=2, logger=logger)
    trainer.fit(Tiny(), loader)
    # held back: the only waits are the end-of-fit flush (statistics and noise-scale copies)
    assert bool(deferred.seen) != arrive and set(deferred.seen) <= {"end"}
    assert [h["step"] for h in cb.history] == [2, 4, 6]
    # logged one batch later once arrived, else all at the end of fit: at their own step
    assert spy.calls == ([(2, 2), (4, 4), (6, 6)] if arrive else [(2, 6), (4, 6), (6, 6)])
    for h in cb.history:
        step = h["step"]
        _check(h, spy.direct[step], spy.plain[step])
        # the noise scale as of that step, not as of the delivery
        assert h["noise_scale/b_simple"] == pytest.approx(spy.values[step], rel=1e-4)
