"""When to record: every N steps with back-off, fixed step lists, retroactive decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from nnstat.curvature.passes import check_keys, keyword_checked


@keyword_checked("schedule")
@dataclass(frozen=True)
class Schedule:
    """Recording rule of one ``type_of_execution``.

    Steps ``t_0 = start``, ``t_{k+1} = t_k + min(max_every, round(every * backoff**k))`` are
    recorded, plus every step in ``steps``. ``every=None`` disables the periodic part. With
    ``retroactive=True`` every batch is captured provisionally so that
    ``Recorder.decide_recording_of_batch`` can still decide to keep it at the end of the step.

    Example:
        >>> s = Schedule(every=1, backoff=2.0)
        >>> [t for t in range(20) if s.is_scheduled(t)]
        [0, 1, 3, 7, 15]
    """

    every: int | None = 100
    backoff: float = 1.0
    max_every: int | None = None
    start: int = 0
    steps: tuple[int, ...] = ()
    retroactive: bool = False
    _cache: dict[int, bool] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.every is not None and (not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"Schedule.every must be a positive int or None, got {self.every!r}")
        if not math.isfinite(self.backoff) or self.backoff < 1.0:
            raise ValueError(f"Schedule.backoff must be a finite number >= 1, got {self.backoff!r}")
        if self.max_every is not None and self.max_every < 1:
            raise ValueError(f"Schedule.max_every must be >= 1 or None, got {self.max_every!r}")
        object.__setattr__(self, "steps", tuple(sorted({int(s) for s in self.steps})))

    def is_scheduled(self, step: int) -> bool:
        """True when ``step`` is recorded by this schedule (pure function of ``step``)."""
        if step in self.steps:
            return True
        if self.every is None or step < self.start:
            return False
        if self.backoff == 1.0:
            return (step - self.start) % min(self.every, self.max_every or self.every) == 0
        hit = self._cache.get(step)
        if hit is None:
            hit = step in _periodic_steps(self, step)
            if len(self._cache) < 4096:
                self._cache[step] = hit
        return hit


def _periodic_steps(s: Schedule, upto: int) -> set[int]:
    out, t, k = set(), s.start, 0
    while t <= upto:
        out.add(t)
        gap = max(1, round(s.every * s.backoff**k)) if s.every else 1
        if s.max_every is not None:
            gap = min(gap, s.max_every)
        t, k = t + gap, k + 1
    return out


def make_schedule(spec: Schedule | dict | int | None) -> Schedule:
    """Normalise a user value (Schedule, dict of its fields, int ``every``, None = never).

    Example:
        >>> make_schedule({"every": 10, "steps": [3]}).is_scheduled(3)
        True
    """
    if isinstance(spec, Schedule):
        return spec
    if spec is None:
        return Schedule(every=None)
    if isinstance(spec, int):
        return Schedule(every=spec)
    if isinstance(spec, dict):
        check_keys("schedule", spec, (f.name for f in fields(Schedule)))
        return Schedule(**spec)
    raise TypeError(f"schedule must be a Schedule, dict, int or None, got {type(spec).__name__}")


def schedule_json(s: Schedule) -> dict[str, Any]:
    return {
        "every": s.every,
        "backoff": s.backoff,
        "max_every": s.max_every,
        "start": s.start,
        "steps": list(s.steps),
        "retroactive": s.retroactive,
    }
