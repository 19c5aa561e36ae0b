"""The patched Trainer on models other than GPT-2: a BERT classifier (whose loss takes
``**kwargs`` but still averages over the batch), a ViT (no ``input_ids``), and token losses
(BERT's masked LM and T5 average over their label tokens, GPT-2 divides by
``num_items_in_batch``). Each stored row is its sample's own gradient of its summed loss:
identity self-influence = the squared norm of the per-sample gradient of the watched modules,
from a per-sample autograd loop."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nnstat.integrations.huggingface import NNStatArguments, patch_trainer  # noqa: E402


class Rows(torch.utils.data.Dataset):
    def __init__(self, columns: dict) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.columns.items()}


def _patched(tmp_path, model, cols: dict, base=None, **trainer_kwargs):
    """The patched Trainer (``base``: the Trainer class patched) logging per-sample gradients of
    ``cols`` (batches of 4 and 2)."""
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), report_to="none", use_cpu=True, per_device_eval_batch_size=4
    )
    nargs = NNStatArguments(
        "hf", root_dir=str(tmp_path), lora=False, progress=False, track=False,
        config={"log": "grad", "save": "grad", "statistic": "none"},
    )  # fmt: skip
    return patch_trainer(base or transformers.Trainer)(
        nnstat_args=nargs, model=model, args=args, train_dataset=Rows(cols), **trainer_kwargs
    )


def _watched_params(run) -> list:
    return [p for m in run.engine.watched.values() for p in m.parameters(recurse=False)]


def _squared_norm(model, params: list, loss: torch.Tensor) -> torch.Tensor:
    """The squared norm of ``loss``'s gradient over ``params`` (the reference per sample)."""
    model.zero_grad()
    loss.backward()
    return sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    ids = torch.randint(1, 20, (6, 5))
    mask = torch.ones(6, 5, dtype=torch.long)
    mask[0, 3:] = 0  # a padded sequence
    cols = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (6,))}
    return transformers.BertForSequenceClassification(cfg), cols


def _vit():
    cfg = transformers.ViTConfig(
        image_size=4, patch_size=2, num_channels=1, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    cols = {"pixel_values": torch.randn(6, 1, 4, 4), "labels": torch.randint(0, 3, (6,))}
    return transformers.ViTForImageClassification(cfg), cols


@pytest.mark.parametrize("build", [_bert, _vit], ids=["bert", "vit"])
def test_patched_trainer_stores_each_samples_own_gradient(tmp_path, build):
    torch.manual_seed(0)
    model, cols = build()
    trainer = _patched(tmp_path, model, cols)
    run = trainer.extract_log()  # batches of 4 and 2: a mean would scale them differently
    got = trainer.self_influence(preconditioner="identity").scores

    params = _watched_params(run)
    assert len(params) > 10
    model.eval()
    ref = [
        _squared_norm(model, params, model(**{k: v[i : i + 1] for k, v in cols.items()}).loss)
        for i in range(6)
    ]
    torch.testing.assert_close(got.double(), torch.stack(ref), rtol=1e-4, atol=1e-8)


# Token-level losses: each sample holds a different number of -100 labels, and the batches of 4
# and 2 hold different numbers of label tokens, so a mean × batch size would scale each batch's
# rows by its own factor. The reference sums each sample's token cross-entropies from its logits.
def _bert_mlm():
    cfg = transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    ids = torch.randint(1, 20, (6, 6))
    labels = torch.full((6, 6), -100)
    for i, positions in enumerate([[0], [1, 2, 4], [5], [0, 1, 2, 3, 5], [2, 3], [1, 2, 3, 4]]):
        labels[i, positions] = torch.randint(1, 20, (len(positions),))
    cols = {"input_ids": ids, "attention_mask": torch.ones(6, 6, dtype=torch.long)}
    return transformers.BertForMaskedLM(cfg), cols | {"labels": labels}, False


def _t5():
    cfg = transformers.T5Config(
        vocab_size=20, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    labels = torch.randint(1, 20, (6, 6))
    for i, n in enumerate([1, 5, 2, 6, 3, 4]):  # valid decoder tokens, then -100 padding
        labels[i, n:] = -100
    cols = {"input_ids": torch.randint(1, 20, (6, 6)), "attention_mask": torch.ones(6, 6)}
    return transformers.T5ForConditionalGeneration(cfg), cols | {"labels": labels}, False


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    ids = torch.randint(1, 20, (6, 6))
    mask = torch.ones(6, 6, dtype=torch.long)
    for i, n in enumerate([2, 6, 3, 5, 6, 4]):  # right padding, labelled -100
        mask[i, n:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    cols = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return transformers.GPT2LMHeadModel(cfg), cols, True


def _summed_token_loss(model, sample: dict, shift: bool) -> torch.Tensor:
    logits, labels = model(**sample).logits, sample["labels"]
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def _summed_token_self_influence(model, run, cols: dict, shift: bool) -> torch.Tensor:
    """Each of the 6 samples' squared gradient norm of its summed token loss (identity
    self-influence), by autograd one sample at a time over the run's watched parameters."""
    params = _watched_params(run)
    assert len(params) > 5
    model.eval()
    return torch.stack(
        [
            _squared_norm(
                model,
                params,
                _summed_token_loss(model, {k: v[i : i + 1] for k, v in cols.items()}, shift),
            )
            for i in range(6)
        ]
    )


@pytest.mark.parametrize("build", [_bert_mlm, _t5, _gpt2], ids=["bert-mlm", "t5", "gpt2"])
def test_patched_trainer_rows_are_summed_token_loss_gradients(tmp_path, build):
    torch.manual_seed(0)
    model, cols, shift = build()
    trainer = _patched(tmp_path, model, cols)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = trainer.extract_log()
    assert not [w for w in caught if "batch size" in str(w.message)]  # the layout is recognised
    got = trainer.self_influence(preconditioner="identity").scores

    ref = _summed_token_self_influence(model, run, cols, shift)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-8)


def _token_ce(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func summing the token cross-entropies, divided by num_items_in_batch."""
    logits = outputs["logits"]
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return total / (1 if num_items_in_batch is None else num_items_in_batch)


def _smoothed_mean(outputs, labels, num_items_in_batch=None):
    """A custom mean loss that ignores num_items_in_batch and is no plain cross-entropy."""
    logits = outputs["logits"]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), label_smoothing=0.1
    )


def _trainer_with_loss(tmp_path, loss_func):
    torch.manual_seed(0)
    model, cols, _ = _bert_mlm()
    return _patched(tmp_path, model, cols, compute_loss_func=loss_func), model, cols


def test_compute_loss_func_dividing_by_num_items_gives_summed_rows(tmp_path):
    trainer, model, cols = _trainer_with_loss(tmp_path, _token_ce)
    run = trainer.extract_log()
    got = trainer.self_influence(preconditioner="identity").scores
    ref = _summed_token_self_influence(model, run, cols, False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-8)


def test_unrecognised_mean_loss_warns_once_and_scales_by_batch_size(tmp_path):
    trainer, model, cols = _trainer_with_loss(tmp_path, _smoothed_mean)
    with pytest.warns(UserWarning, match="compute_loss_func") as caught:
        run = trainer.extract_log()  # two batches, one warning
    assert len([w for w in caught if "compute_loss_func" in str(w.message)]) == 1
    got = trainer.self_influence(preconditioner="identity").scores
    params = _watched_params(run)
    model.eval()
    ref = []
    for start, stop in ((0, 4), (4, 6)):  # the documented fallback: batch mean × batch size
        for i in range(start, stop):
            batch = {k: v[start:stop] for k, v in cols.items()}
            logits = model(**batch).logits
            own = torch.nn.functional.cross_entropy(
                logits[i - start].reshape(-1, logits.shape[-1]),
                batch["labels"][i - start].reshape(-1),
                label_smoothing=0.1,
                reduction="sum",
            )
            scale = (stop - start) / batch["labels"].ne(-100).sum()
            ref.append(_squared_norm(model, params, own * scale))
    torch.testing.assert_close(got.double(), torch.stack(ref), rtol=1e-4, atol=1e-8)


class _SmoothedTrainer(transformers.Trainer):
    """A Trainer whose own compute_loss is the custom mean loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _smoothed_mean(outputs, labels)
        return (loss, outputs) if return_outputs else loss


class _SmoothedMLM(transformers.BertForMaskedLM):
    """A model whose own loss is the custom mean loss."""

    def forward(self, input_ids, attention_mask, labels=None):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask)
        if labels is not None:
            out["loss"] = _smoothed_mean(out, labels)
        return out


@pytest.mark.parametrize(
    "source, named",
    [
        ("compute_loss_func", "the Trainer's compute_loss_func"),
        ("override", "_SmoothedTrainer.compute_loss"),
        ("model", "the model's loss (_SmoothedMLM.forward)"),
    ],
)
def test_the_mean_loss_warning_says_what_was_assumed_and_the_fix(tmp_path, source, named):
    torch.manual_seed(0)
    model, cols, _ = _bert_mlm()
    if source == "compute_loss_func":
        trainer = _patched(tmp_path, model, cols, compute_loss_func=_smoothed_mean)
    elif source == "override":
        trainer = _patched(tmp_path, model, cols, base=_SmoothedTrainer)
    else:
        smoothed = _SmoothedMLM(model.config)
        smoothed.load_state_dict(model.state_dict())
        model = smoothed
        trainer = _patched(tmp_path, model, cols)
    with pytest.warns(UserWarning, match="num_items_in_batch") as caught:
        trainer.extract_log()
    (message,) = [str(w.message) for w in caught if "label tokens" in str(w.message)]
    assert message.startswith(f"nnstat: {named} ignores num_items_in_batch")
    # what was assumed, with the first batch's numbers: its loss (recomputed here) × 4 samples
    model.eval()
    batch = {k: v[:4] for k, v in cols.items()}
    with torch.no_grad():
        first = float(_smoothed_mean(model(**batch), batch["labels"]))
    assumed = re.search(r"the first batch: (\S+) × (\d+)\)", message)
    assert float(assumed[1]) == pytest.approx(first, rel=1e-5) and assumed[2] == "4"
    counts = ", ".join(str(n) for n in batch["labels"].ne(-100).sum(1).tolist())
    assert counts == "1, 3, 1, 5" and f"samples hold {counts} label tokens" in message
    assert "compute_loss_func=lambda outputs, labels, num_items_in_batch: " in message
    assert "/ num_items_in_batch" in message
