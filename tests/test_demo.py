"""The demo, shortened with NNSTAT_DEMO_QUICK=1."""

import pytest

from nnstat.demo import main


def test_demo_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NNSTAT_DEMO_QUICK", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "epoch 2/2" in out and "test accuracy" in out
    assert "kurtosis" in out and "4.weight" in out  # describe table
    assert "trust ratio" in out
    assert str(tmp_path / "tensorboard") in out
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    accuracy = float(out.split("test accuracy")[1].split()[0])
    assert accuracy > 0.5  # it actually trains (10 classes: chance is 0.1)


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--epochs", "0"])
