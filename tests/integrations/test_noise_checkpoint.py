"""The callbacks' noise-scale checkpoint file: what a resume does with a missing, foreign or
mismatched one (the round trip itself: tests/integrations/test_hf_noise_scale.py)."""

from __future__ import annotations

import json

import pytest
from nnstat.integrations._noise_checkpoint import load_state, restore_into, save_state

import nnstat


def test_a_checkpoint_without_the_file_or_of_another_step_starts_afresh_with_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match="holds no noise-scale state"):
        assert load_state(str(tmp_path), step=2, rank=0, world=1) is None
    save_state(str(tmp_path), {"micro": 1}, step=2, rank=1, world=2)
    assert load_state(str(tmp_path), step=2, rank=1, world=2) == {"micro": 1}
    with pytest.warns(RuntimeWarning, match="saved at step 2, but training resumes at step 3"):
        assert load_state(str(tmp_path), step=3, rank=1, world=2) is None
    (tmp_path / "nnstat_noise_scale.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not an nnstat noise-scale checkpoint file"):
        load_state(str(tmp_path), step=2, rank=0, world=1)


def test_restore_into_refuses_another_estimator_or_averaging_with_a_warning():
    saved = nnstat.NoiseScale(beta=0.9)
    saved.update(3.0, 2.0, 1, 4)
    state = {"method": "micro_batch", "noise_scale": saved.state_dict()}
    same = nnstat.NoiseScale(beta=0.9)
    assert restore_into(same, state, "micro_batch")
    assert same.value == saved.value and same.n_updates == 1
    with pytest.warns(RuntimeWarning, match="'micro_batch' estimator, now 'per_sample'"):
        assert not restore_into(nnstat.NoiseScale(beta=0.9), state, "per_sample")
    other = nnstat.NoiseScale(window=10)
    with pytest.warns(RuntimeWarning, match="beta=0.9"):
        assert not restore_into(other, state, "micro_batch")
    assert other.n_updates == 0
