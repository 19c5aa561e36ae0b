"""Two-process gloo harness for the distributed tests: one home for the port, the process group's
set-up and teardown, and spawning the ranks.

Imported as ``from _dist import spawn`` (like ``_ledger``): pytest puts ``tests/`` on
``sys.path`` (its root ``conftest.py``, no ``__init__.py``), and spawned ranks inherit the
parent's path, so they import this module and the test module that holds their job.

* `spawn` runs ``job(rank, *args)`` in each of ``world`` processes inside `process_group`.
* `spawn_launched` runs ``job(rank, *args)`` with a launcher's environment (`rank_env`),
  for frameworks that set up the group themselves (HF's accelerate, Lightning).
* `launch` runs a script once per rank as a subprocess, with the same environment.

Example::

    def _job(rank: int, out_dir: str) -> None:  # a module-level function: spawn pickles it
        ...

    def test_two_ranks(tmp_path):
        spawn(_job, str(tmp_path))
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    """A TCP port free on this machine now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int, world: int = WORLD) -> dict[str, str]:
    """The environment a launcher gives one rank on one machine: what ``init_process_group``'s
    ``env://`` and the frameworks (accelerate, Lightning) read."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "NODE_RANK": "0",
    }


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int) -> Iterator[None]:
    """A gloo process group around the block. Left normally, it is torn down only once every
    rank is done and what holds the group is gone: destroying the group under a live DDP/FSDP
    reducer aborted a rank at exit (SIGABRT, "terminate called without an active exception")."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        gc.collect()  # the DDP reducer (which holds the group) goes before the group
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _in_group(rank: int, world: int, port: int, job: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    with process_group(rank, world, port):
        job(rank, *args)


def spawn(job: Callable[..., Any], *args: Any, world: int = WORLD) -> None:
    """Run ``job(rank, *args)`` in ``world`` spawned processes, each in a gloo process group
    (`process_group`); raises if a rank fails."""
    mp.spawn(_in_group, args=(world, free_port(), job, args), nprocs=world, join=True)


def _launched(rank: int, world: int, port: int, job: Callable[..., Any], args: tuple) -> None:
    os.environ.update(rank_env(rank, port, world))
    torch.set_num_threads(1)
    job(rank, *args)


def spawn_launched(job: Callable[..., Any], *args: Any, world: int = WORLD) -> None:
    """Run ``job(rank, *args)`` in ``world`` spawned processes with a launcher's environment
    (`rank_env`) and no process group: the framework inside sets it up."""
    mp.spawn(_launched, args=(world, free_port(), job, args), nprocs=world, join=True)


def launch(script: str, *argv: str, world: int = WORLD, timeout: float = 240) -> None:
    """Run ``python script *argv`` once per rank with a launcher's environment (`rank_env`);
    fails with the rank's stderr if one exits with an error."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script, *argv],
            env=dict(os.environ, **rank_env(rank, port, world)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
