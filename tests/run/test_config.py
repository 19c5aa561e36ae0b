"""The run configuration: levels, presets, passes, validation, and setup(RunConfig | dict)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn

import nnstat
from nnstat.curvature import EKFAC, KFAC, Covariance, Mean, StatisticsCollector
from nnstat.influence import Refinement
from nnstat.recorder import Rule, Schedule
from nnstat.recorder.schedule import make_schedule
from nnstat.run.config import RunConfig


def test_low_and_mid_level_are_equivalent_for_kfac():
    low = RunConfig.from_any(
        {
            "log": {"forward": False, "backward": False, "grad": True},
            "save": {"forward": False, "backward": False, "grad": True},
            "statistic": {"forward": [Covariance], "backward": [Covariance], "grad": []},
        }
    )
    mid = RunConfig.from_any({"log": "grad", "save": ["grad"], "statistic": "kfac"})
    assert low.log == mid.log == {"forward": False, "backward": False, "grad": True}
    assert low.save == mid.save
    (lp,), (mp,) = low.passes(), mid.passes()
    assert (
        lp.statistic
        == mp.statistic
        == {
            "forward": (Covariance,),
            "backward": (Covariance,),
            "grad": (),
        }
    )
    assert mp.kfac and not lp.kfac  # the preset keeps K-FAC semantics for layernorm


def test_presets_and_passes():
    spec = {
        name: RunConfig(statistic=name).passes()
        for name in ("none", "mean", "raw", "kfac", "ekfac")
    }
    assert [p.name for p in spec["none"]] == ["log"]
    assert spec["mean"][0].statistic["grad"] == (Mean,)
    assert spec["raw"][0].statistic["grad"] == (Covariance,)
    f, e = spec["ekfac"]
    assert (f.name, e.name) == ("factors", "eigenvalues")
    assert f.statistic["forward"] == (Covariance,) and f.statistic["grad"] == ()
    assert not any(f.save.values()), "the factor pass saves nothing"
    assert e.statistic["grad"] == (EKFAC,) and e.save["grad"]
    # KFAC / EKFAC on the grad stream expand to the covariances they need
    low = RunConfig(statistic={"grad": [EKFAC]}).passes()
    assert low[0].statistic["forward"] == (Covariance,) and low[1].statistic["grad"] == (EKFAC,)
    assert RunConfig(statistic={"grad": ["kfac"]}).passes()[0].statistic["backward"] == (
        Covariance,
    )
    assert RunConfig(statistic="ekfac").preset == "ekfac"
    assert RunConfig(statistic={"grad": [Mean]}).preset == "mean"
    assert RunConfig(statistic={"grad": [Mean, KFAC]}).preset is None


def test_defaults_and_store_keys():
    c = RunConfig.from_any(None)
    assert c.loss_reduction == "sum" and c.param_grads is True and c.nonfinite == "error"
    c = RunConfig.from_any(
        {
            "loss_reduction": "mean",
            "param_grads": False,
            "nonfinite": "skip",
            "dtype": "bfloat16",
            "rank": 8,
        }
    )
    assert (c.loss_reduction, c.param_grads, c.nonfinite, c.dtype, c.rank) == (
        "mean",
        False,
        "skip",
        "bfloat16",
        8,
    )
    assert c.update({"rank": None}).rank is None and c.rank == 8


@pytest.mark.parametrize(
    "bad,match",
    [
        (
            {"hessian": "kfac"},
            r"unknown configuration key 'hessian'; valid keys: log, save, statistic",
        ),
        (
            {"statistic": "kfc"},
            r"unknown statistic preset 'kfc'; valid: none, mean, raw, kfac, ekfac",
        ),
        ({"log": "grads"}, r"unknown stream in 'log' 'grads'; valid: forward, backward, grad"),
        ({"save": {"activations": True}}, r"'activations'; valid: forward, backward, grad"),
        (
            {"statistic": {"forward": ["Median"]}},
            r"unknown statistic 'Median'.*valid: Mean, Covariance, KFAC, EKFAC",
        ),
        ({"statistic": {"forward": [EKFAC]}}, r"EKFAC applies to the grad stream, not 'forward'"),
        ({"statistic": {"weights": [Mean]}}, r"unknown stream in 'statistic' 'weights'"),
        ({"loss_reduction": "avg"}, r"unknown loss_reduction 'avg'; valid: sum, mean"),
        ({"nonfinite": "ignore"}, r"valid: error, skip, keep"),
        ({"dtype": "float64"}, r"valid: float32, float16, bfloat16"),
        ({"rank": 0}, r"rank must be a positive int"),
        ({"log": {"grad": 1}}, r"log\['grad'\] must be True or False"),
    ],
)
def test_unknown_keys_and_values_name_the_valid_ones(bad, match):
    with pytest.raises(ValueError, match=match):
        RunConfig.from_any(bad)


def test_json_roundtrip_without_pickle():
    c = RunConfig.from_any({"log": ["grad", "forward"], "statistic": {"grad": [Mean, EKFAC]}})
    text = json.dumps(c.to_json())
    back = RunConfig.from_json(json.loads(text))
    assert back == c
    assert json.loads(text)["statistic"]["grad"] == ["Mean", "EKFAC"]


# ------------------------------------------------------------------ setup(...) with a RunConfig
ALL_KEYS = (
    "log, save, statistic, loss_reduction, param_grads, nonfinite, dtype, rank, factors, "
    "max_factor_dim, "
    "shard_rows, queue_size, on_stored_id, size_budget_bytes, num_samples"
)


def _store(tmp_path, project, config):
    """Log one EK-FAC schedule of a small model configured with ``config``; the store's files."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    run = nnstat.init(project=project, root_dir=tmp_path)
    assert nnstat.setup(config) is run
    nnstat.watch(model)
    for _ in run.schedule():
        for lo in (0, 6):
            with run(data_id=list(range(lo, lo + 6))):
                nn.functional.cross_entropy(
                    model(x[lo : lo + 6]), y[lo : lo + 6], reduction="sum"
                ).backward()
    meta = json.loads((run.path / "meta.json").read_text())
    return run, meta, nnstat.GradientStore(run.path)


def test_setup_takes_a_run_config_like_its_dict_form(tmp_path):
    flat = {"statistic": "ekfac", "rank": 2, "dtype": "bfloat16", "shard_rows": 5}
    a, meta_a, store_a = _store(tmp_path, "dict", flat)
    b, meta_b, store_b = _store(tmp_path, "typed", nnstat.RunConfig(**flat))
    assert a.config == b.config == RunConfig.from_any(flat)
    # a store's id is drawn fresh for each store: two stores never share one
    assert meta_a["store_id"] != meta_b["store_id"]
    for m in (meta_a, meta_b):
        m.pop("project")
        m.pop("store_id")
    assert meta_a == meta_b
    assert store_a.ids == store_b.ids and torch.equal(store_a.rows(0, 12), store_b.rows(0, 12))
    assert (a.path / "statistics.json").read_text() == (b.path / "statistics.json").read_text()
    # what meta.json records: neither the store's operational keys nor param_grads/max_factor_dim
    assert list(meta_b["config"]["run"]) == [
        "log",
        "save",
        "statistic",
        "loss_reduction",
        "nonfinite",
        "dtype",
        "rank",
    ]


def test_setup_dict_updates_and_run_config_replaces(tmp_path):
    run = nnstat.init(project="u", root_dir=tmp_path, config=RunConfig(rank=4, queue_size=2))
    nnstat.setup({"statistic": "kfac"})
    assert (run.config.rank, run.config.queue_size, run.config.preset) == (4, 2, "kfac")
    nnstat.setup(RunConfig(statistic="mean"))
    assert (run.config.rank, run.config.queue_size, run.config.preset) == (None, 16, "mean")
    assert run.config.store.queue_size == 16 and run.config.store.on_stored_id == "skip"


@pytest.mark.parametrize("bad", ["kfac", [("rank", 4)], 3])
def test_setup_of_another_type_names_both_accepted_types(tmp_path, bad):
    nnstat.init(project="t", root_dir=tmp_path)
    with pytest.raises(TypeError, match=r"setup\(\) takes a dict or a RunConfig, got"):
        nnstat.setup(bad)


def test_unknown_key_lists_every_key_including_the_store_keys(tmp_path):
    assert ", ".join(RunConfig.keys()) == ALL_KEYS
    nnstat.init(project="k", root_dir=tmp_path)
    with pytest.raises(ValueError) as info:
        nnstat.setup({"statistic": "kfac", "shard_size": 4})
    assert str(info.value) == f"unknown configuration key 'shard_size'; valid keys: {ALL_KEYS}"


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("shard_rows", 0, r"shard_rows must be a positive int or None, got 0"),
        ("shard_rows", 2.5, r"shard_rows must be a positive int or None"),
        ("queue_size", 0, r"queue_size must be a positive int, got 0"),
        ("queue_size", None, r"queue_size must be a positive int, got None"),
        ("size_budget_bytes", True, r"size_budget_bytes must be a positive int, got True"),
        ("num_samples", -1, r"num_samples must be a non-negative int or None, got -1"),
        ("on_stored_id", "x", r"unknown on_stored_id 'x'; valid: skip, error"),
        ("nonfinite", "drop", r"unknown nonfinite 'drop'; valid: error, skip, keep"),
        ("dtype", "int8", r"unknown dtype 'int8'; valid: float32, float16, bfloat16"),
        ("rank", True, r"rank must be a positive int or None"),
        ("max_factor_dim", 0, r"max_factor_dim must be a positive int or None"),
        ("param_grads", 1, r"param_grads must be True or False"),
    ],
)
def test_invalid_values_are_refused_at_setup_naming_the_key(tmp_path, key, value, match):
    run = nnstat.init(project="v", root_dir=tmp_path)
    before = run.config
    with pytest.raises(ValueError, match=match):
        nnstat.setup({key: value})
    assert run.config is before  # a refused setup leaves the configuration as it was
    with pytest.raises(ValueError, match=match):
        RunConfig(**{key: value})


def test_run_config_is_frozen_and_its_json_keeps_every_key():
    c = RunConfig(statistic="kfac", shard_rows=3, on_stored_id="error")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 3  # type: ignore[misc]
    assert RunConfig.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert c.update({}) == c and c.update({"shard_rows": 4}).shard_rows == 4


def test_collector_takes_a_run_config_and_refuses_run_keys_in_a_dict():
    c = RunConfig(log="grad", save="grad", statistic="ekfac", max_factor_dim=8, rank=4)
    col = StatisticsCollector(c)
    assert (
        [p.name for p in col.passes] == [p.name for p in c.passes()] == ["factors", "eigenvalues"]
    )
    assert col.max_factor_dim == 8 and col.preset == "ekfac"
    flat = StatisticsCollector({"log": "grad", "save": "grad", "statistic": "ekfac"})
    assert flat.passes == StatisticsCollector("ekfac").passes
    with pytest.raises(ValueError, match=r"unknown statistics key 'rank'; valid keys: log, save"):
        StatisticsCollector({"statistic": "kfac", "rank": 4})
    with pytest.raises(TypeError, match="preset name, a dict or a RunConfig"):
        StatisticsCollector(3)


def test_deprecated_statistics_package_forwards_run_config():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import nnstat.statistics as old

    assert old.RunConfig is nnstat.RunConfig is nnstat.run.RunConfig
    assert "RunConfig" in old.__all__ and "RunConfig" in dir(old)
    assert old.Mean is nnstat.curvature.Mean
    assert not hasattr(nnstat.curvature, "RunConfig")  # curvature does not import upward


def test_watch_and_track_module_refuse_a_non_module_naming_its_type(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nnstat.init(project="p", root_dir=tmp_path)
    with pytest.raises(TypeError, match=r"watch\(\) expects the model \(an nn.Module\), got SGD"):
        nnstat.watch(opt)
    with pytest.raises(TypeError, match="got SGD"):
        nnstat.NoiseScale().watch(opt)
    rec = nnstat.Recorder(tmp_path / "rec", group="g", trial="t")
    with pytest.raises(TypeError, match="track_module expects an nn.Module, got SGD"):
        rec.track_module(opt)
    rec.close()
    assert nnstat.watch(model) == ["model"]  # the model itself is still accepted


def _public_init_fields(cls) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.init and f.name[0] != "_")


@pytest.mark.parametrize(
    "cls, what, given",
    [
        (RunConfig, "configuration", {"statistic": "kfac"}),
        (Schedule, "schedule", {"every": 5}),
        (Rule, "rule", {"kind": "nonfinite"}),
        (
            Refinement,
            "refinement",
            {"model": nn.Linear(2, 1), "loss_fn": nn.MSELoss(), "train_data": (torch.ones(1, 2),)},
        ),
    ],
)
def test_unknown_keyword_argument_names_the_valid_keys(cls, what, given):
    with pytest.raises(TypeError) as info:
        cls(**given, bogus_key=1)
    expected = f"unknown {what} key 'bogus_key'; valid keys: {_public_init_fields(cls)}"
    assert str(info.value) == expected
    assert isinstance(cls(**given), cls)  # known keys still construct


@pytest.mark.parametrize(
    "dict_form, keyword_form",
    [
        (lambda: RunConfig.from_any({"shard_size": 4}), lambda: RunConfig(shard_size=4)),
        (lambda: make_schedule({"evry": 4}), lambda: Schedule(evry=4)),
    ],
)
def test_keyword_and_dict_forms_refuse_an_unknown_key_with_one_message(dict_form, keyword_form):
    with pytest.raises(ValueError) as from_dict:
        dict_form()
    with pytest.raises(TypeError) as from_keywords:
        keyword_form()
    assert str(from_dict.value) == str(from_keywords.value)
