"""The callbacks' noise scale in a training checkpoint: a small JSON file per process next to
the framework's own files, so that a resumed run continues the estimate where the checkpoint's
run left it (its averages, estimator, watched modules and cadence) instead of starting afresh.

JSON, not pickle: the file holds `nnstat.NoiseScale.state_dict` (floats and lists) and the
driver's few settings (`nnstat.integrations._hooks.StepStats.noise_scale_state`).

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> path = save_state(folder, {"micro": 3}, step=4, rank=0, world=1)
    >>> os.path.basename(path), load_state(folder, step=4, rank=0, world=1)
    ('nnstat_noise_scale.json', {'micro': 3})
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["load_state", "restore_into", "save_state", "state_file"]

FORMAT = "nnstat.noise_scale.checkpoint"


def state_file(folder: str, rank: int, world: int) -> str:
    """The process's file in a checkpoint folder (one per process: under DDP each rank's
    micro-batch estimate is its own).

    Example:
        >>> state_file("ckpt", 0, 1), state_file("ckpt", 1, 2)
        ('ckpt/nnstat_noise_scale.json', 'ckpt/nnstat_noise_scale_1.json')
    """
    name = "nnstat_noise_scale.json" if world <= 1 else f"nnstat_noise_scale_{rank}.json"
    return os.path.join(folder, name)


def save_state(folder: str, state: Mapping[str, Any], step: int, rank: int, world: int) -> str:
    """Write ``state`` (`StepStats.noise_scale_state`) of the checkpoint at ``step``.

    Returns:
        The file written.
    """
    os.makedirs(folder, exist_ok=True)
    path = state_file(folder, rank, world)
    payload = {"format": FORMAT, "version": 1, "step": int(step), "state": dict(state)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    return path


def load_state(folder: str, step: int, rank: int, world: int) -> dict[str, Any] | None:
    """The state saved in the checkpoint ``folder`` at ``step``; ``None`` with a warning when
    there is none or it is not that checkpoint's (the noise scale then starts afresh).

    Raises:
        ValueError: the file is not a noise-scale checkpoint file this version can read.
    """
    path = state_file(folder, rank, world)
    if not os.path.isfile(path):
        warnings.warn(
            f"nnstat: the checkpoint {folder} holds no noise-scale state ({os.path.basename(path)}"
            ": saved without nnstat, or by an older version), so the noise scale starts afresh "
            "and averages only the resumed steps",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    with open(path, encoding="utf-8") as f:
        payload = json.load(f)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not an nnstat noise-scale checkpoint file; remove it")
    if payload.get("version") != 1:
        raise ValueError(
            f"{path} has noise-scale checkpoint version {payload.get('version')!r}; this nnstat "
            "reads version 1: upgrade nnstat, or remove the file to start the noise scale afresh"
        )
    if payload.get("step") != step:
        warnings.warn(
            f"nnstat: {path} was saved at step {payload.get('step')}, but training resumes at "
            f"step {step}: the noise scale starts afresh",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return dict(payload["state"])


def restore_into(gns: Any, state: Mapping[str, Any], method: str) -> bool:
    """Load a checkpoint's noise-scale averages into a new `nnstat.NoiseScale` of the estimator
    ``method``; a checkpoint of another estimator or averaging (the options changed) is left
    out with a warning, and the noise scale starts afresh.

    Returns:
        Whether the averages were restored.
    """
    reason = None
    if state.get("method") != method:
        reason = f"it was measured by the {state.get('method')!r} estimator, now {method!r}"
    else:
        try:
            gns.load_state_dict(state["noise_scale"])
        except ValueError as e:
            reason = str(e)
    if reason is not None:
        warnings.warn(
            f"nnstat: the checkpoint's noise scale is not continued ({reason}); it starts "
            "afresh. Resume with the options of the checkpoint's run to continue it",
            RuntimeWarning,
            stacklevel=4,
        )
    return reason is None
