"""`nnstat view` under a bounded loopback load: request latency p50/p99 with slow clients around.

Slow clients connect and send nothing (each holds a connection and a server thread); meanwhile
worker threads fetch ``api/data`` and the page as fast as they are answered. Run twice: with
http.server's defaults (listen backlog 5, no socket timeout: what `nnstat view` used before) and
with the viewer's (`BACKLOG`, `REQUEST_TIMEOUT`). Every request must be answered; the script
prints the counts and p50/p99/max latency of each. Not a test; CI never runs it (the test
``tests/viewer/test_viewer_load.py`` runs a smaller load with counts asserted, never timings).

    .venv/bin/python benchmarks/viewer_load.py [--idle 20] [--requests 500] [--threads 8]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nnstat.integrations import JsonlLogger

from nnstat.viewer.server import BACKLOG, REQUEST_TIMEOUT, _server


def folder(base: Path) -> Path:
    with JsonlLogger(base / "run") as log:
        for step in range(200):
            log.log({"train/loss": 1.0 / (step + 1), "lr": 0.1}, step=step)
    return base


def load(url: str, idle: int, requests: int, threads: int, burst: int) -> dict:
    """``idle`` silent connections held open, then ``requests`` GETs from ``threads`` workers
    (and ``burst`` connections opened at once before them); latencies in seconds."""
    port = int(url.rsplit(":", 1)[1].strip("/"))
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
    # a burst of simultaneous connects, as a browser opening many tabs does
    barrier = threading.Barrier(burst) if burst else None

    def one(i: int) -> tuple[float, int]:
        if barrier is not None and i < burst:
            barrier.wait()
        t0 = time.perf_counter()
        path = "api/data" if i % 2 else ""
        try:
            with urllib.request.urlopen(url + path, timeout=120) as r:
                r.read()
                code = r.status
        except OSError:
            code = -1
        return time.perf_counter() - t0, code

    try:
        with ThreadPoolExecutor(max(threads, burst)) as pool:
            if burst:
                burst_res = list(pool.map(one, range(burst)))
            else:
                burst_res = []
        with ThreadPoolExecutor(threads) as pool:
            res = burst_res + list(pool.map(one, range(burst, burst + requests)))
    finally:
        for s in slow:
            s.close()
    lat = sorted(t for t, _ in res)
    return {
        "answered": sum(code == 200 for _, code in res),
        "sent": len(res),
        "p50": statistics.median(lat),
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "max": lat[-1],
    }


def run(root: Path, label: str, backlog: int, timeout: float | None, args) -> None:
    srv = _server(root, 0, request_timeout=timeout, backlog=backlog)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/"
    try:
        r = load(url, args.idle, args.requests, args.threads, args.burst)
    finally:
        srv.shutdown()
        srv.server_close()
    print(
        f"{label:<34} answered {r['answered']}/{r['sent']}  p50 {1000 * r['p50']:7.1f} ms  "
        f"p99 {1000 * r['p99']:8.1f} ms  max {1000 * r['max']:8.1f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--idle", type=int, default=20, help="silent connections held open")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--burst", type=int, default=0, help="connections opened at once first")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = folder(Path(tmp))
        print(
            f"{args.idle} silent clients, {args.requests} requests from {args.threads} threads"
            + (f", after a burst of {args.burst} simultaneous connects" if args.burst else "")
        )
        run(root, "before: backlog 5, no timeout", 5, None, args)
        run(
            root,
            f"after: backlog {BACKLOG}, timeout {REQUEST_TIMEOUT:g} s",
            BACKLOG,
            REQUEST_TIMEOUT,
            args,
        )


if __name__ == "__main__":
    main()
