"""HuggingFace Trainer integration on a tiny GPT-2 built from a config (no downloads): GPT-2's
Conv1D, embeddings and layer norms go through the capture engine for real."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nnstat.integrations.huggingface import (  # noqa: E402
    NNStatArguments,
    NNStatCallback,
    patch_trainer,
)

import nnstat  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
VOCAB, T = 40, 8


def _model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(1, VOCAB, (n, T), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i], "attention_mask": torch.ones(T).long()}


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=0)  # fmt: skip
    return transformers.TrainingArguments(**{**base, **kw})


class _Spy(transformers.TrainerCallback):
    """Independent reference: weights right before/after the optimizer step and the gradients."""

    def __init__(self, step: int) -> None:
        self.step, self.before, self.after, self.grads, self.logs = step, {}, {}, {}, []
        self.began = 0

    def on_train_begin(self, args, state, control, **kw):
        self.began += 1

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.step:
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.step:
            self.after = {n: p.detach().clone() for n, p in model.named_parameters()}
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


def test_callback_logs_statistics_on_logging_steps_through_report_to(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model = _model()
    spy = _Spy(step=4)
    args = _args(tmp_path, max_steps=4, logging_steps=2, per_device_train_batch_size=4,
                 report_to="tensorboard", learning_rate=1e-2)  # fmt: skip
    cb = NNStatCallback(stats=["l2", "rms"], noise_scale_every=1)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(16, 0), callbacks=[cb, spy]
    )
    trainer.train()
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in train_logs] == [2, 4]
    assert spy.began == 1  # re-placing the callback mid-event skipped or repeated no callback
    last = train_logs[-1]
    name = "transformer.h.0.attn.c_attn.weight"
    w0, w1 = spy.before[name], spy.after[name]
    assert last[f"trust_ratio/{name}"] == pytest.approx(
        float(w1.norm() / (w1 - w0).norm()), rel=1e-4
    )
    assert last[f"grad/{name}/l2"] == pytest.approx(float(spy.grads[name].norm()), rel=1e-4)
    assert last[f"update/{name}/rms"] == pytest.approx(
        float((w1 - w0).pow(2).mean().sqrt()), rel=1e-4
    )
    assert last[f"exp_avg/{name}/l2"] > 0
    assert "noise_scale/b_simple" in last and "noise_scale/grad_sq_norm" in last
    assert last["noise_scale/grad_sq_norm"] == last["noise_scale/grad_sq_norm"]  # measured
    # a user's callback sees nnstat's keys in the logs too (only the console printer does not)
    assert [any(k.startswith("trust_ratio/") for k in logs) for logs in spy.logs[:2]] == [True] * 2
    # the reporter (TensorBoard) received them at the Trainer's steps
    files = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0}).Reload()
    events = acc.Scalars(f"train/trust_ratio/{name}")  # HF prefixes training logs
    assert [e.step for e in events] == [2, 4]
    assert events[-1].value == pytest.approx(last[f"trust_ratio/{name}"], rel=1e-5)


def test_callback_every_and_noise_scale_excludes_undefined_modules(tmp_path):
    model = _model()
    cb, spy = NNStatCallback(stats=["l2"], groups=["weight"], every=3), _Spy(step=99)
    args = _args(tmp_path, max_steps=4, logging_steps=1, per_device_train_batch_size=4)
    transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(16, 0), callbacks=[cb, spy]
    ).train()
    assert spy.began == 1  # no reporter: nnstat moves to the end while the event is dispatched
    # the tied wte/lm_head weight (captured once, under lm_head) is left out of the noise
    # scale; the position embedding, fed [1, T] ids shared by the batch, is expanded and kept
    excluded = cb.hooks.excluded
    assert "lm_head" in excluded and "transformer.wte" not in excluded
    assert "transformer.wpe" not in excluded
    assert cb.hooks.gns is None  # closed at the end of training: hooks removed
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def test_default_noise_scale_cadence_is_one_micro_batch_in_eight(tmp_path, monkeypatch):
    """The default measures the per-sample noise scale on one micro-batch in
    `NOISE_SCALE_EVERY`, from the first one after the probe (the very first micro-batch only
    probes which modules qualify), so even a short run logs it from its first logging step."""
    from nnstat.integrations._hf_callback import NOISE_SCALE_EVERY

    from nnstat.gradient_noise import NoiseScale

    assert NNStatCallback().options.noise_scale_every == NOISE_SCALE_EVERY == 8
    seen: list[int] = []
    real = NoiseScale._add_captured

    def counting(self, names, small, big, n):
        seen.append(n)
        return real(self, names, small, big, n)

    monkeypatch.setattr(NoiseScale, "_add_captured", counting)
    cb = NNStatCallback(stats=["l2"], groups=["weight"])
    args = _args(tmp_path, max_steps=18, logging_steps=100, per_device_train_batch_size=4)
    transformers.Trainer(
        model=_model(), args=args, train_dataset=Tokens(72, 0), callbacks=[cb]
    ).train()
    assert seen == [4, 4, 4]  # micro-batches 1, 9 and 17 after the probe (steps 2, 10, 18)


def test_noise_scale_every_none_means_the_class_default_and_bad_values_are_refused():
    from nnstat.integrations._hf_callback import NOISE_SCALE_EVERY

    assert NNStatCallback.default_noise_scale_every == NOISE_SCALE_EVERY
    assert NNStatCallback(noise_scale_every=None).options.noise_scale_every == NOISE_SCALE_EVERY
    for k in (1, 3, 16):
        cb = NNStatCallback(noise_scale_every=k)
        # measured from the first micro-batch after the probe, then one in k
        assert (cb.options.noise_scale_every, cb.hooks._micro) == (k, k - 1)
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ValueError, match="noise_scale_every must be a positive int"):
            NNStatCallback(noise_scale_every=bad)


def _plain_api(model, tmp_path, names, train, query, rank, config):
    """The same analysis with nnstat's plain API and a hand-written summed token loss."""
    run = nnstat.init(project="plain", root_dir=str(tmp_path))
    nnstat.setup(config)
    run.watch(model, name_filter=[f"^{n}$" for n in names])
    run.add_projection(rank=rank, init="random", seed=0)
    model.eval()

    def loss_of(x):
        # the Trainer may have moved the model to a GPU: follow it
        x = x.to(next(model.parameters()).device)
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum"
        )

    for _ in run.schedule():
        for start in range(0, len(train), 8):
            x = train.x[start : start + 8]
            with run(data_id=list(range(start, start + len(x)))):
                loss_of(x).backward()
            model.zero_grad()
    run.eval()
    with run(data_id=list(range(len(query)))):
        loss_of(query.x).backward()
    model.zero_grad()
    log = run.get_log()
    return run, log


def test_patched_trainer_matches_the_plain_api(tmp_path):
    model = _model(1)
    train, query = Tokens(16, 0), Tokens(3, 1)
    nargs = NNStatArguments("hf", root_dir=str(tmp_path), rank=3, progress=False, track=False)
    NNStatTrainer = patch_trainer(transformers.Trainer)
    assert NNStatTrainer.__name__ == "NNStatTrainer"
    # the seed's spelling: NNStatArguments passed as the TrainingArguments
    trainer = NNStatTrainer(model=model, args=nargs, train_dataset=train)
    assert trainer.nnstat_args is nargs
    trainer.args.per_device_eval_batch_size = 8
    run = trainer.extract_log()
    names = list(run.engine.watched)
    assert "transformer.h.0.attn.c_attn" in names and "lm_head" in names  # tied to wte
    assert "transformer.wpe" in names and not run.engine.left_out  # [1, T] ids: expanded
    assert nnstat.GradientStore(run.path).ids == list(range(16))
    result = trainer.influence(query)
    self_train = trainer.self_influence()

    plain_run, log = _plain_api(
        model, tmp_path, names, train, query, rank=3,
        config={"log": "grad", "save": "grad", "statistic": "ekfac"},
    )  # fmt: skip
    ref = nnstat.influence.compute_influence_all(log, plain_run.path, progress=False)
    assert result.scores.shape == (3, 16) and result.train_ids == list(range(16))
    assert result.meta["preconditioner"] == "ekfac"
    torch.testing.assert_close(result.scores, ref.scores, rtol=1e-4, atol=1e-6)
    ref_self = nnstat.influence.compute_self_influence(plain_run.path, progress=False)
    torch.testing.assert_close(self_train.scores, ref_self.scores, rtol=1e-4, atol=1e-6)
    top = trainer.influence(query, top_k=2)
    assert top.helpful_ids[0] == [ref.train_ids[j] for j in ref.scores[0].topk(2).indices]
    assert model.training is False or model.training is True  # restored, not forced
    assert all(p.grad is None for p in model.parameters())

    # refinement on the trainer's own loss and data = the plain Refinement on a hand-written
    # loss: the trainer's per-sample loss is the sum over its predicted tokens
    refined = trainer.influence(query, refine=2)
    assert refined.meta["refine"]["passes"] == 2 and refined.meta["refine"]["steps"] == 2

    def sum_loss(b):
        b = {k: v.to(next(model.parameters()).device) for k, v in b.items()}
        return model(**b).loss * b["labels"][:, 1:].numel()

    def loader(ds):
        return torch.utils.data.DataLoader(ds, batch_size=8)

    model.eval()
    plain = nnstat.influence.Refinement(
        model, None, loader(train), query_data=loader(query), batch_loss=sum_loss,
        loss_reduction="sum", steps=2, curvature="ggn", progress=False,
    )  # fmt: skip
    ref_refined = nnstat.influence.compute_influence_all(log, plain_run.path, refine=plain)
    torch.testing.assert_close(refined.scores, ref_refined.scores, rtol=1e-3, atol=1e-6)
    assert not torch.allclose(refined.scores, result.scores, rtol=1e-2)
    zero = trainer.influence(query, refine=0)
    torch.testing.assert_close(zero.scores, result.scores, rtol=0, atol=0)
    self_refined = trainer.self_influence(refine=1)
    assert self_refined.scores.shape == (16,) and self_refined.meta["refine"]["steps"] == 1
    assert all(p.grad is None for p in model.parameters())


def test_patch_trainer_errors(tmp_path):
    with pytest.raises(TypeError, match="Trainer subclass"):
        patch_trainer(object)
    assert patch_trainer(transformers.Seq2SeqTrainer).__name__ == "NNStatSeq2SeqTrainer"
    with pytest.raises(ValueError, match="data_id"):
        NNStatArguments("p", data_id="row")
    NNStatTrainer = patch_trainer(transformers.Trainer)
    with pytest.raises(TypeError, match="nnstat_args"):
        NNStatTrainer(model=_model(), args=_args(tmp_path))
    trainer = NNStatTrainer(
        nnstat_args=NNStatArguments("p", root_dir=str(tmp_path), track=False),
        model=_model(),
        args=_args(tmp_path),
        train_dataset=Tokens(4, 0),
    )
    assert isinstance(trainer.args, transformers.TrainingArguments)
    assert trainer.nnstat_callback is None
    tracked = NNStatTrainer(
        nnstat_args=NNStatArguments("q", root_dir=str(tmp_path)),
        model=_model(),
        args=_args(tmp_path, report_to="tensorboard"),
    )
    order = [type(c).__name__ for c in tracked.callback_handler.callbacks]
    i = order.index("NNStatCallback")
    assert order[i + 1] == "TensorBoardCallback"
    j = order.index("PrinterCallback")
    assert order[j - 1 : j + 2] == ["_HideFromConsole", "PrinterCallback", "_HideFromConsole"]
    with pytest.raises(RuntimeError, match="extract_log"):
        trainer.influence(Tokens(2, 1))
    with pytest.raises(TypeError, match="valid"):
        trainer.influence(Tokens(2, 1), modes="dot")
    with pytest.raises(ValueError, match="ekfac=True"):
        from nnstat.integrations._logpass import build_config

        build_config({"statistic": "kfac"}, ekfac=True, loss_reduction="sum")
