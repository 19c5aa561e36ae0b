"""Lightning: layer statistics and the noise scale through the Trainer's loggers, then
influence with the module's own ``training_step`` as the loss.

    python examples/lightning_module.py
    NNSTAT_EXAMPLE_QUICK=1 python examples/lightning_module.py
"""

from __future__ import annotations

import os
import tempfile

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from nnstat.integrations.lightning import NNStatCallback, extract_log, influence, self_influence
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

QUICK = os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")


class Digits(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    torch.manual_seed(0)
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X, dtype=torch.float32) / 16.0, torch.tensor(y)
    n = 300 if QUICK else 1500
    train, test = TensorDataset(X[:n], y[:n]), TensorDataset(X[n:], y[n:])
    out = tempfile.mkdtemp(prefix="nnstat-lightning-")
    module = Digits()
    stats = NNStatCallback(stats=["l2", "rms"], every=5)
    trainer = L.Trainer(
        max_epochs=1 if QUICK else 10,
        callbacks=[stats],
        logger=CSVLogger(out),
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not QUICK,
    )
    trainer.fit(module, DataLoader(train, batch_size=32, shuffle=True))
    last = stats.history[-1]
    print(
        f"step {last['step']}: trust_ratio(net.0.weight) {last['trust_ratio/net.0.weight']:.1f}, "
        f"B_simple {last['noise_scale/b_simple']:.1f}; metrics in {trainer.logger.log_dir}"
    )

    # influence: the training loader must not shuffle, so positions name dataset rows
    run = extract_log(
        trainer, module, DataLoader(train, batch_size=100), project="digits", root_dir=out, rank=16
    )
    module.eval()
    with torch.no_grad():
        pred = module.net(test.tensors[0]).argmax(1)
    wrong = (pred != test.tensors[1]).nonzero().flatten()[:5]
    queries = TensorDataset(test.tensors[0][wrong], test.tensors[1][wrong])
    top = influence(trainer, module, DataLoader(queries, batch_size=5), run, top_k=3)
    for q, helpful in enumerate(top.helpful_ids):
        labels = [int(train.tensors[1][i]) for i in helpful]
        print(
            f"misclassified test digit (true {int(queries.tensors[1][q])}, predicted "
            f"{int(pred[wrong[q]])}): training labels most helpful to its true label {labels}"
        )
    scores = self_influence(trainer, module, run).scores
    print(f"training digits with the highest self-influence: {scores.argsort()[-5:].tolist()}")


if __name__ == "__main__":
    main()
