"""The HF callback's noise scale under the Trainer's gradient clipping, against per-sample
gradients of the same model states computed independently (one ``autograd.grad`` per sample)."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nnstat.integrations.huggingface import NNStatCallback  # noqa: E402

VOCAB, T, N = 48, 12, 8


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        # counting sequences: a consistent gradient direction, so |G|^2 > 0 from the start
        start = torch.randint(1, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
        self.x = (start + torch.arange(T)) % VOCAB

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class _Record:
    """Weights and inputs of every training forward (a forward pre-hook on the model)."""

    def __init__(self, model) -> None:
        self.states: list[tuple[dict, torch.Tensor]] = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
            self.states.append((state, kwargs["input_ids"].detach().clone()))


def _reference(model, state: dict, x: torch.Tensor, modules: list[str]) -> tuple[float, float]:
    """``(|G|^2, tr Sigma)`` unbiased from per-sample gradients (B_small = 1, B_big = n) of the
    modules ``modules`` at ``state``; each sample's loss is its token mean."""
    ref = _model()
    ref.load_state_dict(state)
    params = [p for m in modules for p in ref.get_submodule(m).parameters(recurse=False)]
    per = []
    for i in range(len(x)):
        loss = ref(input_ids=x[i : i + 1], labels=x[i : i + 1]).loss
        grads = torch.autograd.grad(loss, params)
        per.append(torch.cat([g.double().flatten() for g in grads]))
    g = torch.stack(per)
    n = len(g)
    small = float(g.pow(2).sum(1).mean())
    big = float(g.mean(0).pow(2).sum())
    g_sq = (n * big - small) / (n - 1)
    trace = (small - big) * n / (n - 1)
    return g_sq, trace


@pytest.mark.parametrize("max_grad_norm", [1e-3, 0.0])
def test_noise_scale_matches_per_sample_reference_with_and_without_clipping(
    tmp_path, max_grad_norm
):
    model = _model()
    record = _Record(model)
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_every=1, noise_scale_beta=0.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0, per_device_train_batch_size=N, max_steps=5, logging_steps=1,
        learning_rate=1e-2, max_grad_norm=max_grad_norm,
    )  # fmt: skip
    trainer = transformers.Trainer(model, args, train_dataset=Tokens(5 * N), callbacks=[cb])
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if "noise_scale/b_simple" in h}
    # the first micro-batch probes which modules qualify; every later one is measured
    assert sorted(logged) == [2, 3, 4, 5]
    # the modules measured: the per-layer keys noise_scale/<module>/b_simple
    modules = sorted(
        k.split("/")[1] for k in logged[2] if k.startswith("noise_scale/") and k.count("/") == 2
    )
    assert modules and not any("wte" in m or "lm_head" in m for m in modules)
    scales = []
    for step, h in logged.items():
        state, x = record.states[step - 1]
        g_sq, trace = _reference(model, state, x, modules)
        assert math.isfinite(h["noise_scale/b_simple"])
        assert h["noise_scale/b_simple"] == pytest.approx(trace / g_sq, rel=1e-4)
        # the Trainer divides the summed token losses by the batch's label count, the
        # reference by each sample's predicted tokens: one common factor on both estimates
        scales += [h["noise_scale/grad_sq_norm"] / g_sq, h["noise_scale/trace_sigma"] / trace]
    assert scales == pytest.approx([((T - 1) / T) ** 2] * len(scales), rel=1e-4)


def test_a_clip_outside_the_accelerator_is_warned_and_left_out_of_the_noise_scale(tmp_path):
    class OwnClip(transformers.Trainer):
        def _clip_grad_norm(self, model):  # clips without accelerator.clip_grad_norm_
            return torch.nn.utils.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_every=1, noise_scale_beta=0.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=N, max_steps=3, logging_steps=1,
        max_grad_norm=1e-3,
    )  # fmt: skip
    trainer = OwnClip(_model(), args, train_dataset=Tokens(3 * N), callbacks=[cb])
    with pytest.warns(UserWarning, match="clipped the gradients .* before the noise scale"):
        trainer.train()
    assert not any("noise_scale/b_simple" in h for h in trainer.state.log_history)


def test_windowed_noise_scale_has_an_interval_from_the_second_observation_under_clipping(
    tmp_path,
):
    model = _model()
    record = _Record(model)
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_every=1, noise_scale_window=8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        per_device_train_batch_size=N,
        max_steps=5,
        logging_steps=1,
        learning_rate=1e-2,
    )  # fmt: skip  (max_grad_norm: the Trainer's default 1.0)
    trainer = transformers.Trainer(model, args, train_dataset=Tokens(5 * N), callbacks=[cb])
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if "noise_scale/b_simple" in h}
    modules = sorted(
        k.split("/")[1] for k in logged[2] if k.startswith("noise_scale/") and k.count("/") == 2
    )
    refs = {s: _reference(model, *record.states[s - 1], modules) for s in logged}
    for step, h in logged.items():
        seen = [refs[s] for s in refs if s <= step]
        expected = sum(t for _, t in seen) / sum(g for g, _ in seen)  # ratio of window means
        assert h["noise_scale/b_simple"] == pytest.approx(expected, rel=1e-4)
        if step >= 3:  # two observations: a bootstrap interval
            low, high = h["noise_scale/low"], h["noise_scale/high"]
            assert math.isfinite(low) and math.isfinite(high) and 0 < low <= high
    with pytest.raises(ValueError, match="noise_scale_window"):
        NNStatCallback(noise_scale_window=1)


def _micro_reference(states: list[tuple[dict, torch.Tensor]]) -> float:
    """B_simple of one optimizer step from its micro-batches' gradients, each taken on its own
    (``autograd.grad`` of the micro-batch's mean loss over every parameter) and the two-batch
    formula: B_small = one micro-batch, B_big = all of them."""
    from nnstat.gradient_noise.maths import two_batch

    ref = _model()
    ref.load_state_dict(states[0][0])
    params = list(ref.parameters())
    means = []
    for _, x in states:
        grads = torch.autograd.grad(ref(input_ids=x, labels=x).loss, params)
        means.append(torch.cat([g.double().flatten() for g in grads]))
    g = torch.stack(means)
    small, big = float(g.pow(2).sum(1).mean()), float(g.mean(0).pow(2).sum())
    g_sq, trace = two_batch(small, big, len(states[0][1]), len(states[0][1]) * len(states))
    return trace / g_sq


@pytest.mark.parametrize("max_grad_norm", [1e-3, 0.0])
def test_gradient_accumulation_defaults_to_the_micro_batch_estimator(tmp_path, max_grad_norm):
    model = _model()
    record = _Record(model)
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_beta=0.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0, per_device_train_batch_size=N // 2, max_steps=3,
        logging_steps=1, learning_rate=1e-2, max_grad_norm=max_grad_norm,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    trainer = transformers.Trainer(model, args, train_dataset=Tokens(3 * N), callbacks=[cb])
    trainer.train()
    assert cb.hooks.method == "micro_batch"
    logged = {h["step"]: h for h in trainer.state.log_history if "noise_scale/b_simple" in h}
    assert sorted(logged) == [1, 2, 3]  # no probing micro-batch: measured from the first step
    for step, h in logged.items():
        states = record.states[2 * (step - 1) : 2 * step]
        assert h["noise_scale/b_simple"] == pytest.approx(_micro_reference(states), rel=1e-4)
    # every parameter is covered, the tied embedding and head included (once)
    assert "noise_scale/transformer.wte/b_simple" in logged[1]


def test_the_estimator_can_be_forced_either_way(tmp_path):
    args = dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=N // 2, max_steps=2, logging_steps=1,
    )  # fmt: skip
    for accumulation, method, chosen in [(2, "per_sample", "per_sample"), (1, "auto", "per_sample"),
                                         (2, "micro_batch", "micro_batch")]:  # fmt: skip
        cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_method=method)
        targs = transformers.TrainingArguments(gradient_accumulation_steps=accumulation, **args)
        trainer = transformers.Trainer(_model(), targs, train_dataset=Tokens(4 * N), callbacks=[cb])
        trainer.train()
        assert cb.hooks.method == chosen
        assert any("noise_scale/b_simple" in h for h in trainer.state.log_history)
    # one micro-batch per step gives the micro-batch estimator nothing to compare, and one
    # process no DDP gradients: forcing either is refused before the first step
    for method, match in [("micro_batch", "needs gradient accumulation"),
                          ("ddp", "on 1 process")]:  # fmt: skip
        cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_method=method)
        targs = transformers.TrainingArguments(gradient_accumulation_steps=1, **args)
        trainer = transformers.Trainer(_model(), targs, train_dataset=Tokens(4 * N), callbacks=[cb])
        with pytest.raises(ValueError, match=match):
            trainer.train()
        assert trainer.state.global_step == 0
    with pytest.raises(ValueError, match="noise_scale_method"):
        NNStatCallback(noise_scale_method="microbatch")


def test_a_smaller_last_micro_batch_is_measured_at_its_own_size(tmp_path):
    """10 sequences in micro-batches of 4, 4 and 2 per optimizer step: the Trainer divides
    each micro-batch's summed token losses by the step's label count (``num_items_in_batch``),
    so the step's gradient is the mean over its 10 samples while each micro-batch's is
    weighted by its size. The callback takes each training forward's batch size; the
    reference solves ``E|g|^2 = |G|^2 + tr(Sigma)/B`` for the micro-batches' mean squared
    norm (the harmonic mean of 4, 4, 2) and the step's (10 samples), from each micro-batch's
    own gradient computed independently at the step's weights."""
    model = _model()
    record = _Record(model)
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_beta=0.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0, per_device_train_batch_size=4, gradient_accumulation_steps=3,
        num_train_epochs=2, logging_steps=1, learning_rate=1e-2, max_grad_norm=0.0,
    )  # fmt: skip
    trainer = transformers.Trainer(model, args, train_dataset=Tokens(10), callbacks=[cb])
    trainer.train()
    assert cb.hooks.method == "micro_batch"
    logged = {h["step"]: h for h in trainer.state.log_history if "noise_scale/b_simple" in h}
    assert sorted(logged) == [1, 2]
    for step, h in logged.items():
        forwards = record.states[3 * (step - 1) : 3 * step]
        ref = _model()
        ref.load_state_dict(forwards[0][0])
        params = list(ref.parameters())
        g, sizes = [], []
        for _, x in forwards:
            grads = torch.autograd.grad(ref(input_ids=x, labels=x).loss, params)
            g.append(torch.cat([v.double().flatten() for v in grads]))
            sizes.append(len(x))
        assert sizes == [4, 4, 2]
        g, w = torch.stack(g), torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
        small, big = float(g.pow(2).sum(1).mean()), float((w[:, None] * g).sum(0).pow(2).sum())
        b_small, b_big = 3 / sum(1 / b for b in sizes), sum(sizes)
        g_sq = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1 / b_small - 1 / b_big)
        assert h["noise_scale/b_simple"] == pytest.approx(trace / g_sq, rel=1e-4)
        # the Trainer counts labels after the shift, the reference each sample's T tokens
        assert h["noise_scale/trace_sigma"] == pytest.approx(trace * ((T - 1) / T) ** 2, rel=1e-4)


def test_an_evaluation_between_steps_leaves_the_next_step_measured(tmp_path):
    """The Trainer switches the model back to train mode inside ``training_step``, after
    ``on_step_begin``: an evaluation after every step left the model in eval mode at that
    event, and the noise scale skipped every batch (no ``noise_scale/`` key at all). Each
    step after the probe is measured, against per-sample gradients computed independently."""
    model = _model()
    record = _Record(model)
    cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_every=1, noise_scale_beta=0.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0, per_device_train_batch_size=N, max_steps=3, logging_steps=1,
        learning_rate=1e-2, max_grad_norm=0.0, eval_strategy="steps", eval_steps=1,
        per_device_eval_batch_size=N,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model, args, train_dataset=Tokens(3 * N), eval_dataset=Tokens(N), callbacks=[cb]
    )
    trainer.train()
    assert sum("eval_loss" in h for h in trainer.state.log_history) == 3
    logged = {h["step"]: h for h in trainer.state.log_history if "noise_scale/b_simple" in h}
    assert sorted(logged) == [2, 3]  # the first micro-batch probes which modules qualify
    modules = sorted(
        k.split("/")[1] for k in logged[2] if k.startswith("noise_scale/") and k.count("/") == 2
    )
    for step, h in logged.items():
        state, x = record.states[step - 1]
        g_sq, trace = _reference(model, state, x, modules)
        assert h["noise_scale/b_simple"] == pytest.approx(trace / g_sq, rel=1e-4)


@pytest.mark.parametrize("accumulation", [1, 2])  # per-sample norms; micro-batches
def test_a_resumed_run_continues_the_noise_scale_of_the_uninterrupted_run(tmp_path, accumulation):
    """4 steps saved at step 2, then resumed from that checkpoint (into another output
    folder): the noise scale logged at steps 3 and 4 equals the uninterrupted run's (its
    averages travel in the checkpoint as JSON), where it used to start afresh."""
    import json
    import os

    def run(out: str, resume: str | None = None) -> dict[int, dict]:
        cb = NNStatCallback(stats=["l2"], groups=["weight"], noise_scale_every=1)
        args = transformers.TrainingArguments(
            output_dir=out, report_to="none", use_cpu=True, save_strategy="steps",
            save_steps=2, disable_tqdm=True, seed=0, per_device_train_batch_size=N // 2,
            max_steps=4, logging_steps=1, learning_rate=1e-2, max_grad_norm=0.0,
            gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        trainer = transformers.Trainer(_model(), args, train_dataset=Tokens(4 * N), callbacks=[cb])
        trainer.train(resume_from_checkpoint=resume)
        return {h["step"]: h for h in trainer.state.log_history if "noise_scale/b_simple" in h}

    whole = run(str(tmp_path / "a"))
    checkpoint = str(tmp_path / "a" / "checkpoint-2")
    saved = json.loads(open(os.path.join(checkpoint, "nnstat_noise_scale.json")).read())
    assert saved["step"] == 2 and saved["state"]["noise_scale"]["n_updates"] >= 1
    resumed = run(str(tmp_path / "b"), resume=checkpoint)
    assert {3, 4} <= set(resumed)  # (step 2 is in the checkpoint's log history)
    keys = ["noise_scale/b_simple", "noise_scale/grad_sq_norm", "noise_scale/trace_sigma"]
    for step in (3, 4):
        for key in keys:
            assert resumed[step][key] == pytest.approx(whole[step][key], rel=1e-6), (step, key)
