"""The one retry pacing of the daemon: exponential backoff with jitter.

Each `next()` gives the delay before the next attempt: `initial`, doubled after every attempt up to
`maximum`, each multiplied by a random factor drawn from `jitter` so that many daemons restarted by
the same event (a runtime or kubelet restart on every node) do not come back in lockstep. `reset()`
after a success starts again from `initial`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    initial: float
    maximum: float
    factor: float = 2.0
    # The delay is multiplied by a factor drawn uniformly from this range.
    jitter: tuple[float, float] = (0.8, 1.2)
    rng: random.Random = field(default_factory=random.Random, repr=False)
    # Doublings so far; it stops growing once `maximum` is reached.
    steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"backoff needs 0 < initial ({self.initial}) <= maximum ({self.maximum})")
        low, high = self.jitter
        if not 0 < low <= high:
            raise ValueError(f"backoff jitter {self.jitter} must be a range of positive factors")

    @property
    def base(self) -> float:
        """The delay before jitter that the next `next()` draws around."""
        return min(self.initial * self.factor**self.steps, self.maximum)

    def next(self) -> float:
        """The delay to wait now; the one after it is longer (up to `maximum`)."""
        base = self.base
        if base < self.maximum:
            self.steps += 1
        return base * self.rng.uniform(*self.jitter)

    def reset(self) -> None:
        self.steps = 0
