"""Causes: the root causes the detectors of one run have named, so that one cause makes one finding."""

from __future__ import annotations

#: a cause named this many steps ago or less still explains what the other detectors see
QUIET_STEPS = 100

#: the learning rate is too high (named by ``learning_rate`` or by ``loss_spike``'s divergence)
LR_HIGH = "learning_rate_high"
#: the learning rate is too low (named by ``learning_rate``)
LR_LOW = "learning_rate_low"
#: the gradient norm exploded (named by ``exploding``): a large update on that step is its consequence
EXPLOSION = "explosion"


class Causes:
    """Shared by the detectors that one :func:`gradwatch.detectors.build` call makes.

    A detector that names a root cause notes it; another detector that sees a consequence of
    the same cause (a loss that diverges because the learning rate is too high, after the
    update-to-weight ratio already named it) asks whether it was named and stays quiet. The
    detectors are called in the same order live and when a stored run is re-judged offline, so
    both reach the same findings. A detector built on its own has a private one.
    """

    def __init__(self) -> None:
        self._named: dict[str, int] = {}

    def note(self, cause: str, step: int) -> None:
        """``cause`` was named by a finding at ``step``."""
        self._named[cause] = step

    def named(self, cause: str, step: int, within: int = QUIET_STEPS) -> bool:
        """Whether ``cause`` was named at most ``within`` steps before ``step``."""
        last = self._named.get(cause)
        return last is not None and 0 <= step - last <= within
