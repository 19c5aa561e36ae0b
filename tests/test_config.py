"""The three configuration levels, presets, passes and validation errors."""

from __future__ import annotations

import json

import pytest

from nnstat.curvature import EKFAC, KFAC, Covariance, Mean
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
