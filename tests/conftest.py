"""Shared fixtures."""

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # the fused row kernels (nnstat.describe.triton_rows) are tested on CPU under Triton's
    # interpreter, which must be chosen before triton is first imported; a test opts in with
    # NNSTAT_TRITON=interpret (elsewhere nothing changes: CPU tensors never take that path)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# W&B writes offline runs (HF Trainer's report_to, the seeds' wandb.log examples) into ./wandb
# unless told otherwise: tests leave the working tree as they found it
os.environ.setdefault("WANDB_DIR", tempfile.mkdtemp(prefix="nnstat-tests-wandb-"))
os.environ.setdefault("WANDB_MODE", "offline")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # under pytest-xdist (-n N) every worker is its own process: one torch thread each, so N
    # workers do not fight over the cores (tests are small: one thread is fastest anyway)
    torch.set_num_threads(1)


@pytest.fixture(params=["training thread", "writer thread", "device staging"])
def rows_formed_in(request, monkeypatch):
    """Run a logging test with rows formed on either side of the writer queue, or as on an
    accelerator.

    The store forms one-position outer-product rows in its writer thread only when torch leaves
    a core idle (``nnstat.store.outer.idle_core``); on an accelerator the Run stages every
    module's rows in one device buffer, copied to the host once per block
    (``nnstat.run.rows.on_accelerator``, forced here on the CPU). All must store the same rows.
    """
    from nnstat.run import rows
    from nnstat.store import outer

    monkeypatch.setattr(outer, "idle_core", lambda: request.param == "writer thread")
    if request.param == "device staging":
        monkeypatch.setattr(rows, "on_accelerator", lambda device: True)
    return request.param


@pytest.fixture
def run_python(tmp_path):
    """``run_python(*args, **kw)``: ``subprocess.run([python, *args], **kw)`` from `tmp_path`.

    A child started with ``-c`` or ``-m`` puts its working directory first on its path; from
    the repository root that is the source tree, not the nnstat this process imported (an
    installed wheel, where the tests run against one: the source tree lacks the
    ``nnstat.integrations`` mapping that installing makes).
    """

    def run(*args: str, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("cwd", tmp_path)
        return subprocess.run([sys.executable, *args], **kw)

    return run


@pytest.fixture
def umask_027(tmp_path):
    """Run a test under umask 027 (not the usual 022, so a file created with a fixed mode
    stands out); yields ``files_with_other_modes(root)``: ``{relative path: mode}`` of each
    file under ``root`` whose mode is not the one a file created with ``open()`` gets."""
    old = os.umask(0o027)
    try:
        reference = tmp_path / "umask-reference"
        reference.write_bytes(b"")
        expected = stat.S_IMODE(reference.stat().st_mode)
        reference.unlink()
        assert expected == 0o640

        def files_with_other_modes(root):
            root = Path(root)
            modes = {
                str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")
            }
            return {
                p: oct(m) for p, m in modes.items() if not (root / p).is_dir() and m != expected
            }

        yield files_with_other_modes
    finally:
        os.umask(old)
