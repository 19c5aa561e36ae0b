"""HF Trainer + NNStatCallback: the statistics in every later callback's ``logs`` (not on the
console), and ``JsonlCallback``'s ``metrics.jsonl`` read by the viewer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from nnstat.integrations.huggingface import JsonlCallback, NNStatCallback  # noqa: E402
from test_hf_noise_scale import N, Tokens, _model  # noqa: E402

from nnstat.viewer.runs import load_run  # noqa: E402


class _UserLogs(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.logs.append({**logs, "step": state.global_step})


def test_user_callbacks_see_the_statistics_the_console_does_not_and_jsonl_holds_them(
    tmp_path, capsys
):
    user = _UserLogs()
    run_dir = tmp_path / "runs" / "gpt2"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=N, max_steps=4, logging_steps=2,
    )  # fmt: skip
    cb = NNStatCallback(stats=["l2"], noise_scale_every=1)
    trainer = transformers.Trainer(
        _model(), args, train_dataset=Tokens(4 * N), callbacks=[cb, user, JsonlCallback(run_dir)]
    )
    trainer.train()
    printed = capsys.readouterr().out
    assert "'loss'" in printed and "weight/" not in printed and "noise_scale" not in printed
    assert [log["step"] for log in user.logs] == [2, 4]
    for log in user.logs:
        history = next(h for h in trainer.state.log_history if h.get("step") == log["step"])
        nnstat_keys = {k for k in history if k.startswith(("weight/", "noise_scale/"))}
        assert nnstat_keys and nnstat_keys <= set(log)
        assert all(log[k] == history[k] for k in nnstat_keys)
    problems: list[str] = []
    run = load_run(tmp_path / "runs", run_dir, lambda p, m: problems.append(m))
    assert problems == [] and run is not None
    assert run["steps"] == [2, 4]
    series = run["series"]
    for log in user.logs:
        i = run["steps"].index(log["step"])
        assert series["loss"][i] == pytest.approx(log["loss"])
        g_sq = log["noise_scale/grad_sq_norm"]
        assert math.isfinite(g_sq) and series["noise_scale/grad_sq_norm"][i] == pytest.approx(g_sq)
        key = "weight/transformer.h.0.mlp.c_fc.weight/l2"
        assert series[key][i] == pytest.approx(log[key])
    assert Path(run_dir, "metrics.jsonl").is_file()


def test_influence_path_saves_the_texts_and_the_queries_the_explorer_shows(tmp_path):
    from nnstat.integrations.huggingface import NNStatArguments, patch_trainer

    from nnstat.viewer.examples import load_examples, query_sets

    def text(row) -> str:
        return " ".join(str(int(t)) for t in row["input_ids"])

    train, query = Tokens(6), Tokens(9)
    query.x = query.x[6:]  # three rows the training set does not hold
    nnstat_args = NNStatArguments("p", root_dir=str(tmp_path), rank=4, track=False, text_fn=text)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
        per_device_eval_batch_size=3,
    )  # fmt: skip
    trainer = patch_trainer(transformers.Trainer)(
        nnstat_args=nnstat_args, model=_model(), args=args, train_dataset=train
    )
    run = trainer.extract_log()
    trainer.influence(query)
    shown = load_examples(run.path)
    assert shown is not None
    assert shown.ids == list(range(6)) and shown.texts == [text(train[i]) for i in range(6)]
    (folder,) = query_sets(run.path)
    assert folder.name == "queries"
    queries = load_examples(folder)
    assert queries is not None and queries.texts == [text(query[i]) for i in range(3)]
