"""Lightning integration on a tiny LightningModule (CPU): statistics through the loggers, the
noise scale against torch.func per-sample gradients, influence against the plain API."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from nnstat.integrations.lightning import (  # noqa: E402
    NNStatCallback,
    extract_log,
    influence,
    self_influence,
)

import nnstat  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _data(n: int = 48, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


def _trainer(tmp_path, callbacks, **kw):
    base = dict(accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=str(tmp_path))  # fmt: skip
    return L.Trainer(callbacks=callbacks, **{**base, **kw})


def _per_sample_grads(module, x, y):
    params = {k: v.detach() for k, v in module.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(module, p, (xi[None],))
        return nn.functional.cross_entropy(out, yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


class _Reference(L.Callback):
    """Independent noise scale (torch.func per-sample gradients fed to a NoiseScale) and the
    weights around one step."""

    def __init__(self, step: int) -> None:
        self.gns = nnstat.NoiseScale(beta=0.9)
        self.values: dict[int, float] = {}
        self.step, self.before, self.after = step, {}, {}
        self.first = True

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            self.before = {k: v.detach().clone() for k, v in module.named_parameters()}
        if self.first:  # nnstat's first batch only probes which modules to watch
            self.first = False
            return
        g = _per_sample_grads(module, *batch)
        small, big = {}, {}
        for mod in ("net.0", "net.2"):
            keys = [k for k in g if k.startswith(mod + ".")]
            small[mod] = float(sum(g[k].pow(2).flatten(1).sum(1) for k in keys).mean())
            big[mod] = float(sum(g[k].mean(0).pow(2).sum() for k in keys))
        self.gns.update(small, big, 1, len(batch[0]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values[trainer.global_step] = self.gns.value
        if trainer.global_step == self.step:
            self.after = {k: v.detach().clone() for k, v in module.named_parameters()}


def test_callback_logs_through_the_loggers_and_matches_references(tmp_path):
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    module = Tiny()
    cb, ref = NNStatCallback(stats=["l2", "rms"]), _Reference(step=4)
    logger = CSVLogger(str(tmp_path), name="csv")
    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    trainer = _trainer(
        tmp_path,
        [ref, cb],  # ref's torch.func pass outside nnstat's capture
        max_steps=6,
        log_every_n_steps=2,
        logger=logger,
    )
    trainer.fit(module, loader)
    assert [h["step"] for h in cb.history] == [2, 4, 6]
    at4 = cb.history[1]
    w0, w1 = ref.before["net.0.weight"], ref.after["net.0.weight"]
    assert at4["trust_ratio/net.0.weight"] == pytest.approx(
        float(w1.norm() / (w1 - w0).norm()), 1e-5
    )
    assert at4["exp_avg/net.2.bias/l2"] > 0
    for h in cb.history:
        assert h["noise_scale/b_simple"] == pytest.approx(ref.values[h["step"]], rel=1e-4)
    frame = pd.read_csv(next((tmp_path / "csv").rglob("metrics.csv")))
    logged = frame.dropna(subset=["trust_ratio/net.0.weight"])
    assert logged["step"].tolist() == [2, 4, 6]
    assert logged["trust_ratio/net.0.weight"].iloc[1] == pytest.approx(
        at4["trust_ratio/net.0.weight"], rel=1e-6
    )
    assert all(not m._forward_hooks and not m._backward_hooks for m in module.modules())


def test_influence_helpers_equal_exact_dot_products_and_the_plain_api(tmp_path):
    module, train, query = Tiny(), _data(24, 0), _data(4, 1)
    train_loader = torch.utils.data.DataLoader(train, batch_size=8)
    query_loader = torch.utils.data.DataLoader(query, batch_size=4)

    # full per-sample gradients, identity metric: exactly g_q . g_i
    run = extract_log(None, module, train_loader, project="full", root_dir=str(tmp_path),
                      rank=None, config="none", progress=False)  # fmt: skip
    res = influence(None, module, query_loader, run, preconditioner="identity", progress=False)
    gt, gq = _per_sample_grads(module, *train.tensors), _per_sample_grads(module, *query.tensors)
    flat = lambda g: torch.cat(  # noqa: E731 - module order, weight then bias
        [torch.cat([g[f"{m}.weight"].flatten(1), g[f"{m}.bias"]], 1) for m in ("net.0", "net.2")], 1
    )  # fmt: skip
    torch.testing.assert_close(res.scores, flat(gq) @ flat(gt).T, rtol=1e-4, atol=1e-6)
    assert res.train_ids == list(range(24)) and res.test_ids == list(range(4))

    # projected + EK-FAC: the same as the plain API on the same model and data
    run = extract_log(None, module, train_loader, project="ek", root_dir=str(tmp_path), rank=3,
                      progress=False)  # fmt: skip
    res = influence(None, module, query_loader, run, progress=False)
    self_res = self_influence(None, module, run, query_loader, progress=False)
    assert module.training and all(p.grad is None for p in module.parameters())  # restored
    plain = nnstat.init(project="plain", root_dir=str(tmp_path))
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac", "loss_reduction": "mean"})
    nnstat.watch(module)
    nnstat.add_projection(rank=3, init="random", seed=0)
    x, y = train.tensors
    for _ in plain.schedule():
        for s in range(0, 24, 8):
            with plain(data_id=list(range(s, s + 8))):
                nn.functional.cross_entropy(module(x[s : s + 8]), y[s : s + 8]).backward()
            module.zero_grad()
    nnstat.eval()
    with plain(data_id=list(range(4))):
        nn.functional.cross_entropy(module(query.tensors[0]), query.tensors[1]).backward()
    log = nnstat.get_log()
    ref = nnstat.influence.compute_influence_all(log, plain.path, progress=False)
    assert res.meta["preconditioner"] == "ekfac"
    torch.testing.assert_close(res.scores, ref.scores, rtol=1e-4, atol=1e-6)
    ref_self = nnstat.influence.compute_self_influence(log, plain.path, progress=False)
    torch.testing.assert_close(self_res.scores, ref_self.scores, rtol=1e-4, atol=1e-6)

    # refinement through training_step (autograd double backward, engine query gradients) = the
    # plain Refinement on (inputs, targets) tensors (torch.func products, vmap query gradients)
    refined = influence(None, module, query_loader, run, refine=3, train_dataloader=train_loader,
                        progress=False)  # fmt: skip
    plain_refine = nnstat.influence.Refinement(
        module, nn.functional.cross_entropy, train.tensors, query_data=query.tensors, steps=3,
        curvature="ggn", progress=False,
    )  # fmt: skip
    ref_refined = nnstat.influence.compute_influence_all(log, plain.path, refine=plain_refine)
    torch.testing.assert_close(refined.scores, ref_refined.scores, rtol=1e-3, atol=1e-6)
    assert refined.meta["refine"]["passes"] == 3  # the damping's trace rides along pass 1
    self_refined = self_influence(None, module, run, refine=2, train_dataloader=train_loader,
                                  progress=False)  # fmt: skip
    assert self_refined.scores.shape == (24,) and self_refined.meta["refine"]["steps"] == 2
    with pytest.raises(ValueError, match="train_dataloader"):
        influence(None, module, query_loader, run, refine=3, progress=False)
    assert module.training and all(p.grad is None for p in module.parameters())


class SkipsABatch(Tiny):
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 2 else super().training_step(batch, batch_idx)


def test_callback_survives_a_skipped_batch(tmp_path):
    # Lightning calls on_before_optimizer_step without a backward when training_step
    # returns None: the open capture block is discarded, not measured
    cb = NNStatCallback(every=1)
    loader = torch.utils.data.DataLoader(_data(48), batch_size=8)
    _trainer(tmp_path, [cb], max_epochs=1, logger=False).fit(SkipsABatch(), loader)
    assert [h["step"] for h in cb.history] == [1, 2, 3, 4, 5, 6]
    assert sum("noise_scale/b_simple" in h for h in cb.history) == 5  # the first batch probes
    assert cb.hooks.gns is None and cb.hooks._gns_ctx is None


def test_influence_helpers_reject_bad_input(tmp_path):
    module = Tiny()
    shuffled = torch.utils.data.DataLoader(_data(16), batch_size=8, shuffle=True)
    with pytest.raises(ValueError, match="shuffles"):
        extract_log(None, module, shuffled, root_dir=str(tmp_path))
    empty = torch.utils.data.DataLoader(_data(0), batch_size=8)
    with pytest.raises(ValueError, match="empty"):
        extract_log(None, module, empty, root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader(_data(16), batch_size=8)
    with pytest.raises(TypeError, match="loss"):
        extract_log(None, module, loader, root_dir=str(tmp_path), loss_fn=lambda b, i: None)
    with pytest.raises(ValueError, match="loss_reduction"):
        extract_log(None, module, loader, config={"loss_reduction": "sum"})


def test_callback_noise_scale_every_defaults_to_every_micro_batch():
    assert NNStatCallback().options.noise_scale_every == 1
    assert NNStatCallback(noise_scale_every=None).options.noise_scale_every == 1
    assert NNStatCallback(noise_scale_every=4).options.noise_scale_every == 4
    with pytest.raises(ValueError, match="noise_scale_every"):
        NNStatCallback(noise_scale_every=0)


def test_step_stats_noise_scale_every():
    from nnstat.integrations._hooks import StatsOptions, StepStats

    with pytest.raises(ValueError, match="noise_scale_every"):
        StatsOptions(noise_scale_every=0)
    module = Tiny()
    hooks = StepStats(StatsOptions(noise_scale_every=2))
    x, y = _data(40).tensors
    for s in range(0, 40, 8):  # 5 micro-batches: one probe, then every second one measured
        hooks.begin_batch(module)
        nn.functional.cross_entropy(module(x[s : s + 8]), y[s : s + 8]).backward()
        hooks.end_backward()
        module.zero_grad()
    assert hooks.gns.n_updates == 2
    hooks.close()
    assert all(not m._forward_hooks and not m._backward_hooks for m in module.modules())


def test_noise_scale_is_read_before_lightnings_gradient_clipping(tmp_path):
    # Lightning clips after on_before_optimizer_step; the capture closes at on_after_backward,
    # before it, so a clip that scales every gradient leaves the estimate as without clipping
    cb, ref = NNStatCallback(stats=["l2"], groups=["weight"], every=1), _Reference(step=2)
    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    trainer = _trainer(tmp_path, [ref, cb], max_steps=5, gradient_clip_val=1e-4, logger=False)
    trainer.fit(Tiny(), loader)
    history = [h for h in cb.history if "noise_scale/b_simple" in h]
    assert [h["step"] for h in history] == [2, 3, 4, 5]
    for h in history:
        assert h["noise_scale/b_simple"] == pytest.approx(ref.values[h["step"]], rel=1e-4)


class _MicroReference(L.Callback):
    """B_simple of each optimizer step from its micro-batches' mean gradients (torch.func, at
    the weights they were taken at) and the two-batch formula."""

    def __init__(self) -> None:
        self.means: list[torch.Tensor] = []
        self.values: dict[int, float] = {}
        self.b = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        g = _per_sample_grads(module, *batch)
        self.means.append(torch.cat([v.double().mean(0).flatten() for v in g.values()]))
        self.b = len(batch[0])

    def on_before_optimizer_step(self, trainer, module, optimizer):
        from nnstat.gradient_noise.maths import two_batch

        g, self.means = torch.stack(self.means), []
        small, big = float(g.pow(2).sum(1).mean()), float(g.mean(0).pow(2).sum())
        g_sq, trace = two_batch(small, big, self.b, self.b * len(g))
        self.values[trainer.global_step + 1] = trace / g_sq


def test_gradient_accumulation_defaults_to_the_micro_batch_estimator(tmp_path):
    cb = NNStatCallback(stats=["l2"], groups=["weight"], every=1, noise_scale_beta=0.0)
    ref = _MicroReference()
    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    trainer = _trainer(
        tmp_path, [ref, cb], max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1e-4,
        logger=False,
    )  # fmt: skip
    trainer.fit(Tiny(), loader)
    assert cb.hooks.method == "micro_batch"
    history = [h for h in cb.history if "noise_scale/b_simple" in h]
    assert [h["step"] for h in history] == [1, 2, 3]  # no probing batch
    for h in history:
        assert h["noise_scale/b_simple"] == pytest.approx(ref.values[h["step"]], rel=1e-4)
    assert {"noise_scale/net.0/b_simple", "noise_scale/net.2/b_simple"} <= set(history[0])


class _ScaledFloat32(MixedPrecision):
    """Lightning's 16-bit AMP plugin with a real GradScaler (the loss scaled for backward,
    ``.grad`` unscaled before ``on_before_optimizer_step``, an overflowed step skipped), its
    forward left in float32 so that the float32 reference holds to 1e-4."""

    def autocast_context_manager(self):
        return contextlib.nullcontext()


class _OverflowAt(Tiny):
    """``Tiny`` whose loss is infinite on one batch (as a float16 overflow)."""

    def __init__(self, batch_idx: int) -> None:
        super().__init__()
        self.overflow = batch_idx

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.inf if batch_idx == self.overflow else loss


def test_micro_batches_under_a_grad_scaler_match_and_skipped_steps_are_left_out(tmp_path):
    """Every micro-batch is measured scaled, in its backward; the step's ``.grad`` must be read
    before Lightning unscales it (else ``b_simple`` is inf on every step). The step the
    scaler skips (an overflow in its first micro-batch) is left out with a warning: the
    logged value then stays the previous step's (beta = 0: the last observation)."""
    cb = NNStatCallback(stats=["l2"], groups=["weight"], every=1, noise_scale_beta=0.0)
    ref, kept = _MicroReference(), []
    keep = L.Callback()  # the noise scale as of the last batch (close() drops it)
    keep.on_train_batch_end = lambda trainer, module, *args: kept.append(cb.hooks.gns)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    trainer = _trainer(
        tmp_path, [ref, cb, keep], max_steps=3, accumulate_grad_batches=2, logger=False,
        plugins=[_ScaledFloat32("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="non-finite gradients"):
        trainer.fit(_OverflowAt(batch_idx=2), loader)  # step 2's first micro-batch
    assert scaler.get_scale() == 2.0**9  # the scaler found the overflow and skipped step 2
    assert cb.hooks.method == "micro_batch"
    history = [h for h in cb.history if "noise_scale/b_simple" in h]
    assert [h["step"] for h in history] == [1, 2, 3]
    expected = [ref.values[1], ref.values[1], ref.values[3]]
    for h, value in zip(history, expected, strict=True):
        assert math.isfinite(value) and h["noise_scale/b_simple"] == pytest.approx(value, rel=1e-4)
    assert kept[-1].n_updates == 2
    assert "unscale_" not in vars(scaler)  # the scaler is left as it was


def test_a_smaller_last_micro_batch_is_measured_at_its_own_size(tmp_path):
    """20 points in batches of 8, 8 and 4, three per optimizer step: the step's observation
    takes each micro-batch's size (the harmonic mean ``H`` and ``3H`` as its batch sizes, the
    sizes at which the two-batch estimates stay unbiased), not one size for all three."""
    from nnstat.gradient_noise.maths import two_batch

    class Sized(_MicroReference):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            super().on_train_batch_start(trainer, module, batch, batch_idx)
            self.sizes.append(len(batch[0]))

        def on_before_optimizer_step(self, trainer, module, optimizer):
            g, self.means = torch.stack(self.means), []
            sizes, self.sizes = self.sizes, []
            h = len(sizes) / sum(1 / b for b in sizes)
            small, big = float(g.pow(2).sum(1).mean()), float(g.mean(0).pow(2).sum())
            g_sq, trace = two_batch(small, big, h, h * len(sizes))
            self.values[trainer.global_step + 1] = trace / g_sq

    cb = NNStatCallback(stats=["l2"], groups=["weight"], every=1, noise_scale_beta=0.0)
    ref = Sized()
    ref.sizes = []
    loader = torch.utils.data.DataLoader(_data(20), batch_size=8, shuffle=False)
    trainer = _trainer(tmp_path, [ref, cb], max_epochs=2, accumulate_grad_batches=3, logger=False)
    trainer.fit(Tiny(), loader)
    assert cb.hooks.method == "micro_batch"
    history = [h for h in cb.history if "noise_scale/b_simple" in h]
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["noise_scale/b_simple"] == pytest.approx(ref.values[h["step"]], rel=1e-4)


def test_the_shorter_last_accumulation_step_of_an_epoch_is_measured_at_its_scale(tmp_path):
    """Lightning divides every micro-batch's loss by ``accumulate_grad_batches`` (3), also in
    an epoch's last step of 2 micro-batches (20 points in batches of 4), so that step's
    ``.grad`` is 2/3 of the mean gradient: its ``grad_sq_norm`` and ``trace_sigma`` equal the
    per-sample reference's, as the full steps' do (not 4/9 of them)."""
    from nnstat.gradient_noise.maths import two_batch

    class Scaled(_MicroReference):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            g = torch.stack(self.means)
            grad = torch.cat([p.grad.double().flatten() for p in module.parameters()])
            self.scale = float(grad.norm() / g.mean(0).norm())  # what Lightning's .grad holds
            small, big = float(g.pow(2).sum(1).mean()), float(g.mean(0).pow(2).sum())
            self.pairs[trainer.global_step + 1] = two_batch(small, big, self.b, self.b * len(g))
            self.scales[trainer.global_step + 1] = (len(g), self.scale)
            super().on_before_optimizer_step(trainer, module, optimizer)

    cb = NNStatCallback(stats=["l2"], groups=["weight"], every=1, noise_scale_beta=0.0)
    ref = Scaled()
    ref.pairs, ref.scales = {}, {}
    loader = torch.utils.data.DataLoader(_data(20), batch_size=4, shuffle=False)
    trainer = _trainer(tmp_path, [ref, cb], max_epochs=2, accumulate_grad_batches=3, logger=False)
    trainer.fit(Tiny(), loader)
    # the installed Lightning's scaling, which the correction assumes
    assert ref.scales[2][0] == 2 and ref.scales[2][1] == pytest.approx(2 / 3, rel=1e-5)
    assert ref.scales[1] == (3, pytest.approx(1.0, rel=1e-5))
    history = [h for h in cb.history if "noise_scale/b_simple" in h]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for h in history:
        g_sq, trace = ref.pairs[h["step"]]
        assert h["noise_scale/grad_sq_norm"] == pytest.approx(g_sq, rel=1e-4)
        assert h["noise_scale/trace_sigma"] == pytest.approx(trace, rel=1e-4)
        assert h["noise_scale/b_simple"] == pytest.approx(ref.values[h["step"]], rel=1e-4)


class _TwoOptimizers(Tiny):
    """Manual optimization with two optimizers (as a GAN's generator and discriminator): SGD
    with momentum on the first layer, Adam on the second, both stepped in every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(self.net[2].parameters(), lr=0.01),
        ]


def test_manual_optimization_with_two_optimizers_logs_each_batchs_whole_update(tmp_path):
    """Each optimizer's step is one Lightning step; the batch's update is every optimizer's
    (a snapshot before the second optimizer made the first one's parameters look unchanged:
    update 0, trust ratio inf), and both optimizers' states are logged."""
    weights: dict[int, dict[str, torch.Tensor]] = {}

    class Weights(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            weights[batch_idx] = {k: v.detach().clone() for k, v in module.named_parameters()}

    cb = NNStatCallback(stats=["l2"], every=1, noise_scale=False)
    module = _TwoOptimizers()
    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    trainer = _trainer(tmp_path, [Weights(), cb], max_steps=6, logger=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Tracker: the optimizer does not hold")
        trainer.fit(module, loader)
    assert [h["step"] for h in cb.history] == [2, 4, 6]  # two optimizer steps per batch
    last = cb.history[-1]
    after = dict(module.named_parameters())
    sgd, adam = trainer.optimizers
    for name, before in weights[2].items():
        moved = float((after[name].detach() - before).double().norm())
        assert moved > 0 and last[f"update/{name}/l2"] == pytest.approx(moved, rel=1e-5)
    for name in ("net.0.weight", "net.0.bias"):
        buf = sgd.state[after[name]]["momentum_buffer"]
        assert last[f"momentum_buffer/{name}/l2"] == pytest.approx(float(buf.norm()), rel=1e-5)
    for name in ("net.2.weight", "net.2.bias"):
        avg = adam.state[after[name]]["exp_avg"]
        assert last[f"exp_avg/{name}/l2"] == pytest.approx(float(avg.norm()), rel=1e-5)
    assert not any(after[n] in sgd.state for n in ("net.2.weight", "net.2.bias"))


@pytest.mark.parametrize("accumulation", [1, 2])  # per-sample norms; micro-batches
def test_a_resumed_fit_continues_the_noise_scale_of_the_uninterrupted_fit(tmp_path, accumulation):
    """2 epochs, resumed from the first epoch's checkpoint: the noise scale logged in the
    second epoch equals the uninterrupted fit's (its state rides in the checkpoint as the
    callback's, JSON types only), where it used to start afresh."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(root, resume=None, max_epochs=2):
        cb = NNStatCallback(stats=["l2"], groups=["weight"], every=1)
        saver = ModelCheckpoint(dirpath=str(root), save_top_k=-1, every_n_epochs=1)
        loader = torch.utils.data.DataLoader(_data(32), batch_size=8, shuffle=False)
        trainer = _trainer(
            root, [cb, saver], max_epochs=max_epochs, accumulate_grad_batches=accumulation,
            logger=False, enable_checkpointing=True,
        )  # fmt: skip
        trainer.fit(Tiny(), loader, ckpt_path=resume)
        return {h["step"]: h for h in cb.history if "noise_scale/b_simple" in h}

    whole = fit(tmp_path / "a")
    first = sorted((tmp_path / "a").glob("epoch=0*.ckpt"))
    assert len(first) == 1
    state = torch.load(first[0], weights_only=True)["callbacks"]
    assert any("noise_scale" in v for v in state.values())
    resumed = fit(tmp_path / "b", resume=str(first[0]))
    per_epoch = 4 // accumulation
    assert sorted(resumed) == [per_epoch + s for s in range(1, per_epoch + 1)]
    keys = ["noise_scale/b_simple", "noise_scale/grad_sq_norm", "noise_scale/trace_sigma"]
    for step, h in resumed.items():
        for key in keys:
            assert h[key] == pytest.approx(whole[step][key], rel=1e-6), (step, key)
