"""The constructor and ``.grad`` guards the HuggingFace and Lightning ``NNStatCallback`` share,
around the framework-neutral `nnstat.integrations._hooks.StepStats` driver.

Example:
    >>> cb = StatsCallbackBase(stats=["l2"], noise_scale=False)
    >>> type(cb.hooks).__name__
    'StepStats'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from nnstat.integrations._hooks import StatsOptions, StepStats

__all__ = ["StatsCallbackBase"]


class StatsCallbackBase:
    """The constructor the HuggingFace and Lightning ``NNStatCallback`` share.

    It validates the options (see :class:`StatsOptions`), builds the :class:`StepStats` driver
    and then calls :meth:`_init_state` for the framework's own bookkeeping.
    ``noise_scale_every=None`` (the default) takes the class's `default_noise_scale_every`, so a
    subclass changes that default without repeating this signature.

    Example:
        >>> cb = StatsCallbackBase(stats=["l2"], noise_scale=False)
        >>> cb.options.stats, type(cb.hooks).__name__, cb.options.noise_scale_every
        (['l2'], 'StepStats', 1)
    """

    #: ``noise_scale_every`` when the constructor gets ``None``: every micro-batch (Lightning)
    default_noise_scale_every: ClassVar[int] = 1

    def __init__(
        self,
        *,
        stats: Sequence[str] | str | None = ("l2", "rms", "abs_max", "nonfinite"),
        groups: Sequence[str] = ("weight", "grad", "optimizer", "update"),
        include: str | None = None,
        exclude: str | None = None,
        every: int | None = None,
        noise_scale: bool = True,
        noise_scale_method: str = "auto",
        noise_scale_beta: float = 0.9,
        noise_scale_filter: str | None = None,
        noise_scale_every: int | None = None,
        noise_scale_window: int | None = None,
    ) -> None:
        from nnstat.describe import validate_stats

        if noise_scale_every is None:
            noise_scale_every = self.default_noise_scale_every
        self.options = StatsOptions(
            stats=list(validate_stats(stats)),
            groups=list(groups),
            include=include,
            exclude=exclude,
            every=every,
            noise_scale=noise_scale,
            noise_scale_method=noise_scale_method,
            noise_scale_beta=noise_scale_beta,
            noise_scale_filter=noise_scale_filter,
            noise_scale_every=noise_scale_every,
            noise_scale_window=noise_scale_window,
        )
        self.hooks = StepStats(self.options)
        self._init_state()

    def _init_state(self) -> None:
        """Framework-specific attributes; subclasses override."""

    def _measure_before(self, obj: Any, name: str) -> bool:
        """Wrap ``obj``'s method ``name`` on the instance so that the step is measured
        (:meth:`StepStats.before_clip`, ``.grad`` as the backwards left it) right before the
        framework's call that changes ``.grad`` (a clip, an AMP unscale). Returns whether it
        was wrapped now (``False``: no such method, or wrapped by this callback already)."""
        method = getattr(obj, name, None)
        if method is None or getattr(method, "_nnstat_owner", None) is self:
            return False
        before = self.hooks.before_clip

        def measured(*args: Any, **kwargs: Any) -> Any:
            before()
            return method(*args, **kwargs)

        measured._nnstat_owner = self  # type: ignore[attr-defined]
        setattr(obj, name, measured)
        return True

    def _unmeasure(self, obj: Any, name: str) -> None:
        """Undo :meth:`_measure_before` (the class's method again) if this callback wrapped it."""
        wrapped = vars(obj).get(name) if obj is not None else None
        if getattr(wrapped, "_nnstat_owner", None) is self:
            delattr(obj, name)
