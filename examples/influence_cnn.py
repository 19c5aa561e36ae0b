"""Influence functions on a small CNN: which training digits drove each wrong prediction, and
which training labels look wrong (self-influence).

    python examples/influence_cnn.py
    NNSTAT_EXAMPLE_QUICK=1 python examples/influence_cnn.py

Ten training labels are flipped on purpose; self-influence g_iᵀ(H+λI)⁻¹g_i ranks training
examples by how much the model had to bend to fit them, so the flipped ones should rank high.
Writes ``influence_cnn.png`` (each misclassified test digit beside its most helpful and most
harmful training digits).
"""

from __future__ import annotations

import os
import tempfile

import torch
from sklearn.datasets import load_digits
from torch import nn

import nnstat
import nnstat.plot as nplt

QUICK = os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc = nn.Linear(16 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.flatten(1))


def main() -> None:
    torch.manual_seed(0)
    images, labels = load_digits(return_X_y=True)
    X = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels)
    n = 200 if QUICK else 1400
    X_train, y_train, X_test, y_test = X[:n], y[:n].clone(), X[n : n + 200], y[n : n + 200]
    flipped = torch.randperm(n)[:10]
    y_train[flipped] = (y_train[flipped] + 1 + torch.randint(0, 9, (10,))) % 10

    model = CNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _epoch in range(1 if QUICK else 15):
        for idx in torch.randperm(n).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X_train[idx]), y_train[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(X_test).argmax(1)
    print(f"test accuracy {(pred == y_test).float().mean():.3f}")

    # logging: EK-FAC statistics + rank-8 projected per-sample gradients of the training set
    run = nnstat.init(project="cnn", root_dir=tempfile.mkdtemp(prefix="nnstat-cnn-"))
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac"})
    nnstat.watch(model)
    nnstat.add_projection(rank=8)
    for _ in run.schedule():
        for s in range(0, n, 100):
            with run(data_id=list(range(s, min(s + 100, n)))):
                out = model(X_train[s : s + 100])
                nn.functional.cross_entropy(out, y_train[s : s + 100], reduction="sum").backward()
            model.zero_grad()

    # analysis: the misclassified test digits, scored for the model's own prediction
    wrong = (pred != y_test).nonzero().flatten().tolist()[:8] or [0, 1, 2]
    nnstat.eval()
    with run(data_id=wrong):
        out = model(X_test[wrong])
        nn.functional.cross_entropy(out, pred[wrong], reduction="sum").backward()
    model.zero_grad()
    result = nnstat.influence.compute_influence_all(nnstat.get_log(), run.path)
    top = result.top_k(3)
    for q, test_id in enumerate(top.test_ids):
        helpful = ", ".join(f"#{i} ({int(y_train[i])})" for i in top.helpful_ids[q])
        print(
            f"test #{test_id}: true {int(y_test[test_id])}, predicted {int(pred[test_id])}; "
            f"most helpful training digits: {helpful}"
        )
    captions = [f"#{i}: {int(y_test[i])} → {int(pred[i])}" for i in wrong]
    fig = nplt.influence_figure(
        {i: X_test[i, 0] for i in wrong},
        X_train[:, 0],
        result,
        k=4,
        train_labels=y_train,
        query_captions=captions,
    )
    fig.savefig("influence_cnn.png")
    print("wrote influence_cnn.png")

    # self-influence of every training example: planted label flips should rank high
    self_inf = nnstat.influence.compute_self_influence(run.path)
    order = self_inf.scores.argsort(descending=True)
    top_ids = [self_inf.ids[i] for i in order[:30].tolist()]
    found = sorted(set(top_ids) & set(flipped.tolist()))
    print(
        f"{len(found)} of the 10 flipped labels are among the 30 highest self-influence "
        f"scores (of {n}; random ranking would find {10 * 30 / n:.1f})"
    )


if __name__ == "__main__":
    main()
