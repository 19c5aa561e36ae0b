"""The recorder finds a planted bug: training goes NaN, and the first non-finite tensor is named.

    python examples/recorder_planted_bug.py
    NNSTAT_EXAMPLE_QUICK=1 python examples/recorder_planted_bug.py
    nnstat view nnstat-recorder-example      # then browse the recorded steps locally

The model normalises each image by its norm. A few training images are blank (all zeros), so
0/0 turns the normalised image into NaN the first time a batch contains one; from then on the
weights are NaN too. The recorder watches every step for non-finite values (a cheap on-device
check), records the offending step in full, and names the earliest tensor in the dependency
graph that turned non-finite: the normalised input, not the loss where NaN is usually noticed.
The fixed model (``eps`` in the norm) runs as a second trial for comparison in the viewer.
"""

from __future__ import annotations

import os

import torch
from sklearn.datasets import load_digits
from torch import nn

from nnstat.recorder import Recorder, correlate, nonfinite

QUICK = os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")
ROOT = "nnstat-recorder-example"


class Net(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, rec: Recorder) -> torch.Tensor:
        x = rec.register_tensor("image", x, role="input")
        x = rec.register_tensor("normalized", x / (x.norm(dim=1, keepdim=True) + self.eps))
        h = rec.register_tensor("hidden", torch.relu(self.fc1(x)))
        return rec.register_tensor("logits", self.fc2(h), role="output")


def train(trial: str, eps: float, X: torch.Tensor, y: torch.Tensor, steps: int) -> dict | None:
    torch.manual_seed(0)
    model = Net(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rec = Recorder(ROOT, group="digits", trial=trial, every=25, rules=[nonfinite()], overwrite=True)
    rec.track_module(model)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        idx = torch.randint(0, len(X), (32,), generator=g)
        rec.start_batch(step)
        target = rec.register_tensor("target", y[idx], role="target")
        loss = nn.functional.cross_entropy(model(X[idx], rec), target)
        rec.register_tensor("loss", loss, role="loss")
        opt.zero_grad()
        loss.backward()
        rec.record_kpi("loss", loss.detach())
        record = rec.finish_batch()
        opt.step()
        if record and record.get("first_offender"):
            rec.close()
            return {"step": step, **record["first_offender"]}
    rec.close()
    return None


def main() -> None:
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X, dtype=torch.float32) / 16.0, torch.tensor(y)
    X[torch.randperm(len(X), generator=torch.Generator().manual_seed(0))[:8]] = 0.0  # the bug
    steps = 60 if QUICK else 400
    found = train("buggy", 0.0, X, y, steps)
    if found is None:
        print(f"no non-finite value in {steps} steps")
    else:
        print(f"step {found['step']}: first non-finite tensor: {found}")
    fixed = train("fixed", 1e-6, X, y, steps)
    print("fixed trial:", "clean" if fixed is None else f"still broken: {fixed}")
    table = correlate(ROOT)
    if len(table):
        print(table.head(5).to_string(index=False))
    print(f"browse the recorded steps: nnstat view {ROOT}")


if __name__ == "__main__":
    main()
