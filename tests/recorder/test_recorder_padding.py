"""The recorder's activation statistics of a padded embedding, against autograd and numpy.

A padded position (``padding_idx``) gives the embedding's weight no gradient, but its output
(a zero vector) is still an input of the next layer and its output gradient is still the loss's:
the recorder must show both as the model computed them, neither dropped nor zeroed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from nnstat.recorder import STAT_NAMES, Recorder, read_step_meta, read_step_stats


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4, padding_idx=0)
        self.lin = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids))


def _stats(x: np.ndarray) -> dict[str, float]:
    x = x.astype(np.float64).ravel()
    return {
        "mean": x.mean(),
        "norm": np.sqrt((x * x).sum()),
        "abs_max": np.abs(x).max(),
        "numel": x.size,
    }


def test_padded_embedding_activations_and_gradients_match_autograd(tmp_path) -> None:
    torch.manual_seed(0)
    model = Tagger()
    ids = torch.randint(1, 12, (5, 7))
    ids[:, 4:] = 0  # padded tails
    ids[1, 0] = 0
    y = torch.randint(0, 3, (5, 7))
    rec = Recorder(tmp_path, every=1, sample_k=5)
    rec.track_module(model)
    assert rec.track_activations(model, loss_reduction="mean") == ["emb", "lin"]
    rec.start_batch(0)
    out = rec.register_tensor("out", model(ids), role="output")
    loss = nn.functional.cross_entropy(out.reshape(-1, 3), y.reshape(-1))
    rec.register_tensor("loss", loss, role="loss")
    loss.backward()
    rec.finish_batch()
    rec.close()

    # the references: the embedding's output and the loss's gradient w.r.t. it, by autograd
    e = model.emb(ids).detach().requires_grad_(True)
    (ge,) = torch.autograd.grad(
        nn.functional.cross_entropy(model.lin(e).reshape(-1, 3), y.reshape(-1)), e
    )
    assert ge[ids == 0].abs().max() > 0  # padded positions do have an output gradient
    meta = read_step_meta(rec.path)[0]
    table = read_step_stats(rec.path, "train-000000000")
    r = meta["rows"]
    col = {s: i for i, s in enumerate(STAT_NAMES)}

    def row(tensor: str, stream: str, sample: int = -1) -> np.ndarray:
        for i in range(len(r["tensor"])):
            if (r["tensor"][i], r["stream"][i], r["sample"][i]) == (tensor, stream, sample):
                return table[i]
        raise KeyError((tensor, stream, sample))

    checks = [
        ("lin:input", "forward", e.detach().numpy()),
        ("emb:output", "gradient", ge.numpy()),
    ]
    for tensor, stream, ref in checks:
        for sample in (-1, 1):
            want = _stats(ref if sample < 0 else ref[sample])
            got = row(tensor, stream, sample)
            for k, v in want.items():
                np.testing.assert_allclose(got[col[k]], v, rtol=1e-5, atol=1e-8, err_msg=k)
