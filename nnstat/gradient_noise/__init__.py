"""nnstat.gradient_noise: the gradient noise scale, to choose a batch size (McCandlish et al., 2018).

`noise_scale` estimates ``B_simple = tr(Σ) / |G|²`` from a model, a loss and data (two batch
sizes, per-sample gradients, or a fit over several sizes; optionally the Hessian-weighted
``B_noise``); `NoiseScale` tracks it while training (per step, per layer, or for free from DDP's
all-reduce); `critical_batch_size` measures what they predict from a batch-size sweep
(steps to a target loss per batch size, e.g. from `steps_to_target` on each run's history). The
function is exported as ``nnstat.noise_scale``; this package is named
``gradient_noise`` so that it does not shadow it (``nnstat.gns`` is its deprecated old name).

Example:
    >>> from nnstat.gradient_noise import NoiseScale
    >>> ns = NoiseScale(beta=0.0)  # |G|^2 = 1, tr(Sigma) = 4 seen at batch sizes 1 and 4
    >>> ns.update(g_small_sq=1.0 + 4.0 / 1, g_big_sq=1.0 + 4.0 / 4, b_small=1, b_big=4)
    >>> ns.value
    4.0
"""

from nnstat.gradient_noise.batches import BatchSource
from nnstat.gradient_noise.critical import CriticalBatchSize, critical_batch_size, steps_to_target
from nnstat.gradient_noise.ddp import (
    DDPNoiseScaleState,
    DDPStepNorms,
    noise_scale_comm_hook,
    register_noise_scale_hook,
)
from nnstat.gradient_noise.estimate import noise_scale
from nnstat.gradient_noise.hessian import HessianNoiseScale, hessian_noise_scale
from nnstat.gradient_noise.result import LayerNoiseScale, NoiseScaleResult
from nnstat.gradient_noise.streaming import NoiseScale

__all__ = [
    "BatchSource",
    "CriticalBatchSize",
    "DDPNoiseScaleState",
    "DDPStepNorms",
    "HessianNoiseScale",
    "LayerNoiseScale",
    "NoiseScale",
    "NoiseScaleResult",
    "critical_batch_size",
    "hessian_noise_scale",
    "noise_scale",
    "noise_scale_comm_hook",
    "register_noise_scale_hook",
    "steps_to_target",
]
