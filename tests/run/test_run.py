"""The Run API: ids, refusals, resume, errors from the writer, passes, eval/get_log, opt-ins."""

import json
import sys
import time
import warnings

import pytest
import torch
from torch import nn

import nnstat
from nnstat.store import StoreWriteError
from nnstat.store.ids import content_id
from nnstat.store.shards import ShardFile


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(24, 5), torch.randint(0, 3, (24,))
    return model, x, y


def step(run, model, x, y, ids=None, **kw):
    with run(data_id=ids, **kw):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()


def logged(
    tmp_path, project="p", config=None, rank=2, batches=((0, 8), (8, 16), (16, 24)), ids=None
):
    model, x, y = make()
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup(config or {"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=rank)
    for lo, hi in batches:
        step(run, model, x[lo:hi], y[lo:hi], None if ids is None else ids[lo:hi])
    nnstat.finalize()
    return run, model, x, y


def test_id_types_are_preserved_and_auto_ids_are_consecutive(tmp_path):
    ids = [*range(12), *[f"s{i}" for i in range(12)]]
    run, *_ = logged(tmp_path, ids=ids)
    assert nnstat.GradientStore(run.path).ids == ids
    run, *_ = logged(tmp_path, project="auto")
    assert nnstat.GradientStore(run.path).ids == list(range(24))


def test_tensor_ids_are_content_hashes(tmp_path):
    model, x, y = make()
    run = nnstat.init(project="h", root_dir=tmp_path)
    nnstat.watch(model)
    step(run, model, x[:4], y[:4], ids=x[:4])
    nnstat.finalize()
    assert nnstat.GradientStore(run.path).ids == [content_id(r) for r in x[:4]]


def test_duplicate_ids_in_a_pass_are_refused(tmp_path):
    model, x, y = make()
    run = nnstat.init(project="d", root_dir=tmp_path)
    nnstat.watch(model)
    step(run, model, x[:4], y[:4], ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"duplicate data ids.*\[4\]"):
        step(run, model, x[4:8], y[4:8], ids=[4, 5, 6, 7])
    with pytest.raises(ValueError, match="duplicate"):
        step(run, model, x[4:6], y[4:6], ids=[9, 9])
    step(run, model, x[4:8], y[4:8], ids=[5, 6, 7, 8])  # a refused batch can be retried
    nnstat.finalize()
    assert nnstat.GradientStore(run.path).ids == [1, 2, 3, 4, 5, 6, 7, 8]


def test_resume_appends_and_skips_stored_ids(tmp_path, rows_formed_in):
    run, model, x, y = logged(tmp_path, batches=[(0, 8)], ids=list(range(24)))
    first = nnstat.GradientStore(run.path).rows(0, 8)
    run, *_ = logged(tmp_path, ids=list(range(24)))  # same config: the whole pass again
    store = nnstat.GradientStore(run.path)
    assert sorted(store.ids) == list(range(24)) and len(store) == 24
    torch.testing.assert_close(store.rows(0, 8), first)
    with pytest.raises(ValueError, match="already in the store"):
        logged(tmp_path, config={"statistic": "none", "on_stored_id": "error"}, ids=list(range(24)))
    nnstat.finalize()


def test_resume_with_different_configuration_is_refused(tmp_path):
    logged(tmp_path, batches=[(0, 8)])
    with pytest.raises(ValueError, match=r"r_in: 2 -> 3"):
        logged(tmp_path, rank=3)
    with pytest.raises(ValueError, match="projection_sha256"):
        model, x, y = make()
        run = nnstat.init(project="p", root_dir=tmp_path)
        nnstat.watch(model)
        nnstat.add_projection(rank=2, seed=7)
        step(run, model, x[:4], y[:4])
    with pytest.raises(ValueError, match="dtype: 'float32' -> 'float16'"):
        logged(tmp_path, config={"statistic": "none", "dtype": "float16"})


def test_writer_failure_is_raised_at_next_run_or_finalize(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardFile, "commit", disk_full)
    model, x, y = make()
    run = nnstat.init(project="w", root_dir=tmp_path)
    nnstat.setup({"shard_rows": 4})
    nnstat.watch(model)
    step(run, model, x[:4], y[:4])  # fills one shard: the background write fails
    writer = run._logger.writer
    for _ in range(500):
        if writer._error is not None:
            break
        time.sleep(0.01)
    with pytest.raises(StoreWriteError, match="No space left") as info:
        step(run, model, x[4:8], y[4:8])  # raised in the training process at the next run(...)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(StoreWriteError, match="No space left"):
        nnstat.finalize()  # ... and at finalize()


def test_meta_is_written_by_the_writer_with_the_hash_of_the_saved_projections(tmp_path):
    import hashlib

    from safetensors.numpy import load_file

    run, *_ = logged(tmp_path)
    meta = json.loads((run.path / "meta.json").read_text())
    saved = load_file(str(run.path / "projections.safetensors"))
    h = hashlib.sha256()  # the recipe of meta.json's projection_sha256, over the file's arrays
    for name in sorted(saved):
        h.update(name.encode() + f"torch.{saved[name].dtype}{saved[name].shape}".encode())
        h.update(saved[name].tobytes())
    assert len(saved) == 4 and meta["projection_sha256"] == h.hexdigest()


def test_failure_to_save_projections_is_raised_and_no_shard_is_written(tmp_path, monkeypatch):
    from nnstat.store import meta as store_meta

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store_meta, "write_projections", read_only)
    model, x, y = make()
    run = nnstat.init(project="ro", root_dir=tmp_path)
    nnstat.setup({"shard_rows": 4})
    nnstat.watch(model)
    # the writer's first job (meta + projections) fails: raised by whichever of the next calls
    # into the store comes after the failure (the end of this block or the next run(...))
    with pytest.raises(StoreWriteError, match="Permission denied") as info:
        for lo in range(0, 24, 4):
            step(run, model, x[lo : lo + 4], y[lo : lo + 4])
            time.sleep(0.05)
    assert isinstance(info.value.__cause__, PermissionError)
    with pytest.raises(StoreWriteError, match="Permission denied"):
        nnstat.finalize()
    assert not list((run.path / "shards").glob("*.npy")) and not (run.path / "meta.json").exists()


def test_store_path_that_is_a_file_fails_in_the_caller(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "shards").write_text("a file where the shard directory should be")
    model, x, y = make()
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.watch(model)
    with pytest.raises(OSError):
        step(run, model, x[:4], y[:4])


def test_nonfinite_policy(tmp_path, rows_formed_in):
    model, x, y = make()
    x = x.clone()
    x[2, 0] = float("nan")
    run = nnstat.init(project="n", root_dir=tmp_path)
    nnstat.watch(model)
    if rows_formed_in == "device staging":
        # the flags are checked in the writer's thread once the rows' copy has landed: the
        # refusal comes at the next call, here finalize() (tests/run/test_run_device_path.py)
        step(run, model, x[:4], y[:4], ids=[0, 1, 2, 3])
        with pytest.raises(ValueError, match=r"ids \[2\] contain NaN/Inf"):
            nnstat.finalize()
    else:
        with pytest.raises(ValueError, match=r"ids \[2\] contain NaN/Inf"):
            step(run, model, x[:4], y[:4], ids=[0, 1, 2, 3])
        nnstat.finalize()
    run = nnstat.init(project="n2", root_dir=tmp_path)
    nnstat.setup({"nonfinite": "skip"})
    nnstat.watch(model)
    step(run, model, x[:4], y[:4], ids=[0, 1, 2, 3])
    nnstat.finalize()
    store = nnstat.GradientStore(run.path)
    assert store.ids == [0, 1, 3] and store.meta["skipped_rows"] == 1
    assert json.loads((run.path / "meta.json").read_text())["skipped_rows"] == 1


def test_unknown_setup_key_lists_valid_keys(tmp_path):
    nnstat.init(project="k", root_dir=tmp_path)
    with pytest.raises(
        ValueError, match="'statistics'.*valid keys:.*statistic.*nonfinite.*on_stored_id"
    ):
        nnstat.setup({"statistics": "kfac"})


def test_init_again_creates_a_new_current_run(tmp_path):
    a = nnstat.init(project="a", root_dir=tmp_path)
    b = nnstat.init(project="b", root_dir=tmp_path)
    assert a is not b and nnstat.run.current_run() is b


def test_eval_log_matches_store_and_new_process_reuses_projection(tmp_path):
    run, model, x, y = logged(tmp_path, config={"statistic": "kfac"})
    nnstat.eval()
    loader = nnstat.build_log_dataloader(batch_size=10)
    assert [len(i) for i, _ in loader] == [10, 10, 4]
    step(run, model, x[:5], y[:5], ids=["q0", "q1", "q2", "q3", "q4"])
    log = nnstat.get_log()
    store = nnstat.GradientStore(run.path)
    torch.testing.assert_close(log.rows, store.rows(0, 5))
    assert (
        log.ids == ["q0", "q1", "q2", "q3", "q4"] and log.meta["modules"] == store.meta["modules"]
    )
    assert set(log.statistics) == set(store.statistics()) and log.statistics
    # a fresh Run on the same store (e.g. another process) logs queries in the same space
    other = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.eval()  # before watch(): the projection still comes from the store
    nnstat.watch(model)
    step(other, model, x[:5], y[:5])
    fresh = nnstat.get_log()
    torch.testing.assert_close(fresh.rows, log.rows)
    for key in ("modules", "row_width", "projection", "projection_sha256", "format_version"):
        assert fresh.meta[key] == store.meta[key], key
    assert not (run.path / "shards" / "rank0-00001.npy").exists()  # eval wrote nothing


def test_train_switches_the_current_run_back_to_logging_rows_to_the_store(tmp_path):
    """nnstat.train() after nnstat.eval(): the next blocks are saved again, each row its
    sample's own gradient (torch.func), and the query block before it saved nothing."""
    from torch.func import functional_call, grad, vmap

    model, x, y = make()
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    nnstat.eval()
    step(run, model, x[:4], y[:4], ids=["q0", "q1", "q2", "q3"])
    log = nnstat.get_log()
    assert nnstat.train() is run and run.mode == "log"
    step(run, model, x[:8], y[:8], ids=list(range(8)))
    nnstat.finalize()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def own(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    ref = vmap(grad(own), in_dims=(None, 0, 0))(params, x[:8], y[:8])
    want = torch.cat(
        [torch.cat([ref[f"{m}.weight"], ref[f"{m}.bias"][:, :, None]], 2).flatten(1) for m in "02"],
        1,
    )
    store = nnstat.GradientStore(run.path)
    assert store.ids == list(range(8))  # the queries were not saved
    torch.testing.assert_close(store.rows(0, 8), want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(log.rows, want[:4], rtol=1e-4, atol=1e-6)


def test_ekfac_schedule_runs_two_passes_and_logs_in_the_second(tmp_path):
    model, x, y = make()
    run = nnstat.init(project="e", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    names = []
    for spec in run.schedule():
        names.append(spec.name)
        for lo in range(0, 24, 8):
            step(run, model, x[lo : lo + 8], y[lo : lo + 8], ids=list(range(lo, lo + 8)))
    assert names == ["factors", "eigenvalues"]
    store = nnstat.GradientStore(run.path)
    assert sorted(store.ids) == list(range(24))  # the second pass is not skipped as a resume
    assert {"0/ekfac/eigenvalues", "2/ekfac/eigenvalues"} <= set(store.statistics())


def test_a_short_data_id_is_named_as_the_likely_cause(tmp_path):
    """3 ids for a batch of 4 whose model input has 4 rows: the rows-vs-samples warning says
    the count given is off (not only "the model flattens its samples"), and the block raises."""
    model, x, y = make()
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.watch(model)
    with pytest.warns(UserWarning, match="rows in dim 0") as seen:
        with pytest.raises(ValueError, match="data_id has 3 entries but the batch has 4"):
            step(run, model, x[:4], y[:4], ids=[0, 1, 2])
    msg = next(str(w.message) for w in seen if "rows in dim 0" in str(w.message))
    assert "the model's first input also has 4 rows" in msg
    assert "one run(data_id=...) entry per sample" in msg
    nnstat.finalize()


def test_two_backward_passes_in_one_block_sum_per_position_and_warn_once(tmp_path):
    """Two forward/backward passes of 4 samples inside one run(...) block: each stored row is
    the sum of the two passes' per-sample gradients at its position (torch.func reference),
    with one warning naming the fix for passes over different samples; one pass per block
    does not warn."""
    from torch.func import functional_call, grad, vmap

    model, x, y = make()
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.watch(model)
    with pytest.warns(UserWarning, match="second backward pass") as seen:
        for ids, starts in (([0, 1, 2, 3], (0, 4)), ([4, 5, 6, 7], (8, 12))):
            with run(data_id=ids):
                for lo in starts:
                    nn.functional.cross_entropy(
                        model(x[lo : lo + 4]), y[lo : lo + 4], reduction="sum"
                    ).backward()
    assert sum("second backward pass" in str(w.message) for w in seen) == 1
    assert "its own run(...) block" in str(seen[0].message)
    nnstat.finalize()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi[None],))
        return nn.functional.cross_entropy(out, yi[None], reduction="sum")

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[:16], y[:16])
    per = torch.cat([g["2.weight"], g["2.bias"][:, :, None]], 2)  # [16, 3, 7]
    want = torch.cat([per[0:4] + per[4:8], per[8:12] + per[12:16]])
    log = nnstat.GradientStore(run.path).load()
    assert log.ids == list(range(8))
    torch.testing.assert_close(log.module_view("2"), want, rtol=1e-5, atol=1e-6)

    run2 = nnstat.init(project="q", root_dir=tmp_path)
    nnstat.watch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(run2, model, x[:4], y[:4], ids=[0, 1, 2, 3])
    nnstat.finalize()


def test_ekfac_by_hand_says_a_pass_is_left_and_matches_the_schedule(tmp_path):
    """One loop + finalize() under "ekfac" (as with "kfac") stores no rows: finalize() warns
    that pass 2 is left, the store's error names the fix, and the second loop gives the rows
    and eigenvalues schedule() gives."""
    model, x, y = make()
    stores = {}
    for how in ("schedule", "by hand"):
        run = nnstat.init(project=how.replace(" ", "_"), root_dir=tmp_path)
        nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac"})
        nnstat.watch(model)
        nnstat.add_projection(rank=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "schedule":
                for _ in run.schedule():
                    step(run, model, x, y, ids=list(range(24)))
            else:
                step(run, model, x, y, ids=list(range(24)))
                nnstat.finalize()
                left = [str(w.message) for w in caught if "pass 1 of 2" in str(w.message)]
                assert len(left) == 1 and "'eigenvalues'" in left[0]
                assert "run.schedule()" in left[0]
                with pytest.raises(FileNotFoundError, match=r"EK-FAC's first pass.*schedule\(\)"):
                    nnstat.build_log_dataloader()
                step(run, model, x, y, ids=list(range(24)))
                nnstat.finalize()
        assert not [w for w in caught if "is done;" in str(w.message)][(how == "by hand") :]
        stores[how] = nnstat.GradientStore(run.path)
    a, b = stores["schedule"], stores["by hand"]
    assert a.ids == b.ids == list(range(24))
    torch.testing.assert_close(b.load().rows, a.load().rows)
    for key in ("0/ekfac/eigenvalues", "2/ekfac/eigenvalues"):
        torch.testing.assert_close(b.statistics()[key], a.statistics()[key])


def test_param_grads_false_gives_same_rows_and_leaves_grads_untouched(tmp_path, rows_formed_in):
    rows = {}
    for pg in (True, False):
        model, x, y = make()
        flags = [p.requires_grad for p in model.parameters()]
        run = nnstat.init(project=f"pg{pg}", root_dir=tmp_path)
        nnstat.setup({"param_grads": pg})
        nnstat.watch(model)
        nnstat.add_projection(rank=2)
        step(run, model, x, y)
        with pytest.raises(RuntimeError, match="boom"):  # flags come back even on exceptions
            with run(data_id=[100]):
                raise RuntimeError("boom")
        assert [p.requires_grad for p in model.parameters()] == flags
        nnstat.finalize()
        rows[pg] = nnstat.GradientStore(run.path).rows(0, 24)
        grads = [p.grad for p in model.parameters()]
        assert all(g is None for g in grads) == (not pg)
    torch.testing.assert_close(rows[False], rows[True])


def test_full_gradient_size_checks(tmp_path, monkeypatch):
    model, x, y = make()
    run = nnstat.init(project="big", root_dir=tmp_path)
    nnstat.setup({"num_samples": 10**6, "size_budget_bytes": 10**6})
    nnstat.watch(model)
    with pytest.warns(UserWarning, match=r"about 228000000 bytes"):
        step(run, model, x[:2], y[:2])  # (6x6 + 3x7) floats x 4 bytes x 1e6 rows
    nnstat.finalize()
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    run = nnstat.init(project="big2", root_dir=tmp_path)
    nnstat.setup({"num_samples": 10**6})
    nnstat.watch(model)
    with pytest.raises(OSError, match="bytes free"):
        step(run, model, x[:2], y[:2])


def test_no_backward_inside_run_is_an_error(tmp_path):
    model, x, _ = make()
    run = nnstat.init(project="nb", root_dir=tmp_path)
    nnstat.watch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="loss.backward"):
            with run(data_id=[0]):
                model(x[:1])
        nnstat.finalize()


def test_module_run_is_callable_and_finalize_shows_progress_when_slow(
    tmp_path, monkeypatch, capsys
):
    real = ShardFile.commit

    def slow(*args, **kwargs):
        time.sleep(0.4)
        real(*args, **kwargs)

    monkeypatch.setattr(ShardFile, "commit", slow)
    for terminal in (True, False):
        # the bar shows on a terminal only (CI logs and batch jobs get no bar lines)
        monkeypatch.setattr(sys.stderr, "isatty", lambda terminal=terminal: terminal)
        model, x, y = make()
        run = nnstat.init(project=f"slow-{terminal}", root_dir=tmp_path)
        nnstat.setup({"shard_rows": 1})
        nnstat.watch(model)
        with nnstat.run(data_id=[1, 2, 3, 4]):  # the module itself works as the context manager
            nn.functional.cross_entropy(model(x[:4]), y[:4], reduction="sum").backward()
        nnstat.finalize()
        shown = "flushing gradient store" in capsys.readouterr().err
        assert shown == terminal
        assert nnstat.GradientStore(run.path).ids == [1, 2, 3, 4]


def test_setup_rank_is_the_default_projection(tmp_path):
    model, x, y = make()
    run = nnstat.init(project="r", root_dir=tmp_path)
    nnstat.setup({"rank": 2})
    nnstat.watch(model)
    step(run, model, x[:4], y[:4])
    nnstat.finalize()
    store = nnstat.GradientStore(run.path)
    assert [(m["r_out"], m["r_in"]) for m in store.modules] == [(2, 2), (2, 2)]
    assert store.meta["projection"]["rank"] == 2 and store.projections()


def test_every_store_file_gets_the_umask_mode_statistics_too(tmp_path, umask_027):
    model, x, y = make()
    run = nnstat.init(project="modes", root_dir=tmp_path / "logs")
    nnstat.setup({"statistic": "ekfac"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    for _ in run.schedule():
        step(run, model, x, y, ids=list(range(24)))
    names = {p.name for p in run.path.rglob("*")}
    assert {"statistics.safetensors", "statistics.json", "meta.json"} <= names
    assert not any(".tmp" in n for n in names)
    assert umask_027(run.path) == {}


def test_a_module_without_gradient_is_warned_about_once_and_stored_as_zeros(tmp_path):
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(5, 3), "unused": nn.Linear(5, 3)})
    x = torch.randn(6, 5)
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lo in (0, 3):
            with run(data_id=list(range(lo, lo + 3))):
                model["used"](x[lo : lo + 3]).pow(2).sum().backward()
        nnstat.finalize()
    messages = [str(w.message) for w in caught if "no gradient" in str(w.message)]
    assert len(messages) == 1 and "['unused']" in messages[0] and "zeros" in messages[0]
    store = nnstat.GradientStore(run.path)
    rows = store.rows(0, len(store))
    assert torch.count_nonzero(store.module_view(rows, "unused")) == 0
    assert torch.count_nonzero(store.module_view(rows, "used")) > 0
